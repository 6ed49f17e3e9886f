"""Every kernel config the fused MoE plans (``moe_configs.step_configs``, what MoEPlan compiles and launches), on the
CPU, for every arch it targets: SM120 and SM80 plan only mma.sync route blocks, which the H200's GPU tier never runs
past 32 rows (it takes warpgroup MMAs from 64), so their configs are checked here. Each step plans without an error for
every token count up to 4096 and both routing modes; the distinct configs of SM120's steps compile (marker compile)."""

from __future__ import annotations

import itertools

import pytest

from exl3tool.kernels.gemm import SMEM_LIMIT_BYTES
from exl3tool.kernels.moe_rotate import Gating
from exl3tool.kernels.moe_route import MoERouteConfig
from exl3tool.ops import moe_configs
from exl3tool.ops.moe_configs import GroupShape, LayerShape, step_configs
from exl3tool.ops.runtime import compile_with_ptx
from exl3tool.ops.targets import typical_sms

ARCHS = ("sm_120a", "sm_90a", "sm_80")  # planned for each arch's typical GPU (RTX 5090, H200, A100)
TOKENS = [*range(1, 300), *range(300, 4097, 37), 4096]


def group(bits, codebook, intermediate, first=0, w2=None):
    w2_bits, w2_codebook = w2 or (bits, codebook)
    return GroupShape(float(bits), codebook, float(w2_bits), w2_codebook, intermediate, first)


# The layers of tests/gpu/test_moe.py's SYNTHETIC, as the plan sees them (shapes, K, codebooks and routing only).
LAYERS = {
    "qwen3-30b-shape-k4-mcg": LayerShape(MoERouteConfig("softmax_topk", 128, 8), 2048, (group(4, "mcg", 768),)),
    "k2-3inst-16-experts": LayerShape(MoERouteConfig("softmax_topk", 16, 4, normalize=False), 512,
                                      (group(2, "3inst", 256),)),
    "k3.5-mul1-shared-gated": LayerShape(MoERouteConfig("softmax_topk", 8, 2, shared="gated"), 384,
                                         (group(3.5, "mul1", 256), group(3.5, "mul1", 640, first=8))),
    "deepseek-grouped-sigmoid": LayerShape(
        MoERouteConfig("sigmoid_noaux_tc", 32, 6, n_group=4, topk_group=2, correction_bias=True, shared="ungated"),
        256, (group(6, "mcg", 128), group(6, "mcg", 256, first=32))),
    "two-groups-k3-k5": LayerShape(MoERouteConfig("softmax_topk", 12, 3), 256,
                                   (group(5, "mcg", 384, first=-1), group(3, "3inst", 384, first=-1))),
    "hidden-intermediate-4096": LayerShape(MoERouteConfig("softmax_topk", 4, 2), 4096, (group(4, "mul1", 4096),)),
    "minimax-m2-sigmoid-one-group": LayerShape(MoERouteConfig("sigmoid_noaux_tc", 32, 8, correction_bias=True), 256,
                                               (group(4, "mcg", 256),)),
    "qwen3-next-512-experts-top-10": LayerShape(MoERouteConfig("softmax_topk", 512, 10, shared="gated"), 256,
                                                (group(4, "mcg", 128), group(4, "mcg", 256, first=512))),
    "lfm2-moe-expert-bias": LayerShape(MoERouteConfig("sigmoid_noaux_tc", 32, 4, scale=2.5, correction_bias=True), 256,
                                       (group(4, "mcg", 256),)),
}

GPT_OSS_GATING = Gating("swiglu_oai", 7.0, True)
# Published models' MoE layers as the plan sees them (at K=4 mcg): more experts, wider layers and other top-k than the
# GPU tier's synthetic layers. Each plans on every arch; SM120 compiles three of them (``test_sm120_...``).
MODELS = {
    "qwen3-235b-a22b": LayerShape(MoERouteConfig("softmax_topk", 128, 8), 4096, (group(4, "mcg", 1536),)),
    "qwen3-next-80b-a3b": LayerShape(MoERouteConfig("softmax_topk", 512, 10, shared="gated"), 2048,
                                     (group(4, "mcg", 512), group(4, "mcg", 512, first=512))),
    "glm-4.5-air": LayerShape(MoERouteConfig("sigmoid_noaux_tc", 128, 8, correction_bias=True, shared="ungated"),
                              4096, (group(4, "mcg", 1408), group(4, "mcg", 1408, first=128))),
    "deepseek-v3": LayerShape(MoERouteConfig("sigmoid_noaux_tc", 256, 8, scale=2.5, n_group=8, topk_group=4,
                                             correction_bias=True, shared="ungated"),
                              7168, (group(4, "mcg", 2048), group(4, "mcg", 2048, first=256))),
    "mixtral-8x7b": LayerShape(MoERouteConfig("softmax_topk", 8, 2), 4096, (group(4, "mcg", 14336),)),
    # gpt-oss: a bias on the softmax router's logits, biased experts 2880 wide (2944 padded), the clamped SwiGLU
    "gpt-oss-20b": LayerShape(MoERouteConfig("softmax_topk", 32, 4, logit_bias=True), 2944,
                              (GroupShape(4.0, "mcg", 4.0, "mcg", 2944, gating=GPT_OSS_GATING),), down_biased=True),
    "gpt-oss-120b": LayerShape(MoERouteConfig("softmax_topk", 128, 4, logit_bias=True), 2944,
                               (GroupShape(4.0, "mcg", 4.0, "mcg", 2944, gating=GPT_OSS_GATING),), down_biased=True),
    "minimax-m2": LayerShape(MoERouteConfig("sigmoid_noaux_tc", 256, 8, correction_bias=True), 3072,
                             (group(4, "mcg", 1536),)),
    "lfm2-8b-a1b": LayerShape(MoERouteConfig("sigmoid_noaux_tc", 32, 4, correction_bias=True), 2048,
                              (group(4, "mcg", 1792),)),
}


