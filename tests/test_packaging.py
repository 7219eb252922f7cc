"""Packaging: the wheel holds every module of the source tree, and the CI smoke check fails
when one is missing."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SMOKE = REPO / ".ci" / "wheel_smoke.py"


def _setup_module():
    spec = importlib.util.spec_from_file_location("rhino_setup", REPO / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)      # setup() itself runs only as __main__
    return mod


def test_discovery_finds_every_package_of_the_tree():
    found = set(_setup_module().discover_packages(REPO))
    on_disk = set()
    for folder, pkg in (("rhino", "rhino"), ("hlo_passes", "rhino.hlo_passes"),
                        ("runtime", "rhino.runtime")):
        for init in (REPO / folder).rglob("__init__.py"):
            on_disk.add(".".join((pkg, *init.parent.relative_to(REPO / folder).parts)))
    assert found == on_disk and {"rhino.planner", "rhino.pipeline", "rhino.models"} <= found


def test_a_folder_of_modules_without_init_stops_the_build(tmp_path):
    for folder in ("rhino", "hlo_passes", "runtime"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "rhino" / "newpart").mkdir()
    (tmp_path / "rhino" / "newpart" / "thing.py").write_text("")
    with pytest.raises(SystemExit, match=r"rhino/newpart holds Python modules but no "
                                         r"__init__.py"):
        _setup_module().discover_packages(tmp_path)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    return next(out.glob("rhino-*.whl"))


def test_the_wheel_holds_every_module(wheel):
    out = subprocess.run([sys.executable, str(SMOKE), "--wheel", str(wheel), "--contents-only"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "holds all" in out.stdout


def test_the_smoke_check_fails_when_a_subpackage_is_left_out(wheel, tmp_path):
    """What `.ci/run` would have said of the old hand-written package list, which forgot
    rhino.planner."""
    stripped = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stripped, "w") as dst:
        for item in src.infolist():
            if not item.filename.startswith("rhino/planner/"):
                dst.writestr(item, src.read(item))
    out = subprocess.run([sys.executable, str(SMOKE), "--wheel", str(stripped),
                          "--contents-only"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "lacks" in out.stderr and "rhino.planner.api" in out.stderr, out.stderr
