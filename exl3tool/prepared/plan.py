"""What `prepare` writes, decided from the format model alone (no IO): the units (one per decoder layer, plus
`globals`), each unit's output tensors as lists of source byte ranges, and its manifest structure entry.

    select_layers(model, layers) -> list[int] | None
    plan_units(model, layers) -> list[Unit]
    expert_groups(block) -> list[list[int]]         MoE experts grouped by (K, codebook, bias, dims)

Every output tensor is a concatenation of whole source tensors (legacy packed su/sv expanded to fp16 +-1):
stacking experts never re-tiles or converts a bit, so a prepared weight decodes exactly like its source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import prod

from exl3tool.errors import NotFoundError, UnsupportedFeatureError, UsageError
from exl3tool.format import TILE, CheckpointModel, GatedMLP, Layer, LinearInfo, MoEBlock, TensorInfo, format_bits
from exl3tool.io.safetensors import DTYPE_SIZES
from exl3tool.prepared.layout import (
    GLOBALS, group_shapes, group_tensor, layer_unit, linear_entry, routing_to_json, stack_order,
)

_LAYER = re.compile(r"^(?P<stack>(?:.+\.)?layers)\.(?P<index>\d+)\.")


@dataclass(frozen=True)
class Piece:
    """Bytes of one source tensor, whole; `expand`: a legacy packed su/sv (I16) written as fp16 +-1."""

    tensor: str
    nbytes: int
    expand: bool = False


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass
class Unit:
    """One resumable unit of work: a decoder layer (`layer-00003`) or `globals`."""

    id: str
    kind: str  # "layer" | "globals"
    tensors: list[OutTensor] = field(default_factory=list)
    structure: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor_specs(self) -> dict[str, dict]:
        return {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in self.tensors}


# --- layer selection ---------------------------------------------------------------------------------------


def select_layers(model: CheckpointModel, layers) -> list[int] | None:
    """None (every layer plus globals) or the chosen layer indices, each checked to exist."""
    if layers is None:
        return None
    have = [layer.index for layer in model.layers]
    try:  # the text grammar ("0-3,7,10-") is exl3tool.selection's; the writer resolves it to indices first
        chosen = sorted({int(i) for i in layers})
    except (TypeError, ValueError):
        raise UsageError(f"layers must be indices, got {layers!r}") from None
    if not chosen:
        raise UsageError("no layers chosen")
    missing = [i for i in chosen if i not in have]
    if missing:
        span = f"{have[0]}..{have[-1]}" if have else "none"
        raise NotFoundError(f"no layer {missing[0]} in the checkpoint (layers: {span})")
    return chosen


# --- planning ----------------------------------------------------------------------------------------------


class _Planner:
    def __init__(self, unit: Unit):
        self.unit = unit
        self.linears: dict[str, dict] = {}

    def add(self, name: str, dtype: str, shape: tuple[int, ...], pieces: list[Piece]) -> str:
        t = OutTensor(name, dtype, tuple(shape), tuple(pieces))
        if sum(p.nbytes for p in pieces) != t.nbytes:  # a source whose parts do not fill the tensor
            raise UnsupportedFeatureError(f"cannot lay out {name}: its sources hold {sum(p.nbytes for p in pieces)} "
                                          f"bytes, {t.dtype} {list(t.shape)} needs {t.nbytes}")
        self.unit.tensors.append(t)
        return name

    def dense(self, info: LinearInfo, role: str) -> str:
        """trellis, suh, svh (fp16, legacy signs expanded), bias: under the source's own names."""
        storage = {"trellis": {"tensor": self.add(info.tensor_name("trellis"), "I16", _trellis_shape(info),
                                                  [_piece(info, "trellis")])}}
        for leaf, size in (("suh", info.in_padded), ("svh", info.out_padded)):
            storage[leaf] = {"tensor": self.add(info.tensor_name(leaf), "F16", (size,), [scale_piece(info, leaf)])}
        if info.has_bias:
            storage["bias"] = {"tensor": self.add(info.tensor_name("bias"), "F16", (info.out_padded,),
                                                  [_piece(info, "bias")])}
        self.linears[info.name] = linear_entry(info, role, storage)
        return info.name

    def mlp(self, mlp: GatedMLP, role: str) -> dict:
        return {"kind": "dense", "name": mlp.name, "gate": self.dense(mlp.gate, role),
                "up": self.dense(mlp.up, role), "down": self.dense(mlp.down, role), "activation": mlp.activation,
                "activation_limit": mlp.activation_limit}

    def moe(self, block: MoEBlock) -> dict:
        entries = [self.group(block, g, ids) for g, ids in enumerate(expert_groups(block))]
        experts = []
        for expert in block.experts:
            experts.append({"name": expert.name, "gate": expert.gate.name, "up": expert.up.name,
                            "down": expert.down.name, "activation": expert.activation,
                            "activation_limit": expert.activation_limit})
        return {
            "kind": "moe", "name": block.name, "router": block.router.name, "routing": routing_to_json(block.routing),
            "experts": experts, "groups": entries,
            "shared_experts": None if block.shared_experts is None else self.mlp(block.shared_experts, "shared_expert"),
            "shared_expert_gate": None if block.shared_expert_gate is None else block.shared_expert_gate.name,
            "correction_bias": None if block.correction_bias is None else block.correction_bias.name,
            "router_bias": None if block.router_bias is None else block.router_bias.name,
        }

    def group(self, block: MoEBlock, g: int, ids: list[int]) -> dict:
        experts = [block.experts[e] for e in ids]
        first = experts[0]
        n, h_p, i_p = len(ids), first.gate.in_padded, first.gate.out_padded
        name = lambda f: group_tensor(block.name, g, f)  # noqa: E731
        bias = first.gate.has_bias
        shapes = group_shapes(n, h_p, i_p, first.gate.bits, first.down.bits, bias, first.down.has_bias)
        for f, (dtype, shape) in shapes.items():
            self.add(name(f), dtype, shape,
                     [_leaf_piece(getattr(experts[p], role), leaf) for p, role, leaf in stack_order(f, experts)])
        for p, x in enumerate(experts):
            views = {
                "gate": ({"tensor": name("w13"), "index": [0, p]}, {"tensor": name("gate_suh"), "index": [p]},
                         {"tensor": name("intermediate_rotations"), "index": [p], "slice": [0, i_p]},
                         {"tensor": name("w13_bias"), "index": [0, p]}),
                "up": ({"tensor": name("w13"), "index": [1, p]}, {"tensor": name("up_suh"), "index": [p]},
                       {"tensor": name("intermediate_rotations"), "index": [p], "slice": [i_p, 2 * i_p]},
                       {"tensor": name("w13_bias"), "index": [1, p]}),
                "down": ({"tensor": name("w2"), "index": [p]},
                         {"tensor": name("intermediate_rotations"), "index": [p], "slice": [2 * i_p, 3 * i_p]},
                         {"tensor": name("down_svh"), "index": [p]}, {"tensor": name("w2_bias"), "index": [p]}),
            }
            for role, info in (("gate", x.gate), ("up", x.up), ("down", x.down)):
                trellis, suh, svh, bias_view = views[role]
                storage = {"trellis": trellis, "suh": suh, "svh": svh}
                if info.has_bias:
                    storage["bias"] = bias_view
                self.linears[info.name] = linear_entry(info, "expert", storage)
        tensors = {f: name(f) for f in shapes}
        return {
            "experts": ids,
            "w13": {"bits": first.gate.bits, "codebook": first.gate.codebook.value},
            "w2": {"bits": first.down.bits, "codebook": first.down.codebook.value},
            "hidden": first.gate.in_features, "hidden_padded": h_p,
            "intermediate": first.gate.out_features, "intermediate_padded": i_p,
            "tensors": tensors,
        }

    def unquantized(self, tensors: list[TensorInfo]) -> list[str]:
        for t in tensors:
            self.add(t.name, t.dtype, t.shape, [Piece(t.name, t.nbytes)])
        return [t.name for t in tensors]


