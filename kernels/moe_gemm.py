"""Grouped decode GEMM of the fused MoE layer: ``P[s, r, plane*N_p + n] = X[plane, r] @ W_hat[plane, expert(r)]``.

Rows ``r`` are routes packed by expert (``moe_route``): block ``b`` holds rows ``b*T .. b*T+T-1`` (T = tokens per
CTA), all of one expert ``block_expert[b]`` (-1: an unused block). One launch serves one expert group (one K and
codebook): ``group_row[e]`` is expert e's row in the group's stacked tensors, -1 for experts of other groups,
whose blocks this launch skips (with ``group_first``, a group of consecutive ids, the row is the expert minus
that first id, and the table is not read). ``planes`` = 2 for gate/up (``w13 [2, E, H_p/16, I_p/16, 16K]``, each
plane with its own rotated input) and 1 for down (``w2 [E, I_p/16, H_p/16, 16K]`` viewed with a leading plane
dim). A CTA's ``warps`` tile columns never straddle the planes (N_p/16 is a multiple of 8). The main loop is the
dense GEMM's (``mainloop.decode_mma_loop``); K splits write fp32 partials that the next kernel sums in split order
(one split may write them in fp16: ``partials``).

With ``intermediate_splits`` (gate/up, small route blocks) the GEMM also does the ``Intermediate`` kernel's work
(as ``gating`` says), saving its launch: every CTA counts in at its (route block, 128-column block of I) once its
partials are written (both planes, every split: ``2 * 128/(16*warps) * splits`` arrivals, ``ptx.count_in``), and
the last one sums the splits in order and writes X2 for the block's rows (``moe_rotate.intermediate_row``, the same
code, so X2 is bit-identical; with ``tail_row_pairs`` a warp's rows two at a time, a row a half-warp), then resets
the counter for the next launch.

With ``topk_sum`` (down at M = 1, routes chosen by the router: one per block, in its first row) the GEMM also
does the ``TopKSum`` kernel's work: every CTA counts in at its 128-column block of the hidden dim (each route's
block, split and the CTAs of its columns: ``k' * 128/(16*warps) * splits`` arrivals over every group's launch,
which share the counter), and the last one sums the token's slot terms for those columns in slot order
(``moe_rotate.topk_sum_block``, the same code) into y, then resets the counter.

With ``input`` (gate/up at M = 1, router-chosen distinct experts: each block's one route sits in its first row) X
is x itself: each CTA rotates the token's x with its expert's gate or up suh into shared memory while its first
weight stages load (``rotate_expert_input``, the dense GEMM's M = 1 prologue), so no RouteInputRotation runs; the
first CTA of each block writes that route's ``route_row`` / ``row_route`` in its place. With ``resident_rows`` > 1
(a few tokens: an expert's routes, one a token, all in its one block, each in the row of its rank) each CTA first
finds its block's routes from the route ranks (``find_block_routes``) and rotates each one's token into a row of
its own. With ``route`` (one token behind a route kernel that wrote only the logits) warp 0 of each CTA chooses the
token's routes itself (``MoERoute.choose``) and takes slot ``blk``'s expert; with ``writes_routes`` CTA (0, 0, 0)
also writes topk_ids / topk_weights / the ranks and releases ``block_expert``, which the down GEMM's CTAs await
with acquire loads (``awaits_block_expert``) before their weight copies.

With ``skip_padding_tail`` (warpgroup MMAs over 320-row blocks: N = 256 + 64 a k-tile) a block whose row 256 is
padding (``row_route`` -1; a block's routes are its first rows) runs a second copy of the main loop without the
N = 64 MMAs, and skips the partials of rows 256 .., which nothing reads.

With ``group_loops`` (mma.sync blocks of several token groups) the main loop is compiled once for each listed count
of token groups, and a block runs the first that covers its groups holding routes (counted from ``row_route`` after
the PDL wait), storing only their partials: padding rows cost no MMAs.

With ``weights_before_wait`` (down, behind a gate/up GEMM with ``next_after_loop``: each of its CTAs lets this
launch go once its partials are written; gate/up from 16 tokens on, behind an input rotation with ``early_next``)
a CTA reads its block's expert and issues its first weight stage before its PDL wait, and X's after it: the
weights stream in during the kernel before. That kernel waited for the route kernel before it let this one launch,
so the block's expert and every kernel before are done. Every CTA waits, also one of an unused block, so that this
kernel ends after the one before it.

A CTA's work is ``MoEGemm.body`` at its block indices, which ``moe_gemm_pair`` also runs for both GEMMs in one grid.

Arguments: X int32 ``[planes, R, K_p/2]``, W int32 ``[planes, E_g, K_p/16, N_p/16, 8K]``, P fp32 (or fp16)
``[splits, R, planes*N_p]``, block_expert int32 ``[blocks]``, group_row int32 ``[experts]``; with the fused
intermediate also the group's rotations fp16 ``[E_g, 3*I_p]``, X2 fp16 ``[R, I_p]``, row_route int32 ``[R]``,
counters int32 ``[blocks * I_p/128]`` (zero) and the true intermediate size.
"""

from dataclasses import dataclass
from functools import cached_property

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import ptx
from .gemm import GemmConfig, check_smem
from .mainloop import WGMMA_MAX_GROUPS, DecodeGemmKernel, acc_groups, allocate_smem, decode_mma_loop
from .moe_route import MoERoute, MoERouteConfig
from .moe_rotate import (
    PARTIALS_DTYPES,
    SILU_GATING,
    Gating,
    TopKSumConfig,
    check_launch_fields,
    group_row_of,
    intermediate_row,
    topk_sum_block,
)
from .rotate import rotate_into_shared, rotate_loaded_into_shared, rotation_loads


def fuses_intermediate(rows: int, warps: int, warp_cols: int) -> bool:
    """Can a gate/up route block of ``rows`` take the fused intermediate? Its tail needs private decode (one tile
    column a warp), at most 8 warps, and whole rows a warp."""
    return warp_cols == 1 and warps <= 8 and rows % warps == 0


