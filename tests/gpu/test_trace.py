"""exl3tool.bench.trace on the GPU: the traced layer computes what the untraced one does, bit for bit, and its stamps
follow the kernels' order (every CTA's points in turn; PDL's waits return only after the kernel before has ended)."""

import pytest
import torch

import exl3tool
from exl3tool.bench.trace import live_ctas, report, trace_layer, unused_ctas
from exl3tool.kernels import ptx
from exl3tool.ops.moe import DeviceMoE, moe_forward, plan_moe
from exl3tool.synthetic import write_checkpoint
from tests.gpu.test_moe import SYNTHETIC

pytestmark = pytest.mark.gpu
QWEN3_30B, _ = SYNTHETIC["qwen3-30b-shape-k4-mcg"]


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("trace"), num_layers=1, vocab=256, head_bits=16, embeddings=False,
                            **QWEN3_30B)
    ckpt = exl3tool.open_checkpoint(path)
    try:
        yield DeviceMoE.from_layer(ckpt.moe(0, device="cuda"))
    finally:
        ckpt.close()


@pytest.mark.parametrize("m", [1, 16])
def test_trace_follows_the_kernels(layer, m):
    us, stamps = trace_layer(m, [layer])
    assert us > 0
    route, gate_up, down = (live_ctas(stamps, r) for r in (ptx.TRACE_ROUTE, ptx.TRACE_GATE_UP, ptx.TRACE_DOWN))
    assert len(route) == 128 // 16 * -(-m // 8) and len(gate_up) > 0 and len(down) > 0
    for rows in (gate_up, down):
        points = rows[:, [ptx.TRACE_ENTRY, ptx.TRACE_WAITED, ptx.TRACE_LOOP, ptx.TRACE_END]]
        assert (points[:, 1:] >= points[:, :-1]).all()  # each CTA's points in order
    # gate/up waits for the route's grid (at M = 1 directly, else behind the input rotation)
    assert gate_up[:, ptx.TRACE_WAITED].min() >= route[:, ptx.TRACE_END].max()
    if m == 1:  # gate/up rotates x itself after its wait; down waits for gate/up's grid (its fused tail included)
        prologue = gate_up[:, ptx.TRACE_PROLOGUE]
        assert (prologue >= gate_up[:, ptx.TRACE_WAITED]).all() and (prologue <= gate_up[:, ptx.TRACE_LOOP]).all()
        assert down[:, ptx.TRACE_WAITED].min() >= gate_up[:, ptx.TRACE_END].max()
        assert len(gate_up) == 8 * 24 * plan_moe(layer, 1).step(1, False).shape.splits13
    if m == 16:  # the grid's route blocks past the used ones: their CTAs enter and leave without a main loop
        t0 = route[:, ptx.TRACE_ENTRY].min()
        unused = unused_ctas(stamps, ptx.TRACE_GATE_UP, t0)
        assert len(unused) > 0 and (unused[:, ptx.TRACE_LOOP] < t0).all()
    lines = report(stamps)
    assert lines[1].startswith(f"route: {len(route)} CTAs") and any(line.startswith("down:") for line in lines)
    assert (m == 16) == any("without a block" in line for line in lines)
    assert lines[-1].startswith("GEMM slots: ")


def test_traced_layer_is_bit_identical_to_the_untraced(layer, seed):
    from exl3tool.bench.trace import tracing

    m = 3
    x = (torch.randn(m, layer.hidden, device="cuda") * 0.1).half()
    plain = moe_forward(x, plan_moe(layer, m)).clone()
    with tracing("cuda") as stamps:
        traced = moe_forward(x, plan_moe(layer, m)).clone()
        torch.cuda.synchronize()
        assert (stamps[ptx.TRACE_ROUTE, :, -1] != 0).any()  # the kernels traced
    assert torch.equal(traced, plain)
