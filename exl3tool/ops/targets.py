"""What one SM of each target holds, and the split-K that fills every SM: the one table grids are sized by.

The decode GEMM streams weights; it runs at the memory or issue limit only when every SM holds as many CTAs as
fit. So the planner asks how many CTAs of a config are resident per SM (threads, registers, shared memory, CTA
slots) and splits K until the grid fills at least one whole wave of them (80% of one on the H200, where fewer,
longer splits measured faster: ``WAVE_FILL``), then picks among the split sizes that do the one with the least
work on the busiest SM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SmLimits:
    smem_bytes: int  # shared memory per SM available to CTAs
    threads: int
    registers: int
    ctas: int  # resident CTAs per SM
    smem_reserved_per_cta: int = 1024  # the driver's per-CTA reservation (SM80 and newer)
    schedulers: int = 4  # warp schedulers (SM sub-partitions), each issuing one instruction a cycle


# CUDA programming guide, compute capability tables.
LIMITS = {
    "sm_80": SmLimits(164 * 1024, 2048, 65536, 32),  # A100
    "sm_86": SmLimits(100 * 1024, 1536, 65536, 16),
    "sm_89": SmLimits(100 * 1024, 1536, 65536, 24),
    "sm_90": SmLimits(228 * 1024, 2048, 65536, 32),  # H100 / H200
    "sm_100": SmLimits(228 * 1024, 2048, 65536, 32),  # B200
    "sm_120": SmLimits(100 * 1024, 1536, 65536, 32),  # RTX 50xx / RTX PRO 6000 Blackwell
    "sm_121": SmLimits(100 * 1024, 1536, 65536, 32),
}
# SMs of each arch's most common GPU (A100, RTX 3090, RTX 4090, H100 / H200 SXM, B200, RTX 5090, DGX Spark): what a
# plan made without a GPU (``exl3tool bench --sass --moe``) assumes.
TYPICAL_SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_100": 148, "sm_120": 170, "sm_121": 48}
# Registers per thread the planner budgets for a decode GEMM CTA, by token groups: the planner's configs (with
# ``decode_warps``) compile to at most this (sm_120a, checked by tests/test_sass.py; 4 groups: 100 for sm_90a mul1
# K=6), so occupancy is known without a compile.
GEMM_REGISTERS = {1: 64, 2: 64, 4: 104, 8: 168, 16: 176}  # 16: shared decode (8 warps of 4 tile columns)
# The warpgroup-MMA GEMM (sm_90a, ``GemmConfig.mma == "wgmma"``, the planner's 8 warps and 4 k-tiles per stage):
# its accumulators (tokens/2 fp32 a lane) and two stages of decoded A fragments stay in registers. The most any
# K and codebook takes (sm_90a: 8 groups 123, 16 groups 150, 32 groups 241, 40 groups 255, no spills), pinned by
# tests/test_sass.py.
WGMMA_REGISTERS = {1: 128, 2: 128, 4: 128, 8: 128, 16: 152, 32: 248, 40: 256}
# The planners' warpgroup-MMA GEMM layout, dense and MoE (GemmConfig / MoEGemmConfig fields): two warpgroups, 4
# k-tiles per stage, 6 stages (up to 217 KB of sm_90a's 227 KB per CTA at 256 tokens). Measured in docs/perf.md.
WGMMA_LAYOUT = dict(mma="wgmma", warps=8, k_tiles_per_stage=4, stages=6)
# The dense linear's warpgroup-MMA GEMM pipelines up to 8 stages where they fit (``fitting_config``: at 33-128
# tokens; 256 keeps 6). H200, K=4 mcg unless said, whole linear, graph, two processes each, y bit-identical, us (6 ->
# 8): 4096x14336 M=40 33.62 -> 33.25, M=64 34.58 -> 34.21 / 34.23 (two runs), M=128 46.34 -> 44.84; 14336x4096 M=64
# 31.59 -> 31.18, M=128 42.99 -> 42.71; 4096x4096 M=64 13.64 -> 13.47; 14336x4096 K=2 mul1 M=48 29.15 -> 28.77.
# 8 k-tiles a stage in 4 stages, unrolled, lost (M=64 34.58 -> 37.34). The MoE's blocks keep WGMMA_LAYOUT: 8 stages
# there measured within the spread (MoE layer M=512 / 1024 / 4096 324.58 / 491.69 / 1129.44 -> 324.91 / 490.96 /
# 1121.65).
DENSE_WGMMA_STAGES = 8
# Up to this many token groups (64 tokens) the dense warpgroup-MMA GEMM takes 8 k-tiles a stage in 4 stages where
# that splits K as the 4-k-tile layout does (plan_gemm; measured there only), one stage a main-loop iteration
# (GemmConfig.rolled: sm_90a K=4 mcg 6.50 SASS a weight at 127 registers, two CTAs an SM; unrolled by two that
# layout needs 178 registers, one CTA an SM). H200, whole linear, graph, two processes each, y bit-identical, us (4
# k-tiles x 8 stages unrolled -> this), K=4 mcg: 4096x14336 M=64 34.30 -> 33.68 and 34.65 -> 33.82 (s29), M=40 33.31
# -> 32.49, M=48 33.64 -> 33.17 (s29); 14336x4096 M=64 31.28 -> 30.78 and 31.73 -> 30.53 (s29); K=2 3inst 4096x14336
# M=64 33.59 -> 31.98 (docs/perf.md, twenty-eighth and twenty-ninth sessions). Rolled alone: 34.65 / 33.94 / 31.70.
# At 65-256 tokens this layout lost (M=128 44.69 -> 48.77, 42.96 -> 46.55: 168 registers, one CTA an SM).
DENSE_WGMMA_SMALL_MAX_GROUPS = 8
DENSE_WGMMA_SMALL_LAYOUT = dict(k_tiles_per_stage=8, stages=4, rolled=True)
# X's column order for that GEMM (GemmConfig.x_order) from this many tokens per CTA on: "stages" (written in the
# stages' swizzled layout by the rotations; thread 0 brings a stage with one bulk copy per 64 columns), below it
# "rows" (every thread's cp.async pieces). Same MMA operands, y bit-identical. H200, K=4 mcg, graph, two rounds, us,
# rows -> stages: dense whole linear 4096x14336 M=200 71.3 / 71.1 -> 61.1 / 61.1, M=256 66.9 / 65.6 -> 60.7 / 59.6;
# 14336x4096 M=200 65.2 / 64.9 -> 57.7 / 57.4, M=256 63.7 / 63.8 -> 60.6 / 60.9; MoE E=128 top-8 2048x768 layer M=4096
# (320-row blocks) 1173.1 / 1208.0 -> 1091.3 / 1104.2 (GEMMs 828.7 -> 710.7). Slower with fewer tokens per CTA: dense
# M=40-96 +2.0-2.4 us, 14336x4096 M=128 +2.1; MoE M=1024 (64-row blocks) 498.5 -> 509.7, M=2048 (128) 779 -> 785.
WGMMA_STAGES_MIN_TOKENS = 256


def wgmma_x_order(tokens_per_cta: int) -> str:
    """X's column order for a warpgroup-MMA GEMM of ``tokens_per_cta`` tokens per CTA."""
    return "stages" if tokens_per_cta >= WGMMA_STAGES_MIN_TOKENS else "rows"


