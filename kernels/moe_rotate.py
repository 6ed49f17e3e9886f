"""The rotations of the fused MoE layer around its two grouped GEMMs, one warp per 128-column block of a token or
packed row; lane l holds columns 4l..4l+3 (8-byte loads and stores). At large M the input rotation holds 8 values a
lane instead (a warp per two blocks, 16-byte x and X accesses; ``RouteInputRotationConfig.lane_values``).

RouteInputRotation  per token t and route slot j whose expert e is in this launch's group (row p): packed row
                    ``r = expert_row[e] + rank[t, j]`` (``moe_route``) gets ``X[0, r] = H128(x[t] * gate_suh[p])``,
                    ``X[1, r] = H128(x[t] * up_suh[p])`` (fp16). It also writes ``row_route[r]`` and
                    ``route_row[t*k' + j]``. A warp takes ``k' / slot_groups`` of a token's slots: all of them at
                    large M (x read once), one each at decode (M=1: 16 warps doing 16 rotations each in turn
                    took 10.9 us on the H200).
Intermediate        per packed row: gate, up = split sums of the gate/up GEMM partials;
                    ``g = H128(gate) * gate_svh[p]``, ``u = H128(up) * up_svh[p]`` (plus their biases: ``Gating``),
                    ``h = silu(g) * u`` or gpt-oss's clamped SwiGLU (zero past the true intermediate size),
                    ``X2[r] = H128(h * down_suh[p])`` (fp16)
TopKSum             per token t: ``y[t] = sum_j w[t, j] * (H128(sum_s P2[s, route_row[t, j]]) * down_svh[e] (+ down
                    bias[e]))`` in fp32,
                    slots j in order and splits in order (deterministic), then cast to y's dtype. A CTA takes
                    ``blocks_per_cta`` column blocks of a token; its warps share the slots (a slot's indices are
                    loaded once for all its blocks) and the terms are summed from shared memory in slot order.
Rows of unused blocks, padding rows (row_route -1) and rows of other groups are skipped; nothing reads them. With
``by_route`` the Intermediate's warps go by route instead (row ``route_row[t*k' + j]``, group from ``topk_ids``), so
that no CTA lands on padding rows.
X and X2 rows are stored in the column order the MoE GEMMs read them in (``x_order``, ``store_x_values``).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from . import ptx
from .hadamard_mma import RUN, hadamard128_f16, run_column
from .rotate import (
    INV_SQRT_128,
    check_lane_values,
    hadamard128,
    lane_column,
    load4,
    load_row,
    one_access,
    row_values,
    store4,
    store_x_values,
)


@cute.jit
def row_words(mX: cute.Tensor, row: Int32, col0: Int32):
    """fp16 ``x[row, col0 .. col0+7]`` as four words, columns past x's width zero: one 16-byte load where the
    eight are inside the row and aligned (x rows may be strided views of any width), else by column."""
    w = cute.make_rmem_tensor(cute.make_layout(4), Int32)
    addr = mX.iterator.toint() + (Int64(row) * mX.stride[0] + col0) * 2
    if one_access(addr, col0, 8, mX.shape[1], 16):
        loaded = ptx.ld_global_v4_b32(addr)
        for i in cutlass.range_constexpr(4):
            w[i] = loaded[i]
    else:
        v = row_values(mX, row, col0, 8, "float16")
        for i in cutlass.range_constexpr(4):
            w[i] = ptx.pack_f32x2(v[2 * i], v[2 * i + 1], "float16")
    return [w[i] for i in range(4)]


def suh_words(mSuh: cute.Tensor, row, col0):
    """The run (``hadamard_mma.run_column``) of fp16 ``suh[row, col0 + ..]`` of a contiguous matrix with 16-byte
    aligned rows as 16 words: four 16-byte loads (col0: the block's first column plus 8q)."""
    addr = mSuh.iterator.toint() + (Int64(row) * mSuh.shape[1] + col0) * 2
    return [w for i in range(4) for w in ptx.ld_global_v4_b32(addr + 64 * i)]


def store_run(x_addr, row, rows, width, col0, values, x_order: str):
    """A thread's run (``hadamard_mma``: 32 Float32, piece i at columns ``col0 + 32i ..``, col0 the block's first
    column plus 8q) of row ``row`` of a GEMM input X (``store_x_values``): four 16-byte stores."""
    for i in range(4):
        store_x_values(x_addr, row, rows, width, col0 + 32 * i, values[8 * i:8 * i + 8], x_order)


ROWS_PER_CTA = 4  # one warp per row
BLOCKS_PER_CTA = 4  # input rotation: one warp per 128-column block of one token
SUM_WARPS = 8  # top-k sum: warps sharing a token's slots
# Fewer SASS in the intermediate (``intermediate_row``: the Intermediate launch and the gate/up GEMMs' fused tail),
# rounding moved by ulps: SiLU's exponential by ex2.approx; the up rotation's 1/128 (exact) standing for the last
# rotation's orthonormal scale. (A top-k slot's weight taking its rotation's scale once cut the TopKSum's SASS 433 ->
# 418 but let ptxas issue one block's partials, not two, before the first butterfly: not done.) H200, E=128 top-8
# 2048x768 K=4 mcg, three rounds, us (off -> on): Intermediate kernel M=1024 23.17 -> 22.57, M=4096 97.09 -> 92.91;
# layer M=1 24.69 -> 24.56, M=16 103.12 -> 102.94 (within the spread) (docs/perf.md, forty-seventh session). An A/B
# switch.
FAST_MATH = True
LOG2_E = 1.4426950408889634


def group_row_of(mGroupRow, expert, group_first: int, group_size):
    """Row of ``expert`` in a launch's expert group (its stacked tensors), negative outside it (and for a negative
    ``expert``): where the group is the ``group_size`` consecutive ids from ``group_first``, ``expert - group_first``
    with no load between the expert and the loads it addresses; else (``group_first`` -1) the ``group_row`` table's.
    Traced inline."""
    if group_first >= 0:
        p = expert - group_first
        return cutlass.select_(p < group_size, p, Int32(-1))
    return mGroupRow[cutlass.max(expert, 0)]


@cute.jit
def route_of_row(mRowRoute: cute.Tensor, mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, row: Int32,
                 block_rows, group_first: cutlass.Constexpr, group_size: Int32):
    """(route or -1, row in the group's stacked tensors or -1) of packed row ``row`` (``block_rows``: an Int32, or a
    Python int where the kernel knows it at compile time; ``group_first``, ``group_size``: ``group_row_of``'s)."""
    expert = Int32(-1)
    route = Int32(-1)
    p = Int32(-1)
    if row < mRowRoute.shape[0]:
        expert = mBlockExpert[row // block_rows]
        if expert >= 0:
            p = group_row_of(mGroupRow, expert, group_first, group_size)
            route = mRowRoute[row]
    return route, p


def split_parts(mP, row, col0, lane, splits: int):
    """Every split's four consecutive columns ``P[s, row, col0 + 4*lane ..]``, loaded (not yet summed)."""
    return split_values(mP, row, col0 + 4 * lane, splits, 4)


def split_values(mP, row, col, splits: int, n: int):
    """Every split's ``n`` (4 or 8) consecutive columns ``P[s, row, col ..]`` as fp32, four a load (16 bytes of fp32
    partials, 8 of fp16 ones: ``partials_dtype``), not yet summed."""
    size = mP.element_type.width // 8
    load = ptx.ld_global_cg_v4_f16_as_f32 if size == 2 else ptx.ld_global_cg_v4_f32
    addr = mP.iterator.toint() + (Int64(row) * mP.shape[2] + col) * size
    split_bytes = Int64(mP.shape[1]) * mP.shape[2] * size
    return [[v for c in range(0, n, 4) for v in load(addr + s * split_bytes + size * c)] for s in range(splits)]


def sum_parts(parts):
    """``split_parts`` (or ``split_values``) summed in split order."""
    return [sum_in_order([p[i] for p in parts]) for i in range(len(parts[0]))]


def summed(mP, row, col0, lane, splits: int):
    """Four consecutive columns of ``sum_s P[s, row, col0 + 4*lane ..]``, splits in index order. The split count
    is a compile-time constant, so every load is issued before the first add waits."""
    return sum_parts(split_parts(mP, row, col0, lane, splits))


def sum_in_order(values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def check_launch_fields(config):
    """group_first and min_ctas_per_sm, fields of MoEGemmConfig and of the rotation launches' configs."""
    if config.group_first < -1:
        raise ValueError("group_first is an expert id, or -1 for the group_row table")
    if config.min_ctas_per_sm < 0:
        raise ValueError("min_ctas_per_sm is a CTA count (0: no launch bounds)")


@dataclass(frozen=True)
class RouteInputRotationConfig:
    x_dtype: str  # "float16" | "bfloat16"
    routes_per_token: int = 1  # k'
    slot_groups: int = 1  # CTAs (grid z) that share a token's route slots
    x_order: str = "rows"  # X's column order (the gate/up GEMM's)
    lane_values: int = 4  # a lane's columns of a 128-block: 4, or 8 (a warp per two blocks, 16-byte x and X)
    # "shuffle": butterflies, a warp per token; "mma": a warp per 8 consecutive routes (t*k' + j) and one block,
    # both planes' H128s on the tensor cores (``hadamard_mma``, its runs: 16-byte x, suh and X accesses), for fp16
    # x and X in rows or stages order (slot_groups and lane_values unused). suh is scaled by 2^suh_shift in
    # registers (exact: a power of two) so that x * suh splits exactly into fp16 hi + lo; the output undoes it.
    hadamard: str = "shuffle"
    suh_shift: int = 0
    early_next: bool = False  # PDL: let the gate/up GEMM launch right after this kernel's wait
    group_first: int = -1  # >= 0: the group's experts are consecutive ids from this one (group_row_of: no table)
    min_ctas_per_sm: int = 0  # > 0: launch bounds asking ptxas for this many CTAs an SM (ptx.occupancy_bounds)

    def __post_init__(self):
        check_lane_values(self.lane_values)
        check_launch_fields(self)
        if self.hadamard not in ("shuffle", "mma"):
            raise ValueError("hadamard must be shuffle or mma")
        if self.hadamard == "mma" and (self.x_dtype != "float16" or self.x_order not in ("rows", "stages")):
            raise ValueError("tensor-core input rotations take fp16 x and X in rows or stages order")
        if not -14 <= self.suh_shift <= 15:
            raise ValueError("suh_shift must keep 2^suh_shift a normal fp16 (-14 .. 15)")

    @property
    def slots_per_warp(self) -> int:
        return -(-self.routes_per_token // self.slot_groups)

    @property
    def blocks_per_warp(self) -> int:
        return self.lane_values // 4


class RouteInputRotation:
    def __init__(self, config: RouteInputRotationConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mGateSuh: cute.Tensor, mUpSuh: cute.Tensor, mXr: cute.Tensor,
                 mIds: cute.Tensor, mRank: cute.Tensor, mExpertRow: cute.Tensor, mGroupRow: cute.Tensor,
                 mRowRoute: cute.Tensor, mRouteRow: cute.Tensor, stream: cuda.CUstream):
        args = (mX, mGateSuh, mUpSuh, mXr, mIds, mRank, mExpertRow, mGroupRow, mRowRoute, mRouteRow)
        if cutlass.const_expr(self.cfg.hadamard == "mma"):
            grid = ((mGateSuh.shape[1] // 128 + BLOCKS_PER_CTA - 1) // BLOCKS_PER_CTA,
                    (mX.shape[0] * self.cfg.routes_per_token + 7) // 8, 1)
            self.kernel_mma(*args).launch(grid=grid, block=(32 * BLOCKS_PER_CTA, 1, 1), stream=stream,
                                          **ptx.pdl_launch(), **ptx.occupancy_bounds(self.cfg.min_ctas_per_sm))
        else:
            per_cta = BLOCKS_PER_CTA * self.cfg.blocks_per_warp
            grid = (mX.shape[0], (mGateSuh.shape[1] // 128 + per_cta - 1) // per_cta, self.cfg.slot_groups)
            self.kernel(*args).launch(grid=grid, block=(32 * BLOCKS_PER_CTA, 1, 1), stream=stream,
                                      **ptx.pdl_launch(), **ptx.occupancy_bounds(self.cfg.min_ctas_per_sm))

    @cute.kernel
    def kernel_mma(self, mX: cute.Tensor, mGateSuh: cute.Tensor, mUpSuh: cute.Tensor, mXr: cute.Tensor,
                   mIds: cute.Tensor, mRank: cute.Tensor, mExpertRow: cute.Tensor, mGroupRow: cute.Tensor,
                   mRowRoute: cute.Tensor, mRouteRow: cute.Tensor):
        """Warp w of CTA (b, t): block 4b + w of routes 8t .. 8t+7. The MMAs' 16 rows are route 8t + g's two
        planes: thread (g, q) holds x * gate_suh as row g and x * up_suh as row g + 8, of the block the run of
        quad q (``hadamard_mma.run_column``), so it loads x and its route's indices once."""
        ptx.wait_for_prior_kernels(self.cfg.early_next)  # PDL: the kernel before this one has finished
        k, shift = self.cfg.routes_per_token, self.cfg.suh_shift
        tid, _, _ = cute.arch.thread_idx()
        bx, tile, _ = cute.arch.block_idx()
        lane = tid % 32
        n_blocks = mGateSuh.shape[1] // 128
        block = bx * BLOCKS_PER_CTA + tid // 32
        routes = mX.shape[0] * k
        if block < n_blocks:
            col0 = block * 128 + run_column(lane % 4, 0)
            route = tile * 8 + lane // 4
            rc = cutlass.min(route, routes - 1)
            tok = rc // k
            x = [w for i in range(4) for w in row_words(mX, tok, col0 + 32 * i)]
            e = mIds[tok, rc - tok * k]
            p = cutlass.select_(route < routes, group_row_of(mGroupRow, e, self.cfg.group_first, mGateSuh.shape[0]),
                                Int32(-1))
            row = mExpertRow[e] + mRank[rc]
            # every load before the first store (a store may alias a later load for all the compiler knows)
            suh = [suh_words(m, cutlass.max(p, 0), col0) for m in (mGateSuh, mUpSuh)]
            two_to_shift = ptx.pinned(((15 + shift) << 10) * 0x10001)  # fp16x2 (2^shift, 2^shift)
            hi, lo = [], []
            for plane in cutlass.range_constexpr(2):
                scaled = suh[plane] if shift == 0 else [ptx.mul_f16x2(w, two_to_shift) for w in suh[plane]]
                parts = [ptx.split_product(x[w], scaled[w]) for w in range(RUN // 2)]
                hi.append([a for a, _ in parts])
                lo.append([b for _, b in parts])
            v = hadamard128_f16(hi, lo, lane, ptx, Float32(0.0), 2.0 ** -shift)
            if p >= 0:
                for plane in cutlass.range_constexpr(2):
                    plane_addr = mXr.iterator.toint() + Int64(plane) * mXr.shape[1] * mXr.shape[2] * 2
                    store_run(plane_addr, row, mXr.shape[1], n_blocks * 128, col0, v[plane], self.cfg.x_order)
                if block == 0 and lane % 4 == 0:
                    mRowRoute[row] = route
                    mRouteRow[route] = row

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mGateSuh: cute.Tensor, mUpSuh: cute.Tensor, mXr: cute.Tensor,
               mIds: cute.Tensor, mRank: cute.Tensor, mExpertRow: cute.Tensor, mGroupRow: cute.Tensor,
               mRowRoute: cute.Tensor, mRouteRow: cute.Tensor):
        ptx.wait_for_prior_kernels(self.cfg.early_next)  # PDL: the kernel before this one has finished
        k, per_warp, n = self.cfg.routes_per_token, self.cfg.slots_per_warp, self.cfg.lane_values
        tid, _, _ = cute.arch.thread_idx()
        tok, bx, z = cute.arch.block_idx()
        lane = tid % 32
        lanes = 128 // n  # lanes a block
        n_blocks = mGateSuh.shape[1] // 128
        first = (bx * BLOCKS_PER_CTA + tid // 32) * self.cfg.blocks_per_warp  # the warp's first block
        block = first + lane // lanes
        exists = block < n_blocks  # a block past the last (odd counts, 8 values) loads the last and stores nothing
        if first < n_blocks:
            col0 = lane_column(cutlass.min(block, n_blocks - 1), lane, n)
            if cutlass.const_expr(n == 4):
                x = [Float32(0.0)] * 4
                if col0 < mX.shape[1]:  # hidden is a multiple of 4: a lane's columns are all in or all out
                    x = load4(mX, tok, col0, self.cfg.x_dtype)
            # Every slot's indices and scales are loaded before the first store: a store may alias a later
            # load for all the compiler knows, so interleaving them would serialise the slots' round trips.
            slots = []
            for jj in cutlass.range_constexpr(per_warp):
                j = z * per_warp + jj
                jc = cutlass.min(j, k - 1)  # surplus slots (k' not a multiple of the groups) load slot k'-1
                e = mIds[tok, jc]
                p = cutlass.select_(j < k, group_row_of(mGroupRow, e, self.cfg.group_first, mGateSuh.shape[0]),
                                    Int32(-1))
                row = mExpertRow[e] + mRank[tok * k + jc]
                pc = cutlass.max(p, 0)
                slots.append((tok * k + j, p, row, *(load_row(m, pc, col0, n) for m in (mGateSuh, mUpSuh))))
            if cutlass.const_expr(n == 8):
                x = row_values(mX, tok, col0, n, self.cfg.x_dtype)  # 16 bytes where aligned, else by column
            for jj in cutlass.range_constexpr(per_warp):
                route, p, row, gate_suh, up_suh = slots[jj]
                if p >= 0:
                    for plane in cutlass.range_constexpr(2):
                        suh = gate_suh if plane == 0 else up_suh
                        v = hadamard128([x[i] * suh[i] for i in range(n)], lane)
                        if exists:  # plane p of X: rows x x_row_halves(h_p) fp16
                            plane_addr = mXr.iterator.toint() + Int64(plane) * mXr.shape[1] * mXr.shape[2] * 2
                            store_x_values(plane_addr, row, mXr.shape[1], n_blocks * 128, col0, v, self.cfg.x_order)
                    if block == 0 and lane == 0:
                        mRowRoute[row] = route
                        mRouteRow[route] = row


PARTIALS_DTYPES = ("float32", "float16")  # the GEMMs' fp32 accumulators, stored as they are or rounded to fp16


def check_partials(partials: str, splits: int):
    """fp16 partials only where there is one K split (each split's would be rounded before the sum)."""
    if partials not in PARTIALS_DTYPES or (partials == "float16" and splits != 1):
        raise ValueError(f"partials {partials!r} with {splits} K splits: float32, or float16 for one split")


GATE_ACTIVATIONS = ("silu", "swiglu_oai")
SWIGLU_OAI_ALPHA = 1.702  # gpt-oss: (up + 1) * gate * sigmoid(1.702 * gate)


@dataclass(frozen=True)
class Gating:
    """How the intermediate gates: ``silu(g) * u``, or gpt-oss's clamped SwiGLU ``(u + 1) * g * sigmoid(1.702 g)``
    with g clamped from above and u both ways at ``limit`` (0: no clamp); with ``biased`` the gate and up
    projections' biases are added to g and u after their rotations. The biases ride in the rotations table
    (``[E_g, 5*I_p]``: gate_svh | up_svh | down_suh | gate bias | up bias, fp16 as the checkpoint stores them)."""

    activation: str = "silu"
    limit: float = 0.0
    biased: bool = False

    def __post_init__(self):
        if self.activation not in GATE_ACTIVATIONS:
            raise ValueError(f"the gating activation must be one of {', '.join(GATE_ACTIVATIONS)}")
        if self.limit < 0 or (self.limit and self.activation != "swiglu_oai"):
            raise ValueError("only swiglu_oai takes a clamp limit (>= 0)")

    @property
    def planes(self) -> int:
        """Vectors of I_p in a row of the rotations table."""
        return 5 if self.biased else 3

    @property
    def folds_scale(self) -> bool:
        """FAST_MATH's fold (up takes both rotations' 1/sqrt(128)): only for silu(g) * u, which is linear in u."""
        return FAST_MATH and self.activation == "silu" and not self.biased


SILU_GATING = Gating()


def gate(g, u, gating: Gating):
    """The intermediate value of gate g and up u (Float32). Traced inline."""
    if gating.activation == "silu":
        return silu(g) * u
    if gating.limit:
        g = cutlass.min(g, Float32(gating.limit))
        u = cutlass.max(cutlass.min(u, Float32(gating.limit)), Float32(-gating.limit))
    return (u + Float32(1.0)) * silu(g, SWIGLU_OAI_ALPHA)


@dataclass(frozen=True)
class IntermediateConfig:
    splits: int  # K splits of the gate/up GEMM
    x_order: str = "rows"  # X2's column order (the down GEMM's)
    # 128-column blocks of a row per warp (dividing the intermediate's blocks): the row's index lookups are done
    # once, and every block's partials and scales are loaded before the first butterfly.
    blocks_per_warp: int = 1
    lane_values: int = 4  # a lane's columns of a block: 4, or 8 (two blocks at once: blocks_per_warp even)
    # Route block rows as a compile-time constant (a row's block by a multiply-high instead of a 25-SASS division by
    # the launch's ``block_rows`` argument); 0: that argument.
    block_rows: int = 0
    partials: str = "float32"  # the gate/up GEMM's (MoEGemmConfig.partials)
    gating: Gating = SILU_GATING
    # A warp per route (its row from route_row, its group from its expert's id), not per packed row: no CTA of the
    # grid lands on padding rows (at M=4096 the 320-row blocks hold 32768 routes in 73920 rows).
    by_route: bool = False
    group_first: int = -1  # >= 0: the group's experts are consecutive ids from this one (group_row_of: no table)
    min_ctas_per_sm: int = 0  # > 0: launch bounds asking ptxas for this many CTAs an SM (ptx.occupancy_bounds)

    def __post_init__(self):
        check_lane_values(self.lane_values)
        check_partials(self.partials, self.splits)
        check_launch_fields(self)
        if self.blocks_per_warp % (self.lane_values // 4):
            raise ValueError("8 values a lane take two blocks at a time: blocks_per_warp must be even")


class Intermediate:
    def __init__(self, config: IntermediateConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mP: cute.Tensor, mRot: cute.Tensor, mX2: cute.Tensor, mRowRoute: cute.Tensor,
                 mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, mIds: cute.Tensor, mRouteRow: cute.Tensor,
                 inter_true: Int32, block_rows: Int32, stream: cuda.CUstream):
        blocks = mRot.shape[1] // self.cfg.gating.planes // 128 // self.cfg.blocks_per_warp  # of blocks_per_warp
        warps = mRouteRow.shape[0] if self.cfg.by_route else mX2.shape[0]
        grid = (blocks, (warps + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)
        self.kernel(mP, mRot, mX2, mRowRoute, mBlockExpert, mGroupRow, mIds, mRouteRow, inter_true,
                    block_rows).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream,
                                       **ptx.pdl_launch(), **ptx.occupancy_bounds(self.cfg.min_ctas_per_sm))

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mRot: cute.Tensor, mX2: cute.Tensor, mRowRoute: cute.Tensor,
               mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, mIds: cute.Tensor, mRouteRow: cute.Tensor,
               inter_true: Int32, block_rows: Int32):
        ptx.wait_for_prior_kernels()  # PDL: the kernel before this one has finished
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        at = rows * ROWS_PER_CTA + tid // 32
        route, p, row = Int32(-1), Int32(-1), at
        if cutlass.const_expr(self.cfg.by_route):
            # route ``at`` (t*k' + j): its expert's group row; its packed row as the input rotation placed it
            if at < mRouteRow.shape[0]:
                route = at
                p = group_row_of(mGroupRow, mIds[at // mIds.shape[1], at % mIds.shape[1]], self.cfg.group_first,
                                 mRot.shape[0])
                row = mRouteRow[at]
        else:
            route, p = route_of_row(mRowRoute, mBlockExpert, mGroupRow, row,
                                    self.cfg.block_rows if self.cfg.block_rows else block_rows, self.cfg.group_first,
                                    mRot.shape[0])
        if route >= 0 and p >= 0:
            intermediate_row(mP, mRot, mX2, row, p, block * self.cfg.blocks_per_warp, lane, inter_true,
                             self.cfg.splits, self.cfg.x_order, self.cfg.blocks_per_warp, self.cfg.lane_values,
                             self.cfg.gating)


def intermediate_row(mP, mRot, mX2, row, p, block, lane, inter_true, splits: int, x_order: str, blocks: int = 1,
                     n: int = 4, gating: Gating = SILU_GATING, row_pair: bool = False, live=None):
    """One warp, packed row ``row`` of group row ``p``, the ``blocks`` 128-column blocks of the intermediate from
    ``block`` (above): ``X2[row, b] = H128(gate(H128(gate) * gate_svh, H128(up) * up_svh) * down_suh)`` (``gate``:
    silu(g) * u or the clamped SwiGLU, g and u with their biases where ``gating`` says), ``n`` values a lane (4; or
    8, two blocks at a time, lanes ``16h + l`` in block h: fewer butterfly exchanges, the same bits). With
    ``row_pair`` (n = 8) the two half-warps take the same blocks of two rows instead (``row``: each lane's own), and
    a lane stores only where ``live`` holds (None: always). Every block's loads are issued first. The
    ``Intermediate`` kernel's whole work, and the gate/up GEMM's fused tail (``moe_gemm``). Traced inline."""
    inter_p = mRot.shape[1] // gating.planes  # X2 rows hold x_row_halves(inter_p) fp16
    lanes = 128 // n  # lanes a block
    loaded = []
    for j in range(0, blocks, 1 if row_pair else n // 4):
        col0 = lane_column(block + j + (0 if row_pair else lane // lanes), lane, n)
        # gate svh, up svh, down suh (, gate bias, up bias)
        scales = [load_row(mRot, p, plane * inter_p + col0, n) for plane in range(gating.planes)]
        parts = [split_values(mP, row, plane * inter_p + col0, splits, n) for plane in range(2)]
        loaded.append((col0, scales, parts))
    fold = gating.folds_scale
    for col0, scales, parts in loaded:
        gate_svh, up_svh, down_suh = scales[:3]
        gate_h = hadamard128(sum_parts(parts[0]), lane)
        # silu(g) * u: up takes both orthonormal scales of H128 (1/128, exact) and the last rotation none
        up_h = hadamard128(sum_parts(parts[1]), lane, 1.0 / 128 if fold else INV_SQRT_128)
        h = [Float32(0.0)] * n
        for i in range(n):
            g = gate_h[i] * gate_svh[i]
            u = up_h[i] * up_svh[i]
            if gating.biased:
                g, u = g + scales[3][i], u + scales[4][i]
            hi = gate(g, u, gating) * down_suh[i]
            h[i] = cutlass.select_(col0 + i < inter_true, hi, Float32(0.0))
        v = hadamard128(h, lane, None if fold else INV_SQRT_128)
        if live is None:
            store_x_values(mX2.iterator.toint(), row, mX2.shape[0], inter_p, col0, v, x_order)
        else:
            store_x_values_where(live, mX2.iterator.toint(), row, mX2.shape[0], inter_p, col0, v, x_order)


@cute.jit
def store_x_values_where(live, x_addr, row, rows, width, col0, values, x_order: cutlass.Constexpr):
    """``store_x_values`` by the lanes where ``live`` holds (a row pair's padding row stays unwritten)."""
    if live:
        store_x_values(x_addr, row, rows, width, col0, values, x_order)


def silu(g, alpha: float = 1.0):
    """``g * sigmoid(alpha * g)`` through the approximate reciprocal (``rcp.approx``, 1 ulp; the X2 it feeds is
    fp16). An IEEE division costs a range check and a slow-path branch per value: H200, E=128 top-8 2048x768 K=4
    mcg, Intermediate kernel us, IEEE -> approximate: M=1024 27.1 -> 23.8, M=2048 51.7 -> 44.5, M=4096 104.7 -> 94.8
    (sm_90a SASS 840 -> 632 instructions, 56 -> 40 registers; y within 3.7e-5 of the division's). With
    FAST_MATH the exponential is one ``ex2.approx`` of ``-alpha * g * log2(e)`` (2 ulp, then rounded to fp16)
    instead of expf's range reduction (two SASS a value instead of eight)."""
    if FAST_MATH:
        e = cute.math.exp2(g * Float32(-alpha * LOG2_E), approx=True, ftz=True)
    else:
        e = cute.math.exp(g * Float32(-alpha))
    return g * cute.arch.rcp_approx(Float32(1.0) + e)


@dataclass(frozen=True)
class TopKSumConfig:
    routes_per_token: int  # k, plus one for shared experts
    out_dtype: str  # "float16" | "bfloat16" | "float32"
    splits: int = 1  # K splits of the down GEMM
    blocks_per_cta: int = 1  # 128-column blocks of a token per CTA: a slot's index loads serve all of them
    partials: str = "float32"  # the down GEMM's (MoEGemmConfig.partials)
    # the down projections' biases, added to each slot's term before its weight: down_svh's table is then
    # ``[rows, 2*H_p]`` (svh | bias, fp16 as the checkpoint stores them)
    biased: bool = False
    # down_svh's row of each expert is its id (one group of every expert in order, the shared one after them): the
    # svh_row table is not read between a slot's expert and its scale loads
    svh_by_expert: bool = False

    def __post_init__(self):
        check_partials(self.partials, self.splits)


class TopKSum:
    def __init__(self, config: TopKSumConfig):
        self.cfg = config
        self.warps = min(config.routes_per_token, SUM_WARPS)

    @cute.jit
    def __call__(self, mP: cute.Tensor, mSvh: cute.Tensor, mSvhRow: cute.Tensor, mIds: cute.Tensor,
                 mW: cute.Tensor, mRouteRow: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        grid = (mY.shape[0], (mP.shape[2] // 128 + self.cfg.blocks_per_cta - 1) // self.cfg.blocks_per_cta, 1)
        self.kernel(mP, mSvh, mSvhRow, mIds, mW, mRouteRow, mY).launch(
            grid=grid, block=(32 * self.warps, 1, 1), stream=stream, **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mSvh: cute.Tensor, mSvhRow: cute.Tensor, mIds: cute.Tensor,
               mW: cute.Tensor, mRouteRow: cute.Tensor, mY: cute.Tensor):
        ptx.wait_for_prior_kernels()  # PDL: the kernel before this one has finished
        k, per_cta = self.cfg.routes_per_token, self.cfg.blocks_per_cta
        tid, _, _ = cute.arch.thread_idx()
        tok, group, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        blocks = mP.shape[2] // 128
        smem = SmemAllocator()
        sTerm = smem.allocate_tensor(Float32, cute.make_layout(per_cta * k * 128), 16)
        for j in cutlass.range(warp, k, self.warps):
            # slot j's indices once, then every block's partial and scale loads before the first butterfly
            row = mRouteRow[tok * k + j]
            svh_row = svh_row_of(mSvhRow, mIds[tok, j], self.cfg.svh_by_expert)
            weight = Float32(mW[tok, j])
            cols = [cutlass.min(group * per_cta + b, blocks - 1) * 128 for b in range(per_cta)]
            parts = [summed(mP, row, cols[b], lane, self.cfg.splits) for b in range(per_cta)]
            svh = [down_scales(mSvh, svh_row, cols[b] + 4 * lane, mP.shape[2], self.cfg.biased)
                   for b in range(per_cta)]
            for b in cutlass.range_constexpr(per_cta):
                park_term(sTerm, (b * k + j) * 128, weight, parts[b], svh[b], lane)
        cute.arch.sync_threads()
        for b in cutlass.range(warp, per_cta, self.warps):
            store_token_block(sTerm, b * k * 128, k, mY, tok, (group * per_cta + b) * 128, lane,
                              self.cfg.out_dtype)


def svh_row_of(mSvhRow, expert, by_expert: bool):
    """down_svh's row of ``expert``: the expert itself (``TopKSumConfig.svh_by_expert``) or the svh_row table's."""
    return expert if by_expert else mSvhRow[expert]


def down_scales(mSvh, svh_row, col, h_p, biased: bool):
    """A lane's four ``down_svh[svh_row, col ..]``, then with ``biased`` its four down biases (``TopKSumConfig``:
    ``h_p`` columns further along the row)."""
    svh = load4(mSvh, svh_row, col)
    return (svh, load4(mSvh, svh_row, col + h_p)) if biased else (svh,)


def park_term(sTerm, at, weight, summed_part, scales, lane):
    """Slot term ``weight * (H128(sum of the splits) * down_svh (+ down bias))`` of one 128-column block into
    ``sTerm[at ..]`` (the lane's 4 columns; ``scales`` from ``down_scales``). Traced inline."""
    v = hadamard128(summed_part, lane)
    for i in range(4):
        term = v[i] * scales[0][i]
        if len(scales) > 1:
            term = term + scales[1][i]
        sTerm[at + 4 * lane + i] = weight * term


@cute.jit
def store_token_block(sTerm: cute.Tensor, at: Int32, k: cutlass.Constexpr, mY: cute.Tensor, tok: Int32,
                      col_block0: Int32, lane: Int32, out_dtype: cutlass.Constexpr):
    """``y[tok, block]`` = the ``k`` parked slot terms at ``sTerm[at ..]`` summed in slot order (one warp)."""
    col0 = col_block0 + 4 * lane
    if col0 < mY.shape[1]:
        acc = [sTerm[at + 4 * lane + i] for i in range(4)]
        for j in cutlass.range_constexpr(1, k):
            acc = [acc[i] + sTerm[at + j * 128 + 4 * lane + i] for i in range(4)]
        size = 4 if out_dtype == "float32" else 2
        store4(mY.iterator.toint() + (Int64(tok) * mY.shape[1] + col0) * size, acc, out_dtype)


@cute.jit
def topk_sum_block(cfg: cutlass.Constexpr, mP: cute.Tensor, mSvh: cute.Tensor, mSvhRow: cute.Tensor,
                   mIds: cute.Tensor, mW: cute.Tensor, mRouteRow: cute.Tensor, mY: cute.Tensor, sTerm: cute.Tensor,
                   tok: Int32, block: Int32, warp: Int32, warps: cutlass.Constexpr, lane: Int32):
    """``TopKSum``'s work for one token and one 128-column block by a CTA of ``warps`` warps (the down GEMM's fused
    tail at decode; ``cfg`` its ``TopKSumConfig``): the same terms, parked and summed in the same order, so y is
    bit-identical."""
    k = cfg.routes_per_token
    per_warp = -(-k // warps)
    # a warp's slots j = warp, warp + warps, ..: every index, then every partial and scale load before the first
    # butterfly (the loads of a slot depend on its indices: one round trip each, not one per slot)
    slots = []
    for jj in cutlass.range_constexpr(per_warp):
        jc = cutlass.min(warp + jj * warps, k - 1)  # past the last slot: slot k'-1 again, never parked
        slots.append((mRouteRow[tok * k + jc], svh_row_of(mSvhRow, mIds[tok, jc], cfg.svh_by_expert),
                      Float32(mW[tok, jc])))
    parts = [summed(mP, row, block * 128, lane, cfg.splits) for row, _, _ in slots]
    svh = [down_scales(mSvh, svh_row, block * 128 + 4 * lane, mP.shape[2], cfg.biased) for _, svh_row, _ in slots]
    for jj in cutlass.range_constexpr(per_warp):
        j = warp + jj * warps
        if j < k:
            park_term(sTerm, j * 128, slots[jj][2], parts[jj], svh[jj], lane)
    cute.arch.sync_threads()
    if warp == 0:
        store_token_block(sTerm, 0, k, mY, tok, block * 128, lane, cfg.out_dtype)
