"""Compile-only kernel tests (no GPU needed, marker `compile`): every kernel variant that can exist compiles once
for SM120 and SM90 (and a spread for SM80/SM89), and its PTX drives the tensor cores with mma.sync. (The 99 KB
shared-memory bound is the config constructor's to enforce: see test_configs_refuse_what_the_kernel_cannot_do.)"""

import re
from dataclasses import replace

import pytest

from exl3tool.format import HALF_RATE_WORDS, Codebook
from exl3tool.kernels.dequant import DequantConfig
from exl3tool.kernels.fold import FoldConfig
from exl3tool.kernels.gemm import SMEM_LIMIT_BYTES, GemmConfig, SharedMemoryError, fitting_config
from exl3tool.kernels.rotate import InputRotationConfig, OutputRotationConfig
from exl3tool.kernels.trellis import CODEBOOKS, SUPPORTED_BITS
from exl3tool.ops import launch
from exl3tool.ops.fold import fold_builder
from exl3tool.ops.runtime import compile_with_ptx
from exl3tool.ops.targets import WGMMA_LAYOUT
from helpers import assert_early_next, assert_waits_before_global_access

pytestmark = pytest.mark.compile

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
ARCHS = ["sm_120a", "sm_90a"]
# Half rates (1.5/2.5/3.5) exist for the mul1 codebook only (the `half-rate-codebook` check): no kernel for the rest.
CASES = [(bits, cb) for bits in SUPPORTED_BITS for cb in CODEBOOKS
         if bits not in HALF_RATE_WORDS.values() or cb == Codebook.MUL1.value]


def ptx_of(config, arch="sm_120a"):
    return compile_with_ptx(lambda options: launch.BUILDERS[type(config)](config, options), arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("token_groups", [1, 8])
@pytest.mark.parametrize("bits,codebook", CASES)
def test_gemm_compiles_with_mma_sync(bits, codebook, token_groups, arch):
    config = fitting_config(bits=bits, codebook=codebook, token_groups=token_groups)
    ptx = ptx_of(config, arch)
    assert f".target {arch}" in ptx
    # One MMA per token group per decoded k-tile of a stage.
    assert ptx.count(MMA) >= token_groups * config.k_tiles_per_stage
    assert "cp.async.cg.shared.global" in ptx


@pytest.mark.parametrize("output", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits,codebook,token_groups", [(2.0, "3inst", 1), (4.0, "mcg", 8), (3.5, "mul1", 2)])
def test_gemm_with_fused_output_rotation_compiles(bits, codebook, token_groups, output):
    config = fitting_config(bits=bits, codebook=codebook, token_groups=token_groups, output=output, has_bias=True)
    ptx = ptx_of(config)
    assert MMA in ptx
    # The last CTA of a block is found with one device-scope acq_rel atomic (no fences), and reads partials from L2.
    assert "atom.acq_rel.gpu.global.add.u32" in ptx and "fence.acq_rel.gpu" not in ptx and "ld.global.cg.v4.f32" in ptx
    assert ptx.count("shfl.sync.bfly") >= 5 * 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bits,codebook,input", [(4.0, "mcg", "float16"), (3.5, "mul1", "bfloat16"),
                                                 (6.0, "3inst", "float16")])
def test_gemm_rotating_its_own_input_compiles(bits, codebook, input, arch):
    """M = 1: the input rotation is the GEMM's prologue (butterflies, packed fp16 pairs into shared memory); only
    the weights are staged; the resident row adds 32 bytes per k-tile of the split to the CTA's shared memory."""
    split = codebook != "mul1"  # as the planner at K >= 2.5 on sm_90 and sm_120: doubled B words
    base = GemmConfig(bits=bits, codebook=codebook, output="float16", split_halves=split,
                      x_order="doubled" if split else "fragments")
    config = replace(base, input=input, resident_k_tiles=64)
    ptx = ptx_of(config, arch)
    assert MMA in ptx and ptx.count("shfl.sync.bfly") >= 2 * 5 * 4  # input and output rotations
    assert "cvt.rn.f16x2.f32" in ptx and ptx.count("cp.async.cg.shared.global") < ptx_of(base, arch).count(
        "cp.async.cg.shared.global")
    row_bytes = 64 if split else 32  # per k-tile: 16 fp16, doubled in pairs
    assert config.smem_bytes == base.smem_bytes - 4 * base.stages * base.x_stage_words + 64 * row_bytes
    with pytest.raises(ValueError, match="input"):
        replace(base, input=input, resident_k_tiles=12)
    with pytest.raises(ValueError, match="input"):
        replace(base, input=input, resident_k_tiles=64, token_groups=2)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("bits,codebook", [(2.0, "mcg"), (3.5, "mul1"), (8.0, "3inst")])