# The share of one wave of resident CTAs that a split-K grid must fill, per arch (default: a whole wave). On the
# H200 one wave of fewer, longer splits beats 1.1-2 waves of more, for both GEMMs (K=4 mcg, whole linear, us):
# wgmma 4096x14336 M=256 one split (0.85 wave) 73.4 against two 80.2, M=128 49.0 / 52.7; 14336x4096 M=256 four
# (0.97) 67.3 against eight 75.9, M=128 45.0 / 48.9, M=64 eight 33.8 against twelve 35.4; mma.sync 14336x4096
# M=1 / 8 / 16 / 32 fourteen splits (0.85) 21.9 / 25.8 / 25.5 / 27.6 against nineteen 22.5 / 27.0 / 27.2 / 28.9,
# 4096x14336 M=1 / 16 four (0.85) 20.6 / 24.3 against five 21.2 / 25.0. SM120 keeps a whole wave (not measured).
WAVE_FILL = {"sm_90": 0.8}
WGMMA_ARCHS = ("sm_90",)
REGISTER_GRANULE = 256  # registers are allocated per warp in units of 256
OVERHEAD_K_TILES = 16  # a CTA's fixed cost (pipeline fill, epilogue) in k-tiles of streaming, for the wave model


# Private-decode GEMMs at 4 and 8 token groups (32 and 64 tokens per CTA) run with 8 warps: one activation stage
# then serves 128 columns, half the copies and address work per weight (K=4 mcg main loop on sm_90a: 8 groups 7.76
# -> 7.35 SASS per weight, 4 groups 6.55 -> 6.48; on sm_120a the 8-group config no longer spills). At 4 groups
# for every codebook (64-100 registers: 16-32 warps of it per H200 SM). H200, whole linear, graph, M=32: 4096x14336
# K=4 mcg 33.24 -> 31.48 us, 14336x4096 33.76 -> 30.83, K=4 3inst 34.22 -> 31.43, K=6 mcg 36.18 -> 35.04, K=2 mul1
# 29.04 -> 29.12 and 4096x4096 14.83 -> 14.96 (even). At 8 groups only where the 8-warp CTA needs <= 128 registers
# at every K (sm_90a and sm_120a, pinned by tests/test_sass.py), so an H200 SM still holds 16 warps of it: mcg.
# 3inst and mul1 need up to 150-154 at some K (8 warps per SM instead of 12); measured there, 8 warps lost (H200,
# M=64: mul1 K=3 4096x14336 43.27 -> 45.24 us, 3inst K=6 14336x4096 46.11 -> 47.18).
EIGHT_WARP_CODEBOOKS = ("mcg",)


