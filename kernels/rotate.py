"""The incoherence rotations around the trellis GEMM (format doc section 5), one warp per (row, 128-block).

Input:  ``X_rot[r, :] = H128(x[r, :] * suh)`` per 128-column block, fp32 math, stored fp16 for the MMA.
Output: ``y[r, :] = H128(sum_s P[s, r, :]) * svh + bias``, which also reduces the GEMM's K splits.

Lane ``l`` holds elements ``4l .. 4l+3`` of a block: the two low index bits are butterflies in registers, the
five high bits are ``shfl.bfly`` exchanges with lanes ``l ^ 1 .. l ^ 16``. H128 is the natural-order Sylvester
matrix scaled by ``1/sqrt(128)``; it is symmetric and its own inverse.
"""

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import ptx
from .trellis import X_ORDERS, x_fragment_slot

ROWS_PER_CTA = 4  # one warp per row
INV_SQRT_128 = 1.0 / math.sqrt(128.0)

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}


def hadamard128(v, lane):
    """Rotate the 128-vector spread over a warp as 4 values per lane (a list of 4 Float32, returned new)."""
    a = (v[0] + v[1], v[0] - v[1], v[2] + v[3], v[2] - v[3])
    v = [a[0] + a[2], a[1] + a[3], a[0] - a[2], a[1] - a[3]]
    for bit in range(5):
        offset = 1 << bit
        # The lane with the bit set holds the "minus" side: new = partner - self; otherwise partner + self.
        sign = Float32(1.0) - Float32(2.0) * Float32((lane >> bit) & 1)
        v = [cute.arch.shuffle_sync_bfly(x, offset) + sign * x for x in v]
    return [x * Float32(INV_SQRT_128) for x in v]


@cute.jit
def reduce_rotate_store(
    mP: cute.Tensor,
    mSvh: cute.Tensor,
    mBias: cute.Tensor,
    mY: cute.Tensor,
    row: Int32,
    block: Int32,
    lane: Int32,
    partial_f32: cutlass.Constexpr,
    has_bias: cutlass.Constexpr,
    out_type: cutlass.Constexpr,
):
    """One warp: ``y[row, block*128 : +128] = H128(sum_s P[s, row, ...]) * svh (+ bias)``, columns < out_true.

    One vector load per split (4 consecutive columns per lane), unrolled so several splits are in flight; the
    splits are summed in index order, so the result does not depend on timing (graph replays are identical).
    Loads bypass L1: in the GEMM's fused epilogue the partials were just written by other CTAs."""
    col0 = block * 128 + 4 * lane
    acc = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    acc.fill(0.0)
    elem = 4 if partial_f32 else 2
    addr = mP.iterator.toint() + (Int64(row) * mP.shape[2] + col0) * elem
    split_bytes = Int64(mP.shape[1]) * mP.shape[2] * elem
    for split in cutlass.range(mP.shape[0], unroll=4):
        if cutlass.const_expr(partial_f32):
            part = ptx.ld_global_cg_v4_f32(addr + split * split_bytes)
        else:
            part = ptx.ld_global_cg_v4_f16_as_f32(addr + split * split_bytes)
        for i in cutlass.range_constexpr(4):
            acc[i] = acc[i] + part[i]
    v = hadamard128([acc[0], acc[1], acc[2], acc[3]], lane)
    for i in cutlass.range_constexpr(4):
        y = v[i] * Float32(mSvh[col0 + i])
        if cutlass.const_expr(has_bias):
            y = y + Float32(mBias[col0 + i])
        if col0 + i < mY.shape[1]:
            mY[row, col0 + i] = out_type(y)


@dataclass(frozen=True)
class InputRotationConfig:
    in_dtype: str  # "float16" | "bfloat16"
    x_order: str = "rows"  # the GEMM's X column order (GemmConfig.x_order)

    def __post_init__(self):
        if self.x_order not in X_ORDERS:
            raise ValueError(f"x_order must be one of {', '.join(X_ORDERS)}")


class InputRotation:
    """``X_rot (M, in_p) fp16 = H128(x (M, in_true) * suh)``; columns past ``in_true`` read as zero. In fragment
    order each element goes to its ``trellis.x_fragment_slot``."""

    def __init__(self, config: InputRotationConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mSuh: cute.Tensor, mXr: cute.Tensor, stream: cuda.CUstream):
        """mX ``(M, in_true)`` fp16/bf16 rows (any row stride), mSuh ``(in_p,)`` fp16, mXr ``(M, in_p)`` fp16."""
        grid = (mXr.shape[1] // 128, (mXr.shape[0] + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)
        self.kernel(mX, mSuh, mXr).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSuh: cute.Tensor, mXr: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        row = rows * ROWS_PER_CTA + tid // 32
        col0 = block * 128 + 4 * lane
        if row < mX.shape[0]:
            v = [Float32(0.0)] * 4
            for i in cutlass.range_constexpr(4):
                x = Float32(0.0)
                if col0 + i < mX.shape[1]:
                    x = Float32(mX[row, col0 + i]) * Float32(mSuh[col0 + i])
                v[i] = x
            v = hadamard128(v, lane)
            for i in cutlass.range_constexpr(4):
                col = col0 + i if cutlass.const_expr(self.cfg.x_order == "rows") else x_fragment_slot(col0 + i)
                mXr[row, col] = cutlass.Float16(v[i])


@dataclass(frozen=True)
class OutputRotationConfig:
    out_dtype: str  # "float16" | "bfloat16" | "float32"
    partial_dtype: str = "float32"  # "float16" when the partials come from a dequantize + cuBLAS GEMM
    has_bias: bool = False


class OutputRotation:
    """``y (M, out_true) = H128(sum_s P[s]) * svh (+ bias)``; P is ``(splits, M, out_p)``."""

    def __init__(self, config: OutputRotationConfig):
        self.cfg = config
        self.out_type = DTYPES[config.out_dtype]

    @cute.jit
    def __call__(self, mP: cute.Tensor, mSvh: cute.Tensor, mBias, mY: cute.Tensor, stream: cuda.CUstream):
        """mP ``(splits, M, out_p)``, mSvh ``(out_p,)`` fp16, mBias ``(out_p,)`` fp16 or None, mY ``(M, out_true)``."""
        bias = mSvh if cutlass.const_expr(mBias is None) else mBias  # never read without a bias
        grid = (mP.shape[2] // 128, (mP.shape[1] + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)
        self.kernel(mP, mSvh, bias, mY).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mSvh: cute.Tensor, mBias: cute.Tensor, mY: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        row = rows * ROWS_PER_CTA + tid // 32
        if row < mP.shape[1]:
            reduce_rotate_store(mP, mSvh, mBias, mY, row, block, lane, self.cfg.partial_dtype == "float32",
                                self.cfg.has_bias, self.out_type)
