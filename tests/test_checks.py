"""Bad inputs, one per check: the exit code, a problem naming file and tensor on one line, never a traceback.

Each case damages a small synthetic checkpoint (or a copy of a genuine fixture) in exactly one way.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

import exl3tool
from exl3tool.errors import CheckpointProblemsError, UnsupportedFeatureError
from exl3tool.format import MCG_MARKER
from exl3tool.synthetic import ModelSpec, edit_checkpoint, save_safetensors, write_checkpoint
from helpers import edit_config, model_dir, run_cli

DENSE = ModelSpec(arch="llama", num_layers=1, embeddings=False)
MOE = ModelSpec(arch="qwen3_moe", num_layers=1, embeddings=False)
Q = "model.layers.0.self_attn.q_proj"
GATE = "model.layers.0.mlp.gate_proj"
FILE = "model.safetensors"


def inspect(path, *extra):
    """(exit code, JSON report or error object, human stdout, human stderr)."""
    as_json = run_cli("inspect", path, "--format", "json", *extra)
    human = run_cli("inspect", path, *extra)
    assert human.exit_code == as_json.exit_code
    return as_json.exit_code, as_json.json(), human.stdout, human.stderr


def assert_problem(path, check, file, tensor, exit_code=1, kind=None):
    code, report, human, _ = inspect(path)
    assert code == exit_code, report
    matches = [p for p in report["problems"] if p["check"] == check]
    assert matches, f"no {check!r} problem in {report['problems']}"
    p = matches[0]
    assert (p["file"], p["tensor"]) == (file, tensor), p
    if kind:
        assert p["kind"] == kind
    # the human output has it as one line: "[kind] file: tensor: message"
    lines = [line for line in human.splitlines() if f"{file}: {tensor}: " in line]
    assert lines and p["message"] in lines[0], human
    return p


@pytest.fixture
def dense(tmp_path):
    return write_checkpoint(tmp_path / "dense", DENSE)


@pytest.fixture
def moe(tmp_path):
    return write_checkpoint(tmp_path / "moe", MOE)


def test_synthetic_bases_are_sound(dense, moe):
    for path in (dense, moe):
        code, report, human, _ = inspect(path)
        assert code == 0 and report["sound"] and report["problems"] == []
        assert "sound: no problems found" in human


# --- safetensors files -----------------------------------------------------------------------------------

def test_truncated_file(dense):
    data = (dense / FILE).read_bytes()
    (dense / FILE).write_bytes(data[:-100])
    p = assert_problem(dense, "safetensors", FILE, "lm_head.svh", exit_code=2, kind="unreadable")
    assert "truncated" in p["message"]


@pytest.mark.parametrize("raw, words", [
    (b"\x05\x00", "shorter than the 8-byte header"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
    (struct.pack("<Q", 9) + b"{not json", "malformed safetensors header"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
])
def test_malformed_header(dense, raw, words):
    (dense / FILE).write_bytes(raw)
    code, report, human, _ = inspect(dense)
    assert code == 2
    p = next(p for p in report["problems"] if p["check"] == "safetensors")
    assert p["file"] == FILE and words in p["message"]
    assert any(line.strip().startswith(f"[unreadable] {FILE}: ") for line in human.splitlines())


def test_bad_header_entry_names_the_tensor(dense):
    header = {"x.weight": {"dtype": "F16", "shape": [2], "data_offsets": [0, 3]}}
    raw = json.dumps(header).encode()
    (dense / FILE).write_bytes(struct.pack("<Q", len(raw)) + raw + b"abc")
    p = assert_problem(dense, "safetensors", FILE, "x.weight", exit_code=2)
    assert "needs 4" in p["message"]


def test_unknown_dtype_in_header(dense):
    header = {"x.weight": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}
    raw = json.dumps(header).encode()
    (dense / FILE).write_bytes(struct.pack("<Q", len(raw)) + raw + b"ab")
    assert_problem(dense, "safetensors", FILE, "x.weight", exit_code=2)


# --- one linear ------------------------------------------------------------------------------------------

def test_trellis_wrong_dtype(dense):
    edit_checkpoint(dense, replace={f"{Q}.trellis": torch.zeros(16, 16, 64, dtype=torch.float16)})
    assert_problem(dense, "trellis-dtype", FILE, f"{Q}.trellis")


@pytest.mark.parametrize("shape", [(16, 16, 50), (16, 16, 144), (256, 64)])
def test_trellis_wrong_shape(dense, shape):
    edit_checkpoint(dense, replace={f"{Q}.trellis": torch.zeros(shape, dtype=torch.int16)})
    assert_problem(dense, "trellis-shape", FILE, f"{Q}.trellis")


def test_padded_dims_not_multiple_of_128(dense):
    edit_checkpoint(dense, replace={f"{Q}.trellis": torch.zeros(17, 16, 64, dtype=torch.int16)})
    p = assert_problem(dense, "padded-dims", FILE, f"{Q}.trellis")
    assert "272" in p["message"]


def test_half_rate_needs_mul1(dense):
    edit_checkpoint(dense, replace={f"{Q}.trellis": torch.zeros(16, 16, 40, dtype=torch.int16)})
    assert_problem(dense, "half-rate-codebook", FILE, f"{Q}.trellis")


def test_bad_marker_value(dense):
    edit_checkpoint(dense, replace={f"{Q}.mcg": torch.tensor(12345, dtype=torch.int32)})
    p = assert_problem(dense, "marker-value", FILE, f"{Q}.mcg")
    assert "0x00003039" in p["message"] and "0xCBAC1FED" in p["message"]


@pytest.mark.parametrize("marker", [torch.tensor([MCG_MARKER], dtype=torch.int32),
                                    torch.tensor(MCG_MARKER, dtype=torch.int64)])
def test_bad_marker_dtype_or_shape(dense, marker):
    edit_checkpoint(dense, replace={f"{Q}.mcg": marker})
    assert_problem(dense, "marker-dtype", FILE, f"{Q}.mcg")


def test_both_markers(dense):
    edit_checkpoint(dense, add={f"{Q}.mul1": torch.tensor(-2082680531, dtype=torch.int32)})
    assert_problem(dense, "marker-conflict", FILE, f"{Q}.mul1")


def test_missing_suh(dense):
    edit_checkpoint(dense, drop=[f"{Q}.suh"])
    assert_problem(dense, "missing-tensor", FILE, f"{Q}.suh")


def test_missing_trellis(dense):
    edit_checkpoint(dense, drop=[f"{Q}.trellis"])
    assert_problem(dense, "missing-tensor", FILE, f"{Q}.trellis")


@pytest.mark.parametrize("leaf, value", [
    ("suh", torch.ones(128, dtype=torch.float16)),
    ("svh", torch.ones(256, dtype=torch.float32)),
])
def test_scale_wrong_shape_or_dtype(dense, leaf, value):
    edit_checkpoint(dense, replace={f"{Q}.{leaf}": value})
    assert_problem(dense, "scale-shape", FILE, f"{Q}.{leaf}")


def test_legacy_su_wrong_length(tmp_path):
    path = write_checkpoint(tmp_path / "legacy", DENSE, legacy_signs=True)
    assert inspect(path)[0] == 0
    edit_checkpoint(path, replace={f"{Q}.su": torch.zeros(8, dtype=torch.int16)})
    assert_problem(path, "scale-shape", FILE, f"{Q}.su")


def test_both_suh_and_su(dense):
    edit_checkpoint(dense, add={f"{Q}.su": torch.zeros(16, dtype=torch.int16)})
    assert_problem(dense, "scale-conflict", FILE, f"{Q}.su")


@pytest.mark.parametrize("leaf, index, value", [("suh", 7, float("nan")), ("svh", 0, float("inf"))])
def test_nonfinite_scales(dense, leaf, index, value):
    from safetensors.torch import load_file

    vec = load_file(dense / FILE)[f"{Q}.{leaf}"].clone()
    vec[index] = value
    edit_checkpoint(dense, replace={f"{Q}.{leaf}": vec})
    p = assert_problem(dense, "scale-nonfinite", FILE, f"{Q}.{leaf}")
    assert f"first at index {index}" in p["message"]
    with exl3tool.open_checkpoint(dense) as ckpt:
        with pytest.raises(CheckpointProblemsError) as err:
            ckpt.reference_forward(Q, torch.randn(1, 256))
        assert err.value.tensor == f"{Q}.{leaf}"


def test_svh_nonzero_on_padding(dense):
    from safetensors.torch import load_file

    svh = load_file(dense / FILE)[f"{GATE}.svh"].clone()
    svh[330] = 1.0  # intermediate 320, padded 384
    edit_checkpoint(dense, replace={f"{GATE}.svh": svh})
    assert_problem(dense, "svh-padding", FILE, f"{GATE}.svh")


def test_bias_wrong_shape(dense):
    edit_checkpoint(dense, add={f"{Q}.bias": torch.zeros(100, dtype=torch.float16)})
    assert_problem(dense, "bias", FILE, f"{Q}.bias")


# --- unknown and unsupported -----------------------------------------------------------------------------

def test_unknown_tensor_beside_trellis(dense):
    edit_checkpoint(dense, add={f"{Q}.scales": torch.zeros(4, dtype=torch.float16)})
    assert_problem(dense, "unknown-tensor", FILE, f"{Q}.scales", kind="unsupported")


def test_unknown_integer_tensor(dense):
    edit_checkpoint(dense, add={"model.layers.0.mlp.qweight": torch.zeros(4, dtype=torch.int32)})
    assert_problem(dense, "unknown-tensor", FILE, "model.layers.0.mlp.qweight", kind="unsupported")


def test_ring_embedding_is_unsupported(dense):
    edit_checkpoint(dense, add={"model.embed_tokens.trellis": torch.zeros(4096, dtype=torch.int16),
                                "model.embed_tokens.signs": torch.zeros(64, dtype=torch.int16)})
    p = assert_problem(dense, "ring-format", FILE, "model.embed_tokens.trellis", kind="unsupported")
    assert "ring" in p["message"]


def test_unknown_tile_order_is_refused(dense):
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"]["tile_order"] = "column_major"
    (dense / "config.json").write_text(json.dumps(config))
    code, report, human, _ = inspect(dense)
    assert code == 1
    p = next(p for p in report["problems"] if p["check"] == "tile-order")
    assert p["file"] == "config.json" and p["kind"] == "unsupported" and "column_major" in p["message"]
    with exl3tool.open_checkpoint(dense) as ckpt:  # and the reference refuses to decode anything
        with pytest.raises(CheckpointProblemsError):
            ckpt.dequantize(Q)


# --- config consistency and completeness -----------------------------------------------------------------

def test_padded_size_disagrees_with_config(dense):
    edit_config(dense, intermediate_size=520)  # pads to 640, the trellis says 384
    p = assert_problem(dense, "config-dims", FILE, f"{GATE}.trellis")
    assert "intermediate_size = 520" in p["message"]


@pytest.mark.parametrize("values, width, said", [
    ({"intermediate_size": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256}, 8192,  # LFM2-1.2B
     "2/3 of intermediate_size times block_ffn_dim_multiplier, rounded up to block_multiple_of"),
    ({"block_ff_dim": 6656, "intermediate_size": 1}, 4608, "2/3 of block_ff_dim"),  # LFM2-350M: 4437 rounds up
    ({"intermediate_size": 6656, "block_ffn_dim_multiplier": None}, 4437, "2/3 of intermediate_size ("),
    ({"intermediate_size": 6656, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 128}, 6656, "rounded up"),
    ({"intermediate_size": 6656, "block_auto_adjust_ff_dim": False}, 6656, "intermediate_size"),
])
def test_lfm2_feed_forward_width_as_hf_derives_it(tmp_path, values, width, said):
    """LFM2's dense feed_forward is sized as HF's Lfm2MLP sizes it: 2/3 of intermediate_size (LiquidAI's block_ff_dim
    first), then times block_ffn_dim_multiplier (1.0 when absent) rounded up to block_multiple_of, rounding only where
    the multiplier is set; block_auto_adjust_ff_dim false keeps intermediate_size. LFM2-MoE's dense layers are not
    adjusted."""
    from exl3tool.io.config import read_config

    def dims(model_type):
        quant = {"quant_method": "exl3", "bits": 4.0}
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 2048,
                                                          "quantization_config": quant, **values}))
        return read_config(tmp_path)[0].dims

    lfm2, moe = dims("lfm2"), dims("lfm2_moe")
    assert lfm2.dense_intermediate == width and said in lfm2.dense_intermediate_key
    assert (moe.dense_intermediate, moe.dense_intermediate_key) == (values.get("intermediate_size"), "intermediate_size")


def test_lfm2_moe_dense_feed_forward_is_sized_from_intermediate_size(tmp_path):
    """An LFM2-MoE dense layer's feed_forward w1 / w3 / w2 are checked against intermediate_size (as its MoE
    blocks' experts are against moe_intermediate_size); as LFM2, 2/3 of it."""
    path = write_checkpoint(tmp_path / "lfm2", ModelSpec(arch="lfm2_moe", num_layers=2, dense_layers=(0,),
                                                         intermediate=384, embeddings=False))
    code, report, _, _ = inspect(path)
    assert code == 0, report["problems"]
    with exl3tool.open_checkpoint(path) as ckpt:
        mlp = ckpt.layer(0).mlp
        assert mlp.down.in_features == 384 and mlp.down.dims_from_config
    edit_config(path, intermediate_size=520)  # pads to 640, the trellis says 384
    p = assert_problem(path, "config-dims", FILE, "model.layers.0.feed_forward.w1.trellis")
    assert "intermediate_size = 520" in p["message"]
    edit_config(path, model_type="lfm2", intermediate_size=576, block_multiple_of=128, num_experts=None)
    with exl3tool.open_checkpoint(path) as ckpt:  # 2/3 of 576 = 384
        assert ckpt.config.dims.dense_intermediate == 384
    edit_config(path, intermediate_size=384)  # 2/3 = 256
    p = assert_problem(path, "config-dims", FILE, "model.layers.0.feed_forward.w1.trellis")
    assert "2/3 of intermediate_size times block_ffn_dim_multiplier, rounded up to block_multiple_of = 256" in \
        p["message"]


