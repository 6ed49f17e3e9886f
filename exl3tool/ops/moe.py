"""The fused MoE layer on the GPU: routing, both grouped decode GEMMs and the top-k sum in 2 + 4*groups launches,
fewer where the GEMMs take over the steps around them (``MoEPlan.launches``: 1 + 2*groups at decode).

    DeviceMoE.from_layer(moe_layer, device)    the stacked expert groups as the kernels read them: zero-copy
                                               from ``load_prepared(..., device="cuda").moe(n)`` (or a source
                                               checkpoint's ``moe(n, device)``), but biases, copied into the
                                               rotation tables; shared experts become one more group of one
                                               expert that every token routes to
    plan_moe(dmoe, max_tokens, x_dtype=torch.float16, out_dtype=None) -> MoEPlan   scratch for up to max_tokens
    moe_forward(x, plan, out=None, topk_ids=None, topk_weights=None) -> y [M, hidden]

Per call (no host sync, no allocation; CUDA-graph capturable once each M was run eagerly, which compiles):
  1 route       logits (fp32), top-k per ``Routing`` (or the caller's ids/weights), routes packed by expert
  per expert group (one K and codebook):
  2 rotate      per packed route: H128(x * gate_suh), H128(x * up_suh) of its expert -> fp16 (one token: in
                the gate/up GEMM's prologue, into shared memory, no launch)
  3 gate/up     decode GEMM from w13 (split-K partials, fp32; fp16 for one split from many tokens:
                moe_configs.HALF_PARTIALS_MIN_TOKENS)
  4 intermediate  split sums, output rotations (+ biases), SiLU gate or gpt-oss's clamped SwiGLU, down input
                rotation -> fp16 (small route blocks and a short gate/up grid, e.g. decode: in that GEMM's last
                CTA per 128 columns, no launch)
  5 down        decode GEMM from w2 (split-K partials, as gate/up's); where block-ready counters hand gate/up's
                route blocks to it, one grid with gate/up (``kernels.moe_gemm_pair``: one launch for both GEMMs)
  6 top-k sum   per token: output rotation * down_svh (+ bias) of each route's expert, weighted, summed in slot order
                (one token: in the last down GEMM CTA per 128 columns, over every group's launch, no launch)
Each token's result depends only on its own routes (rows are computed independently, sums in fixed order), so
it does not depend on the rest of the batch for a given plan and M. Which of these steps launch, and each kernel's
config, ``exl3tool.ops.moe_configs`` plans (with its tuning knobs); this module allocates, compiles and launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from exl3tool.errors import UnsupportedFeatureError
from exl3tool.format import Codebook
from exl3tool.kernels.moe_gemm import MoEGemmConfig
from exl3tool.kernels.moe_rotate import GATE_ACTIVATIONS, SILU_GATING, Gating
from exl3tool.kernels.moe_route import MoERouteConfig
from exl3tool.kernels.trellis import x_row_halves
from exl3tool.ops import moe_configs
from exl3tool.ops import moe_kernels as K
from exl3tool.ops.launch import KERNEL_DTYPES, to_ffi
from exl3tool.ops.runtime import require_gpu, target_arch
from exl3tool.ops.workspace import counters


# Stand-ins in a planned launch's arguments for the call's own x and y.
X_ARG, Y_ARG = object(), object()


@dataclass
class DeviceExpertGroup:
    """One expert group as the kernels read it (views of the stacked tensors, no copies)."""

    experts: tuple[int, ...]  # global ids (the shared expert is id E)
    w13_bits: float
    w13_codebook: str
    w2_bits: float
    w2_codebook: str
    intermediate: int
    intermediate_padded: int
    w13: torch.Tensor  # int32 [2, E_g, H_p/16, I_p/16, 8K]
    w2: torch.Tensor  # int32 [1, E_g, I_p/16, H_p/16, 8K]
    gate_suh: torch.Tensor  # fp16 [E_g, H_p]
    up_suh: torch.Tensor
    rotations: torch.Tensor  # fp16 [E_g, gating.planes*I_p]: gate_svh | up_svh | down_suh (| gate bias | up bias)
    down_svh: torch.Tensor  # fp16 [E_g, H_p] (| down bias [E_g, H_p] where the layer's down_biased)
    gating: Gating = SILU_GATING
    group_row: torch.Tensor = None  # int32 [E']: row of each expert in this group, -1 elsewhere

    # the power of two that scales the largest |gate/up suh| into [1/2, 1]: the tensor-core input rotation's
    # exact fp16 split of x * suh (RouteInputRotationConfig.suh_shift), set at load time (one host sync)
    suh_shift: int = 0

    @property
    def suh_aligned(self) -> bool:
        """Both suh tables 16-byte aligned: the tensor-core input rotation's 16-byte suh loads need it."""
        return self.gate_suh.data_ptr() % 16 == 0 and self.up_suh.data_ptr() % 16 == 0

    @property
    def first_expert(self) -> int:
        """The first id where the group's experts are consecutive ids in order (row p is expert first + p: every
        routed expert of a one-group layer, or the shared expert), else -1 (``MoEGemmConfig.group_first``)."""
        first = self.experts[0]
        return first if self.experts == tuple(range(first, first + len(self.experts))) else -1


