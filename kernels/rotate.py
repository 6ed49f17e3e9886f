"""The incoherence rotations around the trellis GEMM (format doc section 5): a warp per row and 128-block (or two).

Input:  ``X_rot[r, :] = H128(x[r, :] * suh)`` per 128-column block, fp32 math, stored fp16 for the MMA.
Output: ``y[r, :] = H128(sum_s P[s, r, :]) * svh + bias``, which also reduces the GEMM's K splits.

With 4 values a lane, lane ``l`` holds elements ``4l .. 4l+3`` of a block: the two low index bits are butterflies
in registers, the five high bits are ``shfl.bfly`` exchanges with lanes ``l ^ 1 .. l ^ 16``. With 8 (the dense
input rotation), lanes ``16h + l`` hold elements ``8l .. 8l+7`` of the warp's block h: three bits in registers,
four exchanges. H128 is the natural-order Sylvester matrix scaled by ``1/sqrt(128)``; it is symmetric and its own
inverse.
"""

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import ptx
from .trellis import X_ORDERS, x_doubled_word, x_pair_word, x_row_halves, x_stages_index

ROWS_PER_CTA = 4  # one warp per row
INV_SQRT_128 = 1.0 / math.sqrt(128.0)
# Values a lane holds in the dense rotation kernels (4 or 8; the same bits either way). The input rotation takes 8
# (16-byte x loads, a warp per two 128-blocks of a row: twice the bytes in flight per resident warp), the output
# rotation 4 (its split loads already keep enough in flight; 8 halves its warps and lost). H200, K=4 mcg, kernel
# us, 4 -> 8 values, same call, bit-identical: input 14336x4096 M=64 / 128 / 256 2.8 / 4.2 / 7.1 -> 2.3 / 3.8 /
# 6.1, 4096x14336 M=256 3.0 -> 2.5; output 14336x4096 M=16 / 64 / 256 3.3 / 3.0 / 4.6 -> 3.7 / 3.8 / 5.9.
# The GEMM epilogues and the MoE rotations hold 4.
INPUT_LANE_VALUES, OUTPUT_LANE_VALUES = 8, 4
# fp32 partial values a lane of ``reduce_rotate_store`` loads at once (a batch of splits, then their additions in
# order): 8 splits at 4 values a lane, 4 at 8. fp16 partials keep a loop unrolled by 4 (ptxas hoists 3 of its loads).
SPLIT_BATCH_VALUES = 32
SPLITS_IN_FLIGHT = SPLIT_BATCH_VALUES // OUTPUT_LANE_VALUES  # splits the GEMM epilogue's warp loads at once
SPREAD_LOADS = 16  # split partials a lane loads at once in ``reduce_rotate_store_spread``

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}
DTYPE_NAMES = {t: name for name, t in DTYPES.items()}


def hadamard128(v, lane, scale: float | None = INV_SQRT_128):
    """Rotate the 128-vectors spread over a warp as ``len(v)`` = 4 or 8 consecutive values per lane (one vector
    per 32 or 16 lanes), returned new, times ``scale`` (orthonormal by default; None: no multiply). The seven
    butterfly stages run in index-bit order whatever the split (the low bits in registers, the high ones as
    ``shfl.bfly`` with lanes ``l ^ 1 ..``), so both give the same bits."""
    n = len(v)
    register_bits = {4: 2, 8: 3}[n]
    for bit in range(register_bits):
        step = 1 << bit
        out = list(v)
        for i in range(n):
            if i & step == 0:
                out[i], out[i + step] = v[i] + v[i + step], v[i] - v[i + step]
        v = out
    for bit in range(7 - register_bits):
        offset = 1 << bit
        # The lane with the bit set holds the "minus" side: new = partner - self; otherwise partner + self.
        sign = Float32(1.0) - Float32(2.0) * Float32((lane >> bit) & 1)
        v = [cute.arch.shuffle_sync_bfly(x, offset) + sign * x for x in v]
    return v if scale is None else [x * Float32(scale) for x in v]


