"""Synthetic EXL3 checkpoints of our own, for tests and benchmarks (random weights, real format).

    random_linear(in_features, out_features, bits, codebook, *, seed, bias=False, legacy_signs=False,
                  name="linear") -> LinearTensors
    linear_state_dict(tensors) -> {tensor name: Tensor}        what a checkpoint stores for one linear
    ModelSpec(...)                                             shape, architecture, K/codebook (per tensor too)
    write_checkpoint(path, spec=None, **spec_fields) -> Path   config.json + safetensors (+ index)
    save_safetensors(path, tensors)                            a plain safetensors writer (raw bytes allowed)
    edit_checkpoint(path, drop=(), replace=None, add=None)     rewrite shards and index consistently

Architectures: "llama" (dense), "qwen3_moe", "qwen2_moe" (shared expert + sigmoid gate), "qwen3_next" (qwen2_moe's
MoE block, renormalised; linear-attention layers, ExLlamaV3's names: in_proj_qkvz and out_proj quantized, in_proj_ba
not, with a gated full-attention layer every `full_attention_interval`), "mixtral" (block_sparse_moe, w1/w3/w2),
"minimax_m2" (Mixtral's names, sigmoid routing with a correction bias, experts `intermediate` wide), "deepseek_v3"
(shared experts, sigmoid group-limited routing), "gpt_oss" (a router with a bias, experts `intermediate` wide with
biases and the clamped SwiGLU, attention with biases and sinks), "lfm2_moe" (feed_forward blocks, w1/w3/w2, sigmoid
routing with `expert_bias`; short-convolution layers conv.in_proj / out_proj between attention layers with out_proj).
Everything is deterministic in `seed`.
"""

from __future__ import annotations

import fnmatch
import json
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import torch

from exl3tool.checkpoint import TORCH_DTYPES
from exl3tool.format import (
    MCG_MARKER, MUL1_MARKER, TILE, Codebook, LinearInfo, LinearTensors, padded, words_from_bits,
)
from exl3tool.io.config import GATED_QUERY_TYPES, GATED_SHARED_EXPERT_TYPES
from exl3tool.reference.signs import pack_signs

_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # torch dtype -> safetensors name
SUH_MAGNITUDE = (0.018, 0.024)  # what ExLlamaV3's converter produces for unit-scale weights
SVH_MAGNITUDE = (0.9, 1.1)


# --- one linear ------------------------------------------------------------------------------------------


def _signed(n: int, low: float, high: float, g: torch.Generator) -> torch.Tensor:
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (signs * (low + (high - low) * torch.rand(n, generator=g))).half()


def random_linear(
    in_features: int, out_features: int, bits: float, codebook: Codebook | str, *, seed: int,
    bias: bool = False, legacy_signs: bool = False, name: str = "linear",
) -> LinearTensors:
    """A random EXL3 linear: random trellis bits, suh = random signs x ~0.02 (padded rows included),
    svh = random signs x ~1 and exactly 0 on padded output columns (legacy: +-1 signs, as su/sv store)."""
    codebook = Codebook(codebook)
    words = words_from_bits(bits)
    if words % TILE and codebook is not Codebook.MUL1:
        raise ValueError(f"K={bits} exists for the mul1 codebook only")
    in_p, out_p = padded(in_features), padded(out_features)
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_p // TILE, out_p // TILE, words), dtype=torch.int16, generator=g)
    if legacy_signs:
        suh, svh = _signed(in_p, 1, 1, g), _signed(out_p, 1, 1, g)
    else:
        suh, svh = _signed(in_p, *SUH_MAGNITUDE, g), _signed(out_p, *SVH_MAGNITUDE, g)
        svh[out_features:] = 0
    b = None
    if bias:
        b = (torch.randn(out_p, generator=g) * 0.1).half()
        b[out_features:] = 0
    info = LinearInfo(name, in_features, out_features, in_p, out_p, float(bits), codebook, bias, legacy_signs,
                      dims_from_config=True)
    return LinearTensors(info, trellis, suh, svh, b)