def suh_shift(gate_suh: torch.Tensor, up_suh: torch.Tensor) -> int:
    largest = max(gate_suh.abs().max().item(), up_suh.abs().max().item())
    return 0 if largest == 0 else min(15, max(-14, math.floor(-math.log2(largest))))


@dataclass
class DeviceMoE:
    name: str
    num_experts: int
    hidden: int
    hidden_padded: int
    route: MoERouteConfig  # without x_dtype (set per plan)
    router: torch.Tensor  # fp16 [E (+1 gate row), hidden]
    route_bias: torch.Tensor | None  # fp32 [E]: the correction bias (sigmoid) or the logits' bias (softmax)
    groups: list[DeviceExpertGroup]
    down_svh: torch.Tensor  # fp16 [rows, H_p]: every expert's down_svh (| its down bias where down_biased)
    svh_row: torch.Tensor  # int32 [E']: its row there
    down_biased: bool = False

    @property
    def device(self) -> torch.device:
        return self.router.device

    @classmethod
    def from_layer(cls, moe, device=None) -> "DeviceMoE":
        """From an ``exl3tool.reader.MoELayer`` (prepared folder or source checkpoint); tensors already on
        ``device`` are used in place."""
        device = require_gpu(device if device is not None else moe.router.device)
        r = moe.routing
        if r.method not in ("softmax_topk", "sigmoid_noaux_tc"):
            raise UnsupportedFeatureError(f"MoE routing {r.method!r} has no fused kernel", tensor=moe.name)
        if moe.hidden % 4:
            raise UnsupportedFeatureError(f"hidden size {moe.hidden} is not a multiple of 4", tensor=moe.name)
        if moe.router_bias is not None and r.method != "softmax_topk":
            raise UnsupportedFeatureError("a router bias on the logits of sigmoid routing has no fused kernel",
                                          tensor=moe.name)
        activation, limit = layer_activation(moe)
        on = lambda t, dtype=None: t.to(device=device, dtype=dtype or t.dtype).contiguous()  # noqa: E731
        down_biased = any(g.w2_bias is not None for g in moe.groups)
        groups = [_group(g, on, moe.name, activation, limit, down_biased) for g in moe.groups]
        shared = "none"
        router = on(moe.router, torch.float16)
        if moe.shared is not None:
            groups.append(_shared_group(moe.shared, moe.num_experts, on, moe.name, activation, limit, down_biased))
            if moe.shared_gate is not None:
                shared = "gated"
                router = torch.cat([router, on(moe.shared_gate, torch.float16).reshape(1, -1)])
            else:
                shared = "ungated"
        if not torch.equal(router[: moe.num_experts].float(), moe.router.to(device).float()):
            raise UnsupportedFeatureError("the router is not representable in fp16", tensor=moe.name)
        for g in groups:
            g.suh_shift = suh_shift(g.gate_suh, g.up_suh)
        packed = moe.num_experts + (shared != "none")
        row = 0
        svh_row = torch.empty(packed, dtype=torch.int32)
        for g in groups:
            table = torch.full((packed,), -1, dtype=torch.int32)
            for p, e in enumerate(g.experts):
                table[e] = p
                svh_row[e] = row + p
            g.group_row = table.to(device)
            row += len(g.experts)
        single = len(groups) == 1 and groups[0].experts == tuple(range(moe.num_experts))
        down_svh = groups[0].down_svh if single else torch.cat([g.down_svh for g in groups])
        cfg = MoERouteConfig(r.method, moe.num_experts, r.top_k, r.normalize, float(r.scale), r.n_group,
                             r.topk_group, moe.correction_bias is not None, moe.router_bias is not None, shared)
        bias = moe.correction_bias if moe.correction_bias is not None else moe.router_bias
        bias = None if bias is None else on(bias, torch.float32)
        return cls(moe.name, moe.num_experts, moe.hidden, moe.hidden_padded, cfg, router, bias, groups, down_svh,
                   svh_row.to(device), down_biased)


