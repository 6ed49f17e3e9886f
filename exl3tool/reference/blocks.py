"""Whole blocks in fp32: the gated MLP (dense, one expert, shared experts) and the routed MoE block."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from exl3tool.errors import UnsupportedFeatureError
from exl3tool.format import ACTIVATION_KINDS, LinearTensors, Routing
from exl3tool.reference.linear import linear_forward


def _swiglu_oai(g: torch.Tensor, u: torch.Tensor, limit: float | None) -> torch.Tensor:
    """gpt-oss (HF GptOssExperts): gate clamped from above, up both ways, (up + 1) * gate * sigmoid(1.702 gate)."""
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (u + 1) * g * torch.sigmoid(1.702 * g)


def _glu(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    return lambda g, u, limit: act(g) * u


# The gated MLPs' intermediate from gate(x), up(x) and the activation's clamp, for each of format.ACTIVATION_KINDS'
# kinds: act(gate(x)) * up(x), or gpt-oss's clamped SwiGLU
ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]] = {
    "silu": _glu(F.silu), "gelu": _glu(F.gelu), "gelu_tanh": _glu(partial(F.gelu, approximate="tanh")),
    "swiglu_oai": _swiglu_oai,
}


def activation_fn(kind: str, tensor: str | None = None,
                  limit: float | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The intermediate ``(gate(x), up(x)) -> h`` of ``ACTIVATIONS[kind]`` at clamp ``limit``, or
    UnsupportedFeatureError naming ``tensor`` (the MLP's gate)."""
    act = ACTIVATIONS.get(kind)
    if act is None:
        raise UnsupportedFeatureError(f"MLP activation {kind!r} is not supported (known: "
                                      f"{', '.join(ACTIVATION_KINDS)})", tensor=tensor)
    return lambda g, u: act(g, u, limit)


@dataclass
class GatedMLPTensors:
    gate: LinearTensors
    up: LinearTensors
    down: LinearTensors
    activation: str = "silu"
    activation_limit: float | None = None


def gated_mlp_forward(x: torch.Tensor, mlp: GatedMLPTensors) -> torch.Tensor:
    """fp32 down(act(gate(x)) * up(x)) for x [M, hidden] (gpt-oss: its clamped SwiGLU of gate(x) and up(x))."""
    act = activation_fn(mlp.activation, mlp.gate.info.name, mlp.activation_limit)
    return linear_forward(act(linear_forward(x, mlp.gate), linear_forward(x, mlp.up)), mlp.down)


def route(
    x: torch.Tensor, router: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None,
    router_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [M, top_k], expert indices [M, top_k]) for x [M, hidden] and router [E, hidden] (plus
    ``router_bias`` [E] on the logits: gpt-oss, whose softmax over the top-k logits is the renormalised one)."""
    logits = x.float() @ router.float().T
    if router_bias is not None:
        logits = logits + router_bias.float()
    if routing.method == "softmax_topk":
        scores = logits.softmax(dim=-1)
        weights, indices = scores.topk(routing.top_k, dim=-1)
    elif routing.method == "sigmoid_noaux_tc":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if routing.n_group > 1:
            # keep the topk_group groups whose two best experts score highest, then pick top_k inside them
            grouped = choice.view(choice.shape[0], routing.n_group, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(routing.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        indices = choice.topk(routing.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
    else:
        raise UnsupportedFeatureError(f"MoE routing {routing.method!r} is not understood by the reference")
    if routing.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scale, indices


def moe_forward(
    x: torch.Tensor,
    router: torch.Tensor,
    routing: Routing,
    expert: Callable[[int], GatedMLPTensors],
    *,
    shared: GatedMLPTensors | None = None,
    shared_gate: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    router_bias: torch.Tensor | None = None,
    mlp_forward: Callable = gated_mlp_forward,
) -> torch.Tensor:
    """fp32 [M, hidden]: sum over each token's top-k experts of weight * expert(x), plus the shared experts
    (scaled by sigmoid(x @ shared_gate.T) when there is such a gate). `expert(e)` loads expert e on demand,
    so only routed experts are ever decoded. `mlp_forward(x, expert)` runs one expert: the fp32 reference by
    default; exl3tool.ops passes its GPU kernels (then `expert(e)` returns what that function takes)."""
    weights, indices = route(x, router, routing, correction_bias, router_bias)
    out = torch.zeros(x.shape[0], router.shape[1], dtype=torch.float32, device=x.device)
    for e in indices.unique().tolist():
        rows, slots = (indices == e).nonzero(as_tuple=True)
        y = mlp_forward(x[rows], expert(e))
        out.index_add_(0, rows, y * weights[rows, slots, None])
    if shared is not None:
        y = mlp_forward(x, shared)
        if shared_gate is not None:
            y = y * torch.sigmoid(x.float() @ shared_gate.float().T)
        out += y
    return out
