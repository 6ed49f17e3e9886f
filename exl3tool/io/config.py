"""config.json -> ModelConfig: the true dims, the MoE routing and the EXL3 quantization_config.

A config that cannot be read, or that is not EXL3, raises UnreadableInputError; odd values inside a readable
config (the wrong type, or a size no model has) become problems and read as absent, so the rest of the
checkpoint can still be inspected.
"""

from __future__ import annotations

import math
from pathlib import Path

from exl3tool.errors import Problem, ProblemKind, UnreadableInputError
from exl3tool.format import ACTIVATION_KINDS, ModelConfig, ModelDims, QuantConfig, Routing
from exl3tool.io.reading import brief, loads_strict, read_bounded

CONFIG = "config.json"
QUANT_CONFIG = "quantization_config.json"
KNOWN_QUANT_KEYS = frozenset({
    "quant_method", "version", "bits", "head_bits", "calibration", "out_scales", "codebook", "mtp_bits",
    "vision_bits", "original_quantization_config", "tensor_storage",
})
# Keys that change how tiles are laid out: exl3tool knows only the standard layout and refuses any other.
LAYOUT_KEYS = ("tile_order",)
GLOBAL_BLOCKERS = frozenset({"tile-order"})  # problem checks that forbid decoding any linear of the checkpoint

# model_type -> routing method, and whether renormalising the top-k weights is the default (Qwen3-Next and Qwen3.5 /
# 3.6: qwen2_moe's block, Qwen3-VL: qwen3_moe's, which ExLlamaV3 loads only renormalised; multimodal configs give the
# text model's type, "..._text"; Mistral-Small-4's text model "mistral4": DeepSeek-V3's names, a softmax router)
_SOFTMAX_TOPK = {"qwen2_moe": False, "qwen3_moe": False, "qwen3_next": True, "qwen3_5_moe": True,
                 "qwen3_5_moe_text": True, "qwen3_vl_moe": True, "qwen3_vl_moe_text": True, "olmoe": False,
                 "mixtral": True, "minimax": True, "gpt_oss": True, "mistral4": True}
_ALWAYS_RENORMALISED = frozenset({"mixtral", "gpt_oss"})  # their HF routers have no norm_topk_prob to turn it off
# (DeepSeek-V3's router: sigmoid scores, a correction bias for the choice, group-limited where n_group > 1; the rest
# as DeepSeek-V3 with one group, MiniMax-M2 also with Mixtral's names and no scaling; as ExLlamaV3 1.6.5 runs them:
# its "dots" router, Ling's (bailing_hybrid) "ds3")
_SIGMOID_NOAUX = {"deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm4v_moe_text", "solar_open", "dots1", "kimi_k2",
                  "minimax_m2", "lfm2_moe", "glm_moe_dsa", "mimo_v2", "kimi_linear", "bailing_hybrid", "hy_v3", "afmoe",
                  "laguna"}
# Their config.json keys where they are not DeepSeek-V3's: (key, default) of the scale (ExLlamaV3's defaults), the
# renormalisation's key
_SCALE_KEYS = {"hy_v3": ("router_scaling_factor", 2.826), "afmoe": ("route_scale", 1.0),
               "laguna": ("moe_routed_scaling_factor", 1.0), "solar_open": ("routed_scaling_factor", 2.0)}
_NORMALIZE_KEYS = {"hy_v3": "route_norm", "afmoe": "route_norm", "kimi_linear": "moe_renormalize"}
# Model types whose shared expert (`mlp.shared_expert`) is scaled by sigmoid(x @ shared_expert_gate.T)
GATED_SHARED_EXPERT_TYPES = frozenset({"qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"})
# The router's module name in a MoE block (`<block>.<name>.weight`) where it is not "gate", and the model types
# whose router adds a bias to its logits (`<block>.<name>.bias`)
ROUTER_NAMES = {"gpt_oss": "router", "hy_v3": "router.gate", "afmoe": "router.gate"}
ROUTER_BIAS_TYPES = frozenset({"gpt_oss"})
# ...and where the model type's routing is not known, the names others give it (HY-V3's and AFMoE's router.gate,
# Gemma 4's router.proj): the first one present is shown; none present is no problem, as the name is not known
ROUTER_NAME_GUESSES = ("gate", "router", "router.gate", "router.proj")
# The correction bias's name in a MoE block where it is not DeepSeek-V3's `gate.e_score_correction_bias`
CORRECTION_BIAS_NAMES = {"lfm2_moe": "expert_bias", "hy_v3": "expert_bias", "afmoe": "expert_bias",
                         "bailing_hybrid": "gate.expert_bias", "laguna": "experts.e_score_correction_bias"}
