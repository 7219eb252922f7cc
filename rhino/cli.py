"""The ``rhino`` command line.

    rhino inspect PATH_OR_MODEL [--json] [--dot FILE]
    rhino plan PATH_OR_MODEL --mesh 2,4 [--alpha 1e-5,1e-5] [--beta 2e-10,2e-10]
               [--opt-level O2|O3] [--memory-budget BYTES] [--json] [--output FILE]
    rhino demo

``PATH_OR_MODEL`` is an ``.hlo`` / ``.mlir`` file, or a zoo model as ``NAME:key=value,...``
(e.g. ``gpt:layers=72,hidden=512``); ``rhino inspect --models`` lists the zoo.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from rhino.errors import RhinoError


def resolve_source(spec: str) -> tuple[Any, tuple]:
    """A file path -> (path, ()); a zoo spec -> (step function, example args)."""
    if os.path.exists(spec):
        return spec, ()
    from rhino.models import MODEL_NAMES, parse_model_spec

    name = spec.split(":", 1)[0]
    if name not in MODEL_NAMES:
        raise RhinoError(f"{spec!r} is neither an existing file nor a zoo model; zoo models are "
                         f"{', '.join(MODEL_NAMES)} (as NAME or NAME:key=value,...)")
    try:
        model = parse_model_spec(spec)
    except ValueError as e:
        raise RhinoError(str(e)) from None
    return model.step, model.example_args()


def _cmd_inspect(args: argparse.Namespace) -> int:
    from rhino.inspection import inspect_source

    if args.models:
        from rhino.models import MODEL_NAMES
        print("\n".join(MODEL_NAMES))
        return 0
    if not args.source:
        raise RhinoError("inspect needs PATH_OR_MODEL (a .hlo/.mlir file or NAME:key=value,...)")
    source, example = resolve_source(args.source)
    rep = inspect_source(source, *example, top=args.top)
    if args.dot:
        with open(args.dot, "w", encoding="utf-8") as f:
            f.write(rep.to_dot())
    if args.json:
        print(json.dumps(rep.summary, indent=1))
    else:
        print(rep.to_text())
        if args.dot:
            print(f"  coarsened graph written to {args.dot}")
    return 0


def _floats(text: str | None, what: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise RhinoError(f"{what}: expected comma-separated numbers, found {text!r}") from None


def _memory(text: str | None) -> int | None:
    if text is None:
        return None
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError:
        raise RhinoError(f"--memory-budget: expected bytes such as 3000000000 or 2.5GiB, found "
                         f"{text!r}") from None


def _cmd_plan(args: argparse.Namespace) -> int:
    import rhino

    mesh_shape = tuple(int(x) for x in _floats(args.mesh, "--mesh"))
    source, example = resolve_source(args.source)
    progress = None if args.quiet else (lambda msg: print(f"rhino: {msg}", file=sys.stderr))
    try:
        p = rhino.plan(source, *example, mesh_shape=mesh_shape, opt_level=args.opt_level,
                       memory_budget=_memory(args.memory_budget),
                       alpha=_floats(args.alpha, "--alpha"), beta=_floats(args.beta, "--beta"),
                       time_limit=args.time_limit, progress=progress)
    except ValueError as e:
        raise RhinoError(str(e)) from None
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(p.to_json(indent=1))
    print(p.to_json(indent=1) if args.json else p.report())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rhino.inspection import inspect_source

    spec = args.model
    print(f"rhino demo: inspecting the zoo model {spec!r} as the planner will see it")
    source, example = resolve_source(spec)
    rep = inspect_source(source, *example)
    print(rep.to_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rhino", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("inspect", help="ingest and analyse a program; print its structure")
    pi.add_argument("source", nargs="?", help="a .hlo/.mlir file or a zoo model NAME:k=v,...")
    pi.add_argument("--json", action="store_true", help="print one JSON object")
    pi.add_argument("--dot", metavar="FILE", help="write the coarsened graph for Graphviz")
    pi.add_argument("--top", type=int, default=10, help="largest parameters to list")
    pi.add_argument("--models", action="store_true", help="list the zoo models and exit")
    pi.set_defaults(func=_cmd_inspect)
    pp = sub.add_parser("plan", help="find an SPMD sharding plan and print its report")
    pp.add_argument("source", help="a .hlo/.mlir file or a zoo model NAME:k=v,...")
    pp.add_argument("--mesh", default="8", help="mesh shape, e.g. 8 or 2,4 (default: 8)")
    pp.add_argument("--alpha", help="latency per mesh axis in seconds, e.g. 1e-5,1e-5")
    pp.add_argument("--beta", help="seconds per byte per mesh axis, e.g. 2e-10,1e-9")
    pp.add_argument("--opt-level", default="O2", choices=("O2", "O3"))
    pp.add_argument("--memory-budget", help="bytes per device (suffixes KiB, MiB, GiB)")
    pp.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve")
    pp.add_argument("--json", action="store_true", help="print the plan as JSON")
    pp.add_argument("--output", metavar="FILE", help="also save the plan JSON to FILE")
    pp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    pp.set_defaults(func=_cmd_plan)
    pd = sub.add_parser("demo", help="the main job: run rhino on a zoo model")
    pd.add_argument("--model", default="gpt:layers=4,hidden=256",
                    help="zoo model spec (default: %(default)s)")
    pd.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RhinoError as e:
        print(f"rhino: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
