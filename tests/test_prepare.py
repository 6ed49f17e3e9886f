"""`prepare` + `load_prepared` round trips: every genuine fixture and synthetic MoE checkpoints decode, load and
run bit-identically from the prepared layout; the stacked MoE tensors hold exactly the per-expert tensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import exl3tool
from exl3tool import reference
from exl3tool.errors import NotFoundError, UnsupportedFeatureError, UsageError
from exl3tool.format import Codebook, LinearInfo, MoEBlock, TensorInfo
from exl3tool.prepared import is_prepared, load_prepared, prepare_checkpoint
from exl3tool.synthetic import ModelSpec, edit_checkpoint, write_checkpoint

from helpers import GENUINE, model_dir, outputs_dir

SMALL = dict(hidden=256, moe_intermediate=128, intermediate=200, num_experts=4, top_k=2, num_layers=2, vocab=384,
             embeddings=True)


def prepared(tmp_path: Path, src: Path, name: str = "out", **kwargs) -> Path:
    out = tmp_path / name
    prepare_checkpoint(src, out, **kwargs)
    return out


def assert_same_linear(src, prep, name: str) -> None:
    a, b = src.load_linear(name), prep.load_linear(name)
    assert prep.linears[name] == src.linears[name]  # every field but the tensor locations
    for leaf in ("trellis", "suh", "svh", "bias"):
        x, y = getattr(a, leaf), getattr(b, leaf)
        assert (x is None) == (y is None), (name, leaf)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), (name, leaf)


def assert_round_trip(src_path: Path, out: Path, seed: int = 0) -> None:
    """Same structure, same bits for every linear and carried tensor, same reference outputs (torch.equal)."""
    g = torch.Generator().manual_seed(seed)
    with exl3tool.open_checkpoint(src_path) as src, load_prepared(out) as prep:
        assert prep.config == src.config
        assert [layer.index for layer in prep.layers] == [layer.index for layer in src.layers]
        assert set(prep.linears) == set(src.linears) and set(prep.blocks) == set(src.blocks)
        for layer_p, layer_s in zip(prep.layers, src.layers):
            assert [lin.name for lin in layer_p.linears] == [lin.name for lin in layer_s.linears]
            assert type(layer_p.mlp) is type(layer_s.mlp)
            assert layer_p.attention == layer_s.attention
        if isinstance(src.head, LinearInfo):
            assert prep.head == src.head
        elif isinstance(src.head, TensorInfo):
            assert (prep.head.name, prep.head.dtype, prep.head.shape) == (src.head.name, src.head.dtype, src.head.shape)
        else:
            assert prep.head is None
        assert sorted(t.name for t in prep.model.unquantized) == sorted(t.name for t in src.model.unquantized)
        for t in src.model.unquantized:
            a, b = src.load_tensor(t.name), prep.load_tensor(t.name)
            assert a.dtype == b.dtype and torch.equal(a, b), t.name
        in_blocks = {lin.name for block in src.blocks.values() for lin in block.linears}
        for name, info in src.linears.items():
            assert_same_linear(src, prep, name)
            if name not in in_blocks:  # the block forwards below run every other linear
                x = torch.randn(3, info.in_features, generator=g)
                assert torch.equal(src.reference_forward(name, x), prep.reference_forward(name, x)), name
        for name, block in src.blocks.items():
            width = block.router.shape[1] if isinstance(block, MoEBlock) else block.gate.in_features
            x = torch.randn(9, width, generator=g)
            assert torch.equal(src.reference_forward(name, x), prep.reference_forward(name, x)), name
        if src.layers:
            first = src.layers[0].linears[0].name
            assert torch.equal(src.dequantize(first), prep.dequantize(first))


@pytest.mark.parametrize("name", GENUINE)
def test_round_trip_genuine_fixtures(tmp_path, name):
    out = prepared(tmp_path, model_dir(name))
    assert is_prepared(out) and not is_prepared(model_dir(name))
    assert_round_trip(model_dir(name), out)


def test_prepared_moe_matches_exllamav3_outputs(tmp_path):
    """An oracle independent of our source reader: ExLlamaV3's own recorded output of the MoE block."""
    out = prepared(tmp_path, model_dir("qwen3moe_mul1"))
    block = "model.layers.0.mlp"
    with safe_open(outputs_dir("qwen3moe_mul1") / "exllamav3_outputs.safetensors", "pt") as f:
        x, want = f.get_tensor(f"{block}.input"), f.get_tensor(f"{block}.output").float()
    with load_prepared(out) as prep:
        got = prep.reference_forward(block, x)
    assert ((got - want[:, : got.shape[1]]).norm() / want.norm()).item() < 2e-3


