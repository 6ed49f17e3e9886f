"""The read interface shared by source checkpoints (`Checkpoint`) and prepared folders (`PreparedCheckpoint`).

A subclass supplies the format model (`self.model`), `load_tensor`, `load_linear` and how an expert group's
stacked tensors come to be (`_group_tensors`: views of the prepared shards, or the source's experts stacked in
memory exactly as prepare lays them out). This base owns everything else:

    config / layers / linears / blocks / head       the format model
    linear(name) / block(name) / layer(index)       lookups with one "not found" wording
    mlp_tensors(mlp, device) -> GatedMLPTensors     the three linears of a dense MLP, an expert or shared experts
    moe(layer_index, device=None) -> MoELayer       stacked expert groups + router, shared experts, routing
    dequantize(name, device=None) / reference_forward(name, x, device=None)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exl3tool import reference
from exl3tool.errors import NotFoundError, UnsupportedFeatureError, UsageError
from exl3tool.format import Block, Codebook, GatedMLP, Layer, LinearInfo, LinearTensors, MoEBlock, Routing, format_bits
from exl3tool.prepared.layout import group_shapes
from exl3tool.prepared.plan import expert_groups


@dataclass(frozen=True)
class ExpertGroup:
    """Experts of one MoE layer that share K, codebook and dims, stacked (E = len(experts); shapes and stacking
    order: `exl3tool.prepared.layout.group_shapes` / `stack_order`): w13 I16 [2, E, H_p/16, I_p/16, 16*K13]
    (gate plane, then up), w2 I16 [E, I_p/16, H_p/16, 16*K2], gate_suh / up_suh F16 [E, H_p],
    intermediate_rotations F16 [E, 3*I_p] (gate_svh | up_svh | down_suh), down_svh F16 [E, H_p], optional
    w13_bias F16 [2, E, I_p] and w2_bias F16 [E, H_p]. Row p of every tensor belongs to expert `experts[p]`."""

    experts: tuple[int, ...]
    w13_bits: float
    w13_codebook: Codebook
    w2_bits: float
    w2_codebook: Codebook
    hidden: int
    hidden_padded: int
    intermediate: int
    intermediate_padded: int
    w13: torch.Tensor
    w2: torch.Tensor
    gate_suh: torch.Tensor
    up_suh: torch.Tensor
    intermediate_rotations: torch.Tensor
    down_svh: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return group_shapes(len(self.experts), self.hidden_padded, self.intermediate_padded, self.w13_bits,
                            self.w2_bits, self.w13_bias is not None, self.w2_bias is not None)


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer with its experts stacked. `router` [E, hidden] keeps its stored dtype (fp16 in EXL3);
    `shared` holds the shared experts as dense linears. With one expert group (every expert at the same K and
    codebook, the usual case) `w13`, `w2`, ... `bits`, `codebook` give that group's values directly."""

    name: str
    layer: int
    block: MoEBlock
    routing: Routing
    num_experts: int
    hidden: int
    hidden_padded: int
    intermediate: int
    intermediate_padded: int
    router: torch.Tensor
    groups: tuple[ExpertGroup, ...]
    shared: reference.GatedMLPTensors | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]: sigmoid(x @ g.T) scales the shared output
    correction_bias: torch.Tensor | None = None  # [E]: DeepSeek-V3 e_score_correction_bias
    router_bias: torch.Tensor | None = None  # [E]: on the router's logits (gpt-oss)

    @property
    def single_group(self) -> ExpertGroup:
        if len(self.groups) != 1:
            parts = "; ".join(f"experts {_ids(g.experts)}: K={format_bits(g.w13_bits)}/{format_bits(g.w2_bits)} "
                              f"{g.w13_codebook.value}/{g.w2_codebook.value}" for g in self.groups)
            raise UnsupportedFeatureError(f"{len(self.groups)} expert groups of different K or codebook ({parts}): "
                                          "use .groups", tensor=self.name)
        return self.groups[0]

    w13 = property(lambda self: self.single_group.w13)
    w2 = property(lambda self: self.single_group.w2)
    gate_suh = property(lambda self: self.single_group.gate_suh)
    up_suh = property(lambda self: self.single_group.up_suh)
    intermediate_rotations = property(lambda self: self.single_group.intermediate_rotations)
    down_svh = property(lambda self: self.single_group.down_svh)

    @property
    def bits(self) -> float:
        """K of every routed expert linear; UnsupportedFeatureError when they differ (see `groups`)."""
        g = self.single_group
        if g.w13_bits != g.w2_bits:
            raise UnsupportedFeatureError(f"gate/up are K={format_bits(g.w13_bits)}, down K={format_bits(g.w2_bits)}:"
                                          " use .groups[0].w13_bits / .w2_bits", tensor=self.name)
        return g.w13_bits

    @property
    def codebook(self) -> Codebook:
        g = self.single_group
        if g.w13_codebook is not g.w2_codebook:
            raise UnsupportedFeatureError(f"gate/up use {g.w13_codebook.value}, down {g.w2_codebook.value}: use "
                                          ".groups[0].w13_codebook / .w2_codebook", tensor=self.name)
        return g.w13_codebook

    def locate(self, expert: int) -> tuple[ExpertGroup, int]:
        """(group, row in the group's stacked tensors) of an expert id."""
        for g in self.groups:
            if expert in g.experts:
                return g, g.experts.index(expert)
        raise NotFoundError(f"no expert {expert} (experts 0..{self.num_experts - 1})", tensor=self.name)


