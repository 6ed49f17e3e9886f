"""Trellis -> the reconstructed weight with both rotations folded in, for large M:

    W'^T (out_p, in_p) = (diag(suh) Hbd W_hat Hbd diag(svh))^T     so that     y = x @ W' (+ bias)

is one tensor-core GEMM (cuBLAS) with no rotation pass over the activations (``reference.linear.reconstruct``).

One CTA per 128x128 block (input block ``bi``, output block ``bj``): warp w decodes tile row w of the block (the
same lane decode as the GEMM) into shared memory as fp32; then every row is rotated (H128 from the right, one warp
per row, lane l holding columns l + 32r), then every column (H128 from the left), scaled by suh and svh and
rounded once to fp16/bf16. Rows of the fp32 block are 129 words apart, so a warp reading a column hits 32 banks.
The column pass writes W'^T row ``bj*128 + j`` at inputs ``bi*128 + l + 32r``: 64-byte runs per instruction.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32
from cutlass.memory import SmemAllocator

from . import ptx
from .rotate import DTYPES, hadamard128
from .trellis import TrellisPlan, codebook_constants, decode_lane, lane_word_indices, tile_position

WARPS = 8  # one per tile row of the 128x128 block
STRIDE = 129  # fp32 words per shared-memory row (odd: column reads are conflict-free)
SMEM_BYTES = 128 * STRIDE * 4


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
        """mW int32 ``(in_p/16, out_p/16, 8K)``, mSuh fp16 ``(in_p,)``, mSvh fp16 ``(out_p,)``, mOut ``(out_p, in_p)``."""
        grid = (mW.shape[1] // 8, mW.shape[0] // 8, 1)
        self.kernel(mW, mSuh, mSvh, mOut).launch(grid=grid, block=(32 * WARPS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mSuh: cute.Tensor, mSvh: cute.Tensor, mOut: cute.Tensor):
        plan, out_type = self.plan, DTYPES[self.cfg.out_dtype]
        tid, _, _ = cute.arch.thread_idx()
        bj, bi, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        smem = SmemAllocator()
        block = smem.allocate_tensor(Float32, cute.make_layout(128 * STRIDE), 16)

        # Decode: warp w, tile (w, n) of the block; weight j of the lane sits at tile_position(lane, j).
        word_idx, shift = lane_word_indices(plan, lane)
        consts = codebook_constants(self.cfg.codebook, ptx)
        for n in cutlass.range_constexpr(8):
            words = [mW[bi * 8 + warp, bj * 8 + n, i] for i in word_idx]
            pairs = decode_lane(plan, self.cfg.codebook, words, shift, ptx, consts)
            for p in cutlass.range_constexpr(4):
                halves = ptx.half2_to_f32(pairs[p])
                for h in cutlass.range_constexpr(2):
                    row, col = tile_position(lane, 2 * p + h)
                    block[(warp * 16 + row) * STRIDE + n * 16 + col] = halves[h]
        cute.arch.sync_threads()

        # Rows: W_hat Hbd (H128 over the output index of each input row).
        for r in cutlass.range_constexpr(16):
            base = (warp * 16 + r) * STRIDE + lane
            v = hadamard128([block[base + 32 * k] for k in range(4)], lane)
            for k in cutlass.range_constexpr(4):
                block[base + 32 * k] = v[k]
        cute.arch.sync_threads()

        # Columns: Hbd (.) from the left, then suh (rows) and svh (columns), one rounding.
        suh = [Float32(mSuh[bi * 128 + lane + 32 * k]) for k in range(4)]
        for c in cutlass.range_constexpr(16):
            col = warp * 16 + c
            v = hadamard128([block[(lane + 32 * k) * STRIDE + col] for k in range(4)], lane)
            svh = Float32(mSvh[bj * 128 + col])
            for k in cutlass.range_constexpr(4):
                mOut[bj * 128 + col, bi * 128 + lane + 32 * k] = out_type(v[k] * suh[k] * svh)