@pytest.mark.parametrize("key, value, tensor, said", [
    ("linear_num_value_heads", 8, "model.layers.0.linear_attn.in_proj_qkvz.trellis",  # 2*64 + 2*256 pads to 640
     "2 * linear_num_key_heads * linear_key_head_dim + 2 * linear_num_value_heads * linear_value_head_dim = 640"),
    ("linear_value_head_dim", 64, "model.layers.0.linear_attn.in_proj_qkvz.trellis",
     "= 640 pads to 640"),
    ("num_attention_heads", 4, "model.layers.1.self_attn.q_proj.trellis",  # gated: 2 * 4 * 64 rows, not 2 * 2 * 64
     "2 * num_attention_heads * head_dim = 512"),
])
def test_qwen3_next_attention_sizes_disagree_with_config(tmp_path, key, value, tensor, said):
    """Qwen3-Next's gated delta-net projections and its gated q_proj are sized from config.json like the rest."""
    path = write_checkpoint(tmp_path / "next", ModelSpec(arch="qwen3_next", num_layers=2, hidden=256, num_heads=2,
                                                         num_kv_heads=1, head_dim=64, moe_intermediate=128,
                                                         num_experts=4, top_k=2, full_attention_interval=2))
    assert inspect(path)[0] == 0
    edit_config(path, **{key: value})
    p = assert_problem(path, "config-dims", FILE, tensor)
    assert said in p["message"]