# Model types whose gated MLPs compute gpt-oss's clamped SwiGLU whatever hidden_act says (HF's GptOssExperts)
SWIGLU_OAI_TYPES = frozenset({"gpt_oss"})
# Model types whose full-attention q_proj also gives the attention output's gate (twice heads * head_dim rows)
GATED_QUERY_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
# Architectures without experts: a checkpoint of one of these that stores experts contradicts its config.
DENSE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite",
                               "phi3", "olmo", "olmo2", "cohere"})
# Far beyond any real model (the largest have ~130 layers, 512 experts, dims of ~1e5, vocabularies of ~1e6):
# larger values are damage, and believing them would make the checks list a billion missing layers.
MAX_LAYERS, MAX_EXPERTS, MAX_DIM = 10_000, 65_536, 1 << 24


def read_json(path: Path, display_name: str,
              missing: str = "missing: an EXL3 checkpoint folder has a config.json") -> dict:
    """A JSON object from the regular file `path`, or UnreadableInputError (one line naming `display_name`) for
    any way it is not: missing, not a regular file, too large, not strict JSON, nested too deeply."""
    try:
        data = loads_strict(read_bounded(path, display_name), display_name)
    except UnreadableInputError as e:
        if e.message == "missing":
            raise UnreadableInputError(missing, path=display_name) from None
        raise
    if not isinstance(data, dict):
        raise UnreadableInputError("malformed: not a JSON object", path=display_name)
    return data


class _Reader:
    """Typed look-ups into a config dict that turn bad values into problems instead of exceptions."""

    def __init__(self, data: dict, problems: list[Problem], source: str = CONFIG):
        self.data, self.problems, self.source = data, problems, source

    def _bad(self, key: str, value: object, want: str) -> None:
        self.problems.append(Problem("config-value", f"{key} = {brief(value)} is not {want}", self.source))

    def int(self, *keys: str, minimum: int = 1, maximum: int = MAX_DIM) -> int | None:
        for key in keys:
            value = self.data.get(key)
            if value is None:
                continue
            if type(value) is not int or not minimum <= value <= maximum:
                self._bad(key, value, f"an integer from {minimum} to {maximum}")
                return None
            return value
        return None

    def float(self, key: str, minimum: float = -math.inf, maximum: float = math.inf) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if type(value) not in (int, float) or not minimum <= value <= maximum:
            self._bad(key, value, "a number" if math.isinf(minimum) else f"a number from {minimum:g} to {maximum:g}")
            return None
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if type(value) is not bool:
            self._bad(key, value, "true or false")
            return default
        return value

    def str(self, key: str, numbers: bool = False) -> str | None:
        """A string value (with `numbers`, a number is accepted and written as text, as for `version`)."""
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        if numbers and type(value) in (int, float):
            return str(value)
        self._bad(key, value, "a string")
        return None


def _text_config(data: dict) -> dict:
    """Multimodal configs keep the language model's dims in `text_config`."""
    text = data.get("text_config")
    return text if isinstance(text, dict) and "hidden_size" not in data else data