def decode_warps(codebook: str, token_groups: int) -> int:
    """Warps per CTA of a private-decode GEMM: 8 at 4 token groups, and at 8 for ``EIGHT_WARP_CODEBOOKS``; else
    4."""
    return 8 if token_groups == 4 or (token_groups == 8 and codebook in EIGHT_WARP_CODEBOOKS) else 4


# Where the M <= 8 decode GEMM feeds each weight's two fp16 halves to two MMAs (GemmConfig.split_halves, with X
# in doubled order): the smallest bitrate per arch. The split loop issues fewer instructions (sm_120a K=4 mcg 4.38
# per weight against 5.61, sm_90a 4.33) for twice the fp32-accumulate HMMAs, so it pays unless those become the
# bound. H200: one m16n8k16 per 7.5 clocks per SM sub-partition (measured), ~36 issue clocks per k-tile: issue-
# bound at every K (measured 3-5% faster at M = 1 on rows order; slower from M = 16, hence one token group).
# SM120, estimated (no such GPU here): the RTX 5090's GeForce rate, 209.5 dense TFLOP/s with fp32 accumulate over
# 170 SMs at 2.41 GHz, is one m16n8k16 per 32 clocks per sub-partition, 64 per k-tile split; its 1.79 TB/s brings a
# warp's k-tile (32*K bytes) to a sub-partition every 29*K clocks. So the split loop stays under the memory time
# from K = 2.5 on (K=4: 64 against 117 clocks; it issues 35 a k-tile) and would be tensor-bound at K = 2 (64 > 59).
SPLIT_HALVES_MIN_BITS = {"sm_90": 1.0, "sm_120": 2.5, "sm_121": 2.5}
# Token groups up to which the split loop is planned (dense GEMM and MoE route blocks alike). Measured slower at 2
# (s6, before paired hashes: dense M=16 24.0 -> 25.4-25.8 us). Today's sm_90a loop at 2 groups compiles to about one
# SASS a weight fewer split (K=4 mcg 4.77 against 5.88, K=2 4.86 / 5.96, K=6 3inst 5.70 / 6.80), with more registers
# (62 at K=4; up to 72 at K=6-8, over GEMM_REGISTERS[2], and K=8 3inst spills), but it ran slower again (H200, whole
# linear / MoE layer, graph, two processes each, us, 1 -> 2 groups): 4096x14336 M=12 / 16 22.88 / 23.30 -> 23.52 /
# 23.60, 14336x4096 M=16 24.00 -> 24.74 (K=2 mcg 22.10 -> 24.04, K=6 3inst 27.48 -> 27.72), 4096x4096 M=16 11.24 ->
# 11.58; MoE M=96 / 128 (16-row blocks) 203.32 / 209.07 -> 211.04 / 217.95 (docs/perf.md, twenty-sixth session).
SPLIT_HALVES_MAX_TOKEN_GROUPS = 1


