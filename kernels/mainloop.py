"""The decode GEMM's main loop, shared by the dense GEMM and the fused MoE GEMMs.

One CTA: ``cfg.warps`` warps, warp w owns weight tile column ``col_tile0 + w`` (16 output columns) of a trellis
matrix ``W int32 [k_tiles, n_col_tiles, 8K]``; the CTA owns ``cfg.tokens_per_cta`` rows of the rotated input
``X int32 [rows, K/2]`` (fp16 pairs, columns in ``cfg.x_order``; ``[rows, K]`` in doubled order) from ``tok0`` on,
rows past ``tokens`` read as zero. Each stage brings ``k_tiles_per_stage`` rows of weight tiles and the matching
activation slab into shared memory with 16-byte ``cp.async``; ``stages`` are in flight. Every k-tile is decoded in
registers (``trellis.decode_lane``) straight into the A operand of ``mma.m16n8k16`` (swapped operands: weights are
A, 8 tokens are B), accumulating fp32; with ``cfg.split_halves`` each weight's two hashed fp16 halves go to two MMAs
instead (``trellis``).

With ``cfg.warp_cols`` > 1 (shared decode) the decoded tiles go through shared memory instead: each warp still
decodes its own tile column, stores the A fragments (16 bytes per lane), and after a barrier warp w multiplies
``warp_cols`` tile columns by its share of the CTA's tokens (``acc_groups``). Each weight is then decoded once
per ``tokens_per_cta`` tokens (up to 128) while a warp holds the accumulators of only 4*token_groups fp32.

With ``cfg.mma == "wgmma"`` (sm_90a) a stage's k-tiles are all decoded first, then multiplied by warpgroup MMAs
that run while the warps decode the next stage (``warpgroup_decode_mma``); X sits in 128-byte swizzled atoms (the
MMA's K-major B layout) and one more stage is held back for the MMAs still reading it. With X in "stages" order
(``trellis.x_stages_index``: already in that layout in global memory) one thread brings a stage's X with one bulk
copy per 64 columns that completes on the stage's "full" mbarrier (``BulkCopy``) instead of every thread's
cp.async pieces. With ``cfg.mbarriers`` the stages are handed over through mbarriers instead of a CTA barrier per
stage (``mbarrier_wgmma_loop``).

With ``cfg.input`` (M = 1) X is not staged: the caller's ``prologue(sX)`` writes the CTA's whole K range of the
one token into shared memory (the dense GEMM rotates x there) while the first weight stages load; or, with
``cfg.resident_rows`` > 1, of each of that many rows (the MoE GEMM's route blocks at a few tokens).

The dense GEMM passes its whole matrix; the MoE GEMM passes the base address of one expert's plane and the
packed rows of one expert's token block. ``cfg`` is a ``gemm.GemmConfig`` (its stage sizes are the only smem
facts). D rows are output columns (g, g+8), D columns are tokens (2q, 2q+1): ``acc[4*mt + i]`` as in ``store``.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator

from . import ptx
from .trellis import (
    STAGE_K,
    TrellisPlan,
    codebook_constants,
    decode_lane,
    decode_lane_halves,
    doubled_b,
    lane_word_indices,
    mma_a_fragment,
    split_halves_fragments,
    wgmma_swizzled_piece,
)

# Chunks per main-loop iteration: unrolling twice halves the per-chunk barrier/address/branch overhead
# (sm_120a K=4 mcg: 62 -> 29 instructions per 8 tiles; 4x gains nothing more). A warpgroup-MMA loop needs the two:
# its MMAs read their A fragments from registers while they run, and a stage waits only for the MMAs of the stage
# before the last, so consecutive stages must decode into different registers, which ptxas gives the two unrolled
# copies but not one rolled stage (it reuses them: sm_90a M=64 7.77 -> 7.06 SASS a weight, and y changed from run
# to run on the H200; tests/test_sass.py checks the registers alternate). A rolled loop (GemmConfig.rolled) must wait
# for all of its MMAs before each stage's decode.
CHUNK_UNROLL = 2
# A group loop (``decode_mma_loop``'s ``group_loops``) leaves out the X copies of the token groups it does not
# multiply (``x_copies_past``; sm_90a 32-row 2-group loops 8 -> 6 LDGSTS an iteration). H200, E=128 top-8 2048x768
# K=4 mcg, layer graph, three rounds, y bit-identical, us (off -> on): M=160 206.73 -> 203.02, M=256 227.67 -> 226.00
# (docs/perf.md, forty-seventh session). An A/B switch.
GROUP_LOOP_X_ROWS = True
WGMMA_MAX_GROUPS = 32  # token groups of 8 in one warpgroup MMA (N <= 256)


def chunk_unroll(cfg) -> int:
    """Chunks an iteration of the main loop: an mma.sync loop of 3 or 4 stages is unrolled over its stages, so that
    each chunk's stage (addresses) is static (sm_90a K=4 mcg M=1, 3 stages: 4.91 -> 4.35 SASS a weight)."""
    if cfg.rolled:
        return 1
    return cfg.stages if cfg.mma == "sync" and cfg.stages in (3, 4) else CHUNK_UNROLL