def test_missing_layer(dense):
    edit_config(dense, num_hidden_layers=2)
    assert_problem(dense, "missing-layer", "config.json", "model.layers.1")


def test_missing_expert(moe):
    drop = [n for n in _names(moe) if ".experts.2." in n]
    edit_checkpoint(moe, drop=drop)
    p = assert_problem(moe, "missing-expert", FILE, "model.layers.0.mlp.experts.2")
    assert "expert 2 of 4" in p["message"]
    with exl3tool.open_checkpoint(moe) as ckpt:
        with pytest.raises(CheckpointProblemsError):
            ckpt.reference_forward("model.layers.0.mlp", torch.randn(2, 256))


def test_expert_missing_one_projection(moe):
    drop = [n for n in _names(moe) if ".experts.1.down_proj." in n]
    edit_checkpoint(moe, drop=drop)
    assert_problem(moe, "incomplete-mlp", FILE, "model.layers.0.mlp.experts.1.down")


def test_expert_shaped_unlike_the_others(moe):
    name = "model.layers.0.mlp.experts.3.up_proj"
    edit_checkpoint(moe, replace={f"{name}.trellis": torch.zeros(16, 16, 64, dtype=torch.int16),
                                  f"{name}.svh": torch.zeros(256, dtype=torch.float16)})
    kinds = {p["check"] for p in inspect(moe)[1]["problems"]}
    assert {"expert-shape", "config-dims"} <= kinds
    assert_problem(moe, "expert-shape", FILE, name)


