"""Checked linears + unquantized tensors + config -> CheckpointModel (layers, attention, MLP/MoE blocks, head).

Names follow the HF conventions of the common architectures: `<stack>.layers.N.self_attn.*`, dense
`mlp.{gate,up,down}_proj`, Qwen3-MoE / DeepSeek / GLM `mlp.experts.E.{gate,up,down}_proj`, Mixtral
`block_sparse_moe.experts.E.{w1,w3,w2}`, LFM2 `feed_forward.experts.E.{w1,w3,w2}` (and dense `feed_forward.w1`),
shared experts `mlp.shared_expert(s).*` (HY-V3 `mlp.shared_mlp`, Kimi-Linear `block_sparse_moe.shared_experts`) with
an optional `mlp.shared_expert_gate.weight`, router `<block>.gate.weight` (gpt-oss `<block>.router.weight` and
`.bias`, HY-V3 and AFMoE `<block>.router.gate.weight`). True dims come from config.json; a padded size
that disagrees with them is a problem. Completeness (layers, experts, routers) is checked too.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

from exl3tool.errors import Problem
from exl3tool.format import (
    Attention, CheckpointModel, FileInfo, GatedMLP, Layer, LinearInfo, ModelConfig, MoEBlock, TensorInfo, padded,
)
from exl3tool.io.config import (
    CONFIG, CORRECTION_BIAS_NAMES, DENSE_MODEL_TYPES, GATED_QUERY_TYPES, GATED_SHARED_EXPERT_TYPES, MAX_EXPERTS,
    ROUTER_BIAS_TYPES, ROUTER_NAME_GUESSES, ROUTER_NAMES, routing_conflict,
)
from exl3tool.io.safetensors import WIDE_FLOAT_DTYPES

# The router (and its bias), the shared expert's gate and the correction bias: float types the reference and the
# kernels load
ROUTER_DTYPES = WIDE_FLOAT_DTYPES
_LAYER = re.compile(r"^(?P<stack>(?:.+\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
_ATTENTION = re.compile(r"^(?P<module>self_attn|attn|attention|linear_attn|conv)\.(?P<proj>[^.]+)$")
_EXPERT = re.compile(r"^(?P<block>mlp|block_sparse_moe|feed_forward)\.experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")
_SHARED = re.compile(r"^(?P<block>mlp|block_sparse_moe)\.(?P<shared>shared_experts?|shared_mlp)\.(?P<proj>[^.]+)$")
_DENSE = re.compile(r"^(?P<block>mlp|feed_forward)\.(?P<proj>[^.]+)$")
ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
HEAD = "lm_head"
_ATTENTION_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 3,
                    "in_proj_qkvz": 0, "in_proj_qkv": 0, "in_proj_z": 1, "in_proj": 0, "out_proj": 3}
SHORT_CONV_TYPES = frozenset({"lfm2", "lfm2_moe"})  # `conv.in_proj` / `conv.out_proj` layers between attention
# Architectures whose q/k/v/o_proj sizes follow heads * head_dim; others (e.g. MLA) are not checked.
STANDARD_ATTENTION = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "glm4v_moe_text",
    "solar_open", "gemma", "gemma2", "gemma3_text", "granite", "granitemoe", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "minimax_m2", "dots1", "gpt_oss", "lfm2", "lfm2_moe", *GATED_QUERY_TYPES,
})

Dim = tuple[str, int | None]  # (config key that gives it, value)


def gaps(present: set[int], first: int, last: int) -> list[tuple[int, int]]:
    """The inclusive ranges of first..last missing from `present`: as many as there are gaps, however large
    the span (a problem per range, not per index, keeps a claimed billion layers cheap)."""
    out, cursor = [], first
    for i in sorted(i for i in present if first <= i <= last):
        if i > cursor:
            out.append((cursor, i - 1))
        cursor = i + 1
    if cursor <= last:
        out.append((cursor, last))
    return out


def _span(a: int, b: int, what: str, total: int) -> str:
    return f"{what} {a} of {total} is" if a == b else f"{what}s {a}..{b} of {total} are"


@dataclass
class _LayerParts:
    attention: dict[str, dict[str, LinearInfo]] = field(default_factory=lambda: defaultdict(dict))
    experts: dict[str, dict[int, dict[str, LinearInfo]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(dict)))
    shared: dict[str, tuple[str, dict[str, LinearInfo]]] = field(default_factory=dict)
    dense: dict[str, dict[str, LinearInfo]] = field(default_factory=lambda: defaultdict(dict))
    other: list[LinearInfo] = field(default_factory=list)


class _Builder:
    def __init__(self, config: ModelConfig, unquantized: list[TensorInfo], complete: bool):
        self.config = config
        self.dims = config.dims
        self.unquantized = {t.name: t for t in unquantized}
        self.complete = complete  # False when a file could not be read: skip "missing" checks, they would be noise
        self.problems: list[Problem] = []

    # --- true dims -------------------------------------------------------------------------------------

    def true_dims(self, info: LinearInfo, dims: tuple[Dim, Dim] | None) -> LinearInfo:
        if dims is None:
            return info
        sizes = {}
        for side, padded_size, (key, value) in (("input", info.in_padded, dims[0]), ("output", info.out_padded, dims[1])):
            if value is None:
                continue
            if padded(value) != padded_size:
                self.problems.append(Problem(
                    "config-dims", f"padded {side} size {padded_size} disagrees with config.json: {key} = {value} "
                    f"pads to {padded(value)}", info.file, info.tensor_name("trellis"), module=info.name))
            else:
                sizes[side] = value
        return replace(
            info, in_features=sizes.get("input", info.in_padded), out_features=sizes.get("output", info.out_padded),
            dims_from_config=len(sizes) == 2,
        )

    def mlp_dims(self, role: str, key: str, intermediate: int | None) -> tuple[Dim, Dim]:
        hidden, mid = ("hidden_size", self.dims.hidden), (key, intermediate)
        return (mid, hidden) if role == "down" else (hidden, mid)

    def attention_dims(self, module: str, proj: str) -> tuple[Dim, Dim] | None:
        if module == "linear_attn":
            return self.linear_attention_dims(proj)
        d, model_type = self.dims, self.config.model_type
        if module == "conv":  # LFM2's short convolution: in_proj gives its B, C and x gates
            hidden = ("hidden_size", d.hidden)
            sized = model_type in SHORT_CONV_TYPES
            in3 = ("3 * hidden_size", 3 * d.hidden if d.hidden else None)
            return {"in_proj": (hidden, in3), "out_proj": (hidden, hidden)}.get(proj) if sized else None
        if model_type not in STANDARD_ATTENTION or d.head_dim is None:
            return None
        hidden = ("hidden_size", d.hidden)
        q = ("num_attention_heads * head_dim", d.num_heads * d.head_dim if d.num_heads else None)
        kv = ("num_key_value_heads * head_dim", d.num_kv_heads * d.head_dim if d.num_kv_heads else None)
        q_rows = q
        if model_type in GATED_QUERY_TYPES:  # the output gate's rows follow the queries'
            q_rows = ("2 * num_attention_heads * head_dim", 2 * q[1] if q[1] else None)
        return {"q_proj": (hidden, q_rows), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                "o_proj": (q, hidden), "out_proj": (q, hidden)}.get(proj)  # out_proj: LFM2's o_proj

    def linear_attention_dims(self, proj: str) -> tuple[Dim, Dim] | None:
        """A gated delta-net's projections: q and k of the key heads, v and the output gate z of the value heads,
        fused as ExLlamaV3 stores them (Qwen3-Next: in_proj_qkvz; Qwen3.5: in_proj_qkv and in_proj_z)."""
        d = self.dims
        keys = d.linear_key_heads * d.linear_key_head_dim if d.linear_key_heads and d.linear_key_head_dim else None
        values = (d.linear_value_heads * d.linear_value_head_dim
                  if d.linear_value_heads and d.linear_value_head_dim else None)
        hidden = ("hidden_size", d.hidden)
        k_key, v_key = "linear_num_key_heads * linear_key_head_dim", "linear_num_value_heads * linear_value_head_dim"
        v = (v_key, values)
        both = keys is not None and values is not None
        qkv = (f"2 * {k_key} + {v_key}", 2 * keys + values if both else None)
        qkvz = (f"2 * {k_key} + 2 * {v_key}", 2 * keys + 2 * values if both else None)
        return {"in_proj_qkvz": (hidden, qkvz), "in_proj_qkv": (hidden, qkv), "in_proj_z": (hidden, v),
                "out_proj": (v, hidden)}.get(proj)

    def expert_intermediate(self) -> tuple[str, int | None]:
        if self.dims.moe_intermediate is not None:
            return "moe_intermediate_size", self.dims.moe_intermediate
        return "intermediate_size", self.dims.intermediate

    def shared_intermediate(self, kind: str) -> tuple[str, int | None]:
        d = self.dims
        if kind == "shared_expert":  # Qwen2-MoE
            return "shared_expert_intermediate_size", d.shared_expert_intermediate
        if d.moe_intermediate is not None and d.num_shared_experts is not None:  # DeepSeek / GLM
            return "moe_intermediate_size * n_shared_experts", d.moe_intermediate * d.num_shared_experts
        return "shared_expert_intermediate_size", d.shared_expert_intermediate

    # --- blocks ----------------------------------------------------------------------------------------

    def gated(self, name: str, parts: dict[str, LinearInfo], what: str) -> GatedMLP | None:
        missing = [r for r in ("gate", "up", "down") if r not in parts]
        if missing:
            some = next(iter(parts.values()))
            self.problems.append(Problem(
                "incomplete-mlp", f"{what} lacks its {', '.join(missing)} projection(s)", some.file,
                f"{name}.{missing[0]}", module=name))
            return None
        return GatedMLP(name, parts["gate"], parts["up"], parts["down"], self.config.activation,
                        self.config.activation_limit)

    def moe(self, name: str, experts: dict[int, dict[str, LinearInfo]], shared: GatedMLP | None,
            shared_kind: str | None) -> MoEBlock | None:
        routing = self.config.routing
        count = routing.num_experts if routing else max(experts) + 1
        first = experts[min(experts)]
        where = next(iter(first.values())).file
        usable = True

        def config_problem(check: str, message: str) -> None:
            nonlocal usable
            usable = False
            self.problems.append(Problem(check, message, CONFIG, name, module=name))

        model_type = self.config.model_type
        if model_type in DENSE_MODEL_TYPES:
            config_problem("model-type", f"model_type {model_type!r} is a dense architecture, but this block "
                           f"stores {len(experts)} expert(s)")
        if routing is None:
            config_problem("expert-count", f"config.json declares no experts (num_experts, num_local_experts or "
                           f"n_routed_experts), but this block stores {len(experts)}")
            count = min(count, MAX_EXPERTS)  # expert numbers come from tensor names: never loop to a hostile one
        elif conflict := routing_conflict(routing):
            config_problem("config-value", conflict)
        if self.complete:
            for a, b in gaps(set(experts), 0, count - 1):
                usable = False
                self.problems.append(Problem(
                    "missing-expert", f"{_span(a, b, 'expert', count)} missing (config: {count} experts)", where,
                    f"{name}.experts.{a}", module=name))
        elif len(experts) < count:
            usable = False
        for e in sorted(experts):
            if e >= count:
                usable = False
                self.problems.append(Problem(
                    "expert-count", f"expert {e} is beyond the {count} experts config.json declares", where,
                    f"{name}.experts.{e}", module=name))
        built = {}
        for e, parts in sorted(experts.items()):
            mlp = self.gated(f"{name}.experts.{e}", parts, f"expert {e}")
            if mlp is None:
                usable = False
            else:
                built[e] = mlp
        if built:
            ref_e, ref = next(iter(built.items()))
            for e, mlp in built.items():
                for lin, ref_lin in zip(mlp.linears, ref.linears):
                    if (lin.in_padded, lin.out_padded) != (ref_lin.in_padded, ref_lin.out_padded):
                        usable = False
                        self.problems.append(Problem(
                            "expert-shape", f"padded shape {lin.in_padded}x{lin.out_padded} differs from expert "
                            f"{ref_e}'s {ref_lin.in_padded}x{ref_lin.out_padded}", lin.file, lin.name, module=name))
        known_routing = routing is None or routing.method != "unknown"
        router_name = ROUTER_NAMES.get(model_type, "gate")
        if not known_routing:
            router_name = next((n for n in ROUTER_NAME_GUESSES if f"{name}.{n}.weight" in self.unquantized), "gate")
        router = self.unquantized.get(f"{name}.{router_name}.weight")
        router_bias = self.unquantized.get(f"{name}.{router_name}.bias") if model_type in ROUTER_BIAS_TYPES else None
        gate = self.unquantized.get(f"{name}.shared_expert_gate.weight") if shared_kind else None
        bias_name = CORRECTION_BIAS_NAMES.get(model_type, "gate.e_score_correction_bias")
        bias = self.unquantized.get(f"{name}.{bias_name}")
        missing = []  # the router, and what this routing or shared expert computes with beside it
        if router is None and known_routing:
            missing.append((f"{router_name}.weight", "a MoE block needs its fp16 router weight"))
        elif router is None:
            usable = False  # a block the reference refuses anyway (routing not known), its router's name unknown
        if model_type in ROUTER_BIAS_TYPES and router_bias is None:
            missing.append((f"{router_name}.bias", f"a {model_type} router adds a bias to its logits"))
        if routing is not None and routing.method == "sigmoid_noaux_tc" and routing.choice_bias and bias is None:
            missing.append((bias_name, "sigmoid routing chooses by score + correction bias"))
        if shared is not None and model_type in GATED_SHARED_EXPERT_TYPES and gate is None:
            missing.append(("shared_expert_gate.weight", f"a {model_type} shared expert is scaled by its gate"))
        for tensor, why in missing:
            usable = False
            if self.complete:
                self.problems.append(Problem("missing-router", f"missing: {why}", where, f"{name}.{tensor}",
                                             module=name))
        hidden = self.dims.hidden or (router.shape[-1] if router is not None and router.shape else None)
        for what, tensor, shape, dims in (("router", router, (count, hidden), "[experts, hidden_size]"),
                                          ("router bias", router_bias, (count,), "[experts]"),
                                          ("shared expert gate", gate, (1, hidden), "[1, hidden_size]"),
                                          ("correction bias", bias, (count,), "[experts]")):
            if tensor is not None and (tensor.shape != shape or tensor.dtype not in ROUTER_DTYPES):
                usable = False
                self.problems.append(Problem(
                    "router-shape", f"{what} {tensor.dtype} {list(tensor.shape)} is not a float {dims} = "
                    f"{list(shape)}", tensor.file, tensor.name, module=name))
        if not usable:
            return None
        return MoEBlock(name, router, tuple(built[e] for e in range(count)), routing, shared, gate, bias, router_bias)

    def layer(self, stack: str, index: int, parts: _LayerParts) -> Layer:
        prefix = f"{stack}.{index}"
        attention = None
        other = list(parts.other)
        for module, projs in parts.attention.items():
            ordered = sorted(projs.items(), key=lambda kv: (_ATTENTION_ORDER.get(kv[0], 4), kv[0]))
            fixed = {p: self.true_dims(lin, self.attention_dims(module, p)) for p, lin in ordered}
            if attention is None:
                attention = Attention(f"{prefix}.{module}", fixed)
            else:
                other.extend(fixed.values())
        mlp = None
        for block, roles in parts.dense.items():
            key_dim = (self.dims.dense_intermediate_key, self.dims.dense_intermediate)
            fixed = {r: self.true_dims(lin, self.mlp_dims(r, *key_dim)) for r, lin in roles.items()}
            built = self.gated(f"{prefix}.{block}", fixed, "dense MLP")
            mlp = mlp or built
            if built is None:
                other.extend(fixed.values())
        for block, experts in parts.experts.items():
            name = f"{prefix}.{block}"
            key, inter = self.expert_intermediate()
            fixed = {e: {r: self.true_dims(lin, self.mlp_dims(r, key, inter)) for r, lin in roles.items()}
                     for e, roles in experts.items()}
            shared = None
            shared_kind, shared_roles = parts.shared.pop(block, (None, {}))
            if shared_kind:
                shared_fixed = {r: self.true_dims(lin, self.mlp_dims(r, *self.shared_intermediate(shared_kind)))
                                for r, lin in shared_roles.items()}
                shared = self.gated(f"{name}.{shared_kind}", shared_fixed, "shared experts")
                if shared is None:
                    other.extend(shared_fixed.values())
            built = self.moe(name, fixed, shared, shared_kind)
            if built is None:
                other.extend(lin for roles in fixed.values() for lin in roles.values())
                if shared is not None:
                    other.extend(shared.linears)
            mlp = mlp or built
        for block, (kind, roles) in parts.shared.items():  # shared experts without routed ones: a plain MLP
            other.extend(roles.values())
        return Layer(index, attention, mlp, tuple(other))

    def check_layer_count(self, stack: str, indices: set[int]) -> None:
        n = self.dims.num_layers
        if n is None:
            return
        limit = n + self.dims.extra_layers
        for i in sorted(indices):
            if i >= limit:
                self.problems.append(Problem(
                    "layer-count", f"layer {i} is beyond num_hidden_layers = {n}", CONFIG, f"{stack}.{i}"))
        if self.complete:
            for a, b in gaps(indices, 0, n - 1):
                self.problems.append(Problem(
                    "missing-layer", f"{_span(a, b, 'layer', n)} missing: no EXL3 linears", CONFIG, f"{stack}.{a}"))


def _main_stack(linears: dict[str, LinearInfo]) -> str | None:
    counts: dict[str, int] = defaultdict(int)
    for name in linears:
        m = _LAYER.match(name)
        if m:
            counts[m.group("stack")] += 1
    return max(counts, key=counts.get) if counts else None


def build_model(
    config: ModelConfig, files: list[FileInfo], linears: dict[str, LinearInfo], unquantized: list[TensorInfo],
    complete: bool = True,
) -> tuple[CheckpointModel, list[Problem]]:
    builder = _Builder(config, unquantized, complete)
    stack = _main_stack(linears)
    per_layer: dict[int, _LayerParts] = defaultdict(_LayerParts)
    other: list[LinearInfo] = []
    head: LinearInfo | TensorInfo | None = None
    for name, info in linears.items():
        if name == HEAD:
            head = builder.true_dims(info, (("hidden_size", config.dims.hidden), ("vocab_size", config.dims.vocab)))
            continue
        m = _LAYER.match(name)
        if not m or m.group("stack") != stack:
            other.append(info)
            continue
        parts, rest = per_layer[int(m.group("index"))], m.group("rest")
        if a := _ATTENTION.match(rest):
            parts.attention[a.group("module")][a.group("proj")] = info
        elif (e := _EXPERT.match(rest)) and e.group("proj") in ROLES:
            parts.experts[e.group("block")][int(e.group("expert"))][ROLES[e.group("proj")]] = info
        elif (s := _SHARED.match(rest)) and s.group("proj") in ROLES:
            parts.shared.setdefault(s.group("block"), (s.group("shared"), {}))[1][ROLES[s.group("proj")]] = info
        elif (d := _DENSE.match(rest)) and d.group("proj") in ROLES:
            parts.dense[d.group("block")][ROLES[d.group("proj")]] = info
        else:
            parts.other.append(info)
    if head is None:
        head = next((t for t in unquantized if t.name == f"{HEAD}.weight"), None)
    layers = [builder.layer(stack, i, per_layer[i]) for i in sorted(per_layer)]
    if stack is not None:
        builder.check_layer_count(stack, set(per_layer))
    model = CheckpointModel.build(config, files, layers, head, other, unquantized)
    return model, builder.problems
