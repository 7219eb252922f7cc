"""The ``rhino`` command line (``rhino --help``; ``USAGE`` below is what it prints).

Subcommands: ``inspect`` (the graph the planner sees), ``plan`` (an SPMD plan for a mesh, or
SPMD / pipeline / hybrid for a cluster) and ``demo`` (plan and train a zoo model on
simulated CPU devices beside single-device ``jax.jit``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import os
import sys
import time
import traceback
from typing import Any, Sequence

from rhino._version import __version__
from rhino.errors import RhinoError

DEFAULT_MICROBATCHES = 4   # rhino.front_door.DEFAULT_MICROBATCHES (not imported: no jax yet)

DESCRIPTION = """\
rhino: plan and run a one-device JAX training step over many devices.

PATH_OR_MODEL is an .hlo (XLA's HLO text) or .mlir (StableHLO) file, a zoo model
written NAME or NAME:key=value,... (e.g. gpt:layers=4,hidden=256 or
gpt:preset=GPT-Medium,layers=4; `rhino inspect --models` lists the models, their
options and presets), or your own step as SCRIPT.py:FUNCTION, its example arguments
from the script's example_args() (SCRIPT.py:FUNCTION:OTHER names another function).
A plan saved as JSON (--output, Plan.to_json()) is printed by `rhino plan PLAN.json`
and `rhino inspect PLAN.json`."""

DEMO_MODEL = "gpt:layers=4,hidden=256,heads=8,seq=64"

EXAMPLES = """\
examples:
  rhino inspect gpt:layers=4,hidden=256
  rhino plan gpt:layers=4,hidden=256 --mesh 2,4
  rhino plan gpt:layers=4,hidden=256 --mesh 2,8 --backend h100
  rhino plan gpt:layers=4,hidden=256 --cluster 2x4 --output plan.json
  rhino plan plan.json --all
  rhino plan train.py:train_step --cluster 2x4
  rhino demo
  rhino demo --cluster 2x4 --stages 2

Each subcommand has its own help: rhino plan --help."""


# With GPU or TPU figures a zoo step at its default batch is microseconds of compute per
# device (gpt:layers=4,hidden=256 at batch 4: 11 µs on an H100), less than the latency of
# one collective, so every plan keeps the step whole on each device. Without a batch= of
# the user's, such a spec's batch is doubled until one device takes at least this long for
# the whole step (gpt:layers=4,hidden=256: batch 1024; with H100 figures on mesh (8) a
# data-parallel plan wins from batch 256).
ACCELERATOR_STEP_S = 2e-3


def accelerator_batch(spec: str, backend: str | None) -> tuple[str, str | None]:
    """``(spec, note)``: a zoo spec with its batch raised for accelerator figures (module
    constant ``ACCELERATOR_STEP_S``), and a line saying so; ``(spec, None)`` unchanged
    for a file, simulated-CPU figures, or a spec that gives ``batch=`` itself."""
    from rhino.backends import backend_figures, backend_names
    from rhino.models import MODEL_NAMES, parse_model_spec

    name, _, options = spec.partition(":")
    if (backend in (None, "cpu") or backend not in backend_names() or os.path.exists(spec)
            or name not in MODEL_NAMES
            or "batch" in {kv.split("=", 1)[0].strip() for kv in options.split(",")}):
        return spec, None
    import rhino
    from rhino.planner.op_cost import OpTimes

    try:
        model = parse_model_spec(spec)
    except ValueError as e:
        raise RhinoError(str(e)) from None
    cost = backend_figures(backend).cost_model((1,))
    graph = rhino.ingest(model.step, *model.example_args())
    seconds = OpTimes(graph, cost).total()
    batch = model.config.batch
    scale = 1
    while seconds * scale < ACCELERATOR_STEP_S and scale < 1 << 16:
        scale *= 2
    if scale == 1:
        return spec, None
    new = f"{spec}{',' if options else ':'}batch={batch * scale}"
    return new, (f"{backend} figures: batch {batch} is {1e6 * seconds:.0f} µs of compute per "
                 f"device, too little to split; planning {new} ({1e3 * seconds * scale:.2f} "
                 f"ms; give batch= to choose)")


_SCRIPT = re.compile(r"^(?P<path>.+\.py):(?P<fn>[A-Za-z_]\w*)(?::(?P<args>[A-Za-z_]\w*))?$")
EXAMPLE_ARGS = "example_args"


def load_script_step(spec: str) -> tuple[Any, tuple] | None:
    """``SCRIPT.py:FUNCTION[:ARGS]`` -> (the step function, its example arguments), the
    arguments from the script's ``ARGS`` (default ``example_args``): a function returning
    them as a tuple, or the tuple itself. The script is imported as a module (its ``if
    __name__ == "__main__"`` part does not run), its folder first on ``sys.path`` while it
    loads. None for a spec of another form.

    Raises:
        RhinoError: no such script, or it lacks the function or the arguments.
    """
    m = _SCRIPT.match(spec)
    if m is None:
        return None
    import importlib.util

    path = os.path.abspath(m["path"])
    if not os.path.isfile(path):
        raise RhinoError(f"{spec!r}: expected SCRIPT.py:FUNCTION with an existing script, "
                         f"found no file {m['path']!r}")
    name = "rhino_script_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.path.insert(0, os.path.dirname(path))
    try:
        loader.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    found = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
             and getattr(v, "__module__", None) == name]
    step = getattr(module, m["fn"], None)
    if not callable(step):
        raise RhinoError(f"{spec!r}: expected a function {m['fn']!r} in {m['path']}, found "
                         f"{'not a function' if step is not None else 'none'} (its "
                         f"functions: {', '.join(found) or 'none'})")
    what = m["args"] or EXAMPLE_ARGS
    given = getattr(module, what, None)
    if given is None:
        raise RhinoError(f"{spec!r}: expected {m['path']} to define {what}() returning "
                         f"{m['fn']}'s example arguments as a tuple (or name another "
                         f"function: {m['path']}:{m['fn']}:OTHER), found none")
    args = given() if callable(given) else given
    if not isinstance(args, (tuple, list)):
        raise RhinoError(f"{spec!r}: expected {what} to give a tuple of {m['fn']}'s "
                         f"arguments, found {type(args).__name__}")
    return step, tuple(args)


def saved_plan(spec: str):
    """The ``Plan`` saved in a ``.json`` file (``--output``, ``Plan.to_json()``); None for
    another source.

    Raises:
        RhinoError: a ``.json`` file that is not a saved plan.
    """
    if not (spec.endswith(".json") and os.path.isfile(spec)):
        return None
    from rhino.parallel_plan import Plan

    try:
        with open(spec, encoding="utf-8") as f:
            return Plan.from_json(f.read())
    except (RhinoError, ValueError, KeyError, TypeError) as e:
        raise RhinoError(f"{spec}: expected a plan saved as JSON (rhino plan --output, "
                         f"Plan.to_json()), found {type(e).__name__}: {e}") from None


def resolve_source(spec: str) -> tuple[Any, tuple]:
    """A file path -> (path, ()); a zoo spec or ``SCRIPT.py:FUNCTION`` -> (step function,
    example args)."""
    script = load_script_step(spec)
    if script is not None:
        return script
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
        from rhino.models import describe_models
        print(describe_models())
        return 0
    if not args.source:
        raise RhinoError("inspect needs PATH_OR_MODEL (a .hlo/.mlir file or NAME:key=value,...)")
    saved = saved_plan(args.source)
    if saved is not None:
        print(saved.to_json(indent=1) if args.json else saved.report(full=True))
        return 0
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


# ------------------------------------------------------------------ argument types
# Each checks one value when the command line is read, before anything is planned; a
# mistake ends the command with exit status 2 and one line on stderr (``_Parser.error``).
def positive_int(text: str) -> int:
    """``"4"`` -> 4; anything but a positive integer is a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0 or str(text).strip().lstrip("+") != str(value):
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """``"0"`` -> 0; anything but an integer >= 0 is a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or str(text).strip().lstrip("+") != str(value):
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, found {text!r}")
    return value


def mesh_shape(text: str) -> tuple[int, ...]:
    """``"2,4"`` -> (2, 4); every entry a positive integer.

    >>> mesh_shape("2,4")
    (2, 4)
    """
    try:
        return tuple(positive_int(x) for x in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas "
                                         f"(e.g. 8 or 2,4), found {text!r}") from None


def memory_bytes(text: str) -> int:
    """``"2.5GiB"`` -> 2684354560: bytes per device, finite and at least 1.

    >>> memory_bytes("1MiB"), memory_bytes("3000")
    (1048576, 3000)
    """
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in units else t) * mult
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a finite, positive number of bytes such as "
                                         f"3000000000 or 2.5GiB, found {text!r}")
    return int(value)


def output_file(text: str) -> str:
    """A path a file can be written to: not a folder, in an existing, writable folder."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file to write, found the folder {text!r}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, found no "
                                         f"folder {folder!r} for {text!r}")
    target = text if os.path.exists(text) else folder
    if not os.access(target, os.W_OK):
        raise argparse.ArgumentTypeError(f"expected a writable file, found {text!r} not "
                                         f"writable")
    return text