def linear_state_dict(t: LinearTensors) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores for `t`, keyed by full tensor name."""
    name = t.info.name
    out = {f"{name}.trellis": t.trellis}
    if t.info.legacy_signs:
        out[f"{name}.su"], out[f"{name}.sv"] = pack_signs(t.suh), pack_signs(t.svh)
    else:
        out[f"{name}.suh"], out[f"{name}.svh"] = t.suh, t.svh
    if t.info.codebook is Codebook.MCG:
        out[f"{name}.mcg"] = torch.tensor(MCG_MARKER, dtype=torch.int32)
    elif t.info.codebook is Codebook.MUL1:
        out[f"{name}.mul1"] = torch.tensor(MUL1_MARKER, dtype=torch.int32)
    if t.bias is not None:
        out[f"{name}.bias"] = t.bias
    return out


# --- safetensors -----------------------------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def save_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor | tuple[str, tuple, bytes]]) -> None:
    """Write a safetensors file. A value may be a tensor or (dtype name, shape, raw bytes) for odd cases."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            dtype, shape, blob = _DTYPE_NAMES[value.dtype], list(value.shape), _tensor_bytes(value)
        else:
            dtype, shape, blob = value[0], list(value[1]), bytes(value[2])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the safetensors convention: data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


# --- whole checkpoints -----------------------------------------------------------------------------------

ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM", "mixtral": "MixtralForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM",
}
BLOCK_SPARSE_MOE = ("mixtral", "minimax_m2")  # block_sparse_moe.experts.N.w1 / w3 / w2, `intermediate` wide
MOE_BLOCK_NAMES = {**{a: "block_sparse_moe" for a in BLOCK_SPARSE_MOE}, "lfm2_moe": "feed_forward"}
W_NAMED_EXPERTS = (*BLOCK_SPARSE_MOE, "lfm2_moe")  # experts (and LFM2's dense MLPs) named w1 / w3 / w2
W_NAMES = ("w1", "w3", "w2")
PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")
INTERMEDIATE_WIDE_EXPERTS = (*BLOCK_SPARSE_MOE, "gpt_oss")  # experts `intermediate` wide, not `moe_intermediate`
GATED_SHARED_EXPERT = tuple(a for a in ARCHITECTURES if a in GATED_SHARED_EXPERT_TYPES)  # mlp.shared_expert


@dataclass
class ModelSpec:
    """What `write_checkpoint` builds. `per_linear` maps fnmatch patterns of module names to (K, codebook)
    overrides, first match wins, e.g. {"*.down_proj": (6, "mul1")}."""

    arch: str = "llama"
    hidden: int = 256
    intermediate: int = 320  # dense MLP (and the experts of BLOCK_SPARSE_MOE)
    moe_intermediate: int = 128
    shared_intermediate: int = 192  # qwen2_moe shared expert; deepseek_v3 uses moe_intermediate * n_shared
    num_shared_experts: int = 1
    num_layers: int = 2
    num_experts: int = 4
    top_k: int = 2
    norm_topk_prob: bool = True
    hidden_act: str = "silu"  # config.json's name of the MLPs' activation
    dense_layers: tuple[int, ...] = ()  # MoE models: layers with a dense MLP instead
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 1024
    bits: float = 4
    head_bits: float = 6  # 16 = unquantized fp16 lm_head
    codebook: Codebook | str = Codebook.MCG
    per_linear: dict[str, tuple[float, Codebook | str]] = field(default_factory=dict)
    attention_bias: bool = False
    legacy_signs: bool = False
    shards: int = 1
    index: bool | None = None  # default: an index exactly when sharded
    embeddings: bool = True
    seed: int = 0
    n_group: int = 2  # deepseek_v3 routing groups
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    full_attention_interval: int = 4  # qwen3_next: layer i is full attention where (i + 1) % interval == 0
    linear_heads: tuple[int, int, int] = (2, 4, 32)  # qwen3_next linear attention: key heads, value heads, head dim

    @property
    def moe(self) -> bool:
        return self.arch != "llama"


