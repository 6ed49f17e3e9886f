"""What is measured: groups of cases (one linear, gated MLP or MoE block at each token count) and, per kind,
the table of implementations that run it.

A group holds its weights in several copies on the GPU (so that one timed loop streams more than 3x the L2 of
distinct weights), the fp32 reference of copy 0, and builds each implementation as an `Impl`: ``call(i)`` runs
it on weight copy ``i`` with the case's input. Adding an implementation is one entry in a table below.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from exl3tool import reference
from exl3tool.bench import peers
from exl3tool.bench.report import Case, exl3_weight_bytes, floor_us, linear_flops
from exl3tool.bench.timing import L2_MULTIPLE
from exl3tool.format import GatedMLP, LinearInfo, LinearTensors, MoEBlock
from exl3tool.ops import blocks
from exl3tool.ops import moe as fused
from exl3tool.ops.linear import DeviceLinear, choose_path, linear_forward

MAX_COPIES = 256  # small weights: at most this many copies (the report says how many were used)
MAX_MOE_COPIES = 32  # a MoE copy is every expert of the layer (and a model load for ExLlamaV3)
COPY_MEMORY_FRACTION = 0.25  # weight copies of a group use at most this share of the GPU's free memory


def weight_copies(nbytes: int, l2_bytes: int, limit: int = MAX_COPIES) -> int:
    """Copies of ``nbytes`` of weights whose sum exceeds ``L2_MULTIPLE`` x the L2 (at least 2, so consecutive
    calls never read the same weights; at most ``limit``)."""
    return max(2, min(limit, math.ceil(L2_MULTIPLE * l2_bytes / max(nbytes, 1))))


def memory_limit(bytes_per_copy: int, device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(COPY_MEMORY_FRACTION * free // max(bytes_per_copy, 1)))


@dataclass
class Impl:
    name: str
    call: Callable[[int], torch.Tensor]  # output [M, out] (any float dtype) of weight copy i on the case's input
    copies: int
    weight_bytes: int  # streamed per call
    capturable: bool = True
    note: str = ""
    checked: bool = True  # False: a yardstick whose output is not the case's: timed, not checked


@dataclass
class Setup:
    """One case ready to measure: the case (no results yet), its fp32 reference, its implementations."""

    case: Case
    reference: torch.Tensor
    impls: list[tuple[str, Callable[[], Impl | None]]]  # name, builder (None: not available here)


def clone(obj):
    """A deep copy of the tensors of a (nested) dataclass / tuple: another copy of the same weights."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (tuple, list)):
        return type(obj)(clone(o) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: clone(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def random_input(tokens: int, width: int, dtype: torch.dtype, device, seed: int, what: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(f"{what}:{tokens}".encode()))
    return torch.randn(tokens, width, generator=g, device=device, dtype=torch.float32).to(dtype)


def _dense_copies(w0: torch.Tensor, copies: int) -> list[torch.Tensor]:
    """Copy 0 is the real weight (checked); the rest are random weights of the same size and spread (timing
    only), so no copy is zeros."""
    scale = w0.float().std()
    return [w0] + [(torch.randn_like(w0, dtype=torch.float32) * scale).to(w0.dtype) for _ in range(copies - 1)]


# --- linears ---------------------------------------------------------------------------------------------


class LinearGroup:
    kind = "linear"

    def __init__(self, name: str, copies: list[LinearTensors], ctx):
        self.name, self.tensors, self.ctx = name, copies, ctx
        self.info: LinearInfo = copies[0].info
        self.lins = [DeviceLinear.from_tensors(t, ctx.device) for t in copies]
        self.weight_bytes = exl3_weight_bytes(self.info.in_features, self.info.out_features, self.info.bits,
                                              self.info.has_bias)
        self._dense: list[torch.Tensor] | None = None

    def dense(self, dtype) -> list[torch.Tensor]:
        if self._dense is None:
            i = self.info
            w0 = reference.reconstruct(self.tensors[0])[: i.in_features, : i.out_features].to(dtype).contiguous()
            n = min(weight_copies(w0.numel() * w0.element_size(), self.ctx.l2_bytes),
                    memory_limit(w0.numel() * w0.element_size(), self.ctx.device))
            self._dense = _dense_copies(w0, n)
        return self._dense

    def setup(self, tokens: int) -> Setup:
        i, ctx = self.info, self.ctx
        x = random_input(tokens, i.in_features, ctx.dtype, ctx.device, ctx.seed, self.name)
        ref = reference.linear_forward(x, self.tensors[0])
        case = Case("linear", self.name, i.in_features, i.out_features, i.bits, i.codebook.value, tokens,
                    self.weight_bytes, floor_us(self.weight_bytes, ctx.copy_tbs),
                    linear_flops(tokens, i.in_features, i.out_features))
        return Setup(case, ref, [(name, _bind(make, self, x)) for name, make in LINEAR_IMPLEMENTATIONS.items()
                                 if name not in OPTIONAL_PEERS or name in ctx.peers])


def _bind(make, group, x):
    return lambda: make(group, x)


def _linear_exl3(path: str):
    def make(g: LinearGroup, x):
        note = f"path {choose_path(x.shape[0], g.lins[0])} at this M" if path == "auto" else ""
        return Impl("exl3tool" if path == "auto" else "dequant+fp16",
                    lambda c: linear_forward(x, g.lins[c], path=path), len(g.lins), g.weight_bytes, note=note)
    return make


def _linear_torch(g: LinearGroup, x):
    dense, bias = g.dense(x.dtype), g.tensors[0].bias
    nbytes = dense[0].numel() * dense[0].element_size()
    if bias is None:
        return Impl("torch fp16", lambda c: x @ dense[c], len(dense), nbytes)
    b = bias[: g.info.out_features].to(x.dtype)
    return Impl("torch fp16", lambda c: torch.addmm(b, x, dense[c]), len(dense), nbytes + b.numel() * b.element_size())


def _linear_exllamav3(g: LinearGroup, x):
    pairs = [peers.exllamav3_linear(t) for t in g.tensors]
    xp = pairs[0][0](x)
    return Impl("exllamav3", lambda c: pairs[c][1](xp), len(pairs), g.weight_bytes)


# name -> builder(group, x) -> Impl. Peers in OPTIONAL_PEERS run only when asked for (--peer).
LINEAR_IMPLEMENTATIONS = {
    "exl3tool": _linear_exl3("auto"),  # linear_forward's own choice of path at this M
    "dequant+fp16": _linear_exl3("dequant"),  # decode W_hat every call, then torch's GEMM
    "torch fp16": _linear_torch,  # x @ W, W fp16 of the same shape
    "exllamav3": _linear_exllamav3,
}
OPTIONAL_PEERS = {"exllamav3"}


# --- gated MLP (a model's dense MLP block) -----------------------------------------------------------------


class MLPGroup:
    kind = "mlp"

    def __init__(self, name: str, block: GatedMLP, copies: list[reference.GatedMLPTensors], ctx):
        self.name, self.block, self.tensors, self.ctx = name, block, copies, ctx
        dev = ctx.device
        self.mlps = [blocks.DeviceGatedMLP(*(DeviceLinear.from_tensors(t, dev) for t in (m.gate, m.up, m.down)),
                                           m.activation, m.activation_limit) for m in copies]
        self.weight_bytes = sum(exl3_weight_bytes(i.in_features, i.out_features, i.bits, i.has_bias)
                                for i in block.linears)
        self._dense = None

    def dense(self, dtype):
        if self._dense is None:
            parts = [reference.reconstruct(t)[: t.info.in_features, : t.info.out_features].to(dtype).contiguous()
                     for t in (self.tensors[0].gate, self.tensors[0].up, self.tensors[0].down)]
            nbytes = sum(p.numel() * p.element_size() for p in parts)
            n = min(weight_copies(nbytes, self.ctx.l2_bytes), memory_limit(nbytes, self.ctx.device))
            self._dense = list(zip(*(_dense_copies(p, n) for p in parts)))
        return self._dense

    def setup(self, tokens: int) -> Setup:
        b, ctx = self.block, self.ctx
        x = random_input(tokens, b.gate.in_features, ctx.dtype, ctx.device, ctx.seed, self.name)
        ref = reference.gated_mlp_forward(x, self.tensors[0])
        flops = sum(linear_flops(tokens, i.in_features, i.out_features) for i in b.linears)
        case = Case("mlp", self.name, b.gate.in_features, b.down.out_features, _same(b.linears, "bits"),
                    _same(b.linears, "codebook"), tokens, self.weight_bytes,
                    floor_us(self.weight_bytes, ctx.copy_tbs), flops)
        return Setup(case, ref, [(name, _bind(make, self, x)) for name, make in MLP_IMPLEMENTATIONS.items()])


def _same(infos, field):
    values = {getattr(i, field) for i in infos}
    value = values.pop() if len(values) == 1 else None
    return getattr(value, "value", value)


def _mlp_dequant(x, mlp: blocks.DeviceGatedMLP):
    """``blocks.gated_mlp_forward`` with every linear on the dequantize + torch GEMM path."""
    f = lambda h, lin: linear_forward(h, lin, torch.float32, path="dequant")  # noqa: E731
    act = reference.activation_fn(mlp.activation, mlp.gate.info.name, mlp.activation_limit)
    return f(act(f(x, mlp.gate), f(x, mlp.up)).to(x.dtype), mlp.down)


def _mlp_torch(g: MLPGroup, x):
    dense = g.dense(x.dtype)
    act = reference.activation_fn(g.block.activation, g.block.gate.name, g.block.activation_limit)

    def call(c):
        gate, up, down = dense[c]
        return act((x @ gate).float(), (x @ up).float()).to(x.dtype) @ down

    return Impl("torch fp16", call, len(dense), sum(w.numel() * w.element_size() for w in dense[0]))


MLP_IMPLEMENTATIONS = {
    "exl3tool": lambda g, x: Impl("exl3tool", lambda c: blocks.gated_mlp_forward(x, g.mlps[c]), len(g.mlps),
                                  g.weight_bytes),
    "dequant+fp16": lambda g, x: Impl("dequant+fp16", lambda c: _mlp_dequant(x, g.mlps[c]), len(g.mlps),
                                      g.weight_bytes),
    "torch fp16": _mlp_torch,  # the same three matmuls with fp16 weights
}


# --- MoE block -----------------------------------------------------------------------------------------------


class MoEGroup:
    """A MoE layer of a checkpoint reader (a model's, or a synthetic one written for --moe)."""

    kind = "moe"

    def __init__(self, reader, layer: int, ctx, name: str, peer_folder=None):
        self.reader, self.layer, self.ctx, self.name = reader, layer, ctx, name
        self.block: MoEBlock = reader.layer(layer).mlp
        self.peer_folder = peer_folder  # a folder ExLlamaV3 can load (--moe only)
        dev = ctx.device
        self.router = reader.load_tensor(self.block.router.name, dev)
        opt = lambda t: None if t is None else reader.load_tensor(t.name, dev)  # noqa: E731
        self.shared_gate, self.correction_bias = opt(self.block.shared_expert_gate), opt(self.block.correction_bias)
        self.router_bias = opt(self.block.router_bias)
        self._loaded: dict[str, LinearTensors] = {}
        self.expert_bytes = [_mlp_bytes(e) for e in self.block.experts]
        self.shared_bytes = 0 if self.block.shared_experts is None else _mlp_bytes(self.block.shared_experts)
        self.total_bytes = sum(self.expert_bytes) + self.shared_bytes
        self._copies: list[dict] = []  # per copy: {"experts": [DeviceGatedMLP], "shared": ...}
        self._fused: list = []
        self._exllamav3: list = []  # ExLlamaV3 (model, call) per weight copy

    def load(self, name: str, device) -> LinearTensors:
        if name not in self._loaded:
            self._loaded[name] = self.reader.load_linear(name, device)
        return self._loaded[name]

    def copies_for(self, touched_bytes: int) -> int:
        return min(weight_copies(touched_bytes, self.ctx.l2_bytes, MAX_MOE_COPIES),
                   memory_limit(self.total_bytes, self.ctx.device))

    def experts(self, copies: int) -> list[dict]:
        """Per-expert DeviceGatedMLPs of ``copies`` weight copies (copy 0: the checkpoint's own tensors)."""
        dev = self.ctx.device

        def mlp(m: GatedMLP, copy: int):
            t = [self.load(i.name, dev) for i in m.linears]
            t = t if copy == 0 else [clone(x) for x in t]
            return blocks.DeviceGatedMLP(*(DeviceLinear.from_tensors(x, dev) for x in t), m.activation,
                                         m.activation_limit)

        while len(self._copies) < copies:
            c = len(self._copies)
            self._copies.append({
                "experts": [mlp(e, c) for e in self.block.experts],
                "shared": None if self.block.shared_experts is None else mlp(self.block.shared_experts, c),
            })
        return self._copies[:copies]

    def fused_layers(self, copies: int) -> list:
        """``exl3tool.ops.moe.DeviceMoE`` of ``copies`` weight copies (copy 0: the reader's stacked tensors)."""
        if len(self._fused) < copies:
            base = self.reader.moe(self.layer, self.ctx.device)
            while len(self._fused) < copies:
                self._fused.append(fused.DeviceMoE.from_layer(base if not self._fused else clone(base),
                                                              self.ctx.device))
        return self._fused[:copies]

    def setup(self, tokens: int) -> Setup:
        b, ctx, dev = self.block, self.ctx, self.ctx.device
        x = random_input(tokens, self.router.shape[1], ctx.dtype, dev, ctx.seed, self.name)
        from exl3tool.reader import reference_forward

        ref = reference_forward(self.reader, b.name, x, dev, load_linear=self.load)
        _, indices = reference.route(x, self.router, b.routing, self.correction_bias, self.router_bias)
        touched = indices.unique().tolist()
        routes = indices.numel()
        touched_bytes = sum(self.expert_bytes[e] for e in touched) + self.shared_bytes
        e0 = b.experts[0]
        flops = moe_flops(b, tokens)
        hidden = self.router.shape[1]
        case = Case("moe", self.name, hidden, hidden, _same(b.linears, "bits"), _same(b.linears, "codebook"),
                    tokens, touched_bytes, floor_us(touched_bytes, ctx.copy_tbs), flops,
                    experts={"experts": len(b.experts), "top_k": b.routing.top_k, "touched": len(touched),
                             "intermediate": e0.gate.out_features,
                             "shared": b.shared_experts is not None})
        copies = self.copies_for(touched_bytes)
        impls = [(name, _bind_moe(make, self, x, copies, touched_bytes)) for name, make in MOE_IMPLEMENTATIONS.items()
                 if name not in OPTIONAL_PEERS or name in ctx.peers]
        return Setup(case, ref, impls)


def moe_flops(block: MoEBlock, tokens: int) -> int:
    """FLOPs of a MoE block at ``tokens``: each routed expert's three linears per route, the shared experts' per
    token (the router left out)."""
    e0 = block.experts[0]
    flops = tokens * block.routing.top_k * sum(linear_flops(1, i.in_features, i.out_features) for i in e0.linears)
    if block.shared_experts is not None:
        flops += sum(linear_flops(tokens, i.in_features, i.out_features) for i in block.shared_experts.linears)
    return flops


def _bind_moe(make, group, x, copies, nbytes):
    return lambda: make(group, x, copies, nbytes)


def _mlp_bytes(m: GatedMLP) -> int:
    return sum(exl3_weight_bytes(i.in_features, i.out_features, i.bits, i.has_bias) for i in m.linears)


def _moe_per_expert(g: MoEGroup, x, copies, nbytes):
    b = g.block
    sets = g.experts(copies)

    def call(c):
        s = sets[c]
        return blocks.moe_forward(x, g.router, b.routing, lambda e: s["experts"][e], shared=s["shared"],
                                  shared_gate=g.shared_gate, correction_bias=g.correction_bias,
                                  router_bias=g.router_bias)

    return Impl("per-expert", call, copies, nbytes, capturable=False,
                note="routing syncs with the host (one launch set per routed expert): not capturable in a graph")


def _moe_fused(g: MoEGroup, x, copies, nbytes):
    layers = g.fused_layers(copies)
    plans = [fused.plan_moe(d, x.shape[0], x.dtype) for d in layers]
    return Impl("fused", lambda c: fused.moe_forward(x, plans[c]), copies, nbytes,
                note=f"{plans[0].launches(x.shape[0])} launches per layer")


def _moe_exllamav3(g: MoEGroup, x, copies, nbytes):
    if g.peer_folder is None:
        return Impl("exllamav3", None, 0, nbytes, note="ExLlamaV3's MoE block is measured on --moe layers only")
    if x.dtype != torch.float16:
        return Impl("exllamav3", None, 0, nbytes, note="ExLlamaV3 takes float16 activations")
    while len(g._exllamav3) < copies:  # one model load per weight copy
        g._exllamav3.append(peers.exllamav3_moe(g.peer_folder, g.layer, g.ctx.device))
    models = g._exllamav3
    return Impl("exllamav3", lambda c: models[c][1](x), copies, nbytes)


def _moe_same_flops_gemm(g: MoEGroup, x, copies, nbytes):
    """Issue 8's yardstick at large M: the block's FLOPs as one dense fp16 GEMM in torch, [routes, hidden] @
    [hidden, N] (N = 3 x intermediate without shared experts) on random operands; not the block's output."""
    routes, hidden = x.shape[0] * g.block.routing.top_k, x.shape[1]
    n = max(1, round(moe_flops(g.block, x.shape[0]) / linear_flops(routes, hidden, 1)))
    gen = torch.Generator(device=x.device).manual_seed(g.ctx.seed)
    a = torch.randn(routes, hidden, generator=gen, device=x.device).to(x.dtype)
    w = torch.randn(hidden, n, generator=gen, device=x.device).to(x.dtype)
    return Impl(SAME_FLOPS_GEMM, lambda c: a @ w, 1, w.numel() * w.element_size(), checked=False,
                note=f"[{routes}, {hidden}] @ [{hidden}, {n}] {str(x.dtype).removeprefix('torch.')}: "
                     "the block's FLOPs in one torch GEMM (timed, not checked: not the block's output)")


SAME_FLOPS_GEMM = "fp16 GEMM, same FLOPs"
MOE_IMPLEMENTATIONS = {
    "per-expert": _moe_per_expert,  # exl3tool.ops.blocks.moe_forward: the dense kernels once per routed expert
    "fused": _moe_fused,  # exl3tool.ops.moe: routing, grouped decode GEMMs and the top-k sum on the GPU
    "exllamav3": _moe_exllamav3,  # its BlockSparseMLP
    SAME_FLOPS_GEMM: _moe_same_flops_gemm,  # the yardstick of issue 8's M=4096 target (1.5x its time)
}
