"""The house rules, checked on the source: no import cycle, one HiGHS adapter, one vocabulary.

Imports are read with ``ast`` from every module of ``rhino/``, ``hlo_passes/`` (installed as
``rhino.hlo_passes``) and ``runtime/`` (``rhino.runtime``), counting imports inside functions
too: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = {"rhino": "rhino", "hlo_passes": "rhino.hlo_passes", "runtime": "rhino.runtime"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in ROOTS.items():
        for f in (REPO / folder).rglob("*.py"):
            rel = f.relative_to(REPO / folder).with_suffix("").parts
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((package, *parts))] = f
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The rhino modules ``name`` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:       # `import rhino.x.y` as far as it is ours
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        for t in _imports(name, path):
            g.add_edge(name, t)
    return g


def test_the_walk_sees_the_package():
    g = import_graph()
    assert {"rhino.parallel_step", "rhino.hlo_passes.lower", "rhino.runtime.executors.local",
            "rhino.planner.api", "rhino.pipeline.search", "rhino.parallel_plan"} <= set(g)
    assert g.has_edge("rhino.step_builder", "rhino.hlo_passes.lower")
    # an import inside a function counts
    assert g.has_edge("rhino.step_builder", "rhino.runtime.ray.executor")


def test_no_import_cycle():
    """Cycles between package ``__init__`` modules and the modules they re-export are the
    package's own business; any other cycle fails."""
    g = import_graph()
    for a, b in list(g.edges):
        if a.startswith(b + ".") or b.startswith(a + "."):   # a package and its own module
            g.remove_edge(a, b)
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


# The runtime's rooms and what each may import of the runtime (besides itself): the base
# modules import no room; scheduling, transfer and state only the base; executors those
# three; ray anything. The package docstrings say the same.
RUNTIME_BASE = {"rhino.runtime.failures", "rhino.runtime.threads"}
RUNTIME_ROOMS = {
    "scheduling": set(), "transfer": set(), "state": set(),
    "executors": {"scheduling", "transfer", "state"},
    "ray": {"scheduling", "transfer", "state", "executors"},
}


def _room(module: str) -> str | None:
    """The runtime room (``scheduling``, ...) of ``module``, "base" for the base modules,
    "package" for ``rhino.runtime`` itself, None outside the runtime."""
    if module in RUNTIME_BASE:
        return "base"
    if module == "rhino.runtime":
        return "package"
    if module.startswith("rhino.runtime."):
        return module.split(".")[2]
    return None


def room_violations(g: nx.DiGraph) -> list[str]:
    bad = []
    for a, b in g.edges:
        ra, rb = _room(a), _room(b)
        if ra is None or rb is None or ra == rb or rb == "base" or ra == "package":
            continue
        if ra == "base" or rb == "package" or rb not in RUNTIME_ROOMS.get(ra, set()):
            bad.append(f"{a} ({ra}) imports {b} ({rb})")
    return bad


def test_the_runtime_is_in_rooms_and_imports_go_one_way():
    g = import_graph()
    runtime = [n for n in g if n.startswith("rhino.runtime.")]
    homeless = [n for n in runtime if _room(n) not in {"base", *RUNTIME_ROOMS}]
    assert not homeless, f"runtime modules outside the rooms: {homeless}"
    assert set(RUNTIME_ROOMS) <= {_room(n) for n in runtime}
    assert not room_violations(g), room_violations(g)


def test_the_room_check_sees_a_wrong_way_import():
    g = import_graph()
    g.add_edge("rhino.runtime.scheduling.schedules", "rhino.runtime.transfer.transport")
    g.add_edge("rhino.runtime.failures", "rhino.runtime.scheduling.schedules")
    g.add_edge("rhino.runtime.executors.local", "rhino.runtime.ray.cluster")
    assert len(room_violations(g)) == 3, room_violations(g)


