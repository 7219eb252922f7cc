"""Every docs page's blocks run after exactly the install line the page gives, in a fresh
virtual environment (issue 48, item 2): the README's main line (``pip install -c
constraints.txt -e .``: no optional extras) for the README and the pages that give none,
and a page's own ``pip install -c constraints.txt -e '.[...]'`` for a page that gives one
(``docs/ray.md``: ``[all]``). Slow: each environment installs jax and the page's extras,
and ``docs/ray.md`` starts Ray clusters. ``python -m pytest -m slow tests/test_docs_install.py``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from test_docs import BLOCKS, DOCS, REPO, _trim

pytestmark = pytest.mark.slow

README_INSTALL = "pip install -c constraints.txt -e ."
PAGE_INSTALL = re.compile(r"pip install -c constraints\.txt -e '\.\[[\w,]+\]'")


def page_install(page: pathlib.Path) -> str:
    """The install line a page gives its readers (the README's main line where it gives
    none; the README's test command installs the test extra, not for readers)."""
    if page.name == "README.md":
        return README_INSTALL
    m = PAGE_INSTALL.search(page.read_text(encoding="utf-8"))
    return m.group(0) if m else README_INSTALL


_VENVS: dict[str, pathlib.Path] = {}


def _venv(install: str, root: pathlib.Path) -> pathlib.Path:
    """A fresh venv (one per install line in this session) where ``install`` ran."""
    if install not in _VENVS:
        venv = root / f"venv{len(_VENVS)}"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        done = subprocess.run(["bash", "-c", install.replace("pip install", "pip install -q")],
                              cwd=REPO, env=_env(venv), capture_output=True, text=True,
                              timeout=1800)
        assert done.returncode == 0, f"{install}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        _VENVS[install] = venv
    return _VENVS[install]


def _env(venv: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RAY_ADDRESS", "PYTHONPATH",
                        "VIRTUAL_ENV")}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONUNBUFFERED"] = "1"
    return env


PAGES = {page.name: page for page in DOCS}


@pytest.mark.parametrize("bid,lang,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs_after_its_pages_install_line(bid, lang, code, tmp_path_factory):
    page = PAGES[bid.split(":")[0]]
    venv = _venv(page_install(page), tmp_path_factory.getbasetemp())
    code, _ = _trim(code)
    scratch = tmp_path_factory.mktemp("block")
    if lang == "python":
        (scratch / "block.py").write_text(code, encoding="utf-8")
        cmd, cwd = [str(venv / "bin" / "python"), str(scratch / "block.py")], scratch
    else:
        cmd, cwd = ["bash", "-euo", "pipefail", "-c", code], REPO
    out = subprocess.run(cmd, cwd=cwd, env=_env(venv), capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, (f"{bid} after `{page_install(page)}` exited with "
                                 f"{out.returncode}\n--- stdout\n{out.stdout[-3000:]}\n"
                                 f"--- stderr\n{out.stderr[-4000:]}")


def test_each_page_gives_an_install_line_that_exists():
    assert page_install(REPO / "README.md") == README_INSTALL
    assert page_install(REPO / "docs" / "ray.md") == "pip install -c constraints.txt -e '.[all]'"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert README_INSTALL + " && rhino demo" in readme
