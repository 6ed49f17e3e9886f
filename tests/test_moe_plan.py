"""The fused MoE plan on the CPU: the route packing the kernel does (emulated here in NumPy) never needs more
blocks or rows than the plan's bound, for any routing (uniform, all to one expert, every route its own expert,
shared experts); split-K always covers K in whole stages; the launch count."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from exl3tool.kernels.moe_route import MoERouteConfig
from exl3tool.ops import moe_configs
from exl3tool.ops import targets
from exl3tool.ops.moe import DeviceExpertGroup
from exl3tool.ops.moe_configs import (
    GroupShape, LayerShape, _per_split, block_bound, expected_blocks, input_rotation_layout,
    intermediate_blocks_per_warp, intermediate_config, spread_pad, step_shape, sum_blocks_per_cta,
)
from helpers import launched_partials


def pack(ids: np.ndarray, experts: int, block_rows: int):
    """What MoERoute's packing writes: block_expert per block, row_route per row (-1 = padding)."""
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=experts)
    block_expert, row_route = [], []
    for e in range(experts):
        routes = np.nonzero(flat == e)[0].tolist()
        blocks = -(-counts[e] // block_rows)
        block_expert += [e] * blocks
        row_route += routes + [-1] * (blocks * block_rows - len(routes))
    return np.array(block_expert, dtype=np.int64), np.array(row_route, dtype=np.int64)


def moe(num_experts=128, top_k=8, shared="none", hidden_p=2048, inter_p=768):
    cfg = MoERouteConfig("softmax_topk", num_experts, top_k, shared=shared)
    return LayerShape(cfg, hidden_p, (GroupShape(4.0, "mcg", 4.0, "mcg", inter_p),))


def routings(tokens: int, experts: int, k: int, rng):
    yield "uniform", np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
    yield "one expert", np.tile(np.arange(k), (tokens, 1))  # top-k forced onto the same k experts
    spread = (np.arange(tokens * k) % experts).reshape(tokens, k)
    yield "every route its own expert", spread


@pytest.mark.parametrize("shared", ["none", "gated"])
@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 33, 100, 256, 1000])
def test_packing_fits_the_planned_blocks(tokens, shared):
    d = moe(shared=shared)
    cfg = d.route
    shape = step_shape(d, tokens, sm_count=132)
    rng = np.random.default_rng(tokens)
    for what, ids in routings(tokens, cfg.num_experts, cfg.top_k, rng):
        if shared != "none":
            ids = np.concatenate([ids, np.full((tokens, 1), cfg.num_experts)], axis=1)
        assert ids.shape[1] == cfg.routes_per_token
        block_expert, row_route = pack(ids, cfg.packed_experts, shape.block_rows)
        assert len(block_expert) <= shape.blocks and len(row_route) <= shape.rows, what
        # every route has exactly one row, in a block of its own expert
        rows = {r: i for i, r in enumerate(row_route) if r >= 0}
        assert sorted(rows) == list(range(ids.size))
        flat = ids.reshape(-1)
        assert all(block_expert[rows[r] // shape.block_rows] == flat[r] for r in range(ids.size))


@pytest.mark.parametrize("k_tiles,stage", [(128, 8), (48, 8), (256, 8), (8, 8), (128, 16), (48, 16)])
def test_split_k_covers_k_in_whole_stages(k_tiles, stage):
    for splits in range(1, 17):
        per = _per_split(k_tiles, splits, stage)
        assert per % stage == 0 and per * splits >= k_tiles


def test_split_k_refuses_a_k_of_partial_stages():
    """16-k-tile stages do not divide every K (56 k-tiles: in_p 896): the last split's 8 would go unread."""
    with pytest.raises(ValueError, match="not a whole number of 16-k-tile stages"):
        _per_split(56, 1, 16)


def test_block_rows_grow_with_the_routes_per_expert():
    d = moe()
    assert [step_shape(d, m, 132).block_rows for m in (1, 16, 64, 256, 512, 1024, 2048, 4096)] == [
        8, 8, 8, 32, 64, 64, 128, 128]
    # sm_90a's warpgroup MMAs take 320-row blocks once the mean reaches 256 routes an expert
    # (moe_configs.BLOCK_FROM_MEAN), but at a mean of 384 two 256-row blocks an expert cost less than two 320-row ones;
    # SM120 stays at 128
    assert [step_shape(d, m, 132, "sm_90a").block_rows for m in (1024, 2048, 4095, 4096, 6144, 8192)] == [
        64, 128, 128, 320, 256, 320]
    assert step_shape(d, 8192, 188, "sm_120a").block_rows == 128
    one = step_shape(d, 1, 132)
    assert one.blocks == 8 and one.splits13 > 1 and one.splits2 > 1  # M=1 splits K to fill the SMs


def test_the_intermediate_is_fused_into_a_short_gate_up_grid_or_behind_block_ready_counters(monkeypatch):
    """The gate/up GEMM takes over the intermediate step where its grid, counted over the blocks uniform routing
    is expected to use, is at most 1.25 waves of 8 CTAs per SM (H200: M=1-3 and 5-8 faster, M=4 at 2 K splits and
    M=9 on slower), so at decode for this layer, and at M=16 too on a GPU with many more SMs; and from
    moe_configs.READY_COUNTERS_MIN_TOKENS (4) wherever the route blocks use mma.sync, whose down GEMM then waits for
    block-ready counters: on sm_90a up to 32-row blocks and the 64-row ones below moe_configs.SYNC_BELOW_MEAN (M=479),
    never the warpgroup-MMA ones."""
    d = moe()
    fused = [m for m in range(1, 600) if step_shape(d, m, 132, "sm_90a").fused_intermediate]
    ready = [m for m in range(1, 600) if step_shape(d, m, 132, "sm_90a").ready_counters]
    assert fused[:3] == [1, 2, 3] and ready == fused[3:] and ready[0] == 4
    assert ready == list(range(4, 480)) and not any(step_shape(d, m, 132, "sm_90a").wgmma for m in ready)
    assert step_shape(d, 480, 132, "sm_90a").wgmma
    assert not step_shape(d, 4096, 132, "sm_90a").fused_intermediate
    monkeypatch.setattr(moe_configs, "READY_COUNTERS_MIN_TOKENS", 1 << 30)
    # (M=4 and 14-16: 8-warp CTAs, moe_configs.eight_warp_small_blocks, halve the gate/up grid)
    without_counters = [m for m in range(1, 17) if step_shape(d, m, 132).fused_intermediate]
    assert without_counters == [1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 16]
    assert not any(step_shape(d, m, 132).fused_intermediate for m in (64, 256, 4096))
    assert step_shape(d, 16, 1000).fused_intermediate and not step_shape(d, 1, 8).fused_intermediate
    # the expected blocks: every expert reached, one more per 8 routes beyond, the shared expert's own
    assert expected_blocks(d.route, 1, 8) == pytest.approx(8)
    assert expected_blocks(moe(shared="ungated").route, 16, 8) == pytest.approx(
        128 * (1 - (15 / 16) ** 16) + (128 - 128 * (1 - (15 / 16) ** 16)) / 8 + 2)


def test_the_intermediate_takes_two_blocks_a_warp_where_they_divide_the_row():
    """fp32 gate/up partials: two 128-column blocks a warp (moe_configs.INTERMEDIATE_MAX_BLOCKS_PER_WARP) where the
    intermediate's block count is even, one where it is odd (every warp takes the same number), by packed row."""
    assert [intermediate_blocks_per_warp(b) for b in (1, 2, 3, 6, 7, 32)] == [1, 2, 1, 2, 1, 2]
    # 8 values a lane (both blocks at once) where the warp takes two
    assert [(c.blocks_per_warp, c.lane_values) for c in (intermediate_config(1, "rows", b) for b in (3, 6))] == [
        (1, 4), (2, 8)]
    assert not any(intermediate_config(1, "rows", b).by_route for b in (3, 6))


def test_the_intermediate_of_half_partials_takes_up_to_six_blocks_a_warp_and_a_warp_per_route():
    """fp16 gate/up partials (from HALF_PARTIALS_MIN_TOKENS): up to six 128-column blocks a warp, the most that
    divide the row's, and the launch's warps go by route, not by packed row (padding rows get no CTA)."""
    assert [intermediate_blocks_per_warp(b, "float16") for b in (1, 2, 3, 6, 7, 8, 12, 23)] == [1, 2, 3, 6, 1, 4, 6, 1]
    configs = [intermediate_config(1, "rows", b, partials="float16") for b in (3, 6, 7)]
    assert [(c.blocks_per_warp, c.lane_values, c.by_route) for c in configs] == [
        (3, 4, True), (6, 8, True), (1, 4, True)]


def test_one_token_group_blocks_split_halves_and_read_doubled_inputs():
    """8-row route blocks (one token group) split each weight's halves where the dense M <= 8 GEMM does
    (targets.split_halves), so X and X2 are written doubled; larger blocks and mul1 keep their orders."""
    from exl3tool.ops.moe_configs import group_splits, x_order

    mcg = SimpleNamespace(w13_codebook="mcg", w13_bits=4.0, w2_codebook="mul1", w2_bits=4.0)
    assert group_splits("sm_90a", mcg, 8) == (True, False) and group_splits("sm_120a", mcg, 8) == (True, False)
    assert group_splits("sm_90a", mcg, 32) == (False, False)
    low = SimpleNamespace(w13_codebook="3inst", w13_bits=2.0, w2_codebook="mcg", w2_bits=2.0)
    assert group_splits("sm_120a", low, 8) == (False, False) and group_splits("sm_90a", low, 8) == (True, True)
    assert [x_order(rows, split) for rows, split in ((8, True), (8, False), (32, False), (128, False))] == [
        "doubled", "rows", "fragments", "rows"]


def test_sixteen_row_blocks_write_gate_up_x_alone_in_fragment_order(monkeypatch):
    """moe_configs.GATE_UP_FRAGMENT_ORDER_ROWS: 16-row route blocks take gate/up's X (the input rotation's output) in
    fragment order and keep down's X2 in rows; off, both in rows. 32-row blocks take both in fragments either way."""
    from exl3tool.ops.moe_configs import gemm_config, x_order

    orders = lambda rows: (x_order(rows, gate_up=True), x_order(rows), gemm_config(4.0, "mcg", 2, rows).x_order,
                           gemm_config(4.0, "mcg", 1, rows).x_order)
    assert orders(16) == ("fragments", "rows", "fragments", "rows") and orders(32) == ("fragments",) * 4
    monkeypatch.setattr(moe_configs, "GATE_UP_FRAGMENT_ORDER_ROWS", ())
    assert orders(16) == ("rows",) * 4 and orders(32) == ("fragments",) * 4


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("shared", ["none", "gated"])
def test_a_few_tokens_rotate_their_route_blocks_rows_in_the_gate_up_gemm(monkeypatch, arch, shared):
    """moe_configs.RESIDENT_INPUT_TOKENS: up to it the router's routes go without an input rotation launch, the gate/up
    GEMM holding a row of x a token (resident_rows = M, the K split's k-tiles, within its shared memory); the caller's
    routes (an expert twice a token), more tokens and rows that do not fit keep the launch. 4 since s52 (measured on an
    H100: 1-2% faster at M=2-4, 8 lost at M=6-8)."""
    from exl3tool.ops.moe_configs import step_configs

    d = moe(shared=shared)
    assert moe_configs.RESIDENT_INPUT_TOKENS == 4
    for m in range(1, 7):
        for given in (False, True):
            (g,) = step_configs(d, m, given, arch, 132, "float16", "float16").groups
            resident = m <= 4 and not given
            assert (g.rotation is None) == resident and (g.gate_up.input is not None) == resident, (m, given)
            if resident:
                assert g.gate_up.resident_rows == m and g.gate_up.resident_k_tiles == g.per13
                assert g.per13 <= g.gate_up.mainloop.max_resident_k_tiles
            else:
                assert g.gate_up.resident_rows == 1
    # rows that do not fit beside the weight stages keep the launch: 8 tokens of a 16384-wide x, K not split
    monkeypatch.setattr(moe_configs, "RESIDENT_INPUT_TOKENS", 8)
    wide = moe(shared=shared, hidden_p=16384)
    for m, resident in ((2, True), (8, False)):
        (g,) = step_configs(wide, m, False, arch, 132, "float16", "float16").groups
        assert (g.rotation is None) == resident and (g.gate_up.input is not None) == resident, m


def test_eight_warp_small_blocks_at_listed_token_counts(monkeypatch):
    """8- and 16-row route blocks take 8-warp CTAs from moe_configs.EIGHT_WARP_SMALL_BLOCK_MIN_TOKENS and at the token
    counts in EIGHT_WARP_SMALL_BLOCK_TOKENS (M = 4): there its CTAs take twice the columns and split-K fills the SMs
    again with three gate/up splits and two down splits instead of two and one; its neighbours keep 4 warps."""
    from exl3tool.ops.moe_configs import gemm_layout

    d = moe()
    assert moe_configs.EIGHT_WARP_SMALL_BLOCK_TOKENS == (4,)
    assert [gemm_layout(8, "mcg", tokens=m).get("warps", 4) for m in (3, 4, 5, 13, 14)] == [4, 8, 4, 4, 8]
    shapes = [step_shape(d, m, 132) for m in (3, 4, 5)]
    assert [(s.splits13, s.splits2) for s in shapes] == [(2, 2), (3, 2), (1, 1)]
    monkeypatch.setattr(moe_configs, "EIGHT_WARP_SMALL_BLOCK_TOKENS", ())
    assert gemm_layout(8, "mcg", tokens=4).get("warps", 4) == 4
    shape = step_shape(d, 4, 132)
    assert (shape.splits13, shape.splits2) == (2, 1)


def test_unsplit_route_block_pipelines_on_sm90():
    """On sm_90 8-row mma.sync route blocks whose K is not split take moe_configs.UNSPLIT_SYNC_PIPELINES: 3 stages of 8
    k-tiles at 4 warps (H200 M=8-64 3-5% faster), 2 of 16 at 8 warps (half the CTA barriers) where 16 k-tiles divide
    the GEMM's K, else 3 of 8; split ones (M <= 4 here, a few stages a CTA) and everything else keep the layout's;
    SM120 keeps 2 of 8. Each pipeline fits beside the rest of the CTA's shared memory."""
    from exl3tool.ops.moe_configs import block_warps, gemm_config, sync_pipeline

    d = moe()
    shapes = {m: step_shape(d, m, 132) for m in (1, 2, 4, 8, 16, 64)}
    assert [(m, s.block_rows, s.splits13, s.splits2) for m, s in shapes.items()] == [
        (1, 8, 4, 3), (2, 8, 3, 2), (4, 8, 3, 2), (8, 8, 1, 1), (16, 8, 1, 1), (64, 8, 1, 1)]
    assert [block_warps(8, "mcg", False, m) for m in (8, 16, 64)] == [4, 8, 8]
    sixteen, three = {"stages": 2, "k_tiles_per_stage": 16}, {"stages": 3}
    assert [sync_pipeline("sm_90a", 8, 4, False, n, 128) for n in (1, 2)] == [three, {}]
    assert [sync_pipeline("sm_90a", 8, 8, False, 1, k) for k in (128, 48, 56, 8)] == [sixteen, sixteen, three, three]
    assert sync_pipeline("sm_90a", 8, 8, False, 3, 128) == sync_pipeline("sm_90a", 8, 8, True, 1, 128) == {}
    assert sync_pipeline("sm_90a", 16, 8, False, 1, 128) == sync_pipeline("sm_90a", 32, 4, False, 1, 128) == {}
    assert sync_pipeline("sm_120a", 8, 4, False, 1, 128) == sync_pipeline("sm_120a", 8, 8, False, 1, 128) == {}
    for planes in (1, 2):
        cfg = gemm_config(4.0, "mcg", planes, 8, split_halves=True, **sync_pipeline("sm_90a", 8, 4, False, 1, 128))
        assert (cfg.warps, cfg.stages, cfg.k_tiles_per_stage) == (4, 3, 8)
        cfg = gemm_config(4.0, "mcg", planes, 8, tokens=16, split_halves=True,
                          **sync_pipeline("sm_90a", 8, 8, False, 1, 128))
        assert (cfg.warps, cfg.stages, cfg.k_tiles_per_stage) == (8, 2, 16)


def test_large_route_blocks_take_warpgroup_mma_on_sm90a():
    """From MOE_WGMMA_MIN_ROWS rows a block, sm_90a's GEMMs are the warpgroup-MMA ones (X and X2 then in row order,
    which the MMA's swizzled copies expect, and from 256 rows in the stages' layout, one bulk copy a stage), except
    64-row blocks below SYNC_BELOW_MEAN routes an expert; SM120 and the arch-free plan keep mma.sync."""
    from exl3tool.ops.moe_configs import MOE_WGMMA_MIN_ROWS, SYNC_BELOW_MEAN, gemm_config, uses_wgmma, x_order

    assert MOE_WGMMA_MIN_ROWS == 64 and SYNC_BELOW_MEAN == {64: 30}
    assert [uses_wgmma(rows, "sm_90a", 64) for rows in (8, 32, 64, 128)] == [False, False, True, True]
    assert [uses_wgmma(64, "sm_90a", mean) for mean in (17, 29.9, 30, 32)] == [False, False, True, True]
    assert not uses_wgmma(128, "sm_120a", 256) and not uses_wgmma(128, None, 256)
    # E=128 top-8 on the H200: M=257-479 (64-row blocks, means 16-30) mma.sync with the fused intermediate
    plans = {m: step_shape(moe(), m, 132, "sm_90a") for m in (256, 257, 479, 480, 512, 1024, 2048)}
    assert {m: (s.block_rows, s.wgmma, s.ready_counters) for m, s in plans.items()} == {
        256: (32, False, True), 257: (64, False, True), 479: (64, False, True), 480: (64, True, False),
        512: (64, True, False), 1024: (64, True, False), 2048: (128, True, False)}
    assert x_order(64, False, True) == "rows" and x_order(64, False, False) == "fragments"
    assert [x_order(rows, False, True) for rows in (128, 256, 320)] == ["rows", "stages", "stages"]
    assert gemm_config(4.0, "mcg", 1, 320, True).x_order == "stages"
    cfg = gemm_config(4.0, "mcg", 2, 128, True)
    assert (cfg.mma, cfg.warps, cfg.warp_cols, cfg.k_tiles_per_stage) == ("wgmma", 8, 1, 4)
    with pytest.raises(ValueError, match="one-row blocks"):  # the M = 1 prologue stays mma.sync's
        gemm_config(4.0, "mcg", 2, 64, True, input="float16", resident_k_tiles=32)


def test_the_input_rotation_splits_slots_at_decode_and_takes_eight_values_at_large_m():
    """Hidden 2048 (16 blocks), top-8, 132 SMs: a warp per slot while (token, block) warps would leave the SMs
    idle, one warp for all slots in between, and from 64 pairs per SM 8 values a lane with the slots over 4 CTAs
    (over k' where k' is smaller)."""
    layouts = [input_rotation_layout(m, 16, 8, 132) for m in (1, 16, 33, 256, 527, 528, 4096)]
    assert layouts == [(4, 8), (4, 8), (4, 1), (4, 1), (4, 1), (8, 4), (8, 4)]
    assert input_rotation_layout(4096, 16, 2, 132) == (8, 2)


def test_only_the_largest_wgmma_route_blocks_pass_stages_through_mbarriers():
    """moe_configs.MBARRIER_MIN_ROWS: 320-row warpgroup-MMA blocks use the mbarrier main loop (faster there), smaller
    ones and mma.sync the CTA barrier; GemmConfig refuses mbarriers outside the warpgroup-MMA loop."""
    from exl3tool.kernels.gemm import GemmConfig
    from exl3tool.ops.moe_configs import gemm_config

    assert [gemm_config(4.0, "mcg", 2, rows, wgmma=True).mbarriers for rows in (64, 128, 256, 320)] == [
        False, False, False, True]
    assert not gemm_config(4.0, "mcg", 1, 128).mbarriers
    with pytest.raises(ValueError, match="warpgroup-MMA"):
        GemmConfig(4.0, "mcg", token_groups=8, mbarriers=True)


def test_a_group_of_consecutive_experts_names_its_first():
    """DeviceExpertGroup.first_expert (the GEMMs' group_first): every routed expert of a one-group layer, the shared
    expert's group (id E), a run of ids; -1 for interleaved or unordered groups, which keep the group_row table."""
    first = lambda experts: DeviceExpertGroup.first_expert.fget(SimpleNamespace(experts=experts))  # noqa: E731
    assert first(tuple(range(128))) == 0 and first((128,)) == 128 and first((4, 5, 6)) == 4
    assert first((1, 3, 5)) == -1 and first((0, 2)) == -1 and first((5, 4)) == -1


def test_topk_sum_blocks_per_cta_leave_eight_ctas_per_sm(monkeypatch):
    """The most column blocks per top-k sum CTA (4, 2, then 1) that still leave 8 CTAs per SM (132 SMs, 16 blocks a
    token): 4 from 264 tokens, 2 from 132, else 1; never more than SUM_BLOCKS_PER_CTA."""
    want = {1: 1, 131: 1, 132: 2, 256: 2, 263: 2, 264: 4, 4096: 4}
    assert {m: sum_blocks_per_cta(m, 16, 132) for m in want} == want
    for m in want:
        per_cta = sum_blocks_per_cta(m, 16, 132)
        assert m * 16 / per_cta >= 8 * 132 or per_cta == 1
    monkeypatch.setattr(moe_configs, "SUM_BLOCKS_PER_CTA", 1)
    assert sum_blocks_per_cta(4096, 16, 132) == 1


def test_mma_sync_route_blocks_of_several_groups_skip_their_empty_ones():
    """moe_configs.GROUP_LOOPS: the 16-, 32- and 64-row mma.sync route blocks (M = 65-479 at E=128 top-8) compile a main
    loop for each listed count of token groups and read row_route to pick one; 8-row blocks (one group) and
    warpgroup-MMA blocks do not. MoEGemmConfig refuses counts that are not ascending up to the block's groups, and the
    skip where it has no meaning."""
    import dataclasses

    from exl3tool.ops.moe_configs import gemm_config

    assert moe_configs.GROUP_LOOPS == {16: (1, 2), 32: (2, 4), 64: (2, 4, 6, 8)}
    for rows in (8, 16, 32, 64):
        for planes in (2, 1):
            cfg = gemm_config(4.0, "mcg", planes, rows, tokens=256)
            assert cfg.group_loops == moe_configs.GROUP_LOOPS.get(rows, ()) and cfg.takes_row_route == (rows > 8)
    assert gemm_config(4.0, "mcg", 2, 64, True).group_loops == ()
    assert gemm_config(4.0, "mcg", 2, 8, intermediate_splits=1).group_loops == ()
    cfg = gemm_config(4.0, "mcg", 1, 32, tokens=256)
    for wrong in (dict(group_loops=(2, 3)), dict(group_loops=(4, 2, 4)), dict(group_loops=(0, 4)),
                  dict(group_loops=(2, 2, 4)), dict(token_groups=1, group_loops=(1,)),
                  dict(mma="wgmma", token_groups=8, warps=8, group_loops=(4, 8)),
                  dict(warp_cols=4, token_groups=16, group_loops=(8, 16)),
                  dict(planes=2, input="float16", resident_k_tiles=32)):
        with pytest.raises(ValueError, match="group_loops"):
            dataclasses.replace(cfg, **wrong)


def test_group_loops_leave_out_the_x_copies_of_the_groups_they_skip(monkeypatch):
    """mainloop.x_copies_past: a thread's X copies of a stage run over the rows in order (256 threads, 16 pieces a
    row: 16 rows each), so the 32-row blocks' 2-group loop leaves out the second of its two and the 4-group loop
    none; a 16-row block's one copy holds rows of both groups, so its 1-group loop keeps it; with the switch off
    every loop copies every row."""
    import dataclasses

    from exl3tool.kernels import mainloop
    from exl3tool.ops.moe_configs import gemm_config

    cfg32, cfg16 = (gemm_config(4.0, "mcg", 1, rows, tokens=256).mainloop for rows in (32, 16))
    assert (cfg32.warps, cfg32.x_k_tile_words * cfg32.k_tiles_per_stage // 4) == (8, 16)
    assert [mainloop.x_copies_past(cfg32, 256, g) for g in (1, 2, 3, 4)] == [1, 1, 0, 0]
    assert [mainloop.x_copies_past(cfg16, 256, g) for g in (1, 2)] == [0, 0]
    four_warps = dataclasses.replace(cfg32, warps=4)  # 128 threads: 8 rows a copy
    assert [mainloop.x_copies_past(four_warps, 128, g) for g in (1, 2, 3, 4)] == [3, 2, 1, 0]
    monkeypatch.setattr(mainloop, "GROUP_LOOP_X_ROWS", False)
    assert mainloop.x_copies_past(cfg32, 256, 2) == 0


def test_unsplit_gemms_store_fp16_partials_from_the_listed_token_count(monkeypatch):
    """From HALF_PARTIALS_MIN_TOKENS on, each GEMM of one K split and the launch that sums its partials take
    float16 partials; a split GEMM (and the launch after it) keeps float32 at any M (each split's would round)."""
    layer = moe()
    wide = moe(num_experts=2, top_k=1, hidden_p=4096, inter_p=8192)  # split down GEMMs at every M below
    first = moe_configs.HALF_PARTIALS_MIN_TOKENS
    for m in (first - 1, first, 4096):
        for d in (layer, wide):
            c = moe_configs.step_configs(d, m, False, "sm_90", 132, "float16", "float16")
            launched = launched_partials(c)
            assert {role for role, _, _ in launched} == {"gate/up", "intermediate", "down", "top-k sum"}
            assert [partials for _, partials, _ in launched] == [
                "float16" if m >= first and splits == 1 else "float32" for _, _, splits in launched]
        assert c.shape.splits2 > 1  # wide's, the last of the loop
    monkeypatch.setattr(moe_configs, "HALF_PARTIALS_MIN_TOKENS", 1)
    narrow = moe(num_experts=32, top_k=6, hidden_p=256, inter_p=128)  # one split at M = 1
    c = moe_configs.step_configs(narrow, 1, False, "sm_90", 132, "float16", "float16")  # resident input, fused top-k
    gate_up, down = (cfg for role, cfg in c.kernels() if role in ("gate/up", "down"))
    assert (gate_up.input, gate_up.partials, down.partials, down.topk_sum.partials) == (
        "float16", "float16", "float16", "float16")


def _spreads(routes: int, experts: int):
    """Every way of putting ``routes`` routes on ``experts`` experts (counts per expert)."""
    for cuts in itertools.combinations(range(routes + experts - 1), experts - 1):
        edges = (-1, *cuts, routes + experts - 1)
        yield [b - a - 1 for a, b in zip(edges, edges[1:])]


def test_block_bound_is_the_most_blocks_any_routing_fills():
    """moe_configs.block_bound: no way of putting R routes on E experts fills more blocks of T rows, and one fills
    exactly that many (every case of E <= 5, T <= 8, R <= 12)."""
    for experts in (1, 2, 3, 5):
        for rows in (1, 2, 3, 8):
            for n in range(1, 13):
                most = max(sum(-(-c // rows) for c in counts) for counts in _spreads(n, experts))
                assert block_bound(n, experts, rows) == most, (n, experts, rows)
    # the fused layer at M = 1: its 8 routes fill 8 blocks, no ninth (idle CTAs in every grid)
    assert step_shape(moe(), 1, 132).blocks == 8 and step_shape(moe(shared="gated"), 1, 132).blocks == 9


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a", "sm_80"])
def test_spread_pad_holds_an_sm_to_the_asked_ctas(arch):
    """moe_configs.spread_pad: a CTA of ``smem`` bytes plus the pad (and up to STATIC_SMEM_MARGIN of the kernel's own)
    fits the asked CTAs an SM where shared memory binds, and never more; no pad where the CTA is large enough
    already."""
    for ctas in (2, 4, 6, 8):
        for smem in (4096, 17424, 30000):
            pad = spread_pad(arch, smem, ctas)
            assert pad % 16 == 0 and pad >= 0
            for own in (0, moe_configs.STATIC_SMEM_MARGIN):
                fit = targets.resident_ctas(arch, 128, smem + pad + own, 32)
                assert fit == ctas if pad else fit <= ctas, (ctas, smem, own)
    assert spread_pad(arch, 4096, None) == 0


def test_down_gemm_is_spread_at_the_listed_token_counts(monkeypatch):
    """moe_configs.DOWN_MAX_CTAS_PER_SM: at M=1 the down GEMM (alone) holds the shared memory that keeps it to 6 CTAs an
    SM of an H100 / H200; other M and the other kernels hold none."""
    def pads(m):
        c = moe_configs.step_configs(moe(), m, False, "sm_90a", 132, "float16", "float16")
        return {role: cfg.smem_pad for role, cfg in c.kernels() if role in ("gate/up", "down")}

    assert pads(2) == {"gate/up": 0, "down": 0}
    one = pads(1)
    assert one["gate/up"] == 0 and one["down"] > 0
    down = moe_configs.step_configs(moe(), 1, False, "sm_90a", 132, "float16", "float16").groups[0].down
    assert targets.resident_ctas("sm_90a", 128, down.smem_bytes, 32) == moe_configs.DOWN_MAX_CTAS_PER_SM[1] == 6
    monkeypatch.setattr(moe_configs, "DOWN_MAX_CTAS_PER_SM", {})
    assert pads(1)["down"] == 0


def test_slot_blocks_at_one_token_where_only_the_one_token_gemms_read_the_blocks(monkeypatch):
    """moe_configs.SLOT_BLOCKS: the route kernel skips the packing (MoERouteConfig.slot_blocks) at M = 1 with the
    router's routes, where the gate/up GEMM rotates x itself and both GEMMs do the intermediate and the top-k sum; not
    for the caller's routes (they may repeat an expert), nor from two tokens, nor behind an input rotation launch."""
    def slot(m, given=False, **layer):
        return moe_configs.step_configs(moe(**layer), m, given, "sm_90a", 132, "float16", "float16").route.slot_blocks

    assert slot(1) and slot(1, shared="gated")
    assert not slot(1, given=True) and not slot(2) and not slot(8)
    monkeypatch.setattr(moe_configs, "RESIDENT_INPUT_TOKENS", 0)  # an input rotation launch, which reads expert_row
    assert not slot(1)
    with pytest.raises(ValueError, match="slot_blocks"):
        MoERouteConfig("given", 128, 8, slot_blocks=True)


def test_routes_chosen_in_the_gemms_at_one_token_with_slot_blocks(monkeypatch):
    """moe_configs.ROUTE_IN_GEMMS: with slot blocks (one token, the router's routes) the route kernel writes only the
    logits (MoERouteConfig.logits_only), every group's gate/up GEMM chooses its blocks' experts (MoEGemmConfig.route,
    the route's own config), the first one alone writes the routes, and every down GEMM awaits its block's expert
    (awaits_block_expert); without slot blocks nothing changes, and the configs refuse the flags anywhere else."""
    def plan(m, given=False, **layer):
        return moe_configs.step_configs(moe(**layer), m, given, "sm_90a", 132, "float16", "float16")

    for layer in ({}, {"shared": "gated"}):
        c = plan(1, **layer)
        assert c.route.logits_only and c.route.slot_blocks
        assert all(g.gate_up.route == c.route and g.down.route is None for g in c.groups)
        assert [g.gate_up.writes_routes for g in c.groups] == [True] + [False] * (len(c.groups) - 1)
        assert all(g.down.awaits_block_expert and not g.gate_up.awaits_block_expert for g in c.groups)
    for c in (plan(1, given=True), plan(2)):
        assert not c.route.logits_only
        assert all(g.gate_up.route is None and not g.down.awaits_block_expert for g in c.groups)
    with monkeypatch.context() as patch:  # down waits first, then reads the table
        patch.setattr(moe_configs, "EARLY_DOWN_WEIGHTS", False)
        down = plan(1).groups[0].down
        assert down.awaits_block_expert and not down.weights_before_wait
    monkeypatch.setattr(moe_configs, "ROUTE_IN_GEMMS", False)
    c = plan(1)
    assert c.route.slot_blocks and not c.route.logits_only and c.groups[0].gate_up.route is None
    with pytest.raises(ValueError, match="logits_only"):
        MoERouteConfig("softmax_topk", 128, 8, logits_only=True)
    route = plan(1).route
    gate_up, down = plan(1).groups[0].gate_up, plan(1).groups[0].down
    with pytest.raises(ValueError, match="route is for"):
        dataclasses.replace(down, route=route)
    with pytest.raises(ValueError, match="awaits_block_expert"):
        dataclasses.replace(plan(16).groups[0].down, awaits_block_expert=True)  # no fused top-k sum
    with pytest.raises(ValueError, match="route is for"):
        dataclasses.replace(gate_up, route=dataclasses.replace(route, logits_only=False, slot_blocks=False))
    with pytest.raises(ValueError, match="writes_routes"):
        dataclasses.replace(gate_up, route=None, writes_routes=True)


def test_down_gemm_is_spread_only_where_it_fits_one_wave_at_the_cap():
    """moe_configs.down_cap: a down grid larger than DOWN_MAX_CTAS_PER_SM a SM on every SM keeps its CTAs unpadded (a
    wide layer's M=1 down GEMM would otherwise take a second wave); the 30B layer's 768 CTAs fit 6 x 132."""
    wide = moe(num_experts=256, hidden_p=7168, inter_p=2048)
    down = moe_configs.step_configs(wide, 1, False, "sm_90a", 132, "float16", "float16").groups[0].down
    assert down.smem_pad == 0
    assert moe_configs.down_cap(1, 768, 132) == 6 and moe_configs.down_cap(1, 793, 132) is None
    assert moe_configs.down_cap(2, 100, 132) is None


def test_early_prologue_loads_at_one_token(monkeypatch):
    """moe_configs.EARLY_PROLOGUE_LOADS: the gate/up GEMM that rotates x itself issues its prologue's loads first
    (MoEGemmConfig.early_prologue_loads) at M = 1 only (from two tokens it rotates several rows)."""
    def early(m):
        c = moe_configs.step_configs(moe(), m, False, "sm_90a", 132, "float16", "float16").groups[0].gate_up
        return c.input is not None, c.early_prologue_loads

    assert early(1) == (True, True) and early(2) == (True, False) and early(16)[1] is False
    monkeypatch.setattr(moe_configs, "EARLY_PROLOGUE_LOADS", False)
    assert early(1) == (True, False)


def test_splits_in_x_only_where_a_gemm_has_several_k_splits(monkeypatch):
    """moe_configs.SPLITS_IN_X_TOKENS puts a GEMM's K splits in its grid's x (MoEGemmConfig.splits_in_x) at the listed
    token counts where it has more than one (M=1 by default), nowhere else."""
    def flags(m):
        step = moe_configs.step_configs(moe(), m, False, "sm_90a", 132, "float16", "float16")
        g = step.groups[0]
        return (step.shape.splits13, g.gate_up.splits_in_x), (step.shape.splits2, g.down.splits_in_x)

    assert flags(1) == ((4, True), (3, True)) and flags(2) == ((3, False), (2, False))
    assert flags(16) == ((1, False), (1, False))
    monkeypatch.setattr(moe_configs, "SPLITS_IN_X_TOKENS", ())
    assert flags(1) == ((4, False), (3, False))
    monkeypatch.setattr(moe_configs, "SPLITS_IN_X_TOKENS", (2, 16))
    monkeypatch.setattr(moe_configs, "CTAS_PER_SM", 16)
    assert flags(2)[0][1] and flags(16) == ((2, True), (2, True))