@dataclass(frozen=True)
class MoEGemmConfig:
    bits: float
    codebook: str
    planes: int  # 2: gate/up from w13, 1: down from w2
    token_groups: int = 1  # 8 packed rows each: the route block of the layer
    warps: int = 4
    k_tiles_per_stage: int = 8
    stages: int = 2
    warp_cols: int = 1  # shared decode (mainloop) when > 1
    # Gate/up only: > 0 = the GEMM finishes the intermediate itself (``moe_rotate.intermediate_row``) in the last
    # CTA to arrive at each (route block, 128-column block), instead of an ``Intermediate`` launch; the value is
    # the launch's K split count (a compile-time constant, like ``IntermediateConfig.splits``).
    intermediate_splits: int = 0
    # Gate/up at a few tokens only (x's dtype, "float16" or "bfloat16"): the GEMM rotates the x of its route
    # block's tokens with its expert's gate or up suh into shared memory itself (mainloop ``input``; no
    # RouteInputRotation launch), the router's routes each in its own row (distinct experts a token: an expert's
    # routes fit one block); ``resident_k_tiles`` = the K split's k-tiles, ``resident_rows`` = the tokens (M = 1:
    # a block's one route in its first row).
    input: str | None = None
    resident_k_tiles: int = 0
    resident_rows: int = 1
    split_halves: bool = False  # one token group, mcg/3inst: each weight's two fp16 halves to two MMAs (mainloop)
    # Down at M = 1 only (router-chosen routes: each route alone in its block, in its first row): the GEMM also does
    # the ``TopKSum`` launch's work for the token in the last CTA to arrive at each 128-column block (all routes,
    # splits and groups: the counter spans every group's launch); ``topk_sum`` is that launch's config.
    topk_sum: TopKSumConfig | None = None
    # X's column order, as GemmConfig.x_order: what the route input rotation (or the intermediate, for the down
    # GEMM) writes (rotate.store_x_values); x2_order: the fused intermediate's X2 (the down GEMM's x_order)
    x_order: str = "rows"
    x2_order: str = "rows"
    mma: str = "sync"  # GemmConfig.mma: "wgmma" (sm_90a) for the large route blocks
    mbarriers: bool = False  # GemmConfig.mbarriers
    # Warpgroup MMAs over more than 256 rows: a block whose row 256 is padding (row_route -1; a block's routes
    # are its first rows) skips the MMAs and the partials' stores of rows 256 .. (nothing reads padding rows).
    skip_padding_tail: bool = False
    # mma.sync with private decode over more than one token group: the main loop is compiled for each of these
    # ascending token-group counts (the last: token_groups), and a block runs the first that covers its groups that
    # hold routes (row_route of a group's first row >= 0; a block's routes are its first rows), storing only those
    # groups' partials (nothing reads padding rows). Empty: every block multiplies every group.
    group_loops: tuple[int, ...] = ()
    # PDL, for the GEMM before one with ``weights_before_wait``: each CTA lets the next kernel launch once its
    # partials are written (before the fused tail), so that one's CTAs load their weights during that tail.
    next_after_loop: bool = False
    # PDL: the CTA reads its route block's expert and issues the weight copies of its first stages before it waits
    # for the kernel before (``mainloop``'s ``wait``). Only where that kernel waited for the route kernel before it
    # let this one launch (it waits first, and triggers no earlier than that): then every kernel that wrote the
    # block's expert or the weights has finished.
    weights_before_wait: bool = False
    # >= 0: the group's experts are ids group_first .. group_first + E_g - 1 in order (one group of every routed
    # expert, or the shared expert's), so a block's row in the group is its expert minus this, with no group_row
    # lookup between the block's expert and its first weight copies.
    group_first: int = -1
    # With ``input`` at one row: the prologue's loads of x and suh go out before the CTA's weight copies
    # (``rotation_loads``), not behind them: in the trace that prologue ended 1.1-6.5 us (median 2.0) after the PDL
    # wait at M=1, an L2 prefetch of its suh lines changed nothing, and the loop after it is issue-bound.
    early_prologue_loads: bool = False
    rolled: bool = False  # wgmma: one stage a main-loop iteration (GemmConfig.rolled)
    # Block-ready counters instead of the grid-wide PDL wait between gate/up and down (mma.sync route blocks):
    # gate/up with the fused intermediate lets the down GEMM launch as each CTA starts and counts each
    # (route block, 128-column block of I) in at the block's ready counter once its X2 is written
    # (``ready_signal``); each down CTA issues its first weight stages, waits for its block's count, counts itself
    # out (the last one resets it) and waits for the kernel before only at its end, so down's CTAs fill the SMs
    # that gate/up's last CTAs leave idle (``ready_wait``). The counters follow the fused intermediate's in
    # ``counter``: ``[blocks * I_p/128 + blocks]``.
    ready_signal: bool = False
    ready_wait: bool = False
    # ready_wait: each down CTA counts itself out behind its first X copies (the main loop's prologue), not between
    # its wait's barriers, so that the atomic's round trip overlaps the copies' instead of holding every warp.
    count_out_behind_x: bool = False
    # K splits in the grid's x with the columns (x = column tile * splits + split), not in its z: a route block's
    # CTAs of every split are dispatched together, so that its last split, which its fused tail and the down GEMM
    # behind it wait for, does not wait for every other block's earlier splits to be dispatched first.
    splits_in_x: bool = False
    # > 0: launch bounds asking ptxas for this many CTAs an SM (registers at most 64K / (this x threads)); 0: none.
    min_ctas_per_sm: int = 0
    # P's dtype (PARTIALS_DTYPES): "float16" halves the bytes of P's stores and of the reads that sum them (the
    # Intermediate / TopKSum launches or the fused tails); only for a launch of one K split (a split's fp16 would
    # be rounded before the sum: the planner's rule, ``moe_configs.partials_dtype``).
    partials: str = "float32"
    # The fused intermediate's gating (moe_rotate.Gating: the activation, its clamp, gate/up biases in mRot).
    gating: Gating = SILU_GATING
    # The fused intermediate two rows a warp at a time (``intermediate_row``'s row pairs: 8 values a lane, a row a
    # half-warp; the same bits), where a warp has an even number of the block's rows.
    tail_row_pairs: bool = False
    # Bytes of shared memory a CTA holds and never touches (a multiple of 16): fewer CTAs fit an SM, so that a grid
    # launched beside another kernel's last CTAs spreads over more SMs (moe_configs.spread_pad).
    smem_pad: int = 0
    # Gate/up with ``input`` at one token with slot blocks, behind a route kernel that wrote only the logits
    # (MoERouteConfig.logits_only): the CTA chooses its block's expert itself from the logits (``MoERoute.choose``,
    # the route kernel's own selection: block j is slot j's) instead of reading block_expert.
    route: MoERouteConfig | None = None
    # With ``route``, gate/up of the first group: its CTA (0, 0, 0) also writes the token's topk_ids, topk_weights
    # and ranks, and releases block_expert (which that route kernel set to -1), as the route kernel does.
    writes_routes: bool = False
    # Down with ``topk_sum`` behind those: the CTA reads its block's expert with acquire loads until that gate/up
    # GEMM has written it (-1 before; written in its prologue, long before this kernel launches), so that with
    # ``weights_before_wait`` its weight copies still go out before its PDL wait.
    awaits_block_expert: bool = False

    def __post_init__(self):
        if self.planes not in (1, 2):
            raise ValueError("planes must be 1 (w2) or 2 (w13)")
        if self.partials not in PARTIALS_DTYPES:
            raise ValueError(f"partials must be one of {PARTIALS_DTYPES}")
        check_launch_fields(self)
        if self.intermediate_splits and (self.planes != 2
                                         or not fuses_intermediate(self.tokens_per_cta, self.warps, self.warp_cols)):
            raise ValueError("the fused intermediate is for gate/up with private decode, rows a multiple of warps")
        if self.tail_row_pairs and (not self.intermediate_splits or self.tail_rows_per_warp % 2):
            raise ValueError("tail_row_pairs is for the fused intermediate with an even number of rows a warp")
        if self.route is not None and not (self.route.logits_only and self.input is not None
                                           and self.resident_rows == 1):
            raise ValueError("route is for the one-token gate/up GEMM (a row of x) behind logits_only")
        if self.writes_routes and self.route is None:
            raise ValueError("writes_routes is for the gate/up GEMM that chooses its route")
        if self.awaits_block_expert and self.topk_sum is None:
            raise ValueError("awaits_block_expert is for the one-token down GEMM (the fused top-k sum)")
        if self.smem_pad % 16 or self.smem_pad < 0:
            raise ValueError("smem_pad must be a non-negative multiple of 16 bytes")
        if self.gating != SILU_GATING and not self.intermediate_splits:
            raise ValueError("gating is the fused intermediate's (intermediate_splits > 0)")
        if self.input is not None and self.planes != 2:
            raise ValueError("only the gate/up GEMM rotates its own input")
        if self.topk_sum is not None and (self.planes != 1 or self.token_groups != 1 or self.warp_cols != 1
                                          or self.topk_sum.blocks_per_cta != 1):
            raise ValueError("the fused top-k sum is for the down GEMM at one token (8-row blocks)")
        if self.mma == "wgmma" and (self.input is not None or self.topk_sum is not None):
            raise ValueError("the M = 1 prologue and the fused top-k sum are for mma.sync's one-row blocks")
        if self.early_prologue_loads and (self.input is None or self.resident_rows != 1):
            raise ValueError("early_prologue_loads is for the gate/up GEMM that rotates one row of x itself")
        if self.weights_before_wait and (self.input is not None or self.mma != "sync"):
            raise ValueError("weights_before_wait is for mma.sync GEMMs with X staged")
        if self.ready_signal and (not self.intermediate_splits or self.next_after_loop):
            raise ValueError("ready_signal is for gate/up with the fused intermediate (and no next_after_loop)")
        if self.ready_wait and (self.planes != 1 or self.mma != "sync" or self.weights_before_wait):
            raise ValueError("ready_wait is for the mma.sync down GEMM (its weights wait with its X)")
        if self.count_out_behind_x and not self.ready_wait:
            raise ValueError("count_out_behind_x is ready_wait's")
        if self.group_loops and (self.mma != "sync" or self.warp_cols != 1 or self.token_groups < 2
                                 or self.input is not None or self.group_loops[-1] != self.token_groups
                                 or list(self.group_loops) != sorted(set(self.group_loops)) or self.group_loops[0] < 1):
            raise ValueError("group_loops: ascending token-group counts up to token_groups, for mma.sync with private "
                             "decode over more than one token group")
        self.mainloop  # validates the rest, including the shared-memory limit
        if self.skip_padding_tail and (self.mma != "wgmma" or self.token_groups <= WGMMA_MAX_GROUPS or self.input):
            raise ValueError("skip_padding_tail takes warpgroup MMAs over more than 256 packed rows")
        check_smem(self, self.smem_bytes, self.mma)

    @cached_property
    def mainloop(self) -> GemmConfig:
        return GemmConfig(bits=self.bits, codebook=self.codebook, token_groups=self.token_groups, warps=self.warps,
                          k_tiles_per_stage=self.k_tiles_per_stage, stages=self.stages, warp_cols=self.warp_cols,
                          input=self.input, resident_k_tiles=self.resident_k_tiles, resident_rows=self.resident_rows,
                          split_halves=self.split_halves,
                          x_order=self.resident_order if self.input is not None else self.x_order, mma=self.mma,
                          mbarriers=self.mbarriers, rolled=self.rolled)

    @property
    def resident_order(self) -> str:
        """Column order of the M = 1 prologue's resident row: doubled for split halves (no HADD2 per B word in the
        loop), else ``x_order``."""
        return "doubled" if self.split_halves else self.x_order

    @property
    def takes_row_route(self) -> bool:
        """Does the kernel take row_route (the route of each packed row, -1 for padding)?"""
        return bool(self.intermediate_splits or self.input is not None or self.skip_padding_tail
                    or self.group_loops)

    @property
    def tokens_per_cta(self) -> int:
        return 8 * self.token_groups

    @property
    def tail_rows_per_warp(self) -> int:
        """Rows of the route block each warp of the fused intermediate takes (one, at one resident row)."""
        return 1 if self.input is not None and self.resident_rows == 1 else self.tokens_per_cta // self.warps

    @property
    def term_words(self) -> int:
        """The fused top-k sum's slot terms (fp32, k' x 128): in the weight stages, idle after the main loop."""
        return 0 if self.topk_sum is None else self.topk_sum.routes_per_token * 128

    @property
    def extra_term_words(self) -> int:
        """Term words that need their own shared memory: all of them where the weight stages are smaller."""
        main = self.mainloop
        return self.term_words if self.term_words > main.stages * main.w_stage_words else 0

    @property
    def smem_bytes(self) -> int:
        routes = 4 * self.tokens_per_cta if self.resident_rows > 1 else 0  # sRoute: each row's route
        return self.mainloop.smem_bytes + 4 * self.extra_term_words + routes + self.smem_pad