def test_prepared_moe_fields_follow_the_spec(tmp_path):
    out = prepared(tmp_path, model_dir("qwen3moe_mul1"))
    with load_prepared(out) as prep, exl3tool.open_checkpoint(model_dir("qwen3moe_mul1")) as src:
        moe = prep.moe(1)
        assert (moe.name, moe.layer, moe.num_experts) == ("model.layers.1.mlp", 1, 4)
        assert (moe.hidden, moe.hidden_padded, moe.intermediate, moe.intermediate_padded) == (256, 256, 128, 128)
        assert (moe.bits, moe.codebook) == (4.0, Codebook.MUL1)
        assert (moe.routing.method, moe.routing.top_k, moe.routing.normalize) == ("softmax_topk", 2, True)
        shapes = {k: (getattr(moe, k).dtype, tuple(getattr(moe, k).shape)) for k in
                  ("w13", "w2", "gate_suh", "up_suh", "intermediate_rotations", "down_svh", "router")}
        assert shapes == {
            "w13": (torch.int16, (2, 4, 16, 8, 64)), "w2": (torch.int16, (4, 8, 16, 64)),
            "gate_suh": (torch.float16, (4, 256)), "up_suh": (torch.float16, (4, 256)),
            "intermediate_rotations": (torch.float16, (4, 384)), "down_svh": (torch.float16, (4, 256)),
            "router": (torch.float16, (4, 256)),
        }
        assert moe.groups[0].experts == (0, 1, 2, 3) and moe.shared is None and moe.w13.is_contiguous()
        assert torch.equal(moe.router, src.load_tensor("model.layers.1.mlp.gate.weight"))
        with pytest.raises(NotFoundError):
            moe.locate(4)
        # the dense layers of a MoE model have no moe(); a layer that is not there is named
        with pytest.raises(NotFoundError, match="no layer 7"):
            prep.moe(7)
    with load_prepared(prepared(tmp_path, model_dir("llama_mcg"), "dense")) as dense, pytest.raises(NotFoundError):
        dense.moe(0)


def assert_stacks_hold_the_experts(src, prep, layer: int) -> None:
    """w13/w2/suh/svh tables == the per-expert source tensors, and decode to exactly the source's W_hat."""
    moe = prep.moe(layer)
    block = src.layer(layer).mlp
    seen = []
    for group in moe.groups:
        i_p = group.intermediate_padded
        for p, e in enumerate(group.experts):
            seen.append(e)
            gate, up, down = (src.load_linear(lin.name) for lin in block.experts[e].linears)
            assert torch.equal(group.w13[0, p], gate.trellis) and torch.equal(group.w13[1, p], up.trellis)
            assert torch.equal(group.w2[p], down.trellis)
            assert torch.equal(group.gate_suh[p], gate.suh) and torch.equal(group.up_suh[p], up.suh)
            assert torch.equal(group.intermediate_rotations[p], torch.cat([gate.svh, up.svh, down.suh]))
            assert torch.equal(group.intermediate_rotations[p, 2 * i_p:], down.suh)
            assert torch.equal(group.down_svh[p], down.svh)
            assert (group.w13_bits, group.w13_codebook) == (gate.info.bits, gate.info.codebook)
            assert (group.w2_bits, group.w2_codebook) == (down.info.bits, down.info.codebook)
            w_hat = reference.decode_trellis(group.w13[1, p], group.w13_codebook, group.w13_bits)
            assert torch.equal(w_hat.view(torch.int16), reference.decode_w_hat(up).view(torch.int16))
            if gate.bias is not None:
                assert torch.equal(group.w13_bias[0, p], gate.bias) and torch.equal(group.w2_bias[p], down.bias)
    assert sorted(seen) == list(range(len(block.experts)))