def test_gemm_compiles_for_other_mma_sync_archs(bits, codebook, arch):
    ptx = ptx_of(GemmConfig(bits=bits, codebook=codebook, token_groups=2), arch)
    assert f".target {arch}" in ptx and MMA in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bits,codebook", CASES)
def test_dequantize_compiles(bits, codebook, arch):
    ptx = ptx_of(DequantConfig(bits, codebook), arch)
    # The codebook's signature instruction is in the decode.
    marker = {"mul1": "dp4a.u32.u32", "mcg": "0xcbac1fed", "3inst": "mad.lo.u32"}[codebook]
    assert marker in ptx


@pytest.mark.parametrize(
    "config",
    [InputRotationConfig("float16"), InputRotationConfig("bfloat16"), InputRotationConfig("float16", "fragments"),
     InputRotationConfig("bfloat16", "fragments"), InputRotationConfig("float16", "doubled"),
     InputRotationConfig("float16", "stages"), InputRotationConfig("bfloat16", "stages", 8)]
    + [
        OutputRotationConfig(out, partial, bias)
        for out in ("float16", "bfloat16", "float32")
        for partial in ("float32", "float16")
        for bias in (False, True)
    ],
    ids=str,
)
def test_rotations_compile(config):
    ptx = ptx_of(config)
    assert ptx.count("shfl.sync.bfly") >= 5 * 4  # five butterfly stages on four registers


def test_configs_refuse_what_the_kernel_cannot_do():
    with pytest.raises(ValueError):
        GemmConfig(bits=4.5, codebook="mcg")
    with pytest.raises(ValueError):
        GemmConfig(bits=4.0, codebook="mcg", token_groups=3)
    with pytest.raises(SharedMemoryError, match="shared memory"):
        GemmConfig(bits=8.0, codebook="mcg", token_groups=8, k_tiles_per_stage=8, stages=6)
    with pytest.raises(ValueError, match="16 with shared decode"):
        GemmConfig(bits=4.0, codebook="mcg", token_groups=16)  # 64 accumulators + 64 B registers per lane
    with pytest.raises(ValueError, match="warp_cols"):
        GemmConfig(bits=4.0, codebook="mcg", token_groups=2, warps=8, warp_cols=4)
    with pytest.raises(ValueError, match="split_halves"):
        GemmConfig(bits=4.0, codebook="mcg", warps=8, warp_cols=2, token_groups=2, split_halves=True)
    with pytest.raises(ValueError, match="doubled"):  # doubled B words are for the split MMAs only
        GemmConfig(bits=4.0, codebook="mcg", x_order="doubled")
    for half in (dict(output="float16"), dict(input="float16", resident_k_tiles=8)):  # needs both ends fused
        with pytest.raises(ValueError, match="spread_sum"):
            GemmConfig(bits=4.0, codebook="mcg", spread_sum=True, **half)
    with pytest.raises(SharedMemoryError, match="shared memory"):  # the decoded stage counts too
        GemmConfig(bits=4.0, codebook="mcg", token_groups=16, warps=8, warp_cols=4, k_tiles_per_stage=8)
    # warpgroup MMA: whole warpgroups, whole 128-byte swizzle atoms per stage, a stage in flight, row-order X
    with pytest.raises(ValueError, match="mma must be"):
        GemmConfig(bits=4.0, codebook="mcg", mma="tcgen05")
    for bad in (dict(warps=4, warp_cols=2), dict(split_halves=True), dict(x_order="fragments"),
                dict(k_tiles_per_stage=2), dict(stages=2), dict(token_groups=64)):
        with pytest.raises(ValueError, match="wgmma"):
            GemmConfig(**dict(dict(bits=4.0, codebook="mcg", token_groups=8, k_tiles_per_stage=4, stages=4,
                                   mma="wgmma"), **bad))
    with pytest.raises(SharedMemoryError, match="shared memory"):  # sm_90a's 227 KB per CTA
        GemmConfig(bits=8.0, codebook="mcg", token_groups=32, warps=8, k_tiles_per_stage=8, stages=4, mma="wgmma")


