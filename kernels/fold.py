"""Trellis -> the reconstructed weight with both rotations folded in, for large M:

    W' (in_p, out_p) = diag(suh) Hbd W_hat Hbd diag(svh)     so that     y = x @ W' (+ bias)

is one tensor-core GEMM (cuBLAS) with no rotation pass over the activations (``reference.linear.reconstruct``).

One CTA per 128x128 block (input block ``bi``, output block ``bj``), fp32 throughout, one rounding at the end.
H128 is a product of butterflies, one per index bit, in any order and any assignment of index bits to registers
and lanes (the same before and after), which both passes use to keep most butterflies in registers:

1. Rows: warp w decodes tile row w (8 tiles, the GEMM's lane decode). A lane then holds, for each of its 4 input
   rows, 16 of the 128 columns (column bits 3..6 = tile and half, in registers; bits 0..2 = lane bits 2..4), so
   H128 over the columns is 4 register stages and 3 shuffle stages. Scaled by svh/128, stored to shared memory.
2. Columns: 8 lanes per column, lane s holding rows s + 8r (r = 0..15): again 4 register and 3 shuffle stages;
   scaled by suh and written back in place.
3. Copy-out: each thread rounds 8 consecutive values of a block row and stores them as one 16-byte piece of a W'
   row; the grid runs input blocks fastest, so neighbouring CTAs fill adjacent pieces of the same rows. (The
   transposed W'^T stored 2 bytes per lane straight from step 2; H200, 4096x14336 and 14336x4096, L2-cold: kernel
   115-123 -> 111-112 us, the fold path at M=4096 775-799 -> 741-751 us. cuBLAS takes either orientation at the
   same speed within run-to-run noise.)

Rows of the shared block are 132 words apart: the row stores, the column loads and the 16-byte row reads of the
copy-out are all free of bank conflicts.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int64
from cutlass.memory import SmemAllocator

from . import ptx
from .trellis import TrellisPlan, codebook_constants, decode_lane, lane_word_indices

WARPS = 8  # one per tile row of the 128x128 block
STRIDE = 132  # fp32 words per shared-memory row (4 mod 32: conflict-free for both access patterns)
SMEM_BYTES = 128 * STRIDE * 4


def register_butterflies(v):
    """Unscaled Walsh-Hadamard over the index bits held in registers (``len(v)`` a power of two). Plain
    arithmetic: the same code runs traced in the kernel and on NumPy lane arrays in the tests."""
    v = list(v)
    step = 1
    while step < len(v):
        for base in range(0, len(v), 2 * step):
            for k in range(base, base + step):
                v[k], v[k + step] = v[k] + v[k + step], v[k] - v[k + step]
        step *= 2
    return v


def butterflies(v, lane, lane_bits):
    """``register_butterflies``, then the given lane bits (exchanged with ``shfl.bfly``): the lane with the bit
    set keeps partner - self."""
    v = register_butterflies(v)
    for bit in lane_bits:
        sign = Float32(1.0) - Float32(2.0) * Float32((lane >> bit) & 1)
        v = [cute.arch.shuffle_sync_bfly(x, 1 << bit) + sign * x for x in v]
    return v


@dataclass(frozen=True)
class FoldConfig:
    bits: float
    codebook: str
    out_dtype: str = "float16"  # "float16" | "bfloat16": the activations' dtype

    def __post_init__(self):
        TrellisPlan(self.bits)
        if self.out_dtype not in ("float16", "bfloat16"):
            raise ValueError("out_dtype must be float16 or bfloat16")


class Fold:
    def __init__(self, config: FoldConfig):
        self.cfg = config
        self.plan = TrellisPlan(config.bits)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mSuh: cute.Tensor, mSvh: cute.Tensor, mOut: cute.Tensor,
                 stream: cuda.CUstream):
        """mW int32 ``(in_p/16, out_p/16, 8K)``, mSuh fp16 ``(in_p,)``, mSvh fp16 ``(out_p,)``, mOut ``(in_p, out_p)``."""
        grid = (mW.shape[0] // 8, mW.shape[1] // 8, 1)  # input blocks fastest: neighbours write adjacent row pieces
        self.kernel(mW, mSuh, mSvh, mOut).launch(grid=grid, block=(32 * WARPS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mSuh: cute.Tensor, mSvh: cute.Tensor, mOut: cute.Tensor):
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        bi, bj, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        smem = SmemAllocator()
        block = smem.allocate_tensor(Float32, cute.make_layout(128 * STRIDE), 16)

        # 1. Rows. Weight j of tile n sits at (row 2q + (0, 1, 8, 9)[j % 4], column g + 8 * (j // 4)).
        word_idx, shift = lane_word_indices(plan, lane)
        consts = codebook_constants(self.cfg.codebook, ptx)
        g, q = lane // 4, lane % 4
        rows = [[None] * 16 for _ in range(4)]  # rows[j % 4][2n + j // 4]: column 8 * (2n + j // 4) + g
        for n in cutlass.range_constexpr(8):
            words = [mW[bi * 8 + warp, bj * 8 + n, i] for i in word_idx]
            pairs = decode_lane(plan, self.cfg.codebook, words, shift, ptx, consts)
            for p in cutlass.range_constexpr(4):
                halves = ptx.half2_to_f32(pairs[p])
                for h in cutlass.range_constexpr(2):
                    j = 2 * p + h
                    rows[j % 4][2 * n + j // 4] = halves[h]
        svh = [Float32(mSvh[bj * 128 + 8 * m + g]) * Float32(1.0 / 128.0) for m in range(16)]  # both H128 scales
        for r4 in cutlass.range_constexpr(4):
            v = butterflies(rows[r4], lane, (2, 3, 4))
            row = warp * 16 + 2 * q + (0, 1, 8, 9)[r4]
            for m in cutlass.range_constexpr(16):
                block[row * STRIDE + 8 * m + g] = v[m] * svh[m]
        cute.arch.sync_threads()

        # 2. Columns 16w + 4c + lane // 8; lane s = lane % 8 holds rows s + 8r.
        s = lane % 8
        suh = [Float32(mSuh[bi * 128 + s + 8 * r]) for r in range(16)]
        for c in cutlass.range_constexpr(4):
            col = warp * 16 + 4 * c + lane // 8
            v = butterflies([block[(s + 8 * r) * STRIDE + col] for r in range(16)], lane, (0, 1, 2))
            for r in cutlass.range_constexpr(16):
                block[(s + 8 * r) * STRIDE + col] = v[r] * suh[r]  # the values this lane read: no hazard
        cute.arch.sync_threads()

        # 3. Copy-out: piece k (8 values) of block row `row`, as four packed words.
        smem_base = block.iterator.toint()
        out_base = mOut.iterator.toint()
        for i in cutlass.range_constexpr(128 * 16 // (32 * WARPS)):
            piece = i * 32 * WARPS + tid
            row, k = piece // 16, piece % 16
            src = smem_base + (row * STRIDE + 8 * k) * 4
            v = ptx.ld_shared_v4(src, Float32) + ptx.ld_shared_v4(src + 16, Float32)
            words = [ptx.pack_f32x2(v[2 * h], v[2 * h + 1], self.cfg.out_dtype) for h in range(4)]
            ptx.st_global_v4(out_base + (Int64(bi * 128 + row) * mOut.shape[1] + bj * 128 + 8 * k) * 2, words)
