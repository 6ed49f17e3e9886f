"""The rotations of the fused MoE layer around its two grouped GEMMs, one warp per (packed row or token, 128-block).

RouteInputRotation  per packed row r of a route (t, slot) whose expert is in this launch's group (row p):
                    ``X[0, r] = H128(x[t] * gate_suh[p])``, ``X[1, r] = H128(x[t] * up_suh[p])`` (fp16)
Intermediate        per packed row: gate, up = split sums of the gate/up GEMM partials;
                    ``g = H128(gate) * gate_svh[p]``, ``u = H128(up) * up_svh[p]``, ``h = silu(g) * u`` (zero past the
                    true intermediate size), ``X2[r] = H128(h * down_suh[p])`` (fp16)
TopKSum             per token t: ``y[t] = sum_j w[t, j] * H128(sum_s P2[s, route_row[t, j]]) * down_svh[e]`` in fp32,
                    slots j in order and splits in order (deterministic), then cast to y's dtype.
Rows of unused blocks, padding rows (row_route -1) and rows of other groups are skipped; nothing reads them.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import ptx
from .rotate import DTYPES, hadamard128

ROWS_PER_CTA = 4  # one warp per row


@cute.jit
def route_of_row(mRowRoute: cute.Tensor, mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, row: Int32,
                 block_rows: Int32):
    """(route or -1, row in the group's stacked tensors or -1) of packed row ``row``."""
    expert = Int32(-1)
    route = Int32(-1)
    p = Int32(-1)
    if row < mRowRoute.shape[0]:
        expert = mBlockExpert[row // block_rows]
        if expert >= 0:
            p = mGroupRow[expert]
            route = mRowRoute[row]
    return route, p


def summed(mP, row, col0, lane, splits: int):
    """Four consecutive columns of ``sum_s P[s, row, col0 + 4*lane ..]``, splits in index order. The split count
    is a compile-time constant, so every load is issued before the first add waits."""
    addr = mP.iterator.toint() + (Int64(row) * mP.shape[2] + col0 + 4 * lane) * 4
    split_bytes = Int64(mP.shape[1]) * mP.shape[2] * 4
    parts = [ptx.ld_global_cg_v4_f32(addr + s * split_bytes) for s in range(splits)]
    return [sum_in_order([p[i] for p in parts]) for i in range(4)]


def sum_in_order(values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


@dataclass(frozen=True)
class RouteInputRotationConfig:
    x_dtype: str  # "float16" | "bfloat16"


class RouteInputRotation:
    def __init__(self, config: RouteInputRotationConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mGateSuh: cute.Tensor, mUpSuh: cute.Tensor, mXr: cute.Tensor,
                 mRowRoute: cute.Tensor, mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, routes_per_token: Int32,
                 block_rows: Int32, stream: cuda.CUstream):
        grid = (mXr.shape[2] // 128, (mXr.shape[1] + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)
        self.kernel(mX, mGateSuh, mUpSuh, mXr, mRowRoute, mBlockExpert, mGroupRow, routes_per_token,
                    block_rows).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mGateSuh: cute.Tensor, mUpSuh: cute.Tensor, mXr: cute.Tensor,
               mRowRoute: cute.Tensor, mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, routes_per_token: Int32,
               block_rows: Int32):
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        row = rows * ROWS_PER_CTA + tid // 32
        route, p = route_of_row(mRowRoute, mBlockExpert, mGroupRow, row, block_rows)
        if route >= 0 and p >= 0:
            tok = route // routes_per_token
            col0 = block * 128 + 4 * lane
            x = [Float32(0.0)] * 4
            for i in cutlass.range_constexpr(4):
                xi = Float32(0.0)
                if col0 + i < mX.shape[1]:
                    xi = Float32(mX[tok, col0 + i])
                x[i] = xi
            for plane in cutlass.range_constexpr(2):
                suh = mGateSuh if plane == 0 else mUpSuh
                v = hadamard128([x[i] * Float32(suh[p, col0 + i]) for i in range(4)], lane)
                for i in cutlass.range_constexpr(4):
                    mXr[plane, row, col0 + i] = cutlass.Float16(v[i])


@dataclass(frozen=True)
class IntermediateConfig:
    splits: int  # K splits of the gate/up GEMM


class Intermediate:
    def __init__(self, config: IntermediateConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mP: cute.Tensor, mRot: cute.Tensor, mX2: cute.Tensor, mRowRoute: cute.Tensor,
                 mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, inter_true: Int32, block_rows: Int32,
                 stream: cuda.CUstream):
        grid = (mX2.shape[1] // 128, (mX2.shape[0] + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)
        self.kernel(mP, mRot, mX2, mRowRoute, mBlockExpert, mGroupRow, inter_true, block_rows).launch(
            grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mRot: cute.Tensor, mX2: cute.Tensor, mRowRoute: cute.Tensor,
               mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, inter_true: Int32, block_rows: Int32):
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        row = rows * ROWS_PER_CTA + tid // 32
        route, p = route_of_row(mRowRoute, mBlockExpert, mGroupRow, row, block_rows)
        if route >= 0 and p >= 0:
            inter_p = mX2.shape[1]
            col0 = block * 128 + 4 * lane
            gate = hadamard128(summed(mP, row, block * 128, lane, self.cfg.splits), lane)
            up = hadamard128(summed(mP, row, inter_p + block * 128, lane, self.cfg.splits), lane)
            h = [Float32(0.0)] * 4
            for i in cutlass.range_constexpr(4):
                col = col0 + i
                g = gate[i] * Float32(mRot[p, col])
                u = up[i] * Float32(mRot[p, inter_p + col])
                hi = g / (Float32(1.0) + cute.math.exp(-g)) * u * Float32(mRot[p, 2 * inter_p + col])
                h[i] = cutlass.select_(col < inter_true, hi, Float32(0.0))
            v = hadamard128(h, lane)
            for i in cutlass.range_constexpr(4):
                mX2[row, col0 + i] = cutlass.Float16(v[i])


@dataclass(frozen=True)
class TopKSumConfig:
    routes_per_token: int  # k, plus one for shared experts
    out_dtype: str  # "float16" | "bfloat16" | "float32"
    splits: int = 1  # K splits of the down GEMM


class TopKSum:
    def __init__(self, config: TopKSumConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mP: cute.Tensor, mSvh: cute.Tensor, mSvhRow: cute.Tensor, mIds: cute.Tensor,
                 mW: cute.Tensor, mRouteRow: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        grid = (mP.shape[2] // 128, (mY.shape[0] + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)
        self.kernel(mP, mSvh, mSvhRow, mIds, mW, mRouteRow, mY).launch(
            grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mSvh: cute.Tensor, mSvhRow: cute.Tensor, mIds: cute.Tensor,
               mW: cute.Tensor, mRouteRow: cute.Tensor, mY: cute.Tensor):
        k = self.cfg.routes_per_token
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        tok = rows * ROWS_PER_CTA + tid // 32
        if tok < mY.shape[0]:
            col0 = block * 128 + 4 * lane
            acc = [Float32(0.0)] * 4
            for j in cutlass.range_constexpr(k):
                route = tok * k + j
                row = mRouteRow[route]
                svh = mSvhRow[mIds[tok, j]]
                weight = Float32(mW[tok, j])
                v = hadamard128(summed(mP, row, block * 128, lane, self.cfg.splits), lane)
                acc = [acc[i] + weight * (v[i] * Float32(mSvh[svh, col0 + i])) for i in range(4)]
            for i in cutlass.range_constexpr(4):
                if col0 + i < mY.shape[1]:
                    mY[tok, col0 + i] = DTYPES[self.cfg.out_dtype](acc[i])
