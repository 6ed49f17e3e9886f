"""Kernels loaded from the on-disk cache run as the ones compiled: two processes over one fresh cache folder, the
first compiling every kernel and the second loading every one, give bit-identical outputs for the example
checkpoint's MoE layer (fused path) and a dense linear, eager and in graph replay, each within MAX_REL of the fp32
reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, model_dir

pytestmark = pytest.mark.gpu
MAX_REL = 1e-2

# One process: the layer and a linear at two token counts each, NaN-poisoned outputs, eager then graph replay;
# saves the outputs and the fp32 reference and prints the cache's counts.
SCRIPT = r"""
import json, sys
import torch
import exl3tool
from exl3tool.ops import kernel_cache
from exl3tool.ops.linear import DeviceLinear, linear_forward
from exl3tool.ops.moe import DeviceMoE, moe_forward, plan_moe

reader = exl3tool.open_checkpoint(sys.argv[1])
moe = reader.moe(0, device="cuda")
plan = plan_moe(DeviceMoE.from_layer(moe), 33)
name = next(iter(reader.linears))  # the first attention projection
lin = DeviceLinear.from_tensors(reader.load_linear(name), "cuda")
g = torch.Generator(device="cuda").manual_seed(1)
got, want = {}, {}
for m in (1, 33):
    x = (torch.randn(m, moe.hidden, device="cuda", generator=g) * 0.1).half()
    plan.y.fill_(float("nan"))
    got[f"moe{m}"] = moe_forward(x, plan).clone()
    want[f"moe{m}"] = reader.reference_forward(moe.name, x).float()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, plan)
    out.fill_(float("nan"))
    graph.replay()
    got[f"moe{m}-graph"] = out.clone()
    xl = (torch.randn(m, lin.info.in_features, device="cuda", generator=g) * 0.1).half()
    y = torch.full((m, lin.info.out_features), float("nan"), dtype=torch.float16, device="cuda")
    got[f"linear{m}"] = linear_forward(xl, lin, out=y).clone()
    want[f"linear{m}"] = reader.reference_forward(name, xl).float()
torch.save({"got": {k: v.cpu() for k, v in got.items()}, "want": {k: v.cpu() for k, v in want.items()}}, sys.argv[2])
print(json.dumps(vars(kernel_cache.counts)))
"""


def run(tmp_path, cache, tag):
    out = tmp_path / f"{tag}.pt"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir("qwen3moe_mul1")), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EXL3TOOL_KERNEL_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), torch.load(out)


def rel(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def test_kernels_loaded_from_the_cache_match_the_compiled_ones_bit_for_bit(tmp_path):
    cache = tmp_path / "kernels"
    first, compiled = run(tmp_path, cache, "compiled")
    assert first["compiled"] > 3 and first["loaded"] == 0 and first["stored"] == first["compiled"]
    assert len(list(cache.glob("k*.o"))) == first["compiled"]
    second, loaded = run(tmp_path, cache, "loaded")
    assert second == {"loaded": first["compiled"], "compiled": 0, "stored": 0}
    for key, y in compiled["got"].items():
        assert torch.isfinite(y).all(), key
        assert torch.equal(loaded["got"][key], y), key
        base = key.removesuffix("-graph")
        assert torch.equal(y, compiled["got"][base]), key  # graph replay = eager
        assert rel(y, compiled["want"][base]) < MAX_REL, key
