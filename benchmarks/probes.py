"""Reliability probes: bad files, bad options, bad arguments, unusual steps and executor
faults, each run in its own process under a hard timeout and classified by what it did.

    python benchmarks/probes.py [--jobs 2] [--only SUBSTRING] [--out probes.jsonl]

Outcomes:

* ``clear``   -- the expected refusal: a ``RhinoError`` (or, on the command line, exit 2 with
  one line on stderr and no traceback) whose message contains what the probe expects;
* ``correct`` -- a run that should succeed did, and its results equal ``jax.jit``'s;
* ``unclear`` -- refused, with the right kind of error, but the message lacks what it should
  name;
* ``crash``   -- any other exception (a traceback) or a signal;
* ``silent``  -- success where a refusal was expected, or results that differ from jit's;
* ``hang``    -- the process did not end within the probe's timeout.

Prints one line per probe and a table of classes x outcomes; exits 1 unless every probe is
``clear`` or ``correct``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTCOMES = ("clear", "correct", "unclear", "crash", "silent", "hang")

PRELUDE = """
import os, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import numpy as np, jax, jax.numpy as jnp
import rhino
from rhino.models import get_model

def same(got, want, rtol=2e-5, atol=1e-6):
    # results equal jit's, else WRONG on stdout and exit 4 (a silent wrong result)
    data = lambda x: (jax.random.key_data(x) if jax.dtypes.issubdtype(
        getattr(x, "dtype", None), jax.dtypes.prng_key) else x)
    gl, wl = [data(x) for x in jax.tree.leaves(got)], [data(x) for x in jax.tree.leaves(want)]
    try:
        assert len(gl) == len(wl), (len(gl), len(wl))
        for g, w in zip(gl, wl):
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                       rtol=rtol, atol=atol)
    except AssertionError as e:
        print("WRONG", " | ".join(str(e).splitlines()), flush=True)
        sys.exit(4)

def mlp(**kw):
    m = get_model("mlp", **{"layers": 2, "hidden": 32, "batch": 8, **kw})
    params, opt = m.init(jax.random.PRNGKey(0))
    return m, (params, opt, m.make_batch(jax.random.PRNGKey(1)))

def host(tree):
    keep = lambda x: jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
    return jax.tree.map(lambda x: x if keep(x) else np.asarray(x), tree)

def against_jit(step, args, steps=2, rtol=2e-5, atol=1e-6, **options):
    ref, s1 = jax.jit(step), tuple(args)
    s2 = tuple(host(args))
    with rhino.auto_parallel(step, **options) as par:
        for _ in range(steps):
            *st1, out1 = ref(*s1)
            *st2, out2 = par(*s2)
            same(out2, out1, rtol, atol)
            n = len(st1)
            s1, s2 = (*st1, *s1[n:]), (*st2, *s2[n:])
    same(s2, s1, rtol, atol)
"""

# The program of a probe: the body runs under ``try``; a RhinoError (or an exception type the
# probe accepts, e.g. Python's TypeError for an unknown keyword) prints RAISED and exits 3.
WRAP = """
try:
{body}
except (rhino.RhinoError, {accept}) as e:
    print("RAISED", type(e).__name__ + ":", str(e).replace("\\n", " | "), flush=True)
    sys.exit(3)
print("OK", flush=True)
"""


@dataclass
class Probe:
    cls: str                      # the class of probe (rows of the table)
    name: str
    expect: str                   # "error" or "ok"
    says: tuple = ()              # substrings the refusal must contain
    cli: list | None = None       # a `rhino` command line ...
    code: str | None = None       # ... or a Python body (indented into WRAP)
    timeout: float = 120.0
    max_seconds: float | None = None   # a refusal later than this is unclear (slow)
    accept: tuple = ()            # exception types besides RhinoError that are the answer


def _free_ports() -> tuple[socket.socket, socket.socket]:
    closed, silent = socket.socket(), socket.socket()
    closed.bind(("127.0.0.1", 0))                 # bound, not listening: refused
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)                             # accepts, never answers
    return closed, silent


def _dumps(tmp: str) -> dict[str, bytes]:
    """Real HLO and StableHLO text of a small training step."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu")
    code = textwrap.dedent("""
        import sys, jax
        from rhino.models import get_model
        m = get_model("mlp", layers=2, hidden=16, batch=4)
        low = jax.jit(m.step).lower(*m.example_args())
        open(sys.argv[1] + "/good.mlir", "w").write(low.as_text())
        open(sys.argv[1] + "/good.hlo", "w").write(low.compile().as_text())
    """)
    subprocess.run([sys.executable, "-c", code, tmp], check=True, env=env, cwd=REPO,
                   timeout=300)
    return {n: open(os.path.join(tmp, n), "rb").read() for n in ("good.hlo", "good.mlir")}


