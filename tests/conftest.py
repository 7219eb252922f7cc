"""Test set-up: 8 simulated CPU devices, set before jax is imported anywhere, and one
persistent XLA compilation cache for the run (the suite compiles the same zoo programs in
many tests and in the documentation's subprocesses, which inherit the environment; the
cache only skips recompiling a program XLA has already compiled in this run)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="rhino-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """A test that starts a Ray instance (the ``ray_cluster`` fixture) is of the extended
    tier wherever it is written (README, Tests)."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.extended)


@pytest.fixture
def segment_solver_stats(monkeypatch) -> list[dict]:
    """The ``stats`` of every O2 ``_SegmentSolver`` created during the test."""
    from rhino.planner import hierarchical

    seen: list[dict] = []
    init = hierarchical._SegmentSolver.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        seen.append(self.stats)
    monkeypatch.setattr(hierarchical._SegmentSolver, "__init__", spy)
    return seen


@pytest.fixture
def heuristic_o2(monkeypatch) -> None:
    """O2 without its step 0 (small problems handed to the ILP): the tests of its
    heuristic machinery use problems small enough for the ILP to take them."""
    from rhino.planner import hierarchical

    monkeypatch.setattr(hierarchical, "_SMALL_ILP_ENTRIES", -1)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance with 4 CPUs for one test module (skipped without ray)."""
    ray = pytest.importorskip("ray")
    from rhino.runtime.ray.executor import init

    if ray.is_initialized():
        ray.shutdown()
    info = init(num_cpus=4, log_to_driver=False)
    yield info
    ray.shutdown()