@pytest.mark.parametrize("arch, extra", [
    ("qwen3_moe", {}),
    ("qwen2_moe", {"legacy_signs": True}),  # shared expert + sigmoid gate; su/sv expanded to fp16
    ("mixtral", {"intermediate": 160, "codebook": "3inst"}),
    ("deepseek_v3", {"dense_layers": (0,), "num_layers": 3, "codebook": "mul1", "bits": 2.5}),
    ("qwen3_next", {"full_attention_interval": 2}),  # linear-attention layers' tensors carried as they are
    ("minimax_m2", {"hidden_act": "gelu_pytorch_tanh", "intermediate": 128}),  # the activation kept with each MLP
    ("gpt_oss", {"intermediate": 128}),  # router bias, biased experts, the clamped SwiGLU and its limit
    ("lfm2_moe", {"dense_layers": (0,), "num_layers": 3}),  # feed_forward blocks, expert_bias, conv layers
])
def test_round_trip_synthetic_moe(tmp_path, arch, extra):
    src = write_checkpoint(tmp_path / "src", ModelSpec(arch=arch, **{**SMALL, **extra}, shards=2))
    out = prepared(tmp_path, src)
    assert_round_trip(src, out, seed=1)
    with exl3tool.open_checkpoint(src) as s, load_prepared(out) as p:
        for layer in s.layers:
            if isinstance(layer.mlp, MoEBlock):
                assert_stacks_hold_the_experts(s, p, layer.index)
                moe = p.moe(layer.index)
                assert (moe.shared is None) == (layer.mlp.shared_experts is None)
                assert (moe.shared_gate is None) == (layer.mlp.shared_expert_gate is None)
                assert (moe.correction_bias is None) == (layer.mlp.correction_bias is None)
                assert (moe.router_bias is None) == (layer.mlp.router_bias is None)
                pe, se = p.layer(layer.index).mlp.experts[0], layer.mlp.experts[0]
                assert (pe.activation, pe.activation_limit) == (se.activation, se.activation_limit)
                if moe.shared is not None:
                    down = s.load_linear(layer.mlp.shared_experts.down.name)
                    assert torch.equal(moe.shared.down.trellis, down.trellis)


def test_mixed_k_and_codebook_experts_are_grouped(tmp_path):
    spec = ModelSpec(arch="qwen3_moe", **{**SMALL, "num_experts": 5}, per_linear={
        "*.experts.[14].down_proj": (6, "3inst"), "*.experts.[14].*": (3, "mul1"),
        "*.experts.3.*": (4, "mul1")})  # expert 3 differs from 0 and 2 in the codebook alone
    src = write_checkpoint(tmp_path / "src", spec)
    out = prepared(tmp_path, src)
    with exl3tool.open_checkpoint(src) as s, load_prepared(out) as p:
        moe = p.moe(0)
        got = [(g.experts, g.w13_bits, g.w13_codebook.value, g.w2_bits, g.w2_codebook.value) for g in moe.groups]
        assert got == [((0, 2), 4.0, "mcg", 4.0, "mcg"), ((1, 4), 3.0, "mul1", 6.0, "3inst"),
                       ((3,), 4.0, "mul1", 4.0, "mul1")]
        assert moe.groups[1].w13.shape == (2, 2, 16, 8, 48) and moe.groups[1].w2.shape == (2, 8, 16, 96)
        group, row = moe.locate(4)
        assert group.experts == (1, 4) and row == 1
        with pytest.raises(UnsupportedFeatureError, match="3 expert groups"):
            _ = moe.w13
        with pytest.raises(UnsupportedFeatureError, match="use .groups"):
            _ = moe.bits
        assert_stacks_hold_the_experts(s, p, 0)
    assert_round_trip(src, out, seed=2)


