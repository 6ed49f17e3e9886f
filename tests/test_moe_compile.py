"""Compile-only tests of the fused MoE kernels (no GPU): every variant compiles for sm_120a (and sm_90a), its
PTX holds what the design needs (mma.sync in both grouped GEMMs, the arrival counters and shared-memory atomics
of the routing), and every CTA stays within SM120's 99 KB of shared memory."""

import dataclasses
import re

import pytest

from exl3tool.kernels.gemm import SMEM_LIMIT_BYTES, WGMMA_SMEM_LIMIT_BYTES
from exl3tool.kernels.mainloop import weight_copy_count
from exl3tool.kernels.moe_gemm import MoEGemmConfig
from exl3tool.kernels.moe_rotate import Gating, IntermediateConfig, RouteInputRotationConfig, TopKSumConfig
from exl3tool.kernels.moe_route import RESERVED_SMEM_BYTES, STEP_GROUP, WARPS, MoERouteConfig
from exl3tool.kernels.trellis import CODEBOOKS, SUPPORTED_BITS
from exl3tool.ops import moe_configs
from exl3tool.ops import moe_kernels
from exl3tool.ops.moe_configs import gemm_config, x_order
from exl3tool.ops.runtime import compile_with_ptx
from helpers import GLOBAL_ACCESS, PDL_WAIT, assert_early_next, assert_waits_before_global_access

pytestmark = pytest.mark.compile
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
ARRIVAL = "atom.acq_rel.gpu.global.add.u32"  # ptx.count_in: the last CTA found by one acq_rel atomic, no fences
CASES = [(b, cb) for b in SUPPORTED_BITS for cb in CODEBOOKS if b == int(b) or cb == "mul1"]


def ptx_of(config, arch="sm_120a"):
    return compile_with_ptx(lambda options: moe_kernels.BUILDERS[type(config)](config, options), arch)


@pytest.mark.parametrize("planes", [2, 1])
@pytest.mark.parametrize("bits,codebook", CASES)
def test_grouped_gemm_compiles(bits, codebook, planes):
    for block_rows in (8, 64, 128):  # the smallest and largest private-decode blocks, the shared-decode one
        cfg = gemm_config(bits, codebook, planes, block_rows)
        ptx = ptx_of(cfg)
        assert ".target sm_120a" in ptx and ptx.count(MMA) >= cfg.token_groups * cfg.k_tiles_per_stage
        assert "cp.async.cg.shared.global" in ptx and cfg.smem_bytes <= SMEM_LIMIT_BYTES
        assert ("st.shared.v4.b32" in ptx) == (cfg.warp_cols > 1)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("bits,codebook", [(4.0, "mcg"), (2.0, "mul1"), (6.0, "3inst")])
def test_gate_up_gemm_with_the_intermediate_fused(bits, codebook, splits):
    cfg = gemm_config(bits, codebook, 2, 8, intermediate_splits=splits)
    ptx = ptx_of(cfg)
    plain = ptx_of(gemm_config(bits, codebook, 2, 8))
    # the tail: arrival counter (one acq_rel atomic), then the intermediate's three 128-wide rotations and
    # its split sums from L2; the plain GEMM has none of it
    assert ARRIVAL in ptx and "fence.acq_rel.gpu" not in ptx and "ex2.approx" in ptx
    assert ptx.count("shfl.sync.bfly") >= 3 * 5 and ptx.count("ld.global.cg.v4.f32") >= 2 * splits
    assert "atom.global" not in plain and "shfl.sync.bfly" not in plain and ptx.count(MMA) == plain.count(MMA)
    with pytest.raises(ValueError):  # down GEMM, or shared decode: no fused intermediate
        gemm_config(bits, codebook, 1, 8, intermediate_splits=splits)
    with pytest.raises(ValueError):
        gemm_config(bits, codebook, 2, 128, intermediate_splits=splits)


