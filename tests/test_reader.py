"""The reader interface shared by source checkpoints and prepared folders: a source checkpoint's moe(n) stacks
its experts in memory bit-identically to prepare's stored stacks, and both readers give the same reference."""

from __future__ import annotations

import pytest
import torch

import exl3tool
from exl3tool.prepared import load_prepared, prepare_checkpoint
from exl3tool.prepared.layout import GROUP_STACKS
from exl3tool.reader import CheckpointReader, reference_forward
from exl3tool.synthetic import write_checkpoint

from helpers import model_dir

CASES = {
    "qwen3moe_fixture": None,
    "two_groups_shared": dict(arch="qwen2_moe", hidden=256, moe_intermediate=128, num_experts=6, top_k=3,
                                   num_layers=1, vocab=256, per_linear={"*.experts.[02].*": (3, "3inst")}),
    "deepseek": dict(arch="deepseek_v3", hidden=256, moe_intermediate=128, num_experts=8, top_k=2, num_layers=1,
                     vocab=256, n_group=2, topk_group=1),
}


def source(tmp_path, case):
    spec = CASES[case]
    return model_dir("qwen3moe_mul1") if spec is None else write_checkpoint(tmp_path / "src", **spec)


def moe_layers(reader):
    return [layer.index for layer in reader.layers if isinstance(layer.mlp, exl3tool.format.MoEBlock)]


@pytest.mark.parametrize("case", list(CASES))
def test_source_moe_stacks_like_prepare(tmp_path, case):
    src_dir = source(tmp_path, case)
    prepare_checkpoint(src_dir, tmp_path / "prep")
    with exl3tool.open_checkpoint(src_dir) as src, load_prepared(tmp_path / "prep") as prep:
        assert isinstance(src, CheckpointReader) and isinstance(prep, CheckpointReader)
        layers = moe_layers(src)
        assert layers and layers == moe_layers(prep)
        for n in layers:
            a, b = src.moe(n), prep.moe(n)
            assert len(a.groups) == len(b.groups) >= 1
            if case == "two_groups_shared":
                assert len(a.groups) == 2 and a.shared is not None and a.shared_gate is not None
            for ga, gb in zip(a.groups, b.groups):
                assert ga.experts == gb.experts and ga.shapes() == gb.shapes()
                for field in GROUP_STACKS:
                    x, y = getattr(ga, field), getattr(gb, field)
                    assert (x is None) == (y is None), field
                    if x is not None:
                        assert x.dtype == y.dtype and torch.equal(x, y), field
            assert torch.equal(a.router, b.router)
            x = torch.randn(5, a.hidden, dtype=torch.float16)
            ref_a = src.reference_forward(a.name, x)
            assert torch.equal(ref_a, prep.reference_forward(a.name, x))
            loaded = {}
            cached = reference_forward(src, a.name, x, load_linear=lambda name, dev: loaded.setdefault(
                name, src.load_linear(name, dev)))
            assert torch.equal(ref_a, cached) and loaded


def test_lookups_share_one_wording(tmp_path):
    prepare_checkpoint(model_dir("qwen3moe_mul1"), tmp_path / "prep")
    with exl3tool.open_checkpoint(model_dir("qwen3moe_mul1")) as src, load_prepared(tmp_path / "prep") as prep:
        for reader in (src, prep):
            with pytest.raises(exl3tool.errors.NotFoundError, match="no layer 99; layers are"):
                reader.layer(99)
            with pytest.raises(exl3tool.errors.NotFoundError, match="no MLP or MoE block of that name"):
                reader.block("model.layers.0.nothing")
