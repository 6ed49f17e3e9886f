"""The synthetic checkpoint writer: what it writes is what the reader finds, for every architecture."""

from __future__ import annotations

import json

import pytest
import torch

import exl3tool
from exl3tool.format import Codebook, MoEBlock
from exl3tool.synthetic import ModelSpec, random_linear, write_checkpoint, write_moe_layer
from helpers import edit_config, run_cli


@pytest.mark.parametrize("arch, block, experts_names", [
    ("llama", "mlp", None), ("qwen3_moe", "mlp", "gate_proj"), ("qwen2_moe", "mlp", "gate_proj"),
    ("qwen3_next", "mlp", "gate_proj"), ("mixtral", "block_sparse_moe", "w1"), ("minimax_m2", "block_sparse_moe", "w1"),
    ("deepseek_v3", "mlp", "gate_proj"), ("gpt_oss", "mlp", "gate_proj"), ("lfm2_moe", "feed_forward", "w1"),
])
def test_every_architecture_reads_back(tmp_path, arch, block, experts_names):
    spec = ModelSpec(arch=arch, num_layers=2, num_experts=3, hidden=384, intermediate=200, moe_intermediate=160,
                     shards=2, head_bits=16 if arch == "llama" else 2.5, codebook="mul1",
                     per_linear={"*.o_proj": (8, "3inst"), "*.self_attn.out_proj": (8, "3inst")},
                     n_group=1,  # 3 experts: not in 2 routing groups
                     full_attention_interval=2)  # qwen3_next: layer 0 linear attention, layer 1 full
    path = write_checkpoint(tmp_path / arch, spec)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    with exl3tool.open_checkpoint(path) as ckpt:
        assert ckpt.check() == []
        layer = ckpt.layer(1)
        o_proj = layer.attention.projections["out_proj" if arch == "lfm2_moe" else "o_proj"]  # LFM2's name
        assert o_proj.bits == 8 and o_proj.codebook is Codebook.INST3
        assert layer.attention.projections["q_proj"].codebook is Codebook.MUL1
        if arch == "llama":
            assert ckpt.head.dtype == "F16"
            assert layer.mlp.gate.out_features == 200 and layer.mlp.gate.out_padded == 256
        else:
            assert isinstance(layer.mlp, MoEBlock) and len(layer.mlp.experts) == 3
            assert ckpt.head.bits == 2.5
            expert = layer.mlp.experts[2]
            assert expert.gate.name == f"model.layers.1.{block}.experts.2.{experts_names}"
            expected = spec.intermediate if block == "block_sparse_moe" or arch == "gpt_oss" else spec.moe_intermediate
            assert (expert.gate.in_features, expert.gate.out_features) == (384, expected)
        if arch == "lfm2_moe":  # layer 0: a short convolution, sized from hidden_size
            conv = ckpt.layer(0).attention
            assert conv.kind == "conv" and conv.projections["in_proj"].out_features == 3 * 384
            assert layer.mlp.correction_bias.name == "model.layers.1.feed_forward.expert_bias"
        if arch == "qwen3_next":  # the gated q_proj; layer 0's linear attention: its two quantized projections
            q = layer.attention.projections["q_proj"]
            assert (q.out_features, q.out_padded, q.dims_from_config) == (2 * 256, 2 * 256, True)
            assert layer.attention.kind == "full" and layer.mlp.routing.normalize
            linear = ckpt.layer(0).attention
            assert linear.name == "model.layers.0.linear_attn" and linear.kind == "linear"
            keys, values = 2 * 32, 4 * 32  # ModelSpec.linear_heads: 2 key heads, 4 value heads of 32
            qkvz, out = linear.projections["in_proj_qkvz"], linear.projections["out_proj"]
            assert (qkvz.in_features, qkvz.out_features, qkvz.out_padded) == (384, 2 * keys + 2 * values, 384)
            assert (out.in_features, out.in_padded, out.out_features) == (values, 128, 384)
            assert qkvz.dims_from_config and out.dims_from_config


def test_random_linear_layout():
    t = random_linear(100, 200, 2.5, "mul1", seed=1, bias=True)
    assert t.trellis.shape == (8, 16, 40) and t.trellis.dtype == torch.int16
    assert t.suh.shape == (128,) and torch.count_nonzero(t.suh) == 128  # padded rows too
    assert t.svh.shape == (256,) and torch.count_nonzero(t.svh[200:]) == 0 and torch.count_nonzero(t.svh[:200]) == 200
    assert t.bias.shape == (256,)
    assert torch.equal(random_linear(100, 200, 2.5, "mul1", seed=1, bias=True).trellis, t.trellis)
    assert not torch.equal(random_linear(100, 200, 2.5, "mul1", seed=2).trellis, t.trellis)
    with pytest.raises(ValueError):
        random_linear(128, 128, 2.5, "mcg", seed=0)
    with pytest.raises(ValueError):
        random_linear(128, 128, 9, "mcg", seed=0)


