"""Grouped decode GEMM of the fused MoE layer: ``P[s, r, plane*N_p + n] = X[plane, r] @ W_hat[plane, expert(r)]``.

Rows ``r`` are routes packed by expert (``moe_route``): block ``b`` holds rows ``b*T .. b*T+T-1`` (T = tokens per
CTA), all of one expert ``block_expert[b]`` (-1: an unused block). One launch serves one expert group (one K and
codebook): ``group_row[e]`` is expert e's row in the group's stacked tensors, -1 for experts of other groups,
whose blocks this launch skips. ``planes`` = 2 for gate/up (``w13 [2, E, H_p/16, I_p/16, 16K]``, each plane with
its own rotated input) and 1 for down (``w2 [E, I_p/16, H_p/16, 16K]`` viewed with a leading plane dim). A CTA's
``warps`` tile columns never straddle the planes (N_p/16 is a multiple of 8). The main loop is the dense GEMM's
(``mainloop.decode_mma_loop``); K splits write fp32 partials that the next kernel sums in split order.

Arguments: X int32 ``[planes, R, K_p/2]``, W int32 ``[planes, E_g, K_p/16, N_p/16, 8K]``, P fp32
``[splits, R, planes*N_p]``, block_expert int32 ``[blocks]``, group_row int32 ``[experts]``.
"""

from dataclasses import dataclass
from functools import cached_property

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from .gemm import GemmConfig
from .mainloop import DecodeGemmKernel, acc_groups, allocate_smem, decode_mma_loop


@dataclass(frozen=True)
class MoEGemmConfig:
    bits: float
    codebook: str
    planes: int  # 2: gate/up from w13, 1: down from w2
    token_groups: int = 1  # 8 packed rows each: the route block of the layer
    warps: int = 4
    k_tiles_per_stage: int = 8
    stages: int = 2
    warp_cols: int = 1  # shared decode (mainloop) when > 1

    def __post_init__(self):
        if self.planes not in (1, 2):
            raise ValueError("planes must be 1 (w2) or 2 (w13)")
        self.mainloop  # validates the rest, including the shared-memory limit

    @cached_property
    def mainloop(self) -> GemmConfig:
        return GemmConfig(bits=self.bits, codebook=self.codebook, token_groups=self.token_groups, warps=self.warps,
                          k_tiles_per_stage=self.k_tiles_per_stage, stages=self.stages, warp_cols=self.warp_cols)

    @property
    def tokens_per_cta(self) -> int:
        return 8 * self.token_groups

    @property
    def smem_bytes(self) -> int:
        return self.mainloop.smem_bytes


class MoEGemm(DecodeGemmKernel):
    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mP: cute.Tensor,
        mBlockExpert: cute.Tensor,
        mGroupRow: cute.Tensor,
        k_tiles_per_split: Int32,
        stream: cuda.CUstream,
    ):
        grid = (self.cfg.planes * mW.shape[3] // self.cfg.warps, mBlockExpert.shape[0], mP.shape[0])
        self.kernel(mX, mW, mP, mBlockExpert, mGroupRow, k_tiles_per_split).launch(
            grid=grid, block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mP: cute.Tensor, mBlockExpert: cute.Tensor,
               mGroupRow: cute.Tensor, k_tiles_per_split: Int32):
        cfg, main = self.cfg, self.cfg.mainloop
        tid, _, _ = cute.arch.thread_idx()
        bn, blk, split = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32

        _, sW, sX, sDec = allocate_smem(main)
        expert = mBlockExpert[blk]
        p = mGroupRow[cutlass.max(expert, 0)]
        if expert >= 0 and p >= 0:
            n_col_tiles = mW.shape[3]
            k_tiles = mW.shape[2]
            words = self.plan.words_per_tile
            plane = (bn * cfg.warps) // n_col_tiles
            col_tile0 = bn * cfg.warps - plane * n_col_tiles
            rows = mX.shape[1]
            w_base = mW.iterator.toint() + Int64(plane * mW.shape[1] + p) * k_tiles * n_col_tiles * words * 4
            x_base = mX.iterator.toint() + Int64(plane) * rows * mX.shape[2] * 4
            k_begin = split * k_tiles_per_split
            k_end = cutlass.min(k_begin + k_tiles_per_split, k_tiles)
            n_chunks = cutlass.max(k_end - k_begin, 0) // cfg.k_tiles_per_stage
            tok0 = blk * cfg.tokens_per_cta

            acc = cute.make_rmem_tensor(cute.make_layout(4 * cfg.token_groups), Float32)
            acc.fill(0.0)
            decode_mma_loop(main, self.plan, acc, sW, sX, sDec, w_base, x_base, mX.shape[2], n_col_tiles,
                            col_tile0, tok0, rows, k_begin, n_chunks)

            # D rows are output columns (g, g+8), D columns are rows (2q, 2q+1); every row of the block exists.
            for j, col_tile, group in acc_groups(main, warp):
                col = plane * n_col_tiles * 16 + (col_tile0 + col_tile) * 16 + lane // 4
                row = tok0 + group * 8 + 2 * (lane % 4)
                mP[split, row, col] = acc[4 * j]
                mP[split, row, col + 8] = acc[4 * j + 2]
                mP[split, row + 1, col] = acc[4 * j + 1]
                mP[split, row + 1, col + 8] = acc[4 * j + 3]
