"""Trellis -> the reconstructed weight with both rotations folded in, for large M:

    W' (in_p, out_p) = diag(suh) Hbd W_hat Hbd diag(svh)     so that     y = x @ W' (+ bias)

is one tensor-core GEMM (cuBLAS) with no rotation pass over the activations (``reference.linear.reconstruct``).

One CTA per 128x128 block (input block ``bi``, output block ``bj``: rows i, columns c), fp32 throughout, one
rounding at the end. H128 is a product of butterflies, one per index bit; the kernel's fp32 arithmetic is fixed
(``canonical order``): over the columns of each row the bits c3, c4, c5, c6, c0, c1, c2 in that order, times
svh/128; then over the rows of each column i3, i4, i5, i6, i0, i1, i2, times suh; one round-to-nearest. Where each
value sits while that happens is free, and the kernel moves values through shared memory (fp32, 16-byte pieces)
instead of shuffling them, so that each butterfly finds its partner in the same thread:

1. Decode (D): warp w decodes tile row w (8 tiles, the GEMM's lane decode); a lane holds rows 2q + (0, 1, 8, 9)
   and columns g + 8m (m = 0..15: bits c3..c6 in registers), so c3..c6 are register butterflies. Stored as is.
2. Exchange (E): a thread loads 8 consecutive columns (c0..c2) of 8 rows i = (lane & 7) + 8a + 64 i6 (a: bits
   i3..i5); c0..c2 in registers, times svh/128, then i3..i5 in registers and i6 by one ``shfl.bfly`` (lane bit
   3). Stored back where it was loaded (no hazard, no barrier before it).
3. Out (F): a thread loads 8 consecutive columns of 8 consecutive rows (i0..i2 in registers), times suh, rounds
   and stores each row piece as one 16-byte store; a warp's store covers 2 rows x 256 bytes.

Per value: one scalar shared store, two 16-byte-vector load/store round trips and one shuffle, where the previous
kernel (three shuffle stages per pass, scalar column loads and stores, a copy-out pass) paid six shuffles and four
shared accesses: it was bound by the shared-memory/shuffle pipe, this one by instruction issue (~29 SASS
instructions per value, 16 of them the fp32 butterflies and scales). 80 registers (``minctasm`` 3): 3 CTAs per
H200 SM. H200, K=4 mcg fp16, L2-cold, 4096x14336 / 14336x4096: kernel 110.4 / 110.0 -> 71.5 / 71.3 us, W' bit
for bit the same. Not kept: no register cap (103 registers, 2 CTAs per SM) 79.4 / 77.1 us; output blocks
fastest 73.1 / 72.7; a persistent grid of 3 or 2 CTAs per SM looping over blocks, with or without an L2
prefetch of the next block's trellis words, 81-83 us (spills at 80 registers).

Shared memory holds the block as fp32 rows of 128 words (64 KB) with its 16-byte pieces swizzled within each
row: piece p of row i sits at p ^ ((i0 ^ i3) | (i & 6)); D's scalar stores and E's and F's 16-byte accesses are then
free of bank conflicts.
"""

from dataclasses import dataclass

import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from . import ptx
from .trellis import TrellisPlan, codebook_constants, decode_lane, lane_word_indices

WARPS = 8  # 256 threads, 64 values each
ROW = 128  # fp32 words per shared-memory row (swizzled, no padding)
SMEM_BYTES = 128 * ROW * 4


def piece_swizzle(i):
    """The XOR applied to the 16-byte piece index (c >> 2) within shared row i: bit 0 = i0 ^ i3, bits 1..2 = i1, i2.
    Plain integer arithmetic (NumPy arrays in the tests)."""
    return ((i ^ (i >> 3)) & 1) | (i & 6)


def smem_word(i, c):
    """Shared-memory word of block value (row i, column c)."""
    return i * ROW + 4 * ((c >> 2) ^ piece_swizzle(i)) + (c & 3)


# Where each thread's values sit, as smem_word spells out for its rows and columns (tests/test_fold.py checks the
# identity): a per-thread part XOR-ed with compile-time bits, plus a compile-time offset. Plain integer arithmetic
# on DSL Int32 or NumPy lane arrays; warp and lane are the thread's, the rest compile-time.