def test_gate_and_up_that_differ_are_refused_not_converted(tmp_path):
    src = write_checkpoint(tmp_path / "src", ModelSpec(arch="qwen3_moe", **SMALL,
                                                       per_linear={"*.experts.1.up_proj": (5, "mcg")}))
    with pytest.raises(UnsupportedFeatureError, match=r"expert 1: gate \(K=4 mcg.*up \(K=5 mcg.*w13") as info:
        prepare_checkpoint(src, tmp_path / "out")
    assert info.value.tensor == "model.layers.0.mlp"
    assert not (tmp_path / "out").exists()


def test_expert_biases_are_stacked(tmp_path):
    src = write_checkpoint(tmp_path / "src", ModelSpec(arch="qwen3_moe", **SMALL))
    g = torch.Generator().manual_seed(5)
    add = {}
    for e in range(4):
        for proj, size in (("gate_proj", 128), ("up_proj", 128), ("down_proj", 256)):
            add[f"model.layers.1.mlp.experts.{e}.{proj}.bias"] = (torch.randn(size, generator=g) * 0.1).half()
    edit_checkpoint(src, add=add)
    out = prepared(tmp_path, src)
    with exl3tool.open_checkpoint(src) as s, load_prepared(out) as p:
        moe = p.moe(1)
        assert moe.groups[0].w13_bias.shape == (2, 4, 128) and moe.groups[0].w2_bias.shape == (4, 256)
        assert p.moe(0).groups[0].w13_bias is None
        assert_stacks_hold_the_experts(s, p, 1)
    assert_round_trip(src, out, seed=3)


def test_legacy_signs_dense(tmp_path):
    src = write_checkpoint(tmp_path / "src", ModelSpec(num_layers=1, legacy_signs=True, head_bits=16))
    out = prepared(tmp_path, src)
    with load_prepared(out) as p:
        t = p.load_linear("model.layers.0.mlp.down_proj")
        assert t.info.legacy_signs and t.suh.dtype == torch.float16 and set(t.suh.abs().unique().tolist()) == {1.0}
        assert p.head.dtype == "F16"
    assert_round_trip(src, out)


def test_layer_selection(tmp_path):
    src = write_checkpoint(tmp_path / "src", ModelSpec(arch="qwen3_moe", **{**SMALL, "num_layers": 4}))
    out = prepared(tmp_path, src, layers="1-2")
    assert sorted(p.name for p in out.iterdir()) == ["layer-00001-p0.safetensors", "layer-00002-p0.safetensors",
                                                     "manifest.json"]
    with load_prepared(out) as p, exl3tool.open_checkpoint(src) as s:
        assert [layer.index for layer in p.layers] == [1, 2] and p.head is None
        assert all(".layers.1." in t.name or ".layers.2." in t.name for t in p.model.unquantized)
        assert {t.name for t in p.model.unquantized} == {
            t.name for t in s.model.unquantized if ".layers.1." in t.name or ".layers.2." in t.name}
        with pytest.raises(NotFoundError, match="no layer 0"):
            p.layer(0)
        with pytest.raises(NotFoundError):
            p.load_linear("lm_head")
        for name in ("model.layers.2.mlp", "model.layers.1.self_attn.o_proj"):
            x = torch.randn(4, 256)
            assert torch.equal(p.reference_forward(name, x), s.reference_forward(name, x))
    with pytest.raises(NotFoundError, match="no layer 9"):
        prepare_checkpoint(src, tmp_path / "o2", layers=[9])


