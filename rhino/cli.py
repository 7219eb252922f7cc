"""The ``rhino`` command line.

    rhino inspect PATH_OR_MODEL [--json] [--dot FILE]
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
