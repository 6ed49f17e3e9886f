"""Trellis -> fp16 ``W_hat^T (out_p, in_p)``: one warp per 16x16 tile, the same lane decode as the GEMM.

It is the weight half of the large-M path (decode once, then a tensor-core GEMM ``x_rot @ W_hat``, which takes
the transposed operand natively) and, compared with the torch reference via ``torch.equal``, the bit-exact check
of the device decode.

Why transposed: a lane's fp16 pairs are two consecutive *input* rows of one output column, i.e. one 32-bit word
of a W_hat^T row. Each warp writes its tile into shared memory in that order (rows padded to 12 words so the
four stores hit 32 distinct banks), then every lane stores one 16-byte half row: full 32-byte sectors.

Tile order: consecutive warps take consecutive tiles along the *input* axis, so the 32-byte pieces a CTA writes
into each W_hat^T row are contiguous (H200, 4096x14336: 51 -> 44.5 us against tiles taken along the output axis;
several tiles per warp with all loads issued first did not help: 44.7-47.7 us).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator

from . import ptx
from .trellis import TrellisPlan, codebook_constants, decode_lane, lane_word_indices

WARPS = 4
ROW_WORDS = 12  # 8 words of a 16-wide fp16 row + 4 of padding (bank spread, keeps 16-byte alignment)
TILE_WORDS = 16 * ROW_WORDS


@dataclass(frozen=True)
class DequantConfig:
    bits: float
    codebook: str


class Dequantize:
    def __init__(self, config: DequantConfig):
        self.cfg = config
        self.plan = TrellisPlan(config.bits, paired=False)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        """mW int32 ``(in_p/16, out_p/16, 8K)``, mOut int32 ``(out_p, in_p/2)`` (fp16 pairs of W_hat^T rows)."""
        tiles = mW.shape[0] * mW.shape[1]  # a multiple of 64: both tile counts are multiples of 8
        self.kernel(mW, mOut).launch(grid=(tiles // WARPS, 1, 1), block=(32 * WARPS, 1, 1), stream=stream,
                                     **ptx.pdl_launch())

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mOut: cute.Tensor):
        ptx.wait_for_prior_kernels()  # PDL: the kernel before this one has finished
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        tile = bid * WARPS + warp
        b = tile // mW.shape[0]
        a = tile % mW.shape[0]
        word_idx, shift = lane_word_indices(self.plan, lane)
        words = [mW[a, b, i] for i in word_idx]
        pairs = decode_lane(self.plan, self.cfg.codebook, words, shift, ptx, codebook_constants(self.cfg.codebook, ptx))

        smem = SmemAllocator()
        staging = smem.allocate_tensor(Int32, cute.make_layout(WARPS * TILE_WORDS), 16)
        base = staging.iterator.toint() + warp * (TILE_WORDS * 4)
        g = lane // 4
        q = lane % 4
        # Pair p = weights 2p, 2p+1: W_hat rows (2q, 2q+1) + 8*(p%2), column g + 8*(p//2) -> W_hat^T row, word.
        for p in cutlass.range_constexpr(4):
            row = g + 8 * (p // 2)
            ptx.st_shared_b32(base + (row * ROW_WORDS + 4 * (p % 2) + q) * 4, pairs[p])
        cute.arch.sync_warp()
        row = lane // 2
        half = lane % 2
        chunk = ptx.ld_shared_v4(base + (row * ROW_WORDS + 4 * half) * 4)
        out_word = Int64(b * 16 + row) * mOut.shape[1] + a * 8 + half * 4
        ptx.st_global_v4(mOut.iterator.toint() + out_word * 4, chunk)
