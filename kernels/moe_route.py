"""Routing of the fused MoE layer in one launch: router logits, top-k, and the routes counted by expert.

Grid ``(ceil(E_r/expert_tile), ceil(M/token_tile))``, 8 warps (``E_r`` = experts, plus the shared-expert gate as
row E when there is one). CTA (c, b) computes the fp32 logits of router rows ``c*expert_tile ..`` for tokens
``b*token_tile ..`` with ``mma.sync.m16n8k16`` (router rows as A, tokens as B, fp32 accumulate); warp w takes the
w-th eighth of the hidden dim and the eight partial tiles are summed in shared memory in warp order. Each output
element is a fixed sequence of MMAs and adds whatever the tiles are, so a token's logits (and routes) do not
depend on M or the rest of the batch. Inside an MMA the k slots are permuted alike in A and B: lane (g, q) reads
4 consecutive columns ``4q..4q+3`` of a 16-column step of its rows with one 8-byte load.

A warp's slice (its steps padded with zero steps to a multiple of 4) comes through its own ring of shared memory
with ``cp.async``: ``MoERouteConfig.staging`` stages of 2 or 4 steps, sized so that the CTA fills the 99 KB
(hidden 2048 at decode: the warp's whole slice in flight at once, one DRAM round trip instead of one per step).
A stage holds each step's rows (the CTA's router rows, then its tokens) 32 bytes apiece, so the fragment reads
of a step (rows g at 32-byte pitch, q at 8 bytes) hit distinct banks. Rows past the matrix and columns past the
slice or the hidden dim are zero-filled; 16-byte copies, or (a second copy of the loop) 8-byte ones when
hidden % 8 != 0 leaves rows only 8-byte aligned. The warps synchronise only among their own lanes until each
parks its partial tile in its ring.

The last CTA of token block b to finish (device-scope arrival counter, ``ptx.count_in``) turns those
tokens' logits into ``topk_ids / topk_weights [M, k']``, one warp per token (warp w: tokens w, w+8, .. of the
block, their loads issued together and their selections as independent straight-line chains):
  softmax_topk      softmax over the experts (of the logits plus an fp32 bias where ``logit_bias``: gpt-oss), top-k,
                    optional renormalisation, times ``scale``
  sigmoid_noaux_tc  sigmoid scores; choice = score + correction bias; with n_group > 1 only the topk_group
                    groups whose two best choices sum highest compete; weights are the scores of the chosen,
                    optionally renormalised, times ``scale``
  given             the caller's ``topk_ids / topk_weights`` as they are
Column k (when the layer has shared experts) routes every token to "expert" E with weight sigmoid(gate logit)
or 1. Ties go to the lower expert id. Each selection is two ``redux.sync`` (max of an order-preserving integer key,
then min of the ids that hold it). With <= 2 tokens a warp (token_tile 8 or 16: every M <= 256 with
``tiles_for``) only the first is on the serial path (``pick_fast``: the key's holders -> -inf at once, the id and
score off the chain); a token whose keys were not each held once (ties, NaN, +-0) takes the exact search
(``pick``) instead, so the routes are the same.
Lane j writes slot j and takes that route's rank inside its expert from an atomic on the expert's count (the
shared expert: the token index): in shared memory when the whole batch is one token block (every M <= 8 with
``tiles_for``; that CTA is then the last one and packs from those counts at once), else in global memory, and the
last token block to finish (a second ``count_in``) packs.
The packing CTA turns the counts into the packing: each expert's rows padded to the route block ``T`` (the
GEMM's tokens per CTA), ``expert_row[e]`` = its first packed row, ``block_expert[b]`` = the expert of rows
``b*T ..`` (-1: unused) and ``row_route`` = -1 on padding rows; it zeroes the global counts again. The
input rotation (at M = 1 the gate/up GEMM, ``moe_gemm``) then places route ``t*k' + j`` at row
``expert_row[e] + rank`` (and writes ``row_route`` / ``route_row`` there). Row order inside an expert follows
the atomics, which changes no result: every packed row is computed independently and the top-k sum reads routes
in (token, slot) order. The arrival counters and the
global counts reset themselves (the shared ones start at zero in every CTA), so the launch replays in a CUDA
graph with no host work.

With ``logits_only`` (one token, slot blocks) the kernel stops at the logits and sets ``block_expert[0 .. k'-1]``
to -1: the gate/up GEMM's CTAs each run ``choose`` (the same selection), one of them writes the routes and releases
the block table, and the down GEMM awaits it (``moe_gemm``).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from . import ptx
from .gemm import SMEM_LIMIT_BYTES

WARPS = 8  # the hidden dim in eight slices, one per warp (fixed: it fixes the logits' summation order)
THREADS = 32 * WARPS
STEP_GROUP = 4  # a warp's steps are padded to a multiple of 4 with zero steps (its MMA sequence, kept as it was)
ROW_STEP_BYTES = 32  # one router or token row over one 16-column step
RESERVED_SMEM_BYTES = 1024  # the cubin's static shared memory (sm_90a / sm_120a), inside the 99 KB as well
METHODS = ("softmax_topk", "sigmoid_noaux_tc", "given")
NEG_INF = float("-inf")
NO_ID = 0x7FFFFFFF
NEG_INF_KEY = 0x007FFFFF  # ptx.order_key(-inf)


@dataclass(frozen=True)
class MoERouteConfig:
    method: str
    num_experts: int
    top_k: int
    normalize: bool = True
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False
    logit_bias: bool = False  # softmax_topk: mBias [E] added to the logits (choice and weights alike: gpt-oss)
    shared: str = "none"  # "none" | "ungated" | "gated"
    x_dtype: str = "float16"
    expert_tile: int = 16  # router rows per CTA (16 or 32)
    token_tile: int = 8  # tokens per CTA (8, 16 or 32)
    early_next: bool = False  # PDL: let the next kernel launch right after this one's wait
    # One token (the planner's M = 1): route block j is slot j's, block_expert[j] its expert, and no packing (its
    # prefix sum and CTA barriers: 0.93 us of the route's 5.1 at M=1 on an H100, exl3tool.bench.trace). Only the
    # one-token GEMMs read the blocks then, by expert (moe_gemm's prologue), never expert_row nor padding rows.
    slot_blocks: bool = False
    # One token with slot blocks: this kernel only writes the logits; each gate/up CTA chooses the token's routes
    # itself (``choose``, the same bits) and one of them writes them (moe_gemm's ``route``), so that no CTA of this
    # launch waits for the others (the arrival and the top-k: 1.85 of M=1's 4.22 us here on an H100, bench.trace).
    logits_only: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"routing method must be one of {', '.join(METHODS)}")
        if not 1 <= self.top_k <= min(self.num_experts, 32) or self.num_experts > 1024:
            raise ValueError(f"top-{self.top_k} of {self.num_experts} experts is not supported")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{self.num_experts} experts in {self.n_group} groups, top {self.topk_group}")
        if self.logit_bias and self.method == "sigmoid_noaux_tc":
            raise ValueError("a logit bias is for softmax routing (sigmoid routing takes a correction bias)")
        if self.shared not in ("none", "ungated", "gated"):
            raise ValueError("shared must be none, ungated or gated")
        if self.expert_tile not in (16, 32) or self.token_tile not in (8, 16, 32):
            raise ValueError("expert_tile must be 16 or 32, token_tile 8, 16 or 32")
        if self.slot_blocks and self.method == "given":
            raise ValueError("slot_blocks is for the router's routes (the caller's may repeat an expert)")
        if self.logits_only and not self.slot_blocks:
            raise ValueError("logits_only is for one token with slot_blocks (the GEMMs choose the routes)")

    @property
    def chunks(self) -> int:
        """CTAs of a token block: the router rows in tiles of expert_tile."""
        return -(-self.router_rows // self.expert_tile)

    @property
    def routes_per_token(self) -> int:
        return self.top_k + (self.shared != "none")

    @property
    def router_rows(self) -> int:
        return self.num_experts + (self.shared == "gated")

    @property
    def packed_experts(self) -> int:
        """Experts the packing sees: the routed ones, plus the shared expert as id E."""
        return self.num_experts + (self.shared != "none")

    @property
    def staging(self) -> tuple[int, int]:
        """(steps per stage, stages) of each warp's ring: as many steps as fit next to the small buffers, in
        stages of 4 steps, or of 2 when that keeps more steps or 2 stages (both divide ``STEP_GROUP``)."""
        free = SMEM_LIMIT_BYTES - RESERVED_SMEM_BYTES - self._small_smem_bytes
        steps = free // (WARPS * self.stage_rows * ROW_STEP_BYTES)
        size = 4 if steps >= 8 and steps % 4 < 2 else 2
        return size, steps // size

    @property
    def stage_rows(self) -> int:
        return self.expert_tile + self.token_tile

    @property
    def ring_bytes(self) -> int:
        """One warp's ring (its partial tile's home after the MMAs)."""
        size, stages = self.staging
        return stages * size * self.stage_rows * ROW_STEP_BYTES

    @property
    def _small_smem_bytes(self) -> int:
        return 16 + 32 + 4 * self.packed_experts  # sFlag, sScan, sCount (after the rings)

    @property
    def smem_bytes(self) -> int:
        return WARPS * self.ring_bytes + self._small_smem_bytes


def tiles_for(tokens: int) -> dict:
    """Route kernel tiles for M tokens: small tiles up to a few hundred tokens (more CTAs pulling the router, and
    one token per top-k warp, which takes the one-redux selection: 4 tokens a warp took 10 of the 25 us at M=256),
    larger ones beyond (less re-reading of router and activations). Any choice gives the same logits. H200, E=128
    top-8 hidden 2048, route kernel inside the layer (us, (expert, token) tiles): M=64 (32, 32) 23.5 -> (16, 8)
    10.1, M=256 (32, 32) 25.8 -> (32, 8) 14.9, M=16 (16, 16) 12.3 -> (16, 8) 9.7; route alone, M=1024: (32, 32)
    29.4, (32, 8) 31.0. One token block of 16 from 9 tokens (the last CTA counts and packs in shared memory, no
    second arrival) lost too: H100, layer graph, two rounds, us: M=12 93.25 -> 93.65, M=16 105.92 -> 107.26
    (docs/perf.md, sixty-eighth session)."""
    return dict(expert_tile=16 if tokens <= 64 else 32, token_tile=8 if tokens <= 256 else 32)


@dsl_user_op
def ld_cg_f32(gmem_addr, *, loc=None, ip=None) -> Float32:
    """One fp32 another CTA of this launch wrote (after ``count_in``): from L2, never a stale L1 line."""
    return Float32(llvm.inline_asm(T.f32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.f32 $0, [$1];",
                                   "=f,l", has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_cg_s32(gmem_addr, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.b32 $0, [$1];",
                                 "=r,l", has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def atomic_add_shared_u32(smem_addr, value, *, loc=None, ip=None) -> Int32:
    """``old = *addr; *addr += value`` atomically on a shared-memory word; returns old."""
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), values, "atom.shared.add.u32 $0, [$1], $2;", "=r,r,r", has_side_effects=True,
                                 loc=loc, ip=ip))


def _better(v, i, ov, oi):
    """Does candidate (ov, oi) beat (v, i)? Higher value, ties to the lower index."""
    return (ov > v) | ((ov == v) & (oi < i))


def lane_best(values, ids, extra):
    """This lane's best (value, id, extra) of its candidates (compile-time lists)."""
    v, i, e = values[0], ids[0], extra[0]
    for c in range(1, len(values)):
        take = _better(v, i, values[c], ids[c])
        v, i, e = cutlass.select_(take, values[c], v), cutlass.select_(take, ids[c], i), cutlass.select_(take, extra[c], e)
    return v, i, e