def layer_activation(moe) -> tuple[str, float]:
    """(activation, clamp limit or 0) of every expert of the layer (moe_rotate.Gating's), or
    UnsupportedFeatureError: one the kernels' Intermediate does not compute, or experts that differ."""
    mlps = (*moe.block.experts, *((moe.block.shared_experts,) if moe.block.shared_experts else ()))
    kinds = {(m.activation, float(m.activation_limit or 0.0)) for m in mlps}
    other = {a for a, _ in kinds} - set(GATE_ACTIVATIONS)
    if other:
        raise UnsupportedFeatureError(f"the fused MoE kernel gates with {' or '.join(GATE_ACTIVATIONS)}, not "
                                      f"{', '.join(sorted(other))}", tensor=moe.name)
    if len(kinds) > 1:
        raise UnsupportedFeatureError(f"the experts gate differently ({sorted(kinds)}): no fused kernel",
                                      tensor=moe.name)
    return next(iter(kinds))


def _check_group(name, what, w13_bits, w13_cb, w2_bits, w2_cb):
    for bits, cb in ((w13_bits, w13_cb), (w2_bits, w2_cb)):
        try:
            MoEGemmConfig(bits, Codebook(cb).value, 1)
        except ValueError as err:
            raise UnsupportedFeatureError(f"{what}: {err}", tensor=name) from None


def _down_table(svh: torch.Tensor, bias: torch.Tensor | None, down_biased: bool) -> torch.Tensor:
    """A group's rows of the down_svh table: ``svh`` [E_g, H_p], and where the layer's experts have down biases
    (``down_biased``) beside it the group's biases, zeros for a group without them (TopKSumConfig.biased)."""
    if not down_biased:
        return svh
    return torch.cat([svh, torch.zeros_like(svh) if bias is None else bias], dim=1)


def _group(g, on, name, activation: str, limit: float, down_biased: bool) -> DeviceExpertGroup:
    """One expert group as stacked (zero-copy), but for biases: gate/up's join the rotations table and down's the
    down_svh table (moe_rotate.Gating / TopKSumConfig.biased; copies of E_g x 2 vectors, made once here)."""
    _check_group(name, "experts", g.w13_bits, g.w13_codebook, g.w2_bits, g.w2_codebook)
    w2 = on(g.w2)
    rotations = on(g.intermediate_rotations)
    if g.w13_bias is not None:
        rotations = torch.cat([rotations, on(g.w13_bias[0]), on(g.w13_bias[1])], dim=1)
    down_svh = _down_table(on(g.down_svh), None if g.w2_bias is None else on(g.w2_bias), down_biased)
    return DeviceExpertGroup(
        tuple(g.experts), g.w13_bits, Codebook(g.w13_codebook).value, g.w2_bits, Codebook(g.w2_codebook).value,
        g.intermediate, g.intermediate_padded, K.as_words(on(g.w13)), K.as_words(w2).unsqueeze(0),
        on(g.gate_suh), on(g.up_suh), rotations, down_svh, Gating(activation, limit, g.w13_bias is not None))