def _ids(ids) -> str:
    ids = list(ids)
    return f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2 else \
        ",".join(map(str, ids))


def check_input(x: torch.Tensor, width: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != width or not x.is_floating_point():
        raise UsageError(f"input must be a float tensor [M, {width}], got {x.dtype} {list(x.shape)}", tensor=name)


class CheckpointReader:
    """Base of Checkpoint and PreparedCheckpoint (see the module doc for what a subclass supplies)."""

    model = None  # CheckpointModel, set by the subclass
    source: str = ""

    config = property(lambda self: self.model.config)
    layers = property(lambda self: self.model.layers)
    linears = property(lambda self: self.model.linears)
    blocks = property(lambda self: self.model.blocks)
    head = property(lambda self: self.model.head)

    # --- subclass hooks ----------------------------------------------------------------------------------

    def load_tensor(self, name: str, device=None) -> torch.Tensor:
        raise NotImplementedError

    def load_linear(self, name: str, device=None) -> LinearTensors:
        raise NotImplementedError

    def _group_tensors(self, block: MoEBlock, g: int, ids: list[int], device) -> dict[str, torch.Tensor]:
        """field -> stacked tensor of expert group `g` (experts `ids`) of `block`, on `device`."""
        raise NotImplementedError

    def _missing(self, name: str, what: str):
        raise NotFoundError(f"no {what} of that name in the checkpoint", path=self.source, tensor=name)

    def _device(self, device) -> torch.device:
        return torch.device("cpu") if device is None else torch.device(device)

    # --- lookups -----------------------------------------------------------------------------------------

    def linear(self, name: str) -> LinearInfo:
        if name not in self.linears:
            self._missing(name, "EXL3 linear")
        return self.linears[name]

    def block(self, name: str) -> Block:
        if name not in self.blocks:
            self._missing(name, "MLP or MoE block")
        return self.blocks[name]

    def layer(self, index: int) -> Layer:
        for layer in self.layers:
            if layer.index == index:
                return layer
        span = f"{self.layers[0].index}..{self.layers[-1].index}" if self.layers else "none"
        raise NotFoundError(f"no layer {index}; layers are {span}")

    # --- tensors of blocks -------------------------------------------------------------------------------

    def mlp_tensors(self, mlp: GatedMLP, device=None) -> reference.GatedMLPTensors:
        gate, up, down = (self.load_linear(lin.name, device) for lin in mlp.linears)
        return reference.GatedMLPTensors(gate, up, down, mlp.activation, mlp.activation_limit)

    def _optional(self, info, device) -> torch.Tensor | None:
        return None if info is None else self.load_tensor(info.name, device)

    def moe(self, layer_index: int, device=None) -> MoELayer:
        """The MoE layer of decoder layer `layer_index` with its experts stacked per group, on `device`."""
        layer = self.layer(layer_index)
        block = layer.mlp
        if not isinstance(block, MoEBlock):
            raise NotFoundError(f"layer {layer_index} has no MoE block", path=self.source)
        device = self._device(device)
        groups = []
        for g, ids in enumerate(expert_groups(block)):
            first = block.experts[ids[0]]
            groups.append(ExpertGroup(
                tuple(ids), first.gate.bits, first.gate.codebook, first.down.bits, first.down.codebook,
                first.gate.in_features, first.gate.in_padded, first.gate.out_features, first.gate.out_padded,
                **self._group_tensors(block, g, ids, device)))
        first = groups[0]
        return MoELayer(
            block.name, layer_index, block, block.routing, len(block.experts), first.hidden, first.hidden_padded,
            first.intermediate, first.intermediate_padded, self.load_tensor(block.router.name, device),
            tuple(groups), None if block.shared_experts is None else self.mlp_tensors(block.shared_experts, device),
            self._optional(block.shared_expert_gate, device), self._optional(block.correction_bias, device),
            self._optional(block.router_bias, device))

    # --- reference ---------------------------------------------------------------------------------------

    def dequantize(self, module_name: str, device=None) -> torch.Tensor:
        """fp32 weight of an EXL3 linear in HF orientation [out_features, in_features]."""
        return reference.dequantize(self.load_linear(module_name, device))

    def reference_forward(self, name: str, x: torch.Tensor, device=None) -> torch.Tensor:
        """fp32 output of the EXL3 linear or block (dense MLP, MoE block, one expert, shared experts) `name`
        for x [M, in] (true size, any float dtype). Runs on `device` (default: x's device)."""
        return reference_forward(self, name, x, device)


def reference_forward(reader: CheckpointReader, name: str, x: torch.Tensor, device=None, load_linear=None):
    """`reader.reference_forward`, with `load_linear(name, device)` (default: the reader's) so that a caller
    that already holds the linears (verify) has each tensor loaded once."""
    device = x.device if device is None else torch.device(device)
    load = reader.load_linear if load_linear is None else load_linear
    x = x.to(device)

    def mlp(block: GatedMLP) -> reference.GatedMLPTensors:
        return reference.GatedMLPTensors(*(load(lin.name, device) for lin in block.linears), block.activation,
                                         block.activation_limit)

    if name in reader.linears:
        check_input(x, reader.linears[name].in_features, name)
        return reference.linear_forward(x, load(name, device))
    block = reader.block(name)
    if isinstance(block, GatedMLP):
        check_input(x, block.gate.in_features, name)
        return reference.gated_mlp_forward(x, mlp(block))
    router = reader.load_tensor(block.router.name, device)
    check_input(x, router.shape[1], name)
    return reference.moe_forward(
        x, router, block.routing, lambda e: mlp(block.experts[e]),
        shared=None if block.shared_experts is None else mlp(block.shared_experts),
        shared_gate=reader._optional(block.shared_expert_gate, device),
        correction_bias=reader._optional(block.correction_bias, device),
        router_bias=reader._optional(block.router_bias, device))


def stack_group(load_linear, block: MoEBlock, ids: list[int], device) -> dict[str, torch.Tensor]:
    """The stacked tensors of experts `ids` built in memory from their own linears, bit-identical to what
    prepare writes (same shapes, same order: `group_shapes` / `stack_order`)."""
    from exl3tool.prepared.layout import stack_order

    experts = [block.experts[e] for e in ids]
    first = experts[0]
    loaded = [{role: load_linear(getattr(x, role).name, device) for role in ("gate", "up", "down")} for x in experts]
    shapes = group_shapes(len(ids), first.gate.in_padded, first.gate.out_padded, first.gate.bits, first.down.bits,
                          first.gate.has_bias, first.down.has_bias)
    out = {}
    for field, (_, shape) in shapes.items():
        parts = [getattr(loaded[p][role], leaf).reshape(-1) for p, role, leaf in stack_order(field, experts)]
        out[field] = torch.cat(parts).reshape(shape)
    return out
