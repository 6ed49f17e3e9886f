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
from .trellis import X_ORDERS, x_doubled_word, x_pair_word

ROWS_PER_CTA = 4  # one warp per row
INV_SQRT_128 = 1.0 / math.sqrt(128.0)

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}
DTYPE_NAMES = {t: name for name, t in DTYPES.items()}


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


def load4_at(addr, dtype: str = "float16"):
    """Four consecutive fp16/bf16 at an 8-byte aligned global address as Float32: one load."""
    w = ptx.ld_global_v2_b32(addr)
    return list(ptx.words_to_f32(w[0], w[1], dtype))


def load4(tensor, row, col, dtype: str = "float16"):
    """Four consecutive fp16/bf16 ``tensor[row, col ..]`` of a contiguous matrix (8-byte aligned) as Float32."""
    return load4_at(tensor.iterator.toint() + (Int64(row) * tensor.shape[1] + col) * 2, dtype)


def load4_vector(tensor, col):
    """Four consecutive fp16 ``tensor[col ..]`` of a vector (8-byte aligned: its fake tensor says so, and TVM FFI
    checks it) as Float32."""
    return load4_at(tensor.iterator.toint() + Int64(col) * 2)


def store4(addr, values, dtype: str):
    """Four Float32 to consecutive fp16/bf16 (one 8-byte store) or fp32 (one 16-byte store) at ``addr``."""
    if dtype == "float32":
        ptx.st_global_v4(addr, values, Float32)
    else:
        ptx.st_global_v2_b32(addr, ptx.pack_f32x2(values[0], values[1], dtype),
                             ptx.pack_f32x2(values[2], values[3], dtype))


def store_x_quad(row_addr, col0, values, x_order: str):
    """A lane's four consecutive columns ``col0 ..`` (a multiple of 4) of a GEMM input row at ``row_addr``, fp16, in
    the GEMM's column order: rows (one 8-byte store), fragments (``trellis.x_fragment_slot``: two 4-byte stores,
    the column pairs (col0, col0+1) and (col0+2, col0+3)) or doubled (``trellis.x_doubled_word``: four 4-byte
    stores of (v, v))."""
    if x_order == "rows":
        store4(row_addr + Int64(col0) * 2, values, "float16")
        return
    if x_order == "doubled":
        for i in range(4):
            ptx.st_global_u32(row_addr + Int64(x_doubled_word(col0 + i)) * 4,
                              ptx.pack_f32x2(values[i], values[i], "float16"))
        return
    for h in range(2):
        word = x_pair_word(col0 + 2 * h, x_order)
        ptx.st_global_u32(row_addr + Int64(word) * 4, ptx.pack_f32x2(values[2 * h], values[2 * h + 1], "float16"))


@cute.jit
def row_quad(mX: cute.Tensor, row: Int32, col0: Int32, dtype: cutlass.Constexpr):
    """``x[row, col0 .. col0+3]`` as 4 Float32, columns past x's width zero. One 8-byte load where the four are
    inside the row and 8-byte aligned (x rows may be strided views of any width), else four 2-byte ones: the same
    values either way."""
    v = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    width = mX.shape[1]
    addr = mX.iterator.toint() + (Int64(row) * mX.stride[0] + col0) * 2
    whole = col0 + 4 <= width
    if whole and (addr & 7) == 0:
        f = load4_at(addr, dtype)
        for i in cutlass.range_constexpr(4):
            v[i] = f[i]
    else:
        for i in cutlass.range_constexpr(4):
            col = col0 + i
            x = Float32(mX[row, cutlass.min(col, width - 1)])
            v[i] = cutlass.select_(col < width, x, Float32(0.0))
    return [v[0], v[1], v[2], v[3]]


@cute.jit
def store_row_quad(mY: cute.Tensor, row: Int32, col0: Int32, values, out_type: cutlass.Constexpr,
                   dtype: cutlass.Constexpr):
    """``y[row, col0 .. col0+3] = values`` (4 Float32 cast to y's type), columns past y's width skipped: one
    vector store where the four are inside the row and aligned, else one store per column."""
    elem = 4 if dtype == "float32" else 2
    addr = mY.iterator.toint() + (Int64(row) * mY.stride[0] + col0) * elem
    whole = col0 + 4 <= mY.shape[1]
    if whole and (addr & (4 * elem - 1)) == 0:
        store4(addr, values, dtype)
    else:
        for i in cutlass.range_constexpr(4):
            if col0 + i < mY.shape[1]:
                mY[row, col0 + i] = out_type(values[i])


def scaled_quad(mX: cute.Tensor, mSuh: cute.Tensor, row: Int32, col0: Int32, suh_row=None):
    """``x[row, col0 .. col0+3] * suh`` as 4 Float32, columns past x's width +0: a lane's share of one 128-block
    of an input rotation before its butterflies. ``suh`` is a vector, or row ``suh_row`` of a matrix (an expert's),
    8-byte aligned. Traced inline."""
    x = row_quad(mX, row, col0, DTYPE_NAMES[mX.element_type])
    suh = load4_vector(mSuh, col0) if suh_row is None else load4(mSuh, suh_row, col0)
    return [cutlass.select_(col0 + i < mX.shape[1], x[i] * suh[i], Float32(0.0)) for i in range(4)]