def _shared_group(mlp, expert_id: int, on, name, activation: str, limit: float,
                  down_biased: bool) -> DeviceExpertGroup:
    """The shared experts (one dense gated MLP) as a group of one expert: stacked once at plan time."""
    gate, up, down = mlp.gate, mlp.up, mlp.down
    if (gate.info.bits, gate.info.codebook) != (up.info.bits, up.info.codebook):
        raise UnsupportedFeatureError("shared expert gate and up differ in K or codebook", tensor=name)
    if any(t.bias is not None for t in (gate, up, down)):
        raise UnsupportedFeatureError("shared experts with biases have no fused kernel", tensor=name)
    _check_group(name, "shared experts", gate.info.bits, gate.info.codebook, down.info.bits, down.info.codebook)
    w13 = torch.stack([on(gate.trellis), on(up.trellis)]).unsqueeze(1)
    rotations = torch.cat([on(gate.svh), on(up.svh), on(down.suh)]).unsqueeze(0)
    down_svh = _down_table(on(down.svh).unsqueeze(0), None, down_biased)
    return DeviceExpertGroup(
        (expert_id,), gate.info.bits, Codebook(gate.info.codebook).value, down.info.bits,
        Codebook(down.info.codebook).value, gate.info.out_features, gate.info.out_padded,
        K.as_words(w13.contiguous()), K.as_words(on(down.trellis)).unsqueeze(0).unsqueeze(0),
        on(gate.suh).unsqueeze(0), on(up.suh).unsqueeze(0), rotations.contiguous(), down_svh.contiguous(),
        Gating(activation, limit))


@dataclass
class _Step:
    shape: moe_configs.StepShape
    launches: list = field(default_factory=list)  # (launcher, compiled fn, args) run in order
    y: torch.Tensor | None = None


