"""`run_bench` end to end on the CPU with the GPU parts swapped out: our linear is the fp32 reference (so every
implementation passes its check), the timers are fixed numbers. What is left is the driver's own logic: which
cases and implementations a request makes, weight copies, references, MoE routing and bytes floors, a model
layer's distinct linears. (The same paths on real kernels: tests/gpu/test_bench.py.)"""

import contextlib

import pytest
import torch

from exl3tool import reference
from exl3tool.bench import cases as C
from exl3tool.bench import run
from exl3tool.bench.report import Environment, Timing, exl3_weight_bytes, floor_us
from exl3tool.bench.request import BenchRequest, MoESpec
from exl3tool.ops import blocks
from helpers import fake_timers, model_dir

COPY_TBS = 2.0


class _Lin:
    """DeviceLinear stand-in on the CPU: the loaded tensors."""

    def __init__(self, t, device=None):
        self.t, self.info = t, t.info


def _reference_linear(x, lin, out_dtype=None, path="auto", out=None):
    return reference.linear_forward(x, lin.t).to(out_dtype or x.dtype)


@pytest.fixture
def cpu_bench(monkeypatch):
    monkeypatch.setattr(run, "require_gpu", lambda device=None: torch.device("cpu"))
    monkeypatch.setattr(run, "target_arch", lambda device=None: "cpu")
    monkeypatch.setattr(run, "environment", lambda device, arch: Environment(
        "CPU", arch, "cpu", 1, 1 << 20, COPY_TBS, torch.__version__, None, None, "now"))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(C, "memory_limit", lambda nbytes, device: 3)
    monkeypatch.setattr(C.DeviceLinear, "from_tensors", classmethod(lambda cls, t, device=None: _Lin(t)))
    monkeypatch.setattr(C, "linear_forward", _reference_linear)
    monkeypatch.setattr(blocks, "linear_forward", _reference_linear)
    monkeypatch.setattr(C, "MOE_IMPLEMENTATIONS", {k: v for k, v in C.MOE_IMPLEMENTATIONS.items() if k != "fused"})
    monkeypatch.setattr(run, "first_call_s", lambda call: (call(), 0.25))
    return fake_timers(monkeypatch, run, graph_us=10.0, eager_us=20.0)


def test_synthetic_linears(cpu_bench):
    request = BenchRequest(shapes=((256, 384),), bits=(2.0, 4.0), tokens=(1, 16), modes=("graph", "eager"),
                           replays=5)
    report = run.run_bench(request)
    assert [(c.bits, c.tokens) for c in report.cases] == [(2.0, 1), (2.0, 16), (4.0, 1), (4.0, 16)]
    for case in report.cases:
        assert case.weight_bytes == exl3_weight_bytes(256, 384, case.bits)
        assert case.floor_us == pytest.approx(floor_us(case.weight_bytes, COPY_TBS))
        impls = [(r.implementation, r.mode, r.status) for r in case.results]
        assert impls == [(name, mode, "ok") for name in ("exl3tool", "dequant+fp16", "torch fp16")
                         for mode in ("graph", "eager")]
        for r in case.results:
            assert r.check.passed and r.compile_s == 0.25 and r.copies == 3
            assert set(r.vs) == {"exl3tool", "dequant+fp16", "torch fp16"} - {r.implementation}
    assert not report.wrong
    # each mode times all three implementations together (in turns), each loop through every weight copy
    assert cpu_bench == ([("graph", 3)] * 3 + [("eager", 3)] * 3) * 4  # 4 cases
    assert report.settings.modes == ("graph", "eager")