def _config(spec: ModelSpec) -> dict:
    cfg = {
        "architectures": [ARCHITECTURES[spec.arch]], "model_type": spec.arch, "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab, "hidden_act": spec.hidden_act, "tie_word_embeddings": False,
        "attention_bias": spec.attention_bias, "rms_norm_eps": 1e-6,
    }
    if spec.arch in ("qwen3_moe", *GATED_SHARED_EXPERT):
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.top_k, norm_topk_prob=spec.norm_topk_prob,
                   moe_intermediate_size=spec.moe_intermediate, mlp_only_layers=list(spec.dense_layers))
        if spec.arch in GATED_SHARED_EXPERT:
            cfg["shared_expert_intermediate_size"] = spec.shared_intermediate
        if spec.arch == "qwen3_next":
            key_heads, value_heads, head_dim = spec.linear_heads
            cfg.update(full_attention_interval=spec.full_attention_interval, linear_num_key_heads=key_heads,
                       linear_num_value_heads=value_heads, linear_key_head_dim=head_dim,
                       linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
                       layer_types=[_qwen3_next_layer(spec, i) for i in range(spec.num_layers)])
    elif spec.arch in BLOCK_SPARSE_MOE or spec.arch == "gpt_oss":
        cfg.update(num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k)
        if spec.arch == "gpt_oss":
            cfg.update(swiglu_limit=7.0, attention_bias=True)
        if spec.arch == "minimax_m2":
            cfg.update(scoring_func="sigmoid", use_routing_bias=True)
    elif spec.arch == "lfm2_moe":
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.top_k, norm_topk_prob=spec.norm_topk_prob,
                   moe_intermediate_size=spec.moe_intermediate, routed_scaling_factor=spec.routed_scaling_factor,
                   use_expert_bias=True, num_dense_layers=len(spec.dense_layers),
                   layer_types=[_lfm2_layer(i) for i in range(spec.num_layers)])
    elif spec.arch == "deepseek_v3":
        cfg.update(n_routed_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
                   moe_intermediate_size=spec.moe_intermediate, n_shared_experts=spec.num_shared_experts,
                   norm_topk_prob=spec.norm_topk_prob, scoring_func="sigmoid", topk_method="noaux_tc",
                   n_group=spec.n_group, topk_group=spec.topk_group,
                   routed_scaling_factor=spec.routed_scaling_factor, first_k_dense_replace=len(spec.dense_layers))
    cfg["quantization_config"] = {
        "quant_method": "exl3", "version": "1.6.5", "bits": float(spec.bits), "head_bits": spec.head_bits,
        "calibration": {"rows": 16, "cols": 512}, "out_scales": "auto", "codebook": Codebook(spec.codebook).value,
    }
    return cfg


class _Writer:
    """Accumulates modules (each a dict of tensors kept together in one shard)."""

    def __init__(self, spec: ModelSpec):
        self.spec, self.modules, self.seed = spec, [], spec.seed * 1_000_003

    def linear(self, name: str, in_features: int, out_features: int, *, bits=None, bias=False) -> None:
        spec = self.spec
        bits, codebook = (spec.bits if bits is None else bits), spec.codebook
        for pattern, (k, cb) in spec.per_linear.items():
            if fnmatch.fnmatchcase(name, pattern):
                bits, codebook = k, cb
                break
        self.seed += 1
        t = random_linear(in_features, out_features, bits, codebook, seed=self.seed, bias=bias,
                          legacy_signs=spec.legacy_signs, name=name)
        self.modules.append(linear_state_dict(t))

    def plain(self, name: str, shape: tuple[int, ...], dtype=torch.bfloat16, scale: float = 0.02) -> None:
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        self.modules.append({name: (torch.randn(shape, generator=g) * scale).to(dtype)})

    def mlp(self, prefix: str, hidden: int, inter: int, names=PROJ_NAMES, bias: bool = False) -> None:
        gate, up, down = names
        self.linear(f"{prefix}.{gate}", hidden, inter, bias=bias)
        self.linear(f"{prefix}.{up}", hidden, inter, bias=bias)
        self.linear(f"{prefix}.{down}", inter, hidden, bias=bias)