# Pipeline stages of the M = 1 GEMM that rotates its own input (one launch a linear), per arch (default 2). H200,
# K=4 mcg, whole linear, graph, y bit-identical, us (2 -> 3 stages of 8 k-tiles, the main loop unrolled over its
# stages): 4096x14336 19.98 / 20.16 -> 18.84 / 18.85, 14336x4096 21.14 / 21.10 -> 20.16 / 20.21, 4096x4096 10.71 ->
# 10.59; 4 stages 19.95 / 21.63 (six CTAs an SM); 3 stages at M=8 21.58 -> 21.86. SM120 keeps 2 (100 KB an SM: 3
# stages would cost CTAs an SM; not measured).
ROTATED_INPUT_STAGES = {"sm_90": 3}


def rotated_input_stages(arch: str) -> int:
    return ROTATED_INPUT_STAGES.get(arch.rstrip("af"), 2)


def split_halves(arch: str, codebook: str, token_groups: int, bits: float) -> bool:
    min_bits = SPLIT_HALVES_MIN_BITS.get(arch.rstrip("af"))
    return (min_bits is not None and bits >= min_bits and codebook != "mul1"
            and token_groups <= SPLIT_HALVES_MAX_TOKEN_GROUPS)


def typical_sms(arch: str) -> int:
    """SMs of the most common GPU of ``arch`` (with or without the ``a``/``f`` suffix)."""
    limits(arch)  # a ValueError naming the known archs
    return TYPICAL_SMS[arch.rstrip("af")]


def limits(arch: str) -> SmLimits:
    """Limits of ``sm_XY`` with or without the ``a``/``f`` suffix."""
    base = arch.rstrip("af")
    if base not in LIMITS:
        raise ValueError(f"no SM limits for {arch!r}; known: {', '.join(LIMITS)}")
    return LIMITS[base]


def resident_ctas(arch: str, threads: int, smem_bytes: int, registers: int) -> int:
    """CTAs of this shape one SM holds at once."""
    lim = limits(arch)
    warps = threads // 32
    regs_per_warp = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    return max(
        1,
        min(
            lim.ctas,
            lim.threads // threads,
            lim.registers // (regs_per_warp * warps),
            lim.smem_bytes // (smem_bytes + lim.smem_reserved_per_cta),
        ),
    )


def gemm_resident_ctas(arch: str, cfg) -> int:
    """Decode GEMM CTAs of a ``GemmConfig`` one SM holds at once (M <= 8 config: H200 8, SM120 7)."""
    table = WGMMA_REGISTERS if cfg.mma == "wgmma" else GEMM_REGISTERS
    return resident_ctas(arch, 32 * cfg.warps, cfg.smem_bytes, table[cfg.token_groups])


def wave_fill(arch: str) -> float:
    return WAVE_FILL.get(arch.rstrip("af"), 1.0)


def has_wgmma(arch: str | None) -> bool:
    """Does ``arch`` have warpgroup MMAs? (None: the arch-free plan, which does not use them.)"""
    return arch is not None and arch.rstrip("af") in WGMMA_ARCHS


def check_whole_stages(k_tiles: int, stage: int) -> None:
    """A GEMM's main loop runs whole stages of ``stage`` k-tiles in each K split: ``k_tiles`` must be a whole number
    of them, or the last split's remainder would go unread. Stages of up to 8 divide every K (in_p/16 is a multiple
    of 8); 16 does not."""
    if k_tiles % stage:
        raise ValueError(f"K of {k_tiles} k-tiles is not a whole number of {stage}-k-tile stages")


def split_k(k_tiles: int, stage: int, ctas_per_split: int, slots: int, sm_count: int,
            max_per_split: int | None = None, fill: float = 1.0) -> int:
    """k-tiles per split (a multiple of ``stage``, at least two stages unless K is shorter, at most
    ``max_per_split``): the grid fills at least ``fill`` x ``slots`` (= resident CTAs x SMs, one whole wave) where
    K allows, and among those sizes the one whose busiest SM streams the least (ceil(CTAs / SMs) x (tiles + fixed
    cost)); ties go to fewer splits."""
    check_whole_stages(k_tiles, stage)
    longest = stage * -(-k_tiles // stage)
    if max_per_split is not None:
        longest = min(longest, max_per_split // stage * stage)
    sizes = range(min(stage * min(2, -(-k_tiles // stage)), longest), longest + 1, stage)

    def ctas(per_split):
        return ctas_per_split * math.ceil(k_tiles / per_split)

    filling = [s for s in sizes if ctas(s) >= fill * slots] or [sizes[0]]
    return min(filling, key=lambda s: (math.ceil(ctas(s) / sm_count) * (s + OVERHEAD_K_TILES), -s))