def _trellis_shape(info: LinearInfo) -> tuple[int, int, int]:
    return (info.in_padded // TILE, info.out_padded // TILE, info.trellis_words)


def _piece(info: LinearInfo, leaf: str) -> Piece:
    t = info.tensors[leaf]
    return Piece(t.name, t.nbytes)


def _leaf_piece(info: LinearInfo, leaf: str) -> Piece:
    return scale_piece(info, leaf) if leaf in ("suh", "svh") else _piece(info, leaf)


def scale_piece(info: LinearInfo, leaf: str) -> Piece:
    """suh/svh as fp16: stored, or expanded from legacy packed su/sv (16 signs per I16 word -> 32 bytes)."""
    if leaf in info.tensors:
        return _piece(info, leaf)
    packed = info.tensors["su" if leaf == "suh" else "sv"]
    return Piece(packed.name, packed.nbytes * TILE, expand=True)


def _describe(info: LinearInfo) -> str:
    return f"K={format_bits(info.bits)} {info.codebook.value}" + (" +bias" if info.has_bias else "")


def expert_groups(block: MoEBlock) -> list[list[int]]:
    """The experts of `block` split into groups that share K, codebook, bias and dims (one set of stacked
    tensors each), in the order prepare numbers them; UnsupportedFeatureError for experts it cannot stack."""
    groups: dict[tuple, list[int]] = {}
    for e, expert in enumerate(block.experts):
        groups.setdefault(_group_key(block, e, expert), []).append(e)
    return sorted(groups.values())


def _group_key(block: MoEBlock, e: int, expert: GatedMLP) -> tuple:
    """Experts sharing this key share stacked tensors. gate and up of one expert must agree (one w13)."""
    gate, up, down = expert.gate, expert.up, expert.down
    sig = lambda i: (i.bits, i.codebook, i.has_bias, i.in_features, i.out_features, i.in_padded, i.out_padded)  # noqa
    if sig(gate) != sig(up):
        raise UnsupportedFeatureError(
            f"expert {e}: gate ({_describe(gate)}, {gate.in_features}x{gate.out_features}) and up ({_describe(up)}, "
            f"{up.in_features}x{up.out_features}) differ, but the prepared layout stacks them in one w13 tensor; "
            "exl3tool prepare refuses to convert either", tensor=block.name)
    if (down.in_padded, down.out_padded, down.in_features, down.out_features) != \
            (gate.out_padded, gate.in_padded, gate.out_features, gate.in_features):
        raise UnsupportedFeatureError(
            f"expert {e}: down is {down.in_features}x{down.out_features}, not the transpose of gate's "
            f"{gate.in_features}x{gate.out_features}", tensor=block.name)
    first = block.experts[0]
    if (expert.activation, expert.activation_limit) != (first.activation, first.activation_limit):
        raise UnsupportedFeatureError(f"expert {e}: activation {expert.activation!r} differs from expert 0's",
                                      tensor=block.name)
    return (sig(gate), sig(down))


def _stack_of(model: CheckpointModel) -> str | None:
    for layer in model.layers:
        for lin in layer.linears:
            m = _LAYER.match(lin.name)
            if m:
                return m.group("stack")
    return None


def _unquantized_by_layer(model: CheckpointModel) -> tuple[dict[int, list[TensorInfo]], list[TensorInfo]]:
    stack = _stack_of(model)
    indices = {layer.index for layer in model.layers}
    per_layer: dict[int, list[TensorInfo]] = {}
    rest = []
    for t in model.unquantized:
        m = _LAYER.match(t.name)
        if m and m.group("stack") == stack and int(m.group("index")) in indices:
            per_layer.setdefault(int(m.group("index")), []).append(t)
        else:
            rest.append(t)
    return per_layer, rest


def _layer_unit(layer: Layer, unquantized: list[TensorInfo]) -> Unit:
    unit = Unit(layer_unit(layer.index), "layer")
    p = _Planner(unit)
    attention = None
    if layer.attention is not None:
        attention = {"name": layer.attention.name,
                     "projections": {k: p.dense(v, "attention") for k, v in layer.attention.projections.items()}}
    mlp = None
    if isinstance(layer.mlp, GatedMLP):
        mlp = p.mlp(layer.mlp, "mlp")
    elif isinstance(layer.mlp, MoEBlock):
        mlp = p.moe(layer.mlp)
    other = [p.dense(lin, "other") for lin in layer.other_linears]
    names = p.unquantized(unquantized)
    unit.structure = {"index": layer.index, "attention": attention, "mlp": mlp, "other_linears": other,
                      "linears": p.linears, "unquantized": names}
    return unit


def _globals_unit(model: CheckpointModel, unquantized: list[TensorInfo]) -> Unit:
    unit = Unit(GLOBALS, "globals")
    p = _Planner(unit)
    head = None
    if isinstance(model.head, LinearInfo):
        head = {"kind": "exl3", "linear": p.dense(model.head, "head")}
    elif isinstance(model.head, TensorInfo):
        head = {"kind": "unquantized", "tensor": model.head.name}
    other = [p.dense(lin, "other") for lin in model.other_linears]
    names = p.unquantized(unquantized)
    unit.structure = {"head": head, "other_linears": other, "linears": p.linears, "unquantized": names}
    return unit


def plan_units(model: CheckpointModel, layers: list[int] | None) -> list[Unit]:
    """The units to write: the chosen layers (all when `layers` is None, then `globals` too), in order."""
    per_layer, rest = _unquantized_by_layer(model)
    chosen = [layer for layer in model.layers if layers is None or layer.index in layers]
    units = [_layer_unit(layer, per_layer.get(layer.index, [])) for layer in chosen]
    if layers is None:
        units.append(_globals_unit(model, rest))
    seen: set[str] = set()
    for unit in units:
        for t in unit.tensors:
            if t.name in seen:
                raise UnsupportedFeatureError("two prepared tensors would share this name", tensor=t.name)
            seen.add(t.name)
    return units