WGMMA = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.f16.f16"


@pytest.mark.parametrize("bits,codebook,token_groups,warps", [(4.0, "mcg", 8, 8), (2.0, "3inst", 1, 4),
                                                              (3.5, "mul1", 32, 8), (8.0, "mcg", 16, 4)])
def test_warpgroup_mma_gemm_compiles_for_sm90a(bits, codebook, token_groups, warps):
    """sm_90a's wide-M GEMM: one asynchronous m64 x tokens x k16 warpgroup MMA per decoded k-tile (A from
    registers, B by descriptor), the stage's cp.async data fenced for the async proxy, one group left in flight."""
    config = fitting_config(bits=bits, codebook=codebook, token_groups=token_groups, warps=warps, mma="wgmma",
                            k_tiles_per_stage=4, stages=6)
    ptx = ptx_of(config, "sm_90a")
    assert ptx.count(WGMMA.format(8 * token_groups)) >= config.k_tiles_per_stage and MMA not in ptx
    for needed in ("wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 1",
                   "wgmma.wait_group.sync.aligned 0", "fence.proxy.async.shared::cta", "cp.async.cg.shared.global"):
        assert needed in ptx, needed
    assert_waits_before_global_access(ptx, "sm_90a")
    # X's copies (mainloop.RowCopies): a thread's rows 8k apart, each copy's address made in one multiply-add and
    # its missing rows zero-filled by ignore-src, where the stage's 16-byte pieces split evenly over the threads.
    threads, pieces = 32 * warps, config.tokens_per_cta * 8  # 8 pieces per token row of a 4-k-tile stage
    row_copies = re.findall(r"mad\.wide\.u32 a, %r\d+, \d+, %rd\d+; "
                            r"cp\.async\.cg\.shared\.global \[%r\d+\+\d+\], \[a\], 16, p;", ptx)
    if pieces % threads == 0 and (threads // 8) % 8 == 0:
        per_stage = pieces // threads
        assert len(row_copies) % per_stage == 0 and len(row_copies) >= per_stage * (config.stages - 2)
    else:
        assert not row_copies


@pytest.mark.parametrize("token_groups,k_tiles_per_stage,mbarriers", [(32, 4, False), (16, 8, False), (40, 4, True)])
def test_warpgroup_mma_gemm_with_x_in_stages_order(token_groups, k_tiles_per_stage, mbarriers):
    """X in the stages' layout (trellis.x_stages_index): one thread announces a stage's X bytes on its full mbarrier
    and brings them with one bulk copy per 64 columns (mainloop.BulkCopy), every thread waits on that mbarrier's
    phase, and the threads' 16-byte cp.async copy the weights only; the same warpgroup MMAs as row order. Only
    row order fences X to the async proxy (cp.async writes it; the bulk copy is the async proxy's own)."""
    layout = dict(bits=4.0, codebook="mcg", token_groups=token_groups, warps=8, mma="wgmma",
                  k_tiles_per_stage=k_tiles_per_stage, stages=6, mbarriers=mbarriers)
    stages, rows = fitting_config(**layout, x_order="stages"), fitting_config(**layout, x_order="rows")
    ptx, plain = ptx_of(stages, "sm_90a"), ptx_of(rows, "sm_90a")
    pieces, size = k_tiles_per_stage * 16 // 64, 128 * stages.tokens_per_cta
    copy = (r" @p cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes "
            r"\[%r\d+\], \[%rd\d+\], (\d+), \[(%r\d+)\];")
    announce = r"setp\.eq\.b32 p, %r\d+, 0; @p mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[(%r\d+)\], (\d+);"
    issues = re.findall(announce + copy * pieces, ptx)
    assert len(issues) >= stages.stages - 2, len(issues)  # the stages issued ahead, then one per loop chunk
    for bar, announced, *copies in issues:
        assert int(announced) == pieces * size and copies == [str(size), bar] * pieces
    assert "cp.async.bulk" not in plain and "mbarrier.try_wait.parity.shared.b64" in ptx
    assert "fence.proxy.async.shared::cta" in plain and "fence.proxy.async.shared::cta" not in ptx
    # the threads' 16-byte copies: a stage's weights (one piece each here) against weights and X's 128-byte rows
    assert 0 < ptx.count("cp.async.cg.shared.global") < plain.count("cp.async.cg.shared.global")
    assert ptx.count(WGMMA.format(8 * token_groups)) == plain.count(WGMMA.format(8 * token_groups))
    assert stages.smem_bytes == rows.smem_bytes + (0 if mbarriers else 16 * stages.stages)
    with pytest.raises(ValueError, match="stages"):  # the stages' layout is the warpgroup MMA's
        GemmConfig(bits=4.0, codebook="mcg", token_groups=8, x_order="stages")


SHARED_DECODE = [dict(token_groups=16, warps=8, warp_cols=4, k_tiles_per_stage=4),
                 dict(token_groups=8, warps=8, warp_cols=2, k_tiles_per_stage=4, stages=3)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", SHARED_DECODE)
@pytest.mark.parametrize("bits,codebook", [(1.0, "mcg"), (4.0, "3inst"), (3.5, "mul1"), (8.0, "mcg")])
def test_shared_decode_gemm_compiles(bits, codebook, layout, arch):
    config = GemmConfig(bits=bits, codebook=codebook, x_order="fragments", **layout)
    ptx = ptx_of(config, arch)
    assert f".target {arch}" in ptx and config.smem_bytes <= SMEM_LIMIT_BYTES
    # each warp: its k-tiles' A fragments stored once, then token_groups MMAs per k-tile from shared memory
    assert ptx.count(MMA) >= config.token_groups * config.k_tiles_per_stage
    assert ptx.count("st.shared.v4.b32") >= config.k_tiles_per_stage
    assert ptx.count("ld.shared.v4.b32") >= config.warp_cols * config.k_tiles_per_stage


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a", "sm_80"])
@pytest.mark.parametrize("config", [GemmConfig(bits=4.0, codebook="mcg", token_groups=2),
                                    GemmConfig(bits=2.0, codebook="3inst", output="float16", input="float16",
                                               resident_k_tiles=64),
                                    DequantConfig(4.0, "mcg"), InputRotationConfig("float16", "fragments"),
                                    OutputRotationConfig("bfloat16", "float32", True), FoldConfig(3.0, "mul1")],
                         ids=["gemm", "gemm-rotating-x", "dequant", "input-rotation", "output-rotation", "fold"])
def test_kernels_wait_for_the_kernel_before_them_under_pdl(config, arch):
    """Every dense kernel kind waits for the kernel before it under PDL (``helpers``: the rule and its check)."""
    build = fold_builder if isinstance(config, FoldConfig) else launch.BUILDERS[type(config)]
    assert_waits_before_global_access(compile_with_ptx(lambda options: build(config, options), arch), arch)


WGMMA_GEMM = GemmConfig(bits=4.0, codebook="mcg", token_groups=8, **WGMMA_LAYOUT)


@pytest.mark.parametrize("config,arch", [(InputRotationConfig("float16", "stages"), "sm_90a"),
                                         (OutputRotationConfig("float16"), "sm_90a"), (WGMMA_GEMM, "sm_90a"),
                                         (InputRotationConfig("float16", "fragments"), "sm_80")],
                         ids=["input-rotation", "output-rotation", "wgmma-gemm", "input-rotation-sm80"])
def test_early_next_lets_the_next_kernel_launch_right_after_the_wait(config, arch):
    """``early_next``: one griddepcontrol.launch_dependents, right after the kernel's wait and before any global
    access; none without it (the next kernel then launches as this one's CTAs exit) and none on SM80."""
    build = launch.BUILDERS[type(config)]
    for early in (False, True):
        assert_early_next(compile_with_ptx(lambda options: build(replace(config, early_next=early), options), arch),
                          early, arch)