class MoEPlan:
    """Scratch for up to ``max_tokens`` tokens, allocated once; per M the configs, compiled kernels and views."""

    def __init__(self, dmoe: DeviceMoE, max_tokens: int, x_dtype=torch.float16, out_dtype=None):
        self.dmoe, self.max_tokens = dmoe, max_tokens
        self.x_dtype, self.out_dtype = x_dtype, out_dtype or x_dtype
        device = dmoe.device
        self.arch = target_arch(device)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        cfg = dmoe.route
        k, e_r = cfg.routes_per_token, cfg.router_rows
        shapes = [moe_configs.step_shape(dmoe, m, self.sm_count, self.arch) for m in range(1, max_tokens + 1)]
        h_p = dmoe.hidden_padded
        i_p = max(g.intermediate_padded for g in dmoe.groups)
        rows = max(s.rows for s in shapes)
        new = lambda n, dtype: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
        self.logits = new(max_tokens * e_r, torch.float32)
        self.ids = new(max_tokens * k, torch.int32)
        self.weights = new(max_tokens * k, torch.float32)
        self.rank = new(max_tokens * k, torch.int32)
        # arrival counters (one per route token block, one for the last block) and per-expert counts: kept at zero
        token_blocks = max(math.ceil(m / moe_configs.tiles_for(m)["token_tile"]) for m in range(1, max_tokens + 1))
        self.counters = torch.zeros(token_blocks + 1, dtype=torch.int32, device=device)
        self.counts = torch.zeros(cfg.packed_experts, dtype=torch.int32, device=device)
        self.expert_row = new(cfg.packed_experts, torch.int32)
        self.block_expert = new(max(s.blocks for s in shapes), torch.int32)
        self.row_route = new(rows, torch.int32)
        self.route_row = new(max_tokens * k, torch.int32)
        # X and X2 rows are twice as wide where a step's GEMM reads them doubled (split halves)
        x_halves = x2_halves = 0
        for s in shapes:
            for g in dmoe.groups:
                order13, order2 = moe_configs.group_x_orders(self.arch, g, s)
                x_halves = max(x_halves, 2 * s.rows * x_row_halves(h_p, order13))
                x2_halves = max(x2_halves, s.rows * x_row_halves(i_p, order2))
        self.xr = new(x_halves, torch.float16)
        self.p13 = new(max(s.splits13 * s.rows for s in shapes) * 2 * i_p, torch.float32)
        self.x2 = new(x2_halves, torch.float16)
        self.p2 = new(max(s.splits2 * s.rows for s in shapes) * h_p, torch.float32)
        self.y = new(max_tokens * dmoe.hidden, self.out_dtype)
        self.dummy_i32 = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self.dummy_f32 = torch.zeros(1, 1, dtype=torch.float32, device=device)
        self._steps: dict[tuple[int, bool], _Step] = {}

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.logits, self.ids, self.weights, self.rank,
                                                          self.expert_row, self.block_expert, self.row_route,
                                                          self.route_row, self.xr, self.p13, self.x2, self.p2,
                                                          self.y))

    def launches(self, tokens: int, given: bool = False) -> int:
        """Kernel launches of one call with ``tokens`` tokens (``given``: the caller's topk_ids)."""
        return len(self.configs(tokens, given).kernels())

    def configs(self, tokens: int, given: bool) -> moe_configs.StepConfigs:
        """What a call with ``tokens`` tokens compiles and launches here (``step_configs``)."""
        return moe_configs.step_configs(self.dmoe, tokens, given, self.arch, self.sm_count, KERNEL_DTYPES[self.x_dtype],
                            KERNEL_DTYPES[self.out_dtype])

    def step(self, tokens: int, given: bool) -> _Step:
        key = (tokens, given)
        if key not in self._steps:
            self._steps[key] = self._make_step(tokens, given)
        return self._steps[key]

    def _make_step(self, tokens: int, given: bool) -> _Step:
        d, arch = self.dmoe, self.arch
        c = self.configs(tokens, given)
        s = c.shape
        k, e_r, h_p, rows = d.route.routes_per_token, d.route.router_rows, d.hidden_padded, s.rows
        step = _Step(s)
        logits = self.logits[: tokens * e_r].view(tokens, e_r)
        ids = self.ids[: tokens * k].view(tokens, k)
        weights = self.weights[: tokens * k].view(tokens, k)
        block_expert = self.block_expert[: s.blocks]
        row_route = self.row_route[:rows]
        route_row = self.route_row[: tokens * k]
        rank = self.rank[: tokens * k]
        step.y = self.y[: tokens * d.hidden].view(tokens, d.hidden)
        bias = d.route_bias if d.route_bias is not None else self.dummy_f32.view(1)
        step.route = (K.compiled(c.route, arch), *map(to_ffi, (d.router, bias, self.dummy_i32, self.dummy_f32,
                                                                logits, ids, weights, rank, self.counters,
                                                                self.counts, self.expert_row, block_expert,
                                                                row_route)))
        p2 = partials_view(self.p2, c.groups[0].down.partials, (s.splits2, rows, h_p))
        col_blocks = h_p // 128
        # the top-k sum's counters first: the same ones for every group's down GEMM (their CTAs all count in)
        (topk_counter,) = counters.views(d.device, ((col_blocks,), torch.int32))
        for g, gc in zip(d.groups, c.groups):
            i_p = g.intermediate_padded
            hx, ix = x_row_halves(h_p, gc.order13), x_row_halves(i_p, gc.order2)
            xr = self.xr[: 2 * rows * hx].view(2, rows, hx)
            p13 = partials_view(self.p13, gc.gate_up.partials, (s.splits13, rows, 2 * i_p))
            x2 = self.x2[: rows * ix].view(rows, ix)
            g13, g2, resident = gc.gate_up, gc.down, gc.gate_up.input is not None
            # launch_gemm's arguments: x (X_ARG: the call's own x) or the rotated X, the fused intermediate's tail
            # (row_route also when the GEMM reads or writes it), the prologue's suh rows and route indices
            tail = (None, None, row_route if g13.takes_row_route else None, None, 0)
            if s.fused_intermediate:
                # the (block, 128 columns of I) arrival counters, then with ready_counters one per block
                _, counter = counters.views(d.device, ((col_blocks,), torch.int32),
                                            ((s.blocks * (i_p // 128 + s.ready_counters),), torch.int32))
                tail = (g.rotations, x2, row_route, counter, g.intermediate)
            ranks = rank if g13.resident_rows > 1 or g13.writes_routes else None
            prologue = (g.gate_suh, g.up_suh, ids, route_row, ranks) if resident else ()
            gate_up = (X_ARG if resident else K.as_words(xr), g.w13, p13, block_expert, g.group_row, gc.per13,
                       *tail, *prologue)
            if g13.route is not None:  # svh .. sum_counters (weights where it writes the routes), logits, bias
                gate_up += (None, None, weights if g13.writes_routes else None, None, None, logits, bias)
            if gc.rotation is not None:
                step.launches.append((K.launch_input_rotation, K.compiled(gc.rotation, arch),
                                      (X_ARG, g.gate_suh, g.up_suh, xr, ids, rank, self.expert_row, g.group_row,
                                       row_route, route_row)))
            down = (K.as_words(x2).unsqueeze(0), g.w2, p2, block_expert, g.group_row, gc.per2,
                    None, None, row_route if g2.takes_row_route else None, counter if g2.ready_wait else None, 0)
            if gc.pair is not None:  # both GEMMs in one grid: gate/up's arguments, then down's own
                step.launches.append((K.launch_gemm_pair, K.compiled(gc.pair, arch),
                                      (*gate_up[:3], *down[:3], block_expert, g.group_row, gc.per13, gc.per2,
                                       g.rotations, x2, row_route, counter, g.intermediate)))
                continue
            step.launches.append((K.launch_gemm, K.compiled(g13, arch), gate_up))
            if gc.intermediate is not None:
                step.launches.append((K.launch_intermediate, K.compiled(gc.intermediate, arch),
                                      (p13, g.rotations, x2, row_route, block_expert, g.group_row, ids, route_row,
                                       g.intermediate, s.block_rows)))
            if g2.topk_sum is not None:  # the sum's arguments: ids, route_row, down_svh, svh_row, weights, y, counters
                down += (None, None, ids, route_row, None, d.down_svh, d.svh_row, weights, Y_ARG, topk_counter)
            step.launches.append((K.launch_gemm, K.compiled(g2, arch), down))
        if c.topk is not None:
            step.launches.append((K.launch_topk_sum, K.compiled(c.topk, arch), (p2, d.down_svh, d.svh_row, ids,
                                                                                weights, route_row, Y_ARG)))
        step.launches = [(launch, fn, persistent(args)) for launch, fn, args in step.launches]
        return step


def partials_view(buffer: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A GEMM's partials ``shape`` in ``dtype`` (MoEGemmConfig.partials) at the start of the fp32 scratch
    ``buffer``, sized for fp32 ones."""
    flat = buffer.view(torch.float16) if dtype == "float16" else buffer
    return flat[: math.prod(shape)].view(shape)


def persistent(args: tuple) -> tuple:
    """A planned launch's arguments with its tensors handed to TVM FFI once, as the dense launchers do
    (``launch.to_ffi``), but one: the call's x or y where it takes one, else its first tensor, stays a torch
    tensor, from which TVM FFI takes torch's current stream (graph capture included)."""
    keep = None if any(a is X_ARG or a is Y_ARG for a in args) else next(
        i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    return tuple(to_ffi(a) if isinstance(a, torch.Tensor) and i != keep else a for i, a in enumerate(args))


def plan_moe(dmoe: DeviceMoE, max_tokens: int, x_dtype=torch.float16, out_dtype=None) -> MoEPlan:
    return MoEPlan(dmoe, max_tokens, x_dtype, out_dtype)


def moe_forward(x: torch.Tensor, plan: MoEPlan, out: torch.Tensor | None = None,
                topk_ids: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, hidden] (plan.out_dtype) of the MoE layer for x [M, hidden] (plan.x_dtype, contiguous). Without
    ``out`` the result is a view of the plan's own buffer, overwritten by the next call. ``topk_ids`` int32 /
    ``topk_weights`` fp32 [M, top_k] replace the router's choice (the shared experts still run)."""
    d = plan.dmoe
    tokens = x.shape[0]
    if x.dim() != 2 or x.shape[1] != d.hidden or x.dtype != plan.x_dtype or not x.is_contiguous():
        raise ValueError(f"{d.name}: x must be a contiguous {plan.x_dtype} [M, {d.hidden}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if not 1 <= tokens <= plan.max_tokens:
        raise ValueError(f"{d.name}: {tokens} tokens; this plan takes 1..{plan.max_tokens}")
    given = topk_ids is not None
    step = plan.step(tokens, given)
    fn, router, bias, no_ids, no_weights, *scratch = step.route
    gi, gw = (topk_ids, topk_weights) if given else (no_ids, no_weights)
    K.launch_route(fn, x, router, bias, gi, gw, *scratch, step.shape.block_rows)
    y = step.y if out is None else out
    for launch, fn, args in step.launches:
        launch(fn, *[x if a is X_ARG else y if a is Y_ARG else a for a in args])
    return y


def routes(plan: MoEPlan, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32, topk_weights fp32) [M, k'] of the last call with M tokens (views of the plan's scratch;
    column k is the shared expert when there is one)."""
    k = plan.dmoe.route.routes_per_token
    return plan.ids[: tokens * k].view(tokens, k), plan.weights[: tokens * k].view(tokens, k)