def warp_best(v, i, extra):
    """The warp's best (value, id) - higher value, ties to the lower id - and the winner's ``extra``, in every
    lane; ids must be owned by lane ``id % 32``. Two ``redux.sync`` and one shuffle."""
    key = cutlass.Uint32(ptx.order_key(v))
    top = cute.arch.warp_redux_sync(key, "umax")
    win = cute.arch.warp_redux_sync(cutlass.select_(key == top, i, Int32(NO_ID)), "min")
    owner = win % 32
    return cute.arch.shuffle_sync(v, owner), win, cute.arch.shuffle_sync(extra, owner)


def warp_sum(v):
    for bit in range(5):
        v = v + cute.arch.shuffle_sync_bfly(v, 16 >> bit)
    return v


def warp_max(v):
    for bit in range(5):
        v = cutlass.max(v, cute.arch.shuffle_sync_bfly(v, 16 >> bit))
    return v


class MoERoute:
    def __init__(self, config: MoERouteConfig):
        self.cfg = config
        self.per_lane = (config.num_experts + 31) // 32
        self.m_tiles = config.expert_tile // 16
        self.n_tiles = config.token_tile // 8

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, H] fp16/bf16
        mRouter: cute.Tensor,  # [E_r, H] fp16
        mBias: cute.Tensor,  # [E] fp32 correction or logit bias (any fp32 tensor without one)
        mGivenIds: cute.Tensor,  # [M, k] int32 ("given" only; else any int32 tensor)
        mGivenW: cute.Tensor,  # [M, k] fp32
        mLogits: cute.Tensor,  # [M, E_r] fp32 scratch
        mIds: cute.Tensor,  # [M, k'] int32
        mW: cute.Tensor,  # [M, k'] fp32
        mRank: cute.Tensor,  # [M * k'] int32: each route's rank inside its expert
        mCounters: cute.Tensor,  # int32 [>= ceil(M/token_tile) + 1], zero before the first launch
        mCounts: cute.Tensor,  # int32 [E'], zero before the first launch
        mExpertRow: cute.Tensor,  # [E'] int32
        mBlockExpert: cute.Tensor,  # [blocks] int32
        mRowRoute: cute.Tensor,  # [blocks * T] int32
        block_rows: Int32,  # T
        stream: cuda.CUstream,
    ):
        grid = (self.cfg.chunks,
                (mX.shape[0] + self.cfg.token_tile - 1) // self.cfg.token_tile, 1)
        self.kernel(mX, mRouter, mBias, mGivenIds, mGivenW, mLogits, mIds, mW, mRank, mCounters, mCounts,
                    mExpertRow, mBlockExpert, mRowRoute, block_rows).launch(
            grid=grid, block=(THREADS, 1, 1), stream=stream, **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRouter: cute.Tensor, mBias: cute.Tensor, mGivenIds: cute.Tensor,
               mGivenW: cute.Tensor, mLogits: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, mRank: cute.Tensor,
               mCounters: cute.Tensor, mCounts: cute.Tensor, mExpertRow: cute.Tensor, mBlockExpert: cute.Tensor,
               mRowRoute: cute.Tensor, block_rows: Int32):
        ptx.wait_for_prior_kernels(self.cfg.early_next)  # PDL: the kernel before this one has finished
        ptx.trace_stamp(ptx.TRACE_ROUTE, ptx.TRACE_ENTRY)
        cfg = self.cfg
        tid, _, _ = cute.arch.thread_idx()
        chunk, tb, _ = cute.arch.block_idx()
        n_chunks, n_tb, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        tokens = mX.shape[0]

        smem = SmemAllocator()
        sRing = smem.allocate_tensor(Float32, cute.make_layout(WARPS * cfg.ring_bytes // 4), 16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        sScan = smem.allocate_tensor(Int32, cute.make_layout(WARPS), 16)
        sCount = smem.allocate_tensor(Int32, cute.make_layout(cfg.packed_experts), 16)

        # The whole batch in one token block (every M <= token_tile; tiles_for: every M <= 8): its top-k CTA is
        # the last one, and counts the routes per expert in shared memory (zeroed here, ordered before the top-k
        # by count_in's barrier), then packs straight from those counts.
        single = n_tb == 1
        for e in cutlass.range(tid, cfg.packed_experts, THREADS):
            sCount[e] = Int32(0)

        e0, t0 = chunk * cfg.expert_tile, tb * cfg.token_tile
        if mX.shape[1] % 8 == 0:  # rows 16-byte aligned (a loop of its own: no predicated-off 8-byte copies)
            self.logits(mX, mRouter, mLogits, sRing, e0, t0, warp, lane, tid, True)
        else:
            self.logits(mX, mRouter, mLogits, sRing, e0, t0, warp, lane, tid, False)

        ptx.trace_stamp(ptx.TRACE_ROUTE, ptx.TRACE_WAITED)  # (its logits stored)
        if cutlass.const_expr(cfg.logits_only):
            if (chunk == 0) & (tid < cfg.routes_per_token):  # the gate/up GEMM writes (releases) them
                mBlockExpert[tid] = Int32(-1)
            ptx.trace_stamp(ptx.TRACE_ROUTE, ptx.TRACE_END)
            ptx.trace_flags(ptx.TRACE_ROUTE, ptx.TRACE_LIVE)
        else:
            self.routes(mLogits, mBias, mGivenIds, mGivenW, mIds, mW, mRank, mCounters, mCounts, mExpertRow,
                        mBlockExpert, mRowRoute, block_rows, sFlag, sScan, sCount, single, tb, n_chunks, n_tb, tid,
                        warp, lane, tokens)

    @cute.jit
    def routes(self, mLogits: cute.Tensor, mBias: cute.Tensor, mGivenIds: cute.Tensor, mGivenW: cute.Tensor,
               mIds: cute.Tensor, mW: cute.Tensor, mRank: cute.Tensor, mCounters: cute.Tensor, mCounts: cute.Tensor,
               mExpertRow: cute.Tensor, mBlockExpert: cute.Tensor, mRowRoute: cute.Tensor, block_rows: Int32,
               sFlag: cute.Tensor, sScan: cute.Tensor, sCount: cute.Tensor, single, tb: Int32, n_chunks: Int32,
               n_tb: Int32, tid: Int32, warp: Int32, lane: Int32, tokens: Int32):
        """The last CTA of token block ``tb`` (its logits stored): top-k of its tokens, then the packing."""
        cfg = self.cfg
        counter = mCounters.iterator.toint() + Int64(tb) * 4
        ptx.count_in(counter, n_chunks, sFlag, 0, tid)
        ptx.trace_stamp(ptx.TRACE_ROUTE, ptx.TRACE_LOOP)  # (arrived)
        if sFlag[0] != 0:
            self.top_k(mLogits, mBias, mGivenIds, mGivenW, mIds, mW, mRank, mCounts, sCount, single,
                       tb * cfg.token_tile + warp, tokens, lane)
            ptx.trace_stamp(ptx.TRACE_ROUTE, ptx.TRACE_ARRIVED)  # (its top-k done)
            if tid == 0:
                ptx.st_global_u32(counter, Int32(0))
            if cutlass.const_expr(cfg.slot_blocks):
                if warp == 0 and lane < mIds.shape[1]:  # token 0's warp: the slot this lane wrote
                    mBlockExpert[lane] = mIds[0, lane]
            elif single:
                cute.arch.sync_threads()  # every route counted in sCount
                self.pack(mCounts, mExpertRow, mBlockExpert, mRowRoute, tokens, block_rows, sCount, sFlag, sScan,
                          tid, True)
            else:
                # --- the last token block: pack the routes counted in mCounts ----------------------------------
                last = mCounters.iterator.toint() + Int64(n_tb) * 4
                ptx.count_in(last, n_tb, sFlag, 1, tid)
                if sFlag[1] != 0:
                    self.pack(mCounts, mExpertRow, mBlockExpert, mRowRoute, tokens, block_rows, sCount, sFlag,
                              sScan, tid, False)
                    if tid == 0:
                        ptx.st_global_u32(last, Int32(0))
        ptx.trace_stamp(ptx.TRACE_ROUTE, ptx.TRACE_END)
        ptx.trace_flags(ptx.TRACE_ROUTE, ptx.TRACE_LIVE | sFlag[0])

    @cute.jit
    def logits(self, mX: cute.Tensor, mRouter: cute.Tensor, mLogits: cute.Tensor, sRing: cute.Tensor, e0: Int32,
               t0: Int32, warp: Int32, lane: Int32, tid: Int32, wide: cutlass.Constexpr):
        """``logits[t0 .., e0 ..]`` of this CTA's tile: warp w's slice of the hidden dim through its ring as MMAs,
        then the warps' partial tiles summed in warp order. ``wide``: 16-byte copies, else 8-byte ones."""
        cfg = self.cfg
        mt_n, nt_n = self.m_tiles, self.n_tiles
        size, stages = cfg.staging
        rows_n = cfg.stage_rows
        hidden = mX.shape[1]
        rows = mRouter.shape[0]
        tokens = mX.shape[0]
        steps = (hidden + 15) // 16
        per_warp = (steps + WARPS - 1) // WARPS
        s_begin = warp * per_warp
        s_end = cutlass.min(s_begin + per_warp, steps)
        # the slice in whole groups of 4 steps, the copies of steps past s_end zero-filled
        n_stages = (cutlass.max(s_end - s_begin, 0) + STEP_GROUP - 1) // STEP_GROUP * (STEP_GROUP // size)
        col_end = cutlass.min(s_end * 16, hidden)
        ring = sRing.iterator.toint() + warp * cfg.ring_bytes
        slot_bytes = size * rows_n * ROW_STEP_BYTES

        # Copies: lane (h, rr, jq) = (lane % 2, lane / 2 % 4, lane / 8) takes half h of step jq % size of rows
        # rr + 4 * (jq / size) + per_copy * i; 8 lanes then write one full 128-byte bank line (4 rows x 32 bytes).
        per_copy = 16 // size
        copy_step = lane // 8 % size
        row0 = lane // 2 % 4 + 4 * (lane // 8 // size)
        lane_col = copy_step * 16 + 8 * (lane % 2)
        dst = ring + (copy_step * rows_n + row0) * ROW_STEP_BYTES + 16 * (lane % 2)
        row_bytes = Int64(hidden) * 2
        sources = []  # (address of the row, clamped in; is the row real)
        for i in cutlass.range_constexpr(rows_n // per_copy):
            r = row0 + per_copy * i
            if cutlass.const_expr(per_copy * i < cfg.expert_tile):
                idx, limit, matrix = e0 + r, rows, mRouter.iterator.toint()
            else:
                idx, limit, matrix = t0 + r - cfg.expert_tile, tokens, mX.iterator.toint()
            sources.append((matrix + Int64(cutlass.min(idx, limit - 1)) * row_bytes, idx < limit))
        first_col = s_begin * 16 + lane_col

        for st in cutlass.range_constexpr(stages):
            if st < n_stages:
                self.load_stage(sources, first_col + st * size * 16, col_end, dst + st * slot_bytes, per_copy, wide)
            cute.arch.cp_async_commit_group()

        g = lane // 4
        frag = ring + g * ROW_STEP_BYTES + 8 * (lane % 4)  # lane (g, q): row g, columns 4q..4q+3 of each step
        acc = cute.make_rmem_tensor(cute.make_layout(mt_n * nt_n * 4), Float32)
        acc.fill(0.0)
        for st in cutlass.range(n_stages):
            cute.arch.cp_async_wait_group(stages - 1)
            cute.arch.sync_warp()  # the other lanes' copies of this stage have landed
            slot = (st % stages) * slot_bytes
            for j in cutlass.range_constexpr(size):
                step = frag + slot + j * rows_n * ROW_STEP_BYTES
                a_words = [ptx.ld_shared_v2_b32(step + 8 * r * ROW_STEP_BYTES) for r in range(2 * mt_n)]
                b_words = [ptx.ld_shared_v2_b32(step + (cfg.expert_tile + 8 * n) * ROW_STEP_BYTES)
                           for n in range(nt_n)]
                for mt in cutlass.range_constexpr(mt_n):
                    lo, hi = a_words[2 * mt], a_words[2 * mt + 1]  # rows g and g+8
                    for nt in cutlass.range_constexpr(nt_n):
                        b = b_words[nt]
                        base = (mt * nt_n + nt) * 4
                        c = [acc[base + i] for i in range(4)]
                        if cutlass.const_expr(cfg.x_dtype == "float16"):
                            c = ptx.mma_m16n8k16_f32((lo[0], hi[0], lo[1], hi[1]), b, c, "float16")
                        else:
                            # exact: the fp16 router as the sum of two bf16 matrices
                            lo0, lo0r = ptx.f16x2_as_bf16x2_pair(lo[0])
                            hi0, hi0r = ptx.f16x2_as_bf16x2_pair(hi[0])
                            lo1, lo1r = ptx.f16x2_as_bf16x2_pair(lo[1])
                            hi1, hi1r = ptx.f16x2_as_bf16x2_pair(hi[1])
                            c = ptx.mma_m16n8k16_f32((lo0, hi0, lo1, hi1), b, c, "bfloat16")
                            c = ptx.mma_m16n8k16_f32((lo0r, hi0r, lo1r, hi1r), b, c, "bfloat16")
                        for i in cutlass.range_constexpr(4):
                            acc[base + i] = c[i]
            cute.arch.sync_warp()  # every lane is done with the slot before it is refilled
            if st + stages < n_stages:
                self.load_stage(sources, first_col + (st + stages) * size * 16, col_end, dst + slot, per_copy,
                                wide)
            cute.arch.cp_async_commit_group()

        # Each warp's partial tile goes to its own ring (no copies are pending: every stage issued was waited for).
        tile = mt_n * nt_n * 4
        ring_words = cfg.ring_bytes // 4
        cute.arch.sync_warp()
        for i in cutlass.range_constexpr(tile):
            sRing[warp * ring_words + i * 32 + lane] = acc[i]
        cute.arch.sync_threads()
        for idx in cutlass.range(tid, tile * 32, THREADS):
            total = self.tile_sum(sRing, idx, ring_words)
            expert, tok = self.tile_place(idx, e0, t0)
            if expert < rows and tok < tokens:
                mLogits[tok, expert] = total

    @cute.jit
    def tile_sum(self, sRing: cute.Tensor, idx: Int32, ring_words: cutlass.Constexpr) -> Float32:
        """Element ``idx`` of the CTA's logits tile: the warps' partial tiles summed in warp order."""
        total = sRing[idx]
        for w in cutlass.range_constexpr(1, WARPS):
            total = total + sRing[w * ring_words + idx]
        return total

    def tile_place(self, idx, e0, t0):
        """(expert, token) of element ``idx`` of the tile starting at router row ``e0`` and token ``t0``: the MMA
        accumulators' layout (i = idx / 32 the register, el = idx % 32 the lane)."""
        nt_n = self.n_tiles
        i = idx // 32
        el = idx % 32
        c = i % 4
        nt = (i // 4) % nt_n
        mt = i // 4 // nt_n
        return e0 + mt * 16 + el // 4 + 8 * (c // 2), t0 + nt * 8 + 2 * (el % 4) + c % 2

    @cute.jit
    def load_stage(self, sources, col: Int32, col_end: Int32, dst: Int32, per_copy: cutlass.Constexpr,
                   wide: cutlass.Constexpr):
        """This lane's copies of one stage: columns ``col ..+8`` of each of its rows (``sources``) to ``dst`` and
        every ``per_copy`` rows on; zero-filled past ``col_end`` (the slice or the hidden dim) and for rows that
        are not there."""
        if cutlass.const_expr(wide):
            ok = col < col_end
            offset = Int64(cutlass.select_(ok, col, Int32(0))) * 2
            for i in cutlass.range_constexpr(len(sources)):
                row, real = sources[i]
                ptx.cp_async(dst + per_copy * i * ROW_STEP_BYTES, row + offset,
                             cutlass.select_(real & ok, Int32(16), Int32(0)))
        else:
            for half in cutlass.range_constexpr(2):
                c = col + 4 * half
                ok = c < col_end
                offset = Int64(cutlass.select_(ok, c, Int32(0))) * 2
                for i in cutlass.range_constexpr(len(sources)):
                    row, real = sources[i]
                    ptx.cp_async(dst + per_copy * i * ROW_STEP_BYTES + 8 * half, row + offset,
                                 cutlass.select_(real & ok, Int32(8), Int32(0)), 8)

    @cute.jit
    def top_k(self, mLogits: cute.Tensor, mBias: cute.Tensor, mGivenIds: cute.Tensor, mGivenW: cute.Tensor,
              mIds: cute.Tensor, mW: cute.Tensor, mRank: cute.Tensor, mCounts: cute.Tensor, sCount: cute.Tensor,
              single, first: Int32, tokens: Int32, lane: Int32):
        """One warp: the routes of tokens ``first, first + 8, ..`` of the token block (every loop here is unrolled
        at compile time). All their loads first, then each token's selection (independent chains, whose latencies
        overlap), then the stores; lane j writes slot j and takes the route's rank inside its expert from the
        counts in shared memory when ``single`` (one token block), else from the global ones."""
        cfg = self.cfg
        n, k = cfg.num_experts, cfg.top_k
        toks = [first + WARPS * u for u in range((cfg.token_tile + WARPS - 1) // WARPS)]
        rows = [mLogits.iterator.toint() + Int64(cutlass.min(t, tokens - 1)) * mLogits.shape[1] * 4 for t in toks]
        chosen = []  # per token: (ids, weights) of its k routes, in every lane
        if cutlass.const_expr(cfg.method == "given"):
            given = [cutlass.min(t, tokens - 1) for t in toks]
            chosen = [([mGivenIds[t, j] for j in range(k)], [Float32(mGivenW[t, j]) for j in range(k)]) for t in given]
        else:
            chosen = self.choose(rows, mBias, lane)
        gates = [self.shared_gate(row) for row in rows]
        routes = mIds.shape[1]
        for u in cutlass.range_constexpr(len(toks)):
            tok = toks[u]
            mine, w = self.slot_route(*chosen[u], lane)
            if (tok < tokens) & (lane < k):
                mIds[tok, lane] = mine
                mW[tok, lane] = w
                rank = Int32(0)
                if single:
                    rank = atomic_add_shared_u32(sCount.iterator.toint() + mine * 4, Int32(1))
                else:
                    rank = ptx.atomic_add_u32(mCounts.iterator.toint() + Int64(mine) * 4, Int32(1))
                mRank[tok * routes + lane] = rank
            if cutlass.const_expr(cfg.shared != "none"):
                if (tok < tokens) & (lane == k % 32):
                    mIds[tok, k] = Int32(n)
                    mW[tok, k] = gates[u]
                    mRank[tok * routes + k] = tok

    @cute.jit
    def choose(self, rows, mBias: cute.Tensor, lane: Int32):
        """The router's k routes of each token whose fp32 logits start at address ``rows[u]`` (one warp, every
        lane): a list of (ids, weights) in slot order, the weights before ``finish``. The route kernel's top-k and
        the one-token gate/up GEMM that chooses its blocks' experts itself (moe_gemm's ``route``) both run this."""
        cfg = self.cfg
        n, k = cfg.num_experts, cfg.top_k
        expert = [Int32(lane + 32 * i) for i in range(self.per_lane)]
        valid = [x < n for x in expert]
        chosen = []
        logits = [[cutlass.select_(valid[i], ld_cg_f32(row + cutlass.min(expert[i], n - 1) * 4), Float32(NEG_INF))
                   for i in range(self.per_lane)] for row in rows]
        bias = [Float32(0.0)] * self.per_lane
        if cutlass.const_expr(cfg.correction_bias or cfg.logit_bias):
            bias = [Float32(mBias[cutlass.min(expert[i], n - 1)]) for i in range(self.per_lane)]
        if cutlass.const_expr(cfg.logit_bias):  # padding experts stay -inf
            logits = [[logit[i] + bias[i] for i in range(self.per_lane)] for logit in logits]
        scored = [self.scores(logit, expert, valid, bias) for logit in logits] if len(rows) <= 2 else []
        # the one-redux chain where latency rules (<= 2 tokens a warp; H200 route alone M=1 6.43 -> 6.24 us,
        # M=16 8.80 -> 8.51); with 4 tokens a warp its extra work costs more than it saves (M=4096 +2.5 us)
        fast = [self.pick_fast(choice, expert, score) for score, choice, _ in scored] if len(rows) <= 2 else []
        for u in cutlass.range_constexpr(len(fast)):
            picked = cute.make_rmem_tensor(cute.make_layout(k), Int32)
            picked_w = cute.make_rmem_tensor(cute.make_layout(k), Float32)
            for j in cutlass.range_constexpr(k):
                picked[j] = fast[u][0][j]
                picked_w[j] = fast[u][1][j]
            if not fast[u][2]:  # a tie, a NaN or a zero among the candidates (all rare): the exact search
                exact = self.pick(scored[u][1], expert, scored[u][0])
                for j in cutlass.range_constexpr(k):
                    picked[j] = exact[0][j]
                    picked_w[j] = exact[1][j]
            weights = self.normalized([picked_w[j] for j in range(k)], scored[u][2], lane)
            chosen.append(([picked[j] for j in range(k)], weights))
        if cutlass.const_expr(len(fast) == 0):
            for logit in logits:  # per token, scores then picks (the order the kernel was measured in)
                score, choice, total = self.scores(logit, expert, valid, bias)
                ids, weights = self.pick(choice, expert, score)
                chosen.append((ids, self.normalized(weights, total, lane)))
        return chosen

    def slot_route(self, ids, weights, lane):
        """(expert, weight) of this lane's slot (lane j: route j) of one token's ``choose``d or given routes; the
        router's weights finished (renormalised, scaled), the caller's as given. Traced inline."""
        mine, w = ids[0], weights[0]
        for j in range(1, self.cfg.top_k):
            mine = cutlass.select_(lane == j, ids[j], mine)
            w = cutlass.select_(lane == j, weights[j], w)
        if self.cfg.method != "given":
            w = self.finish(weights, w)  # this lane's slot only
        return mine, w

    def shared_gate(self, row):
        """The shared expert's weight for the token whose logits start at ``row``: sigmoid of its gate logit (row
        E of the router) when gated, else 1. Traced inline."""
        if self.cfg.shared != "gated":
            return Float32(1.0)
        return Float32(1.0) / (Float32(1.0) + cute.math.exp(-ld_cg_f32(row + self.cfg.num_experts * 4)))

    def scores(self, logit, expert, valid, bias):
        """One token's (score, choice, total) of this lane's experts: the selection comes from the choices, the
        weights from the scores of the chosen divided by ``total`` (softmax: the sum of the exponentials, the
        same in every lane; else None). Dividing only the chosen, after the selection, leaves the selection
        chain free of the divisions (whose slow-path branches ptxas does not schedule across) and gives the
        same bits as dividing every score first."""
        cfg = self.cfg
        if cfg.method == "softmax_topk":
            m = logit[0]
            for i in range(1, self.per_lane):
                m = cutlass.max(m, logit[i])
            m = warp_max(m)
            ex = [cutlass.select_(valid[i], cute.math.exp(logit[i] - m), Float32(0.0)) for i in range(self.per_lane)]
            s = ex[0]
            for i in range(1, self.per_lane):
                s = s + ex[i]
            total = warp_sum(s)
            score = ex
            choice = list(logit)  # softmax is monotonic: select on the logits
        else:
            total = None
            score = [Float32(1.0) / (Float32(1.0) + cute.math.exp(-logit[i])) for i in range(self.per_lane)]
            choice = []
            for i in range(self.per_lane):
                c = score[i]
                if cfg.correction_bias:
                    c = c + bias[i]
                choice.append(cutlass.select_(valid[i], c, Float32(NEG_INF)))
            if cfg.n_group > 1:
                choice = self.limit_groups(choice, expert)
        return score, choice, total

    @staticmethod
    def normalized(weights, total, lane):
        """The chosen routes' scores over ``scores``' total (softmax), or as they are: lane j divides score j and
        the others take it by shuffle (one division a lane, not k)."""
        if total is None:
            return weights
        mine = weights[0]
        for j in range(1, len(weights)):
            mine = cutlass.select_(lane == j, weights[j], mine)
        mine = mine / total
        return [cute.arch.shuffle_sync(mine, j) for j in range(len(weights))]

    def pick(self, choice, expert, score):
        """The exact search: k times the best (higher choice, ties to the lower id), then -inf. Returns the ids and
        the scores of the k routes, in every lane."""
        ids, weights = [], []
        for j in range(self.cfg.top_k):
            v, idx, sc = lane_best(choice, expert, score)
            _, idx, sc = warp_best(v, idx, sc)
            ids.append(idx)
            weights.append(sc)
            choice = [cutlass.select_(expert[i] == idx, Float32(NEG_INF), choice[i]) for i in range(self.per_lane)]
        return ids, weights

    def pick_fast(self, choice, expert, score):
        """``pick`` with one ``redux.sync`` on its serial path per route: the best choice's order key (a lane's
        max, then the warp's), and the candidate holding it -> -inf. That holder's id (a second redux) and score
        (a shuffle) are off the chain. It is ``pick`` whenever each of those keys has exactly one holder and the
        lanes' float order is key order (no NaN, no +-0 among the choices); ``clean`` (warp-uniform) says so, or
        the caller runs ``pick``."""
        n_held = Int32(0)
        for c in choice:
            n_held = n_held + cutlass.select_((c != c) | (c == Float32(0.0)), Int32(64), Int32(0))
        keys = [cutlass.Uint32(ptx.order_key(c)) for c in choice]
        ids, weights = [], []
        for j in range(self.cfg.top_k):
            best = list(keys)
            while len(best) > 1:  # a tree
                pairs = [cutlass.max(best[i], best[i + 1]) for i in range(0, len(best) - 1, 2)]
                best = pairs + best[len(best) // 2 * 2:]
            top = cute.arch.warp_redux_sync(best[0], "umax")
            hit = [key == top for key in keys]
            mine, sc = Int32(NO_ID), score[0]
            for i in range(len(keys)):
                mine = cutlass.select_(hit[i], expert[i], mine)
                sc = cutlass.select_(hit[i], score[i], sc)
                n_held = n_held + cutlass.select_(hit[i], Int32(1), Int32(0))
            win = cute.arch.warp_redux_sync(mine, "min")
            ids.append(win)
            weights.append(cute.arch.shuffle_sync(sc, win % 32))
            keys = [cutlass.Uint32(cutlass.select_(hit[i], cutlass.Uint32(NEG_INF_KEY), keys[i]))
                    for i in range(len(keys))]
        return ids, weights, cute.arch.warp_redux_sync(n_held, "add") == self.cfg.top_k

    def finish(self, weights, mine):
        """The weight of route ``mine`` (one of ``weights``, the k chosen routes' weights from their scores):
        optionally renormalised over the k, times ``scale``. One division per lane: each lane stores one slot."""
        cfg = self.cfg
        if cfg.normalize:
            total = weights[0]
            for j in range(1, cfg.top_k):
                total = total + weights[j]
            mine = mine / (total + Float32(1e-20))
        return mine * Float32(cfg.scale)

    def limit_groups(self, choice, expert):
        """-inf for the experts outside the topk_group groups whose two best choices sum highest."""
        cfg = self.cfg
        size = cfg.num_experts // cfg.n_group
        group_score = []
        for g in range(cfg.n_group):
            member = [(x >= g * size) & (x < (g + 1) * size) for x in expert]
            vals = [cutlass.select_(member[i], choice[i], Float32(NEG_INF)) for i in range(len(choice))]
            best = Float32(0.0)
            for r in range(min(2, size)):
                v, idx, _ = lane_best(vals, expert, vals)
                v, idx, _ = warp_best(v, idx, v)
                best = best + v
                vals = [cutlass.select_(expert[i] == idx, Float32(NEG_INF), vals[i]) for i in range(len(vals))]
            group_score.append(best)
        keep = [Int32(0)] * cfg.n_group
        for r in range(cfg.topk_group):
            v, gi = group_score[0], Int32(0)
            for g in range(1, cfg.n_group):
                take = _better(v, gi, group_score[g], Int32(g))
                v, gi = cutlass.select_(take, group_score[g], v), cutlass.select_(take, Int32(g), gi)
            for g in range(cfg.n_group):
                hit = gi == g
                keep[g] = cutlass.select_(hit, Int32(1), keep[g])
                group_score[g] = cutlass.select_(hit, Float32(NEG_INF), group_score[g])
        out = []
        for i, x in enumerate(expert):
            kept = Int32(0)
            for g in range(cfg.n_group):
                kept = cutlass.select_((x >= g * size) & (x < (g + 1) * size), keep[g], kept)
            out.append(cutlass.select_(kept != 0, choice[i], Float32(NEG_INF)))
        return out

    @cute.jit
    def pack(self, mCounts: cute.Tensor, mExpertRow: cute.Tensor, mBlockExpert: cute.Tensor, mRowRoute: cute.Tensor,
             tokens: Int32, block_rows: Int32, sCount: cute.Tensor, sFlag: cute.Tensor, sScan: cute.Tensor,
             tid: Int32, local: cutlass.Constexpr):
        """One CTA: each expert's rows padded to ``block_rows``, in expert order. The counts come from ``sCount``
        when ``local`` (counted there by this CTA), else from ``mCounts``, zeroed for the next launch."""
        cfg = self.cfg
        experts = cfg.packed_experts
        counts = mCounts.iterator.toint()
        # Exclusive prefix sum of the padded counts: thread t owns experts [t*per, (t+1)*per).
        per = (experts + THREADS - 1) // THREADS
        first = cutlass.min(tid * per, experts)
        last = cutlass.min(first + per, experts)
        rows = Int32(0)
        for e in range(first, last):
            count = Int32(tokens)  # the shared expert (id E) takes every token
            if e < cfg.num_experts:
                if cutlass.const_expr(local):
                    count = sCount[e]
                else:
                    count = ld_cg_s32(counts + Int64(e) * 4)
                    ptx.st_global_u32(counts + Int64(e) * 4, Int32(0))
            sCount[e] = count
            rows = rows + (count + block_rows - 1) // block_rows * block_rows
        lane = tid % 32
        scan = rows
        for bit in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(scan, 1 << bit)
            scan = scan + cutlass.select_(lane >= (1 << bit), up, Int32(0))
        if lane == 31:
            sScan[tid // 32] = scan
        cute.arch.sync_threads()
        start = scan - rows
        for w in cutlass.range_constexpr(WARPS):
            start = start + cutlass.select_(w < tid // 32, sScan[w], Int32(0))
        if tid == THREADS - 1:
            sFlag[2] = (start + rows) // block_rows
        for e in range(first, last):
            count = sCount[e]
            blocks = (count + block_rows - 1) // block_rows
            mExpertRow[e] = start
            for b in range(blocks):
                mBlockExpert[start // block_rows + b] = e
            for r in range(start + count, start + blocks * block_rows):
                mRowRoute[r] = -1
            start = start + blocks * block_rows
        cute.arch.sync_threads()
        for b in range(sFlag[2] + tid, mBlockExpert.shape[0], THREADS):
            mBlockExpert[b] = -1