def _build(spec: ModelSpec) -> list[dict[str, torch.Tensor]]:
    w = _Writer(spec)
    h = spec.hidden
    if spec.embeddings:
        w.plain("model.embed_tokens.weight", (spec.vocab, h))
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        w.plain(f"{p}.input_layernorm.weight", (h,), scale=1.0)
        if spec.arch == "qwen3_next" and _qwen3_next_layer(spec, i) == "linear_attention":
            _linear_attention(w, f"{p}.linear_attn", spec)
        elif spec.arch == "lfm2_moe" and _lfm2_layer(i) == "conv":
            _short_conv(w, f"{p}.conv", spec)
        else:
            gated = 2 if spec.arch in GATED_QUERY_TYPES else 1  # q_proj also gives the attention output's gate
            out = "out_proj" if spec.arch == "lfm2_moe" else "o_proj"
            for proj, fan_in, fan_out in (("q_proj", h, gated * q), ("k_proj", h, kv), ("v_proj", h, kv),
                                          (out, q, h)):
                bias = spec.arch == "gpt_oss" or (spec.attention_bias and proj != "o_proj")
                w.linear(f"{p}.self_attn.{proj}", fan_in, fan_out, bias=bias)
            if spec.arch == "gpt_oss":
                w.plain(f"{p}.self_attn.sinks", (spec.num_heads,), scale=1.0)
        w.plain(f"{p}.post_attention_layernorm.weight", (h,), scale=1.0)
        block = f"{p}.{MOE_BLOCK_NAMES.get(spec.arch, 'mlp')}"
        names = W_NAMES if spec.arch in W_NAMED_EXPERTS else PROJ_NAMES
        if not spec.moe or i in spec.dense_layers:
            if spec.arch == "lfm2_moe":  # LFM2's dense MLP takes its MoE blocks' names
                w.mlp(block, h, spec.intermediate, names)
            else:
                w.mlp(f"{p}.mlp", h, spec.intermediate)
            continue
        if spec.arch == "gpt_oss":  # the router as ExLlamaV3 stores an unquantized linear (fp16), HF's bf16 bias
            w.plain(f"{block}.router.weight", (spec.num_experts, h), torch.float16, scale=0.5)
            w.plain(f"{block}.router.bias", (spec.num_experts,), scale=0.5)
        else:
            w.plain(f"{block}.gate.weight", (spec.num_experts, h), torch.float16, scale=0.5)
        width = spec.intermediate if spec.arch in INTERMEDIATE_WIDE_EXPERTS else spec.moe_intermediate
        for e in range(spec.num_experts):
            w.mlp(f"{block}.experts.{e}", h, width, names, bias=spec.arch == "gpt_oss")
        if spec.arch in GATED_SHARED_EXPERT:
            w.mlp(f"{block}.shared_expert", h, spec.shared_intermediate)
            w.plain(f"{block}.shared_expert_gate.weight", (1, h), torch.float16, scale=0.5)
        elif spec.arch == "deepseek_v3":
            w.mlp(f"{block}.shared_experts", h, spec.moe_intermediate * spec.num_shared_experts)
        if spec.arch in ("deepseek_v3", "minimax_m2"):
            w.plain(f"{block}.gate.e_score_correction_bias", (spec.num_experts,), torch.float32, scale=0.1)
        elif spec.arch == "lfm2_moe":
            w.plain(f"{block}.expert_bias", (spec.num_experts,), torch.float32, scale=0.1)
    w.plain("model.norm.weight", (h,), scale=1.0)
    if spec.head_bits == 16:
        w.plain("lm_head.weight", (spec.vocab, h), torch.float16)
    else:
        w.linear("lm_head", h, spec.vocab, bits=spec.head_bits)
    return w.modules


def _lfm2_layer(i: int) -> str:
    return "full_attention" if i % 2 else "conv"


def _short_conv(w: _Writer, prefix: str, spec: ModelSpec) -> None:
    """An LFM2 short-convolution layer: its in (B, C, x) and out projections quantized, the 3-tap filter as it is."""
    w.linear(f"{prefix}.in_proj", spec.hidden, 3 * spec.hidden)
    w.plain(f"{prefix}.conv.weight", (spec.hidden, 1, 3))
    w.linear(f"{prefix}.out_proj", spec.hidden, spec.hidden)


def _qwen3_next_layer(spec: ModelSpec, i: int) -> str:
    return "full_attention" if (i + 1) % spec.full_attention_interval == 0 else "linear_attention"