def _replace_first(data: bytes, old: bytes, new: bytes) -> bytes:
    assert old in data, old
    return data.replace(old, new, 1)


def file_probes(tmp: str) -> list[Probe]:
    d = _dumps(tmp)
    hlo, mlir = d["good.hlo"], d["good.mlir"]
    lines = hlo.split(b"\n")
    entry = next(i for i, ln in enumerate(lines) if ln.startswith(b"ENTRY"))
    param = next(ln for ln in lines[entry:] if b"parameter(1)" in ln)
    import re
    first_dim = re.search(rb"f32\[(\d+)", lines[entry + 1]).group(0)
    bad = {
        "non_utf8.hlo": hlo[:200] + b"\xff\xfe" + hlo[200:],
        "negative_dim.hlo": hlo.replace(first_dim, first_dim.split(b"[")[0] + b"[-4"),
        "param_out_of_range.hlo": hlo.replace(param, param.replace(b"parameter(1)",
                                                                   b"parameter(7)")),
        "header_layout.hlo": re.sub(rb"(entry_computation_layout=\{\()f32\[(\d+)",
                                    rb"\1f32[999", hlo, count=1),
        "truncated.hlo": hlo[: len(hlo) * 2 // 3],
        "empty.hlo": b"",
        "garbage.hlo": bytes(range(256)) * 8,
        # an elementwise op whose result shape disagrees with its operands'
        "operand_shape.hlo": re.sub(rb"= f32\[\d+(?:,\d+)*\](\{[0-9,]*\})? (add|multiply|subtract)\(",
                                    rb"= f32[3,3] \2(", hlo, count=1),
        "non_utf8.mlir": mlir[:100] + b"\xc3\x28" + mlir[100:],
        "negative_dim.mlir": re.sub(rb"tensor<(\d+)x", rb"tensor<-\1x", mlir, count=1),
        "truncated.mlir": mlir[: len(mlir) // 2],
        "good.hlo": hlo,
        "good.mlir": mlir,
    }
    assert bad["operand_shape.hlo"] != hlo
    for n, data in bad.items():
        with open(os.path.join(tmp, n), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(tmp, "a_folder.hlo"), exist_ok=True)
    probes = []
    for n in bad:
        path = os.path.join(tmp, n)
        ok = n.startswith("good")
        says = () if ok else (n,)
        probes.append(Probe("bad files", f"inspect {n}", "ok" if ok else "error", says,
                            cli=["inspect", path]))
        probes.append(Probe("bad files", f"rhino.ingest {n}", "ok" if ok else "error", says,
                            code=f"g = rhino.ingest({path!r})\nassert g.check() is None or True"))
    probes.append(Probe("bad files", "inspect a folder", "error", ("a_folder.hlo",),
                        cli=["inspect", os.path.join(tmp, "a_folder.hlo")]))
    probes.append(Probe("bad files", "inspect a missing file", "error", ("no_such.hlo",),
                        cli=["inspect", os.path.join(tmp, "no_such.hlo")]))
    return probes


def cli_probes(tmp: str) -> list[Probe]:
    p = []

    def bad(name, argv, *says, max_seconds=15.0):
        p.append(Probe("bad options (CLI)", name, "error", says, cli=argv,
                       max_seconds=max_seconds))

    bad("--mesh 0", ["demo", "--mesh", "0"], "--mesh")
    bad("--mesh 2.5", ["demo", "--mesh", "2.5"], "2.5")
    bad("--mesh 2,2.5", ["plan", "mlp", "--mesh", "2,2.5"], "2,2.5")
    bad("--mesh -2", ["plan", "mlp", "--mesh", "-2"], "--mesh")
    bad("--stages 0", ["demo", "--cluster", "2x4", "--stages", "0"], "--stages")
    bad("--stages -2", ["demo", "--cluster", "2x4", "--stages", "-2"], "-2")
    bad("--stages without --cluster", ["demo", "--stages", "2"], "--cluster")
    bad("--steps 0", ["demo", "--steps", "0"], "--steps")
    bad("--memory-budget inf", ["demo", "--memory-budget", "inf"], "--memory-budget")
    bad("--memory-budget nan", ["plan", "mlp", "--memory-budget", "nan"], "nan")
    bad("--memory-budget 2XB", ["plan", "mlp", "--memory-budget", "2XB"], "2XB")
    bad("--memory-budget 1MiB", ["demo", "--memory-budget", "1MiB"], "lower bound",
        max_seconds=60.0)
    bad("--output at a folder", ["plan", "mlp", "--output", tmp], "--output")
    bad("--output in no folder", ["plan", "mlp", "--output", f"{tmp}/no/such/p.json"],
        "existing folder")
    bad("--dot at a folder", ["inspect", "mlp", "--dot", tmp], "--dot")
    bad("--top=-3", ["inspect", "mlp", "--top=-3"], "--top")
    bad("unknown model", ["plan", "nosuchmodel"], "nosuchmodel")
    bad("unknown model option", ["plan", "gpt:nosuch=1"], "nosuch")
    bad("bad model option value", ["plan", "gpt:layers=x"], "layers")
    bad("--cluster 2x", ["plan", "mlp", "--cluster", "2x"], "2x")
    bad("--cluster 0x4", ["plan", "mlp", "--cluster", "0x4"], "0x4")
    bad("--level O9", ["plan", "mlp", "--mesh", "2", "--level", "O9"], "O9")
    bad("--backend nosuch", ["plan", "mlp", "--mesh", "2", "--backend", "nosuch"], "nosuch")
    bad("--flops -1", ["plan", "mlp", "--mesh", "2", "--flops", "-1"], "--flops")
    bad("unknown subcommand", ["frobnicate"], "frobnicate")
    bad("--mesh beside --cluster", ["plan", "mlp", "--mesh", "2", "--cluster", "2x2"],
        "--mesh")
    p.append(Probe("bad options (CLI)", "plan --json is JSON", "ok",
                   cli=["plan", "mlp", "--mesh", "2", "--json"]))
    p.append(Probe("bad options (CLI)", "--version", "ok", cli=["--version"]))
    return p


def api_probes() -> list[Probe]:
    p = []

    def bad(name, body, *says, cls="bad options (API)", accept=()):
        p.append(Probe(cls, name, "error", says, code=body, accept=accept))

    call = "m, args = mlp()\n"
    bad("mesh_shape=(0,)", call + "rhino.auto_parallel(m.step, mesh_shape=(0,))", "mesh_shape")
    bad("memory_budget='2GB'", call + "rhino.auto_parallel(m.step, mesh_shape=(2,), "
        "memory_budget='2GB')", "memory_budget")
    bad("memory_budget=-1", call + "rhino.auto_parallel(m.step, mesh_shape=(2,), "
        "memory_budget=-1)", "memory_budget")
    bad("stages=0", call + "rhino.auto_parallel(m.step, cluster='2x1', stages=0)", "stages")
    bad("num_microbatches=0", call + "rhino.auto_parallel(m.step, cluster='2x1', "
        "num_microbatches=0)", "num_microbatches")
    bad("executor='nosuch'", call + "rhino.auto_parallel(m.step, cluster='2x1', "
        "executor='nosuch')", "nosuch")
    bad("opt_level='O9'", call + "rhino.auto_parallel(m.step, mesh_shape=(2,), opt_level='O9')",
        "O9")
    bad("cluster='2x'", call + "rhino.auto_parallel(m.step, cluster='2x')", "2x")
    bad("timeout=-1", call + "rhino.auto_parallel(m.step, cluster='2x1', timeout=-1)",
        "timeout")
    # Python's own refusal of an unknown keyword, as every function gives it
    bad("unknown option", call + "rhino.auto_parallel(m.step, mesh_shape=(2,), meshshape=2)",
        "unexpected keyword argument 'meshshape'", accept=("TypeError",))
    bad("mesh_shape and cluster", call + "rhino.auto_parallel(m.step, mesh_shape=(2,), "
        "cluster='2x1')", "cluster")
    bad("batch_args names nothing", call + "s = rhino.auto_parallel(m.step, cluster='2x1', "
        "batch_args=('nosuch',))\ns(*args)", "nosuch")
    bad("annotation of no value", call + "s = rhino.auto_parallel(m.step, mesh_shape=(2,), "
        "annotations={'nosuch': 'S[x]'})\ns(*args)", "nosuch")
    bad("annotation that does not divide",
        "s = rhino.auto_parallel(lambda w, x: (w - 0.1 * (x.T @ (x @ w)), jnp.sum(x @ w)), "
        "mesh_shape=(4,), annotations={'w': 'S[x]·R'})\ns(jnp.ones((6, 6)), jnp.ones((8, 6)))",
        "divisible")
    bad("more devices than there are", call + "s = rhino.auto_parallel(m.step, "
        "mesh_shape=(64,))\ns(*args)", "64")

    arg = "bad arguments"
    bad("too few arguments", call + "s = rhino.auto_parallel(m.step, mesh_shape=(2,))\n"
        "s(*args[:2])", "missing a required argument: 'batch'", cls=arg)
    bad("a string argument", call + "s = rhino.auto_parallel(m.step, mesh_shape=(2,))\n"
        "s(args[0], args[1], 'batch')", "argument batch", "found str", cls=arg)
    bad("a batch the annotation cannot split",
        "s = rhino.auto_parallel(lambda w, x: (w - 0.1 * (x.T @ (x @ w)), jnp.sum(x @ w)), "
        "mesh_shape=(2,), annotations={'x': 'S[x]·R'})\ns(jnp.ones((6, 6)), jnp.ones((7, 6)))",
        "divisible", cls=arg)
    bad("microbatches that do not divide the batch", "m, args = mlp(batch=6)\n"
        "s = rhino.auto_parallel(m.step, cluster='2x1', stages=2, num_microbatches=4)\n"
        "s(*args)", "6", cls=arg)
    p.append(Probe(arg, "new shapes between calls (SPMD)", "ok", code=(
        "m, a = mlp()\nm2, b = mlp(batch=16)\n"
        "with rhino.auto_parallel(m.step, mesh_shape=(2,)) as s:\n"
        "    same(s(*host(a))[-1], jax.jit(m.step)(*a)[-1])\n"
        "    same(s(*host(b))[-1], jax.jit(m2.step)(*b)[-1])")))
    p.append(Probe(arg, "new dtype between calls (SPMD)", "ok", code=(
        "f = lambda w, x: (w - 0.1 * x.T @ (x @ w), jnp.sum(x @ w))\n"
        "w, x = jnp.ones((8, 8)), jnp.arange(64.0).reshape(8, 8) / 64\n"
        "w16, x16 = w.astype(jnp.bfloat16), x.astype(jnp.bfloat16)\n"
        "want, want16 = jax.jit(f)(w, x), jax.jit(f)(w16, x16)\n"
        "with rhino.auto_parallel(f, mesh_shape=(2,)) as s:\n"
        "    same(s(w, x), want)\n"
        "    same(s(w16, x16), want16, rtol=2e-2)")))
    return p


def step_probes() -> list[Probe]:
    cls = "unusual steps"
    p = []

    def ok(name, body, timeout=180.0):
        p.append(Probe(cls, name, "ok", code=body, timeout=timeout))

    ok("zoo MLP, SPMD 2x4", "m, a = mlp()\nagainst_jit(m.step, a, mesh_shape=(2, 4))")
    ok("zoo MLP, 2 stages", "m, a = mlp()\nagainst_jit(m.step, a, cluster='2x1', stages=2, "
       "num_microbatches=2)")
    ok("zoo GPT, SPMD 4", "m = get_model('gpt', layers=2, hidden=64, heads=4, seq=16, "
       "batch=8)\np, o = m.init(jax.random.PRNGKey(0))\n"
       "against_jit(m.step, (p, o, m.make_batch(jax.random.PRNGKey(1))), mesh_shape=(4,), "
       "atol=1e-4)")
    ok("a step with no batch", "f = lambda w: (w * 0.5, jnp.sum(w))\n"
       "against_jit(f, (jnp.arange(16.0).reshape(4, 4),), mesh_shape=(2,))")
    ok("a while loop over the parameters", (
        "def f(w, x):\n"
        "    w2 = jax.lax.fori_loop(0, 3, lambda i, v: v - 0.01 * x.T @ (x @ v), w)\n"
        "    return w2, jnp.sum(w2)\n"
        "against_jit(f, (jnp.ones((8, 8)), jnp.arange(128.0).reshape(16, 8) / 128), "
        "mesh_shape=(2,))"))
    ok("cond on a parameter (SPMD)", (
        "def f(w, x):\n"
        "    w2 = jax.lax.cond(jnp.sum(w) > 0, lambda v: v * 0.9, lambda v: v, w)\n"
        "    return w2 - 0.01 * x.T @ (x @ w2), jnp.sum(x @ w2)\n"
        "against_jit(f, (jnp.ones((8, 8)), jnp.ones((16, 8))), mesh_shape=(4,))"))
    ok("integer and weak-typed inputs", (
        "def f(w, x, n):\n"
        "    return w + n * 0.5, jnp.sum(x.astype(jnp.float32) @ w)\n"
        "against_jit(f, (jnp.ones((8, 8)), jnp.arange(64).reshape(8, 8), 3), "
        "mesh_shape=(2,))"))
    ok("a PRNG key argument (pipeline)", (
        "def f(w, x, key):\n"
        "    def loss(v):\n"
        "        keep = jax.random.bernoulli(key, 0.8, x.shape)\n"
        "        return jnp.mean(jnp.tanh(jnp.where(keep, x, 0) @ v) ** 2)\n"
        "    l, g = jax.value_and_grad(loss)(w)\n"
        "    return w - 0.1 * g, l\n"
        "against_jit(f, (jnp.ones((16, 16)) * 0.1, jnp.ones((8, 16)), jax.random.key(0)), "
        "cluster='2x1', stages=2, num_microbatches=2, batch_args=('x',))"))
    p.append(Probe(cls, "BatchNorm-like statistics, pipelined", "error",
                   ("statistics of the whole batch", "per_microbatch_statistics"), code=(
        "def f(w, x):\n"
        "    def loss(v):\n"
        "        h = x @ v\n"
        "        h = (h - h.mean(0)) / (h.std(0) + 1e-3)\n"
        "        return jnp.mean(h ** 2)\n"
        "    l, g = jax.value_and_grad(loss)(w)\n"
        "    return w - 0.1 * g, l\n"
        "s = rhino.auto_parallel(f, cluster='2x1', stages=2, num_microbatches=2)\n"
        "s(np.ones((16, 16), np.float32), np.arange(128.0, dtype=np.float32)"
        ".reshape(8, 16))")))
    p.append(Probe(cls, "a step that raises", "error", ("ZeroDivisionError",), code=(
        "def f(w):\n    raise ZeroDivisionError('in the step')\n"
        "s = rhino.auto_parallel(f, mesh_shape=(2,))\ntry:\n"
        "    s(jnp.ones(4))\nexcept ZeroDivisionError as e:\n"
        "    raise rhino.RhinoError('ZeroDivisionError passed through: ' + str(e))")))
    return p


def executor_probes() -> tuple[list[Probe], list]:
    cls = "executor faults"
    closed, silent = _free_ports()
    addr = [f"127.0.0.1:{s.getsockname()[1]}" for s in (closed, silent)]
    stuck = (
        "import threading\nSTUCK = threading.Event()\n"
        "def blk(x):\n    if STUCK.is_set():\n        threading.Event().wait()\n    return x\n"
        "def f(w, x):\n"
        "    def loss(v):\n        return jnp.mean(jnp.tanh(x @ v) ** 2)\n"
        "    l, g = jax.value_and_grad(loss)(w)\n"
        "    l = jax.pure_callback(blk, jax.ShapeDtypeStruct(l.shape, l.dtype), l)\n"
        "    return w - 0.1 * g, l\n"
        "w, x = np.ones((16, 16), np.float32), np.ones((8, 16), np.float32)\n"
        "s = rhino.auto_parallel(f, cluster='2x1', stages=2, num_microbatches=2, timeout=60)\n"
        "s(w, x)\ns._last.run.executor.timeout = 3\nSTUCK.set()\nt = time.monotonic()\n"
        "try:\n    s(w, x)\nfinally:\n"
        "    assert time.monotonic() - t < 10, time.monotonic() - t\n    s.close()\n")
    p = [
        Probe(cls, "stuck local stage", "error", ("stage 1: the step did not finish",),
              code=stuck,
              timeout=120, max_seconds=90),
        Probe(cls, "rhino.init of a closed port", "error", (addr[0],),
              code=f"rhino.init(address={addr[0]!r}, timeout=10)", timeout=60,
              max_seconds=30),
        Probe(cls, "rhino.init of a port that never answers", "error", (addr[1], "within 5 s"),
              code=f"rhino.init(address={addr[1]!r}, timeout=5)", timeout=60, max_seconds=30),
        Probe(cls, "ray_address= of a closed port", "error", (addr[0],), code=(
            "m, a = mlp()\ns = rhino.auto_parallel(m.step, cluster='2x1', stages=2, "
            f"executor='ray', ray_address={addr[0]!r}, timeout=10)\ns.plan_for(*a)\n"
            "s(*a)"), timeout=120, max_seconds=60),
    ]
    return p, [closed, silent]


def _run(probe: Probe, tmp: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    if probe.cli is not None:
        argv = [sys.executable, "-m", "rhino.cli", *probe.cli]
    else:
        body = textwrap.indent(probe.code, "    ")
        path = os.path.join(tmp, f"probe_{abs(hash(probe.name))}.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(PRELUDE + WRAP.format(body=body, accept=", ".join(
                (*probe.accept, "rhino.RhinoError"))))
        argv = [sys.executable, path]
    t0 = time.monotonic()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=probe.timeout,
                             env=env, cwd=tmp, errors="replace")
    except subprocess.TimeoutExpired:
        return dict(outcome="hang", seconds=probe.timeout, detail="")
    took = time.monotonic() - t0
    outcome, detail = classify(probe, out.returncode, out.stdout, out.stderr)
    if outcome == "clear" and probe.max_seconds is not None and took > probe.max_seconds:
        outcome, detail = "unclear", f"refused after {took:.0f} s: " + detail
    return dict(outcome=outcome, seconds=round(took, 1), detail=detail[-600:])


