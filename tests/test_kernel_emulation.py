"""The device decode sequence (kernels.trellis with NumPy ops) against the torch reference, bit for bit, on the
CPU: every bitrate, every codebook, every lane. Also the swapped-operand MMA fragment mapping of the GEMM."""

import numpy as np
import pytest
import torch

from exl3tool.kernels import emulate
from exl3tool.kernels.gemm import GemmConfig
from exl3tool.kernels.mainloop import acc_groups, swizzled_x_word
from exl3tool.kernels.trellis import (
    CODEBOOKS,
    STAGE_K,
    SUPPORTED_BITS,
    TrellisPlan,
    decode_lane,
    decode_lane_halves,
    doubled_b,
    codebook_constants,
    lane_word_indices,
    mma_a_fragment,
    split_halves_fragments,
    tile_position,
    x_doubled_word,
    x_fragment_slot,
    x_stages_index,
)
from exl3tool.reference import decode_trellis

CASES = [(bits, cb) for bits in SUPPORTED_BITS for cb in CODEBOOKS]
LANES = np.arange(32)


def random_tiles(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, (n, 1, int(16 * bits)), dtype=torch.int32, generator=g).to(torch.int16)


def emulated_tile(plan, codebook, tile_words16):
    """Run the lane decode for all 32 lanes of one tile; return the fp16 16x16 tile and the lanes' pairs."""
    ring = tile_words16.numpy().view(np.uint32)
    idx, shift = lane_word_indices(plan, LANES)
    pairs = decode_lane(plan, codebook, [ring[i] for i in idx], shift, emulate, codebook_constants(codebook, emulate))
    tile = np.zeros((16, 16), dtype=np.uint16)
    for j in range(8):
        half = (pairs[j // 2] >> np.uint32(16 * (j % 2))) & np.uint32(0xFFFF)
        for lane in range(32):
            tile[tile_position(lane, j)] = half[lane]
    return tile.view(np.float16), pairs


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "cuts"])
@pytest.mark.parametrize("bits,codebook", CASES)
def test_lane_decode_matches_reference(bits, codebook, paired):
    """Both decodes: paired hashes (``TrellisPlan.links``, K=4 and K=8) and a cut a window (every K)."""
    plan = TrellisPlan(bits, paired=paired)
    tiles = random_tiles(bits, 6, seed=int(bits * 10) + len(codebook))
    ref = decode_trellis(tiles.reshape(6, 1, -1), codebook, bits).numpy()  # 6 tiles stacked along the input
    for t in range(6):
        got, _ = emulated_tile(plan, codebook, tiles[t, 0])
        assert np.array_equal(got.view(np.uint16), ref[16 * t : 16 * t + 16].view(np.uint16)), (bits, codebook, t)


def test_paired_hashes_where_they_move_alu_work_without_adding_instructions():
    """K=4 and K=8 hash paired windows (every window in a pair); the other bitrates have no pairs 16 bits apart."""
    for bits in SUPPORTED_BITS:
        plan = TrellisPlan(bits)
        links = plan.links
        if bits in (4.0, 8.0):
            assert sorted(w for i, j, _ in links.pairs for w in (i, j)) == list(range(8))
            assert links.instructions <= plan.cuts.instructions + 8
            assert links.alu_instructions <= plan.cuts.instructions - plan.cuts.fma_instructions - 4
        else:
            assert links is None, bits
        assert TrellisPlan(bits, paired=False).links is None


def test_lane_words_cover_every_window():
    """Each lane's windows fit in the words it loads (the plan's claim), for every bitrate and lane."""
    for bits in SUPPORTED_BITS:
        plan = TrellisPlan(bits)
        idx, shift = lane_word_indices(plan, LANES)
        assert len(idx) == plan.raw_words <= 3
        assert np.all(shift + plan.deltas[-1] + 16 <= 32 * plan.raw_words)
        assert all(np.all((i >= 0) & (i < plan.words_per_tile)) for i in idx)


def test_unknown_bitrate_and_codebook_are_refused():
    with pytest.raises(ValueError):
        TrellisPlan(4.5)
    with pytest.raises(ValueError):
        decode_lane(TrellisPlan(2.0), "qtip", [np.uint32(0)] * 2, 0, emulate, ())


