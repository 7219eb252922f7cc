"""Every module's examples run as written: the docstring examples of every module of
``rhino`` (``rhino.hlo_passes`` and ``rhino.runtime`` included) pass ``doctest``. Modules
whose examples need a Ray cluster mark those lines ``+SKIP``."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import rhino
import rhino.hlo_passes
import rhino.runtime


def _modules() -> list[str]:
    names = set()
    for pkg in (rhino, rhino.hlo_passes, rhino.runtime):
        names.update(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
    return sorted(names - {"rhino.__main__"})


def test_every_package_module_is_found():
    names = _modules()
    assert {"rhino.parallel_step", "rhino.hlo_passes.stage_programs",
            "rhino.runtime.state.remote_array", "rhino.pipeline.search"} <= set(names), names
    assert len(names) > 60


@pytest.mark.parametrize("name", _modules())
def test_module_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name}"
