"""Routing of the fused MoE layer in one launch: router logits, top-k, and the routes packed by expert.

Grid ``(ceil(E_r/4), ceil(M/8))``, 4 warps: warp w of CTA (c, b) computes the fp32 logits of router row
``4c + w`` for tokens ``8b .. 8b+7`` (``E_r`` = experts, plus the shared-expert gate as row E when there is one).
The last CTA of token block b to finish (device-scope fence + arrival counter, as the dense GEMM's fused
epilogue) turns those tokens' logits into ``topk_ids / topk_weights [M, k']``, one warp per token:
  softmax_topk      softmax over the experts, top-k, optional renormalisation, times ``scale``
  sigmoid_noaux_tc  sigmoid scores; choice = score + correction bias; with n_group > 1 only the topk_group
                    groups whose two best choices sum highest compete; weights are the scores of the chosen,
                    optionally renormalised, times ``scale``
  given             the caller's ``topk_ids / topk_weights`` as they are
Column k (when the layer has shared experts) routes every token to "expert" E with weight sigmoid(gate logit)
or 1. Ties go to the lower expert id.
The last token block to finish packs the routes (one CTA): counts per expert, each padded to the route block
``T`` (the GEMM's tokens per CTA), prefix sums, then ``row_route[r]`` = route ``t*k' + j`` of packed row r (-1:
padding), ``route_row`` its inverse and ``block_expert[b]`` = the expert of rows ``b*T ..`` (-1: unused).
Row order inside an expert follows shared-memory atomics, which changes no result: every packed row is
computed independently and the top-k sum reads routes in (token, slot) order. Both arrival counters reset
themselves, so the launch replays in a CUDA graph with no host work.
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

TOKENS_PER_CTA = 8
EXPERTS_PER_CTA = 4  # one router row per warp
THREADS = 32 * EXPERTS_PER_CTA
METHODS = ("softmax_topk", "sigmoid_noaux_tc", "given")
NEG_INF = float("-inf")


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
    shared: str = "none"  # "none" | "ungated" | "gated"
    x_dtype: str = "float16"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"routing method must be one of {', '.join(METHODS)}")
        if not 1 <= self.top_k <= min(self.num_experts, 32) or self.num_experts > 1024:
            raise ValueError(f"top-{self.top_k} of {self.num_experts} experts is not supported")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{self.num_experts} experts in {self.n_group} groups, top {self.topk_group}")
        if self.shared not in ("none", "ungated", "gated"):
            raise ValueError("shared must be none, ungated or gated")

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


@dsl_user_op
def ld_cg_f32(gmem_addr, *, loc=None, ip=None) -> Float32:
    """One fp32 another CTA of this launch wrote (after a fence): from L2, never a stale L1 line."""
    return Float32(llvm.inline_asm(T.f32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.f32 $0, [$1];",
                                   "=f,l", has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_cg_s32(gmem_addr, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.b32 $0, [$1];",
                                 "=r,l", has_side_effects=True, loc=loc, ip=ip))


def _better(v, i, ov, oi):
    """Does candidate (ov, oi) beat (v, i)? Higher value, ties to the lower index."""
    return (ov > v) | ((ov == v) & (oi < i))


def warp_argmax(v, i, extra):
    """Butterfly argmax over a warp of (value, index, extra): every lane ends with the winner's triple."""
    for bit in range(5):
        offset = 16 >> bit
        ov = cute.arch.shuffle_sync_bfly(v, offset)
        oi = cute.arch.shuffle_sync_bfly(i, offset)
        oe = cute.arch.shuffle_sync_bfly(extra, offset)
        take = _better(v, i, ov, oi)
        v, i, extra = cutlass.select_(take, ov, v), cutlass.select_(take, oi, i), cutlass.select_(take, oe, extra)
    return v, i, extra


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
        self.x_type = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[config.x_dtype]

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, H] fp16/bf16
        mRouter: cute.Tensor,  # [E_r, H] fp16
        mBias: cute.Tensor,  # [E] fp32 correction bias (any fp32 tensor without one)
        mGivenIds: cute.Tensor,  # [M, k] int32 ("given" only; else any int32 tensor)
        mGivenW: cute.Tensor,  # [M, k] fp32
        mLogits: cute.Tensor,  # [M, E_r] fp32 scratch
        mIds: cute.Tensor,  # [M, k'] int32
        mW: cute.Tensor,  # [M, k'] fp32
        mCounters: cute.Tensor,  # int32 [>= ceil(M/8) + 1], zero before the first launch
        mBlockExpert: cute.Tensor,  # [blocks] int32
        mRowRoute: cute.Tensor,  # [blocks * T] int32
        mRouteRow: cute.Tensor,  # [M * k'] int32
        block_rows: Int32,  # T
        stream: cuda.CUstream,
    ):
        grid = ((self.cfg.router_rows + EXPERTS_PER_CTA - 1) // EXPERTS_PER_CTA,
                (mX.shape[0] + TOKENS_PER_CTA - 1) // TOKENS_PER_CTA, 1)
        self.kernel(mX, mRouter, mBias, mGivenIds, mGivenW, mLogits, mIds, mW, mCounters, mBlockExpert, mRowRoute,
                    mRouteRow, block_rows).launch(grid=grid, block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRouter: cute.Tensor, mBias: cute.Tensor, mGivenIds: cute.Tensor,
               mGivenW: cute.Tensor, mLogits: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
               mCounters: cute.Tensor, mBlockExpert: cute.Tensor, mRowRoute: cute.Tensor, mRouteRow: cute.Tensor,
               block_rows: Int32):
        cfg = self.cfg
        tid, _, _ = cute.arch.thread_idx()
        chunk, tb, _ = cute.arch.block_idx()
        n_chunks, n_tb, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        tokens = mX.shape[0]
        hidden = mX.shape[1]
        tok0 = tb * TOKENS_PER_CTA

        smem = SmemAllocator()
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        sScan = smem.allocate_tensor(Int32, cute.make_layout(THREADS // 32), 16)
        sCount = smem.allocate_tensor(Int32, cute.make_layout(cfg.packed_experts), 16)
        sCursor = smem.allocate_tensor(Int32, cute.make_layout(cfg.packed_experts), 16)

        # --- logits: row e of the router against 8 tokens, 4 columns per lane per step --------------------
        e = chunk * EXPERTS_PER_CTA + warp
        if e < cfg.router_rows:
            acc = cute.make_rmem_tensor(cute.make_layout(TOKENS_PER_CTA), Float32)
            acc.fill(0.0)
            row_addr = mRouter.iterator.toint() + Int64(e) * hidden * 2
            for step in cutlass.range((hidden + 127) // 128, unroll=4):
                col = (step * 32 + lane) * 4
                if col < hidden:
                    r = ptx.ld_global_cg_v4_f16_as_f32(row_addr + col * 2)
                    for t in cutlass.range_constexpr(TOKENS_PER_CTA):
                        tok = cutlass.min(tok0 + t, tokens - 1)
                        for i in cutlass.range_constexpr(4):
                            acc[t] = acc[t] + Float32(mX[tok, col + i]) * r[i]
            for t in cutlass.range_constexpr(TOKENS_PER_CTA):
                total = warp_sum(acc[t])
                if lane == 0 and tok0 + t < tokens:
                    mLogits[tok0 + t, e] = total

        # --- the last CTA of this token block: top-k of its tokens ----------------------------------------
        counter = mCounters.iterator.toint() + Int64(tb) * 4
        ptx.count_in(counter, n_chunks, sFlag, 0, tid)
        if sFlag[0] != 0:
            ptx.fence_gpu()
            for t in cutlass.range_constexpr(TOKENS_PER_CTA // EXPERTS_PER_CTA):
                tok = tok0 + warp * (TOKENS_PER_CTA // EXPERTS_PER_CTA) + t
                if tok < tokens:
                    self.top_k(mLogits, mBias, mGivenIds, mGivenW, mIds, mW, tok, lane)
            if tid == 0:
                ptx.st_global_u32(counter, Int32(0))
            # --- the last token block: pack the routes ----------------------------------------------------
            last = mCounters.iterator.toint() + Int64(n_tb) * 4
            ptx.count_in(last, n_tb, sFlag, 1, tid)
            if sFlag[1] != 0:
                ptx.fence_gpu()
                self.pack(mIds, mBlockExpert, mRowRoute, mRouteRow, block_rows, sCount, sCursor, sFlag, sScan, tid)
                if tid == 0:
                    ptx.st_global_u32(last, Int32(0))

    @cute.jit
    def top_k(self, mLogits: cute.Tensor, mBias: cute.Tensor, mGivenIds: cute.Tensor, mGivenW: cute.Tensor,
              mIds: cute.Tensor, mW: cute.Tensor, tok: Int32, lane: Int32):
        """One warp: token ``tok``'s routes (every loop here is unrolled at compile time)."""
        cfg = self.cfg
        n, k = cfg.num_experts, cfg.top_k
        row = mLogits.iterator.toint() + Int64(tok) * mLogits.shape[1] * 4
        ids, weights = [], []
        if cutlass.const_expr(cfg.method == "given"):
            for j in cutlass.range_constexpr(k):
                ids.append(mGivenIds[tok, j])
                weights.append(Float32(mGivenW[tok, j]))
        else:
            expert = [lane + 32 * i for i in range(self.per_lane)]
            valid = [x < n for x in expert]
            logit = [cutlass.select_(valid[i], ld_cg_f32(row + cutlass.min(expert[i], n - 1) * 4), Float32(NEG_INF))
                     for i in range(self.per_lane)]
            if cutlass.const_expr(cfg.method == "softmax_topk"):
                m = logit[0]
                for i in cutlass.range_constexpr(1, self.per_lane):
                    m = cutlass.max(m, logit[i])
                m = warp_max(m)
                ex = [cutlass.select_(valid[i], cute.math.exp(logit[i] - m), Float32(0.0)) for i in range(self.per_lane)]
                s = ex[0]
                for i in cutlass.range_constexpr(1, self.per_lane):
                    s = s + ex[i]
                s = warp_sum(s)
                score = [x / s for x in ex]
                choice = list(logit)  # softmax is monotonic: select on the logits
            else:
                score = [Float32(1.0) / (Float32(1.0) + cute.math.exp(-logit[i])) for i in range(self.per_lane)]
                choice = []
                for i in cutlass.range_constexpr(self.per_lane):
                    c = score[i]
                    if cutlass.const_expr(cfg.correction_bias):
                        c = c + Float32(mBias[cutlass.min(expert[i], n - 1)])
                    choice.append(cutlass.select_(valid[i], c, Float32(NEG_INF)))
                if cutlass.const_expr(cfg.n_group > 1):
                    choice = self.limit_groups(choice, expert, lane)
            for j in cutlass.range_constexpr(k):
                v, idx, sc = choice[0], Int32(expert[0]), score[0]
                for i in cutlass.range_constexpr(1, self.per_lane):
                    take = _better(v, idx, choice[i], Int32(expert[i]))
                    v, idx, sc = (cutlass.select_(take, choice[i], v), cutlass.select_(take, Int32(expert[i]), idx),
                                  cutlass.select_(take, score[i], sc))
                v, idx, sc = warp_argmax(v, idx, sc)
                ids.append(idx)
                weights.append(sc)
                choice = [cutlass.select_(Int32(expert[i]) == idx, Float32(NEG_INF), choice[i])
                          for i in range(self.per_lane)]
            if cutlass.const_expr(cfg.normalize):
                total = weights[0]
                for j in cutlass.range_constexpr(1, k):
                    total = total + weights[j]
                weights = [w / (total + Float32(1e-20)) for w in weights]
            weights = [w * Float32(cfg.scale) for w in weights]
        if lane == 0:
            for j in cutlass.range_constexpr(k):
                mIds[tok, j] = ids[j]
                mW[tok, j] = weights[j]
            if cutlass.const_expr(cfg.shared != "none"):
                gate = Float32(1.0)
                if cutlass.const_expr(cfg.shared == "gated"):
                    gate = Float32(1.0) / (Float32(1.0) + cute.math.exp(-ld_cg_f32(row + n * 4)))
                mIds[tok, k] = Int32(n)
                mW[tok, k] = gate

    def limit_groups(self, choice, expert, lane):
        """-inf for the experts outside the topk_group groups whose two best choices sum highest."""
        cfg = self.cfg
        size = cfg.num_experts // cfg.n_group
        group_score = []
        for g in range(cfg.n_group):
            member = [(Int32(x) >= g * size) & (Int32(x) < (g + 1) * size) for x in expert]
            vals = [cutlass.select_(member[i], choice[i], Float32(NEG_INF)) for i in range(len(choice))]
            best = Float32(0.0)
            for r in range(min(2, size)):
                v, idx = vals[0], Int32(expert[0])
                for i in range(1, len(vals)):
                    take = _better(v, idx, vals[i], Int32(expert[i]))
                    v, idx = cutlass.select_(take, vals[i], v), cutlass.select_(take, Int32(expert[i]), idx)
                v, idx, _ = warp_argmax(v, idx, v)
                best = best + v
                vals = [cutlass.select_(Int32(expert[i]) == idx, Float32(NEG_INF), vals[i]) for i in range(len(vals))]
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
                kept = cutlass.select_((Int32(x) >= g * size) & (Int32(x) < (g + 1) * size), keep[g], kept)
            out.append(cutlass.select_(kept != 0, choice[i], Float32(NEG_INF)))
        return out

    @cute.jit
    def pack(self, mIds: cute.Tensor, mBlockExpert: cute.Tensor, mRowRoute: cute.Tensor, mRouteRow: cute.Tensor,
             block_rows: Int32, sCount: cute.Tensor, sCursor: cute.Tensor, sFlag: cute.Tensor, sScan: cute.Tensor,
             tid: Int32):
        """One CTA: routes grouped by expert, each expert's rows padded to ``block_rows``."""
        experts = self.cfg.packed_experts
        routes = mIds.shape[0] * mIds.shape[1]
        ids = mIds.iterator.toint()
        for e in range(tid, experts, THREADS):
            sCount[e] = 0
        cute.arch.sync_threads()
        for i in range(tid, routes, THREADS):
            cute.arch.atomic_add(sCount.iterator + ld_cg_s32(ids + Int64(i) * 4), Int32(1))
        cute.arch.sync_threads()
        # Exclusive prefix sum of the padded counts: thread t owns experts [t*per, (t+1)*per).
        per = (experts + THREADS - 1) // THREADS
        first = cutlass.min(tid * per, experts)
        last = cutlass.min(first + per, experts)
        rows = Int32(0)
        for e in range(first, last):
            rows = rows + (sCount[e] + block_rows - 1) // block_rows * block_rows
        lane = tid % 32
        scan = rows
        for bit in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(scan, 1 << bit)
            scan = scan + cutlass.select_(lane >= (1 << bit), up, Int32(0))
        if lane == 31:
            sScan[tid // 32] = scan
        cute.arch.sync_threads()
        start = scan - rows
        for w in cutlass.range_constexpr(THREADS // 32):
            start = start + cutlass.select_(w < tid // 32, sScan[w], Int32(0))
        if tid == THREADS - 1:
            sFlag[2] = (start + rows) // block_rows
        for e in range(first, last):
            blocks = (sCount[e] + block_rows - 1) // block_rows
            sCursor[e] = start
            for b in range(blocks):
                mBlockExpert[start // block_rows + b] = e
            start = start + blocks * block_rows
        cute.arch.sync_threads()
        for b in range(sFlag[2] + tid, mBlockExpert.shape[0], THREADS):
            mBlockExpert[b] = -1
        for e in range(tid, experts, THREADS):
            count = sCount[e]
            start = sCursor[e]
            for r in range(start + count, start + (count + block_rows - 1) // block_rows * block_rows):
                mRowRoute[r] = -1
        cute.arch.sync_threads()
        for i in range(tid, routes, THREADS):
            e = ld_cg_s32(ids + Int64(i) * 4)
            pos = cute.arch.atomic_add(sCursor.iterator + e, Int32(1))
            mRowRoute[pos] = i
            mRouteRow[i] = pos