def classify(probe: Probe, rc: int, stdout: str, stderr: str) -> tuple[str, str]:
    if rc < 0 or "Traceback (most recent call last)" in stderr or "Fatal Python" in stderr:
        return "crash", stderr.strip()[-600:] or f"signal {-rc}"
    if probe.cli is not None:
        if rc == 0:
            if probe.expect == "ok":
                if "--json" in probe.cli:
                    try:
                        json.loads(stdout)
                    except ValueError as e:
                        return "silent", f"stdout is not JSON: {e}"
                return "correct", ""
            return "silent", "exit 0: " + stdout.strip()[-300:]
        msg = stderr.strip()
        if probe.expect == "ok":
            return "crash", msg
        if rc != 2 or msg.count("\n") != 0:
            return "unclear", f"exit {rc}: {msg}"
        missing = [s for s in probe.says if s not in msg]
        return ("unclear", f"lacks {missing}: {msg}") if missing else ("clear", msg)
    raised = next((ln for ln in stdout.splitlines() if ln.startswith("RAISED ")), None)
    wrong = next((ln for ln in stdout.splitlines() if ln.startswith("WRONG")), None)
    if rc == 4 and wrong:
        return "silent", wrong
    if rc == 0 and "OK" in stdout.splitlines():
        return ("correct", "") if probe.expect == "ok" else ("silent", "ran without error")
    if raised is None:
        return "crash", (stderr.strip() or stdout.strip())[-600:]
    if probe.expect == "ok":
        return "unclear", raised
    missing = [s for s in probe.says if s not in raised]
    return ("unclear", f"lacks {missing}: {raised}") if missing else ("clear", raised)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rhino-probes-") as tmp:
        ex, sockets = executor_probes()
        probes = [*file_probes(tmp), *cli_probes(tmp), *api_probes(), *step_probes(), *ex]
        probes = [p for p in probes if args.only in f"{p.cls}: {p.name}"]
        # the long ones first, so that the pool ends together
        order = sorted(probes, key=lambda p: -p.timeout)
        with ThreadPoolExecutor(args.jobs) as pool:
            results = dict(zip((p.name for p in order),
                               pool.map(lambda p: _run(p, tmp), order)))
        for s in sockets:
            s.close()
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    rows = []
    for p in probes:
        r = results[p.name]
        table[p.cls][r["outcome"]] += 1
        rows.append(dict(cls=p.cls, name=p.name, **r))
        print(f"{r['outcome']:8s} {r['seconds']:6.1f} s  {p.cls}: {p.name}"
              + (f"\n{'':18s}{r['detail'][:300]}" if r["outcome"] not in ("clear", "correct")
                 else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print()
    print("| class | probes | " + " | ".join(OUTCOMES) + " |")
    print("|---|---:|" + "---:|" * len(OUTCOMES))
    total = collections.Counter()
    for c, n in table.items():
        total.update(n)
        print(f"| {c} | {sum(n.values())} | " + " | ".join(str(n[o]) for o in OUTCOMES) + " |")
    print(f"| **all** | {sum(total.values())} | "
          + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    return 0 if set(total) <= {"clear", "correct"} else 1


if __name__ == "__main__":
    sys.exit(main())