@pytest.mark.parametrize("bits,codebook", [(4.0, "mcg"), (3.5, "mul1"), (7.0, "3inst")])
def test_swapped_mma_fragments_compute_x_times_w_hat(bits, codebook):
    """A = decoded tile (mma_a_fragment), B = 8 token rows of x as the GEMM loads them: D[col, token] = (x @ W)."""
    plan = TrellisPlan(bits)
    tile, pairs = emulated_tile(plan, codebook, random_tiles(bits, 1, seed=3)[0, 0])
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 16)).astype(np.float16)
    words = x.view(np.uint32)  # row-major: word (token, k/2) holds x[token, k], x[token, k+1]
    g, q = LANES // 4, LANES % 4
    b = (words[g, q], words[g, q + 4])
    zeros = [np.zeros(32)] * 4
    d = emulate.mma_m16n8k16(mma_a_fragment(pairs), b, zeros)
    y = np.full((8, 16), np.nan)
    # The GEMM epilogue: c0 -> (token 2q, col g), c1 -> (2q+1, g), c2 -> (2q, g+8), c3 -> (2q+1, g+8).
    y[2 * q, g], y[2 * q + 1, g], y[2 * q, g + 8], y[2 * q + 1, g + 8] = d
    np.testing.assert_allclose(y, x.astype(np.float64) @ tile.astype(np.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bits,codebook", [(4.0, "mcg"), (2.0, "3inst"), (6.0, "mcg")])
def test_split_halves_mmas_compute_x_times_the_unrounded_weights(bits, codebook):
    """Two MMAs on unsummed halves with duplicated activations (``split_halves_fragments``) = x @ (lo + hi) exactly;
    lo + hi rounded to fp16 is the reference W_hat, so the GEMM differs from x @ W_hat only by that rounding."""
    plan = TrellisPlan(bits)
    ring16 = random_tiles(bits, 1, seed=11)
    ring = ring16[0, 0].numpy().view(np.uint32)
    idx, shift = lane_word_indices(plan, LANES)
    consts = codebook_constants(codebook, emulate)
    halves = decode_lane_halves(plan, codebook, [ring[i] for i in idx], shift, emulate, consts)
    w = np.zeros((16, 16))
    for j in range(8):
        lo, hi = emulate._halves(halves[j])
        for lane in range(32):
            w[tile_position(lane, j)] = lo[lane] + hi[lane]
    ref = decode_trellis(ring16.reshape(1, 1, -1), codebook, bits).numpy()
    assert np.array_equal(w.astype(np.float16).view(np.uint16), ref.view(np.uint16))
    x = np.random.default_rng(7).standard_normal((8, 16)).astype(np.float16)
    words = x.view(np.uint32)
    g, q = LANES // 4, LANES % 4
    acc = [np.zeros(32)] * 4
    # B doubled in the loop (row order) or read as written (doubled order): the same four words
    doubled = doubled_b((words[g, q], words[g, q + 4]), emulate)
    arranged = np.zeros((8, 32), dtype=np.float16)
    arranged[:, 2 * x_doubled_word(np.arange(16))] = x
    arranged[:, 2 * x_doubled_word(np.arange(16)) + 1] = x
    loaded = [arranged.view(np.uint32)[g, 4 * q + i] for i in range(4)]
    assert all(np.array_equal(u, v) for u, v in zip(doubled, loaded))
    for a, b in split_halves_fragments(halves, loaded, emulate):
        acc = emulate.mma_m16n8k16(a, b, acc)
    y = np.full((8, 16), np.nan)
    y[2 * q, g], y[2 * q + 1, g], y[2 * q, g + 8], y[2 * q + 1, g + 8] = acc
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("token_groups,k_tiles_per_stage", [(8, 4), (32, 4), (16, 8), (40, 4)])
def test_stages_order_holds_each_route_blocks_stages_as_the_row_copies_lay_them_out(token_groups, k_tiles_per_stage):
    """X in stages order (trellis.x_stages_index) is a permutation of the rows x columns, and the bytes of token
    block b's stage c (``pieces`` runs of T rows x 128 bytes, where ``mainloop.BulkCopy`` copies them from) are the
    shared-memory image that row order's per-thread copies make of the same rows (``mainloop.swizzled_x_word``):
    the GEMM multiplies the same operands either way."""
    cfg = GemmConfig(4.0, "mcg", token_groups=token_groups, warps=8, k_tiles_per_stage=k_tiles_per_stage, stages=3,
                     mma="wgmma")
    t, width, blocks = cfg.tokens_per_cta, 512, 3
    rows = t * blocks
    index = x_stages_index(np.arange(rows)[:, None], np.arange(width)[None, :], rows)
    assert np.array_equal(np.sort(index.reshape(-1)), np.arange(rows * width))
    x = np.random.default_rng(5).integers(0, 1 << 16, (rows, width), dtype=np.uint16)
    flat = np.empty(rows * width, dtype=np.uint16)
    flat[index.reshape(-1)] = x.reshape(-1)
    stage_k = 16 * k_tiles_per_stage
    pieces = stage_k // STAGE_K
    for b in range(blocks):
        for c in range(width // stage_k):
            runs = [flat[((c * pieces + a) * rows + b * t) * STAGE_K:][: t * STAGE_K] for a in range(pieces)]
            copied = np.concatenate(runs).view(np.uint32)  # the stage as the bulk copies leave it
            image = np.zeros(cfg.x_stage_words, dtype=np.uint32)
            words = x[b * t:(b + 1) * t, c * stage_k:(c + 1) * stage_k].view(np.uint32)  # [T, stage_k / 2]
            for row in range(t):
                for part in range(stage_k // 8):
                    s = swizzled_x_word(cfg, row, part)
                    image[s:s + 4] = words[row, 4 * part:4 * part + 4]
            assert np.array_equal(copied, image), (b, c)


def test_arrange_x_puts_rows_in_stages_order_and_pads_whole_token_blocks():
    """``linear.arrange_x`` (the one-hot GEMM tests' X): rows into ``x_rows`` (whole token blocks), each element at
    its ``x_stages_index``, the padding rows zero."""
    from exl3tool.ops.linear import arrange_x, x_rows

    cfg = GemmConfig(4.0, "mcg", token_groups=8, warps=8, k_tiles_per_stage=4, stages=3, mma="wgmma",
                     x_order="stages")
    xr = torch.randn(100, 256).half()
    got = arrange_x(xr, cfg)
    assert x_rows(100, cfg) == 128 and tuple(got.shape) == (128, 256)
    index = torch.from_numpy(x_stages_index(np.arange(128)[:, None], np.arange(256)[None, :], 128))
    back = got.reshape(-1)[index.reshape(-1)].view(128, 256)
    assert torch.equal(back[:100], xr) and not back[100:].any()


def test_doubled_order_is_a_permutation_within_each_k_tile():
    """Every word of a doubled row is written once, by an element of its own k-tile (16 words per 16 elements)."""
    cols = np.arange(256)
    words = x_doubled_word(cols)
    assert np.array_equal(np.sort(words), cols) and np.array_equal(words // 16, cols // 16)


def test_fragment_order_puts_each_lanes_b_words_side_by_side():
    """X in fragment order (what the input rotation writes for the GEMM): every slot is written once, and the 16
    bytes lane (g, q) loads per k-tile pair are the B words it would read from row order."""
    cols = np.arange(256)
    slots = x_fragment_slot(cols)
    assert np.array_equal(np.sort(slots), cols)
    x = np.random.default_rng(3).standard_normal((8, cols.size)).astype(np.float16)
    arranged = np.zeros_like(x)
    arranged[:, slots] = x
    rows, frag = x.view(np.uint32), arranged.view(np.uint32)
    g, q = LANES // 4, LANES % 4
    for kk in range(cols.size // 16):
        loaded = [frag[g, (kk // 2) * 16 + 4 * q + i] for i in range(4)]
        want = (rows[g, 8 * kk + q], rows[g, 8 * kk + q + 4])
        assert all(np.array_equal(u, v) for u, v in zip(loaded[2 * (kk % 2) : 2 * (kk % 2) + 2], want)), kk


@pytest.mark.parametrize("layout", [dict(warps=4, token_groups=8), dict(warps=8, token_groups=16, warp_cols=4),
                                    dict(warps=8, token_groups=8, warp_cols=2), dict(warps=8, token_groups=8, warp_cols=8)])
def test_accumulator_groups_cover_the_cta_tile_once(layout):
    """Every (tile column, token group) of a CTA is accumulated by exactly one warp, in one register group."""
    cfg = GemmConfig(bits=4.0, codebook="mcg", k_tiles_per_stage=4, **layout)
    owners = [(col, group) for warp in range(cfg.warps) for _, col, group in acc_groups(cfg, warp)]
    assert sorted(owners) == [(c, g) for c in range(cfg.warps) for g in range(cfg.token_groups)]
    for warp in range(cfg.warps):
        assert sorted(j for j, _, _ in acc_groups(cfg, warp)) == list(range(cfg.token_groups))