def _ray_imports(text: str) -> list[str]:
    """The imports of ray in ``text``, but Ray's copy of cloudpickle (a fallback where
    cloudpickle is not installed on its own: nothing of Ray runs)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "ray"]
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or "").split(".")[0] == "ray":
            found += [f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}" != "ray.cloudpickle"]
    return found


def test_only_the_ray_room_imports_ray():
    users = sorted(n for n, p in MODULES.items() if _ray_imports(p.read_text(encoding="utf-8")))
    assert users and all(n.startswith("rhino.runtime.ray.") for n in users), users
    assert _ray_imports("def f():\n    import ray\n    from ray.util import x\n") == [
        "ray", "ray.util.x"]


def test_the_flat_names_are_the_moved_modules():
    import importlib

    import rhino.runtime as rt

    for old, new in rt.MOVED.items():
        assert (REPO / "runtime" / (new.replace(".", "/") + ".py")).exists(), new
        assert not (REPO / "runtime" / f"{old}.py").exists(), old
    from rhino.runtime import executor, ray_executor
    assert executor is importlib.import_module("rhino.runtime.executors.local")
    assert ray_executor is importlib.import_module("rhino.runtime.ray.executor")
    assert executor.__spec__.name == "rhino.runtime.executors.local"
    from rhino.runtime.transport import ExecutorError
    from rhino.runtime.failures import ExecutorError as moved
    assert ExecutorError is moved


def test_one_module_builds_highs_models():
    users = [n for n, p in MODULES.items() if "highspy.Highs(" in p.read_text(encoding="utf-8")]
    assert users == ["rhino.milp"]


@pytest.mark.parametrize("name", ["SolverStatus", "Role", "TaskKind", "PlanKind",
                                  "ScheduleKind", "ExecutorKind", "TransportKind",
                                  "Accumulate"])
def test_the_vocabulary_is_enums(name):
    import enum

    from rhino import vocabulary

    cls = getattr(vocabulary, name)
    assert issubclass(cls, enum.Enum) and issubclass(cls, str)


def test_statuses_and_roles_come_from_the_vocabulary():
    import rhino
    from rhino.pipeline.coarsen import classify_ops
    from rhino.pipeline.gradient import find_gradient_boundary
    from rhino.models import get_model
    from rhino.vocabulary import PlanKind, Role, SolverStatus

    m = get_model("mlp", batch=16, hidden=16)
    p = rhino.plan(m.step, *m.example_args(), mesh_shape=(2,))
    assert isinstance(p.kind, PlanKind) and isinstance(p.spmd.search.status, SolverStatus)
    again = rhino.Plan.from_json(p.to_json())
    assert isinstance(again.spmd.search.status, SolverStatus)
    g = rhino.ingest(m.step, *m.example_args())
    roles = classify_ops(g, find_gradient_boundary(g)).role
    assert {type(r) for r in roles} == {Role}


def test_no_private_name_is_imported_across_modules():
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    ("rhino", ".")) or isinstance(node, ast.ImportFrom) and node.level:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") \
                            and not (node.module or "").startswith("rhino.jaxpr") \
                            and node.module != "rhino._version":
                        bad.append(f"{name}: from {node.module} import {a.name}")
    assert not bad, bad


def _outside_jaxpr() -> dict[str, pathlib.Path]:
    """Every module but those of ``rhino.jaxpr`` (the one place for JAX's internals)."""
    return {n: p for n, p in MODULES.items() if not n.startswith("rhino.jaxpr")}


def _internals(name: str, text: str) -> list[str]:
    """Where module ``name`` (source ``text``) touches JAX's internals."""
    from rhino.jaxpr import primitives as prims

    names = prims.all_names()
    bad = [f"{name}: {needle}" for needle in ("jax._src", "jax.core.", "jax.extend")
           if needle in text]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr in ("primitive", "source_info"):
            bad.append(f"{name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Attribute) and node.attr == "params" and \
                isinstance(node.value, (ast.Attribute, ast.Name)) and \
                getattr(node.value, "attr", getattr(node.value, "id", "")) == "eqn":
            bad.append(f"{name}:{node.lineno}: eqn.params")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(x, ast.Call) and getattr(x.func, "attr", "") == "name"
                        for x in sides)
            lits = [x.value for x in sides if isinstance(x, ast.Constant)]
            if named and any(v in names for v in lits if isinstance(v, str)):
                bad.append(f"{name}:{node.lineno}: a primitive name compared by hand")
    return bad


def test_jax_internals_are_used_in_rhino_jaxpr_only():
    """``jax._src``, ``jax.core``, ``jax.extend.core``, an equation's primitive, parameters
    or source info, and primitive names compared by hand: only ``rhino.jaxpr`` touches
    them (its tests included), so a JAX upgrade breaks one package."""
    bad = [b for name, path in _outside_jaxpr().items()
           for b in _internals(name, path.read_text(encoding="utf-8"))]
    assert not bad, bad


def test_the_internals_check_sees_each_kind_of_use():
    src = ("from jax._src import core\n"
           "def f(eqn, fe):\n"
           "    a = eqn.primitive.name\n"
           "    b = fe.eqn.params['axes']\n"
           "    return prims.name(eqn) == 'scan'\n")
    found = _internals("m", src)
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        ".primitive", "a primitive name compared by hand", "eqn.params", "jax._src"], found
    assert _internals("m", "def f(x):\n    return x.name == 'scan'\n") == []
