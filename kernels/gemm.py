"""Dense W4A16 trellis GEMM: ``P[s] = X_rot @ W_hat`` over one K split, weights decoded in registers.

Operands are swapped (kernels.md): the decoded 16x16 weight tile is the A operand of ``mma.m16n8k16`` (its
rows are 16 output columns) and 8 tokens of activations are the B operand, so M = 1 wastes 7/8 of an MMA
instead of 15/16, and each lane's decoded weights already sit in its A registers (``trellis.mma_a_fragment``).

CTA: ``warps`` warps, warp w owns output tile column ``bn*warps + w`` (16 columns); the CTA owns
``8*token_groups`` tokens and one K split. Each stage brings ``k_tiles_per_stage`` rows of tiles and the matching
activation slab into shared memory with 16-byte ``cp.async``; ``stages`` of them are in flight. Partial sums go
to ``P[split, token, column]`` in fp32. Then either ``rotate.OutputRotation`` reduces the splits and rotates
(``output=None``), or the GEMM does it itself (``output="float16"``, ...): every CTA bumps a counter of its
128-column block; the last one to arrive (all splits of the block written) sums the partials in split order,
rotates, scales by svh, adds the bias and writes y, then resets the counter to 0 for the next launch.

On sm_90a, from 33 tokens on, ``mma="wgmma"``: warps come in warpgroups of four whose decoded tiles (64 output
columns, the same A-fragment registers) multiply all the CTA's tokens (up to 256) with one asynchronous
``wgmma.m64nNk16`` per k-tile, B read by descriptor from shared memory where cp.async put X (``mainloop``). The
accumulators have the mma.m16n8k16 layout, so the partial-sum stores and the fused epilogue are the same; with one
K split (``whole_k``) each CTA holds whole 128-column tiles, stages them in shared memory over the drained X stages
and rotates them there instead (``rotate_tile_from_shared``: no partials, no counters).

Arguments are tensors (``exl3tool.ops.launch`` passes torch tensors through TVM FFI): X int32 ``[M, in_p/2]``
(fp16 pairs of the rotated input), W int32 ``[in_p/16, out_p/16, 8K]`` (the trellis words), P fp32
``[splits, M, out_p]``, all contiguous and 16-byte aligned.
"""

from dataclasses import dataclass

import cutlass
from cuda.bindings import driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import ptx
from .rotate import (
    DTYPES,
    load_vector,
    reduce_rotate_store,
    reduce_rotate_store_spread,
    rotate_into_shared,
    rotated_output_values,
    store_row_values,
)
from .mainloop import (  # noqa: F401 (CHUNK_UNROLL: the SASS tests read it here)
    CHUNK_UNROLL,
    DecodeGemmKernel,
    acc_groups,
    allocate_smem,
    decode_mma_loop,
)
from .trellis import X_ORDERS, TrellisPlan

SMEM_LIMIT_BYTES = 99 * 1024  # SM120's per-CTA limit; we hold every GPU to it
WGMMA_SMEM_LIMIT_BYTES = 227 * 1024  # the warpgroup-MMA GEMM runs on sm_90a only: its per-CTA limit
MMAS = ("sync", "wgmma")
# fp32 words per token row of the output tile the warpgroup-MMA GEMM's fused epilogue stages in shared memory: 128
# columns + 4, so that the MMA layout's stores (lanes: 8 columns x 4 token pairs) hit 32 distinct banks.
TILE_PITCH = 132
ROTATE_BATCH_ROWS = 8  # rows of that tile a warp loads before it rotates them


class SharedMemoryError(ValueError):
    """A kernel config whose shared memory exceeds its per-CTA limit (planners try the next config on it)."""


def check_smem(config, smem_bytes: int, mma: str) -> None:
    """Raise SharedMemoryError where ``config`` needs more shared memory than its MMA kind's per-CTA limit."""
    limit = WGMMA_SMEM_LIMIT_BYTES if mma == "wgmma" else SMEM_LIMIT_BYTES
    if smem_bytes > limit:
        raise SharedMemoryError(f"{config} needs {smem_bytes} bytes of shared memory (limit {limit})")