def lane_column(block, lane, n: int):
    """First of the ``n`` (4 or 8) consecutive columns a lane holds in 128-block ``block``: ``128 // n`` lanes a
    block, so lane l is lane ``l % (128 // n)`` of the warp's block ``l // (128 // n)``."""
    return block * 128 + n * (lane % (128 // n))


def rotation_thread(n: int, n_blocks):
    """(row, lane, the lane's first column, whether its 128-block exists) of this thread of a dense rotation kernel
    (``rotation_grid``) with ``n`` values a lane (``128 // n`` lanes a block). A block past the last (odd block
    counts, 8 values) repeats the last one's loads and stores nothing. Traced inline."""
    tid, _, _ = cute.arch.thread_idx()
    bx, rows, _ = cute.arch.block_idx()
    lane = tid % 32
    lanes = 128 // n
    block = bx * (32 // lanes) + lane // lanes
    col0 = lane_column(cutlass.min(block, n_blocks - 1), lane, n)
    return rows * ROWS_PER_CTA + tid // 32, lane, col0, block < n_blocks


def load_at(addr, dtype: str = "float16", n: int = 4):
    """``n`` = 4 or 8 consecutive fp16/bf16 at a ``2n``-byte aligned global address as Float32: one load."""
    if n == 4:
        w = ptx.ld_global_v2_b32(addr)
    else:
        w = ptx.ld_global_v4_b32(addr)
    return [x for i in range(0, n // 2, 2) for x in ptx.words_to_f32(w[i], w[i + 1], dtype)]


def load4(tensor, row, col, dtype: str = "float16"):
    """Four consecutive fp16/bf16 ``tensor[row, col ..]`` of a contiguous matrix (8-byte aligned) as Float32."""
    return load_at(tensor.iterator.toint() + (Int64(row) * tensor.shape[1] + col) * 2, dtype)


def load_row(tensor, row, col, n: int = 4, dtype: str = "float16"):
    """``n`` (4 or 8) consecutive fp16/bf16 ``tensor[row, col ..]`` of a contiguous matrix as Float32, 8 bytes a
    load (its rows are only 8-byte aligned)."""
    return [x for c in range(0, n, 4) for x in load4(tensor, row, col + c, dtype)]


def check_lane_values(n: int) -> None:
    """A rotation config's values a lane: 4, or 8 (two 128-blocks a warp)."""
    if n not in (4, 8):
        raise ValueError("lane_values must be 4 or 8")


def load_vector(tensor, col, n: int = 4):
    """``n`` consecutive fp16 ``tensor[col ..]`` of a vector as Float32, 8 bytes a load (the vector is 8-byte
    aligned: its fake tensor says so, and TVM FFI checks it)."""
    return [x for c in range(0, n, 4) for x in load_at(tensor.iterator.toint() + Int64(col + c) * 2)]


def store4(addr, values, dtype: str):
    """Four Float32 to consecutive fp16/bf16 (one 8-byte store) or fp32 (one 16-byte store) at ``addr``."""
    if dtype == "float32":
        ptx.st_global_v4(addr, values, Float32)
    else:
        ptx.st_global_v2_b32(addr, ptx.pack_f32x2(values[0], values[1], dtype),
                             ptx.pack_f32x2(values[2], values[3], dtype))


def store_at(addr, values, dtype: str):
    """4 or 8 Float32 to consecutive fp16/bf16 or fp32 at a ``len(values)``-element aligned ``addr``: 8 fp16 in
    one 16-byte store, else ``store4`` per four."""
    if len(values) == 8 and dtype != "float32":
        ptx.st_global_v4(addr, [ptx.pack_f32x2(values[i], values[i + 1], dtype) for i in range(0, 8, 2)])
        return
    for c in range(0, len(values), 4):
        store4(addr + c * (4 if dtype == "float32" else 2), values[c : c + 4], dtype)


def store_x_values(x_addr, row, rows, width, col0, values, x_order: str):
    """A lane's 4 or 8 consecutive columns ``col0 ..`` (a multiple of their count) of row ``row`` of a GEMM input X
    of ``rows`` x ``width`` (in_p) at ``x_addr``, fp16, in the GEMM's column order: rows (one 8- or 16-byte store),
    stages (``trellis.x_stages_index``: the same store, in the row's swizzled piece of its chunk), fragments
    (``trellis.x_fragment_slot``: one 4-byte store per column pair) or doubled (``trellis.x_doubled_word``: one
    4-byte store of (v, v) per column; rows of ``trellis.x_row_halves``)."""
    if x_order == "stages":
        store_at(x_addr + Int64(x_stages_index(row, col0, rows)) * 2, values, "float16")
        return
    row_addr = x_addr + Int64(row) * (2 * x_row_halves(width, x_order))
    if x_order == "rows":
        store_at(row_addr + Int64(col0) * 2, values, "float16")
        return
    if x_order == "doubled":
        for i in range(len(values)):
            ptx.st_global_u32(row_addr + Int64(x_doubled_word(col0 + i)) * 4,
                              ptx.pack_f32x2(values[i], values[i], "float16"))
        return
    for h in range(0, len(values), 2):
        word = x_pair_word(col0 + h, x_order)
        ptx.st_global_u32(row_addr + Int64(word) * 4, ptx.pack_f32x2(values[h], values[h + 1], "float16"))


def one_access(addr, col0, n: int, width, align: int):
    """Do the ``n`` columns from ``col0`` lie inside a row ``width`` wide, from an ``align``-byte aligned ``addr``: one
    vector load or store for all of them? (x and y rows may be strided views of any width.) Traced inline."""
    return (col0 + n <= width) & ((addr & (align - 1)) == 0)


@cute.jit
def row_values(mX: cute.Tensor, row: Int32, col0: Int32, n: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """``x[row, col0 .. col0+n-1]`` as ``n`` (4 or 8) Float32, columns past x's width zero. One vector load where
    the ``n`` are inside the row and aligned (x rows may be strided views of any width), else one 2-byte load per
    column: the same values either way."""
    v = cute.make_rmem_tensor(cute.make_layout(n), Float32)
    width = mX.shape[1]
    addr = mX.iterator.toint() + (Int64(row) * mX.stride[0] + col0) * 2
    if one_access(addr, col0, n, width, 2 * n):
        f = load_at(addr, dtype, n)
        for i in cutlass.range_constexpr(n):
            v[i] = f[i]
    else:
        for i in cutlass.range_constexpr(n):
            col = col0 + i
            x = Float32(mX[row, cutlass.min(col, width - 1)])
            v[i] = cutlass.select_(col < width, x, Float32(0.0))
    return [v[i] for i in range(n)]


@cute.jit
def store_row_values(mY: cute.Tensor, row: Int32, col0: Int32, values, out_type: cutlass.Constexpr,
                     dtype: cutlass.Constexpr):
    """``y[row, col0 ..] = values`` (4 or 8 Float32 cast to y's type), columns past y's width skipped: vector
    stores where the values are inside the row and aligned, else one store per column."""
    n = len(values)
    elem = 4 if dtype == "float32" else 2
    addr = mY.iterator.toint() + (Int64(row) * mY.stride[0] + col0) * elem
    if one_access(addr, col0, n, mY.shape[1], min(n * elem, 16)):
        store_at(addr, values, dtype)
    else:
        for i in cutlass.range_constexpr(n):
            if col0 + i < mY.shape[1]:
                mY[row, col0 + i] = out_type(values[i])


def scaled_values(mX: cute.Tensor, mSuh: cute.Tensor, row: Int32, col0: Int32, n: int = 4, suh_row=None):
    """``x[row, col0 .. col0+n-1] * suh`` as ``n`` Float32, columns past x's width +0: a lane's share of one
    128-block of an input rotation before its butterflies. ``suh`` is a vector, or row ``suh_row`` of a matrix (an
    expert's), 8-byte aligned. Traced inline."""
    suh = load_vector(mSuh, col0, n) if suh_row is None else load_row(mSuh, suh_row, col0, n)  # first: x's may branch
    x = row_values(mX, row, col0, n, DTYPE_NAMES[mX.element_type])
    return scaled_product(x, suh, col0, mX.shape[1])


def scaled_product(x, suh, col0, width):
    """``x * suh`` of a lane's columns ``col0 ..``, +0 past x's ``width`` (the input rotation's scaling)."""
    return [cutlass.select_(col0 + i < width, x[i] * suh[i], Float32(0.0)) for i in range(len(x))]


def prologue_column(k_begin, n_blocks, r: int, warp, warps: int, lane):
    """A lane's first column of x in round ``r`` of the M = 1 prologue: the 128-block ``warp + r * warps`` of the K
    split from k-tile ``k_begin`` (past the last of ``n_blocks``: the last again, its results never stored)."""
    return k_begin * 16 + cutlass.min(warp + r * warps, cutlass.max(n_blocks - 1, 0)) * 128 + 4 * lane


@cute.jit
def rotate_into_shared(mX: cute.Tensor, mSuh: cute.Tensor, sX: cute.Tensor, k_begin: Int32, n_blocks: Int32,
                       rounds: cutlass.Constexpr, x_order: cutlass.Constexpr, warp: Int32,
                       warps: cutlass.Constexpr, lane: Int32, suh_row: Int32 = 0,
                       suh_matrix: cutlass.Constexpr = False, x_row: Int32 = 0, s_word0: Int32 = 0):
    """A decode GEMM's prologue at M = 1: ``sX`` (fp16 pairs, from word ``s_word0``) = the rotated row ``x_row``
    of x over the 128-blocks ``k_begin*16 + 128*b``, b < ``n_blocks`` (at most ``rounds * warps``), in the main
    loop's column order (``trellis.X_ORDERS``, of the element relative to the range), block b by warp ``b % warps``.
    Every round's loads are issued before any butterfly (one memory latency, not one per round). Bit-identical to
    ``InputRotation`` (with ``suh_matrix``, row ``suh_row`` of suh: to ``moe_rotate.RouteInputRotation``)."""
    scaled = [scaled_values(mX, mSuh, x_row, prologue_column(k_begin, n_blocks, r, warp, warps, lane), 4,
                            suh_row if suh_matrix else None) for r in range(rounds)]
    rotate_scaled_into_shared(scaled, sX, n_blocks, x_order, warp, warps, lane, s_word0)


@cute.jit
def rotation_loads(mX: cute.Tensor, suh_matrix_addr: Int64, suh_width: Int32, suh_row: Int32, k_begin: Int32,
                   n_blocks: Int32, rounds: cutlass.Constexpr, warp: Int32, warps: cutlass.Constexpr, lane: Int32):
    """``rotate_into_shared``'s loads of x's row 0 and of row ``suh_row`` of an fp16 suh matrix (``[rows,
    suh_width]``, contiguous, 8-byte aligned, at ``suh_matrix_addr``) without using them: no branch and no conversion,
    so that a caller can issue them before its weight copies and finish with ``rotate_loaded_into_shared``. A lane's
    4 columns of x come by one 8-byte load where they lie inside the row and aligned (else from an aligned address
    inside the tensor, ignored: the scalar path reloads them). Per round: (suh words, x words, vector, column)."""
    width = mX.shape[1]
    x_base = mX.iterator.toint()
    out = []
    for r in cutlass.range_constexpr(rounds):
        col0 = prologue_column(k_begin, n_blocks, r, warp, warps, lane)
        suh = ptx.ld_global_v2_b32(suh_matrix_addr + (Int64(suh_row) * suh_width + col0) * 2)
        addr = x_base + Int64(col0) * 2
        vector = one_access(addr, col0, 4, width, 8)
        out.append((suh, ptx.ld_global_v2_b32(cutlass.select_(vector, addr, x_base & Int64(-8))), vector, col0))
    return out


@cute.jit
def rotate_loaded_into_shared(loads, mX: cute.Tensor, sX: cute.Tensor, n_blocks: Int32, x_order: cutlass.Constexpr,
                              warp: Int32, warps: cutlass.Constexpr, lane: Int32):
    """``rotate_into_shared`` of x's row 0 from ``rotation_loads``' words: the same values and butterflies, so the
    same bits (x's columns outside one aligned 8-byte load of the row: ``row_values``' scalar loads now)."""
    dtype = DTYPE_NAMES[mX.element_type]
    width = mX.shape[1]
    scaled = []
    for r in cutlass.range_constexpr(len(loads)):
        suh_words, x_words, vector, col0 = loads[r]
        suh = ptx.words_to_f32(suh_words[0], suh_words[1], "float16")
        v = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        if vector:
            f = ptx.words_to_f32(x_words[0], x_words[1], dtype)
            for i in cutlass.range_constexpr(4):
                v[i] = f[i]
        else:
            x = row_values(mX, Int32(0), col0, 4, dtype)
            for i in cutlass.range_constexpr(4):
                v[i] = x[i]
        scaled.append(scaled_product([v[i] for i in range(4)], suh, col0, width))
    rotate_scaled_into_shared(scaled, sX, n_blocks, x_order, warp, warps, lane, Int32(0))


@cute.jit
def rotate_scaled_into_shared(scaled, sX: cute.Tensor, n_blocks: Int32, x_order: cutlass.Constexpr, warp: Int32,
                              warps: cutlass.Constexpr, lane: Int32, s_word0: Int32):
    """The butterflies of each round's scaled values (``scaled_values``) and their stores into ``sX`` (as
    ``rotate_into_shared``)."""
    for r in cutlass.range_constexpr(len(scaled)):
        v = hadamard128(scaled[r], lane)
        b = warp + r * warps
        if b < n_blocks:
            e0 = b * 128 + 4 * lane
            if cutlass.const_expr(x_order == "doubled"):
                for i in cutlass.range_constexpr(4):
                    sX[s_word0 + x_doubled_word(e0 + i)] = ptx.pack_f32x2(v[i], v[i], "float16")
            else:
                for h in cutlass.range_constexpr(2):
                    sX[s_word0 + x_pair_word(e0 + 2 * h, x_order)] = ptx.pack_f32x2(v[2 * h], v[2 * h + 1],
                                                                                    "float16")


@cute.jit
def reduce_rotate_store(
    mP: cute.Tensor,
    mSvh: cute.Tensor,
    mBias: cute.Tensor,
    mY: cute.Tensor,
    row: Int32,
    col0: Int32,
    lane: Int32,
    exists,
    n: cutlass.Constexpr,
    partial_f32: cutlass.Constexpr,
    has_bias: cutlass.Constexpr,
    out_type: cutlass.Constexpr,
):
    """A warp's 128-blocks of ``y[row] = H128(sum_s P[s, row]) * svh (+ bias)``, columns < out_true: this lane's
    ``n`` (4 or 8) columns from ``col0``, stored if ``exists`` (its lanes still take part in the butterflies).

    Vector loads per split (``n`` consecutive columns per lane), a batch of splits in flight (fp32 partials:
    ``SPLIT_BATCH_VALUES``); the splits are summed in index order, so the result does not depend on timing (graph
    replays are identical).
    Loads bypass L1: in the GEMM's fused epilogue the partials were just written by other CTAs."""
    svh = load_vector(mSvh, col0, n)
    bias = load_vector(mBias, col0, n) if cutlass.const_expr(has_bias) else None
    acc = cute.make_rmem_tensor(cute.make_layout(n), Float32)
    acc.fill(0.0)
    elem = 4 if partial_f32 else 2
    addr = mP.iterator.toint() + (Int64(row) * mP.shape[2] + col0) * elem
    split_bytes = Int64(mP.shape[1]) * mP.shape[2] * elem
    splits = mP.shape[0]
    if cutlass.const_expr(partial_f32):
        batch = SPLIT_BATCH_VALUES // n
        for s0 in cutlass.range(0, splits, batch):  # the batch's loads first, then its additions in order
            parts = [[x for c in range(0, n, 4) for x in ptx.ld_global_cg_v4_f32_or_neg_zero(
                addr + (s0 + b) * split_bytes + 16 * (c // 4), Int32(s0 + b < splits))] for b in range(batch)]
            for b in cutlass.range_constexpr(batch):  # past the last split: + -0.0, no change
                for i in cutlass.range_constexpr(n):
                    acc[i] = acc[i] + parts[b][i]
    else:
        for split in cutlass.range(splits, unroll=4):
            part = fp16_partial_values(addr + split * split_bytes, n)
            for i in cutlass.range_constexpr(n):
                acc[i] = acc[i] + part[i]
    y = rotated_output_values([acc[i] for i in range(n)], svh, bias, lane)
    if exists:
        store_row_values(mY, row, col0, y, out_type, DTYPE_NAMES[out_type])


@cute.jit
def reduce_rotate_store_spread(mP: cute.Tensor, mSvh: cute.Tensor, mBias: cute.Tensor, mY: cute.Tensor,
                               sum_addr: Int32, row: Int32, block: Int32, warp: Int32, warps: cutlass.Constexpr,
                               lane: Int32, has_bias: cutlass.Constexpr, out_type: cutlass.Constexpr):
    """``reduce_rotate_store`` of one row's 128-block by every warp of the CTA: warp w sums columns ``128/warps``
    wide (a column a lane) over the splits, in split order as there (the same fp32 additions, so the same bits),
    parks the sums at ``sum_addr`` (128 fp32 of shared memory), and warp 0 rotates and stores them. For the M = 1
    GEMM's fused epilogue, where the row is the CTA's one token: each lane keeps 16 splits' loads in flight instead
    of one warp keeping 4, so a block of 28 splits waits two round trips to L2 instead of seven."""
    per_warp = 128 // warps
    col = block * 128 + per_warp * warp + lane
    svh = load_vector(mSvh, block * 128 + 4 * lane)
    bias = load_vector(mBias, block * 128 + 4 * lane) if cutlass.const_expr(has_bias) else None
    if lane < per_warp:
        addr = mP.iterator.toint() + (Int64(row) * mP.shape[2] + col) * 4
        split_bytes = Int64(mP.shape[1]) * mP.shape[2] * 4
        splits = mP.shape[0]
        acc = Float32(0.0)
        for s0 in cutlass.range(0, splits, SPREAD_LOADS):  # the batch's loads first, then its additions in order
            parts = [ptx.ld_global_cg_f32_or_neg_zero(addr + (s0 + i) * split_bytes, Int32(s0 + i < splits))
                     for i in range(SPREAD_LOADS)]
            for i in cutlass.range_constexpr(SPREAD_LOADS):  # past the last split: + -0.0, no change
                acc = acc + parts[i]
        ptx.st_shared_f32(sum_addr + (per_warp * warp + lane) * 4, acc)
    cute.arch.sync_threads()
    if warp == 0:
        v = ptx.ld_shared_v4(sum_addr + 16 * lane, Float32)
        y = rotated_output_values(list(v), svh, bias, lane)
        store_row_values(mY, row, block * 128 + 4 * lane, y, out_type, DTYPE_NAMES[out_type])


def fp16_partial_values(addr, n: int):
    """``n`` (4 or 8) consecutive fp16 partial sums at ``addr`` as Float32, through L2 only, 16 bytes a load where
    they fill one. Traced inline."""
    if n == 4:
        return list(ptx.ld_global_cg_v4_f16_as_f32(addr))
    w = ptx.ld_global_cg_v4_b32(addr)
    return [x for i in range(0, 4, 2) for x in ptx.words_to_f32(w[i], w[i + 1], "float16")]


def rotated_output_values(v, svh, bias, lane):
    """``H128(v) * svh (+ bias)`` for a lane's 4 or 8 values of a 128-block (``bias`` None: none). The arithmetic
    of every output rotation, written once; traced inline."""
    y = [x * s for x, s in zip(hadamard128(v, lane), svh)]
    return y if bias is None else [x + b for x, b in zip(y, bias)]


def rotation_grid(n_blocks, rows, lane_values: int):
    """A dense rotation kernel's grid: x over the 128-blocks of a row, ``lane_values // 4`` per warp; y over the
    rows, ``ROWS_PER_CTA`` (one a warp) per CTA."""
    per_warp = lane_values // 4
    return ((n_blocks + per_warp - 1) // per_warp, (rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1)


@dataclass(frozen=True)
class InputRotationConfig:
    in_dtype: str  # "float16" | "bfloat16"
    x_order: str = "rows"  # the GEMM's X column order (GemmConfig.x_order)
    lane_values: int = INPUT_LANE_VALUES
    # PDL: let the next kernel in the stream launch right after this one's wait (``ptx.wait_for_prior_kernels``)
    early_next: bool = False

    def __post_init__(self):
        if self.x_order not in X_ORDERS:
            raise ValueError(f"x_order must be one of {', '.join(X_ORDERS)}")
        check_lane_values(self.lane_values)


class InputRotation:
    """``X_rot (M, in_p) fp16 = H128(x (M, in_true) * suh)``; columns past ``in_true`` read as zero. In fragment
    order each element goes to its ``trellis.x_fragment_slot``; in doubled order X_rot is ``(M, 2*in_p)`` and each
    element goes twice, to both halves of its ``trellis.x_doubled_word``."""

    def __init__(self, config: InputRotationConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mSuh: cute.Tensor, mXr: cute.Tensor, stream: cuda.CUstream):
        """mX ``(M, in_true)`` fp16/bf16 rows (any row stride), mSuh ``(in_p,)`` fp16, mXr ``(M, in_p)`` fp16
        (``(M, 2*in_p)`` in doubled order; in stages order ``(R, in_p)``, R >= M whole token blocks, the rows past M
        left as they are)."""
        grid = rotation_grid(mSuh.shape[0] // 128, mX.shape[0], self.cfg.lane_values)
        self.kernel(mX, mSuh, mXr).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream, **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSuh: cute.Tensor, mXr: cute.Tensor):
        ptx.wait_for_prior_kernels(self.cfg.early_next)  # PDL: the kernel before this one has finished
        n = self.cfg.lane_values
        row, lane, col0, exists = rotation_thread(n, mSuh.shape[0] // 128)
        if row < mX.shape[0]:
            v = hadamard128(scaled_values(mX, mSuh, row, col0, n), lane)
            if exists:
                store_x_values(mXr.iterator.toint(), row, mXr.shape[0], mSuh.shape[0], col0, v, self.cfg.x_order)


@dataclass(frozen=True)
class OutputRotationConfig:
    out_dtype: str  # "float16" | "bfloat16" | "float32"
    partial_dtype: str = "float32"  # "float16" when the partials come from a dequantize + cuBLAS GEMM
    has_bias: bool = False
    lane_values: int = OUTPUT_LANE_VALUES
    # PDL: let the next kernel in the stream launch right after this one's wait (``ptx.wait_for_prior_kernels``)
    early_next: bool = False

    def __post_init__(self):
        check_lane_values(self.lane_values)


class OutputRotation:
    """``y (M, out_true) = H128(sum_s P[s]) * svh (+ bias)``; P is ``(splits, M, out_p)``."""

    def __init__(self, config: OutputRotationConfig):
        self.cfg = config
        self.out_type = DTYPES[config.out_dtype]

    @cute.jit
    def __call__(self, mP: cute.Tensor, mSvh: cute.Tensor, mBias, mY: cute.Tensor, stream: cuda.CUstream):
        """mP ``(splits, M, out_p)``, mSvh ``(out_p,)`` fp16, mBias ``(out_p,)`` fp16 or None, mY ``(M, out_true)``."""
        bias = mSvh if cutlass.const_expr(mBias is None) else mBias  # never read without a bias
        grid = rotation_grid(mP.shape[2] // 128, mP.shape[1], self.cfg.lane_values)
        self.kernel(mP, mSvh, bias, mY).launch(grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream,
                                               **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mSvh: cute.Tensor, mBias: cute.Tensor, mY: cute.Tensor):
        ptx.wait_for_prior_kernels(self.cfg.early_next)  # PDL: the kernel before this one has finished
        n = self.cfg.lane_values
        row, lane, col0, exists = rotation_thread(n, mP.shape[2] // 128)
        if row < mP.shape[1]:
            reduce_rotate_store(mP, mSvh, mBias, mY, row, col0, lane, exists, n, self.cfg.partial_dtype == "float32",
                                self.cfg.has_bias, self.out_type)