def _feed_forward(r: _Reader, model_type: str | None, intermediate: int | None) -> tuple[str, int | None]:
    """(what config.json calls it, the width) of the dense MLPs. LFM2's (HF's Lfm2MLP) derives it from
    intermediate_size (block_ff_dim in LiquidAI's configs): two thirds of it where block_auto_adjust_ff_dim (the
    default), then times block_ffn_dim_multiplier (default 1.0) rounded up to block_multiple_of (default 256) where
    that multiplier is set, as HF rounds only then. LFM2-MoE's dense layers and every other type: intermediate_size."""
    key = "block_ff_dim" if model_type == "lfm2" and r.data.get("block_ff_dim") is not None else "intermediate_size"
    width = r.int(key) if key == "block_ff_dim" else intermediate  # each key read once: a bad value, one problem
    if model_type != "lfm2" or width is None or not r.bool("block_auto_adjust_ff_dim", True):
        return key, width
    width = int(2 * width / 3)
    multiplier = r.float("block_ffn_dim_multiplier", 0.0, 1e6) if "block_ffn_dim_multiplier" in r.data else 1.0
    if multiplier is None:
        return f"2/3 of {key} (block_auto_adjust_ff_dim)", width
    multiple = r.int("block_multiple_of") or 256
    width = multiple * math.ceil(int(multiplier * width) / multiple)
    return f"2/3 of {key} times block_ffn_dim_multiplier, rounded up to block_multiple_of", width


def _dims(r: _Reader, model_type: str | None) -> ModelDims:
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    head_dim = r.int("head_dim")
    if head_dim is None and hidden and heads and hidden % heads == 0:
        head_dim = hidden // heads
    intermediate = r.int("intermediate_size")
    dense_key, dense_width = _feed_forward(r, model_type, intermediate)
    return ModelDims(
        hidden=hidden,
        intermediate=intermediate,
        dense_intermediate_key=dense_key,
        dense_intermediate=dense_width,
        moe_intermediate=r.int("moe_intermediate_size"),
        shared_expert_intermediate=r.int("shared_expert_intermediate_size"),
        num_heads=heads,
        num_kv_heads=r.int("num_key_value_heads") or heads,
        head_dim=head_dim,
        vocab=r.int("vocab_size"),
        num_layers=r.int("num_hidden_layers", maximum=MAX_LAYERS),
        extra_layers=r.int("num_nextn_predict_layers", minimum=0, maximum=MAX_LAYERS) or 0,
        num_experts=r.int("num_experts", "num_local_experts", "n_routed_experts", maximum=MAX_EXPERTS),
        num_shared_experts=r.int("n_shared_experts", "num_shared_experts", maximum=MAX_EXPERTS),
        linear_key_heads=r.int("linear_num_key_heads"),
        linear_value_heads=r.int("linear_num_value_heads"),
        linear_key_head_dim=r.int("linear_key_head_dim"),
        linear_value_head_dim=r.int("linear_value_head_dim"),
    )


def _routing(r: _Reader, model_type: str | None, num_experts: int | None) -> Routing | None:
    if not num_experts:
        return None
    top_k = r.int("num_experts_per_tok", "num_experts_per_token", "moe_topk", maximum=MAX_EXPERTS) or 1
    if model_type in _SOFTMAX_TOPK:
        normalize = model_type in _ALWAYS_RENORMALISED or r.bool("norm_topk_prob", _SOFTMAX_TOPK[model_type])
        return Routing("softmax_topk", num_experts, top_k, normalize)
    if model_type in _SIGMOID_NOAUX:
        scale_key, scale = _SCALE_KEYS.get(model_type, ("routed_scaling_factor", 1.0))
        return Routing(
            "sigmoid_noaux_tc", num_experts, top_k, r.bool(_NORMALIZE_KEYS.get(model_type, "norm_topk_prob"), True),
            scale=r.float(scale_key, 0.0, 1e6) or scale,
            n_group=r.int("n_group", "num_expert_group", maximum=MAX_EXPERTS) or 1,
            topk_group=r.int("topk_group", maximum=MAX_EXPERTS) or 1,
            choice_bias=r.bool("use_expert_bias", True),
        )
    return Routing("unknown", num_experts, top_k, r.bool("norm_topk_prob", False))