@pytest.mark.parametrize("x_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("splits", [0, 4])
def test_gate_up_gemm_rotating_its_own_input(x_dtype, splits):
    """M = 1: the gate/up GEMM rotates x itself (no activation copies: only weights go through cp.async), with the
    intermediate fused or not; split halves doubles the MMAs and reads the resident row in doubled order (X2, the
    down GEMM's input, keeps the route blocks' order)."""
    plain = gemm_config(4.0, "mcg", 2, 8, intermediate_splits=splits)
    staged = ptx_of(plain)
    for split_halves in (False, True):
        cfg = dataclasses.replace(plain, input=x_dtype, resident_k_tiles=32, split_halves=split_halves)
        assert cfg.mainloop.x_order == ("doubled" if split_halves else plain.x_order) and cfg.x_order == plain.x_order
        ptx = ptx_of(cfg)
        assert ptx.count(MMA) == (2 if split_halves else 1) * staged.count(MMA)
        assert "0x80008000" not in ptx  # no B word doubled in the loop (trellis.doubled_b's -0.0 adds)
        # the prologue: two rotations (gate or up suh), 5 shuffles per value of a lane's 4; the fused tail's 3
        assert ptx.count("shfl.sync.bfly") == 2 * 5 * 4 + (3 * 5 * 4 if splits else 0)
        assert ptx.count("cp.async.cg.shared.global") < staged.count("cp.async.cg.shared.global")
        assert cfg.smem_bytes < plain.smem_bytes
    with pytest.raises(ValueError):  # the down GEMM's input is the intermediate: no prologue
        dataclasses.replace(gemm_config(4.0, "mcg", 1, 8), input=x_dtype, resident_k_tiles=32)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("rows", [2, 4])
def test_gate_up_gemm_rotating_its_route_blocks_rows(arch, rows):
    """A few tokens (MoEGemmConfig.resident_rows): the gate/up GEMM finds its block's routes (by their experts and
    ranks) and rotates each one's x into its own padded row of shared memory, with the same main loop as one
    resident row: the same MMAs and copies (weights only), the rows' shared memory on top, no spills, a rotation
    per row, and the fused intermediate for every packed row with a route."""
    one = gemm_config(4.0, "mcg", 2, 8, False, rows, split_halves=True, x2_order="doubled",
                      intermediate_splits=3, ready_signal=rows == 4)  # M = 4: 8 warps and ready counters
    one = dataclasses.replace(one, input="float16", resident_k_tiles=48)
    cfg = dataclasses.replace(one, resident_rows=rows)
    assert cfg.mainloop.x_smem_words == rows * (48 * 16 + 16)  # doubled rows, 16-word padding between them
    assert cfg.smem_bytes - one.smem_bytes == 4 * (cfg.mainloop.x_smem_words - one.mainloop.x_smem_words) + 4 * 8
    ptx, base = ptx_of(cfg, arch), ptx_of(one, arch)
    assert ptx.count(MMA) == base.count(MMA) and "cp.async.cg.shared.global" in ptx
    assert ptx.count("cp.async.cg.shared.global") == base.count("cp.async.cg.shared.global")
    # the prologue's two rotations (gate or up suh) a row; the fused tail's, once a row a warp (one row: warp 0's)
    prologue = 2 * 5 * 4
    tail = base.count("shfl.sync.bfly") - prologue
    assert ptx.count("shfl.sync.bfly") == rows * prologue + (8 // cfg.warps) * tail
    from exl3tool.sass import gemm_report
    kernel = gemm_report(cfg, arch)
    assert kernel.frame_bytes == 0 and kernel.spill_instructions == 0
    with pytest.raises(ValueError):  # rows of x need input; 8 rows at most (one token group)
        dataclasses.replace(one, input=None, resident_k_tiles=0, resident_rows=2)
    with pytest.raises(ValueError):
        dataclasses.replace(one, resident_rows=9)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("rows,resident", [(32, 0), (64, 0), (8, 2)])
def test_fused_intermediate_in_row_pairs(arch, rows, resident):
    """MoEGemmConfig.tail_row_pairs: the fused intermediate takes a warp's rows two at a time (8 values a lane, a row
    a half-warp): the same main loop (MMAs, weight copies), 4 butterfly exchanges a value instead of 5 (a pair's
    3 rotations: 3 x 8 x 4 shuffles, against 2 x 3 x 4 x 5 for its rows one by one), no spills; only for an even
    number of rows a warp with the fused intermediate."""
    base = gemm_config(4.0, "mcg", 2, rows, False, resident, intermediate_splits=1 if not resident else 3,
                       **(dict(split_halves=True, x2_order="doubled") if resident else {}))
    if resident:
        base = dataclasses.replace(base, input="float16", resident_k_tiles=48, resident_rows=resident)
    pairs = dataclasses.replace(base, tail_row_pairs=True)
    assert base.tail_rows_per_warp % 2 == 0
    ptx, plain = ptx_of(pairs, arch), ptx_of(base, arch)
    assert ptx.count(MMA) == plain.count(MMA)
    assert ptx.count("cp.async.cg.shared.global") == plain.count("cp.async.cg.shared.global")
    per_warp = base.tail_rows_per_warp
    assert plain.count("shfl.sync.bfly") - ptx.count("shfl.sync.bfly") == per_warp * 3 * 4 * 5 - per_warp // 2 * 96
    from exl3tool.sass import gemm_report
    kernel = gemm_report(pairs, arch)
    assert kernel.frame_bytes == 0 and kernel.spill_instructions == 0
    with pytest.raises(ValueError):  # one row a warp: 8-row blocks at 8 warps
        dataclasses.replace(gemm_config(4.0, "mcg", 2, 8, False, 16, intermediate_splits=1), tail_row_pairs=True)
    with pytest.raises(ValueError):  # no fused intermediate
        dataclasses.replace(gemm_config(4.0, "mcg", 2, rows), tail_row_pairs=True)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_down_counts_out_behind_its_first_x_copies(arch, monkeypatch):
    """MoEGemmConfig.count_out_behind_x: the down GEMM's count-out atomic comes behind its first X copies instead of
    inside its wait (one atomic either way), with the same MMAs and copies, no spills; only a down GEMM that waits at
    block-ready counters takes it."""
    monkeypatch.setattr(moe_configs, "COUNT_OUT_BEHIND_X", True)
    layer = moe_configs.LayerShape(MoERouteConfig("softmax_topk", 128, 8), 2048,
                                   (moe_configs.GroupShape(4.0, "mcg", 4.0, "mcg", 768),))
    down = moe_configs.step_configs(layer, 16, False, arch, 132, "float16", "float16").groups[0].down
    assert down.count_out_behind_x and down.ready_wait
    ptx, plain = ptx_of(down, arch), ptx_of(dataclasses.replace(down, count_out_behind_x=False), arch)
    assert ptx.count(MMA) == plain.count(MMA) > 0
    assert ptx.count("cp.async.cg.shared.global") == plain.count("cp.async.cg.shared.global")
    atomic = "atom.global.add.u32"
    assert ptx.count(atomic) == plain.count(atomic) == 1, atomic
    # behind the first X copies' commit here; before it (inside the wait) without the knob
    first_commit = "cp.async.commit_group"
    assert ptx.index(atomic) > ptx.index(first_commit) and plain.index(atomic) < plain.index(first_commit)
    from exl3tool.sass import gemm_report
    kernel = gemm_report(down, arch)
    assert kernel.frame_bytes == 0 and kernel.spill_instructions == 0
    with pytest.raises(ValueError):
        dataclasses.replace(down, ready_wait=False)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_splits_in_x_take_the_split_from_the_column_index(arch):
    """MoEGemmConfig.splits_in_x (the M=1 GEMMs, 4 and 3 K splits): the column block is the grid x's quotient by the
    split count, the split its remainder (one integer division more, behind the block index's first read), the MMAs
    and copies those of splits in z."""
    layer = moe_configs.LayerShape(MoERouteConfig("softmax_topk", 128, 8), 2048,
                                   (moe_configs.GroupShape(4.0, "mcg", 4.0, "mcg", 768),))
    group = moe_configs.step_configs(layer, 1, False, arch, 132, "float16", "float16").groups[0]
    for cfg in (group.gate_up, group.down):
        assert cfg.splits_in_x
        ptx, plain = ptx_of(cfg, arch), ptx_of(dataclasses.replace(cfg, splits_in_x=False), arch)
        assert ptx.count(MMA) == plain.count(MMA) > 0
        assert ptx.count("cp.async.cg.shared.global") == plain.count("cp.async.cg.shared.global")
        divisions = lambda text: len(re.findall(r"\bdiv\.[su]32", text.split("ctaid.x")[1]))  # noqa: E731
        assert divisions(ptx) == divisions(plain) + 1


@pytest.mark.parametrize("planes,splits", [(2, 0), (2, 3), (1, 0)])
def test_split_halves_gemms_read_doubled_inputs(planes, splits):
    """8-row blocks with split halves: two MMAs per tile, B words loaded doubled (no doubling in the loop); the
    fused intermediate writes X2 doubled for the down GEMM (four 4-byte stores of (v, v) per lane and block)."""
    plain = gemm_config(4.0, "mcg", planes, 8, intermediate_splits=splits)
    split = gemm_config(4.0, "mcg", planes, 8, split_halves=True, x2_order="doubled", intermediate_splits=splits)
    assert split.x_order == "doubled" and plain.x_order == "rows"
    ptx, base = ptx_of(split), ptx_of(plain)
    assert ptx.count(MMA) == 2 * base.count(MMA) and "0x80008000" not in ptx
    assert ptx.count("ld.shared.v4.b32") > base.count("ld.shared.v4.b32")  # one 16-byte B load per k-tile


@pytest.mark.parametrize("routes,out_dtype,splits", [(8, "float16", 3), (9, "bfloat16", 1), (33, "float32", 2)])
@pytest.mark.parametrize("bits,codebook", [(4.0, "mcg"), (2.0, "mul1")])
def test_down_gemm_with_the_topk_sum_fused(bits, codebook, routes, out_dtype, splits):
    """M = 1: the down GEMM's last CTA per 128 columns does the top-k sum (arrival counter, the sum's one 128-wide
    rotation per slot and its split sums from L2), its slot terms in the idle weight stages where they fit."""
    plain = gemm_config(bits, codebook, 1, 8)
    cfg = dataclasses.replace(plain, topk_sum=TopKSumConfig(routes, out_dtype, splits))
    ptx, plain_ptx = ptx_of(cfg), ptx_of(plain)
    assert ARRIVAL in ptx and "fence.acq_rel.gpu" not in ptx and "atom." not in plain_ptx
    per_warp = -(-routes // cfg.warps)  # a warp's slots, unrolled: their loads issued before the first butterfly
    assert ptx.count("shfl.sync.bfly") == 5 * 4 * per_warp and ptx.count("ld.global.cg.v4.f32") == splits * per_warp
    assert ptx.count(MMA) == plain_ptx.count(MMA) and cfg.smem_bytes <= SMEM_LIMIT_BYTES
    stage_words = plain.mainloop.stages * plain.mainloop.w_stage_words
    assert cfg.extra_term_words == (128 * routes if 128 * routes > stage_words else 0)
    assert cfg.smem_bytes == plain.smem_bytes + 4 * cfg.extra_term_words
    for wrong in (dict(planes=2), dict(token_groups=2)):  # gate/up, or more than one token group
        with pytest.raises(ValueError):
            dataclasses.replace(cfg, **wrong)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_80"])
@pytest.mark.parametrize("config", [MoERouteConfig("softmax_topk", 128, 8), RouteInputRotationConfig("float16", 8, 1),
                                    MoEGemmConfig(4.0, "mcg", 2, token_groups=4), IntermediateConfig(2),
                                    TopKSumConfig(8, "float16", 1)], ids=lambda c: type(c).__name__)
def test_moe_kernels_wait_for_the_kernel_before_them_under_pdl(config, arch):
    """Every MoE launch waits for the kernel before it under PDL (``helpers``: the rule and its check)."""
    assert_waits_before_global_access(ptx_of(config, arch), arch)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_grouped_gemm_other_archs(arch):
    assert MMA in ptx_of(MoEGemmConfig(4.0, "mcg", 2, token_groups=2), arch)


@pytest.mark.parametrize("config", [
    MoERouteConfig("softmax_topk", 128, 8),
    MoERouteConfig("softmax_topk", 128, 8, expert_tile=32, token_tile=32),
    MoERouteConfig("softmax_topk", 60, 4, normalize=False, shared="gated", x_dtype="bfloat16"),
    MoERouteConfig("sigmoid_noaux_tc", 256, 8, scale=2.5, n_group=8, topk_group=4, correction_bias=True,
                   shared="ungated"),
    MoERouteConfig("sigmoid_noaux_tc", 16, 2, n_group=1, correction_bias=False),
    MoERouteConfig("given", 128, 8, shared="gated"),
], ids=str)
def test_route_compiles(config):
    ptx = ptx_of(config)
    # logits on the tensor cores -> top-k in the last CTA of a token block (ranks from global atomics, or from
    # shared-memory ones when the batch is one token block) -> packing in the last block: acq_rel counters, atomics
    mma = "mma.sync.aligned.m16n8k16.row.col.f32." + ("f16.f16" if config.x_dtype == "float16" else "bf16.bf16")
    assert mma in ptx and ARRIVAL in ptx and "atom.global.add.u32" in ptx
    # one shared-memory atomic per token of a warp (its lanes take their routes' ranks at once)
    assert ptx.count("atom.shared.add.u32") == -(-config.token_tile // WARPS)
    if config.method != "given":  # two redux.sync per chosen expert
        assert ptx.count("redux.sync") >= 2 * config.top_k
    # router and activations reach the MMAs through shared memory only: 16-byte copies, 8-byte ones for the rows
    # of a hidden size that is not a multiple of 8
    assert "cp.async.cg.shared.global" in ptx and "cp.async.ca.shared.global" in ptx and "ld.global.v2" not in ptx


@pytest.mark.parametrize("experts,shared", [(16, "none"), (128, "none"), (256, "gated"), (1024, "gated")])
def test_route_staging_fits_every_tile(experts, shared):
    for expert_tile in (16, 32):
        for token_tile in (8, 16, 32):
            cfg = MoERouteConfig("softmax_topk", experts, 8, shared=shared, expert_tile=expert_tile,
                                 token_tile=token_tile)
            size, stages = cfg.staging
            assert STEP_GROUP % size == 0 and stages >= 2
            assert cfg.smem_bytes + RESERVED_SMEM_BYTES <= SMEM_LIMIT_BYTES
            assert 4 * expert_tile * token_tile <= cfg.ring_bytes  # a warp's partial tile fits in its ring
    if experts <= 256:  # decode tiles: a warp's whole slice of hidden 2048 in flight at once
        size, stages = MoERouteConfig("softmax_topk", experts, 8, shared=shared).staging
        assert size * stages >= 2048 // 16 // WARPS


def test_route_sass_issues_every_stage_before_the_first_mma():
    from exl3tool import sass

    cfg = MoERouteConfig("softmax_topk", 128, 8)
    (k,) = sass.analyze_cubin(sass.compile_cubin(lambda o: moe_kernels.BUILDERS[MoERouteConfig](cfg, o), "sm_90a"))
    assert k.frame_bytes == 0 and k.spill_instructions == 0 and k.static_smem_bytes == RESERVED_SMEM_BYTES
    first_mma = next(i for i, ins in enumerate(k.instructions) if ins.root == "HMMA")
    before = k.instructions[:first_mma]
    size, stages = cfg.staging
    copies = (cfg.expert_tile + cfg.token_tile) * size // 16  # 16-byte copies per lane per stage
    assert sum(i.root == "LDGSTS" and i.opcode.endswith(".128") for i in before) >= stages * copies
    assert sum(i.root == "LDGDEPBAR" for i in before) >= stages and not any(i.root == "LDG" for i in before)


@pytest.mark.parametrize("config", [RouteInputRotationConfig("float16", 8), RouteInputRotationConfig("bfloat16", 9),
                                    RouteInputRotationConfig("float16", 8, 8), RouteInputRotationConfig("bfloat16", 9, 9),
                                    RouteInputRotationConfig("float16", 8, 1, "fragments"),
                                    RouteInputRotationConfig("bfloat16", 8, 1, "doubled"),
                                    RouteInputRotationConfig("float16", 9, 4, "fragments", 8),
                                    RouteInputRotationConfig("float16", 8, 4, "rows", 8),
                                    RouteInputRotationConfig("float16", 8, 4, "stages", 8),
                                    RouteInputRotationConfig("bfloat16", 3, 1, "stages"),
                                    IntermediateConfig(1), IntermediateConfig(4), IntermediateConfig(2, "fragments"),
                                    IntermediateConfig(1, "stages", 2, 8),
                                    IntermediateConfig(1, "doubled"), IntermediateConfig(1, "rows", 2, 8),
                                    IntermediateConfig(2, "fragments", 4, 8),
                                    IntermediateConfig(1, "stages", 6, 8, 320, "float16", by_route=True),
                                    IntermediateConfig(1, "stages", 6, 8, 320, "float16", by_route=True, group_first=0),
                                    IntermediateConfig(1, "rows", 2, 8, group_first=8),
                                    RouteInputRotationConfig("float16", 9, 4, "fragments", 8, group_first=128),
                                    TopKSumConfig(8, "float16", 1, 4, "float16", svh_by_expert=True),
                                    TopKSumConfig(8, "float16", 3),
                                    TopKSumConfig(9, "bfloat16", 1), TopKSumConfig(3, "float32", 16),
                                    TopKSumConfig(9, "float16", 2, 4), TopKSumConfig(33, "bfloat16", 1, 4),
                                    TopKSumConfig(8, "float16", 1, 2)], ids=str)
def test_rotations_compile(config):
    ptx = ptx_of(config)
    assert ptx.count("shfl.sync.bfly") >= 5 * 4
    if getattr(config, "x_order", "rows") in ("fragments", "doubled"):  # 4-byte stores: column pairs apart, or
        assert "st.global.u32" in ptx and "st.global.v2.b32" not in ptx  # each value doubled
    else:  # 8-byte (4 16-bit values), 16-byte (8 of them) or 16-byte (4 fp32 outputs) vector stores
        assert any(op in ptx for op in ("st.global.v2.b32", "st.global.v4.b32", "st.global.v4.f32"))
    assert "st.global.b16" not in ptx and "st.global.u16" not in ptx


def assert_first_weights_before_wait(cfg, plain):
    """``weights_before_wait``: before the PDL wait the CTA reads only its block's expert and group row and issues
    only the weight copies of the stages ahead (X, every store and any arrival counter after it); every path waits,
    an unused block's CTA too; the MMAs are those of ``plain``, the GEMM that waits first (without a fused tail)."""
    main = cfg.mainloop
    body = ptx_of(cfg, "sm_90a")
    body = body[body.index(".entry"):]
    before = body[: body.index(PDL_WAIT)]
    assert [m.group(0) for m in GLOBAL_ACCESS.finditer(before)] == ["ld.global"] * 2
    w_copies = weight_copy_count(main, 32 * main.warps) * (main.stages - 1)
    assert before.count("cp.async.cg.shared.global") == w_copies > 0
    assert body.count(PDL_WAIT) == 2 and body.count("cp.async.cg.shared.global") > w_copies
    assert "griddepcontrol" not in ptx_of(cfg, "sm_80")  # no PDL there: nothing to wait for
    assert ptx_of(plain, "sm_90a").count(MMA) == body.count(MMA) > 0


@pytest.mark.parametrize("topk", [None, TopKSumConfig(8, "float16", 3)], ids=["plain", "topk-sum"])
@pytest.mark.parametrize("split", [False, True])
def test_down_gemm_issues_its_first_weights_before_its_wait(split, topk):
    """The down GEMM behind a gate/up GEMM that does the intermediate (moe_configs.EARLY_DOWN_WEIGHTS), with or without
    the fused top-k sum."""
    plain = gemm_config(4.0, "mcg", 1, 8, split_halves=split)
    assert_first_weights_before_wait(dataclasses.replace(plain, weights_before_wait=True, topk_sum=topk), plain)


@pytest.mark.parametrize("rows,split", [(8, True), (32, False)])
def test_gate_up_gemm_issues_its_first_weights_before_its_wait(rows, split):
    """The gate/up GEMM behind an input rotation with ``early_next`` (moe_configs.EARLY_GATE_UP_WEIGHTS_MIN_TOKENS)."""
    plain = gemm_config(4.0, "mcg", 2, rows, split_halves=split)
    assert_first_weights_before_wait(dataclasses.replace(plain, weights_before_wait=True), plain)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_input_rotation_lets_the_gate_up_gemm_launch_right_after_its_wait(arch):
    """``RouteInputRotationConfig.early_next``: one griddepcontrol.launch_dependents right after the wait, before any
    global access; none without it, none on SM80."""
    for early in (False, True):
        assert_early_next(ptx_of(RouteInputRotationConfig("float16", 8, early_next=early), arch), early, arch)


def test_gate_up_gemm_lets_the_down_gemm_launch_before_its_fused_tail():
    """``next_after_loop``: each CTA triggers the next launch after its partials' stores, before it counts in for
    the fused intermediate (whose last CTA's tail the down GEMM's weight loads then overlap)."""
    cfg = gemm_config(4.0, "mcg", 2, 8, split_halves=True, intermediate_splits=4, next_after_loop=True)
    body = ptx_of(cfg, "sm_90a")
    trigger = body.index("griddepcontrol.launch_dependents")
    assert body.count("griddepcontrol.launch_dependents") == 1 and body.index(PDL_WAIT) < trigger
    assert body.rindex("st.global.b32", 0, body.index(ARRIVAL)) < trigger < body.index(ARRIVAL)
    assert "launch_dependents" not in ptx_of(dataclasses.replace(cfg, next_after_loop=False), "sm_90a")


@pytest.mark.parametrize("rows", [8, 32])
def test_block_ready_counters_replace_the_grid_wide_wait_between_gate_up_and_down(rows):
    """``ready_signal`` / ``ready_wait``: gate/up triggers the down launch before anything else and, in the fused
    intermediate's last CTA, adds one to its block's ready counter after X2 (a release atomic after the counter's
    reset); down issues its first weights, spins on the counter with acquire loads and a back-off, counts itself out
    (the last reader zeroes it), then copies X, and waits for the kernel before only after its partials. The MMAs
    are those of the grid-wide wait."""
    split = rows == 8
    up = gemm_config(4.0, "mcg", 2, rows, split_halves=split, intermediate_splits=1, ready_signal=True,
                     x2_order=x_order(rows, split))
    body = ptx_of(up, "sm_90a")
    body = body[body.index(".entry"):]
    assert body.count("griddepcontrol.launch_dependents") == 1
    assert body.index("griddepcontrol.launch_dependents") < min(body.index(PDL_WAIT), body.index("ld.global"))
    assert body.count(ARRIVAL) == 2 and body.rindex("st.global.u32") < body.rindex(ARRIVAL)
    assert body.count(MMA) == ptx_of(replace_ready(up, False), "sm_90a").count(MMA)

    down = gemm_config(4.0, "mcg", 1, rows, split_halves=split, ready_wait=True)
    body = ptx_of(down, "sm_90a")
    body = body[body.index(".entry"):]
    spin = body.index("ld.acquire.gpu.global.u32")
    assert "launch_dependents" not in body and body.count(PDL_WAIT) == 1 and "nanosleep.u32" in body
    assert body.index("cp.async.cg.shared.global") < spin < body.index("atom.global.add.u32")
    assert body.rindex("st.global.b32") < body.index(PDL_WAIT)  # the partials, then the wait
    assert body.count(MMA) == ptx_of(replace_ready(down, False), "sm_90a").count(MMA)
    with pytest.raises(ValueError):  # the signal comes from the fused intermediate's last CTA
        gemm_config(4.0, "mcg", 2, rows, split_halves=split, ready_signal=True)
    with pytest.raises(ValueError):  # down waits for its counter, not for the kernel before
        gemm_config(4.0, "mcg", 1, rows, split_halves=split, ready_wait=True, weights_before_wait=True)


@pytest.mark.parametrize("rows,arch", [(8, "sm_90a"), (32, "sm_90a"), (8, "sm_120a")])
def test_gemm_pair_is_both_gemms_in_one_grid(rows, arch):
    """``MoEGemmPair``: one kernel with gate/up's and down's code (their MMAs, counters and waits, each once), no
    CTA letting the next launch go early unless ``early_next`` (then each first), and the launch's shared memory
    that of the larger half, not the two added (the halves' allocations merged)."""
    from exl3tool.kernels.moe_gemm_pair import MoEGemmPairConfig
    from exl3tool.kernels.ptx import compiling_for
    from exl3tool.ops.runtime import COMPILE_OPTIONS

    split = rows == 8
    up = gemm_config(4.0, "mcg", 2, rows, split_halves=split, intermediate_splits=1, ready_signal=True,
                     x2_order=x_order(rows, split), smem_pad=4096)  # the larger half
    down = gemm_config(4.0, "mcg", 1, rows, split_halves=split, ready_wait=True)
    pair = MoEGemmPairConfig(up, down)
    assert pair.smem_bytes == up.smem_bytes > down.smem_bytes
    body = ptx_of(pair, arch)
    body = body[body.index(".entry"):]
    assert body.count(MMA) == ptx_of(up, arch).count(MMA) + ptx_of(down, arch).count(MMA)
    assert "launch_dependents" not in body and body.count(PDL_WAIT) == 2  # gate/up's first, down's at its end
    assert body.count("ld.acquire.gpu.global.u32") >= 1 and body.count(ARRIVAL) == 2
    with compiling_for(arch):  # the launch's shared memory, in the host code
        host = str(moe_kernels.build_gemm_pair(pair, f"{COMPILE_OPTIONS} --gpu-arch={arch}").ir_module)
    assert f"llvm.mlir.constant({pair.smem_bytes} : i64)" in host
    assert f"llvm.mlir.constant({up.smem_bytes + down.smem_bytes} : i64)" not in host
    split = ptx_of(MoEGemmPairConfig(up, down, down_splits=2), arch)  # a down K split's index arithmetic
    assert split.count(MMA) == body.count(MMA) and "launch_dependents" not in split
    early = ptx_of(MoEGemmPairConfig(up, down, early_next=True), arch)  # every CTA triggers first
    early = early[early.index(".entry"):]
    assert early.count("griddepcontrol.launch_dependents") == 1
    assert early.index("griddepcontrol.launch_dependents") < min(early.index(PDL_WAIT), early.index("ld.global"))
    with pytest.raises(ValueError):  # down waits for the kernel before, not for its blocks' counters
        MoEGemmPairConfig(up, replace_ready(down, False))
    with pytest.raises(ValueError):  # different threads
        MoEGemmPairConfig(up, dataclasses.replace(down, warps=down.warps // 2))


def test_block_ready_counters_with_the_one_token_gemms():
    """At M = 1 (if moe_configs.READY_COUNTERS_MIN_TOKENS allows) the counters join the gate/up GEMM that rotates its
    own input and the down GEMM that does the top-k sum: gate/up, launched right behind the route, triggers the down
    launch once its wait for the route is over (down reads the route's block table before its own counter) and before
    any load; down spins on its block's counter before its X copies, its top-k sum counts in at its own counters
    (``mSumCounter``), and it waits for the kernel before at its end. The MMAs are those without the counters."""
    up = dataclasses.replace(gemm_config(4.0, "mcg", 2, 8, split_halves=True, intermediate_splits=4,
                                         x2_order="doubled"), input="float16", resident_k_tiles=32)
    body = ptx_of(replace_ready(up, True), "sm_90a")
    body = body[body.index(".entry"):]
    assert body.index(PDL_WAIT) < body.index("griddepcontrol.launch_dependents") < body.index("ld.global")
    assert body.count(ARRIVAL) == 2 and body.count(MMA) == ptx_of(up, "sm_90a").count(MMA)

    down = dataclasses.replace(gemm_config(4.0, "mcg", 1, 8, split_halves=True),
                               topk_sum=TopKSumConfig(8, "float16", 3))
    body = ptx_of(replace_ready(down, True), "sm_90a")
    body = body[body.index(".entry"):]
    spin = body.index("ld.acquire.gpu.global.u32")
    assert spin < body.index(ARRIVAL) < body.rindex(PDL_WAIT) and body.count(PDL_WAIT) == 1
    assert body.count(MMA) == ptx_of(down, "sm_90a").count(MMA)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("planes", [2, 1])
def test_sixteen_k_tile_stages_of_eight_warp_route_blocks(arch, planes):
    """The unsplit GEMMs of 8-warp 8-row route blocks on sm_90 (moe_configs.UNSPLIT_SYNC_PIPELINES): 2 stages of 16
    k-tiles, gate/up with its fused intermediate and ready signal, down with its wait. Against 3 stages of 8: the same
    MMAs a k-tile, fewer CTA barriers a weight, within 99 KB and four CTAs' shared memory an SM; on sm_90a no spills, at
    most 64 registers (four CTAs of 256 threads an SM, as at 3 of 8) and no more SASS a weight."""
    from exl3tool import sass
    from exl3tool.kernels.trellis import mmas_per_tile

    fields = (dict(intermediate_splits=1, ready_signal=True, x2_order=x_order(8, True)) if planes == 2
              else dict(ready_wait=True))
    sixteen = gemm_config(4.0, "mcg", planes, 8, tokens=16, split_halves=True,
                          **moe_configs.sync_pipeline("sm_90a", 8, 8, False, 1, 128), **fields)
    eight = dataclasses.replace(sixteen, stages=3, k_tiles_per_stage=8)
    assert (sixteen.warps, sixteen.stages, sixteen.k_tiles_per_stage) == (8, 2, 16)
    assert sixteen.smem_bytes <= SMEM_LIMIT_BYTES and 4 * (sixteen.smem_bytes + 1024) <= 228 * 1024  # 1 KB: driver's
    new, old = sass.gemm_report(sixteen, arch), sass.gemm_report(eight, arch)
    assert new.main_loop.mmas == 2 * 16 * mmas_per_tile(True) and old.main_loop.mmas == 3 * 8 * mmas_per_tile(True)

    def barriers(report):
        return report.main_loop.by_opcode.get("BAR", 0) / report.loop_weights

    assert 0 < barriers(new) < barriers(old)
    if arch == "sm_90a":
        assert new.spill_instructions == 0 and new.registers <= 64 and new.per_weight <= old.per_weight


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("codebook", ["mcg", "3inst"])
@pytest.mark.parametrize("rows", moe_configs.EIGHT_WARP_SMALL_BLOCK_ROWS)
def test_eight_warp_small_blocks_from_fourteen_tokens(arch, codebook, rows):
    """From moe_configs.EIGHT_WARP_SMALL_BLOCK_MIN_TOKENS the 8- and 16-row route blocks take 8 warps a CTA (twice its
    columns; each warp's loop unchanged): gate/up with the fused intermediate and its block-ready signal, down
    waiting for it, within SM120's shared memory, with the 4-warp kernels' MMAs a warp."""
    split = rows == 8  # one token group splits each weight's halves (targets.SPLIT_HALVES_MAX_TOKEN_GROUPS)
    stages = {"stages": 3} if arch == "sm_90a" and rows == 8 else {}
    assert_eight_warps_keep_the_mmas(arch, codebook, rows, moe_configs.EIGHT_WARP_SMALL_BLOCK_MIN_TOKENS, split, 1,
                                     **stages)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_eight_warp_small_blocks_at_listed_token_counts_with_split_k(arch):
    """At the token counts in moe_configs.EIGHT_WARP_SMALL_BLOCK_TOKENS (M = 4) the 8-row blocks' 8-warp GEMMs split K:
    gate/up sums three splits in its fused intermediate and signals block readiness, down waits for it, both with
    split halves and 2 stages, within SM120's shared memory and with the 4-warp kernels' MMAs a warp."""
    eights = assert_eight_warps_keep_the_mmas(arch, "mcg", 8, moe_configs.EIGHT_WARP_SMALL_BLOCK_TOKENS[0], True, 3)
    assert [c.stages for c in eights] == [2, 2]


def assert_eight_warps_keep_the_mmas(arch, codebook, rows, tokens, split, intermediate_splits, **stages) -> list:
    """The gate/up (fused intermediate, ready signal) and down (ready wait) GEMMs of ``rows``-row blocks take 8 warps
    at ``tokens`` and 4 a token fewer, fit the shared memory and keep the 4-warp kernels' MMAs a warp; returns the
    8-warp configs."""
    eights = []
    for planes, fields in ((2, dict(intermediate_splits=intermediate_splits, ready_signal=True,
                                    x2_order=x_order(rows, split))),
                           (1, dict(ready_wait=True))):
        four, eight = (gemm_config(4.0, codebook, planes, rows, split_halves=split, tokens=m, **stages, **fields)
                       for m in (tokens - 1, tokens))
        assert (four.warps, eight.warps) == (4, 8) and eight.smem_bytes <= SMEM_LIMIT_BYTES
        assert ptx_of(eight, arch).count(MMA) == ptx_of(four, arch).count(MMA)
        eights.append(eight)
    return eights


def replace_ready(cfg, on: bool):
    return dataclasses.replace(cfg, ready_signal=on and cfg.planes == 2, ready_wait=on and cfg.planes == 1)


@pytest.mark.parametrize("planes", [2, 1])
def test_contiguous_groups_find_a_blocks_row_without_a_lookup(planes):
    """``group_first`` (a group of consecutive expert ids): a block's row in the group is its expert minus the first
    id, so the GEMM reads one int (the block's expert) before its first weight copies instead of two (its expert,
    then group_row there); the main loop is the same."""
    base = gemm_config(4.0, "mcg", planes, 8)
    mmas = None
    for first, loads in ((-1, 2), (0, 1), (128, 1)):
        body = ptx_of(dataclasses.replace(base, group_first=first), "sm_90a")
        body = body[body.index(".entry"):]
        before = body[: body.index("cp.async.cg.shared.global")]
        assert len(GLOBAL_ACCESS.findall(before)) == loads, first
        assert mmas is None or body.count(MMA) == mmas
        mmas = body.count(MMA)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_route_lets_the_next_kernel_launch_right_after_its_wait(arch):
    """``MoERouteConfig.early_next`` (decode: the gate/up GEMM's or the input rotation's CTAs resident when the
    route ends): one griddepcontrol.launch_dependents right after the wait, before any global access; none without
    it, none on SM80."""
    for early in (False, True):
        assert_early_next(ptx_of(MoERouteConfig("softmax_topk", 128, 8, early_next=early), arch), early, arch)


def test_configs_refuse_what_the_kernels_cannot_do():
    with pytest.raises(ValueError):
        MoEGemmConfig(4.0, "mcg", 3)
    with pytest.raises(ValueError):
        MoERouteConfig("softmax_topk", 8, 9)
    with pytest.raises(ValueError):
        MoERouteConfig("sigmoid_noaux_tc", 10, 2, n_group=4)
    with pytest.raises(ValueError):
        MoERouteConfig("softmax_topk", 128, 8, token_tile=64)
    with pytest.raises(ValueError):
        IntermediateConfig(1, "rows", 3, 8)  # 8 values a lane take two blocks at a time
    with pytest.raises(ValueError):  # weights before the wait: X staged, mma.sync
        MoEGemmConfig(4.0, "mcg", 2, input="float16", resident_k_tiles=8, weights_before_wait=True)
    with pytest.raises(ValueError):
        gemm_config(4.0, "mcg", 1, 64, True, weights_before_wait=True)
    with pytest.raises(ValueError):
        MoEGemmConfig(4.0, "mcg", 1, group_first=-2)


def _memory_order(config, arch="sm_120a"):
    """The kernel's global loads, stores and shuffles in SASS order, as opcodes."""
    from exl3tool import sass

    (k,) = sass.analyze_cubin(sass.compile_cubin(lambda o: moe_kernels.BUILDERS[type(config)](config, o), arch))
    return [i.opcode for i in k.instructions if i.root in ("LDG", "STG", "SHFL")]


def test_rotation_kernels_issue_their_loads_before_they_wait():
    """Latency, not bandwidth, bounded these kernels at large M (a chain of dependent round trips per warp):
    the input rotation loads every slot's indices and scales before its first store (a store may alias a later
    load, so the compiler cannot hoist across it); the top-k sum with 4 column blocks per CTA has at least two
    blocks' partials in flight before its first butterfly; the intermediate issues every load before its first
    store (with SiLU's approximate reciprocal, 40 registers, ptxas issues a block's up partials during its gate
    butterfly instead of before it: the kernel is issue-bound at full occupancy, and measured 10% faster)."""
    ops = _memory_order(RouteInputRotationConfig("float16", 8))
    first_store = next(i for i, op in enumerate(ops) if op.startswith("STG"))
    assert not any(op.startswith("LDG") for op in ops[first_store:])
    # with 8 values a lane (large M): one 16-byte x load, and X one 16-byte store per slot and plane
    ops = _memory_order(RouteInputRotationConfig("float16", 8, 4, lane_values=8))
    first_store = next(i for i, op in enumerate(ops) if op.startswith("STG"))
    assert not any(op.startswith("LDG") for op in ops[first_store:]) and "LDG.E.128" in ops[:first_store]
    assert ops.count("STG.E.128") == 2 * 2, ops
    ops = _memory_order(TopKSumConfig(8, "float16", 2, blocks_per_cta=4))
    first_shuffle = ops.index("SHFL.BFLY")
    assert ops[:first_shuffle].count("LDG.E.128.STRONG.GPU") >= 2 * 2
    for blocks, splits, n in ((6, 1, 4), (3, 2, 4), (2, 1, 8)):
        ops = _memory_order(IntermediateConfig(splits, "rows", blocks, n))
        first_store = next(i for i, op in enumerate(ops) if op.startswith("STG"))
        assert ops[:first_store].count("LDG.E.128.STRONG.GPU") == 2 * splits * blocks, (blocks, splits)


WGMMA = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.f16.f16"


@pytest.mark.parametrize("planes", [2, 1])
@pytest.mark.parametrize("bits,codebook,block_rows",
                         [(4.0, "mcg", 128), (2.0, "3inst", 32), (3.5, "mul1", 64), (6.0, "mcg", 256)])
def test_grouped_gemm_with_warpgroup_mma_compiles_for_sm90a(bits, codebook, block_rows, planes):
    """sm_90a's large route blocks: the dense GEMM's warpgroup-MMA main loop (one m64 x rows x k16 MMA per k-tile,
    X in row order, from 256 rows in the stages' layout), within sm_90a's shared memory per CTA. X that cp.async
    wrote is fenced to the async proxy before the MMAs read it; X that a bulk copy wrote is not."""
    cfg = gemm_config(bits, codebook, planes, block_rows, wgmma=True)
    order = "stages" if block_rows >= 256 else "rows"
    assert (cfg.mma, cfg.x_order, cfg.warps) == ("wgmma", order, 8) and cfg.smem_bytes <= WGMMA_SMEM_LIMIT_BYTES
    ptx = ptx_of(cfg, "sm_90a")
    assert ptx.count(WGMMA.format(block_rows)) >= cfg.k_tiles_per_stage and MMA not in ptx
    assert ("fence.proxy.async.shared::cta" in ptx) == (order == "rows") and "wgmma.wait_group.sync.aligned 0" in ptx
    assert_waits_before_global_access(ptx, "sm_90a")
    with pytest.raises(ValueError, match="one-row blocks"):
        dataclasses.replace(cfg, planes=2, input="float16", resident_k_tiles=32)


@pytest.mark.parametrize("planes", [2, 1])
def test_320_row_blocks_skip_their_last_64_rows_by_a_second_main_loop(planes):
    """320-row blocks (N = 256 + 64 warpgroup MMAs) run one of two main loops, chosen per block by whether row 256
    is a route: one with both MMAs a k-tile, one with the N = 256 ones alone. No MMA sits behind a predicate (ptxas
    would fence each one of the stage, C7519). A 256-row config refuses the skip."""
    cfg = gemm_config(4.0, "mcg", planes, 320, wgmma=True)
    assert cfg.skip_padding_tail
    ptx = ptx_of(cfg, "sm_90a")
    full, tail = WGMMA.format(256), WGMMA.format(64)
    assert ptx.count(tail) >= cfg.k_tiles_per_stage and ptx.count(full) >= ptx.count(tail) + cfg.k_tiles_per_stage
    assert "@q" not in ptx and "@p wgmma" not in ptx
    assert not gemm_config(4.0, "mcg", planes, 256, wgmma=True).skip_padding_tail
    with pytest.raises(ValueError, match="more than 256"):
        dataclasses.replace(cfg, token_groups=32)


def test_intermediate_silu_takes_the_approximate_reciprocal():
    """SiLU's 1 / (1 + exp(-g)) as rcp.approx: no IEEE division (its range check and slow-path call per value)."""
    for cfg in (IntermediateConfig(1, "stages", 2, 8), gemm_config(4.0, "mcg", 2, 8, intermediate_splits=2)):
        ptx = ptx_of(cfg)
        assert "rcp.approx" in ptx and "div.rn.f32" not in ptx and "div.full" not in ptx


def test_fast_math_trims_the_intermediate(monkeypatch):
    """moe_rotate.FAST_MATH: SiLU's exponential is one ex2.approx without expf's range reduction (its FFMAs), in
    the Intermediate launch and the gate/up GEMM's fused tail alike, and on sm_90a the Intermediate (two blocks a
    warp) issues 8% fewer SASS; the top-k sum is left as it is."""
    from collections import Counter

    from exl3tool import sass
    from exl3tool.kernels import moe_rotate

    def counts(cfg):
        cubin = sass.compile_cubin(lambda options: moe_kernels.BUILDERS[type(cfg)](cfg, options), "sm_90a")
        ((instructions, _, _),) = sass.disassemble(cubin).values()
        return Counter(i.root for i in instructions if i.root != "NOP")

    inter, topk = IntermediateConfig(1, "stages", 2, 8), TopKSumConfig(8, "float16", 1, 4)
    tail = gemm_config(4.0, "mcg", 2, 8, intermediate_splits=2)
    fast = {cfg: counts(cfg) for cfg in (inter, topk, tail)}
    monkeypatch.setattr(moe_rotate, "FAST_MATH", False)
    exact = {cfg: counts(cfg) for cfg in (inter, topk, tail)}
    assert fast[inter].total() < 0.92 * exact[inter].total()
    assert fast[inter]["FFMA"] < exact[inter]["FFMA"] and fast[tail]["FFMA"] < exact[tail]["FFMA"]
    assert fast[topk] == exact[topk]


def test_the_intermediate_finds_a_rows_block_without_a_division(monkeypatch):
    """moe_configs.INTERMEDIATE_CONSTANT_BLOCK_ROWS: the planner compiles the Intermediate launch for its route block
    size, so a packed row's block comes from a multiply-high (sm_90a: no I2F.RP reciprocal of the division, fewer SASS),
    its loads still all before its first store; with the switch off the launch's argument divides as before."""
    from collections import Counter

    from exl3tool import sass

    def counts(cfg):
        cubin = sass.compile_cubin(lambda options: moe_kernels.build_intermediate(cfg, options), "sm_90a")
        ((instructions, _, _),) = sass.disassemble(cubin).values()
        return Counter(i.opcode for i in instructions if i.root != "NOP")

    constant = moe_configs.intermediate_config(1, "stages", 6, 320)
    monkeypatch.setattr(moe_configs, "INTERMEDIATE_CONSTANT_BLOCK_ROWS", False)
    argument = moe_configs.intermediate_config(1, "stages", 6, 320)
    assert (constant.block_rows, argument.block_rows) == (320, 0)
    fast, slow = counts(constant), counts(argument)
    assert slow["I2F.RP"] == 1 and fast["I2F.RP"] == 0 and fast.total() < slow.total()
    ops = _memory_order(constant)  # and still every partial load before the first store
    first_store = next(i for i, op in enumerate(ops) if op.startswith("STG"))
    assert ops[:first_store].count("LDG.E.128.STRONG.GPU") == 2 * constant.blocks_per_warp


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("routes,x_order,shift,first", [(8, "stages", 6, 0), (9, "rows", 0, -1), (3, "stages", -1, 128)])
def test_input_rotation_on_tensor_cores_compiles(routes, x_order, shift, first, arch):
    """The route input rotation a warp per 8 routes (hadamard "mma"; their gate and up planes as the MMAs' 16
    rows): both planes' H128s as 2 x 2 x 8 fp16 MMAs from exact hi/lo splits of x * suh (suh scaled by 2^shift
    in registers unless shift is 0), no shuffle; every load before the first store; at most 128 registers (4 CTAs
    of 4 warps an SM), no spills; fp16 x and X in rows or stages order only. A group of consecutive ids from
    ``first`` (group_first) reads no group_row table: one global load fewer."""
    from exl3tool import sass

    cfg = RouteInputRotationConfig("float16", routes, x_order=x_order, hadamard="mma", suh_shift=shift,
                                   group_first=first)
    table = dataclasses.replace(cfg, group_first=-1)
    assert ptx_of(table, arch).count("ld.global") == ptx_of(cfg, arch).count("ld.global") + (first >= 0)
    ptx = ptx_of(cfg, arch)
    assert ptx.count(MMA) == 2 * 2 * 8 and "shfl.sync" not in ptx
    assert ptx.count("fma.rn.f16x2") == 2 * 16 and ptx.count("mul.rn.f16x2") == 2 * 16 * (1 + (shift != 0))
    (k,) = sass.analyze_cubin(sass.compile_cubin(lambda o: moe_kernels.BUILDERS[type(cfg)](cfg, o), arch))
    assert k.registers <= 128 and k.spill_instructions == 0, (k.registers, k.spill_instructions)
    ops = [i.opcode for i in k.instructions if i.root in ("LDG", "STG", "SHFL")]
    first_store = next(i for i, op in enumerate(ops) if op.startswith("STG"))
    assert not any(op.startswith("LDG") for op in ops[first_store:])
    for bad in (dict(x_dtype="bfloat16"), dict(x_order="fragments"), dict(x_order="doubled"), dict(suh_shift=16)):
        with pytest.raises(ValueError):
            RouteInputRotationConfig(**{"x_dtype": "float16", "routes_per_token": routes, "x_order": x_order,
                                        "hadamard": "mma", "suh_shift": shift, **bad})


@pytest.mark.parametrize("planes,split", [(2, True), (1, True), (1, False)])
def test_three_stage_route_block_gemms_are_unrolled_over_their_stages(planes, split):
    """sm_90a, 8-row route blocks at 3 stages (moe_configs.UNSPLIT_SYNC_PIPELINES): the main loop holds one chunk a
    stage (mainloop.chunk_unroll: static stage addresses), so it issues about as much a weight as at 2 stages, no
    spills."""
    from exl3tool import sass
    from exl3tool.kernels.trellis import mmas_per_tile

    cfg = gemm_config(4.0, "mcg", planes, 8, split_halves=split, stages=3)
    three, two = sass.gemm_report(cfg, "sm_90a"), sass.gemm_report(dataclasses.replace(cfg, stages=2), "sm_90a")
    assert cfg.stages == 3 and three.main_loop.mmas == 3 * cfg.k_tiles_per_stage * mmas_per_tile(split)
    assert three.per_weight <= two.per_weight + 0.06 and three.spill_instructions == 0


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("rows", sorted(moe_configs.GROUP_LOOPS))
def test_route_blocks_compile_a_main_loop_for_each_group_count(arch, rows):
    """moe_configs.GROUP_LOOPS (the M = 65-479 plan: gate/up with its fused intermediate, ready signal and weights
    before its wait, down waiting for its block): one main loop for each count of token groups in the list, each with
    that count's MMAs, so the kernel holds sum(counts) / groups times the MMAs of one that multiplies every group,
    within SM120's shared memory. On sm_90a no spills and no fewer CTAs an SM than that kernel by registers."""
    from exl3tool import sass
    from exl3tool.ops.targets import resident_ctas

    loops = moe_configs.GROUP_LOOPS[rows]
    for planes, fields in ((2, dict(intermediate_splits=1, ready_signal=True, weights_before_wait=True,
                                    x2_order=x_order(rows))), (1, dict(ready_wait=True))):
        cfg = gemm_config(4.0, "mcg", planes, rows, tokens=256, **fields)
        every = dataclasses.replace(cfg, group_loops=())
        assert cfg.group_loops == loops and cfg.smem_bytes <= SMEM_LIMIT_BYTES
        assert ptx_of(cfg, arch).count(MMA) * cfg.token_groups == ptx_of(every, arch).count(MMA) * sum(loops) > 0
        if arch == "sm_90a":
            new, old = sass.gemm_report(cfg, arch), sass.gemm_report(every, arch)
            ctas = [resident_ctas(arch, 32 * cfg.warps, cfg.smem_bytes, k.registers) for k in (new, old)]
            assert new.spill_instructions == 0 and ctas[0] >= ctas[1], (planes, new.registers, old.registers)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_sixteen_row_gate_up_reads_x_in_fragment_order(arch):
    """moe_configs.GATE_UP_FRAGMENT_ORDER_ROWS (16-row route blocks, 8 warps at M = 96): the gate/up GEMM reads its X in
    fragment order, one 16-byte shared load per k-tile for both token groups instead of four 4-byte ones: fewer
    shared loads and SASS a weight in the main loop than with X in rows, the same MMAs, no spills and no fewer CTAs
    an SM. Down's X2 stays in rows (fragments took its registers from 42 to 64 on sm_90a)."""
    from exl3tool import sass
    from exl3tool.ops.targets import resident_ctas

    fields = dict(intermediate_splits=1, ready_signal=True, weights_before_wait=True, x2_order=x_order(16))
    cfg = gemm_config(4.0, "mcg", 2, 16, tokens=96, **fields)
    rows = dataclasses.replace(cfg, x_order="rows")
    assert (cfg.x_order, cfg.x2_order, cfg.warps) == ("fragments", "rows", 8)
    assert gemm_config(4.0, "mcg", 1, 16, tokens=96, ready_wait=True).x_order == "rows"
    new, old = sass.gemm_report(cfg, arch), sass.gemm_report(rows, arch)
    loads = [k.main_loop.by_opcode.get("LDS", 0) for k in (new, old)]
    assert new.main_loop.mmas == old.main_loop.mmas > 0 and loads[0] < loads[1], loads
    assert new.per_weight < old.per_weight - 0.3, (new.per_weight, old.per_weight)
    ctas = [resident_ctas(arch, 32 * cfg.warps, k.smem_per_cta_bytes, k.registers) for k in (new, old)]
    assert new.spill_instructions == 0 and ctas[0] >= ctas[1], (new.registers, old.registers)


@pytest.mark.parametrize("arch,block_rows,wgmma", [("sm_120a", 64, False), ("sm_120a", 8, False),
                                                   ("sm_90a", 320, True)])
def test_fp16_partials_are_stored_and_summed_as_fp16(arch, block_rows, wgmma):
    """``partials`` float16: both GEMMs store P as 16-bit values (st.global.b16, no scalar 32-bit store left: the
    fp32 config stores st.global.b32; the fused intermediate's X2 stores are vectors), and the Intermediate and TopKSum launches, and the fused tails, load 8-byte fp16
    quads (ld.global.cg.v4.b16) where the fp32 config loads fp32 quads. fp16 partials refuse K splits."""
    fused = dict(intermediate_splits=1) if block_rows == 8 else {}
    for planes in (2, 1):
        half = gemm_config(4.0, "mcg", planes, block_rows, wgmma, partials="float16", **(fused if planes == 2 else {}))
        full = dataclasses.replace(half, partials="float32")
        stores = [re.findall(r"st\.global\.b(?:16|32)", ptx_of(c, arch)) for c in (half, full)]
        assert set(stores[0]) == {"st.global.b16"} and "st.global.b32" in stores[1], stores
        if fused and planes == 2:
            assert "ld.global.cg.v4.b16" in ptx_of(half, arch) and "ld.global.cg.v4.f32" in ptx_of(full, arch)
    for cfg in (IntermediateConfig(1, "stages", 2, 8), TopKSumConfig(8, "float16", 1, 4)):
        half, full = (ptx_of(dataclasses.replace(cfg, partials=p), arch) for p in ("float16", "float32"))
        assert "ld.global.cg.v4.b16" in half and "ld.global.cg.v4.f32" not in half and "ld.global.cg.v4.f32" in full
    for make in (lambda: IntermediateConfig(2, partials="float16"),
                 lambda: TopKSumConfig(8, "float16", 2, 1, "float16"),
                 lambda: gemm_config(4.0, "mcg", 1, 8, partials="bfloat16")):
        with pytest.raises(ValueError, match="partials"):
            make()


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_gpt_oss_gating_and_biases_compile(arch):
    """gpt-oss: the clamped SwiGLU with gate/up biases (``Gating``: two more fp16 vectors of the rotations table
    loaded a block, g clamped at 7 from above and u at +-7 by compare-selects, which keep NaN as torch's clamp does,
    sigmoid(1.702 g) by ex2.approx), in the Intermediate launch and the gate/up GEMM's fused tail alike; down
    biases in the top-k sum (a second load a slot); a bias on the router's softmax logits. SiLU without biases
    keeps FAST_MATH's folded scale (1/128 on up), which the others cannot take."""
    oss = Gating("swiglu_oai", 7.0, True)
    limit, neg_limit, alpha = "0f40E00000", "0fC0E00000", "0fC01D265F"  # 7, -7, -1.702 log2(e)
    for plain, gated in [(IntermediateConfig(1, "stages", 2, 8), IntermediateConfig(1, "stages", 2, 8, gating=oss)),
                         (gemm_config(4.0, "mcg", 2, 8, intermediate_splits=2),
                          gemm_config(4.0, "mcg", 2, 8, intermediate_splits=2, gating=oss))]:
        a, b = ptx_of(plain, arch), ptx_of(gated, arch)
        assert limit not in a and alpha not in a and "ex2.approx" in b
        clamps = [len(re.findall(rf"selp\.f32\s+%r\d+, {c}", b)) for c in (limit, neg_limit)]
        assert clamps[0] == 2 * clamps[1] > 0  # g and u from above, u from below
        assert alpha in b and b.count("ld.global") > a.count("ld.global")
        assert "0f3C000000" in a and "0f3C000000" not in b  # 1/128: the folded scale of silu(g) * u only
    unclamped = ptx_of(IntermediateConfig(1, "rows", 1, 4, gating=Gating("swiglu_oai")), arch)
    assert limit not in unclamped and alpha in unclamped
    plain, biased = TopKSumConfig(8, "float16", 1, 4), TopKSumConfig(8, "float16", 1, 4, biased=True)
    assert ptx_of(biased, arch).count("ld.global") > ptx_of(plain, arch).count("ld.global")
    route = ptx_of(MoERouteConfig("softmax_topk", 32, 4, logit_bias=True), arch)
    assert route.count("ld.global") > ptx_of(MoERouteConfig("softmax_topk", 32, 4), arch).count("ld.global")
    with pytest.raises(ValueError, match="logit bias"):
        MoERouteConfig("sigmoid_noaux_tc", 32, 4, logit_bias=True)
    with pytest.raises(ValueError, match="clamp"):
        Gating("silu", 7.0)
    with pytest.raises(ValueError, match="gating"):
        gemm_config(4.0, "mcg", 2, 8, gating=oss)  # no fused intermediate: nothing gates


def test_spread_down_gemm_holds_six_ctas_an_sm_and_runs_the_same_code():
    """The M=1 down GEMM with moe_configs.DOWN_MAX_CTAS_PER_SM's shared-memory pad (sm_90a, E=128 top-8 2048x768 K=4
    mcg): the kernel's own shared memory within moe_configs.STATIC_SMEM_MARGIN, 6 CTAs an SM by its compiled registers
    and shared memory, and the unpadded kernel's instructions, opcode for opcode."""
    from exl3tool import sass
    from exl3tool.ops import targets
    from exl3tool.ops.moe_configs import GroupShape, LayerShape

    layer = LayerShape(MoERouteConfig("softmax_topk", 128, 8), 2048, (GroupShape(4.0, "mcg", 4.0, "mcg", 768),))
    down = moe_configs.step_configs(layer, 1, False, "sm_90a", 132, "float16", "float16").groups[0].down
    assert down.smem_pad > 0
    kernels = [sass.analyze_cubin(sass.compile_cubin(lambda o: moe_kernels.BUILDERS[MoEGemmConfig](c, o), "sm_90a"),
                                  dynamic_smem_bytes=c.smem_bytes)[0]
               for c in (down, dataclasses.replace(down, smem_pad=0))]
    padded, plain = kernels
    assert padded.static_smem_bytes <= moe_configs.STATIC_SMEM_MARGIN
    assert targets.resident_ctas("sm_90a", 32 * down.warps, padded.smem_per_cta_bytes, padded.registers) == 6
    assert [i.opcode for i in padded.instructions] == [i.opcode for i in plain.instructions]


def test_trace_stamps_only_in_traced_kernels(monkeypatch):
    """exl3tool.bench.trace: with ptx.TRACE_ADDR set the route and the GEMMs store %globaltimer at their marked
    points and their SM id (%smid); without it they hold no trace code (their SASS is the untraced kernels')."""
    from exl3tool.kernels import ptx

    gate_up = gemm_config(4.0, "mcg", 2, 8, intermediate_splits=4, split_halves=True)
    down = gemm_config(4.0, "mcg", 1, 8, weights_before_wait=True)
    resident = dataclasses.replace(gemm_config(4.0, "mcg", 2, 8), input="float16", resident_k_tiles=32)
    route = MoERouteConfig("softmax_topk", 128, 8)
    assert not any("%globaltimer" in ptx_of(c) or "%smid" in ptx_of(c) for c in (gate_up, down, resident, route))
    monkeypatch.setattr(ptx, "TRACE_ADDR", 1 << 40)
    # gate/up: entry, its wait, the loop, the arrival, the end; down (no fused tail): all but the arrival; a GEMM
    # rotating x itself (no fused tail): its prologue instead
    for config, stamps in ((gate_up, 5), (down, 4), (resident, 5), (route, 5)):
        text = ptx_of(config, "sm_90a")
        assert text.count("mov.u64 t, %globaltimer;") == stamps and text.count("mov.u32 s, %smid;") == 1, config


def test_route_with_slot_blocks_skips_the_packing():
    """MoERouteConfig.slot_blocks (one token): the route kernel compiles (sm_120a, sm_90a) without the packing's
    prefix-sum shuffles and with fewer CTA barriers, writing block_expert straight from the slots."""
    plain = MoERouteConfig("softmax_topk", 128, 8, shared="gated")
    slots = dataclasses.replace(plain, slot_blocks=True)
    for arch in ("sm_120a", "sm_90a"):
        packed, direct = ptx_of(plain, arch), ptx_of(slots, arch)
        assert direct.count("shfl.sync.up") == 0 < packed.count("shfl.sync.up")
        assert direct.count("bar.sync") < packed.count("bar.sync")


@pytest.mark.parametrize("name", ["qwen3-30b-shape-k4-mcg", "deepseek-grouped-sigmoid", "k3.5-mul1-shared-gated",
                                  "gpt-oss-20b"])
def test_one_token_gemms_choose_their_routes(name):
    """moe_configs.ROUTE_IN_GEMMS at one token: the route kernel (MoERouteConfig.logits_only) compiles (sm_120a,
    sm_90a) to the logits alone, with no arrival atomic and no top-k (redux.sync); each group's gate/up GEMM
    (MoEGemmConfig.route) with the selection's redux.sync, which it has none of without it, the first one releasing
    the block table; each down GEMM (awaits_block_expert) with acquire loads of it instead, also where it waits for
    gate/up before its weight copies."""
    from test_moe_configs import LAYERS, MODELS

    c = moe_configs.step_configs({**LAYERS, **MODELS}[name], 1, False, "sm_90a", 132, "float16", "float16")
    assert c.route.logits_only
    full = dataclasses.replace(c.route, logits_only=False)
    for arch in ("sm_120a", "sm_90a"):
        alone, whole = ptx_of(c.route, arch), ptx_of(full, arch)
        assert alone.count("redux.sync") == alone.count("atom.") == 0 < whole.count("redux.sync")
        assert whole.count("atom.") > 0
    for i, g in enumerate(c.groups):
        chooses, reads = ptx_of(g.gate_up), ptx_of(dataclasses.replace(g.gate_up, route=None, writes_routes=False))
        assert chooses.count("redux.sync") > 0 == reads.count("redux.sync"), name
        assert (chooses.count("st.release.gpu") > 0) == (i == 0) and reads.count("st.release.gpu") == 0
        awaits, reads = ptx_of(g.down), ptx_of(dataclasses.replace(g.down, awaits_block_expert=False))
        assert awaits.count("ld.acquire.gpu") > reads.count("ld.acquire.gpu") and awaits.count("redux.sync") == 0
        late = ptx_of(dataclasses.replace(g.down, weights_before_wait=False))  # EARLY_DOWN_WEIGHTS off: waits first
        assert late.count("ld.acquire.gpu") == awaits.count("ld.acquire.gpu")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_gate_up_gemm_loads_its_prologue_before_its_weights(arch):
    """MoEGemmConfig.early_prologue_loads (the gate/up GEMM that rotates one row of x itself): the prologue's 8-byte
    loads of suh and x come before the CTA's first weight copy (LDGSTS), not after its stages as without it; the
    main loop keeps its MMAs and no more instructions (sm_90a: 546 to 548, two moves fewer), no spills; other GEMMs
    refuse the flag."""
    from exl3tool import sass

    resident = dataclasses.replace(gemm_config(4.0, "mcg", 2, 8, intermediate_splits=4, split_halves=True),
                                   input="float16", resident_k_tiles=32)

    def kernel(config):
        return sass.analyze_cubin(sass.compile_cubin(lambda o: moe_kernels.BUILDERS[MoEGemmConfig](config, o),
                                                     arch))[0]

    early, plain = kernel(dataclasses.replace(resident, early_prologue_loads=True)), kernel(resident)
    for k, before in ((early, 2), (plain, 0)):
        ops = [i.opcode for i in k.instructions]
        first_copy = next(i for i, op in enumerate(ops) if op.startswith("LDGSTS"))
        assert ops[:first_copy].count("LDG.E.64") == before, ops[:first_copy]
    assert early.main_loop.mmas == plain.main_loop.mmas > 0
    assert len(early.main_loop.instructions) <= len(plain.main_loop.instructions)
    assert early.spill_instructions == 0
    for bad in (dict(input=None, resident_k_tiles=0), dict(resident_rows=2)):
        with pytest.raises(ValueError, match="early_prologue_loads"):
            dataclasses.replace(resident, early_prologue_loads=True, **bad)