@pytest.mark.parametrize("arch,model_type,tensor", [
    ("qwen3_moe", "qwen3_moe", "model.layers.0.mlp.gate.weight"),
    ("deepseek_v3", "deepseek_v3", "model.layers.0.mlp.gate.e_score_correction_bias"),
    ("deepseek_v3", "glm4_moe", "model.layers.0.mlp.gate.e_score_correction_bias"),
    ("qwen2_moe", "qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight"),
    ("qwen3_next", "qwen3_5_moe_text", "model.layers.0.mlp.shared_expert_gate.weight"),
    ("gpt_oss", "gpt_oss", "model.layers.0.mlp.router.weight"),
    ("gpt_oss", "gpt_oss", "model.layers.0.mlp.router.bias"),
    ("lfm2_moe", "lfm2_moe", "model.layers.0.feed_forward.expert_bias"),
])
def test_missing_what_the_routing_computes_with(tmp_path, arch, model_type, tensor):
    """The router itself (gpt-oss's `router`, with the bias on its logits); and sigmoid routing chooses experts by
    score + correction bias (LFM2-MoE's expert_bias), a Qwen2-MoE-style shared expert is scaled by its gate: without
    them the block would compute something else, so it is refused like a block without a router."""
    path = write_checkpoint(tmp_path / arch, ModelSpec(arch=arch, num_layers=1, n_group=1, embeddings=False))
    edit_config(path, model_type=model_type)
    assert inspect(path)[0] == 0
    edit_checkpoint(path, drop=[tensor])
    assert_problem(path, "missing-router", FILE, tensor)


@pytest.mark.parametrize("router", ["router.gate", "router.proj", None])
def test_a_router_by_another_name_of_an_unknown_model_type_is_no_problem(tmp_path, router):
    """Where the model type's routing is not known (the reference refuses its MoE blocks anyway), the router's name is
    not known either: HY-V3's router.gate or Gemma 4's router.proj is found, and none at all is no problem; the same
    rename in a known model type is a missing router."""
    path = write_checkpoint(tmp_path / "moe", ModelSpec(arch="qwen3_moe", num_layers=1, embeddings=False))
    name = "model.layers.0.mlp.gate.weight"
    with exl3tool.open_checkpoint(path) as ckpt:
        weight = ckpt.load_tensor(name)
    edit_checkpoint(path, drop=[name], add={} if router is None else {f"model.layers.0.mlp.{router}.weight": weight})
    edit_config(path, model_type="someone_elses_moe")
    code, report, _, _ = inspect(path)
    assert code == 0 and report["problems"] == [], report["problems"]
    assert any("routing of model_type 'someone_elses_moe' is not known" in n for n in report["notes"])
    with exl3tool.open_checkpoint(path) as ckpt:
        block = ckpt.layer(0).mlp
        assert (block is None) == (router is None)
        if router is not None:
            assert block.router.name == f"model.layers.0.mlp.{router}.weight"
            with pytest.raises(UnsupportedFeatureError):
                ckpt.reference_forward("model.layers.0.mlp", torch.randn(1, 256))
    edit_config(path, model_type="qwen3_moe")
    assert_problem(path, "missing-router", FILE, name)