def configs_of(step) -> list:
    """A step's configs in launch order."""
    return [config for _, config in step.kernels()]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [*LAYERS, *MODELS])
@pytest.mark.parametrize("paired", [False, True])
def test_every_step_plans_on_every_arch(name, arch, paired, monkeypatch):
    """Before the fix, SM120 and SM80 planned a fused intermediate and block-ready counters for the mma.sync 128-row
    blocks (shared decode, 4 tile columns a warp), which MoEGemmConfig refuses: the Qwen3-30B layer raised from 2048
    tokens on, the small layers from 256-683."""
    monkeypatch.setattr(moe_configs, "PAIRED_GEMMS", paired)
    d = {**LAYERS, **MODELS}[name]
    for tokens, given, dtype in itertools.product(TOKENS, (False, True), ("float16", "bfloat16")):
        step = step_configs(d, tokens, given, arch, typical_sms(arch), dtype, dtype)
        s = step.shape
        private = all(g.gate_up.warp_cols == 1 for g in step.groups)
        assert not s.ready_counters or private, (tokens, given, dtype)
        # launches: route, per group (input rotation, gate/up, Intermediate, down), the top-k sum
        launches = 1 + (step.topk is not None) + sum(
            (g.rotation is not None) + 1 + (g.intermediate is not None) + 1 for g in step.groups)
        assert launches == 1 + (step.topk is not None) + len(step.groups) * (
            4 - s.fused_intermediate - (step.groups[0].gate_up.input is not None))
        # both GEMMs of a group as one launch wherever the ready counters hand its blocks over (PAIRED_GEMMS)
        pairs = [g.pair is not None for g in step.groups]
        assert pairs == [paired and g.gate_up.ready_signal and g.gate_up.input is None
                         and g.gate_up.warps == g.down.warps for g in step.groups], (tokens, given, dtype)
        assert len(step.kernels()) == launches - sum(pairs)
        for c in configs_of(step):
            assert getattr(c, "smem_bytes", 0) <= SMEM_LIMIT_BYTES or arch == "sm_90a", (tokens, c)


@pytest.mark.parametrize("arch", ARCHS)
def test_gemm_pairs_take_their_halves_and_launch_bounds(arch, monkeypatch):
    """A group's pair is its own gate/up and down configs, with PAIRED_MIN_CTAS_PER_SM's launch bounds for its block
    rows and warps, and takes their place in the launches; with PAIRED_GEMMS off no step pairs."""
    monkeypatch.setattr(moe_configs, "PAIRED_GEMMS", True)
    d = LAYERS["qwen3-30b-shape-k4-mcg"]
    seen = set()
    for tokens in (8, 16, 64, 96, 256, 384):
        step = step_configs(d, tokens, False, arch, typical_sms(arch), "float16", "float16")
        (g,) = step.groups
        assert (g.pair.gate_up, g.pair.down, g.pair.down_splits) == (g.gate_up, g.down, step.shape.splits2), tokens
        bound = moe_configs.PAIRED_MIN_CTAS_PER_SM.get((step.shape.block_rows, g.gate_up.warps), 0)
        assert g.pair.min_ctas_per_sm == bound and g.pair.smem_bytes == max(g.gate_up.smem_bytes, g.down.smem_bytes)
        assert [role for role, _ in step.kernels()] == ["route", "input rotation", "gate/up + down", "top-k sum"]
        seen.add(bound)
    assert len(seen) > 1
    monkeypatch.setattr(moe_configs, "PAIRED_GEMMS", False)
    for tokens in (8, 16, 256):
        step = step_configs(d, tokens, False, arch, typical_sms(arch), "float16", "float16")
        assert step.groups[0].pair is None and "gate/up + down" not in dict(step.kernels())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [*LAYERS, *MODELS])
