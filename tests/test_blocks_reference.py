"""Whole-block reference on synthetic checkpoints of every MoE naming: routing checked against a naive
per-token loop written from the HF modeling code, experts and shared experts through single-expert forwards."""

from __future__ import annotations

import pytest
import torch

import exl3tool
from exl3tool.errors import UnsupportedFeatureError, UsageError
from exl3tool.format import MoEBlock
from exl3tool.synthetic import ModelSpec, edit_checkpoint, write_checkpoint
from helpers import edit_config


def naive_weights(x, router, cfg, bias=None):
    """{expert: weight} per token, one token at a time, following the HF routing code."""
    out = []
    for row in x.double():
        logits = router.double() @ row
        if cfg["method"] == "softmax":
            scores = logits.softmax(-1)
            top = sorted(range(len(scores)), key=lambda e: -scores[e])[: cfg["top_k"]]
            weights = {e: scores[e].item() for e in top}
        else:  # DeepSeek-V3 noaux_tc
            scores = logits.sigmoid()
            choice = scores + bias.double()
            per = len(scores) // cfg["n_group"]
            groups = [sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True) for g in range(cfg["n_group"])]
            group_score = [sum(g[:2]) for g in groups]
            kept = sorted(range(cfg["n_group"]), key=lambda g: -group_score[g])[: cfg["topk_group"]]
            allowed = [e for e in range(len(scores)) if e // per in kept]
            top = sorted(allowed, key=lambda e: -choice[e])[: cfg["top_k"]]
            weights = {e: scores[e].item() for e in top}
        if cfg["normalize"]:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        out.append({e: w * cfg.get("scale", 1.0) for e, w in weights.items()})
    return out


ARCHS = {
    "qwen3_moe": dict(block="mlp", method="softmax", normalize=True),
    "mixtral": dict(block="block_sparse_moe", method="softmax", normalize=True),
    "minimax_m2": dict(block="block_sparse_moe", method="sigmoid", normalize=True, n_group=1, topk_group=1),
    "qwen2_moe": dict(block="mlp", method="softmax", normalize=False, shared="shared_expert"),
    "qwen3_next": dict(block="mlp", method="softmax", normalize=True, shared="shared_expert"),
    "deepseek_v3": dict(block="mlp", method="sigmoid", normalize=True, shared="shared_experts", scale=2.5,
                        n_group=2, topk_group=1),
    "lfm2_moe": dict(block="feed_forward", method="sigmoid", normalize=True, scale=2.5, n_group=1, topk_group=1),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_block_equals_sum_of_routed_experts(tmp_path, arch):
    cfg = {**ARCHS[arch], "top_k": 2}
    spec = ModelSpec(arch=arch, num_layers=1, num_experts=4, top_k=2, norm_topk_prob=cfg["normalize"],
                     embeddings=False, per_linear={"*.experts.1.*": (2.5, "mul1"), "*.experts.3.down*": (6, "3inst")})
    path = write_checkpoint(tmp_path / arch, spec)
    name = f"model.layers.0.{cfg['block']}"
    x = torch.randn(6, 256)
    with exl3tool.open_checkpoint(path) as ckpt:
        block = ckpt.block(name)
        assert isinstance(block, MoEBlock) and len(block.experts) == 4
        got = ckpt.reference_forward(name, x)
        router = ckpt.load_tensor(block.router.name)
        bias = ckpt.load_tensor(block.correction_bias.name) if block.correction_bias else None
        expected = torch.zeros(6, 256, dtype=torch.float64)
        for t, weights in enumerate(naive_weights(x, router, cfg, bias)):
            for e, w in weights.items():
                expected[t] += w * ckpt.reference_forward(f"{name}.experts.{e}", x[t : t + 1])[0].double()
        if "shared" in cfg:
            shared = ckpt.reference_forward(f"{name}.{cfg['shared']}", x).double()
            if block.shared_expert_gate is not None:
                gate = ckpt.load_tensor(block.shared_expert_gate.name).double()
                shared = shared * torch.sigmoid(x.double() @ gate.T)
            expected += shared
        assert (block.shared_experts is not None) == ("shared" in cfg)
    assert got.dtype == torch.float32 and got.shape == (6, 256)
    rel = ((got.double() - expected).norm() / expected.norm()).item()
    assert rel < 1e-5, rel


def test_gpt_oss_block_follows_hf(tmp_path):
    """gpt-oss (HF GptOssTopKRouter, GptOssExperts): the router's bias on the logits, a softmax over the top-k
    logits, experts with biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate <= 7, |up| <= 7),
    written here from dequantized weights; inputs large enough that the clamps bite."""
    path = write_checkpoint(tmp_path / "oss", ModelSpec(arch="gpt_oss", num_layers=1, num_experts=6, top_k=3,
                                                        intermediate=192, embeddings=False))
    name, x = "model.layers.0.mlp", 30 * torch.randn(5, 256, dtype=torch.float64)
    # a bias as large as the logits, so that it changes the choice
    edit_checkpoint(path, replace={f"{name}.router.bias": 300 * torch.randn(6).to(torch.bfloat16)})
    with exl3tool.open_checkpoint(path) as ckpt:
        block = ckpt.block(name)
        assert (block.router.name, block.router_bias.name) == (f"{name}.router.weight", f"{name}.router.bias")
        assert (block.experts[0].activation, block.experts[0].activation_limit) == ("swiglu_oai", 7.0)
        logits = x @ ckpt.load_tensor(block.router.name).double().T + ckpt.load_tensor(block.router_bias.name).double()
        top, chosen = logits.topk(3, dim=-1)
        weights = top.softmax(-1)

        def linear(lin, h):
            return h @ ckpt.dequantize(lin.name).double().T + ckpt.load_tensor(f"{lin.name}.bias").double()[
                : lin.out_features]

        expected, clamped = torch.zeros(5, 256, dtype=torch.float64), 0
        for t in range(5):
            for w, e in zip(weights[t], chosen[t].tolist()):
                mlp = block.experts[e]
                gate, up = linear(mlp.gate, x[t]), linear(mlp.up, x[t])
                clamped += int((gate > 7).sum() + (up.abs() > 7).sum())
                gate, up = gate.clamp(max=7), up.clamp(-7, 7)
                expected[t] += w * linear(mlp.down, (up + 1) * gate * torch.sigmoid(1.702 * gate))
        got = ckpt.reference_forward(name, x.float())
    assert clamped > 0
    rel = ((got.double() - expected).norm() / expected.norm()).item()
    assert rel < 1e-5, rel


def test_dense_mlp_is_silu_gated(tmp_path):
    path = write_checkpoint(tmp_path / "d", ModelSpec(num_layers=1, embeddings=False, attention_bias=True))
    x = torch.randn(3, 256)
    with exl3tool.open_checkpoint(path) as ckpt:
        p = "model.layers.0.mlp"
        gate = x @ ckpt.dequantize(f"{p}.gate_proj").T
        up = x @ ckpt.dequantize(f"{p}.up_proj").T
        expected = (torch.nn.functional.silu(gate) * up) @ ckpt.dequantize(f"{p}.down_proj").T
        got = ckpt.reference_forward(p, x)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
        q = "model.layers.0.self_attn.q_proj"  # with bias
        assert ckpt.linear(q).has_bias
        bias = ckpt.load_tensor(f"{q}.bias").float()
        assert torch.allclose(ckpt.reference_forward(q, x), x @ ckpt.dequantize(q).T + bias, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keys,kind", [
    (dict(hidden_act="gelu_pytorch_tanh"), "gelu_tanh"),
    (dict(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"), "gelu_tanh"),  # Gemma: hidden_activation first
    (dict(hidden_act="gelu"), "gelu"), (dict(hidden_act="gelu_new"), "gelu_tanh"), (dict(hidden_act="swish"), "silu"),
    (dict(hidden_act=None), "silu"),
])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_mlp_activation_from_the_config(tmp_path, arch, keys, kind):
    """The gated MLPs compute config.json's activation (before, SiLU whatever it said): a dense MLP and every expert
    of a MoE block equal down(act(gate(x)) * up(x)) from their single linears, act by HF's definition."""
    path = write_checkpoint(tmp_path / arch, ModelSpec(arch=arch, num_layers=1, embeddings=False))
    edit_config(path, **keys)
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[kind]
    x = torch.randn(3, 256)
    with exl3tool.open_checkpoint(path) as ckpt:
        block = ckpt.block("model.layers.0.mlp")
        mlps = block.experts if isinstance(block, MoEBlock) else (block,)
        assert {m.activation for m in mlps} == {kind}
        for m in mlps[:2]:
            gate, up = (ckpt.reference_forward(lin.name, x).double() for lin in (m.gate, m.up))
            want = ckpt.reference_forward(m.down.name, act(gate).float() * up.float()).double()
            got = ckpt.reference_forward(m.name, x).double()
            assert ((got - want).norm() / want.norm()).item() < 1e-6, m.name
    assert exl3tool.inspect_checkpoint(str(path)).to_json()["summary"]["activation"] == kind


def test_unknown_mlp_activation_is_refused_for_blocks_only(tmp_path):
    path = write_checkpoint(tmp_path / "relu2", ModelSpec(arch="qwen3_moe", num_layers=1, embeddings=False,
                                                          hidden_act="relu2"))
    with exl3tool.open_checkpoint(path) as ckpt:
        for name in ("model.layers.0.mlp", "model.layers.0.mlp.experts.0"):
            with pytest.raises(UnsupportedFeatureError, match="relu2"):
                ckpt.reference_forward(name, torch.randn(1, 256))
        assert ckpt.reference_forward("model.layers.0.mlp.experts.0.up_proj", torch.randn(1, 256)).shape == (1, 128)
    report = exl3tool.inspect_checkpoint(str(path))
    assert any("activation 'relu2' is not known" in note for note in report.notes)


def test_every_activation_kind_has_its_function():
    from exl3tool.format import ACTIVATION_KINDS
    from exl3tool.reference import ACTIVATIONS

    assert set(ACTIVATION_KINDS.values()) == set(ACTIVATIONS)


def test_layer_lists_linears_and_blocks(tmp_path):
    path = write_checkpoint(tmp_path / "q2", ModelSpec(arch="qwen2_moe", num_layers=2, dense_layers=(1,),
                                                       embeddings=False))
    with exl3tool.open_checkpoint(path) as ckpt:
        moe, dense = ckpt.layer(0), ckpt.layer(1)
        assert [b.name for b in moe.blocks][:2] == ["model.layers.0.mlp", "model.layers.0.mlp.experts.0"]
        assert moe.blocks[-1].name == "model.layers.0.mlp.shared_expert"
        assert len(moe.linears) == 4 + 4 * 3 + 3
        assert [b.name for b in dense.blocks] == ["model.layers.1.mlp"]


def test_unknown_routing_is_refused_for_blocks_only(tmp_path):
    path = write_checkpoint(tmp_path / "u", ModelSpec(arch="qwen3_moe", num_layers=1, embeddings=False))
    edit_config(path, model_type="someone_elses_moe")
    with exl3tool.open_checkpoint(path) as ckpt:
        with pytest.raises(UnsupportedFeatureError):
            ckpt.reference_forward("model.layers.0.mlp", torch.randn(1, 256))
        assert ckpt.reference_forward("model.layers.0.mlp.experts.0", torch.randn(1, 256)).shape == (1, 256)


@pytest.mark.parametrize("arch,model_type,renormalised", [
    ("qwen3_next", "qwen3_next", True), ("qwen3_next", "qwen3_5_moe", True), ("qwen3_next", "qwen3_5_moe_text", True),
    ("qwen3_moe", "qwen3_vl_moe_text", True), ("qwen2_moe", "qwen2_moe", False), ("qwen3_moe", "qwen3_moe", False),
])
def test_routing_default_when_the_config_leaves_norm_topk_prob_out(tmp_path, arch, model_type, renormalised):
    """Qwen3-Next and Qwen3.5 are qwen2_moe's block renormalised, Qwen3-VL qwen3_moe's (ExLlamaV3 loads them no other
    way), Qwen2-MoE and Qwen3-MoE by default not: a config without norm_topk_prob routes as the model type does,
    and a block's weights sum to one exactly when renormalised (a shared expert adds its gated output)."""
    path = write_checkpoint(tmp_path / arch, ModelSpec(arch=arch, num_layers=1, num_experts=6, top_k=3,
                                                       embeddings=False))
    edit_config(path, norm_topk_prob=None, model_type=model_type)
    x = torch.randn(5, 256)
    with exl3tool.open_checkpoint(path) as ckpt:
        block = ckpt.block("model.layers.0.mlp")
        assert (block.routing.method, block.routing.top_k, block.routing.normalize) == ("softmax_topk", 3,
                                                                                        renormalised)
        router = ckpt.load_tensor(block.router.name)
        weights = naive_weights(x, router, dict(method="softmax", top_k=3, normalize=renormalised))
        sums = [sum(w.values()) for w in weights]
        assert all(abs(total - 1) < 1e-12 for total in sums) == renormalised
        got = ckpt.reference_forward("model.layers.0.mlp", x).double()
        expected = torch.zeros(5, 256, dtype=torch.float64)
        if block.shared_experts is not None:
            shared = ckpt.reference_forward("model.layers.0.mlp.shared_expert", x).double()
            expected += shared * torch.sigmoid(x.double() @ ckpt.load_tensor(block.shared_expert_gate.name).double().T)
        for t, chosen in enumerate(weights):
            for e, w in chosen.items():
                expected[t] += w * ckpt.reference_forward(f"model.layers.0.mlp.experts.{e}", x[t:t + 1])[0].double()
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("model_type", ["glm4_moe", "glm4_moe_lite", "dots1", "kimi_k2"])
def test_deepseek_like_model_types_route_as_deepseek_v3(tmp_path, model_type):
    """DeepSeek-V3's names and router in other models (one routing group): the same routing read from the config,
    the same block output bit for bit."""
    path = write_checkpoint(tmp_path / "ds", ModelSpec(arch="deepseek_v3", num_layers=1, num_experts=8, top_k=3,
                                                       n_group=1, topk_group=1, embeddings=False))
    x = torch.randn(4, 256)
    with exl3tool.open_checkpoint(path) as ckpt:
        routing, want = ckpt.block("model.layers.0.mlp").routing, ckpt.reference_forward("model.layers.0.mlp", x)
    edit_config(path, model_type=model_type)
    with exl3tool.open_checkpoint(path) as ckpt:
        assert ckpt.block("model.layers.0.mlp").routing == routing and routing.method == "sigmoid_noaux_tc"
        assert torch.equal(ckpt.reference_forward("model.layers.0.mlp", x), want)


def rename_tensors(path, renames: dict[str, str]) -> None:
    """Move every tensor whose name starts with a key of ``renames`` to the same name under its value."""
    from safetensors import safe_open

    moved = {}
    for shard in sorted(path.glob("model*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                old = next((o for o in renames if name.startswith(o)), None)
                if old is not None:
                    moved[name] = (renames[old] + name[len(old):], f.get_tensor(name))
    edit_checkpoint(path, drop=list(moved), add=dict(moved.values()))


# model type: (block, tensor renames from DeepSeek-V3's, config.json keys from DeepSeek-V3's: value or None to drop)
# as ExLlamaV3 1.6.5's architectures name them (their router "dots", Ling's "ds3")
DEEPSEEK_RENAMED = {
    "glm_moe_dsa": ("mlp", {}, {}),
    "glm4v_moe_text": ("mlp", {}, {}),
    "solar_open": ("mlp", {}, {}),
    "mimo_v2": ("mlp", {}, {}),
    "hy_v3": ("mlp", {"model.layers.0.mlp.gate.weight": "model.layers.0.mlp.router.gate.weight",
                      "model.layers.0.mlp.gate.e_score_correction_bias": "model.layers.0.mlp.expert_bias",
                      "model.layers.0.mlp.shared_experts.": "model.layers.0.mlp.shared_mlp."},
              {"routed_scaling_factor": None, "router_scaling_factor": 2.5, "n_shared_experts": None,
               "num_shared_experts": 1, "norm_topk_prob": None, "route_norm": True}),
    "afmoe": ("mlp", {"model.layers.0.mlp.gate.weight": "model.layers.0.mlp.router.gate.weight",
                      "model.layers.0.mlp.gate.e_score_correction_bias": "model.layers.0.mlp.expert_bias"},
              {"routed_scaling_factor": None, "route_scale": 2.5, "n_shared_experts": None, "num_shared_experts": 1}),
    "laguna": ("mlp", {"model.layers.0.mlp.gate.e_score_correction_bias":
                       "model.layers.0.mlp.experts.e_score_correction_bias",
                       "model.layers.0.mlp.shared_experts.": "model.layers.0.mlp.shared_expert."},
               {"routed_scaling_factor": None, "moe_routed_scaling_factor": 2.5, "n_shared_experts": None,
                "shared_expert_intermediate_size": 128}),
    "bailing_hybrid": ("mlp", {"model.layers.0.mlp.gate.e_score_correction_bias": "model.layers.0.mlp.gate.expert_bias"},
                       {"n_shared_experts": None, "num_shared_experts": 1}),
    "kimi_linear": ("block_sparse_moe",
                    {**{f"model.layers.0.mlp.experts.{e}.{a}.": f"model.layers.0.block_sparse_moe.experts.{e}.{b}."
                        for e in range(8) for a, b in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))},
                     "model.layers.0.mlp.": "model.layers.0.block_sparse_moe."},
                    {"n_routed_experts": None, "num_experts": 8, "num_experts_per_tok": None, "num_experts_per_token": 3,
                     "n_group": None, "num_expert_group": 2, "n_shared_experts": None, "num_shared_experts": 1,
                     "norm_topk_prob": None, "moe_renormalize": True}),
}


@pytest.mark.parametrize("model_type", list(DEEPSEEK_RENAMED))
def test_deepseek_routed_model_types_by_their_own_names(tmp_path, model_type):
    """GLM-5 (glm_moe_dsa), GLM-4.5V's text model, Solar Open, MiMo-V2, HY-V3, AFMoE, Laguna, Ling (bailing_hybrid) and
    Kimi-Linear route as DeepSeek-V3 does (ExLlamaV3's "dots" router, Ling's "ds3" with routing groups) under their
    own tensor and config names: the same routing, no problem reported, the same block output bit for bit. Bailing
    and Kimi keep two routing groups. Without the scale in config.json, ExLlamaV3's default for the type."""
    grouped = model_type in ("bailing_hybrid", "kimi_linear")
    path = write_checkpoint(tmp_path / "ds", ModelSpec(
        arch="deepseek_v3", num_layers=1, num_experts=8, top_k=3, n_group=2 if grouped else 1, topk_group=1,
        moe_intermediate=128, num_shared_experts=1, embeddings=False))
    x = torch.randn(4, 256)
    with exl3tool.open_checkpoint(path) as ckpt:
        routing, want = ckpt.block("model.layers.0.mlp").routing, ckpt.reference_forward("model.layers.0.mlp", x)
    assert routing.scale == 2.5 and routing.n_group == (2 if grouped else 1) and routing.normalize
    block, renames, keys = DEEPSEEK_RENAMED[model_type]
    rename_tensors(path, renames)
    edit_config(path, model_type=model_type, **keys)
    with exl3tool.open_checkpoint(path) as ckpt:
        assert ckpt.check() == []
        moe = ckpt.block(f"model.layers.0.{block}")
        assert moe.routing == routing and moe.shared_experts is not None and moe.correction_bias is not None
        assert torch.equal(ckpt.reference_forward(moe.name, x), want)
    scale_key = next((k for k, v in keys.items() if "scal" in k and v is not None), "routed_scaling_factor")
    edit_config(path, **{scale_key: None})
    with exl3tool.open_checkpoint(path) as ckpt:
        assert ckpt.block(f"model.layers.0.{block}").routing.scale == {"hy_v3": 2.826, "solar_open": 2.0}.get(
            model_type, 1.0)


def test_mistral4_routes_by_softmax_with_deepseek_names(tmp_path):
    """Mistral-Small-4's text model (mistral4): DeepSeek-V3's names and its ungated shared experts, but a softmax
    router renormalised over the top-k, no correction bias and no scale (ExLlamaV3's "std" router)."""
    path = write_checkpoint(tmp_path / "ds", ModelSpec(arch="deepseek_v3", num_layers=1, num_experts=8, top_k=3,
                                                       n_group=1, topk_group=1, embeddings=False))
    edit_checkpoint(path, drop=["model.layers.0.mlp.gate.e_score_correction_bias"])
    edit_config(path, model_type="mistral4", routed_scaling_factor=None, scoring_func=None, topk_method=None)
    name, x = "model.layers.0.mlp", torch.randn(5, 256)
    with exl3tool.open_checkpoint(path) as ckpt:
        assert ckpt.check() == []
        block = ckpt.block(name)
        assert (block.routing.method, block.routing.normalize, block.routing.scale) == ("softmax_topk", True, 1.0)
        got = ckpt.reference_forward(name, x).double()
        router = ckpt.load_tensor(block.router.name)
        expected = ckpt.reference_forward(f"{name}.shared_experts", x).double()
        for t, weights in enumerate(naive_weights(x, router, dict(method="softmax", top_k=3, normalize=True))):
            for e, w in weights.items():
                expected[t] += w * ckpt.reference_forward(f"{name}.experts.{e}", x[t : t + 1])[0].double()
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5


def test_wrong_input_width_is_a_usage_error(tmp_path):
    path = write_checkpoint(tmp_path / "w", ModelSpec(num_layers=1, embeddings=False))
    with exl3tool.open_checkpoint(path) as ckpt:
        with pytest.raises(UsageError):
            ckpt.reference_forward("model.layers.0.mlp", torch.randn(2, 100))
        with pytest.raises(exl3tool.NotFoundError):
            ckpt.reference_forward("model.layers.0.nothing", torch.randn(2, 256))