def test_lfm2_without_expert_bias_chooses_by_score(tmp_path):
    """LFM2-MoE's use_expert_bias = false: no bias is stored and none is missed; the scores alone choose."""
    path = write_checkpoint(tmp_path / "lfm2", ModelSpec(arch="lfm2_moe", num_layers=1, embeddings=False))
    edit_checkpoint(path, drop=["model.layers.0.feed_forward.expert_bias"])
    edit_config(path, use_expert_bias=False)
    assert inspect(path)[0] == 0
    with exl3tool.open_checkpoint(path) as ckpt:
        block = ckpt.block("model.layers.0.feed_forward")
        assert block.correction_bias is None and not block.routing.choice_bias
        x = torch.randn(3, 256)
        scores = (x @ ckpt.load_tensor(block.router.name).float().T).sigmoid()
        chosen = scores.topk(2, dim=-1).indices
        weights = scores.gather(1, chosen)
        expected = torch.zeros(3, 256, dtype=torch.float64)
        for t in range(3):
            for w, e in zip(weights[t] / weights[t].sum() * 2.5, chosen[t].tolist()):
                expected[t] += w.item() * ckpt.reference_forward(f"{block.name}.experts.{e}", x[t : t + 1])[0].double()
        got = ckpt.reference_forward(block.name, x).double()
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5


def test_ungated_shared_experts_need_no_gate(tmp_path):
    path = write_checkpoint(tmp_path / "ds", ModelSpec(arch="deepseek_v3", num_layers=1, n_group=1, embeddings=False))
    with exl3tool.open_checkpoint(path) as ckpt:
        block = ckpt.block("model.layers.0.mlp")
        assert block.shared_experts is not None and block.shared_expert_gate is None and ckpt.check() == []


@pytest.mark.parametrize("arch,tensor,value", [
    ("qwen3_moe", "model.layers.0.mlp.gate.weight", torch.zeros(3, 256, dtype=torch.float16)),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", torch.zeros(2, 256, dtype=torch.float16)),
    ("deepseek_v3", "model.layers.0.mlp.gate.e_score_correction_bias", torch.zeros(3)),
    ("deepseek_v3", "model.layers.0.mlp.gate.e_score_correction_bias", torch.zeros(4, 1)),
    ("qwen3_moe", "model.layers.0.mlp.gate.weight", ("F8_E4M3", (4, 256), bytes(4 * 256))),
    ("gpt_oss", "model.layers.0.mlp.router.bias", torch.zeros(5, dtype=torch.bfloat16)),
])
def test_router_companions_of_the_wrong_shape_or_dtype(tmp_path, arch, tensor, value):
    """The shared expert's gate [1, hidden], the correction bias and gpt-oss's router bias [experts] and the router
    itself, each in a float
    type torch loads: the block is refused (prepare, the reference) instead of failing inside a matmul."""
    path = write_checkpoint(tmp_path / arch, ModelSpec(arch=arch, num_layers=1, n_group=1, embeddings=False))
    edit_checkpoint(path, replace={tensor: value})
    assert_problem(path, "router-shape", FILE, tensor)
    with exl3tool.open_checkpoint(path) as ckpt:
        with pytest.raises(CheckpointProblemsError):
            ckpt.reference_forward("model.layers.0.mlp", torch.randn(1, 256))


def test_expert_beyond_the_configured_count(moe):
    from exl3tool.synthetic import linear_state_dict, random_linear

    extra = {}
    for proj, (i, o) in {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}.items():
        extra.update(linear_state_dict(random_linear(i, o, 4, "mcg", seed=9, name=f"model.layers.0.mlp.experts.4.{proj}")))
    edit_checkpoint(moe, add=extra)
    assert_problem(moe, "expert-count", FILE, "model.layers.0.mlp.experts.4")


def test_layer_beyond_num_hidden_layers(dense):
    from exl3tool.synthetic import linear_state_dict, random_linear

    edit_checkpoint(dense, add=linear_state_dict(random_linear(256, 256, 4, "mcg", seed=1,
                                                               name="model.layers.3.self_attn.o_proj")))
    assert_problem(dense, "layer-count", "config.json", "model.layers.3")


def test_malformed_config_value(dense):
    edit_config(dense, hidden_size="wide")
    code, report, _, _ = inspect(dense)
    assert code == 1
    p = next(p for p in report["problems"] if p["check"] == "config-value")
    assert p["file"] == "config.json" and "hidden_size" in p["message"]


