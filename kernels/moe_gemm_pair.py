"""Both grouped decode GEMMs of an expert group in one grid: gate/up's CTAs first, then down's.

Between two launches the down GEMM's CTAs wait for their route blocks' ready counters (``MoEGemmConfig.ready_signal``
/ ``ready_wait``), yet its grid only half-fills the GPU while gate/up's last CTAs run: behind a running kernel a
programmatically dependent one gets one occupancy of CTAs an SM and no more until that kernel's last CTA leaves (the
per-CTA trace: at M=256 up to 109 SMs idle, H100, docs/perf.md s74). One grid has no such limit: the hardware
dispatches its CTAs in index order, so every gate/up CTA is resident or done before the first down CTA starts, and a
down CTA that waits for its block's count never holds a slot a gate/up CTA still needs (the same order CUTLASS's
stream-K fixup relies on). Each CTA runs ``MoEGemm.body`` of its half with the plain grid's block indices: CTA
``i < C13 * blocks`` is gate/up's (column tile ``i % C13``, route block ``i // C13``), the rest down's likewise, so
every partial, X2 row and y bit is the two launches' own (K splits too: a half's CTAs in its grid's order).

The next kernel (the top-k sum) launches as this grid ends, or with ``early_next`` once every CTA of it has
started (never before a down CTA has its slot).

Arguments (``MoEGemm``'s for each half): X int32 ``[2, R, H_p/2]``, w13, P13, X2 as int32 ``[1, R, I_p/2]``, w2,
P2, block_expert, group_row, k-tiles per split of each, the fused intermediate's rotations, X2 (fp16), row_route,
counters (arrival counters, then the blocks' ready counters) and the true intermediate size.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Int32

from . import ptx
from .moe_gemm import MoEGemm, MoEGemmConfig, column_tiles, gemm_arguments


@dataclass(frozen=True)
class MoEGemmPairConfig:
    gate_up: MoEGemmConfig
    down: MoEGemmConfig
    # > 0: launch bounds asking ptxas for this many CTAs an SM (MoEGemmConfig.min_ctas_per_sm): one kernel holds
    # the registers of the larger half, which alone may fit fewer CTAs than either half did
    min_ctas_per_sm: int = 0
    # the down GEMM's K splits (P2's first dim; gate/up's are its fused intermediate's): compile-time, so that one
    # split costs no index arithmetic held across the main loop
    down_splits: int = 1
    # PDL: every CTA lets the next kernel (the top-k sum) launch as it starts, so that its CTAs wait resident for
    # this grid's end; they take SM slots only once the last CTA of this grid has started. False: it launches as
    # this grid ends.
    early_next: bool = False

    def __post_init__(self):
        if self.down_splits < 1:
            raise ValueError("down_splits is a K split count")
        if not pairs(self.gate_up, self.down):
            raise ValueError("a GEMM pair takes gate/up with ready_signal and down with ready_wait: mma.sync, the same "
                             "warps, no prologue, fused top-k sum or K splits in x")

    @property
    def warps(self) -> int:
        return self.gate_up.warps

    @property
    def smem_bytes(self) -> int:
        """Either half's shared memory (the halves' allocations share it: ``smem_merge_branch_allocs``)."""
        return max(self.gate_up.smem_bytes, self.down.smem_bytes)


def pairs(gate_up: MoEGemmConfig, down: MoEGemmConfig) -> bool:
    """Can these two GEMMs run as one grid? gate/up hands route blocks to down by the ready counters (so down reads
    nothing that waits for gate/up's whole grid), neither rotates its own input, and both have the same threads."""
    return (gate_up.planes == 2 and down.planes == 1 and gate_up.ready_signal and down.ready_wait
            and gate_up.mma == down.mma == "sync" and gate_up.warps == down.warps
            and gate_up.input is None and down.topk_sum is None and gate_up.route is None
            and not (gate_up.splits_in_x or down.splits_in_x or gate_up.next_after_loop))


class MoEGemmPair:
    def __init__(self, cfg: MoEGemmPairConfig):
        self.cfg = cfg
        self.gate_up = MoEGemm(cfg.gate_up)
        self.down = MoEGemm(cfg.down)
        self.threads = 32 * cfg.warps

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW13: cute.Tensor, mP13: cute.Tensor, mX2Words: cute.Tensor,
                 mW2: cute.Tensor, mP2: cute.Tensor, mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor,
                 per13: Int32, per2: Int32, mRot: cute.Tensor, mX2: cute.Tensor, mRowRoute: cute.Tensor,
                 mCounter: cute.Tensor, inter_true: Int32, stream: cuda.CUstream):
        cols13, cols2 = column_tiles(self.cfg.gate_up, mW13), column_tiles(self.cfg.down, mW2)
        blocks = mBlockExpert.shape[0]
        self.kernel(mX, mW13, mP13, mX2Words, mW2, mP2, mBlockExpert, mGroupRow, per13, per2, mRot, mX2, mRowRoute,
                    mCounter, inter_true).launch(
            grid=((cols13 * self.cfg.gate_up.intermediate_splits + cols2 * self.cfg.down_splits) * blocks, 1, 1),
            block=(self.threads, 1, 1), stream=stream, smem_merge_branch_allocs=True, **ptx.pdl_launch(),
            **ptx.occupancy_bounds(self.cfg.min_ctas_per_sm))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW13: cute.Tensor, mP13: cute.Tensor, mX2Words: cute.Tensor,
               mW2: cute.Tensor, mP2: cute.Tensor, mBlockExpert: cute.Tensor, mGroupRow: cute.Tensor, per13: Int32,
               per2: Int32, mRot: cute.Tensor, mX2: cute.Tensor, mRowRoute: cute.Tensor, mCounter: cute.Tensor,
               inter_true: Int32):
        if cutlass.const_expr(self.cfg.early_next):
            ptx.launch_dependents()
        i, _, _ = cute.arch.block_idx()
        blocks = mBlockExpert.shape[0]
        cols13, cols2 = column_tiles(self.cfg.gate_up, mW13), column_tiles(self.cfg.down, mW2)
        splits13, splits2 = self.cfg.gate_up.intermediate_splits, self.cfg.down_splits
        first_down = cols13 * blocks * splits13
        # each half's CTAs in its plain grid's order (columns, blocks, K splits; x fastest)
        if i < first_down:
            blk, split = split_of(i // cols13, blocks, splits13)
            self.gate_up.body(*gemm_arguments(mX, mW13, mP13, mBlockExpert, mGroupRow, per13, mRot, mX2, mRowRoute,
                                              mCounter, inter_true),
                              i % cols13, blk, split, Int32(cols13 * splits13), False)
        else:
            j = i - first_down
            blk, split = split_of(j // cols2, blocks, splits2)
            self.down.body(*gemm_arguments(mX2Words, mW2, mP2, mBlockExpert, mGroupRow, per2, mRowRoute=mRowRoute,
                                           mCounter=mCounter),
                           j % cols2, blk, split, Int32(cols2 * splits2), False)


def split_of(q, blocks, splits: int):
    """(route block, K split) of a half's ``q``-th row of CTAs (blocks, then splits). Traced inline."""
    if splits == 1:
        return q, Int32(0)
    return q % blocks, q // blocks