@dataclass(frozen=True)
class GemmConfig:
    bits: float
    codebook: str
    token_groups: int = 1  # 8 tokens each
    # Defaults from the H200 sweep (docs/perf.md): 4 warps, 8 k-tiles per stage, double buffering.
    warps: int = 4  # 16 output columns each
    k_tiles_per_stage: int = 8  # one 128-row rotation block of the input per stage
    stages: int = 2
    output: str | None = None  # fused output rotation: y's dtype ("float16", "bfloat16", "float32")
    has_bias: bool = False
    split_halves: bool = False  # mcg/3inst: two MMAs per tile add each weight's halves (trellis.split_halves_fragments)
    # X's column order (trellis.X_ORDERS): "rows" (x as is), "fragments" (trellis.x_fragment_slot: each lane's B
    # words of a k-tile pair side by side, one 16-byte shared load instead of four 32-bit ones), with split
    # halves "doubled" (trellis.x_doubled_word: the B words already duplicated, one 16-byte load per k-tile), or with
    # wgmma "stages" (trellis.x_stages_index: a route block's stage is one bulk copy per 64 columns, mainloop).
    x_order: str = "rows"
    # Tile columns each warp multiplies: 1 = its own decoded tile, by all the CTA's tokens (private decode); 2, 4
    # or 8 = decoded tiles shared through shared memory, each warp taking warp_cols columns and token_groups /
    # warp_cols of the token groups (mainloop: shared decode, up to 16 token groups).
    warp_cols: int = 1
    # M = 1 only: the GEMM rotates its own input (x's dtype, "float16" or "bfloat16"): each CTA rotates its K
    # split's blocks of x into shared memory while its first weight stages load, and every MMA reads B from there
    # (no input-rotation launch). ``resident_k_tiles`` sizes that buffer: the plan's k-tiles per split.
    input: str | None = None
    resident_k_tiles: int = 0
    # Rows of x resident with ``input``: 1 (one token; every MMA column reads it), or up to 8 (the MoE GEMM's small
    # route blocks: lane quad g reads row g, the last one past them), each padded (``resident_pad_words``).
    resident_rows: int = 1
    # "sync": warp-level mma.sync (every arch). "wgmma" (sm_90a only): each warpgroup's four decoded tiles (64 output
    # columns, in registers) multiply all the CTA's tokens (up to 256) with one asynchronous warpgroup MMA per
    # k-tile, B read from shared memory where cp.async put it (128-byte swizzled token rows, ``ptx``); the warps
    # decode the next stage while the tensor cores work on this one.
    mma: str = "sync"
    # wgmma with ``output``, one K split (the plan's promise): each CTA holds whole 128-column tiles and rotates them
    # from shared memory (``rotate_tile_from_shared``) instead of writing partials and counting in.
    whole_k: bool = False
    # M = 1 (``input``) with ``output``, more K splits than one warp keeps in flight (``SPLITS_IN_FLIGHT``): the
    # last CTA of a 128-column block sums it with every warp, a column a lane (``reduce_rotate_store_spread``),
    # instead of warp 0 alone. The plan's choice: with fewer splits it gains nothing (one round trip either way)
    # and the kernel keeps the other epilogue's code and registers.
    spread_sum: bool = False
    # wgmma only: stages handed over through mbarriers (``mainloop.mbarrier_wgmma_loop``: each copy's completion
    # arrives on its stage's "full" barrier, each warp releases a stage once its MMAs are done) instead of one CTA
    # barrier per stage, so a warp waits only for the data it reads and for the stage it refills, which every warp
    # released a chunk before.
    mbarriers: bool = False
    # wgmma only: one stage a main-loop iteration, not two (``mainloop.chunk_unroll``). Each stage's MMAs read
    # the same A registers, so a stage waits for all of them (``wgmma_wait(0)``) before its decode writes them.
    rolled: bool = False
    # PDL: let the next kernel in the stream launch right after this one's wait (``ptx.wait_for_prior_kernels``)
    early_next: bool = False

    def __post_init__(self):
        TrellisPlan(self.bits)  # validates the bitrate
        if self.mma not in MMAS:
            raise ValueError(f"mma must be one of {', '.join(MMAS)}")
        if self.mma == "wgmma":
            self._check_wgmma()
        elif self.token_groups not in (1, 2, 4, 8, 16) or (self.token_groups == 16 and self.warp_cols == 1):
            raise ValueError("token_groups must be 1, 2, 4 or 8 (16 with shared decode)")
        if self.warp_cols not in (1, 2, 4, 8) or self.warp_cols > self.warps or self.token_groups % self.warp_cols:
            raise ValueError("warp_cols must be 1, 2, 4 or 8, at most warps, and divide token_groups")
        if self.warp_cols > 1 and self.split_halves:
            raise ValueError("shared decode stores summed weights: no split_halves")
        if self.warps not in (4, 8):
            raise ValueError("warps must be 4 or 8 (out_p/16 is a multiple of 8)")
        if self.k_tiles_per_stage not in (1, 2, 4, 8, 16):
            raise ValueError("k_tiles_per_stage must be 1, 2, 4, 8 (they divide in_p/16, a multiple of 8) or 16 "
                             "(where the caller's K splits are whole stages)")
        if self.stages < 2:
            raise ValueError("need at least two pipeline stages")
        if self.split_halves and self.codebook == "mul1":
            raise ValueError("split_halves is for the mcg and 3inst codebooks")
        if self.x_order not in X_ORDERS:
            raise ValueError(f"x_order must be one of {', '.join(X_ORDERS)}")
        if self.x_order == "fragments" and (self.split_halves or self.k_tiles_per_stage < 2):
            raise ValueError("x_order='fragments' reads k-tile pairs (k_tiles_per_stage >= 2), without split_halves")
        if self.x_order == "doubled" and not self.split_halves:
            raise ValueError("x_order='doubled' holds the B words of split_halves")
        if self.x_order == "stages" and self.mma != "wgmma":
            raise ValueError("x_order='stages' is the warpgroup-MMA GEMM's shared-memory stage layout")
        if self.input is not None and (self.input not in ("float16", "bfloat16")
                                       or not self.takes_input(self.resident_k_tiles)):
            raise ValueError("input (fp16/bf16) is for one token group, 8 k-tiles per stage and resident_k_tiles a "
                             "positive multiple of 8")
        if not 1 <= self.resident_rows <= 8 or (self.resident_rows > 1 and self.input is None):
            raise ValueError("resident_rows: 1 to 8 rows of x, with input")
        if (self.mbarriers or self.rolled) and self.mma != "wgmma":
            raise ValueError("mbarriers and rolled are pipelines of the warpgroup-MMA main loop")
        if self.whole_k and (self.mma != "wgmma" or self.output is None):
            raise ValueError("whole_k is the warpgroup-MMA GEMM's epilogue with a fused output rotation")
        if self.spread_sum and (self.input is None or self.output is None):
            raise ValueError("spread_sum is the one-token GEMM's fused epilogue (input and output set)")
        if self.whole_k and self.x_smem_words < self.tokens_per_cta * TILE_PITCH:
            raise ValueError("whole_k: the X stages must hold the CTA's output tile")
        if self.output not in (None, *DTYPES):
            raise ValueError(f"output must be None or one of {', '.join(DTYPES)}")
        check_smem(self, self.smem_bytes, self.mma)

    def takes_input(self, resident_k_tiles: int) -> bool:
        """Can this GEMM rotate its own input (``input``) over a K split of ``resident_k_tiles`` k-tiles? One token
        group, 8 k-tiles per stage, and whole stages of them."""
        return self.token_groups == 1 and self.k_tiles_per_stage == 8 and resident_k_tiles > 0 \
            and resident_k_tiles % 8 == 0

    def _check_wgmma(self):
        if self.token_groups not in (1, 2, 4, 8, 16, 32, 40):
            raise ValueError("wgmma: token_groups must be 1, 2, 4, 8, 16, 32 or 40 (8 to 320 tokens)")
        if (self.warps not in (4, 8) or self.warp_cols != 1 or self.split_halves
                or self.x_order not in ("rows", "stages") or self.input is not None):
            raise ValueError("wgmma: one or two warpgroups (4 or 8 warps) of private decode, X in row or stages "
                             "order, no split_halves or input")
        if self.k_tiles_per_stage not in (4, 8) or self.stages < 3:
            raise ValueError("wgmma: 4 or 8 k-tiles per stage (whole 128-byte swizzle atoms) and at least 3 "
                             "stages (one stage is read by the MMAs in flight)")

    @property
    def tokens_per_cta(self) -> int:
        return 8 * self.token_groups

    @property
    def w_row_words(self) -> int:
        return self.warps * TrellisPlan(self.bits).words_per_tile

    @property
    def w_stage_words(self) -> int:
        return self.k_tiles_per_stage * self.w_row_words

    @property
    def x_k_tile_words(self) -> int:
        """32-bit words of one token's X per k-tile: 8 (16 fp16 values), 16 in doubled order."""
        return 16 if self.x_order == "doubled" else 8

    @property
    def x_row_words(self) -> int:
        if self.mma == "wgmma":
            return self.x_k_tile_words * self.k_tiles_per_stage  # swizzled, not padded
        return self.x_k_tile_words * self.k_tiles_per_stage + self.x_row_pad_words

    @property
    def x_row_pad_words(self) -> int:
        """Rows padded so that the token rows a warp reads at once fall in distinct banks: +4 words for the 32-bit
        loads of row order (8 rows), +16 for the 16-byte loads of fragment and doubled order (2 rows per 8-lane
        phase)."""
        return 4 if self.x_order == "rows" else 16

    @property
    def x_stage_words(self) -> int:
        return 0 if self.input else self.tokens_per_cta * self.x_row_words

    @property
    def resident_pad_words(self) -> int:
        """Padding of a resident row of x (``input``): as ``x_row_pad_words`` where rows are several (one row has no
        neighbour to share banks with)."""
        return self.x_row_pad_words if self.resident_rows > 1 else 0

    @property
    def resident_row_words(self) -> int:
        """One resident row of x (``input``): the K split's k-tiles, padded."""
        return self.x_k_tile_words * self.resident_k_tiles + self.resident_pad_words

    @property
    def x_smem_words(self) -> int:
        """X in shared memory: the stage ring, or with ``input`` the resident rows of the K split."""
        return self.resident_rows * self.resident_row_words if self.input else self.stages * self.x_stage_words

    @property
    def max_resident_k_tiles(self) -> int:
        """The most k-tiles (a multiple of 8) the resident rows of x (``input``) can hold beside the weight
        stages."""
        free = (SMEM_LIMIT_BYTES - 4 * self.stages * self.w_stage_words - 16
                - 4 * self.resident_rows * self.resident_pad_words)
        return free // (4 * self.x_k_tile_words * self.resident_rows) // 8 * 8

    @property
    def decoded_words(self) -> int:
        """Shared decode's buffer: one stage of A fragments (32 lanes x 4 words per tile)."""
        return self.k_tiles_per_stage * self.warps * 128 if self.warp_cols > 1 else 0

    @property
    def smem_bytes(self) -> int:
        align = 1024 if self.mma == "wgmma" else 0  # the swizzled X stages start on a 1024-byte boundary
        # a full and an empty mbarrier per stage (X in "stages" order: its bulk copies complete on the full one)
        bars = 16 * self.stages if self.mbarriers or self.x_order == "stages" else 0
        return 4 * (self.stages * self.w_stage_words + self.x_smem_words + self.decoded_words) + 16 + align + bars