@pytest.mark.parametrize("key, value", [
    ("hidden_size", [256]), ("hidden_size", 256.0), ("num_attention_heads", {"a": 1}), ("model_type", ["llama"]),
    ("architectures", {"x": 1}), ("tie_word_embeddings", "yes"), ("num_hidden_layers", 10**9),
    ("hidden_size", 1 << 40), ("num_hidden_layers", 0), ("intermediate_size", "wide"),
])
def test_config_values_of_the_wrong_type_or_size(dense, key, value):
    """A value no model has is one problem and reads as absent: never a TypeError, never a billion-layer loop."""
    edit_config(dense, **{key: value})
    code, report, _, _ = inspect(dense)
    assert code == 1
    (p,) = [p for p in report["problems"] if p["check"] == "config-value"]
    assert p["file"] == "config.json" and p["message"].startswith(key)


@pytest.mark.parametrize("bits", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_json_numbers_in_the_config_are_refused(dense, bits):
    """Python's json reads NaN/Infinity; written back into inspect -f json or manifest.json they are not JSON."""
    text = (dense / "config.json").read_text().replace('"bits": 4', f'"bits": {bits}')
    assert bits in text
    (dense / "config.json").write_text(text)
    code, error, _, stderr = inspect(dense)
    assert code == 2 and "config.json: malformed JSON: " in error["error"]["message"], error
    assert len(stderr.splitlines()) == 1


@pytest.mark.parametrize("qc, words", [({"bits": 0.5}, "bits = 0.5 is not a number from 1 to 16"),
                                       ({"version": [1]}, "version = [1] is not a string")])
def test_quantization_config_values(dense, qc, words):
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"].update(qc)
    (dense / "config.json").write_text(json.dumps(config))
    code, report, _, _ = inspect(dense)
    assert code == 1 and [p["message"] for p in report["problems"]] == [words]


def test_missing_layers_are_one_problem_per_gap(dense):
    edit_config(dense, num_hidden_layers=5000)
    code, report, _, _ = inspect(dense)
    assert code == 1
    assert [(p["check"], p["tensor"], p["message"]) for p in report["problems"]] == [
        ("missing-layer", "model.layers.1", "layers 1..4999 of 5000 are missing: no EXL3 linears")]


def test_top_k_beyond_the_experts(moe):
    """Claimed sound but wrong: the reference would raise a raw torch error. Now a problem, and refused."""
    edit_config(moe, num_experts_per_tok=9)
    p = assert_problem(moe, "config-value", "config.json", "model.layers.0.mlp")
    assert p["message"] == "num_experts_per_tok = 9 is more than the 4 experts"
    with exl3tool.open_checkpoint(moe) as ckpt:
        with pytest.raises(CheckpointProblemsError, match="num_experts_per_tok"):
            ckpt.reference_forward("model.layers.0.mlp", torch.zeros(1, 256))


def test_routing_groups_that_do_not_divide_the_experts(tmp_path):
    path = write_checkpoint(tmp_path / "ds", ModelSpec(arch="deepseek_v3", num_layers=1, num_experts=3, top_k=1,
                                                       embeddings=False))
    p = assert_problem(path, "config-value", "config.json", "model.layers.0.mlp")
    assert p["message"] == "n_group = 2 does not divide the 3 experts"


def test_dense_model_type_with_experts(moe):
    edit_config(moe, model_type="llama")
    p = assert_problem(moe, "model-type", "config.json", "model.layers.0.mlp")
    assert "'llama' is a dense architecture" in p["message"]


def test_experts_the_config_does_not_declare(moe):
    edit_config(moe, num_experts=None)
    p = assert_problem(moe, "expert-count", "config.json", "model.layers.0.mlp")
    assert "declares no experts" in p["message"] and "stores 4" in p["message"]


def test_expert_numbers_far_beyond_the_config(moe):
    from exl3tool.synthetic import linear_state_dict, random_linear

    name = "model.layers.0.mlp.experts.999999999.up_proj"
    edit_checkpoint(moe, add=linear_state_dict(random_linear(256, 128, 4, "mcg", seed=1, name=name)))
    assert_problem(moe, "expert-count", FILE, "model.layers.0.mlp.experts.999999999")


def test_problem_lists_are_capped_per_check(dense):
    from exl3tool.inspection import PROBLEMS_PER_CHECK

    extra = {f"junk.{i}.weight": torch.zeros(1, dtype=torch.int16) for i in range(PROBLEMS_PER_CHECK + 7)}
    edit_checkpoint(dense, add=extra)
    code, report, human, _ = inspect(dense)
    assert code == 1 and report["problems_left_out"] == {"unknown-tensor": 7}
    assert len(report["problems"]) == PROBLEMS_PER_CHECK
    assert f"Problems ({PROBLEMS_PER_CHECK + 7})" in human and "  ... and 7 more unknown-tensor" in human
    assert human.count("unknown-tensor") == 1 and human.count("[unsupported]") == PROBLEMS_PER_CHECK


def test_problems_are_collected_not_stop_at_first(dense, moe):
    edit_checkpoint(dense, drop=[f"{Q}.suh"], replace={f"{GATE}.mcg": torch.tensor(1, dtype=torch.int32)},
                    add={"junk.trellis": torch.zeros(8, dtype=torch.int16)})
    code, report, _, _ = inspect(dense)
    assert code == 1
    assert {"missing-tensor", "marker-value", "ring-format"} <= {p["check"] for p in report["problems"]}


def _names(path):
    from safetensors import safe_open

    with safe_open(path / FILE, "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("entry, words", [
    ({"__metadata__": {"format": 1}}, "__metadata__ value 'format' is 1, not a string"),
    ({"__metadata__": ["pt"]}, "__metadata__ is ['pt'], not a map of strings"),
    ({"t": {"dtype": ["F16"], "shape": [1], "data_offsets": [0, 2]}}, "unknown dtype ['F16']"),
    ({"t": {"dtype": {"F16": 1}, "shape": [1], "data_offsets": [0, 2]}}, "unknown dtype an object of 1 key(s)"),
    ({"t": {"dtype": "F16", "shape": [[[[1]]]], "data_offsets": [0, 2]}}, "malformed shape a list of 1 item(s)"),
    ({"t": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2.0]}}, "malformed data_offsets [0, 2.0]"),
])
def test_header_values_of_the_wrong_type(dense, entry, words):
    header = json.dumps(entry).encode()
    data = b"\0\0" if "t" in entry else b""
    (dense / FILE).write_bytes(struct.pack("<Q", len(header)) + header + data)
    code, report, _, _ = inspect(dense)
    assert code == 2
    p = report["problems"][0]
    assert p["check"] == "safetensors" and words in p["message"], p


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json(dense, depth):
    """Nesting that would overflow the stack (or a recursive walk) is malformed input: exit 2, one line."""
    nested = "[" * depth + "]" * depth
    header = ('{"__metadata__": {"a": "b"}, "t": {"dtype": "F16", "shape": ' + nested + ', "data_offsets": [0, 0]}}')
    (dense / FILE).write_bytes(struct.pack("<Q", len(header)) + header.encode())
    code, report, _, _ = inspect(dense)
    assert code == 2 and report["problems"][0]["check"] == "safetensors"
    (dense / "config.json").write_text('{"quantization_config": {"quant_method": "exl3"}, "x": ' + nested + "}")
    code, error, _, stderr = inspect(dense)
    assert code == 2 and "config.json: malformed JSON: nested" in error["error"]["message"]
    assert len(stderr.splitlines()) == 1


