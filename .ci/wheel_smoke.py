"""CI: build rhino's wheel, install it (not editable) into a new virtual environment, and use
it from outside the source tree.

1. Every module in the source tree (``rhino/``, ``hlo_passes/`` -> ``rhino.hlo_passes``,
   ``runtime/`` -> ``rhino.runtime``) must be in the wheel: found by walking the tree here,
   independently of ``setup.py``'s own discovery.
2. In a new venv (``pip install WHEEL[models] -c constraints.txt``), from a folder outside the
   checkout: every module imports, from site-packages; ``rhino --version`` answers;
   ``rhino plan gpt:layers=4,hidden=256 --cluster 2x4 --json`` prints valid JSON.
3. Without extras (``[models]`` only): Ray, matplotlib and orbax are not installed; an SPMD
   step runs and equals ``jax.jit``; ``rhino.init``, a timeline PNG and a checkpoint each
   raise an error naming the extra to install (``[ray]``, ``[plots]``, ``[checkpoint]``).

Usage: ``python3 .ci/wheel_smoke.py`` (builds the wheel), or ``--wheel FILE`` to check a
given wheel, or ``--contents-only`` to stop after step 1. Exit 1 with the reason on failure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import zipfile

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = {"rhino": "rhino", "hlo_passes": "rhino.hlo_passes", "runtime": "rhino.runtime"}
PLAN = ["plan", "gpt:layers=4,hidden=256", "--cluster", "2x4", "--json"]
OPTIONAL = """
import importlib.util, os, tempfile
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
for name in ("ray", "matplotlib", "orbax"):
    assert importlib.util.find_spec(name) is None, f"{name} installed without its extra"
import jax, jax.numpy as jnp, numpy as np, rhino
from rhino.runtime.scheduling.timeline import ExecutedTimeline, TaskRecord
step = lambda w, x: (w - 0.1 * x.T @ (x @ w), jnp.sum(x @ w))
w, x = jnp.ones((16, 16)), jnp.ones((32, 16))
want = jax.jit(step)(w, x)
got = rhino.auto_parallel(step, mesh_shape=(2,), donate=False)(w, x)
np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
tl = ExecutedTimeline((TaskRecord(0, "F0", 0.0, 0.001, 0, "forward"),), "1f1b", 1, 1)
d = tempfile.mkdtemp()
for what, extra, call in (
        ("rhino.init", "rhino[ray]", lambda: rhino.init()),
        ("a timeline PNG", "rhino[plots]", lambda: tl.draw(os.path.join(d, "t.png"))),
        ("a checkpoint", "rhino[checkpoint]",
         lambda: rhino.save_checkpoint(os.path.join(d, "c"), {"w": w}))):
    try:
        call()
    except rhino.RhinoError as e:
        assert extra in str(e), (what, str(e))
    else:
        raise AssertionError(f"{what} ran without its optional package")
tl.write_trace(os.path.join(d, "t.json"))     # trace events need nothing
"""


def source_modules() -> list[str]:
    """Dotted names of every module of the source tree."""
    out = []
    for folder, package in ROOTS.items():
        for f in sorted((REPO / folder).rglob("*.py")):
            rel = f.relative_to(REPO / folder).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out.append(".".join((package, *parts)))
    return out


def wheel_modules(wheel: pathlib.Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".py")]
    return {n[:-3].replace("/", ".").removesuffix(".__init__") for n in names}


def fail(msg: str) -> None:
    print(f"wheel smoke: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd: list[str], cwd: pathlib.Path, what: str, timeout: float = 1200
        ) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        fail(f"{what} exited with {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=pathlib.Path, help="check this wheel instead of building")
    ap.add_argument("--contents-only", action="store_true", help="only compare the contents")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rhino-wheel-") as tmp:
        tmp = pathlib.Path(tmp)
        wheel = a.wheel
        if wheel is None:
            run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"),
                 str(REPO)], REPO, "building the wheel")
            wheel = next((tmp / "dist").glob("rhino-*.whl"))
        expected = source_modules()
        missing = sorted(set(expected) - wheel_modules(wheel))
        if missing:
            fail(f"{wheel.name} lacks {len(missing)} module(s) of the source tree: "
                 f"{', '.join(missing[:12])}")
        print(f"wheel smoke: {wheel.name} holds all {len(expected)} modules")
        if a.contents_only:
            return 0
        venv = tmp / "venv"
        run([sys.executable, "-m", "venv", str(venv)], tmp, "creating a venv")
        py = venv / "bin" / "python"
        run([str(py), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"),
             f"{wheel}[models]"], tmp, "installing the wheel")
        outside = tmp / "elsewhere"
        outside.mkdir()
        check = ("import importlib, sys\n"
                 "for name in sys.argv[1:]:\n"
                 "    m = importlib.import_module(name)\n"
                 "    assert 'site-packages' in (m.__file__ or ''), (name, m.__file__)\n")
        run([str(py), "-c", check, *expected], outside, "importing every module")
        version = run([str(venv / "bin" / "rhino"), "--version"], outside, "rhino --version")
        out = run([str(venv / "bin" / "rhino"), *PLAN], outside, "rhino " + " ".join(PLAN))
        try:
            plan = json.loads(out.stdout)
        except json.JSONDecodeError as e:
            fail(f"rhino {' '.join(PLAN)} printed no valid JSON ({e}); stdout starts "
                 f"{out.stdout[:300]!r}")
        run([str(py), "-c", OPTIONAL], outside, "rhino without its optional packages")
        print(f"wheel smoke: OK ({version.stdout.strip()}; all modules import from "
              f"site-packages; `rhino {' '.join(PLAN)}` -> JSON, {plan['kind']} plan; "
              f"without extras: SPMD runs, optional features name their extras)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