def _floats(text: str | None, what: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise RhinoError(f"{what}: expected comma-separated numbers, found {text!r}") from None


# Options of one mode only: (flag, default). Given in the other mode they are refused, not
# ignored (a --mesh beside --cluster used to be dropped without a word).
_SPMD_ONLY = {"plan": (("--mesh", (8,)), ("--alpha", None), ("--beta", None),
                       ("--opt-level", "O2"), ("--time-limit", 600.0),
                       ("--min-split-flops", None)),
              "demo": (("--mesh", (8,)),)}
_CLUSTER_ONLY = {"plan": (("--microbatches", DEFAULT_MICROBATCHES), ("--epsilon", 0.1),
                          ("--max-stages", None), ("--stages", None), ("--virtual-stages", 1),
                          ("--schedule", "auto"),
                          ("--alpha-intra", None), ("--beta-intra", None),
                          ("--alpha-inter", None), ("--beta-inter", None),
                          ("--per-microbatch-statistics", False)),
                 "demo": (("--stages", None), ("--virtual-stages", 1),
                          ("--microbatches", DEFAULT_MICROBATCHES), ("--schedule", "auto"))}


def _mode_options(args: argparse.Namespace, command: str) -> None:
    """Refuse the options of the mode not chosen; fill in the defaults of the chosen one."""
    cluster = bool(args.cluster)
    wrong = _SPMD_ONLY[command] if cluster else _CLUSTER_ONLY[command]
    given = [flag for flag, _ in wrong
             if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        raise RhinoError(
            f"{', '.join(given)}: expected " + ("without --cluster (SPMD on one mesh); "
                                                "found beside --cluster " + str(args.cluster)
                                                if cluster else
                                                "with --cluster (a pipeline), found without it"))
    for flag, default in (_CLUSTER_ONLY if cluster else _SPMD_ONLY)[command]:
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, default)


def _source_for(args: argparse.Namespace) -> tuple[Any, tuple]:
    """The plan's source, its zoo batch raised for accelerator figures (said as progress)."""
    spec, note = accelerator_batch(args.source, args.backend)
    if note:
        _progress(args)(note)
    return resolve_source(spec)


def _emit_plan(p, args: argparse.Namespace) -> int:
    """Save (--output) and print (report, or --json) a plan."""
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(p.to_json(indent=1))
    print(p.to_json(indent=1) if args.json else p.report(full=args.all))
    return 0


def _progress(args: argparse.Namespace):
    """Progress lines on stderr (the ``rhino`` logger at INFO), or none with --quiet."""
    from rhino.progress import get_logger, info

    get_logger().setLevel(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    return info


# What plans a step: refused beside a saved plan, which is printed as it was saved.
_PLANNING = ("mesh", "alpha", "beta", "flops", "backend", "opt_level", "memory_budget",
             "time_limit", "min_split_flops", "cluster", "microbatches", "epsilon",
             "max_stages", "alpha_intra", "beta_intra", "alpha_inter", "beta_inter",
             "per_microbatch_statistics")


def _cmd_plan(args: argparse.Namespace) -> int:
    import rhino

    saved = saved_plan(args.source)
    if saved is not None:
        given = ["--" + k.replace("_", "-") for k in _PLANNING if getattr(args, k) is not None]
        if given:
            raise RhinoError(f"{', '.join(given)}: options for planning a step; found a saved "
                             f"plan, {args.source}, which is printed as saved (plan the step "
                             f"again to change them)")
        return _emit_plan(saved, args)
    _mode_options(args, "plan")
    source, example = _source_for(args)
    progress = _progress(args)
    try:
        if args.cluster:
            from rhino.pipeline.api import make_cluster

            cluster = make_cluster(args.cluster, args.backend, alpha_intra=args.alpha_intra,
                                   beta_intra=args.beta_intra, alpha_inter=args.alpha_inter,
                                   beta_inter=args.beta_inter, flops_per_s=args.flops)
            p = rhino.plan(source, *example, cluster=cluster,
                           num_microbatches=args.microbatches, epsilon=args.epsilon,
                           max_stages=args.max_stages, memory_budget=args.memory_budget,
                           stages=args.stages, virtual_stages=args.virtual_stages,
                           schedule=args.schedule, progress=progress,
                           per_microbatch_statistics=args.per_microbatch_statistics)
            progress(p.choice_line())
        else:
            p = rhino.plan(source, *example, mesh_shape=args.mesh, opt_level=args.opt_level,
                           memory_budget=args.memory_budget,
                           alpha=_floats(args.alpha, "--alpha"),
                           beta=_floats(args.beta, "--beta"), flops_per_s=args.flops,
                           backend=args.backend, time_limit=args.time_limit,
                           progress=progress, min_split_flops=args.min_split_flops)
    except ValueError as e:
        raise RhinoError(str(e)) from None
    return _emit_plan(p, args)


def _ensure_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` simulated CPU devices (only effective before jax's backend starts)."""
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + flag).strip()


def _cmd_demo(args: argparse.Namespace) -> int:
    _mode_options(args, "demo")
    mesh_shape = args.mesh
    if args.cluster:
        from rhino.pipeline.api import make_cluster
        n = make_cluster(args.cluster).num_devices
    else:
        n = math.prod(mesh_shape)
    _ensure_cpu_devices(n)
    _progress(args)
    import jax
    import numpy as np

    import rhino

    if len(jax.devices()) < n:
        raise RhinoError(f"the demo needs {n} devices, found {len(jax.devices())}; start it "
                         f"with XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    from rhino.models import parse_model_spec
    if args.model is None:
        # A pipeline runs the zoo's default batch (its microbatches may hold one example;
        # the stage plans are then made at that shape); SPMD gives each device a sequence.
        # On GPUs or TPUs that is too little work to split: the batch is raised.
        from rhino.backends import figures_for_devices
        backend = figures_for_devices(jax.devices()[:n]).backend
        args.model, note = accelerator_batch(DEMO_MODEL, backend)
        if note:
            print(f"rhino demo: {note}")
        else:
            args.model = DEMO_MODEL if args.cluster else f"{DEMO_MODEL},batch=8"
    try:
        model = parse_model_spec(args.model)
    except ValueError as e:
        raise RhinoError(f"--model: {e}") from None
    where = (f"cluster {args.cluster} as a pipeline ({args.microbatches} microbatches, "
             f"{args.schedule})" if args.cluster else f"mesh {mesh_shape}")
    print(f"rhino demo: {args.model} trained on {n} {jax.devices()[0].platform} devices "
          f"({where}), {args.steps} Adam steps, beside single-device jax.jit")
    params, opt = model.init(jax.random.PRNGKey(0))
    batch = model.make_batch(jax.random.PRNGKey(1))
    if args.cluster:
        step = rhino.auto_parallel(model.step, cluster=args.cluster, stages=args.stages,
                                   virtual_stages=args.virtual_stages,
                                   num_microbatches=args.microbatches, schedule=args.schedule,
                                   opt_level=args.opt_level, memory_budget=args.memory_budget)
        print(step.report_for(params, opt, batch))
    else:
        step = rhino.auto_parallel(model.step, mesh_shape=mesh_shape, opt_level=args.opt_level,
                                   memory_budget=args.memory_budget)
        print(step.report_for(params, opt, batch))
    ref = jax.jit(model.step)
    rp, ro = params, opt
    ap, ao = jax.tree.map(np.array, params), jax.tree.map(np.array, opt)
    print(f"\n  {'step':>4}  {'single device':>14}  {'rhino':>14}  {'|diff|':>9}")
    worst, times = 0.0, []
    for i in range(args.steps):
        rp, ro, rl = ref(rp, ro, batch)
        t0 = time.perf_counter()
        ap, ao, al = step(ap, ao, batch)
        al = float(al)                    # the step's result, ready
        times.append(time.perf_counter() - t0)
        d = abs(float(rl) - al)
        worst = max(worst, d / max(abs(float(rl)), 1e-30))
        print(f"  {i + 1:>4}  {float(rl):>14.6f}  {float(al):>14.6f}  {d:>9.2e}")
    ok = worst <= 1e-4
    print(f"\n  largest relative loss difference {worst:.2e}: "
          f"{'matches' if ok else 'DOES NOT MATCH'} single-device training (rtol 1e-4)")
    examples, tokens = rhino.batch_sizes(batch)
    print("  measured: " + rhino.throughput_line(step.plan_for(params, opt, batch), times,
                                                 examples, tokens))
    if args.cluster:
        print("\n  the last step as run (measured):\n" + step.timeline().render_text(96))
        step.close()
    return 0 if ok else 1


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``rhino plan: error: argument --mesh: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_finite(what: str):
    """An argparse type: a positive finite number, else ``expected <what>, found '...'``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}")
        return value
    return parse


_flops = _positive_finite("FLOP/s per device such as 1e12")
_flop_count = _positive_finite("a positive number of FLOPs such as 1e6")


def build_parser() -> argparse.ArgumentParser:
    from rhino.backends import backend_names

    p = _Parser(prog="rhino", description=DESCRIPTION, epilog=EXAMPLES,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"rhino {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="on an error, print the whole traceback instead of one line")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kw: Any) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, **kw)
        # Also accepted after the command; SUPPRESS keeps a --debug given before it.
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the whole traceback")
        return sp

    pi = command("inspect", help="ingest and analyse a program; print its structure")
    pi.add_argument("source", nargs="?", help="a .hlo/.mlir file, a zoo model NAME:k=v,..., "
                    "your step as SCRIPT.py:FUNCTION, or a saved plan PLAN.json")
    pi.add_argument("--json", action="store_true", help="print one JSON object")
    pi.add_argument("--dot", metavar="FILE", type=output_file,
                    help="write the coarsened graph for Graphviz")
    pi.add_argument("--top", type=nonnegative_int, default=10,
                    help="largest parameters to list (default: 10)")
    pi.add_argument("--models", action="store_true", help="list the zoo models with their options and presets, and exit")
    pi.set_defaults(func=_cmd_inspect)
    pp = command("plan", help="find a plan (SPMD for --mesh; SPMD, pipeline or "
                 "hybrid for --cluster) and print its report")
    pp.add_argument("source", help="a .hlo/.mlir file, a zoo model NAME:k=v,..., your step "
                    "as SCRIPT.py:FUNCTION, or a saved plan PLAN.json (printed)")
    pp.add_argument("--mesh", type=mesh_shape,
                    help="mesh shape, e.g. 8 or 2,4 (default: 8)")
    pp.add_argument("--alpha", help="latency per mesh axis in seconds, e.g. 1e-5,1e-5")
    pp.add_argument("--beta", help="seconds per byte per mesh axis, e.g. 2e-10,1e-9")
    pp.add_argument("--flops", type=_flops, metavar="FLOP/S",
                    help="FLOP/s of one device, every dtype, e.g. 1e12")
    pp.add_argument("--backend", choices=backend_names(),
                    help="plan with built-in figures of these devices (α, β, FLOP/s per "
                    "dtype, memory); default: simulated CPU")
    pp.add_argument("--opt-level", choices=("O2", "O3"), help="default: O2")
    pp.add_argument("--memory-budget", type=memory_bytes,
                    help="bytes per device (suffixes KiB, MiB, GiB)")
    pp.add_argument("--time-limit", type=float, help="seconds per solve (default: 600)")
    pp.add_argument("--min-split-flops", type=_flop_count, metavar="FLOPS",
                    help="ops of at least this many FLOPs may not run whole on every device "
                    "(their replicated choices are removed), e.g. 1e6")
    pp.add_argument("--json", action="store_true", help="print the plan as JSON")
    pp.add_argument("--output", metavar="FILE", type=output_file,
                    help="also save the plan JSON to FILE")
    pp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    pp.add_argument("--all", action="store_true", help="list every collective, parameter, "
                    "candidate and tensor between stages in the report (default: the largest)")
    pp.add_argument("--cluster", metavar="HxD", help="plan SPMD / pipeline / hybrid for H hosts "
                    "x D devices per host, e.g. 2x8 (the pipeline planner; instead of --mesh)")
    pp.add_argument("--microbatches", type=positive_int,
                    help=f"microbatches per step (1F1B; with --cluster, default: "
                    f"{DEFAULT_MICROBATCHES}, as auto_parallel)")
    pp.add_argument("--epsilon", type=float,
                    help="stage imbalance tolerance (with --cluster, default: 0.1)")
    pp.add_argument("--max-stages", type=positive_int, help="the most pipeline stages")
    pp.add_argument("--stages", type=positive_int, help="with --cluster: exactly this many "
                    "pipeline stages (device groups with --virtual-stages)")
    pp.add_argument("--virtual-stages", type=positive_int, help="with --cluster and "
                    "--stages: stages of the model per device group (interleaved-1f1b)")
    pp.add_argument("--schedule", choices=("auto", "1f1b", "gpipe", "eager-1f1b", "zb-h1",
                                           "interleaved-1f1b"),
                    help="with --cluster (default: auto, the planner's choice)")
    pp.add_argument("--per-microbatch-statistics", action="store_const", const=True,
                    help="with --cluster: let each microbatch use its own statistics of the "
                    "batch (batch norm), as auto_parallel(per_microbatch_statistics=True); "
                    "by default a step whose gradients need the whole batch is not pipelined")
    for where in ("intra", "inter"):
        pp.add_argument(f"--alpha-{where}", type=float,
                        help=f"link latency {where}-host in seconds (with --cluster)")
        pp.add_argument(f"--beta-{where}", type=float,
                        help=f"seconds per byte {where}-host (with --cluster)")
    pp.set_defaults(func=_cmd_plan)
    pd = command("demo", help="the main job: plan and train a zoo model on simulated "
                              "CPU devices beside single-device training")
    pd.add_argument("--model", help=f"zoo model spec (default: {DEMO_MODEL},batch=8; with "
                    "--cluster, the zoo's default batch)")
    pd.add_argument("--mesh", type=mesh_shape, help="mesh shape (default: 8)")
    pd.add_argument("--steps", type=positive_int, default=10,
                    help="training steps (default: 10)")
    pd.add_argument("--opt-level", default="O2", choices=("O2", "O3"))
    pd.add_argument("--cluster", metavar="HxD", help="train as a pipeline over H hosts x D "
                    "devices, e.g. 2x4 (instead of --mesh)")
    pd.add_argument("--stages", type=positive_int, help="pipeline stages with --cluster "
                    "(default: the planner's choice)")
    pd.add_argument("--microbatches", type=positive_int,
                    help=f"with --cluster (default: {DEFAULT_MICROBATCHES})")
    pd.add_argument("--virtual-stages", type=positive_int, help="with --cluster and "
                    "--stages: stages of the model per device group (interleaved-1f1b; "
                    "default: 1)")
    pd.add_argument("--schedule", choices=("auto", "1f1b", "gpipe", "eager-1f1b", "zb-h1",
                                           "interleaved-1f1b"),
                    help="with --cluster (default: auto, the planner's choice)")
    pd.add_argument("--memory-budget", type=memory_bytes, help="bytes per device, e.g. "
                    "2MiB: the compiled SPMD program's (re-plans with more weight on memory "
                    "until it fits); with --cluster, each stage's estimated peak")
    pd.set_defaults(func=_cmd_demo)
    return p


# Options whose value may start with a minus sign ("--alpha -1e-5,1e-5"): argparse would take
# the value for an option; written "--alpha=-1e-5,1e-5" it is read as a value.
_NUMBER_OPTIONS = ("--alpha", "--beta", "--alpha-intra", "--beta-intra", "--alpha-inter",
                   "--beta-inter", "--epsilon", "--flops", "--time-limit",
                   "--min-split-flops")
_NEGATIVE = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``["--alpha", "-1e-5,1e-5"]`` -> ``["--alpha=-1e-5,1e-5"]`` (see ``_NUMBER_OPTIONS``).

    >>> _attach_negative_values(["plan", "m", "--alpha", "-1e-5,1e-5", "--json"])
    ['plan', 'm', '--alpha=-1e-5,1e-5', '--json']
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _NUMBER_OPTIONS and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def one_line(message: str) -> str:
    """A message on one line (its lines joined with `` | ``).

    >>> one_line("ray start failed; its log ends:\\n  a\\n\\n  b")
    'ray start failed; its log ends: | a | b'
    """
    return " | ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status: 0 done, 1 the demo's results differ
    or rhino failed unexpectedly, 2 a mistake in the command or its input (one line on
    stderr; ``--debug`` prints the traceback instead), 130 interrupted, 141 the reader of
    its output stopped reading (``rhino plan ... | head``: nothing more is printed, as a
    Unix tool ended by SIGPIPE)."""
    argv = _attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a usage error (2), or --help / --version (0)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("rhino: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python would complain again flushing stdout at exit: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except Exception as e:  # noqa: BLE001 - every failure ends as one line (or --debug)
        if args.debug:
            traceback.print_exc()
        if isinstance(e, RhinoError):
            print(f"rhino: error: {one_line(str(e))}", file=sys.stderr)
            return 2
        if isinstance(e, OSError) and e.filename is not None:
            print(f"rhino: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
            return 2
        hint = "" if args.debug else " (rhino --debug ... prints the traceback)"
        print(f"rhino: internal error: {type(e).__name__}: {one_line(str(e))}{hint}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