# --- shards and the index --------------------------------------------------------------------------------

@pytest.fixture
def sharded(tmp_path):
    return write_checkpoint(tmp_path / "sharded", DENSE, shards=3)


def _rewrite_index(path, edit):
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    edit(index["weight_map"])
    index_path.write_text(json.dumps(index))


def test_sharded_base_is_sound(sharded):
    code, report, _, _ = inspect(sharded)
    assert code == 0 and report["summary"]["files"] == 3


def test_index_names_a_missing_file(sharded):
    _rewrite_index(sharded, lambda m: m.update({"lm_head.trellis": "model-00009-of-00009.safetensors"}))
    p = assert_problem(sharded, "index-file", "model.safetensors.index.json", "lm_head.trellis", exit_code=2)
    assert "does not exist" in p["message"]


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_names_a_path_outside_the_folder(sharded, target):
    (sharded.parent / "outside.safetensors").write_bytes((sharded / "model-00001-of-00003.safetensors").read_bytes())
    _rewrite_index(sharded, lambda m: m.update({"model.norm.weight": target}))
    p = assert_problem(sharded, "index-file", "model.safetensors.index.json", "model.norm.weight", exit_code=2)
    assert "outside the checkpoint folder" in p["message"]


@pytest.mark.parametrize("target, words", [("a\x00b.safetensors", "'a\\x00b.safetensors', not a file name"),
                                           ("", "'', not a file name"), ("sub", "'sub', which does not exist"),
                                           (".", "'.', a folder, not a regular file")])
def test_index_names_that_are_not_files(sharded, target, words):
    _rewrite_index(sharded, lambda m: m.update({"model.norm.weight": target}))
    code, report, human, _ = inspect(sharded)
    p = next(p for p in report["problems"] if p["check"] == "index-file")
    assert code == 2 and p["tensor"] == "model.norm.weight" and p["message"] == f"the index names {words}"
    assert len([line for line in human.splitlines() if "the index names" in line]) == 1


def test_index_names_inside_the_folder_by_any_path(sharded):
    """Only where a name points lexically matters: `sub/../x` stays inside, and a shard may be a symlink
    out of the folder (as every shard of a Hugging Face hub snapshot is)."""
    shard = "model-00001-of-00003.safetensors"
    (sharded / "sub").mkdir()
    outside = sharded.parent / "blobs" / "0123abcd"
    outside.parent.mkdir()
    (sharded / shard).rename(outside)
    (sharded / shard).symlink_to(f"../blobs/{outside.name}")
    _rewrite_index(sharded, lambda m: m.update({k: f"sub/../{v}" for k, v in m.items() if v == shard}))
    code, report, _, _ = inspect(sharded)
    assert code == 0 and report["summary"]["files"] == 3, report["problems"]