def fitting_config(config_type=GemmConfig, **fields):
    """The config asked for (a ``GemmConfig``, or e.g. the MoE GEMM's ``config_type``), with as many pipeline
    stages (down to 2) as fit in the shared-memory limit."""
    stages = fields.pop("stages", config_type.stages)
    for n in range(stages, 1, -1):
        try:
            return config_type(stages=n, **fields)
        except SharedMemoryError:
            pass
    return config_type(stages=2, **fields)


class TrellisGemm(DecodeGemmKernel):
    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mP: cute.Tensor,
        k_tiles_per_split: Int32,
        mSvh,
        mBias,
        mY,
        mCounter,
        mSuh,
        stream: cuda.CUstream,
    ):
        """mX int32 ``(M, in_p/2)`` (doubled order: ``(M, in_p)``; stages order: ``(R, in_p/2)``, R = M rounded up to
        whole token blocks, ``linear.x_rows``), mW int32 ``(in_p/16, out_p/16, 8K)``, mP fp32 ``(splits, M, out_p)``.

        The fused epilogue (``output`` set) also takes mSvh/mBias fp16 ``(out_p,)`` (mBias None without a bias),
        mY ``(M, out_true)`` and mCounter int32 ``(ceil(M/tokens_per_cta) * out_p/128,)``; without it all four
        are None. With ``input`` mX is x itself ``(1, in_true)`` (fp16/bf16, rows may be strided) and mSuh fp16
        ``(in_p,)``; else mSuh is None."""
        if cutlass.const_expr(mSuh is None):
            mSuh = mP  # never touched: no prologue
        if cutlass.const_expr(self.cfg.output is None):
            mSvh, mBias, mY, mCounter = mP, mP, mP, mP  # never touched: the epilogue is compiled out
        elif cutlass.const_expr(mBias is None):
            mBias = mSvh  # never read without a bias
        grid = (
            mW.shape[1] // self.cfg.warps,
            (mX.shape[0] + self.cfg.tokens_per_cta - 1) // self.cfg.tokens_per_cta,
            mP.shape[0],
        )
        self.kernel(mX, mW, mP, k_tiles_per_split, mSvh, mBias, mY, mCounter, mSuh).launch(
            grid=grid, block=(self.threads, 1, 1), stream=stream, **ptx.pdl_launch()
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mP: cute.Tensor,
        k_tiles_per_split: Int32,
        mSvh: cute.Tensor,
        mBias: cute.Tensor,
        mY: cute.Tensor,
        mCounter: cute.Tensor,
        mSuh: cute.Tensor,
    ):
        ptx.wait_for_prior_kernels(self.cfg.early_next)  # PDL: the kernel before this one has finished
        cfg, plan = self.cfg, self.plan
        tid, _, _ = cute.arch.thread_idx()
        bn, bm, split = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32

        tokens = mP.shape[1]  # X's rows may be padded to whole token blocks ("stages" order)
        n_k_tiles = mW.shape[0]
        k_begin = split * k_tiles_per_split
        k_end = cutlass.min(k_begin + k_tiles_per_split, n_k_tiles)
        n_chunks = (k_end - k_begin) // cfg.k_tiles_per_stage
        tok0 = bm * cfg.tokens_per_cta
        col_tile0 = bn * cfg.warps

        smem, sW, sX, sDec = allocate_smem(cfg)
        sLast = smem.allocate_tensor(Int32, cute.make_layout(4), 16)

        acc = cute.make_rmem_tensor(cute.make_layout(4 * cfg.token_groups), Float32)
        acc.fill(0.0)
        prologue = None
        if cutlass.const_expr(cfg.input is not None):
            def prologue(sX):  # noqa: E306 (the K split's x blocks, rotated, into the resident row)
                rotate_into_shared(mX, mSuh, sX, k_begin, n_chunks * cfg.k_tiles_per_stage // 8,
                                   -(-cfg.resident_k_tiles // (8 * cfg.warps)), cfg.x_order, warp, cfg.warps, lane)
        decode_mma_loop(cfg, plan, acc, sW, sX, sDec, mW.iterator.toint(), mX.iterator.toint(), mX.shape[1],
                        mW.shape[1], col_tile0, tok0, tokens, k_begin, n_chunks, prologue, mX.shape[0])
        if cutlass.const_expr(cfg.whole_k):
            # the CTA holds its whole 128-column tile, so it rotates it from shared memory
            rotate_tile_from_shared(cfg, acc, sX.iterator.toint(), mSvh, mBias, mY, col_tile0 // 8, tok0, tokens,
                                    warp, lane)
        else:
            self.partials_epilogue(mP, mSvh, mBias, mY, mCounter, sLast, sW, acc, split, bm, col_tile0, tok0, tokens,
                                   tid, warp, lane)

    @cute.jit
    def partials_epilogue(self, mP, mSvh, mBias, mY, mCounter, sLast, sW, acc, split, bm, col_tile0, tok0, tokens, tid,
                          warp, lane):
        """The CTA's partial sums to ``P[split]``; with ``output``, then the last CTA of its 128-column block (every
        split written) sums them in split order and rotates them."""
        cfg = self.cfg
        # D rows are output columns (g, g+8), D columns are tokens (2q, 2q+1).
        q = lane % 4
        for j, col_tile, group in acc_groups(cfg, warp):
            col = (col_tile0 + col_tile) * 16 + lane // 4
            tok = tok0 + group * 8 + 2 * q
            if tok < tokens:
                mP[split, tok, col] = acc[4 * j]
                mP[split, tok, col + 8] = acc[4 * j + 2]
            if tok + 1 < tokens:
                mP[split, tok + 1, col] = acc[4 * j + 1]
                mP[split, tok + 1, col + 8] = acc[4 * j + 3]

        if cutlass.const_expr(cfg.output is not None):
            # Release our partials, then count this CTA in for its 128-column block of its token block.
            ctas_per_block = 128 // (16 * cfg.warps)
            block = col_tile0 // 8  # the 128-column block: 8 tile columns
            slot = bm * (mP.shape[2] // 128) + block
            counter = mCounter.iterator.toint() + Int64(slot) * 4
            ptx.count_in(counter, mP.shape[0] * ctas_per_block, sLast, 0, tid)
            if sLast[0] != 0:
                if cutlass.const_expr(cfg.spread_sum):  # one token: every warp sums a slice of its block, parked
                    # in the weight stages, idle now (count_in's barrier follows every warp's last MMA)
                    reduce_rotate_store_spread(mP, mSvh, mBias, mY, sW.iterator.toint(), tok0, block, warp,
                                               cfg.warps, lane, cfg.has_bias, DTYPES[cfg.output])
                else:
                    for r in cutlass.range_constexpr(cfg.tokens_per_cta // cfg.warps):
                        row = tok0 + r * cfg.warps + warp
                        if row < tokens:
                            reduce_rotate_store(mP, mSvh, mBias, mY, row, block * 128 + 4 * lane, lane, exists=True,
                                                n=4, partial_f32=True, has_bias=cfg.has_bias,
                                                out_type=DTYPES[cfg.output])
                if tid == 0:
                    ptx.st_global_u32(counter, Int32(0))  # ready for the next launch (and graph replay)


@cute.jit
def rotate_tile_from_shared(cfg: cutlass.Constexpr, acc: cute.Tensor, tile_addr: Int32, mSvh: cute.Tensor,
                            mBias: cute.Tensor, mY: cute.Tensor, block: Int32, tok0: Int32, tokens: Int32,
                            warp: Int32, lane: Int32):
    """The warpgroup-MMA GEMM's fused epilogue (one K split): the accumulators (MMA layout: D rows are output
    columns (g, g+8), D columns are tokens (2q, 2q+1)) go to an fp32 tile ``[token][TILE_PITCH]`` over the drained
    X stages, then warp w rotates token rows w, w + warps, ...: ``y = H128(row) * svh (+ bias)``. No partials
    leave the SM and no other CTA is waited for."""
    q = lane % 4
    cute.arch.sync_threads()  # every warp's MMAs are done with the stages
    for j, col_tile, group in acc_groups(cfg, warp):
        col = col_tile * 16 + lane // 4
        for i in cutlass.range_constexpr(4):
            tok = group * 8 + 2 * q + i % 2
            ptx.st_shared_f32(tile_addr + (tok * TILE_PITCH + col + 8 * (i // 2)) * 4, acc[4 * j + i])
    cute.arch.sync_threads()
    col0 = block * 128 + 4 * lane
    svh = load_vector(mSvh, col0)
    bias = load_vector(mBias, col0) if cutlass.const_expr(cfg.has_bias) else None
    rows_per_warp = cfg.tokens_per_cta // cfg.warps
    for b in cutlass.range_constexpr(0, rows_per_warp, ROTATE_BATCH_ROWS):
        batch = range(b, min(b + ROTATE_BATCH_ROWS, rows_per_warp))
        rows = [ptx.ld_shared_v4(tile_addr + ((r * cfg.warps + warp) * TILE_PITCH + 4 * lane) * 4, Float32)
                for r in batch]
        for r, v in zip(batch, rows):
            row = tok0 + r * cfg.warps + warp
            y = rotated_output_values(list(v), svh, bias, lane)
            if row < tokens:
                store_row_values(mY, row, col0, y, DTYPES[cfg.output], cfg.output)
