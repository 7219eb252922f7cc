"""Every command and code block of README.md and docs/*.md runs as written.

Blocks fenced as ``bash`` run with ``bash -euo pipefail`` from the repository root; blocks
fenced as ``python`` run as a script in a scratch folder. ``text`` blocks (synopses) are not
run. A python block whose first line is ``# (continues the block above)`` runs after the
block before it in the same file, as one script. Each runs in a clean environment: the
test process's ``XLA_FLAGS`` and ``JAX_PLATFORMS`` are removed, so a block must set up what
it needs itself, as a user pasting it would.

The README's test command is what ``.ci/run`` runs (checked here, not run: it would run this
suite again). In an environment of unpinned versions (``.ci/latest``: the installed jax is not
the one ``constraints.txt`` pins) the blocks' ``pip install -c constraints.txt`` run without
the constraints: with them, the block would turn the environment under test into the pinned
one halfway through the suite. Blocks that take minutes (``ray job submit``) run trimmed
(``TRIMMED``: fewer steps), and as written under ``-m slow``; the blocks of documents that
start a Ray cluster (``SLOW_DOCS``) run only under ``-m slow``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

# The extended tier (Ray, several processes, the docs' commands, the slowest runs): run by
# .ci/run after the default suite (README, Tests: `-m "extended and not slow"`).
pytestmark = pytest.mark.extended

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
CONTINUES = "# (continues the block above)"
RUN = {"bash", "sh", "python"}
TEST_COMMAND = "pip install -c constraints.txt -e '.[test]' && python -m pytest -q"
# A long block -> the substitutions that make its default-suite form.
TRIMMED = {"ray job submit": {"--steps 10": "--steps 2"}}


def doc_blocks() -> list[tuple[str, str, str]]:
    """(id, language, code) of every fenced block, continuation blocks joined on."""
    out: list[tuple[str, str, str]] = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        last_python = None
        for m in FENCE.finditer(text):
            lang, code = m.group(1), m.group(2)
            line = text.count("\n", 0, m.start()) + 1
            bid = f"{path.name}:{line}"
            if lang == "python" and code.startswith(CONTINUES):
                assert last_python is not None, f"{bid}: continues a block, but none is above"
                code = last_python + "\n" + code
            if lang == "python":
                last_python = code
            out.append((bid, lang, code))
    return out


BLOCKS = [b for b in doc_blocks() if b[1] in RUN and b[2].strip() != TEST_COMMAND]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RAY_ADDRESS")}
    # The test's own environment first on PATH: `pip`, `python`, `rhino`, `ray`.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pinned_jax() -> str | None:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.startswith("jax=="):
            return line.split("==", 1)[1].strip()
    return None


def unpinned() -> bool:
    """Whether this environment runs other versions than ``constraints.txt`` pins."""
    import importlib.metadata

    return importlib.metadata.version("jax") != _pinned_jax()


def _unpin(code: str) -> str:
    return code.replace("pip install -c constraints.txt ", "pip install ") if unpinned() \
        else code


def _trim(code: str) -> tuple[str, bool]:
    for marker, subs in TRIMMED.items():
        if marker in code:
            for a, b in subs.items():
                assert a in code, f"trimming {marker!r} blocks expects {a!r} in them"
                code = code.replace(a, b)
            return code, True
    return code, False


def _run(lang: str, code: str, tmp_path: pathlib.Path, timeout: float):
    if lang == "python":
        script = tmp_path / "block.py"
        script.write_text(code, encoding="utf-8")
        cmd, cwd = [sys.executable, str(script)], tmp_path
    else:
        cmd, cwd = ["bash", "-euo", "pipefail", "-c", _unpin(code)], REPO
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _check(bid: str, out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, (f"{bid} exited with {out.returncode}\n--- stdout\n"
                                 f"{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}")


# Documents whose blocks each start a Ray cluster (19-86 s a block on 2 cores, 126 s of the
# default suite's time together): run with -m slow, with the untrimmed long blocks.
SLOW_DOCS = {"ray.md"}


@pytest.mark.parametrize("bid,lang,code", [
    pytest.param(*b, marks=pytest.mark.slow) if b[0].split(":")[0] in SLOW_DOCS else b
    for b in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_block_runs(bid: str, lang: str, code: str, tmp_path: pathlib.Path):
    code, _ = _trim(code)
    _check(bid, _run(lang, code, tmp_path, timeout=900))


LONG = [b for b in BLOCKS if _trim(b[2])[1]]


@pytest.mark.slow
@pytest.mark.parametrize("bid,lang,code", LONG, ids=[b[0] for b in LONG])
def test_long_block_runs_untrimmed(bid: str, lang: str, code: str, tmp_path: pathlib.Path):
    _check(bid, _run(lang, code, tmp_path, timeout=1800))


def test_the_blocks_are_found():
    """The parser sees the README's blocks (a broken fence would skip them silently)."""
    ids = {b[0].split(":")[0] for b in BLOCKS}
    assert {"README.md", "ray.md"} <= ids
    codes = "\n".join(b[2] for b in BLOCKS)
    assert "rhino demo --cluster 2x4 --stages 2" in codes.splitlines()
    assert "pip install -c constraints.txt -e . && rhino demo" in codes   # optax: a dependency
    assert "ray job submit" in codes


def test_an_unpinned_environment_installs_without_the_pins(monkeypatch):
    import importlib.metadata

    code = "pip install -c constraints.txt -e '.[models]' && rhino demo"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
    assert _unpin(code) == "pip install -e '.[models]' && rhino demo"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: _pinned_jax())
    assert _unpin(code) == code


def test_readme_test_command_is_what_ci_runs():
    blocks = [b for b in doc_blocks() if b[2].strip() == TEST_COMMAND]
    assert blocks, f"README.md: expected the test command {TEST_COMMAND!r} in a block"
    ci = (REPO / ".ci" / "run").read_text()
    install, test = TEST_COMMAND.split(" && ")
    assert install.replace("pip install", "pip install -q") in ci, \
        "`.ci/run` must install as the README says"
    assert test.replace("python -m", "python3 -m") in ci, "`.ci/run` must test as the README says"