def rotated_quad(mX: cute.Tensor, mSuh: cute.Tensor, row: Int32, col0: Int32, lane: Int32):
    """One warp's 128-block of ``H128(x[row] * suh)``: this lane's elements ``col0 .. col0+3`` (``4*lane ..`` of
    the block). The arithmetic of every input rotation, written once; traced inline."""
    return hadamard128(scaled_quad(mX, mSuh, row, col0), lane)


@cute.jit
def rotate_into_shared(mX: cute.Tensor, mSuh: cute.Tensor, sX: cute.Tensor, k_begin: Int32, n_blocks: Int32,
                       rounds: cutlass.Constexpr, x_order: cutlass.Constexpr, warp: Int32,
                       warps: cutlass.Constexpr, lane: Int32, suh_row: Int32 = 0,
                       suh_matrix: cutlass.Constexpr = False):
    """A decode GEMM's prologue at M = 1: ``sX`` (fp16 pairs) = the rotated row 0 of x over the 128-blocks
    ``k_begin*16 + 128*b``, b < ``n_blocks`` (at most ``rounds * warps``), in the main loop's column order
    (``trellis.X_ORDERS``, of the element relative to the range), block b by warp ``b % warps``. Every
    round's loads are issued before any butterfly (one memory latency, not one per round). Bit-identical to
    ``InputRotation`` (with ``suh_matrix``, row ``suh_row`` of suh: to ``moe_rotate.RouteInputRotation``)."""
    last = cutlass.max(n_blocks - 1, 0)
    scaled = [scaled_quad(mX, mSuh, Int32(0), k_begin * 16 + cutlass.min(warp + r * warps, last) * 128 + 4 * lane,
                          suh_row if suh_matrix else None) for r in range(rounds)]
    for r in cutlass.range_constexpr(rounds):
        v = hadamard128(scaled[r], lane)
        b = warp + r * warps
        if b < n_blocks:
            e0 = b * 128 + 4 * lane
            if cutlass.const_expr(x_order == "doubled"):
                for i in cutlass.range_constexpr(4):
                    sX[x_doubled_word(e0 + i)] = ptx.pack_f32x2(v[i], v[i], "float16")
            else:
                for h in cutlass.range_constexpr(2):
                    sX[x_pair_word(e0 + 2 * h, x_order)] = ptx.pack_f32x2(v[2 * h], v[2 * h + 1], "float16")


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
    svh = load4_vector(mSvh, col0)
    bias = load4_vector(mBias, col0) if cutlass.const_expr(has_bias) else None
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
    y = rotated_output_quad([acc[0], acc[1], acc[2], acc[3]], svh, bias, lane)
    store_row_quad(mY, row, col0, y, out_type, DTYPE_NAMES[out_type])


def rotated_output_quad(v, svh, bias, lane):
    """``H128(v) * svh (+ bias)`` for a lane's four values of a 128-block (``bias`` None: none). The arithmetic of
    every output rotation, written once; traced inline."""
    y = [x * s for x, s in zip(hadamard128(v, lane), svh)]
    return y if bias is None else [x + b for x, b in zip(y, bias)]


@dataclass(frozen=True)
class InputRotationConfig:
    in_dtype: str  # "float16" | "bfloat16"
    x_order: str = "rows"  # the GEMM's X column order (GemmConfig.x_order)

    def __post_init__(self):
        if self.x_order not in X_ORDERS:
            raise ValueError(f"x_order must be one of {', '.join(X_ORDERS)}")


class InputRotation:
    """``X_rot (M, in_p) fp16 = H128(x (M, in_true) * suh)``; columns past ``in_true`` read as zero. In fragment
    order each element goes to its ``trellis.x_fragment_slot``; in doubled order X_rot is ``(M, 2*in_p)`` and each
    element goes twice, to both halves of its ``trellis.x_doubled_word``."""

    def __init__(self, config: InputRotationConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mSuh: cute.Tensor, mXr: cute.Tensor, stream: cuda.CUstream):
        """mX ``(M, in_true)`` fp16/bf16 rows (any row stride), mSuh ``(in_p,)`` fp16, mXr ``(M, in_p)`` fp16
        (``(M, 2*in_p)`` in doubled order)."""
        grid = (mSuh.shape[0] // 128, (mXr.shape[0] + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)
        self.kernel(mX, mSuh, mXr).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream, **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSuh: cute.Tensor, mXr: cute.Tensor):
        ptx.wait_for_prior_kernels()  # PDL: the kernel before this one has finished
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        row = rows * ROWS_PER_CTA + tid // 32
        col0 = block * 128 + 4 * lane
        if row < mX.shape[0]:
            v = rotated_quad(mX, mSuh, row, col0, lane)
            store_x_quad(mXr.iterator.toint() + Int64(row) * mXr.shape[1] * 2, col0, v, self.cfg.x_order)


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
        self.kernel(mP, mSvh, bias, mY).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream,
                                               **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mSvh: cute.Tensor, mBias: cute.Tensor, mY: cute.Tensor):
        ptx.wait_for_prior_kernels()  # PDL: the kernel before this one has finished
        tid, _, _ = cute.arch.thread_idx()
        block, rows, _ = cute.arch.block_idx()
        lane = tid % 32
        row = rows * ROWS_PER_CTA + tid // 32
        if row < mP.shape[1]:
            reduce_rotate_store(mP, mSvh, mBias, mY, row, block, lane, self.cfg.partial_dtype == "float32",
                                self.cfg.has_bias, self.out_type)