def _shard_layout(path: Path) -> tuple[int, list[tuple[str, int, int, int]]]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    sizes = {"I16": 2, "F16": 2, "BF16": 2, "F32": 4, "I32": 4}
    return 8 + n, [(k, *v["data_offsets"], sizes[v["dtype"]]) for k, v in header.items() if k != "__metadata__"]


def test_shards_are_bounded_and_aligned(tmp_path):
    src = write_checkpoint(tmp_path / "src", ModelSpec(arch="qwen3_moe", **SMALL))
    out = prepared(tmp_path, src, max_shard_bytes="40kB")
    manifest = json.loads((out / "manifest.json").read_text())
    layer0 = next(u for u in manifest["units"] if u["id"] == "layer-00000")
    assert [f["name"] for f in layer0["files"]][:3] == ["layer-00000-p0.safetensors", "layer-00000-p1.safetensors",
                                                        "layer-00000-p2.safetensors"]
    for unit in manifest["units"]:
        for f in unit["files"]:
            start, tensors = _shard_layout(out / f["name"])
            assert start % 64 == 0
            data = sum(end - begin for _, begin, end, _ in tensors)
            assert data <= 40_000 or len(tensors) == 1, f["name"]
            assert all(begin % size == 0 for _, begin, _, size in tensors)
            assert f["size"] == (out / f["name"]).stat().st_size
    assert_round_trip(src, out)


def test_output_is_deterministic_and_readable_by_safetensors(tmp_path):
    src = model_dir("qwen3moe_mul1")
    a, b = prepared(tmp_path, src, "a"), prepared(tmp_path, src, "b")
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert [u["files"] for u in ma["units"]] == [u["files"] for u in mb["units"]]
    with safe_open(a / "layer-00000-p0.safetensors", "pt") as f, load_prepared(a) as p:
        assert f.metadata() == {"format": "exl3tool.prepared", "layout_version": "1", "unit": "layer-00000"}
        name = "model.layers.0.mlp.expert_group.0.w13"
        assert torch.equal(f.get_tensor(name), p.load_tensor(name))


def test_cpu_tensors_are_copy_on_write_views(tmp_path):
    out = prepared(tmp_path, model_dir("llama_mul1"))
    with load_prepared(out) as p:
        t = p.load_linear("model.layers.0.self_attn.q_proj")
        before = t.trellis.clone()
        t.trellis.zero_()  # a private page: the file must not change
        assert p.check() == []
        again = load_prepared(out)
        assert torch.equal(again.load_linear("model.layers.0.self_attn.q_proj").trellis, before)
        again.close()
    with load_prepared(out, device="cpu", verify_hashes=False) as p:
        moved = p.load_linear("model.layers.0.self_attn.q_proj", device="meta")
        assert moved.trellis.device.type == "meta" and moved.info.bits == 4.0
    with pytest.raises(UsageError, match="not a torch device"):
        load_prepared(out, device="warp-drive")
    with pytest.raises(UsageError, match="verify_hashes"):
        load_prepared(out, verify_hashes="sometimes")


def test_is_prepared(tmp_path):
    out = prepared(tmp_path, model_dir("llama_mcg"))
    assert is_prepared(out) and is_prepared(str(out))
    assert not is_prepared(tmp_path / "nowhere") and not is_prepared(model_dir("llama_mcg"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text('{"schema": "something else"}')
    assert not is_prepared(tmp_path / "junk")
    (tmp_path / "junk" / "manifest.json").write_bytes(b"\xff\xfe")
    assert not is_prepared(tmp_path / "junk")


def test_top_level_exports():
    assert exl3tool.load_prepared is load_prepared
    assert exl3tool.is_prepared is is_prepared
    assert exl3tool.prepare_checkpoint is prepare_checkpoint
