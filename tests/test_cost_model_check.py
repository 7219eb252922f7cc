"""``benchmarks/cost_model_check.py`` (issue 45): its statistics on hand-made pairs (default
suite), and the whole check on toy models (slow: plans, compiles and times several
steps on the 8 CPU devices)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "cost_model_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import cost_model_check as cmc  # noqa: E402


def test_ranks_share_ties_and_spearman_reads_them():
    assert cmc.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert cmc.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert cmc.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Pearson's of ranks (1, 2, 3, 4) and (1, 3, 2, 4): 0.8.
    assert cmc.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert cmc.spearman([1, 2], [1, 2]) is None and cmc.spearman([1, 1, 1], [1, 2, 3]) is None


def test_summary_of_pairs():
    def pair(model, plan, est, meas):
        return {"model": model, "plan": plan, "estimate_s": est, "measured_s": meas,
                "error": est / meas - 1}

    pairs = [pair("a", "dp", 1.0, 1.2), pair("a", "rhino", 0.9, 1.0),
             pair("a", "fsdp", 2.0, 1.6), pair("b", "dp", 3.0, 3.0),
             pair("b", "rhino", 2.5, 3.2), pair("b", "megatron", 2.0, 3.1),
             {"model": "b", "plan": "pipeline", "error": "PlanningError: ..."}]
    s = cmc.summarize(pairs)
    assert s["pairs_measured"] == 6
    errors = sorted(abs(p["error"]) for p in pairs[:6])
    assert s["median_abs_error"] == pytest.approx((errors[2] + errors[3]) / 2)
    assert s["models"]["a"]["fastest_measured"] == "rhino" and s["models"]["a"]["chosen_ok"]
    # b: rhino's plan measured 3.2 against dp's 3.0: 6.7 % slower, beyond the 5 % allowed.
    b = s["models"]["b"]
    assert b["chosen_over_fastest"] == pytest.approx(3.2 / 3.0) and not b["chosen_ok"]
    assert not s["chosen_ok"]
    # Two pairs that planned one program are one plan: their steps are pooled.
    pairs[4].update(plan_key="k", times_s=[3.2, 3.3, 3.4])
    pairs[3].update(plan_key="k", times_s=[2.9, 3.0, 3.05])
    b = cmc.summarize(pairs)["models"]["b"]
    # Pooled median 3.125 against megatron's 3.1: 0.8 % slower.
    assert b["chosen_same_as"] == ["dp"] and b["fastest_plan"] == ["megatron"]
    assert b["chosen_over_fastest"] == pytest.approx(3.125 / 3.1) and b["chosen_ok"]


def test_peer_pins_cover_every_leaf():
    from rhino.models import get_model

    m = get_model("gpt", **cmc.QUICK["gpt"])
    args = m.example_args()
    leaves = cmc.arg_leaves(m.step, args)
    for plan in ("dp", "fsdp", "megatron", "dp_tp"):
        pins = cmc.peer_annotations(plan, "gpt", m.step, args)
        assert set(pins) == {f"{n}{k}" for n, k, _ in leaves}
    mega = cmc.peer_annotations("megatron", "gpt", m.step, args)
    assert tuple(mega["params['layers'][0]['wqkv']"]) == (None, "x")
    assert tuple(mega["batch['tokens']"]) == ()
    dp_tp = cmc.peer_annotations("dp_tp", "gpt", m.step, args)
    assert tuple(dp_tp["opt_state[0].mu['layers'][0]['wo']"]) == ("y", None)
    assert tuple(dp_tp["batch['tokens']"]) == ("x",)


@pytest.mark.slow
def test_the_check_on_toy_models(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--models", "gpt",
                           "--plans", "dp,megatron,rhino,pipeline", "--rounds", "1",
                           "--steps", "2", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert {"pairs", "spearman", "median_abs_error", "summary"} <= set(r)
    assert [p["plan"] for p in r["pairs"]] == ["dp", "megatron", "rhino", "pipeline"]
    for p in r["pairs"]:
        assert p["estimate_s"] > 0 and p["measured_s"] > 0 and p["steps"] == 2, p
        assert p["error"] == pytest.approx(p["estimate_s"] / p["measured_s"] - 1)
    assert r["pairs"][-1]["stages"] == 2
    assert "| gpt | rhino |" in proc.stdout and "chosen_ok" in r["summary"]