def test_down_counts_out_behind_its_x_where_it_waits_at_counters(name, arch, monkeypatch):
    """moe_configs.COUNT_OUT_BEHIND_X: exactly the down GEMMs that wait at block-ready counters count out behind
    their first X copies; with the knob off none does."""
    d = {**LAYERS, **MODELS}[name]
    for on in (True, False):
        monkeypatch.setattr(moe_configs, "COUNT_OUT_BEHIND_X", on)
        seen = set()
        for tokens in (1, 2, 4, 16, 33, 256, 1024):
            for g in step_configs(d, tokens, False, arch, typical_sms(arch), "float16", "float16").groups:
                assert g.down.count_out_behind_x == (on and g.down.ready_wait), (tokens, on)
                assert not g.gate_up.count_out_behind_x
                seen.add(g.down.ready_wait)
        assert seen == {True, False}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [*LAYERS, *MODELS])
def test_resident_route_rows_plan_where_the_gate_up_stages_take_them(name, arch, monkeypatch):
    """With RESIDENT_INPUT_TOKENS at 8 (the candidate), every step of 1-8 tokens plans: the gate/up GEMM takes the
    rows where its stages can (``GemmConfig.takes_input``) and they fit, else the input rotation launches. Found on
    the H200 (s51): DeepSeek's 256-wide layer at 4 tokens splits K into 4 k-tiles, and the planner raised instead."""
    monkeypatch.setattr(moe_configs, "RESIDENT_INPUT_TOKENS", 8)
    d = {**LAYERS, **MODELS}[name]
    for tokens in range(1, 9):
        step = step_configs(d, tokens, False, arch, typical_sms(arch), "float16", "float16")
        for g in step.groups:
            resident = g.gate_up.input is not None
            assert (g.rotation is None) == resident, tokens
            if resident:
                assert g.gate_up.resident_rows == tokens and g.gate_up.resident_k_tiles % 8 == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_gpt_oss_steps_gate_and_bias_as_its_layer(arch):
    """Every step of a gpt-oss layer computes its gating where the intermediate is (the Intermediate launch or the
    gate/up GEMM's fused tail, never both), sums with the down biases and routes with the logits' bias; a gate/up
    GEMM without the fused tail compiles as any other layer's (one kernel for both)."""
    d = MODELS["gpt-oss-20b"]
    for tokens in (1, 2, 5, 16, 64, 256, 1024, 4096):
        step = step_configs(d, tokens, False, arch, typical_sms(arch), "float16", "float16")
        (g,) = step.groups
        assert step.route.logit_bias and step.route.method == "softmax_topk"
        sums = [step.topk] if step.topk is not None else [g.down.topk_sum]
        assert all(c.biased for c in sums), tokens
        if g.intermediate is None:
            assert g.gate_up.intermediate_splits and g.gate_up.gating == GPT_OSS_GATING, tokens
        else:
            assert g.intermediate.gating == GPT_OSS_GATING and g.gate_up.gating == Gating(), tokens


def test_sm120_plans_128_row_blocks_with_the_intermediate_launch():
    d = LAYERS["qwen3-30b-shape-k4-mcg"]
    step = step_configs(d, 4096, False, "sm_120a", 170, "float16", "float16")
    (g,) = step.groups
    assert step.shape.block_rows == 128 and g.gate_up.warp_cols == 4 and g.gate_up.mma == "sync"
    assert not step.shape.fused_intermediate and g.intermediate is not None and not g.down.ready_wait
    step = step_configs(d, 1024, False, "sm_120a", 170, "float16", "float16")  # 64-row blocks keep the counters
    assert step.shape.block_rows == 64 and step.shape.ready_counters and step.groups[0].intermediate is None


@pytest.mark.compile
@pytest.mark.parametrize("tokens", [1, 4, 16, 256, 1024, 4096])
def test_sm120_steps_compile(tokens):
    """What an RTX 5090 compiles for the Qwen3-30B layer: every config of the step, within 99 KB of shared memory."""
    from exl3tool.ops.moe_kernels import BUILDERS

    step = step_configs(LAYERS["qwen3-30b-shape-k4-mcg"], tokens, False, "sm_120a", 170, "float16", "float16")
    for config in configs_of(step):
        ptx = compile_with_ptx(lambda options, c=config: BUILDERS[type(c)](c, options), "sm_120a")
        assert ".target sm_120a" in ptx and "wgmma" not in ptx, config
        assert getattr(config, "smem_bytes", 0) <= SMEM_LIMIT_BYTES


@pytest.mark.compile
@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "deepseek-v3", "mixtral-8x7b", "gpt-oss-20b"])
def test_sm120_compiles_published_models(name):
    """What an RTX 5090 compiles for 512 experts at top-10, a 7168-wide layer with group-limited routing, and a
    14336-wide intermediate: every distinct config of four steps, within 99 KB of shared memory."""
    from exl3tool.ops.moe_kernels import BUILDERS

    configs = {c for tokens in (1, 16, 256, 4096)
               for c in configs_of(step_configs(MODELS[name], tokens, False, "sm_120a", 170, "bfloat16", "bfloat16"))}
    for config in configs:
        ptx = compile_with_ptx(lambda options, c=config: BUILDERS[type(c)](c, options), "sm_120a")
        assert ".target sm_120a" in ptx and "wgmma" not in ptx, config
        assert getattr(config, "smem_bytes", 0) <= SMEM_LIMIT_BYTES