def d_rows_cols(warp, lane, r4, m):
    """D: value m (column bits c3..c6) of row r4 (rows 2q + (0, 1, 8, 9)) of a decode lane."""
    return warp * 16 + 2 * (lane % 4) + (0, 1, 8, 9)[r4], 8 * m + lane // 4


def d_word(warp, lane, r4, m):
    g, q = lane // 4, lane % 4
    return ((warp * 16 + 2 * q) * ROW + g % 4 + 8 * ((m % 4) ^ q) + 4 * ((g // 4) ^ ((r4 & 1) ^ (r4 >> 1)))
            + ROW * (0, 1, 8, 9)[r4] + 32 * (m // 4))


def e_rows_cols(warp, lane, a, k):
    """E: row bits i3..i5 = a, column bits c0..c2 = k; lane bits 0..2 = i0..i2, bit 3 = i6, bit 4 = c3."""
    return lane % 8 + 8 * a + 64 * (lane // 8 % 2), 8 * (lane // 16 + 2 * warp) + k


def e_word(warp, lane, a, hp):
    """First word of E's 16-byte piece hp (columns 4hp..4hp+3 of its 8) of row a."""
    i_lo, cq = lane % 8, lane // 16 + 2 * warp
    return ((i_lo + 64 * (lane // 8 % 2)) * ROW + 8 * (cq ^ (i_lo // 2)) + 4 * ((i_lo % 2) ^ (a % 2) ^ hp)
            + ROW * 8 * a)


def f_rows_cols(warp, lane, b, k):
    """F: row bits i0..i2 = b, column bits c0..c2 = k; lane bit 0 = i3, bits 1..4 = c3..c6, warp = i4..i6."""
    return 16 * warp + 8 * (lane % 2) + b, 8 * (lane // 2) + k


def f_word(warp, lane, b, hp):
    i3, cq = lane % 2, lane // 2
    return (16 * warp + 8 * i3) * ROW + 8 * (cq ^ (b // 2)) + 4 * (i3 ^ (b % 2) ^ hp) + ROW * b


def register_butterflies(v):
    """Unscaled Walsh-Hadamard over the index bits held in registers (``len(v)`` a power of two): the bit of
    step 1 first. Plain arithmetic: the same code runs traced in the kernel and on NumPy lane arrays in the tests."""
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
    set keeps partner - self (sign * self is exact, so a fused FFMA rounds the same)."""
    v = register_butterflies(v)
    for bit in lane_bits:
        sign = Float32(1.0) - Float32(2.0) * Float32((lane >> bit) & 1)
        v = [cute.arch.shuffle_sync_bfly(x, 1 << bit) + sign * x for x in v]
    return v


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """fp32 ``a * b`` that ptxas may not contract into an FMA with a following add (the svh scale feeds the column
    butterflies in registers; the canonical order rounds it first)."""
    values = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
    return Float32(llvm.inline_asm(T.f32(), values, "mul.rn.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False,
                                   loc=loc, ip=ip))


@dsl_user_op
def st_shared_f32(smem_addr, value, *, loc=None, ip=None) -> None:
    values = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, values, "st.shared.f32 [$0], $1;", "r,f", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_v4_f32(smem_addr, values, *, loc=None, ip=None) -> None:
    args = [Int32(smem_addr).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    llvm.inline_asm(None, args, "st.shared.v4.f32 [$0], {$1,$2,$3,$4};", "r,f,f,f,f", has_side_effects=True,
                    loc=loc, ip=ip)


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
        self.plan = TrellisPlan(config.bits, paired=False)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mSuh: cute.Tensor, mSvh: cute.Tensor, mOut: cute.Tensor,
                 stream: cuda.CUstream):
        """mW int32 ``(in_p/16, out_p/16, 8K)``, mSuh fp16 ``(in_p,)``, mSvh fp16 ``(out_p,)``, mOut ``(in_p, out_p)``."""
        grid = (mW.shape[0] // 8, mW.shape[1] // 8, 1)  # input blocks fastest
        self.kernel(mW, mSuh, mSvh, mOut).launch(grid=grid, block=(32 * WARPS, 1, 1), stream=stream,
                                                   min_blocks_per_mp=3, preferred_smem_carveout=100, **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mSuh: cute.Tensor, mSvh: cute.Tensor, mOut: cute.Tensor):
        ptx.wait_for_prior_kernels()  # PDL: the kernel before this one has finished
        tid, _, _ = cute.arch.thread_idx()
        bi, bj, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        block = smem.allocate_tensor(Float32, cute.make_layout(128 * ROW), 16)
        self.fold_block(mW, mSuh, mSvh, mOut, bi, bj, block.iterator.toint(), tid // 32, tid % 32)

    def fold_block(self, mW, mSuh, mSvh, mOut, bi, bj, base, warp, lane):
        """Block (bi, bj) of W' by this CTA, through the 64 KB of shared memory at ``base`` (traced inline)."""
        plan = self.plan
        # D. Weight j of tile n sits at (row 2q + (0, 1, 8, 9)[j % 4], column g + 8 * (j // 4)).
        word_idx, shift = lane_word_indices(plan, lane)
        consts = codebook_constants(self.cfg.codebook, ptx)
        rows = [[None] * 16 for _ in range(4)]  # rows[j % 4][2n + j // 4]: column 8 * (2n + j // 4) + g
        for n in range(8):
            words = [mW[bi * 8 + warp, bj * 8 + n, i] for i in word_idx]
            pairs = decode_lane(plan, self.cfg.codebook, words, shift, ptx, consts)
            for p in range(4):
                halves = ptx.half2_to_f32(pairs[p])
                for h in range(2):
                    j = 2 * p + h
                    rows[j % 4][2 * n + j // 4] = halves[h]
        for r4 in range(4):
            v = register_butterflies(rows[r4])  # c3, c4, c5, c6
            for m in range(16):
                st_shared_f32(base + 4 * d_word(warp, lane, r4, m), v[m])
        cute.arch.sync_threads()

        # E. Rows i = (lane & 7) + 8a + 64 i6 (i6 = lane bit 3), columns 8cq + k (cq = lane bit 4 + 2 warp).
        cq = lane // 16 + 2 * warp
        x = [[None] * 8 for _ in range(8)]
        for a in range(8):
            for hp in range(2):
                x[a][4 * hp:4 * hp + 4] = ptx.ld_shared_v4(base + 4 * e_word(warp, lane, a, hp), Float32)
        svh = [Float32(mSvh[bj * 128 + 8 * cq + k]) * Float32(1.0 / 128.0) for k in range(8)]  # both H128 scales
        for a in range(8):
            x[a] = [mul_rn(v, svh[k]) for k, v in enumerate(register_butterflies(x[a]))]  # c0, c1, c2
        for k in range(8):
            col = butterflies([x[a][k] for a in range(8)], lane, (3,))  # i3, i4, i5; i6
            for a in range(8):
                x[a][k] = col[a]
        for a in range(8):
            for hp in range(2):
                st_shared_v4_f32(base + 4 * e_word(warp, lane, a, hp), x[a][4 * hp:4 * hp + 4])
        cute.arch.sync_threads()

        # F. Rows i = 16 warp + 8 i3 + b (i3 = lane bit 0), columns 8cq + k (cq = lane >> 1).
        i3 = lane % 2
        cq = lane // 2
        row0 = warp * 16 + 8 * i3
        y = [[None] * 8 for _ in range(8)]
        for b in range(8):
            for hp in range(2):
                y[b][4 * hp:4 * hp + 4] = ptx.ld_shared_v4(base + 4 * f_word(warp, lane, b, hp), Float32)
        suh = [Float32(mSuh[bi * 128 + row0 + b]) for b in range(8)]
        for k in range(8):
            col = register_butterflies([y[b][k] for b in range(8)])  # i0, i1, i2
            for b in range(8):
                y[b][k] = col[b] * suh[b]
        out_base = mOut.iterator.toint()
        for b in range(8):
            words = [ptx.pack_f32x2(y[b][2 * h], y[b][2 * h + 1], self.cfg.out_dtype) for h in range(4)]
            ptx.st_global_v4(out_base + (Int64(bi * 128 + row0 + b) * mOut.shape[1] + bj * 128 + 8 * cq) * 2, words)