def _linear_attention(w: _Writer, prefix: str, spec: ModelSpec) -> None:
    """A Qwen3-Next gated delta-net layer as ExLlamaV3 stores it: the fused q/k/v/z and the output projections
    quantized, the small b/a projection, the convolution and the per-head constants as they are."""
    key_heads, value_heads, head_dim = spec.linear_heads
    keys, values = key_heads * head_dim, value_heads * head_dim
    w.linear(f"{prefix}.in_proj_qkvz", spec.hidden, 2 * keys + 2 * values)
    w.plain(f"{prefix}.in_proj_ba.weight", (2 * value_heads, spec.hidden), torch.float16)
    w.plain(f"{prefix}.conv1d.weight", (2 * keys + values, 1, 4))
    w.plain(f"{prefix}.A_log", (value_heads,), torch.float32)
    w.plain(f"{prefix}.dt_bias", (value_heads,))
    w.plain(f"{prefix}.norm.weight", (head_dim,), scale=1.0)
    w.linear(f"{prefix}.out_proj", values, spec.hidden)


def _shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_shards(path: Path, shards: list[dict[str, torch.Tensor]], index: bool) -> None:
    names = _shard_names(len(shards))
    weight_map = {}
    for name, tensors in zip(names, shards):
        save_safetensors(path / name, tensors)
        weight_map.update({t: name for t in tensors})
    if index:
        total = sum(_tensor_nbytes(v) for shard in shards for v in shard.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _tensor_nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v[2])


def write_checkpoint(path: str | Path, spec: ModelSpec | None = None, **fields) -> Path:
    """Write a complete synthetic EXL3 checkpoint folder at `path` and return it."""
    spec = replace(spec or ModelSpec(), **fields)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config(spec), indent=2))
    modules = _build(spec)
    n = max(1, min(spec.shards, len(modules)))
    per = -(-len(modules) // n)
    shards = [{k: v for m in modules[i * per:(i + 1) * per] for k, v in m.items()} for i in range(n)]
    _write_shards(path, shards, spec.index if spec.index is not None else n > 1)
    return path


def moe_layer_head_dim(hidden: int) -> int:
    """The attention head size of ``write_moe_layer``'s checkpoints: 128, or 64 where hidden needs it."""
    return 128 if hidden % 128 == 0 else 64


def write_moe_layer(path: str | Path, experts: int, top_k: int, hidden: int, intermediate: int, bits: float,
                    codebook: str, seed: int = 0) -> Path:
    """A one-layer Qwen3-MoE checkpoint of that MoE shape, which ExLlamaV3 can load too: what ``bench --moe`` and
    the A/B tool measure."""
    head_dim = moe_layer_head_dim(hidden)
    heads = max(1, hidden // head_dim)
    return write_checkpoint(path, arch="qwen3_moe", hidden=hidden, moe_intermediate=intermediate, num_experts=experts,
                            top_k=top_k, num_layers=1, bits=bits, codebook=codebook, vocab=1024, num_heads=heads,
                            num_kv_heads=heads // 4 if heads % 4 == 0 else 1, head_dim=head_dim, seed=seed)


def edit_checkpoint(
    path: str | Path, *, drop=(), replace: Mapping[str, torch.Tensor | tuple] | None = None,
    add: Mapping[str, torch.Tensor | tuple] | None = None,
) -> None:
    """Rewrite a checkpoint's shards (and index) with tensors dropped, replaced or added (to the last shard).
    Values may be raw (dtype, shape, bytes) triples, so any malformed tensor can be produced."""
    from safetensors import safe_open

    path = Path(path)
    replace, add, drop = dict(replace or {}), dict(add or {}), set(drop)
    index_path = path / "model.safetensors.index.json"
    names = sorted(p.name for p in path.glob("model*.safetensors"))
    shards = []
    for name in names:
        with safe_open(path / name, framework="pt") as f:
            shards.append({k: replace.pop(k, None) if k in replace else f.get_tensor(k)
                           for k in f.keys() if k not in drop})
    if replace:
        raise KeyError(f"not in the checkpoint: {sorted(replace)}")
    shards[-1].update(add)
    for name, tensors in zip(names, shards):
        save_safetensors(path / name, tensors)
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {t: name for name, tensors in zip(names, shards) for t in tensors}
        index_path.write_text(json.dumps(index, indent=2))