def _activation(r: _Reader, model_type: str | None) -> tuple[str, float | None]:
    """The MLPs' activation (``format.ACTIVATION_KINDS``) and its clamp: gpt-oss's clamped SwiGLU for its model
    type (swiglu_limit, 7.0 by default as in HF); else Gemma's `hidden_activation` where set (HF reads it first),
    else `hidden_act`, else SiLU, which every other common architecture uses."""
    if model_type in SWIGLU_OAI_TYPES:
        limit = r.float("swiglu_limit", 0.0, 1e6)
        return "swiglu_oai", 7.0 if limit is None else limit
    name = r.str("hidden_activation") or r.str("hidden_act") or "silu"
    return ACTIVATION_KINDS.get(name, name), None


def routing_conflict(routing: Routing) -> str | None:
    """Why `routing` cannot pick its experts (config values that contradict each other), or None."""
    e, k, groups, keep = routing.num_experts, routing.top_k, routing.n_group, routing.topk_group
    if k > e:
        return f"num_experts_per_tok = {k} is more than the {e} experts"
    if routing.method == "sigmoid_noaux_tc" and groups > 1:
        if e % groups:
            return f"n_group = {groups} does not divide the {e} experts"
        if keep > groups:
            return f"topk_group = {keep} is more than n_group = {groups}"
        if k > keep * (e // groups):
            return f"num_experts_per_tok = {k} is more than the {keep * (e // groups)} experts topk_group = {keep} " \
                   "groups hold"
    return None


def _quant(qc: dict, problems: list[Problem], source: str) -> QuantConfig:
    for key in LAYOUT_KEYS:
        if qc.get(key) is not None:
            problems.append(Problem(
                "tile-order", f"quantization_config.{key} = {brief(qc[key])}: exl3tool knows only the standard EXL3 "
                "tile order and refuses to decode another", source, kind=ProblemKind.UNSUPPORTED))
    reader = _Reader(qc, problems, source)
    return QuantConfig(
        version=reader.str("version", numbers=True),
        bits=reader.float("bits", 1.0, 16.0),  # K runs 1..8; 16 is how an unquantized head is written
        head_bits=reader.float("head_bits", 1.0, 16.0),
        codebook=reader.str("codebook"),
        extra_keys=tuple(sorted(k for k in qc if k not in KNOWN_QUANT_KEYS and k not in LAYOUT_KEYS)),
    )


def read_config(root: Path) -> tuple[ModelConfig, list[Problem]]:
    """Parse root/config.json (and check the optional root/quantization_config.json for layout keys)."""
    data = read_json(root / CONFIG, str(root / CONFIG))
    qc = data.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "exl3":
        found = f"quant_method is {brief(method)}" if isinstance(qc, dict) else "there is no quantization_config"
        raise UnreadableInputError(f"not an EXL3 checkpoint: {found}", path=root / CONFIG)
    problems: list[Problem] = []
    top = _Reader(data, problems)
    r = _Reader(_text_config(data), problems)
    architectures = data.get("architectures")
    architecture = None
    if isinstance(architectures, list) and architectures:
        architecture = _Reader({"architectures[0]": architectures[0]}, problems).str("architectures[0]")
    elif architectures is not None:
        top._bad("architectures", architectures, "a list of names")
    model_type = r.str("model_type") if r.data.get("model_type") is not None else top.str("model_type")
    dims = _dims(r, model_type)
    quant = _quant(qc, problems, CONFIG)
    side = root / QUANT_CONFIG
    if side.exists():
        try:
            side_qc = read_json(side, QUANT_CONFIG)
            _quant(side_qc, problems, QUANT_CONFIG)
        except UnreadableInputError as e:
            problems.append(Problem("config-file", e.message, QUANT_CONFIG, kind=ProblemKind.UNREADABLE))
    activation, activation_limit = _activation(r, model_type)
    config = ModelConfig(
        architecture=architecture,
        model_type=model_type,
        dims=dims,
        quant=quant,
        routing=_routing(r, model_type, dims.num_experts),
        tie_word_embeddings=top.bool("tie_word_embeddings", False),
        activation=activation,
        activation_limit=activation_limit,
    )
    return config, problems