def test_index_places_a_tensor_in_a_file_without_it(sharded):
    _rewrite_index(sharded, lambda m: m.update({"model.layers.0.extra.weight": "model-00001-of-00003.safetensors"}))
    assert_problem(sharded, "missing-tensor", "model-00001-of-00003.safetensors", "model.layers.0.extra.weight")


def test_tensor_not_where_the_index_says(sharded):
    _rewrite_index(sharded, lambda m: m.pop("model.norm.weight"))
    shard = "model-00003-of-00003.safetensors"
    assert_problem(sharded, "index-mismatch", shard, "model.norm.weight")


def test_missing_shard_without_index(tmp_path):
    path = write_checkpoint(tmp_path / "noindex", DENSE, shards=3, index=False)
    assert inspect(path)[0] == 0
    (path / "model-00002-of-00003.safetensors").unlink()
    code, report, _, _ = inspect(path)
    assert code == 2
    assert report["problems"][0]["check"] == "shard-missing"
    assert report["problems"][0]["file"] == "model-00002-of-00003.safetensors"


def test_tensor_in_two_shards(sharded):
    from safetensors import safe_open

    with safe_open(sharded / "model-00001-of-00003.safetensors", "pt") as f:
        first = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(sharded / "model-00003-of-00003.safetensors", "pt") as f:
        last = {k: f.get_tensor(k) for k in f.keys()}
    name = next(iter(first))
    save_safetensors(sharded / "model-00003-of-00003.safetensors", {**last, name: first[name]})
    p = assert_problem(sharded, "duplicate-tensor", "model-00003-of-00003.safetensors", name)
    assert "model-00001-of-00003.safetensors" in p["message"]


# --- inputs that cannot be read at all -------------------------------------------------------------------

def test_no_such_folder(tmp_path):
    code, error, _, stderr = inspect(tmp_path / "nope")
    assert code == 2 and error["error"]["type"] == "UnreadableInputError"
    assert "nope" in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("content, words", [(None, "missing"), ("{oops", "malformed JSON"),
                                             ('{"quantization_config": {"quant_method": "gptq"}}', "not an EXL3"),
                                             ("[1, 2]", "not a JSON object"), ('{"a": 1}', "not an EXL3")])
def test_unreadable_config(dense, content, words):
    if content is None:
        (dense / "config.json").unlink()
    else:
        (dense / "config.json").write_text(content)
    code, error, _, stderr = inspect(dense)
    # the one line names the folder as well as the file
    assert code == 2 and words in error["error"]["message"] and error["error"]["file"] == str(dense / "config.json")
    assert stderr.count("\n") == 1 and str(dense / "config.json") in stderr


def test_no_weights(dense):
    (dense / FILE).unlink()
    code, error, _, _ = inspect(dense)
    assert code == 2 and "no *.safetensors" in error["error"]["message"]


def test_a_file_instead_of_a_folder(dense):
    code, error, _, _ = inspect(dense / "config.json")
    assert code == 2 and "not a folder" in error["error"]["message"]


def test_revision_with_a_local_folder_is_a_usage_error(dense):
    code, error, _, _ = inspect(dense, "--revision", "main")
    assert code == 2 and error["error"]["type"] == "UsageError"


def test_layer_out_of_range(dense):
    code, error, _, stderr = inspect(dense, "--layer", "5")
    assert code == 2 and "no layer 5" in stderr


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "x", "--format", "xml"], ["inspect", "x", "--bogus"],
                                  ["inspect", "x", "--layer", "-1"], ["nosuchcommand"]])
def test_typer_usage_errors_exit_2(args):
    result = run_cli(*args)
    assert result.exit_code == 2


# --- hostile names ---------------------------------------------------------------------------------------

def test_hostile_tensor_names_are_printed_safely(dense):
    evil = "model.layers.0.\x1b[31mred[/]\nFAKE: line[bold]x"
    edit_checkpoint(dense, add={f"{evil}.scales": torch.zeros(2, dtype=torch.int32)})
    code, report, human, _ = inspect(dense)
    assert code == 1
    assert any(p["tensor"] == f"{evil}.scales" for p in report["problems"])  # JSON keeps the exact name
    assert "\x1b" not in human
    line = next(line for line in human.splitlines() if "FAKE" in line)
    assert "\\x1b[31mred[/]\\x0aFAKE: line[bold]x.scales" in line
    assert not any(line.startswith("FAKE") for line in human.splitlines())


def test_genuine_fixture_damaged_in_place(copy_of):
    path = copy_of(model_dir("llama_mcg"))
    shard = path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    code, report, _, _ = inspect(path)
    assert code == 2
    assert report["problems"][0]["file"] == "model-00002-of-00002.safetensors"
