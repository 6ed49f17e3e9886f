"""`exl3tool bench` on the GPU: tiny runs whose every row was checked against the reference and then timed, in
both modes, for synthetic linears, a synthetic MoE block and a real layer (the genuine Qwen3-MoE example)."""

import pytest

from exl3tool.bench.cases import SAME_FLOPS_GEMM
from tests.helpers import model_dir, run_cli

pytestmark = pytest.mark.gpu


def _bench(*args):
    result = run_cli("bench", *args, "--replays", "5", "-f", "json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json()
    assert report["schema"] == "exl3tool.bench/1" and report["environment"]["copy_tbs"] > 0.1
    return report


def _timed(r):
    """A checked, timed row: sound figures (per-call times, a positive host time, derived numbers)."""
    assert r["status"] == "ok" and r["check"]["passed"], r
    assert r["check"]["rel_l2"] <= 1e-2 and r["check"]["cosine"] >= 0.9999
    assert 0 < r["min_us"] <= r["median_us"] <= r["max_us"] and r["host_us"] > 0 and r["repeats"] == 5
    assert r["weight_gbs"] > 0 and r["tflops"] > 0 and r["compile_s"] >= 0 and r["copies"] >= 2


def test_tiny_linear_both_modes():
    report = _bench("--shape", "256x512", "--tokens", "1,16", "--mode", "both")
    assert [c["tokens"] for c in report["cases"]] == [1, 16]
    for case in report["cases"]:
        assert case["floor_us"] > 0 and case["flops"] == 2 * case["tokens"] * 256 * 512
        rows = {(r["implementation"], r["mode"]): r for r in case["results"]}
        assert set(rows) == {(i, m) for i in ("exl3tool", "dequant+fp16", "torch fp16") for m in ("graph", "eager")}
        for (impl, mode), r in rows.items():
            _timed(r)
            others = {i for i, m in rows if m == mode and i != impl}
            assert set(r["vs"]) == others  # a same-run ratio to every other implementation, same mode
            assert r["vs"]["exl3tool" if impl != "exl3tool" else "torch fp16"] > 0


def test_synthetic_moe_block():
    report = _bench("--moe", "8:2:256:128", "--tokens", "1,16", "--mode", "both")
    for case in report["cases"]:
        assert case["kind"] == "moe" and 1 <= case["experts"]["touched"] <= 8
        rows = {(r["implementation"], r["mode"]): r for r in case["results"]}
        assert rows["per-expert", "graph"]["status"] == "eager-only"  # host syncs: never captured
        _timed(rows["per-expert", "eager"])
        _timed(rows["fused", "graph"])
        _timed(rows["fused", "eager"])
        for mode in ("graph", "eager"):
            _yardstick(rows, mode)


def _yardstick(rows, mode):
    """The same-FLOPs GEMM of a MoE case: timed, not checked, a ratio on the fused row."""
    gemm = rows[SAME_FLOPS_GEMM, mode]
    assert gemm["status"] == "ok" and gemm["check"] is None and gemm["copies"] == 1
    assert 0 < gemm["min_us"] <= gemm["median_us"] and gemm["tflops"] > 0
    assert rows["fused", mode]["vs"][SAME_FLOPS_GEMM] == pytest.approx(
        gemm["median_us"] / rows["fused", mode]["median_us"])


def test_real_layer_linears_and_block():
    report = _bench(str(model_dir("qwen3moe_mul1")), "--layer", "1", "--tokens", "4", "--mode", "eager")
    kinds = [c["kind"] for c in report["cases"]]
    assert kinds.count("moe") == 1 and kinds.count("linear") == 3
    for case in report["cases"]:
        rows = {(r["implementation"], r["mode"]): r for r in case["results"]}
        for (impl, mode), r in rows.items():
            if impl == SAME_FLOPS_GEMM:
                _yardstick(rows, mode)
            else:
                _timed(r)


def test_implementations_take_turns():
    """time_interleaved times one launch of each in every round (same clocks for all), and its per-call figures
    come from CUDA events: a launch that sleeps 200 us on the GPU per call reads about that."""
    import torch

    from exl3tool.bench.timing import time_interleaved

    order = []

    def sleeper(name, calls):
        def launch():
            order.append(name)
            for _ in range(calls):
                torch.cuda._sleep(200_000)  # ~100+ us of GPU cycles per call at any clock
        return launch

    a, b = time_interleaved([(sleeper("a", 1), 1), (sleeper("b", 2), 2)], repeats=6)
    assert order == ["a", "b"] * 6
    assert a.repeats == b.repeats == 6
    assert 0.5 < b.median_us / a.median_us < 2.0  # per call: b's two calls are divided by two
