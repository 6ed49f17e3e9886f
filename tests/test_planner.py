"""The decode GEMM's split-K planner sizes grids by each target's own SM limits (exl3tool.ops.targets); no GPU."""

import math
from types import SimpleNamespace

import pytest

from exl3tool.kernels.gemm import fitting_config
from exl3tool.ops import linear as linear_ops
from exl3tool.ops.linear import FOLD_MIN_TOKENS, WGMMA_MAX_TOKENS, choose_path, plan_gemm
from exl3tool.ops.targets import gemm_resident_ctas, limits, resident_ctas, wave_fill


def linear(in_p, out_p, bits=4.0, codebook="mcg"):
    return SimpleNamespace(info=SimpleNamespace(in_padded=in_p, out_padded=out_p, bits=bits, codebook=codebook),
                           device=None)


def test_resident_ctas_follow_each_targets_limits():
    cfg = fitting_config(bits=4.0, codebook="mcg", token_groups=1)
    assert gemm_resident_ctas("sm_120a", cfg) == 7  # SM120: 100 KB of shared memory per SM is the limit
    assert gemm_resident_ctas("sm_90a", cfg) == 8  # H200: 64K registers at 64 per thread
    assert limits("sm_120a").threads == 1536 and limits("sm_90a").smem_bytes == 228 * 1024
    assert resident_ctas("sm_120a", 512, 1024, 32) == 3  # 1536 threads
    with pytest.raises(ValueError, match="no SM limits"):
        limits("sm_75")