def test_synthetic_moe_block(cpu_bench):
    request = BenchRequest(moe=(MoESpec(8, 2, 256, 128),), bits=(4.0,), tokens=(1, 64), modes=("graph", "eager"),
                           replays=5)
    report = run.run_bench(request)
    assert [c.tokens for c in report.cases] == [1, 64]
    one, many = report.cases
    assert one.kind == "moe" and one.group == "moe 256x256 K4 mcg 8e top-2 I=128"
    assert one.experts["touched"] == 2 and many.experts["touched"] == 8  # 64 tokens reach every expert
    per_expert = 3 * exl3_weight_bytes(256, 128, 4)
    assert one.weight_bytes == 2 * per_expert and many.weight_bytes == 8 * per_expert
    assert one.flops == 2 * 2 * 3 * 256 * 128  # one token, two routes, three linears
    status = {(r.implementation, r.mode): r.status for r in one.results}
    assert status == {("per-expert", "graph"): "eager-only", ("per-expert", "eager"): "ok",
                      (C.SAME_FLOPS_GEMM, "graph"): "ok", (C.SAME_FLOPS_GEMM, "eager"): "ok"}
    assert all(r.check.passed for r in one.results if r.implementation == "per-expert")
    # the yardstick: the block's FLOPs in one GEMM of its routes' rows (2 x 64 x 256 @ 256 x 384), timed, unchecked
    gemm = [r for r in many.results if r.implementation == C.SAME_FLOPS_GEMM]
    assert all(r.check is None and r.timing is not None for r in gemm)
    assert "[128, 256] @ [256, 384]" in gemm[0].note and 2 * 128 * 256 * 384 == many.flops
    assert {r.mode: r.vs for r in many.results if r.implementation == "per-expert"}["eager"][C.SAME_FLOPS_GEMM] == 1


def test_model_layer(cpu_bench):
    request = BenchRequest(model=str(model_dir("qwen3moe_mul1")), layer=1, tokens=(4,), replays=5)
    report = run.run_bench(request)
    kinds = [(c.kind, c.name, c.shape) for c in report.cases]
    # every distinct (in, out, K, codebook) once, named by its first linear; then the layer's MoE block
    assert kinds == [("linear", "self_attn.q_proj (+1 alike)", "256x256"),
                     ("linear", "self_attn.k_proj (+9 alike)", "256x128"),  # k, v, 4 experts' gate and up
                     ("linear", "mlp.experts.0.down_proj (+3 alike)", "128x256"),
                     ("moe", "mlp", "256x256")]
    assert report.cases[0].codebook == "mul1" and report.cases[-1].experts["experts"] == 4
    assert all(r.check.passed for c in report.cases for r in c.results if r.check is not None)


def test_dense_model_layer(cpu_bench):
    report = run.run_bench(BenchRequest(model=str(model_dir("llama_mcg")), layer=0, tokens=(3,), replays=5))
    mlp = report.cases[-1]
    assert (mlp.kind, mlp.name) == ("mlp", "mlp") and mlp.bits is not None
    assert [r.implementation for r in mlp.results] == ["exl3tool", "dequant+fp16", "torch fp16"]
    assert all(r.status == "ok" and r.check.passed for r in mlp.results)
    import exl3tool

    with exl3tool.open_checkpoint(str(model_dir("llama_mcg"))) as ckpt:
        block = ckpt.layer(0).mlp
    assert mlp.flops == sum(2 * 3 * i.in_features * i.out_features for i in block.linears)
    assert mlp.weight_bytes == sum(exl3_weight_bytes(i.in_features, i.out_features, i.bits) for i in block.linears)


def test_wrong_implementation_is_reported_not_timed(cpu_bench, monkeypatch):
    wrong = dict(C.LINEAR_IMPLEMENTATIONS, exl3tool=lambda g, x: C.Impl(
        "exl3tool", lambda c: torch.zeros(x.shape[0], g.info.out_features), 2, 1))
    monkeypatch.setattr(C, "LINEAR_IMPLEMENTATIONS", wrong)
    report = run.run_bench(BenchRequest(shapes=((128, 128),), tokens=(2,), replays=5))
    (case,) = report.cases
    ours = case.results[0]
    assert ours.implementation == "exl3tool" and ours.status == "wrong" and ours.timing is None
    assert not ours.check.passed and ours.vs == {}
    assert report.wrong == [(case, ours)]
    assert cpu_bench == [("graph", 3), ("graph", 3)]  # only the two peers were timed


