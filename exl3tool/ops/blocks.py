"""Whole MLP blocks built from our dense EXL3 linear kernels (routing and the activation in torch).

A fused MoE kernel is separate work; this composes the verified dense kernel per expert so that verify can check
dense-MLP and MoE blocks end to end against the fp32 reference. Routing is the reference's own (it is not a
kernel); only the linears differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from exl3tool.ops.linear import DeviceLinear, linear_forward
from exl3tool.reference import blocks as reference_blocks


@dataclass
class DeviceGatedMLP:
    gate: DeviceLinear
    up: DeviceLinear
    down: DeviceLinear
    activation: str = "silu"
    activation_limit: float | None = None


def gated_mlp_forward(x: torch.Tensor, mlp: DeviceGatedMLP) -> torch.Tensor:
    """fp32 ``down(act(gate(x)) * up(x))``; the intermediate is rounded to x's dtype, as a serving engine does."""
    act = reference_blocks.activation_fn(mlp.activation, mlp.gate.info.name, mlp.activation_limit)
    h = act(linear_forward(x, mlp.gate, torch.float32), linear_forward(x, mlp.up, torch.float32))
    return linear_forward(h.to(x.dtype), mlp.down, torch.float32)


moe_forward = partial(reference_blocks.moe_forward, mlp_forward=gated_mlp_forward)
moe_forward.__doc__ = "``reference.moe_forward`` with every expert run by our kernels (``expert(e) -> DeviceGatedMLP``)."