class DecodeGemmKernel:
    """Base of the kernels built on this main loop (dense and MoE GEMM): their config (``bits``, ``warps``, ...),
    its trellis plan and the CTA's thread count."""

    def __init__(self, config):
        self.cfg = config
        # paired hashes only in the split-halves loop (M <= 8), where the ALU pipe binds (``ptx.PAIRED_HASH_ARCHS``)
        self.plan = TrellisPlan(config.bits, paired=ptx.paired_hashes() and config.split_halves)
        self.threads = 32 * config.warps


def stage_copies(cfg, plan, threads, addrs, k_begin, col_tile0, tok0, tokens, x_row_words_g, n_col_tiles, tid,
                 x_rows=None, full=None):
    """This thread's cp.async copies of a stage, worked out once before the main loop: ``(shared byte address in
    stage 0, shared bytes per stage, global byte address of chunk 0, global bytes per chunk, source bytes)``
    each (for X in the wgmma layout, one ``RowCopies``). A stage is ``k_tiles_per_stage`` rows of the CTA's
    weight tiles (each row one contiguous run of ``warps`` tiles) and the matching activation columns of the CTA's
    tokens; chunk c's copy reads ``c`` strides on, so the loop adds one product per copy instead of redoing the
    index arithmetic (``issue_stage``).

    A plain helper traced inline (not ``@cute.jit``): its loops and branches are compile-time Python."""
    sW_addr, sX_addr, gW_addr, gX_addr = addrs
    words = plan.words_per_tile
    copies = []
    row_chunks = cfg.w_row_words // 4
    total = cfg.k_tiles_per_stage * row_chunks
    w_stride = Int64(n_col_tiles) * (4 * cfg.k_tiles_per_stage * words)
    for it in range(weight_copy_count(cfg, threads)):
        i = it * threads + tid
        if total % threads != 0:
            i = cutlass.min(i, total - 1)  # surplus threads repeat the last copy: same bytes, same place
        kk = i // row_chunks
        part = i % row_chunks
        g_word = (Int64(k_begin + kk) * n_col_tiles + col_tile0) * words + part * 4
        s_word = kk * cfg.w_row_words + part * 4
        copies.append((sW_addr + s_word * 4, 4 * cfg.w_stage_words, gW_addr + g_word * 4, w_stride, Int32(16)))

    if cutlass.const_expr(cfg.input is not None):
        return copies  # X is resident (the prologue rotated it into shared memory)
    if cutlass.const_expr(cfg.x_order == "stages"):
        pieces = cfg.k_tiles_per_stage * 16 // STAGE_K
        chunk_bytes = Int64(x_rows) * (2 * STAGE_K)  # one 64-column chunk of every row
        copies.append(BulkCopy(sX_addr, 4 * cfg.x_stage_words, pieces, 2 * STAGE_K * cfg.tokens_per_cta,
                               gX_addr + (Int64(k_begin * 16 // STAGE_K) * x_rows + tok0) * (2 * STAGE_K),
                               chunk_bytes, full, tid))
        return copies
    row_chunks = cfg.x_k_tile_words * cfg.k_tiles_per_stage // 4
    total = cfg.tokens_per_cta * row_chunks
    if cutlass.const_expr(cfg.mma == "wgmma" and total % threads == 0 and (threads // row_chunks) % 8 == 0):
        copies.append(row_copies(cfg, threads, sX_addr, gX_addr, k_begin, tok0, tokens, x_row_words_g, row_chunks,
                                 tid))
        return copies
    for it in range((total + threads - 1) // threads):
        i = it * threads + tid
        if total % threads != 0:
            i = cutlass.min(i, total - 1)
        row = i // row_chunks
        part = i % row_chunks
        tok = tok0 + row
        valid = tok < tokens
        g_word = Int64(cutlass.select_(valid, tok, 0)) * x_row_words_g + k_begin * cfg.x_k_tile_words + part * 4
        s_word = swizzled_x_word(cfg, row, part) if cfg.mma == "wgmma" else row * cfg.x_row_words + part * 4
        # Tokens past the end are zero-filled (src-size 0) so their MMA lanes add nothing.
        copies.append((sX_addr + s_word * 4, 4 * cfg.x_stage_words, gX_addr + g_word * 4,
                       Int64(4 * cfg.k_tiles_per_stage * cfg.x_k_tile_words),
                       cutlass.select_(valid, Int32(16), Int32(0))))
    return copies


def x_copies_past(cfg, threads, groups: int) -> int:
    """How many of ``stage_copies``' mma.sync X copies (the last ones) hold only rows past the CTA's first
    ``groups`` token groups: a main loop that multiplies those groups alone leaves them out (none with
    GROUP_LOOP_X_ROWS off). A copy with rows on both sides still copies all of them: its size as a predicate made
    per loop cost the 16-row blocks' loops 1% more SASS on sm_90a."""
    if not GROUP_LOOP_X_ROWS:
        return 0
    row_chunks = cfg.x_k_tile_words * cfg.k_tiles_per_stage // 4
    total = cfg.tokens_per_cta * row_chunks
    return sum(it * threads // row_chunks >= 8 * groups for it in range(-(-total // threads)))


def x_needs_proxy_fence(cfg) -> bool:
    """Must a warpgroup-MMA stage fence the async proxy before its MMAs read X? Only where cp.async (the generic
    proxy) wrote X: a bulk copy ("stages" order) writes through the async proxy itself, and the weights are read by
    ordinary shared loads. The fence is a MEMBAR.ALL.CTA a stage. H200, graph, y bit-identical, two processes each,
    us (fence -> none): MoE E=128 top-8 2048x768 K=4 mcg M=4096 1056.51 -> 1054.47, M=8192 2079.45 -> 2070.65; dense
    K=4 mcg M=256 4096x14336 59.51 -> 57.91, 14336x4096 61.00 -> 60.65 (docs/perf.md, twenty-eighth session)."""
    return cfg.x_order != "stages"


def weight_copy_count(cfg, threads) -> int:
    """How many of ``stage_copies``' entries (the first ones) copy weights: a stage's 16-byte weight pieces over
    the CTA's threads."""
    return -(-cfg.k_tiles_per_stage * (cfg.w_row_words // 4) // threads)


def swizzled_x_word(cfg, row, part):
    """Shared word (from the stage's start) of 16-byte piece ``part`` of token row ``row`` in the wgmma layout:
    128-byte swizzle atoms of 64 k each, one after the other, piece p of a row at p ^ (row % 8)."""
    atom, piece = part // 8, part % 8
    return (atom * cfg.tokens_per_cta + row) * 32 + wgmma_swizzled_piece(row, piece) * 4


class BulkCopy(NamedTuple):
    """A stage's X in "stages" order: ``pieces`` 64-column chunks of the CTA's rows, each ``size`` contiguous bytes
    in global memory (``chunk_bytes`` apart) and in the stage (one after the other), copied by thread 0 with one
    bulk copy each, completing on the stage's ``full`` mbarrier."""
    s_addr: object  # Int32: stage 0
    s_stride: int  # shared bytes per stage
    pieces: int
    size: int
    g_addr: object  # Int64: chunk 0 of the split, the CTA's first row
    chunk_bytes: object  # Int64: global bytes between 64-column chunks
    full: object  # the stages' full mbarriers (a shared pointer)
    tid: object


class RowCopies(NamedTuple):
    """A thread's X copies of a stage into the swizzled wgmma layout: one 16-byte piece of token rows ``row0 +
    i * row_step`` (i < count); eight threads in a row copy its 128 bytes (whole lines per instruction). The
    piece's swizzled place is the same in every such row (row_step is a multiple of the 8-row swizzle period), so
    row i sits ``i * row_step`` rows of 128 bytes on in shared memory and ``i * g_row_step`` bytes in global
    memory."""
    s_addr: object  # Int32: stage 0, row0
    s_stride: int  # shared bytes per stage
    g_addr: object  # Int64: chunk 0, row0
    g_stride: int  # global bytes per chunk
    g_row_step: object  # Int32
    rows_left: object  # Int32: tokens - row0
    row_step: int
    count: int


def row_copies(cfg, threads, sX_addr, gX_addr, k_begin, tok0, tokens, x_row_words_g, row_chunks, tid):
    """This thread's ``RowCopies`` (the same copies as one tuple per (row, piece), as ``stage_copies`` makes them
    elsewhere): a pointer, a size and a predicate per copy held across the loop do not fit beside the wgmma
    accumulators, and ptxas rebuilt them from the thread index every stage (sm_90a, 256 tokens: 10.4 -> 8.9 SASS
    per weight in the main loop; H200 whole linear 4096x14336 M=256 85.3 -> 80.2 us, M=128 53.6 -> 52.3). Traced
    inline."""
    row_step = threads // row_chunks
    row0 = tid // row_chunks
    part = tid % row_chunks
    s_word = swizzled_x_word(cfg, row0, part)
    g_word = Int64(tok0 + row0) * x_row_words_g + k_begin * cfg.x_k_tile_words + part * 4
    return RowCopies(sX_addr + s_word * 4, 4 * cfg.x_stage_words, gX_addr + g_word * 4,
                     4 * cfg.k_tiles_per_stage * cfg.x_k_tile_words, row_step * 4 * x_row_words_g,
                     tokens - tok0 - row0, row_step, cfg.tokens_per_cta // row_step)


def issue_stage(copies, chunk, stage):
    """The copies of chunk ``chunk`` into stage buffer ``stage`` (``stage_copies``). Traced inline."""
    for c in copies:
        if isinstance(c, BulkCopy):
            first = Int64(chunk * c.pieces)
            ptx.bulk_stage_copy(c.tid, (c.full + stage).toint(),
                                [(c.s_addr + stage * c.s_stride + i * c.size, c.g_addr + (first + i) * c.chunk_bytes)
                                 for i in range(c.pieces)], c.size)
        elif isinstance(c, RowCopies):
            s_addr = c.s_addr + stage * c.s_stride
            g_addr = c.g_addr + Int64(chunk) * c.g_stride
            for i in range(c.count):
                row = i * c.row_step  # 128 bytes a row in every swizzle atom
                ptx.cp_async_row(s_addr, 128 * row, g_addr, c.g_row_step, i, row, c.rows_left)
        else:
            s_addr, s_stride, g_addr, g_stride, size = c
            ptx.cp_async(s_addr + stage * s_stride, g_addr + Int64(chunk) * g_stride, size)


@cute.jit
def decode_mma_loop(
    cfg: cutlass.Constexpr,
    plan: cutlass.Constexpr,
    acc: cute.Tensor,
    sW: cute.Tensor,
    sX: cute.Tensor,
    sDec: cute.Tensor,
    gW_addr: Int64,
    gX_addr: Int64,
    x_row_words_g: Int32,
    n_col_tiles: Int32,
    col_tile0: Int32,
    tok0: Int32,
    tokens: Int32,
    k_begin: Int32,
    n_chunks: Int32,
    prologue: cutlass.Constexpr = None,
    x_rows: Int32 = 0,
    mma_groups: cutlass.Constexpr = None,
    wait: cutlass.Constexpr = None,
    group_loops: cutlass.Constexpr = None,
    prologue_loads: cutlass.Constexpr = None,
):
    """``acc (4*token_groups fp32 registers) += X[tok0:+T, k-range] @ W_hat[k-range, CTA's columns]`` over
    ``n_chunks`` stages of k-tiles from ``k_begin``. ``acc`` must be zeroed by the caller; ``acc_groups`` says
    which tile column and token group each of its 4-register groups holds. ``sW, sX, sDec`` from ``allocate_smem``.
    In "stages" order ``x_rows`` is X's row count (a whole number of route blocks: no bound on ``tokens``).
    ``mma_groups`` (warpgroup MMAs, and mma.sync with private decode): only the first ``mma_groups`` token groups
    are multiplied (whole MMAs), the accumulators of the rest stay as they were. ``wait`` (mma.sync with X staged):
    the PDL wait, which the loop calls after it has issued the weight copies of the stages it loads ahead and before
    their X copies (the caller vouches that the weights and ``gW_addr`` need no output of the kernel before).
    ``group_loops`` (mma.sync with private decode): ``(count, counts)``; ``count()``, called after that wait, gives
    the token groups that hold routes (1 .. token_groups, at run time), and the main loop is compiled once for each
    of the ascending group ``counts`` (the last: token_groups) and run for the first that covers it.
    ``prologue_loads`` (with ``prologue``): called before any weight copy is issued, its result passed on as
    ``prologue(sX, loaded)``: the prologue's loads then go out ahead of the weight stages."""
    threads = 32 * cfg.warps
    loaded = prologue_loads() if cutlass.const_expr(prologue_loads is not None) else None
    tid, _, _ = cute.arch.thread_idx()
    warp = tid // 32
    lane = tid % 32
    sX_addr = sX.iterator.toint()
    addrs = (sW.iterator.toint(), sX_addr, gW_addr, gX_addr)

    bulk = cfg.x_order == "stages"
    copies = stage_copies(cfg, plan, threads, addrs, k_begin, col_tile0, tok0, tokens, x_row_words_g, n_col_tiles,
                          tid, x_rows, sDec if bulk else None)
    wgmma = cfg.mma == "wgmma"
    if cutlass.const_expr(wgmma and cfg.mbarriers):
        mbarrier_wgmma_loop(cfg, plan, acc, sW, sX_addr, sDec, copies, n_chunks, warp, lane, tid, mma_groups)
        return
    if cutlass.const_expr(bulk):  # the stages' full mbarriers: thread 0's arrival and its bulk copies' bytes
        if tid == 0:
            for i in cutlass.range_constexpr(cfg.stages):
                cute.arch.mbarrier_init(sDec + i, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
    # Stages loaded ahead: all but the one being decoded, and with wgmma also the one its MMAs still read.
    ahead_stages = cfg.stages - 2 if wgmma else cfg.stages - 1
    if cutlass.const_expr(wait is not None):
        # the weights of the stages ahead first (the first commit group holds them all), then the wait, then X
        w_count = weight_copy_count(cfg, threads)
        for st in cutlass.range_constexpr(ahead_stages):
            if st < n_chunks:
                issue_stage(copies[:w_count], st, st)
        wait()
        copies_ahead = copies[w_count:]
    else:
        copies_ahead = copies
    for st in cutlass.range_constexpr(ahead_stages):
        if st < n_chunks:
            issue_stage(copies_ahead, st, st)
        cute.arch.cp_async_commit_group()
    if cutlass.const_expr(prologue_loads is not None):
        prologue(sX, loaded)  # as below, its loads already on their way
    elif cutlass.const_expr(prologue is not None):
        prologue(sX)  # while the first stages load; the main loop's first barrier publishes what it wrote

    word_idx, shift = lane_word_indices(plan, lane)
    consts = codebook_constants(cfg.codebook, ptx)
    # chunk_loop's arguments before and after its copies (a group loop passes fewer copies)
    before = (cfg, plan, acc, sW, sX, sDec)
    after = (n_chunks, ahead_stages, word_idx, shift, consts, warp, lane)
    if cutlass.const_expr(group_loops is None):
        chunk_loop(*before, copies, *after, mma_groups)
    else:
        count_live, counts = group_loops
        live = count_live()  # after the wait: what the kernel before wrote is visible
        for i in cutlass.range_constexpr(len(counts)):
            if live <= counts[i] and live > (counts[i - 1] if i > 0 else 0):
                # the loop's stages copy X only of the groups it multiplies (the stages ahead, issued before the
                # count is known, copy every row)
                group_copies = copies[: len(copies) - x_copies_past(cfg, threads, counts[i])]
                chunk_loop(*before, group_copies, *after, counts[i])


@cute.jit
def chunk_loop(cfg: cutlass.Constexpr, plan: cutlass.Constexpr, acc: cute.Tensor, sW: cute.Tensor, sX: cute.Tensor,
               sDec, copies, n_chunks: Int32, ahead_stages: cutlass.Constexpr, word_idx, shift, consts, warp: Int32,
               lane: Int32, mma_groups: cutlass.Constexpr = None):
    """``decode_mma_loop``'s main loop over the chunks, once its first stages are issued: each chunk waits for its
    stage, issues the copies of the stage ``ahead_stages`` on and decodes and multiplies its k-tiles."""
    wgmma = cfg.mma == "wgmma"
    bulk = cfg.x_order == "stages"
    sX_addr = sX.iterator.toint()
    w_lane = warp * plan.words_per_tile
    for chunk in cutlass.range(n_chunks, unroll=chunk_unroll(cfg)):
        if cutlass.const_expr(wgmma):
            # the MMAs of chunk - 2 are done: its stage may be refilled after the barrier (rolled: of chunk - 1 too,
            # whose A registers this chunk's decode writes)
            ptx.wgmma_wait(0 if cfg.rolled else 1)
        cute.arch.cp_async_wait_group(ahead_stages - 1)
        if cutlass.const_expr(bulk):
            cute.arch.mbarrier_wait(sDec + chunk % cfg.stages, (chunk // cfg.stages) % 2)  # the stage's X landed
        if cutlass.const_expr(wgmma and x_needs_proxy_fence(cfg)):
            ptx.fence_proxy_async_shared()  # this thread's cp.async data, visible to the tensor cores' reads
        cute.arch.sync_threads()
        ahead = chunk + ahead_stages
        if ahead < n_chunks:
            issue_stage(copies, ahead, ahead % cfg.stages)
        cute.arch.cp_async_commit_group()

        stage = chunk % cfg.stages
        w_stage = stage * cfg.w_stage_words + w_lane
        x_stage = stage * cfg.x_stage_words
        if cutlass.const_expr(cfg.input is not None):
            x_stage = chunk * (cfg.x_k_tile_words * cfg.k_tiles_per_stage)  # the resident row's words of this chunk
        if cutlass.const_expr(wgmma):
            warpgroup_decode_mma(cfg, plan, acc, sW, sX_addr + 4 * x_stage, w_stage, word_idx, shift, consts,
                                 mma_groups)
        elif cutlass.const_expr(cfg.warp_cols > 1):
            shared_decode_mma(cfg, plan, acc, sW, sX, sDec.iterator.toint(), w_stage, x_stage, word_idx, shift,
                              consts, warp, lane)
        else:
            private_decode_mma(cfg, plan, acc, sW, sX, w_stage, x_stage, word_idx, shift, consts, lane, mma_groups)
    if cutlass.const_expr(wgmma):
        ptx.wgmma_wait(0)  # acc is final


@cute.jit
def mbarrier_wgmma_loop(cfg: cutlass.Constexpr, plan: cutlass.Constexpr, acc: cute.Tensor, sW: cute.Tensor,
                        sX_addr: Int32, bars, copies, n_chunks: Int32, warp: Int32, lane: Int32, tid: Int32,
                        mma_groups: cutlass.Constexpr = None):
    """The warpgroup-MMA main loop with mbarrier hand-offs (``GemmConfig.mbarriers``). Stage s has a ``full``
    barrier (every thread's copies of its chunk arrive on it as they land: ``cp.async.mbarrier.arrive.noinc``) and
    an ``empty`` one (each warp arrives once its MMAs of the stage's chunk are done). Chunk c waits for its full
    barrier (then the async-proxy fence, as after the CTA barrier), is decoded and multiplied; then the warp
    releases chunk c-1 and refills the stage of chunk c-2 (released a chunk earlier by every warp) with chunk
    c + stages - 2: as many chunks in flight as the CTA-barrier loop, but no warp waits for another's decode."""
    stages = cfg.stages
    full, empty = bars, bars + stages
    if tid == 0:
        for i in cutlass.range_constexpr(stages):
            # every thread's cp.async arrival, and with X in "stages" order thread 0's bulk-copy arrival
            cute.arch.mbarrier_init(full + i, 32 * cfg.warps + (1 if cfg.x_order == "stages" else 0))
            cute.arch.mbarrier_init(empty + i, cfg.warps)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    for st in cutlass.range_constexpr(stages - 2):
        if st < n_chunks:
            issue_stage(copies, st, st)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_mbarrier_arrive_noinc(full + st)
    word_idx, shift = lane_word_indices(plan, lane)
    consts = codebook_constants(cfg.codebook, ptx)
    w_lane = warp * plan.words_per_tile
    for chunk in cutlass.range(n_chunks, unroll=chunk_unroll(cfg)):
        stage = chunk % stages
        cute.arch.mbarrier_wait(full + stage, (chunk // stages) % 2)
        if cutlass.const_expr(x_needs_proxy_fence(cfg)):
            ptx.fence_proxy_async_shared()  # the copies' data, visible to the tensor cores' reads
        warpgroup_decode_mma(cfg, plan, acc, sW, sX_addr + 4 * stage * cfg.x_stage_words,
                             stage * cfg.w_stage_words + w_lane, word_idx, shift, consts, mma_groups)
        ptx.wgmma_wait(0 if cfg.rolled else 1)  # this warpgroup's MMAs of chunk - 1 (rolled: and chunk) are done
        if chunk > 0:
            if lane == 0:
                cute.arch.mbarrier_arrive(empty + (chunk - 1) % stages)
        refill = chunk + stages - 2  # into the stage of chunk - 2
        if refill < n_chunks:
            s2 = refill % stages
            if chunk >= 2:
                cute.arch.mbarrier_wait(empty + s2, ((chunk - 2) // stages) % 2)
            issue_stage(copies, refill, s2)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_mbarrier_arrive_noinc(full + s2)
    ptx.wgmma_wait(0)  # acc is final


def warpgroup_decode_mma(cfg, plan, acc, sW, sX_stage_addr, w_stage, word_idx, shift, consts, mma_groups=None):
    """One stage with warpgroup MMAs: every k-tile of this warp's tile column decoded into A registers first (the
    previous stage's MMAs still run meanwhile), then one fence and one asynchronous ``m64 x tokens x k16`` MMA per
    k-tile, committed as one group. The caller waits for the group before the stage's buffer is refilled and
    before reading ``acc``. Traced inline."""
    frags = []
    for kk in range(cfg.k_tiles_per_stage):
        words = lane_words(cfg, sW, w_stage, kk, word_idx)
        frags.append(mma_a_fragment(decode_lane(plan, cfg.codebook, words, shift, ptx, consts)))
    ptx.wgmma_fence()
    high = Int64(ptx.wgmma_descriptor_high())
    desc0 = high | Int64((sX_stage_addr & 0x3FFFF) >> 4)
    for kk in range(cfg.k_tiles_per_stage):
        for g0, groups in wgmma_token_chunks(cfg.token_groups if mma_groups is None else mma_groups):
            # k-tile kk: atom kk // 4 (64 k of every token row), 32 bytes further per k-tile inside it; the
            # chunk's first token row 8*g0 is 128 bytes a row further. The 14-bit start address field cannot
            # carry: the stage lies inside the 228 KB of shared memory.
            desc = desc0 + (((kk // 4) * (cfg.tokens_per_cta * 128) + 8 * g0 * 128 + (kk % 4) * 32) >> 4)
            regs = range(4 * g0, 4 * (g0 + groups))
            d = ptx.wgmma_m64k16(frags[kk], desc, [acc[i] for i in regs], "float16")
            for i, v in zip(regs, d):
                acc[i] = v
    ptx.wgmma_commit()


def wgmma_token_chunks(token_groups: int):
    """(first token group, token groups) of each warpgroup MMA a k-tile takes: at most 32 groups (N = 256 tokens)
    an instruction, so a 320-token CTA issues N = 256 and N = 64."""
    return [(g0, min(WGMMA_MAX_GROUPS, token_groups - g0)) for g0 in range(0, token_groups, WGMMA_MAX_GROUPS)]


def lane_words(cfg, sW, w_stage, kk, word_idx):
    """This lane's trellis words of k-tile ``kk`` of its tile column in the stage (``w_stage``: the stage's first
    word of this warp's tile; ``word_idx`` from ``trellis.lane_word_indices``). Traced inline."""
    return [sW[w_stage + kk * cfg.w_row_words + i] for i in word_idx]


def private_decode_mma(cfg, plan, acc, sW, sX, w_stage, x_stage, word_idx, shift, consts, lane, mma_groups=None):
    """One stage: each k-tile of this warp's tile column decoded into A registers and multiplied by the CTA's
    token groups (the first ``mma_groups`` of them, if given). Traced inline."""
    sX_addr = sX.iterator.toint()
    g = lane // 4
    q = lane % 4
    b_words = {}
    for kk in range(cfg.k_tiles_per_stage):
        words = lane_words(cfg, sW, w_stage, kk, word_idx)
        if cutlass.const_expr(cfg.split_halves):
            halves = decode_lane_halves(plan, cfg.codebook, words, shift, ptx, consts)
        else:
            a = mma_a_fragment(decode_lane(plan, cfg.codebook, words, shift, ptx, consts))
        for mt in range(cfg.token_groups if mma_groups is None else mma_groups):
            if cutlass.const_expr(cfg.input is None):
                row = (mt * 8 + g) * cfg.x_row_words
            elif cutlass.const_expr(cfg.resident_rows == 1):
                row = 0  # the one token
            else:  # resident rows: lane quad g's, the last past them
                row = cutlass.min(g, cfg.resident_rows - 1) * cfg.resident_row_words
            b = load_b(cfg, sX, sX_addr, x_stage + row, kk, q, b_words, mt)
            if cutlass.const_expr(cfg.split_halves):
                operands = split_halves_fragments(halves, b if cfg.x_order == "doubled" else doubled_b(b, ptx), ptx)
            else:
                operands = ((a, b),)
            for a_m, b_m in operands:
                c = (acc[4 * mt], acc[4 * mt + 1], acc[4 * mt + 2], acc[4 * mt + 3])
                d = ptx.mma_m16n8k16_f32(a_m, b_m, c, "float16")
                for i in range(4):
                    acc[4 * mt + i] = d[i]

def load_b(cfg, sX, sX_addr, row_word, kk, q, loaded, key):
    """Lane's B words of k-tile ``kk`` from its token row in the stage (``row_word``): row order, two 32-bit loads;
    fragment order, one 16-byte load per k-tile pair, kept in ``loaded[key]`` for the pair's second k-tile;
    doubled order, the four doubled words (``trellis.doubled_b``) in one 16-byte load. Traced inline."""
    if cutlass.const_expr(cfg.x_order == "rows"):
        x_word = row_word + kk * 8 + q
        return (sX[x_word], sX[x_word + 4])
    if cutlass.const_expr(cfg.x_order == "doubled"):
        return ptx.ld_shared_v4(sX_addr + (row_word + kk * 16 + 4 * q) * 4)
    if kk % 2 == 0:
        loaded[key] = ptx.ld_shared_v4(sX_addr + (row_word + (kk // 2) * 16 + 4 * q) * 4)
    return loaded[key][2 * (kk % 2) : 2 * (kk % 2) + 2]


def shared_decode_mma(cfg, plan, acc, sW, sX, sDec_addr, w_stage, x_stage, word_idx, shift, consts, warp, lane):
    """One stage with shared decode: decode this warp's tiles into ``sDec`` (A fragments, lane-major: one
    conflict-free 16-byte store and load per lane and tile), barrier, then this warp's ``acc_groups`` MMAs.
    The barrier at the top of the next stage keeps ``sDec`` from being overwritten while it is read. Traced
    inline."""
    for kk in range(cfg.k_tiles_per_stage):
        words = lane_words(cfg, sW, w_stage, kk, word_idx)
        a = mma_a_fragment(decode_lane(plan, cfg.codebook, words, shift, ptx, consts))
        ptx.st_shared_v4(sDec_addr + ((kk * cfg.warps + warp) * 32 + lane) * 16, a)
    cute.arch.sync_threads()
    sX_addr = sX.iterator.toint()
    col_group, token_split = divmod_warp(cfg, warp)
    groups = cfg.token_groups // cfg.warp_cols
    g = lane // 4
    q = lane % 4
    b_words = {}
    for kk in range(cfg.k_tiles_per_stage):
        a_frags = [ptx.ld_shared_v4(sDec_addr + ((kk * cfg.warps + col_group * cfg.warp_cols + c) * 32 + lane) * 16)
                   for c in range(cfg.warp_cols)]
        for n in range(groups):
            row = x_stage + ((token_split * groups + n) * 8 + g) * cfg.x_row_words
            b = load_b(cfg, sX, sX_addr, row, kk, q, b_words, n)
            for c in range(cfg.warp_cols):
                j = c * groups + n
                d = ptx.mma_m16n8k16_f32(a_frags[c], b, [acc[4 * j + i] for i in range(4)], "float16")
                for i in range(4):
                    acc[4 * j + i] = d[i]


def divmod_warp(cfg, warp):
    """(column group, token split) of a warp in the shared-decode MMA phase: column group c multiplies tile
    columns ``c*warp_cols ..``, token split t the token groups ``t*token_groups/warp_cols ..``."""
    col_groups = cfg.warps // cfg.warp_cols
    return warp % col_groups, warp // col_groups


def acc_groups(cfg, warp):
    """``(j, tile column, token group)`` of each accumulator group ``acc[4j .. 4j+3]`` of a warp (tile column
    relative to the CTA's first, token group of 8 relative to its first token). Traced inline."""
    if cutlass.const_expr(cfg.warp_cols == 1):
        return [(mt, warp, mt) for mt in range(cfg.token_groups)]
    col_group, token_split = divmod_warp(cfg, warp)
    groups = cfg.token_groups // cfg.warp_cols
    return [(c * groups + n, col_group * cfg.warp_cols + c, token_split * groups + n)
            for c in range(cfg.warp_cols) for n in range(groups)]


def allocate_smem(cfg):
    """The main loop's shared memory: (sW, sX, sDec) stage buffers (sDec only with shared decode, else sW again,
    never touched). Traced inline."""
    smem = SmemAllocator()
    if cutlass.const_expr(cfg.mma == "wgmma"):  # the swizzled stages first, on a 1024-byte boundary
        sX = smem.allocate_tensor(Int32, cute.make_layout(cfg.x_smem_words), 1024)
        sW = smem.allocate_tensor(Int32, cute.make_layout(cfg.stages * cfg.w_stage_words), 16)
        if cutlass.const_expr(cfg.mbarriers or cfg.x_order == "stages"):  # in sDec's place: the stages' full and
            return smem, sW, sX, smem.allocate_array(Int64, 2 * cfg.stages, byte_alignment=8)  # empty mbarriers
        return smem, sW, sX, sW
    sW = smem.allocate_tensor(Int32, cute.make_layout(cfg.stages * cfg.w_stage_words), 16)
    sX = smem.allocate_tensor(Int32, cute.make_layout(cfg.x_smem_words), 16)
    sDec = sW
    if cutlass.const_expr(cfg.warp_cols > 1):
        sDec = smem.allocate_tensor(Int32, cute.make_layout(cfg.decoded_words), 16)
    return smem, sW, sX, sDec