def test_legacy_signs_round_trip(tmp_path):
    path = write_checkpoint(tmp_path / "legacy", ModelSpec(num_layers=1, legacy_signs=True, embeddings=False))
    with exl3tool.open_checkpoint(path) as ckpt:
        info = ckpt.linear("model.layers.0.self_attn.k_proj")
        assert info.legacy_signs and "su" in info.tensors and "suh" not in info.tensors
        t = ckpt.load_linear(info.name)
        assert t.suh.dtype == torch.float16 and set(t.suh.abs().unique().tolist()) == {1.0}
        assert ckpt.check() == []


@pytest.mark.parametrize("hidden,head_dim", [(256, 128), (192, 64)])
def test_moe_layer_checkpoint_has_the_asked_shape(tmp_path, hidden, head_dim):
    """``write_moe_layer`` (bench --moe, the A/B tool): one Qwen3-MoE layer of E experts, top-k, hidden and
    intermediate, at the bitrate and codebook asked."""
    path = write_moe_layer(tmp_path / "m", 6, 2, hidden, 128, 3.0, "3inst", seed=1)
    config = json.loads((path / "config.json").read_text())
    assert config["head_dim"] == head_dim and config["num_hidden_layers"] == 1
    with exl3tool.open_checkpoint(str(path)) as reader:
        block = reader.layer(0).mlp
        assert isinstance(block, MoEBlock) and len(block.experts) == 6 and block.routing.top_k == 2
        gate = block.experts[0].gate
        assert (gate.in_features, gate.out_features, gate.bits, gate.codebook) == (hidden, 128, 3.0, Codebook.INST3)


def test_inspect_names_linear_attention_layers(tmp_path):
    """Qwen3-Next: inspect's layer table shows the gated delta-net layers as linear attention, JSON too, and every
    projection's true size comes from config.json (no padded-size note)."""
    path = write_checkpoint(tmp_path / "next", ModelSpec(arch="qwen3_next", num_layers=2, num_experts=4, top_k=2,
                                                         full_attention_interval=2))
    report = run_cli("inspect", str(path), "--format", "json").json()
    assert report["sound"] and report["notes"] == []
    assert [(r["attention_kind"], r["attention"]) for r in report["layers"]] == [
        ("linear", ["in_proj_qkvz", "out_proj"]), ("full", ["q_proj", "k_proj", "v_proj", "o_proj"])]
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in run_cli("inspect", str(path)).stdout.splitlines() if line.count("│") > 3}
    assert rows["0"] == "linear qkvz,out" and rows["1"] == "q,k,v,o"


def test_qwen3_5_linear_attention_projections_are_sized_from_the_config(tmp_path):
    """Qwen3.5 stores a gated delta-net's q/k/v and its output gate z apart (ExLlamaV3: in_proj_qkv, in_proj_z):
    both are sized from the linear heads, as Qwen3-Next's fused in_proj_qkvz is."""
    from exl3tool.synthetic import edit_checkpoint, linear_state_dict

    path = write_checkpoint(tmp_path / "q35", ModelSpec(arch="qwen3_next", num_layers=2, num_experts=4, top_k=2,
                                                        full_attention_interval=2))
    prefix = "model.layers.0.linear_attn"
    keys, values = 2 * 32, 4 * 32  # ModelSpec.linear_heads
    split = {}
    for proj, out, seed in (("in_proj_qkv", 2 * keys + values, 1), ("in_proj_z", values, 2)):
        split.update(linear_state_dict(random_linear(256, out, 4, "mcg", seed=seed, name=f"{prefix}.{proj}")))
    edit_checkpoint(path, drop=[n for n in _tensor_names(path) if n.startswith(f"{prefix}.in_proj_qkvz.")], add=split)
    edit_config(path, model_type="qwen3_5_moe_text")
    with exl3tool.open_checkpoint(path) as ckpt:
        assert ckpt.check() == []
        attention = ckpt.layer(0).attention
        assert attention.kind == "linear" and list(attention.projections) == ["in_proj_qkv", "in_proj_z", "out_proj"]
        qkv, z = attention.projections["in_proj_qkv"], attention.projections["in_proj_z"]
        assert (qkv.out_features, qkv.out_padded, qkv.dims_from_config) == (2 * keys + values, 256, True)
        assert (z.out_features, z.dims_from_config) == (values, True)
    edit_config(path, linear_value_head_dim=64)  # v and z twice as wide: 256, which the stored z (128) is not
    with exl3tool.open_checkpoint(path) as ckpt:
        assert {(p.check, p.tensor) for p in ckpt.check()} >= {("config-dims", f"{prefix}.in_proj_z.trellis")}


def _tensor_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())