@pytest.mark.parametrize("arch,sms", [("sm_120a", 170), ("sm_120a", 188), ("sm_90a", 132)])
@pytest.mark.parametrize("shape", [(4096, 14336), (14336, 4096)])
@pytest.mark.parametrize("tokens", [1, 8, 16, 64])
@pytest.mark.parametrize("bits", [2.0, 4.0, 6.0])
def test_plan_fills_a_wave(arch, sms, shape, tokens, bits):
    in_p, out_p = shape
    plan = plan_gemm(tokens, linear(in_p, out_p, bits), sms, arch=arch)
    cfg, k_tiles = plan.config, in_p // 16
    # The splits cover K exactly once, in whole stages.
    assert plan.k_tiles_per_split % cfg.k_tiles_per_stage == 0
    assert (plan.splits - 1) * plan.k_tiles_per_split < k_tiles <= plan.splits * plan.k_tiles_per_split
    ctas = (out_p // 16 // cfg.warps) * math.ceil(tokens / cfg.tokens_per_cta) * plan.splits
    # SM120 (170 and 188 SMs): at least one whole wave; the H200 80% of one (targets.WAVE_FILL, measured there).
    assert wave_fill(arch) == (0.8 if arch == "sm_90a" else 1.0)
    assert ctas >= wave_fill(arch) * gemm_resident_ctas(arch, cfg) * sms, (plan, ctas)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_eight_warps_where_they_keep_the_occupancy(arch):
    def warps(tokens, shape, codebook="mcg"):  # the mma.sync GEMM (sm_90a takes warpgroup MMAs from 33 tokens)
        return plan_gemm(tokens, linear(*shape, codebook=codebook), 132, arch=arch, mma="sync").config.warps

    # One 64-token block of mcg: 8 warps on any width; more blocks only on outputs up to EIGHT_WARP_MAX_OUT.
    assert warps(64, (4096, 14336)) == warps(40, (4096, 14336)) == warps(128, (14336, 4096)) == 8
    assert warps(96, (4096, 14336)) == warps(128, (4096, 14336)) == 4
    # At 8 token groups 3inst and mul1 keep 4 (more registers at some K); at 4 groups every codebook takes 8; fewer
    # groups keep 4.
    assert warps(64, (4096, 4096), "3inst") == warps(64, (4096, 4096), "mul1") == 4
    assert warps(32, (4096, 14336), "mul1") == warps(24, (14336, 4096), "3inst") == warps(32, (4096, 4096)) == 8
    assert warps(16, (4096, 4096)) == warps(1, (4096, 4096)) == 4


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("bits", [4.0, 8.0])
def test_one_token_plan_keeps_the_resident_row_in_shared_memory(arch, bits):
    """At M = 1 the GEMM holds its split's row of x in shared memory (doubled for split halves): a wide K with a
    grid that needs no split-K (a vocabulary head) still gets a split that fits the 99 KB per CTA."""
    in_p, out_p = 32768, 132 * 31 * 4 * 16  # one split would fill 31 whole waves: the cheapest without the cap
    plan = plan_gemm(1, linear(in_p, out_p, bits), 132, arch=arch, input="float16")
    cfg = plan.config
    assert cfg.input == "float16" and cfg.resident_k_tiles == plan.k_tiles_per_split <= cfg.max_resident_k_tiles
    assert cfg.smem_bytes <= 99 * 1024 and plan.splits * plan.k_tiles_per_split >= in_p // 16
    assert plan.splits > 1  # the whole K (2048 k-tiles) would not fit


@pytest.mark.parametrize("in_p,out_p,tokens,splits", [(4096, 14336, 256, 1), (4096, 14336, 128, 1),
                                                      (4096, 14336, 64, 2), (14336, 4096, 256, 4),
                                                      (14336, 4096, 128, 4), (14336, 4096, 64, 8)])
def test_warpgroup_mma_splits_fill_most_of_one_wave(in_p, out_p, tokens, splits):
    """The wgmma GEMM's split-K takes the fewest splits whose grid fills 80% of a wave (one or two CTAs an SM):
    the H200's faster plans (targets.WAVE_FILL), where a whole wave would need two or more splits."""
    plan = plan_gemm(tokens, linear(in_p, out_p), 132, arch="sm_90a")
    slots = gemm_resident_ctas("sm_90a", plan.config) * 132
    ctas = out_p // 128 * math.ceil(tokens / plan.config.tokens_per_cta) * plan.splits
    assert plan.config.mma == "wgmma" and plan.splits == splits
    assert wave_fill("sm_90a") * slots <= ctas <= 2 * slots


@pytest.mark.parametrize("in_p,out_p,tokens,splits", [(4096, 14336, 1, 4), (4096, 14336, 16, 4),
                                                      (14336, 4096, 1, 14), (14336, 4096, 16, 14),
                                                      (14336, 4096, 32, 8)])
def test_mma_sync_splits_on_the_h200(in_p, out_p, tokens, splits):
    """The mma.sync GEMM on sm_90a: 85% of a wave in fewer, longer splits (measured faster, targets.WAVE_FILL);
    the same linears on SM120 fill whole waves with more (test_plan_fills_a_wave)."""
    plan = plan_gemm(tokens, linear(in_p, out_p), 132, arch="sm_90a")
    assert plan.config.mma == "sync" and plan.splits == splits


def test_warpgroup_mma_where_the_target_has_it(monkeypatch):
    """sm_90a multiplies 33..WGMMA_MAX_TOKENS rows with warpgroup MMAs (two warpgroups, all the CTA's tokens in
    one MMA, up to 256) and keeps them on the decode GEMM instead of dequantize + cuBLAS; SM120 has none."""
    lin = linear(4096, 14336)
    # X in row order up to 128 tokens per CTA, from 256 in the stages' layout (one bulk copy per stage)
    for tokens, per_cta, order in ((33, 64, "rows"), (64, 64, "rows"), (100, 128, "rows"), (200, 256, "stages"),
                                   (WGMMA_MAX_TOKENS, 256, "stages")):
        cfg = plan_gemm(tokens, lin, 132, arch="sm_90a").config
        assert (cfg.mma, cfg.warps, cfg.tokens_per_cta, cfg.split_halves, cfg.x_order) == (
            "wgmma", 8, per_cta, False, order), tokens
        assert linear_ops.x_rows(tokens, cfg) == (per_cta if order == "stages" else tokens)
    assert plan_gemm(32, lin, 132, arch="sm_90a").config.mma == "sync"
    assert all(plan_gemm(m, lin, 170, arch="sm_120a").config.mma == "sync" for m in (33, 64, 256))
    monkeypatch.setenv("EXL3TOOL_ARCH", "sm_90a")
    monkeypatch.setattr(linear_ops, "sm_count", lambda device: 132)
    # one K split (the whole K in each CTA: 4096x14336 from 65 tokens): the GEMM's epilogue rotates its tiles
    assert [choose_path(m, lin) for m in (32, 33, 64, 65, WGMMA_MAX_TOKENS, WGMMA_MAX_TOKENS + 1, FOLD_MIN_TOKENS)] == [
        "gemm-unfused", "gemm-unfused", "gemm-unfused", "gemm", "gemm", "dequant", "fold"]
    assert choose_path(WGMMA_MAX_TOKENS, linear(14336, 4096)) == "gemm-unfused"  # four splits
    # the fused output rotation: from shared memory where one split covers K, else by the last CTA of a block
    fused = [plan_gemm(WGMMA_MAX_TOKENS, linear(*shape), 132, arch="sm_90a", output="float16")
             for shape in ((4096, 14336), (14336, 4096))]
    assert [(p.config.whole_k, p.splits) for p in fused] == [(True, 1), (False, 4)]
    monkeypatch.setenv("EXL3TOOL_ARCH", "sm_120a")
    assert choose_path(WGMMA_MAX_TOKENS, lin) == "dequant"


def test_early_next_only_around_warpgroup_mma_gemms(monkeypatch):
    """linear.EARLY_NEXT: "input" lets only the input rotation of a warpgroup-MMA linear (M 33..256 on sm_90a)
    start the GEMM early; "all" its GEMM and output rotation too; never at M <= 32 or without warpgroup MMAs."""
    kernels = ("input", "gemm", "output")
    for policy, wanted in (("none", ()), ("input", ("input",)), ("all", kernels)):
        monkeypatch.setattr(linear_ops, "EARLY_NEXT", policy)
        for tokens in (1, 16, 32, 33, 64, 256, 257):
            for arch in ("sm_90a", "sm_120a"):
                on = 33 <= tokens <= 256 and arch == "sm_90a"
                got = [linear_ops.early_next(k, tokens, arch) for k in kernels]
                assert got == [on and k in wanted for k in kernels], (policy, tokens, arch)


def test_one_token_gemm_rotating_its_input_takes_three_stages_on_the_h200():
    """H200: the M = 1 GEMM that rotates its own input pipelines 3 stages (targets.ROTATED_INPUT_STAGES, measured
    faster), with the same splits and 8 CTAs an SM; SM120 keeps 2 stages, and so do other token counts."""
    for shape, splits in (((4096, 14336), 4), ((14336, 4096), 14)):
        plan = plan_gemm(1, linear(*shape), 132, arch="sm_90a", input="float16")
        assert plan.config.stages == 3 and plan.splits == splits
        assert gemm_resident_ctas("sm_90a", plan.config) == 8
        assert plan_gemm(1, linear(*shape), 170, arch="sm_120a", input="float16").config.stages == 2
        assert plan_gemm(8, linear(*shape), 132, arch="sm_90a").config.stages == 2


def test_dense_warpgroup_gemm_takes_up_to_eight_stages():
    """The dense linear's warpgroup-MMA GEMM pipelines targets.DENSE_WGMMA_STAGES (8) where shared memory holds them
    (65-128 tokens; fewer at 256 tokens, 6, its 36 KB stages), with the same splits as at 6 stages; up to 64 tokens
    it takes targets.DENSE_WGMMA_SMALL_LAYOUT (4 stages of 8 k-tiles, rolled), two CTAs an SM, where that gives the
    splits of the 4-k-tile layout. The MoE's 64-row route blocks take that layout too; larger ones keep
    targets.WGMMA_LAYOUT's 6 stages of 4, unrolled."""
    for shape in ((4096, 14336), (14336, 4096)):
        for tokens, stages, k_tiles in ((40, 4, 8), (64, 4, 8), (65, 8, 4), (128, 8, 4), (256, 6, 4)):
            plan = plan_gemm(tokens, linear(*shape), 132, arch="sm_90a")
            six = plan_gemm(tokens, linear(*shape), 132, arch="sm_90a", stages=6, k_tiles_per_stage=4, rolled=False)
            cfg = plan.config
            assert cfg.mma == "wgmma" and (cfg.stages, cfg.k_tiles_per_stage) == (stages, k_tiles), (shape, tokens)
            assert cfg.rolled == (tokens <= 64) and plan.splits == six.splits and cfg.smem_bytes <= 227 * 1024
        assert gemm_resident_ctas("sm_90a", plan_gemm(64, linear(*shape), 132, arch="sm_90a").config) == 2
    # where 8-k-tile stages would split K more coarsely (32 splits of 8 k-tiles -> 16 of 16), the 4-k-tile layout stays
    plan = plan_gemm(64, linear(4096, 1024), 132, arch="sm_90a")
    assert (plan.config.rolled, plan.config.k_tiles_per_stage, plan.splits) == (False, 4, 32)
    # a caller's own stages take the standard layout, not half of the small one
    cfg = plan_gemm(64, linear(4096, 14336), 132, arch="sm_90a", k_tiles_per_stage=4).config
    assert (cfg.rolled, cfg.stages) == (False, 8)
    from exl3tool.ops import moe_configs

    assert moe_configs.gemm_config(4.0, "mcg", 2, 64, wgmma=True).mainloop.rolled  # moe_configs.WGMMA_BLOCK_LAYOUT
    assert not moe_configs.gemm_config(4.0, "mcg", 2, 320, wgmma=True).mainloop.rolled


@pytest.mark.parametrize("arch,sms", [("sm_90a", 132), ("sm_120a", 170)])
def test_one_token_gemm_spreads_its_sum_where_the_splits_exceed_one_warps_loads(arch, sms):
    """M = 1 with the output rotation fused: the last CTA of a block sums it with every warp (``spread_sum``) where
    there are more K splits than one warp loads at once (``SPLITS_IN_FLIGHT``), and not where there are fewer (no
    round trip to save), nor without the fused output or the rotated input."""
    from exl3tool.kernels.rotate import SPLITS_IN_FLIGHT

    for shape in ((4096, 14336), (14336, 4096), (4096, 4096), (8192, 2048), (2048, 8192), (1024, 512)):
        plan = plan_gemm(1, linear(*shape), sms, arch=arch, input="float16", output="float16")
        assert plan.config.spread_sum == (plan.splits > SPLITS_IN_FLIGHT), (shape, plan.splits)
        assert not plan_gemm(1, linear(*shape), sms, arch=arch, input="float16").config.spread_sum
        assert not plan_gemm(1, linear(*shape), sms, arch=arch, output="float16").config.spread_sum
    assert plan_gemm(1, linear(14336, 4096), sms, arch=arch, input="float16", output="float16").config.spread_sum
    assert not plan_gemm(1, linear(4096, 14336), sms, arch=arch, input="float16", output="float16").config.spread_sum


def test_split_halves_up_to_the_planned_token_groups(monkeypatch):
    """``targets.SPLIT_HALVES_MAX_TOKEN_GROUPS`` (1) decides where the split loop, with X doubled, is planned: the
    dense GEMM and the MoE route blocks ask the same function."""
    from exl3tool.ops import targets

    def plan(tokens):
        return plan_gemm(tokens, linear(4096, 14336), 132, arch="sm_90a").config

    assert plan(8).split_halves and plan(8).x_order == "doubled"
    assert not plan(16).split_halves and plan(16).x_order == "fragments"
    assert not targets.split_halves("sm_90a", "mcg", 2, 4.0)
    monkeypatch.setattr(targets, "SPLIT_HALVES_MAX_TOKEN_GROUPS", 2)
    assert plan(16).split_halves and plan(16).x_order == "doubled" and plan(16).token_groups == 2
    assert not plan(32).split_halves
    assert targets.split_halves("sm_90a", "mcg", 2, 4.0) and not targets.split_halves("sm_90a", "mul1", 2, 4.0)


def test_a_stage_that_does_not_divide_k_is_refused():
    """A tuning override of 16 k-tiles a stage on a K of 56 k-tiles (in_p 896) would leave the last split's 8 unread:
    the planner refuses it; the same stage on a K of 64 plans."""
    with pytest.raises(ValueError, match="not a whole number of 16-k-tile stages"):
        plan_gemm(16, linear(896, 4096), 132, arch="sm_120a", k_tiles_per_stage=16)
    plan = plan_gemm(16, linear(1024, 4096), 132, arch="sm_120a", k_tiles_per_stage=16)
    assert plan.config.k_tiles_per_stage == 16 and plan.k_tiles_per_split % 16 == 0