class MoEGemm(DecodeGemmKernel):
    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mP: cute.Tensor,
        mBlockExpert: cute.Tensor,
        mGroupRow: cute.Tensor,
        k_tiles_per_split: Int32,
        mRot,
        mX2,
        mRowRoute,
        mCounter,
        inter_true: Int32,
        mGateSuh,
        mUpSuh,
        mIds,
        mRouteRow,
        mRank,
        mSvh,
        mSvhRow,
        mWeights,
        mY,
        mSumCounter,
        mLogits,
        mBias,
        stream: cuda.CUstream,
    ):
        """mRot .. inter_true: None (and 0) without the fused intermediate; mGateSuh, mUpSuh: None unless the GEMM
        rotates its own input (then mX is x itself ``[M, hidden]``); mSvh .. mY: None without the fused top-k sum
        (``TopKSum``'s down_svh, svh_row, topk_weights, y); mIds, mRouteRow: for either, else None; mRank: the
        route ranks with resident rows, else None. mCounter: the fused intermediate's arrival counters (one per
        route block and 128 columns) and the blocks' ready counters after them, else None; mSumCounter: the fused
        top-k sum's (one per 128 columns), else None. mLogits ``[1, E_r]`` fp32, mBias (the router's bias, or any
        fp32 tensor): with ``route``, else None; mWeights and mRank also where the GEMM writes the routes."""
        args = gemm_arguments(mX, mW, mP, mBlockExpert, mGroupRow, k_tiles_per_split, mRot, mX2, mRowRoute, mCounter,
                              inter_true, mGateSuh, mUpSuh, mIds, mRouteRow, mRank, mSvh, mSvhRow, mWeights, mY,
                              mSumCounter, mLogits, mBias)
        columns = column_tiles(self.cfg, mW)
        grid = (columns, mBlockExpert.shape[0], mP.shape[0])
        if cutlass.const_expr(self.cfg.splits_in_x):
            grid = (columns * mP.shape[0], mBlockExpert.shape[0], 1)
        self.kernel(*args).launch(
            grid=grid, block=(self.threads, 1, 1), stream=stream, **ptx.pdl_launch(),
            **ptx.occupancy_bounds(self.cfg.min_ctas_per_sm))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mP: cute.Tensor, mBlockExpert: cute.Tensor,
               mGroupRow: cute.Tensor, k_tiles_per_split: Int32, mRot: cute.Tensor, mX2: cute.Tensor,
               mRowRoute: cute.Tensor, mCounter: cute.Tensor, inter_true: Int32, mGateSuh: cute.Tensor,
               mUpSuh: cute.Tensor, mIds: cute.Tensor, mRouteRow: cute.Tensor, mRank: cute.Tensor,
               mSvh: cute.Tensor, mSvhRow: cute.Tensor, mWeights: cute.Tensor, mY: cute.Tensor,
               mSumCounter: cute.Tensor, mLogits: cute.Tensor, mBias: cute.Tensor):
        bn, blk, split = cute.arch.block_idx()
        if cutlass.const_expr(self.cfg.splits_in_x):
            split = bn % mP.shape[0]
            bn = bn // mP.shape[0]
        gx, _, gz = cute.arch.grid_dim()
        self.body(mX, mW, mP, mBlockExpert, mGroupRow, k_tiles_per_split, mRot, mX2, mRowRoute, mCounter, inter_true,
                  mGateSuh, mUpSuh, mIds, mRouteRow, mRank, mSvh, mSvhRow, mWeights, mY, mSumCounter, mLogits, mBias,
                  bn, blk, split, Int32(gx * gz), True)

    @cute.jit
    def body(self, mX: cute.Tensor, mW: cute.Tensor, mP: cute.Tensor, mBlockExpert: cute.Tensor,
             mGroupRow: cute.Tensor, k_tiles_per_split: Int32, mRot: cute.Tensor, mX2: cute.Tensor,
             mRowRoute: cute.Tensor, mCounter: cute.Tensor, inter_true: Int32, mGateSuh: cute.Tensor,
             mUpSuh: cute.Tensor, mIds: cute.Tensor, mRouteRow: cute.Tensor, mRank: cute.Tensor,
             mSvh: cute.Tensor, mSvhRow: cute.Tensor, mWeights: cute.Tensor, mY: cute.Tensor,
             mSumCounter: cute.Tensor, mLogits: cute.Tensor, mBias: cute.Tensor, bn: Int32, blk: Int32,
             split: Int32, readers: Int32, triggers: cutlass.Constexpr):
        """One CTA's work: column tile ``bn``, route block ``blk``, K split ``split`` (``readers``: the CTAs of a
        route block, which count out at its ready counter). ``triggers``: the CTA lets the next kernel launch as
        its config says (``ready_signal``); False in a ``MoEGemmPair``, whose down CTAs are in this grid."""
        cfg, main = self.cfg, self.cfg.mainloop
        region = ptx.TRACE_GATE_UP if cfg.planes == 2 else ptx.TRACE_DOWN  # the timing trace's (ptx.TRACE_ADDR)
        ptx.trace_stamp(region, ptx.TRACE_ENTRY)
        # With ready_signal the down GEMM waits for its blocks' ready counters, not for this grid, so it may launch
        # before this kernel's own PDL wait; it reads the route's block table first, though. Behind the input
        # rotation that table is written (the rotation waited for the route before letting this kernel launch);
        # right behind the route (M = 1: this kernel rotates the input) only after the wait.
        if cutlass.const_expr(triggers and cfg.ready_signal and cfg.input is None):
            ptx.launch_dependents()
        if cutlass.const_expr(not (cfg.weights_before_wait or cfg.ready_wait)):
            ptx.wait_for_prior_kernels()  # PDL: the kernel before this one has finished
            ptx.trace_stamp(region, ptx.TRACE_WAITED)
        if cutlass.const_expr(triggers and cfg.ready_signal and cfg.input is not None):
            ptx.launch_dependents()
        tid, _, _ = cute.arch.thread_idx()
        warp = tid // 32
        lane = tid % 32

        smem, sW, sX, sDec = allocate_smem(main)
        sLast = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        sRoute = sLast  # resident rows: the route in each row of the block (-1: padding)
        if cutlass.const_expr(cfg.resident_rows > 1):
            sRoute = smem.allocate_tensor(Int32, cute.make_layout(cfg.tokens_per_cta), 16)
        if cutlass.const_expr(cfg.smem_pad > 0):
            smem.allocate_tensor(Int32, cute.make_layout(cfg.smem_pad // 4), 16)  # held, never touched
        sTerm = sLast  # the fused top-k sum's slot terms: the weight stages, or their own where those are smaller
        if cutlass.const_expr(cfg.extra_term_words > 0):
            sTerm = smem.allocate_tensor(Float32, cute.make_layout(cfg.extra_term_words), 16)
        elif cutlass.const_expr(cfg.topk_sum is not None):
            sTerm = cute.make_tensor(cute.recast_ptr(sW.iterator, dtype=Float32), cute.make_layout(cfg.term_words))
        if cutlass.const_expr(cfg.route is not None):
            # warp 0 chooses and the CTA takes its choice from shared memory: every warp choosing (24 an SM, and
            # down's CTAs too) made the prologue after the PDL wait 1.31 -> 2.85 us median, 7.65 at p90, and the
            # layer 21.81 -> 24.63 us (M=1, H100)
            sChosen = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
            if warp == 0:
                choose_block_expert(cfg, mLogits, mBias, mIds, mWeights, mRank, mBlockExpert, sChosen, blk,
                                    (bn == 0) & (split == 0) & (blk == 0), lane)
            cute.arch.sync_threads()
            expert = sChosen[0]
        elif cutlass.const_expr(cfg.awaits_block_expert):
            expert = await_block_expert(mBlockExpert.iterator.toint() + Int64(blk) * 4)
        else:
            expert = mBlockExpert[blk]
        p = group_row_of(mGroupRow, expert, cfg.group_first, mW.shape[1])
        if expert >= 0 and p >= 0:
            n_col_tiles = mW.shape[3]
            k_tiles = mW.shape[2]
            words = self.plan.words_per_tile
            plane = (bn * cfg.warps) // n_col_tiles
            col_tile0 = bn * cfg.warps - plane * n_col_tiles
            w_base = mW.iterator.toint() + Int64(plane * mW.shape[1] + p) * k_tiles * n_col_tiles * words * 4
            k_begin = split * k_tiles_per_split
            k_end = cutlass.min(k_begin + k_tiles_per_split, k_tiles)
            n_chunks = cutlass.max(k_end - k_begin, 0) // cfg.k_tiles_per_stage
            tok0 = blk * cfg.tokens_per_cta

            acc = cute.make_rmem_tensor(cute.make_layout(4 * cfg.token_groups), Float32)
            acc.fill(0.0)
            n_blocks = n_chunks * cfg.k_tiles_per_stage // 8  # the prologue's 128-blocks of x
            rounds = -(-cfg.resident_k_tiles // (8 * cfg.warps))
            if cutlass.const_expr(cfg.input is not None and cfg.resident_rows > 1):
                def prologue(sX):  # noqa: E306 (the block's tokens' x, rotated with this expert's suh, while W loads)
                    find_block_routes(mIds, mRank, mRouteRow, mRowRoute, sRoute, expert, tok0,
                                      bn == 0 and split == 0, tid, self.threads)
                    for i in cutlass.range_constexpr(cfg.resident_rows):
                        route = sRoute[i]
                        if route >= 0:  # rows past the block's routes: padding columns, never stored or read
                            rotate_expert_input(mX, mGateSuh, mUpSuh, sX, plane, p, k_begin, n_blocks, rounds,
                                                cfg.resident_order, warp, cfg.warps, lane, route // mIds.shape[1],
                                                i * main.resident_row_words)
                    ptx.trace_stamp(region, ptx.TRACE_PROLOGUE)
                decode_mma_loop(main, self.plan, acc, sW, sX, sDec, w_base, Int64(0), Int32(0), n_col_tiles,
                                col_tile0, tok0, Int32(1), k_begin, n_chunks, prologue)
                store_partials(mP, acc, acc_groups(main, warp), split, plane * n_col_tiles * 16, col_tile0, tok0,
                               lane)
            elif cutlass.const_expr(cfg.input is not None):
                if cutlass.const_expr(cfg.early_prologue_loads):
                    gate = plane == 0
                    suh = cutlass.select_(gate, mGateSuh.iterator.toint(), mUpSuh.iterator.toint())
                    suh_width = cutlass.select_(gate, mGateSuh.shape[1], mUpSuh.shape[1])
                    # the token's x and this expert's suh, loaded before any weight copy
                    loads = lambda: rotation_loads(mX, suh, suh_width, p, k_begin, n_blocks, rounds,  # noqa: E731
                                                   warp, cfg.warps, lane)

                    def prologue(sX, loaded):  # noqa: E306 (rotated while W loads)
                        rotate_loaded_into_shared(loaded, mX, sX, n_blocks, cfg.resident_order, warp, cfg.warps,
                                                  lane)
                        ptx.trace_stamp(region, ptx.TRACE_PROLOGUE)
                else:
                    loads = None

                    def prologue(sX):  # noqa: E306 (the token's x, rotated with this expert's suh, while W loads)
                        rotate_expert_input(mX, mGateSuh, mUpSuh, sX, plane, p, k_begin, n_blocks, rounds,
                                            cfg.resident_order, warp, cfg.warps, lane)
                        ptx.trace_stamp(region, ptx.TRACE_PROLOGUE)
                decode_mma_loop(main, self.plan, acc, sW, sX, sDec, w_base, Int64(0), Int32(0), n_col_tiles,
                                col_tile0, tok0, Int32(1), k_begin, n_chunks, prologue, prologue_loads=loads)
                if cutlass.const_expr(cfg.route is not None):
                    if bn == 0 and split == 0 and tid == 0:  # block blk holds slot blk (mIds may not be written yet)
                        mRouteRow[blk] = tok0
                        mRowRoute[tok0] = blk
                elif bn == 0 and split == 0 and tid < mIds.shape[1]:
                    if mIds[0, tid] == expert:  # this block's one route: slot tid of token 0
                        mRouteRow[tid] = tok0
                        mRowRoute[tok0] = tid
                # every MMA column is the one token: its row alone
                if lane % 4 == 0:
                    col = plane * n_col_tiles * 16 + (col_tile0 + warp) * 16 + lane // 4
                    mP[split, tok0, col] = acc[0].to(mP.element_type)
                    mP[split, tok0, col + 8] = acc[2].to(mP.element_type)
            else:
                rows = mX.shape[1]
                x_base = mX.iterator.toint() + Int64(plane) * rows * mX.shape[2] * 4
                wait = ptx.wait_for_prior_kernels if cfg.weights_before_wait else None
                prologue = None
                if cutlass.const_expr(cfg.ready_wait):
                    n_ib = k_tiles // 8
                    ready = block_ready_counter(mCounter, mBlockExpert, n_ib, blk)
                    behind = cfg.count_out_behind_x
                    wait = lambda: ptx.wait_count(ready, n_ib, readers, tid, not behind)  # noqa: E731
                    if cutlass.const_expr(behind):  # the main loop calls it behind its first X copies
                        prologue = lambda sX: ptx.count_out(ready, n_ib, readers, tid)  # noqa: E731
                if cutlass.const_expr(wait is not None):
                    inner_wait = wait
                    wait = lambda: (inner_wait(), ptx.trace_stamp(region, ptx.TRACE_WAITED))  # noqa: E731
                loop_args = (main, self.plan, acc, sW, sX, sDec, w_base, x_base, mX.shape[2], n_col_tiles, col_tile0,
                             tok0, rows, k_begin, n_chunks, prologue, rows)
                if cutlass.const_expr(cfg.group_loops):
                    # a main loop per count of route-holding groups (a predicate per group and k-tile would still
                    # issue the skipped MMAs and loads), picked after the wait: the input rotation writes row_route
                    count = lambda: live_groups(mRowRoute, tok0, cfg.token_groups)  # noqa: E731
                    decode_mma_loop(*loop_args, None, wait, (count, cfg.group_loops))
                elif cutlass.const_expr(cfg.skip_padding_tail):
                    # A main loop of each kind, chosen per block: in one loop with the tail MMAs behind a predicate
                    # ptxas fenced every MMA apart (C7519: a warpgroup.arrive each). H200, E=128 top-8 2048x768 K=4
                    # mcg, layer graph, y bit-identical, us: M=4096 1095.28 -> 1056.51, M=8192 2155.10 -> 2079.45.
                    tail_run = cutlass.select_(mRowRoute[tok0 + 8 * WGMMA_MAX_GROUPS] >= 0, Int32(1), Int32(0))
                    if tail_run != 0:
                        decode_mma_loop(*loop_args, None, wait)
                    else:
                        decode_mma_loop(*loop_args, WGMMA_MAX_GROUPS, wait)
                else:
                    decode_mma_loop(*loop_args, None, wait)
                # P has every row of the block; a skipped tail's rows are left unwritten
                groups = acc_groups(main, warp)
                skippable = [cfg.skip_padding_tail and group >= WGMMA_MAX_GROUPS for _, _, group in groups]
                head = [g for g, skip in zip(groups, skippable) if not skip]
                if cutlass.const_expr(cfg.group_loops):
                    live = live_groups(mRowRoute, tok0, cfg.token_groups)  # again: not held across the loop
                    for i in cutlass.range_constexpr(len(head)):
                        if head[i][2] < live:
                            store_partials(mP, acc, head[i : i + 1], split, plane * n_col_tiles * 16, col_tile0,
                                           tok0, lane)
                else:
                    store_partials(mP, acc, head, split, plane * n_col_tiles * 16, col_tile0, tok0, lane)
                if cutlass.const_expr(cfg.skip_padding_tail):
                    if tail_run != 0:
                        tail = [g for g, skip in zip(groups, skippable) if skip]
                        store_partials(mP, acc, tail, split, plane * n_col_tiles * 16, col_tile0, tok0, lane)
            ptx.trace_stamp(region, ptx.TRACE_LOOP)
            if cutlass.const_expr(cfg.next_after_loop):
                ptx.launch_dependents()

            if cutlass.const_expr(cfg.intermediate_splits > 0):
                block = col_tile0 // 8  # 128-column block of I (both planes count in at the same one)
                counter = mCounter.iterator.toint() + (Int64(blk) * (n_col_tiles // 8) + block) * 4
                ptx.count_in(counter, 2 * (8 // cfg.warps) * cfg.intermediate_splits, sLast, 0, tid)
                ptx.trace_stamp(region, ptx.TRACE_ARRIVED)
                if sLast[0] != 0:
                    if cutlass.const_expr(cfg.input is not None and cfg.resident_rows == 1):
                        if warp == 0:  # the block's one route (its row_route may not be written yet)
                            intermediate_row(mP, mRot, mX2, tok0, p, block, lane, inter_true,
                                             cfg.intermediate_splits, cfg.x2_order, gating=cfg.gating)
                    elif cutlass.const_expr(cfg.tail_row_pairs):
                        half = lane // 16
                        for r in cutlass.range_constexpr(cfg.tail_rows_per_warp // 2):
                            slots = [(2 * r + h) * cfg.warps + warp for h in range(2)]
                            pair = [tail_route(cfg, mRowRoute, sRoute, tok0 + slot, slot) for slot in slots]
                            pair_row = tok0 + cutlass.select_(half == 0, slots[0], slots[1])
                            pair_live = cutlass.select_(half == 0, pair[0], pair[1]) >= 0
                            if (pair[0] >= 0) | (pair[1] >= 0):  # warp-uniform: every lane loads both routes
                                intermediate_row(mP, mRot, mX2, pair_row, p, block, lane, inter_true,
                                                 cfg.intermediate_splits, cfg.x2_order, n=8, gating=cfg.gating,
                                                 row_pair=True, live=pair_live)
                    else:
                        for r in cutlass.range_constexpr(cfg.tail_rows_per_warp):
                            row = tok0 + r * cfg.warps + warp
                            route = tail_route(cfg, mRowRoute, sRoute, row, r * cfg.warps + warp)
                            if route >= 0:  # padding rows stay unwritten, as in Intermediate
                                intermediate_row(mP, mRot, mX2, row, p, block, lane, inter_true,
                                                 cfg.intermediate_splits, cfg.x2_order, gating=cfg.gating)
                    if tid == 0:
                        ptx.st_global_u32(counter, Int32(0))  # ready for the next launch (and graph replay)
                    if cutlass.const_expr(cfg.ready_signal):
                        ptx.signal_count(block_ready_counter(mCounter, mBlockExpert, n_col_tiles // 8, blk), tid)

            if cutlass.const_expr(cfg.topk_sum is not None):
                block = col_tile0 // 8  # 128-column block of the hidden dim: every route, split and group counts in
                counter = mSumCounter.iterator.toint() + Int64(block) * 4
                ptx.count_in(counter, cfg.topk_sum.routes_per_token * (8 // cfg.warps) * cfg.topk_sum.splits, sLast,
                             0, tid)
                ptx.trace_stamp(region, ptx.TRACE_ARRIVED)
                if sLast[0] != 0:  # (count_in's barrier: no warp still reads the weight stages that hold sTerm)
                    topk_sum_block(cfg.topk_sum, mP, mSvh, mSvhRow, mIds, mWeights, mRouteRow, mY, sTerm, 0, block,
                                   warp, cfg.warps, lane)
                    if tid == 0:
                        ptx.st_global_u32(counter, Int32(0))  # ready for the next launch (and graph replay)
            ptx.trace_stamp(region, ptx.TRACE_END)
            last = Int32(0)  # sLast[0]: this CTA arrived last at its fused tail's counter
            if cutlass.const_expr(cfg.intermediate_splits > 0 or cfg.topk_sum is not None):
                last = sLast[0]
            ptx.trace_flags(region, ptx.TRACE_LIVE | last)
        elif cutlass.const_expr(cfg.weights_before_wait):
            ptx.wait_for_prior_kernels()  # every CTA waits: this kernel ends only after the one before it
        if cutlass.const_expr(cfg.ready_wait):
            ptx.wait_for_prior_kernels()  # likewise, at the end: the kernels after this one wait for gate/up too


def column_tiles(cfg: MoEGemmConfig, mW) -> Int32:
    """CTAs a route block and K split: each takes ``warps`` of the planes' 16-column tiles. Traced inline."""
    return cfg.planes * mW.shape[3] // cfg.warps


def gemm_arguments(mX, mW, mP, mBlockExpert, mGroupRow, k_tiles_per_split, mRot=None, mX2=None, mRowRoute=None,
                   mCounter=None, inter_true=None, mGateSuh=None, mUpSuh=None, mIds=None, mRouteRow=None, mRank=None,
                   mSvh=None, mSvhRow=None, mWeights=None, mY=None, mSumCounter=None, mLogits=None, mBias=None):
    """``MoEGemm.kernel``'s arguments (and ``body``'s before the block indices), a tensor the config does not use
    (None, ``MoEGemm.__call__``'s meanings) stood in for by one it has: never touched. Traced inline."""
    if mRowRoute is None:
        mRowRoute = mBlockExpert
    if mCounter is None:
        mCounter = mP  # no fused tail
    if mRot is None:
        mRot, mX2 = mP, mP  # no fused intermediate
    if inter_true is None:
        inter_true = Int32(0)
    if mGateSuh is None:
        mGateSuh, mUpSuh = mP, mP  # no prologue
    if mIds is None:
        mIds, mRouteRow = mBlockExpert, mBlockExpert
    if mRank is None:
        mRank = mBlockExpert  # no resident rows
    if mSvh is None:
        mSvh, mSvhRow, mY = mP, mBlockExpert, mP  # no fused top-k sum
    if mWeights is None:
        mWeights = mP  # neither the fused top-k sum nor the routes' writer
    if mLogits is None:
        mLogits, mBias = mP, mP  # the block's expert from block_expert
    if mSumCounter is None:
        mSumCounter = mP  # no fused top-k sum
    return (mX, mW, mP, mBlockExpert, mGroupRow, k_tiles_per_split, mRot, mX2, mRowRoute, mCounter, inter_true,
            mGateSuh, mUpSuh, mIds, mRouteRow, mRank, mSvh, mSvhRow, mWeights, mY, mSumCounter, mLogits, mBias)


def choose_block_expert(cfg: MoEGemmConfig, mLogits, mBias, mIds, mWeights, mRank, mBlockExpert, sChosen, blk,
                        writer, lane):
    """One warp: ``sChosen[0]`` = the expert of route block ``blk`` (slot ``blk`` of the one token) from the
    router's logits; the ``writer`` warp of a ``writes_routes`` GEMM also stores the token's routes as the route
    kernel's top-k and slot blocks would (each routed expert's rank 0: a token's experts are distinct). Traced
    inline."""
    router = MoERoute(cfg.route)
    n, k = cfg.route.num_experts, cfg.route.top_k
    row = mLogits.iterator.toint()
    ids, weights = router.choose([row], mBias, lane)[0]
    expert = ids[0]
    for j in range(1, k):
        expert = cutlass.select_(blk == j, ids[j], expert)
    if cfg.route.shared != "none":
        expert = cutlass.select_(blk == k, Int32(n), expert)  # the shared expert's slot k
    if cfg.writes_routes:
        mine, w = router.slot_route(ids, weights, lane)  # (a division a lane: cheap beside the loads before it)
        write_routes(mine, w, router.shared_gate(row), mIds, mWeights, mRank, mBlockExpert, writer, lane, n, k,
                     cfg.route.shared != "none")
    store_choice(sChosen, expert, lane)


@cute.jit
def await_block_expert(addr: Int64) -> Int32:
    """Acquire loads of a block's expert until it is not -1 (``awaits_block_expert``)."""
    expert = ptx.ld_acquire_u32(addr)
    while expert < 0:
        ptx.nanosleep(64)
        expert = ptx.ld_acquire_u32(addr)
    return expert


@cute.jit
def store_choice(sChosen: cute.Tensor, expert: Int32, lane: Int32):
    if lane == 0:
        sChosen[0] = expert


@cute.jit
def write_routes(mine: Int32, w: Float32, gate: Float32, mIds: cute.Tensor, mWeights: cute.Tensor,
                 mRank: cute.Tensor, mBlockExpert: cute.Tensor, writer, lane: Int32, n: cutlass.Constexpr,
                 k: cutlass.Constexpr, shared: cutlass.Constexpr):
    """``choose_block_expert``'s stores: lane j writes slot j (``mine``, ``w``), lane k the shared expert's."""
    if writer:
        if lane < k:
            mIds[0, lane] = mine
            mWeights[0, lane] = w
            mRank[lane] = Int32(0)
            ptx.st_release_u32(mBlockExpert.iterator.toint() + Int64(lane) * 4, mine)  # after the stores above
        if cutlass.const_expr(shared):
            if lane == k:
                mIds[0, k] = Int32(n)
                mWeights[0, k] = gate
                mRank[k] = Int32(0)
                ptx.st_release_u32(mBlockExpert.iterator.toint() + Int64(k) * 4, Int32(n))


def tail_route(cfg: MoEGemmConfig, mRowRoute: cute.Tensor, sRoute: cute.Tensor, row, slot):
    """The route of the block's row ``row`` (its ``slot``-th) for the fused intermediate (-1: padding): row_route's,
    or with resident rows this CTA's own record (the first CTA's row_route may not be written yet). Traced inline."""
    return mRowRoute[row] if cfg.input is None else sRoute[slot]


@cute.jit
def find_block_routes(mIds: cute.Tensor, mRank: cute.Tensor, mRouteRow: cute.Tensor, mRowRoute: cute.Tensor,
                      sRoute: cute.Tensor, expert: Int32, tok0: Int32, first, tid: Int32, threads: cutlass.Constexpr):
    """``sRoute[i]``: the route in row ``tok0 + i`` of the route block of ``expert``, -1 where none. The router's
    routes (distinct experts a token) of a few tokens: an expert's routes all fit its one block, each in the row of
    its rank (``moe_route``). The ``first`` CTA of the block also writes ``route_row`` / ``row_route`` for them,
    as the input rotation does. Ends with a CTA barrier."""
    if tid < cute.size(sRoute):
        sRoute[tid] = Int32(-1)
    cute.arch.sync_threads()
    k = mIds.shape[1]
    for r in cutlass.range(tid, mIds.shape[0] * k, threads):
        t = r // k
        if mIds[t, r - t * k] == expert:
            i = mRank[r]
            sRoute[i] = r
            if first:
                mRouteRow[r] = tok0 + i
                mRowRoute[tok0 + i] = r
    cute.arch.sync_threads()


def live_groups(mRowRoute, tok0, token_groups: int):
    """How many of the route block's token groups (from packed row ``tok0``) hold routes: the first, which every
    used block's does, and each whose first row is a route (a block's routes are its first rows). Traced inline."""
    live = Int32(1)
    for g in range(1, token_groups):
        live += cutlass.select_(mRowRoute[tok0 + 8 * g] >= 0, Int32(1), Int32(0))
    return live


def block_ready_counter(mCounter, mBlockExpert, n_ib, blk):
    """Address of route block ``blk``'s ready counter (``ready_signal`` / ``ready_wait``): after the fused
    intermediate's ``blocks * n_ib`` arrival counters. Traced inline."""
    return mCounter.iterator.toint() + (Int64(mBlockExpert.shape[0]) * n_ib + blk) * 4


def store_partials(mP, acc, groups, split, col0, col_tile0, tok0, lane):
    """Accumulator ``groups`` (``acc_groups``' entries) into ``P[split]``: D rows are output columns (g, g+8) of
    the tile column from ``col0``, D columns are packed rows (2q, 2q+1) of the token group. Traced inline."""
    for j, col_tile, group in groups:
        col = col0 + (col_tile0 + col_tile) * 16 + lane // 4
        row = tok0 + group * 8 + 2 * (lane % 4)
        mP[split, row, col] = acc[4 * j].to(mP.element_type)
        mP[split, row, col + 8] = acc[4 * j + 2].to(mP.element_type)
        mP[split, row + 1, col] = acc[4 * j + 1].to(mP.element_type)
        mP[split, row + 1, col + 8] = acc[4 * j + 3].to(mP.element_type)


@cute.jit
def rotate_expert_input(mX: cute.Tensor, mGateSuh: cute.Tensor, mUpSuh: cute.Tensor, sX: cute.Tensor, plane: Int32,
                        p: Int32, k_begin: Int32, n_blocks: Int32, rounds: cutlass.Constexpr,
                        x_order: cutlass.Constexpr, warp: Int32, warps: cutlass.Constexpr, lane: Int32,
                        x_row: Int32 = 0, s_word0: Int32 = 0):
    """The resident prologue: ``H128(x[x_row] * suh[p])`` of the K split into ``sX`` from word ``s_word0`` (in
    ``x_order``), with the gate (plane 0) or up suh of group row ``p``: what ``RouteInputRotation`` writes for
    that route, bit for bit."""
    if plane == 0:
        rotate_into_shared(mX, mGateSuh, sX, k_begin, n_blocks, rounds, x_order, warp, warps, lane, p, True, x_row,
                           s_word0)
    else:
        rotate_into_shared(mX, mUpSuh, sX, k_begin, n_blocks, rounds, x_order, warp, warps, lane, p, True, x_row,
                           s_word0)