def test_linear_with_bias_every_implementation_checks(cpu_bench):
    from exl3tool.synthetic import random_linear

    ctx = run.Context(torch.device("cpu"), torch.float16, 0, 1 << 20, COPY_TBS, ())
    t = random_linear(256, 200, 3, "3inst", seed=5, bias=True, name="biased")
    group = C.LinearGroup("biased", [t, C.clone(t)], ctx)
    case = run.measure(group.setup(5), ctx, BenchRequest(shapes=((256, 200),), replays=5))
    assert case.weight_bytes == exl3_weight_bytes(256, 200, 3, bias=True)
    assert [(r.implementation, r.status) for r in case.results] == [
        ("exl3tool", "ok"), ("dequant+fp16", "ok"), ("torch fp16", "ok")]
    assert all(r.check.passed for r in case.results)


def test_cli_table_json_file_and_plot(cpu_bench, tmp_path):
    import json

    from helpers import run_cli

    result = run_cli("bench", "--shape", "256x384", "--tokens", "1,16", "--mode", "both", "--replays", "5",
                     "--plot", tmp_path / "perf.png", "--json-out", tmp_path / "perf.json")
    assert result.exit_code == 0, result.stderr
    assert "linear 256x384 K4 mcg" in result.stdout and "torch fp16" in result.stdout
    assert "path gemm at this M" in result.stdout  # the auto path at M=1, as a note
    data = json.loads((tmp_path / "perf.json").read_text())
    assert data["schema"] == "exl3tool.bench/1" and len(data["cases"]) == 2
    assert (tmp_path / "perf.png").read_bytes()[:4] == b"\x89PNG"
    as_json = run_cli("bench", "--shape", "256x384", "--tokens", "4", "--replays", "5", "-f", "json").json()
    assert [r["implementation"] for r in as_json["cases"][0]["results"]] == ["exl3tool", "dequant+fp16",
                                                                             "torch fp16"]


def test_peer_rows_when_it_cannot_run(cpu_bench, monkeypatch):
    """A requested peer that fails to build is a 'failed' row (its error as the note); ExLlamaV3's MoE block on
    a model layer is 'skipped' (it loads whole model folders: --moe only)."""
    monkeypatch.setattr(run, "require_peers", lambda peers: None)
    report = run.run_bench(BenchRequest(model=str(model_dir("qwen3moe_mul1")), layer=0, tokens=(2,),
                                        peers=("exllamav3",), replays=5))
    linear, moe = report.cases[0], report.cases[-1]
    peer = next(r for r in linear.results if r.implementation == "exllamav3")
    assert peer.status == "failed" and "exllamav3" in peer.note and peer.timing is None
    skipped = next(r for r in moe.results if r.implementation == "exllamav3")
    assert skipped.status == "skipped" and "--moe layers only" in skipped.note
    assert report.wrong and all(r.implementation == "exllamav3" for _, r in report.wrong)


def test_exllamav3_extension_is_built_once_a_process(tmp_path, monkeypatch):
    """A failing ExLlamaV3 extension build (minutes) is tried once, not again by every case: later calls raise
    the first attempt's error."""
    import sys

    from exl3tool.bench import peers

    package = tmp_path / "exllamav3"
    package.mkdir()
    (package / "__init__.py").write_text("tries = 0\n")
    (package / "ext.py").write_text("import exllamav3\nexllamav3.tries += 1\nraise RuntimeError('nvcc failed')\n")
    for name in [n for n in sys.modules if n == "exllamav3" or n.startswith("exllamav3.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    peers._exllamav3_ext_error.cache_clear()
    try:
        for _ in range(3):
            with pytest.raises(RuntimeError, match="nvcc failed"):
                peers.require_exllamav3_ext()
        assert sys.modules["exllamav3"].tries == 1
    finally:
        peers._exllamav3_ext_error.cache_clear()  # the stand-in's error is not the process's
        for name in [n for n in sys.modules if n == "exllamav3" or n.startswith("exllamav3.")]:
            del sys.modules[name]
