"""What one fused MoE call launches at M tokens, and with which configs: the tuning knobs (each with the
measurement that set it), the step's shape (route block rows, blocks, K splits, which steps a GEMM fuses) and every
kernel's config (``step_configs``). Pure planning: it needs no GPU, so any arch's configs are planned and compiled on
the CPU (``exl3tool bench --sass --moe``, tests/test_moe_configs.py); ``exl3tool.ops.moe`` allocates, compiles and
launches what it plans.

    step_shape(layer, tokens, sm_count, arch) -> StepShape
    step_configs(layer, tokens, given, arch, sm_count, x_dtype, out_dtype) -> StepConfigs
``layer`` is a LayerShape, or a DeviceMoE (which has the same attributes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from exl3tool.kernels.gemm import SharedMemoryError, fitting_config
from exl3tool.kernels.mainloop import WGMMA_MAX_GROUPS
from exl3tool.kernels.moe_gemm import MoEGemmConfig, fuses_intermediate
from exl3tool.kernels.moe_gemm_pair import MoEGemmPairConfig, pairs
from exl3tool.kernels.moe_rotate import SILU_GATING, Gating, IntermediateConfig, RouteInputRotationConfig, TopKSumConfig
from exl3tool.kernels.moe_route import MoERouteConfig, tiles_for
from exl3tool.ops import targets
from exl3tool.ops.targets import WGMMA_LAYOUT, check_whole_stages, decode_warps, has_wgmma, split_halves

# Split-K aims for this many CTAs per SM (the dense GEMM: 8). At M=1 (8 blocks since block_bound) 8 would take 6 K
# splits of gate/up, 1152 CTAs where 8 an SM fit (62 registers); 7 keeps every M's splits as they were before that
# bound (M=1-4: 4/3, 3/2, 2/2, 3/2).
CTAS_PER_SM = 7
# At these token counts a GEMM of several K splits puts them in its grid's x beside the columns
# (MoEGemmConfig.splits_in_x), so that a route block's CTAs of every split are dispatched together; elsewhere in z,
# where each split's CTAs of every block go before the next split's. The same CTAs' work: y bit-identical. H100, E=128
# top-8 2048x768 K=4 mcg, layer graph, us, z -> x: M=1 21.93 -> 21.69 (two rounds) and 21.92 -> 21.71 (three, another
# call); M=2 34.53 -> 34.47, M=3 44.19 -> 44.50, M=4 51.66 -> 53.10. Two K splits at M=16 and 32 (CTAS_PER_SM 16) lost
# in x as in z (s66): 106.39 -> 119.05, 132.87 -> 135.79 (docs/perf.md, sixty-ninth session).
SPLITS_IN_X_TOKENS = (1,)
ROTATION_WARPS_PER_SM = 4  # below this many (token, 128 block) warps per SM the input rotation splits the slots
# From this many (token, 128 block) pairs per SM on, the input rotation holds 8 values a lane (16-byte x and X, a
# warp per two blocks) and splits a token's slots over 4 CTAs (two a warp: the scales of 8 would need 168
# registers). H200, E=128 top-8 hidden 2048, kernel us, two rounds, bit-identical (4 values and one slot group ->
# 8 values and 4): M=1024 33.5 / 33.7 -> 29.5 / 29.7, M=4096 127.1 / 128.5 -> 117.4 / 118.0; M=256 11.1 / 11.3
# -> 11.0 / 11.1 (kept at 4).
WIDE_ROTATION_PAIRS_PER_SM, WIDE_ROTATION = 64, (8, 4)
SUM_BLOCKS_PER_CTA = 4  # top-k sum at large M: 128-column blocks of a token per CTA (at most; sum_blocks_per_cta)
# sum_blocks_per_cta takes more blocks a CTA only while this many CTAs an SM remain. At M=256 (E=128 top-8 hidden
# 2048) 4 blocks would leave 7.8, so it takes 2: 2048 CTAs of 8 warps, two waves at 8 an SM. One wave of 1024 CTAs
# of 4 blocks (7; M=128 then 2 blocks) gained nothing: H100, layer graph, three rounds, us: M=128 189.63 -> 188.43,
# M=256 225.43 -> 226.94 (spreads 2-4; TopKSum kernel 5.32 -> 5.28, 7.83 -> 7.64; docs/perf.md, s76).
SUM_MIN_CTAS_PER_SM = 8
# The Intermediate launch takes up to this many 128-column blocks of a packed row per warp (moe_rotate: the row's
# index lookups once, every block's loads issued before the first butterfly), by the gate/up partials' dtype. fp32:
# H200, E=128 top-8 2048x768 K=4 mcg (6 blocks), layer graph, two rounds, y bit-identical, Intermediate kernel us
# (1 -> 2 -> 3 -> 6 blocks): M=256 12.1 -> 10.4 -> 11.6 -> 13.1, M=1024 34.4 -> 27.8 -> 30.5 -> 34.3, M=4096 136.1 ->
# 109.3 -> 116.9 -> 123.9. fp16 (half the bytes a load, so more loads in flight pay): H100, Intermediate kernel us,
# two rounds, y bit-identical, 2 blocks by packed row -> 6 blocks by route (INTERMEDIATE_BY_ROUTE): M=512 12.21 ->
# 11.70, M=1024 19.94 -> 19.61, M=2048 37.31 -> 34.85, M=4096 87.35 -> 70.50 (6 by row 71.36; 2 by route 75.49;
# 3 by route 79.73) (docs/perf.md, fifty-fifth session).
INTERMEDIATE_MAX_BLOCKS_PER_WARP = {"float32": 2, "float16": 6}
# Values a lane of the Intermediate launch where a warp takes an even number of blocks: 8 (two blocks at once: four
# butterfly exchanges instead of five, sm_90a 96 SHFL instead of 120 for two blocks, 832 SASS instead of 880; the same
# bits) or 4. H200, E=128 top-8 2048x768 K=4 mcg, Intermediate kernel us, two rounds, y bit-identical (4 -> 8):
# M=1024 27.8 / 27.8 -> 27.2 / 27.2, M=4096 107.5 / 108.3 -> 105.2 / 105.5; M=256 10.3 / 10.4 -> 10.5 / 10.7.
INTERMEDIATE_LANE_VALUES = 8
# The Intermediate launch compiled per route block size (IntermediateConfig.block_rows): a packed row's block by a
# multiply-high, not a division by the launch's argument (sm_90a 558 -> 528 SASS, two blocks a warp). H200, E=128 top-8
# 2048x768 K=4 mcg, Intermediate kernel us, three rounds, y bit-identical (off -> on): M=1024 23.26 -> 22.57, M=4096
# 96.86 -> 92.91 (docs/perf.md, forty-seventh session). An A/B switch.
INTERMEDIATE_CONSTANT_BLOCK_ROWS = True
# The Intermediate launch a warp per route (IntermediateConfig.by_route), not per packed row, by the partials' dtype
# (above: with fp16 ones; at M=4096 the 320-row blocks hold 32768 routes in 73920 rows).
INTERMEDIATE_BY_ROUTE = {"float32": False, "float16": True}
# Route blocks of warpgroup-MMA GEMMs (X in rows or stages order) take the route input rotation a warp per 8
# routes, its H128s on the tensor cores (RouteInputRotationConfig.hadamard "mma", kernels.hadamard_mma; fp16 x,
# 16-byte aligned suh). The shuffle rotation is issue- and L1-bound (H200 ncu, M=4096: 75% issue, L1 87%).
# H200, E=128 top-8 2048x768 K=4 mcg, kernel us (profiler, 4 L2-cold copies), shuffle -> mma: M=4096 133.6 ->
# 111.8, M=2048 56.9 -> 46.5, M=1024 29.6 -> 24.2; y moves 1.8e-4 (relative), as close to the fp32 reference.
INPUT_ROTATION_MMA = True
# Launch bounds (CTAs an SM, 0: none) of the tensor-core input rotation and of the Intermediate launch: more warps an
# SM for these memory-bound launches at the cost of spills (sm_90a, CPU: rotation 94 registers, 6 -> 80 with 25
# spill SASS; Intermediate 56, 10 -> 48 with 4). H100, M=4096, kernel us (profiler), beside each other in one run:
# rotation at 6 CTAs 116.68 -> 127.45, Intermediate at 10 66.59 -> 66.99 (docs/perf.md, fifty-seventh session).
INPUT_ROTATION_MIN_CTAS_PER_SM = 0
INTERMEDIATE_MIN_CTAS_PER_SM = 0
BLOCK_ROWS = (8, 16, 32, 64, 128, 256, 320)  # route block = GEMM tokens per CTA, by the mean routes per expert
# The mean routes per expert from which a block above TWICE_THE_MEAN_MAX_ROWS may be taken: its own size, except 320
# rows (sm_90a's warpgroup MMAs, N = 256 + 64 per k-tile, 250 registers at K=4), from 256. Among those reached,
# block_rows_for takes the cheapest for the experts' spread (the mean + 3 standard deviations of random routing):
# blocks per expert x (rows + BLOCK_FIXED_ROWS). At M=4096, E=128 top-8 (mean 256, experts at about 210-300
# routes) 256-row blocks leave half the experts a second, nearly empty block (192 blocks, 67% of the rows used)
# where 320-row blocks hold each expert in one (128 blocks, 80%). H200, K=4 mcg, layer graph, 4 L2-cold copies, two
# rounds, y bit-identical (256 -> 320 rows): M=4096 1319.4 / 1306.4 -> 1218.5 / 1238.6 us.
BLOCK_FROM_MEAN = {128: 128, 256: 256, 320: 256}
# A route block's fixed cost (mostly its decoded weights) in rows of MMA work, fitted to the H200's MoE GEMMs at
# M=4096: 128-row blocks 1042 us against 256-row ones 943 (eighth and ninth sessions).
BLOCK_FIXED_ROWS = 128
# The largest route block of each MMA kind (GemmConfig.mma). 256-row blocks are the dense M=256 warpgroup-MMA
# layout, whose 222 KB of shared memory only sm_90a has. H200, E=128 top-8 2048x768 K=4 mcg, layer graph, y
# bit-identical, two rounds: M=4096 (mean 256) 1398.9 / 1401.2 -> 1320.9 / 1322.8 us (GEMMs 1042 / 1051 -> 943 /
# 939); from a mean of 128 (M=2048) slower, 806.8 / 814.6 -> 847.5 / 856.0, so 256 rows only once the mean reaches
# them.
LARGEST_BLOCK_ROWS = {"sync": 128, "wgmma": 320}
TWICE_THE_MEAN_MAX_ROWS = 64  # the largest block chosen by block_rows_for's twice-the-mean rule
# GEMM layout per route block beyond MoEGemmConfig's defaults (private decode, 4 warps, 8 k-tiles per stage): a
# 128-row block decodes into shared memory for 8 warps of 4 tile columns each (kernels.mainloop, shared decode).
# H200, E=128 top-8 2048x768 K=4, M=4096, whole layer: 64-row private blocks 2140 us, 128-row shared 1805.
GEMM_LAYOUT = {128: dict(warps=8, warp_cols=4, k_tiles_per_stage=4)}
# Other route blocks take targets.decode_warps: 8 warps for 32-row blocks and 64-row mcg blocks (H200, E=128 top-8
# 2048x768 K=4 mcg, whole layer, bit-identical: M=192 265.1 -> 258.6 us, M=256 273.0 -> 265.9, M=1024 578.65 ->
# 556.26).
# 8- and 16-row route blocks take 8-warp CTAs from this many tokens on: twice the columns a CTA, so half the CTAs
# and half the X stages a weight. H200, E=128 top-8 2048x768 K=4 mcg, layer graph, two processes each, y
# bit-identical, us (4 -> 8 warps): 8 rows M=14 94.40 -> 92.38, M=16 106.09 -> 104.76, M=32 129.70 -> 127.68, M=64
# 158.02 -> 153.99; 16 rows M=80 198.99 -> 190.91, M=96 200.42 -> 191.68, M=128 203.58 -> 196.16; lost at M=12
# 89.81 -> 91.55 and M=8 69.87 -> 71.60 (two K splits there); M=13 97.95 -> 97.07, within two processes' spread.
# SM120 not measured. Also at the token counts in EIGHT_WARP_SMALL_BLOCK_TOKENS: M=4, where 4 warps split gate/up's
# K in two and down's not at all, 8 warps in three and two. The same H200 layer, three rounds each, us (y not the same
# bits, the split sums group differently): M=4 53.99 -> 50.72, 58.15 -> 54.02 (s40) and 54.18 -> 50.57 (s41); 4 warps
# at 8 warps' splits (CTAS_PER_SM = 16, y bit-identical to 8 warps') 51.44, so the splits give three quarters of the
# gain and the wider CTAs the rest; 4 warps at (2, 2) splits 52.33. Lost at M=1 25.08 -> 25.48, M=3 43.58 -> 46.35,
# M=5 56.69 -> 57.29, M=6 60.21 -> 64.85, M=8 69.73 -> 71.83; more splits at 4 warps M=5 56.84 -> 56.01 (within
# two spreads), M=6 59.99 -> 63.99 (docs/perf.md, fortieth and forty-first sessions).
EIGHT_WARP_SMALL_BLOCK_ROWS = (8, 16)
EIGHT_WARP_SMALL_BLOCK_MIN_TOKENS = 14
EIGHT_WARP_SMALL_BLOCK_TOKENS: tuple[int, ...] = (4,)
# Route blocks whose X and X2 are written in the GEMMs' fragment order (one 16-byte shared load per k-tile pair and
# token group, as the dense GEMM from 2 token groups): bit-identical y. H200, E=128 top-8 2048x768 K=4, whole layer,
# two alternated runs: 32 rows (M=256) 284.4 -> 272.6 us, 64 rows (M=1024) 651.0 -> 579.5; not 8 rows (M=16: 125.8
# -> 132.0) nor 128 (shared decode, M=4096: 1779 -> 2094, 148 registers leave one CTA per SM; capped to two, 1777)
# nor 16 at 8 warps (M=80 190.70 -> 192.35, M=96 192.15 -> 194.07: its down GEMM takes 64 registers, not 42).
FRAGMENT_ORDER_ROWS = (32, 64)
# Route blocks whose gate/up X alone is in fragment order, down's X2 staying in rows. At 16 rows (8 warps) the gate/up
# main loop loads a k-tile's B words of both token groups by one 16-byte shared load instead of four 4-byte ones
# (sm_90a 6.22 -> 5.84 SASS a weight, 42 -> 46 registers, five CTAs an SM either way; sm_120a 6.18 -> 5.81, 44 -> 64,
# three either way), where X2 in fragment order took down to 64 registers (above). H200, E=128 top-8 2048x768 K=4
# mcg, layer graph, three rounds, y bit-identical, us (off -> on): M=96 182.13 -> 178.13, M=128 189.29 -> 186.96;
# X2 too (FRAGMENT_ORDER_ROWS with 16, its down GEMM held to five CTAs an SM) 185.13 and 194.89 (docs/perf.md,
# forty-seventh session).
GATE_UP_FRAGMENT_ORDER_ROWS = (16,)
# Where the GPU has warpgroup MMAs (sm_90a), route blocks from this many rows multiply with them (the dense GEMM's
# layout, targets.WGMMA_LAYOUT: two warpgroups, 4 k-tiles per stage; X and X2 in row order, the MMA's swizzled layout is
# made by the copies). H200, E=128 top-8 2048x768 K=4 mcg, layer graph, y bit-identical: M=4096 (128-row blocks) 1706.7
# -> 1402.6 us (GEMMs 1395.6 -> 1061.7), M=1024 (64 rows) 552.9 -> 497.1 (433.5 -> 379.0); M=256 (32 rows) lost, 254.5
# -> 271.0 (its half-empty blocks still pay for every decoded weight).
MOE_WGMMA_MIN_ROWS = 64
# Route blocks of these sizes keep mma.sync below this mean of routes an expert even where the GPU has warpgroup MMAs:
# their group loops (GROUP_LOOPS) skip the empty token groups for which a warpgroup MMA pays, and the gate/up GEMM
# does the intermediate (ready counters: a launch fewer). H200, E=128 top-8 2048x768 K=4 mcg, layer graph, three
# rounds, us (warpgroup MMAs -> mma.sync with group loops (4, 8)): M=320 (mean 20) 295.00 -> 271.13, M=384 (24)
# 298.32 -> 278.41 and 298.60 -> 278.61; M=448 (28) 301.37 -> 301.40, M=480 (30) 302.99 -> 305.20, M=512 (32) 305.74
# -> 326.31; mma.sync without the group loops M=384 363.34, M=448 368.76 (docs/perf.md, forty-seventh session).
# Group loops (4, 6, 8), another call (warpgroup -> mma.sync): M=448 301.96 -> 292.90, M=512 306.06 -> 308.33, M=576
# 309.42 -> 326.16 (docs/perf.md, forty-eighth session).
SYNC_BELOW_MEAN = {64: 30}
# Warpgroup-MMA route blocks of these sizes take these fields over targets.WGMMA_LAYOUT: 64-row blocks the dense
# GEMM's rolled 8-k-tile stages (targets.DENSE_WGMMA_SMALL_LAYOUT; sm_90a 7.91 -> 6.44 SASS a weight, 100 -> 126
# registers, two CTAs an SM either way). H200, E=128 top-8 2048x768 K=4 mcg, layer graph, two processes each, y
# bit-identical, us: M=512 325.56 -> 309.17, M=1024 480.43 -> 462.79 (docs/perf.md, twenty-ninth session).
WGMMA_BLOCK_LAYOUT: dict[int, dict] = {64: targets.DENSE_WGMMA_SMALL_LAYOUT}
# Route blocks from this many rows hand their wgmma stages over through mbarriers instead of a CTA barrier per stage
# (GemmConfig.mbarriers: no warp waits for another's decode; a stage is refilled a chunk after all released it).
# Same MMAs in the same order: y bit-identical. H200, E=128 top-8 2048x768 K=4 mcg, both GEMMs (profiler us), two
# rounds (CTA barrier -> mbarriers): M=4096 (320-row blocks) 834.6 / 836.3 / 835.4 / 840.1 -> 786.3 / 789.6 / 789.2 /
# 791.3; slower with smaller blocks, M=6144 (256 rows) 1188.6 / 1200.2 -> 1303.8 / 1312.7, M=2048 (128 rows) 598.0 /
# 598.5 -> 706.0 / 706.2, M=1024 (64 rows) 373.4 / 374.2 -> 434.9 / 444.9, and in the dense wgmma GEMM at M=64-256
# by 4-20%.
MBARRIER_MIN_ROWS = 320
# Route blocks over 256 rows (320, warpgroup MMAs of N = 256 + 64) skip the N = 64 MMAs and their partials'
# stores where row 256 is padding (MoEGemmConfig.skip_padding_tail): at M=4096, E=128 top-8, about half the
# experts get at most 256 routes. H200, 2048x768 K=4 mcg, layer graph over 4 L2-cold copies, two rounds, y
# bit-identical: M=4096 1130.1 / 1142.7 -> 1113.8 / 1128.7 us (GEMMs 687.2 -> 671.5), with the N = 64 MMAs behind a
# predicate; as a second main loop without them (s28, kernels.moe_gemm) M=4096 1095.28 -> 1056.51, M=8192 2155.10 ->
# 2079.45 against that predicate (no-skip blocks not measured again).
SKIP_PADDING_TAIL = True
# mma.sync route blocks of these sizes multiply only their token groups that hold routes, rounded up to one of these
# counts (MoEGemmConfig.group_loops: a main loop compiled for each, picked per block), and store only those groups'
# partials. At M=256 a 32-row block holds 16 routes on average, so half its MMAs and B loads were padding. H200,
# E=128 top-8 2048x768 K=4 mcg, layer graph, three rounds each, y bit-identical, us (every group -> skip): M=96
# (16-row blocks) 192.88 -> 182.38, M=128 196.86 -> 190.19, M=256 240.32 -> 227.88. Counts of 32-row blocks, another
# call: (2, 4) / (1, 2, 3, 4) / (2, 3, 4) M=160 207.50 / 208.60 / 209.72, M=192 211.92 / 211.89 / 213.03, M=256
# 227.30 / 225.89 / 226.24, within the spreads (up to 2.0); (2, 4) keeps down at 60 registers (sm_90a; 68 with every
# count, three CTAs an SM instead of four) and gate/up at 68 (80 before) (docs/perf.md, forty-third session).
# 64-row blocks, three rounds, (4, 8) / (4, 6, 8) / (2, 4, 6, 8): M=320 273.89 / 273.52 / 270.10, M=384 279.66 / 280.01
# / 278.65, M=440 299.48 / 292.72 / 293.43 (each keeps two 8-warp CTAs an SM on sm_90a, 110-118 registers, no spills;
# docs/perf.md, forty-eighth session).
GROUP_LOOPS = {16: (1, 2), 32: (2, 4), 64: (2, 4, 6, 8)}  # 64: see SYNC_BELOW_MEAN
# The gate/up GEMM finishes the intermediate itself (moe_gemm: one launch fewer) for route blocks up to this many
# rows, when its grid is short: at most FUSED_INTERMEDIATE_CTAS_PER_SM CTAs an SM (1.25 waves of 8), counting the
# blocks of the experts that uniform routing is expected to reach. Every CTA's arrival at the counter, and the last
# one's serial tail, then overlap the other CTAs' work. H200, E=128 top-8 2048x768 K=4 mcg, layer graph over 4 L2-cold
# copies, two rounds, y bit-identical, launch -> fused (waves): M=2 38.3 -> 36.9 (1.06), M=3 46.6 -> 44.4 (1.03),
# M=5 70.0 -> 68.5 (0.82), M=6 76.9 -> 76.1 (0.95), M=7 84.9 -> 80.0 (1.08), M=8 93.4 -> 84.8 (1.21); M=4 59.4 ->
# 61.0 (1.34, two K splits), M=9 95.1 -> 95.4 (1.33), M=10 98.3 -> 106.6 (1.44), M=12 108.1 -> 113.3 (1.64), M=16
# 121.6 -> 124.2 (2.0), M=64 176.2 -> 180.8 (3.96); M=1 (0.73) 33.1 -> 32.45 earlier (docs/perf.md, nineteenth).
FUSED_INTERMEDIATE_ROWS = 8
FUSED_INTERMEDIATE_CTAS_PER_SM = 10
# Route blocks of these sizes whose gate/up GEMM does the intermediate take two of a warp's rows at a time there
# (MoEGemmConfig.tail_row_pairs: 8 values a lane, a row a half-warp; the same bits): half the chains of dependent
# loads, butterflies and stores in the last CTA's tail, which the per-CTA trace put at up to 11.9 us beside 15-37 us
# main loops at M=256 (H100, s62). Not 8- and 16-row blocks: 8 more registers there cost a CTA an SM (sm_90a, 16
# rows at 8 warps 46 -> 62 registers, 5 -> 4 CTAs; 8 rows at 4 warps (M=2) 54 -> 62, 9 -> 8); 32 rows 72 -> 80
# and 64 rows 116 -> 118 keep theirs (3 and 2). H100, E=128 top-8 2048x768 K=4 mcg, layer graph, y bit-identical,
# us, () -> (32, 64), three rounds: M=256 225.31 -> 224.04 (GEMM kernels 220.25 -> 216.03), M=192 209.16 -> 209.24
# (201.35 -> 199.89); two rounds: M=256 227.70 -> 225.40, M=384 300.30 -> 299.18; with 16 too, M=96 179.70 ->
# 178.16, M=128 185.54 -> 186.29 (docs/perf.md, sixty-third session).
FUSED_TAIL_ROW_PAIRS = (32, 64)
# Pipelines (stages, k-tiles a stage) of the mma.sync route blocks whose K is not split (each CTA runs the whole K:
# at hidden 2048 / intermediate 768, 16 stages of 8 k-tiles of gate/up, 6 of down), by (block rows, warps a CTA), in
# order of preference: the first whose stage divides the GEMM's k-tiles. The main loop is unrolled over 3 or 4
# stages (mainloop.chunk_unroll); split blocks (2-8 stages a CTA: M <= 4) keep the layout's 2 of 8. H200, E=128 top-8
# 2048x768 K=4 mcg, layer graph over L2-cold copies, a process per variant, y bit-identical, us:
# - 3 stages of 8 (4 warps, 2 -> 3): M=4 54.57 -> 53.98, M=8 83.54 -> 79.61, M=16 119.43 -> 114.49, M=64 170.50 ->
#   166.37. Lost: split blocks at 3 (M=1 26.25 -> 27.56, M=2 36.82 -> 38.26), 16- and 32-row blocks at 3 (M=128
#   208.1 -> 216.8, M=256 252.2 -> 261.3), 4 stages (M=16 116.93; at 8 warps, s41: M=16 105.39 -> 107.83, M=64
#   155.06 -> 158.05; 16-row blocks at 3, M=96 192.81 -> 200.23) (docs/perf.md, twenty-second session).
# - 2 stages of 16 at 8 warps (half the CTA barriers, which ncu puts at 17% of the warps' cycles at M=16; 50 KB,
#   still four CTAs an SM), two calls, three rounds each: M=16 104.44 -> 103.27 and 104.58 -> 104.23, M=32 128.39 ->
#   127.44, M=64 155.98 -> 154.26 and 155.33 -> 152.95; 16-row blocks lost (64 KB, three CTAs an SM: M=128 198.43 ->
#   207.24) (docs/perf.md, forty-second session).
# SM120 keeps 2 of 8 (its 100 KB an SM would hold fewer CTAs; not measured).
UNSPLIT_SYNC_PIPELINES = {"sm_90": {(8, 4): (dict(stages=3),),
                                    (8, 8): (dict(stages=2, k_tiles_per_stage=16), dict(stages=3))}}
# Launch bounds of the mma.sync route blocks' GEMMs, by (block rows, planes): CTAs an SM that ptxas must fit
# (MoEGemmConfig.min_ctas_per_sm); none. The 32-row gate/up GEMM's fused intermediate takes it to 80 registers on
# sm_90a (3 CTAs of 8 warps an SM); {(32, 2): 4} compiles it to 64 (13 spills in the tail, a 4.6% longer main
# loop). H200, E=128 top-8 2048x768 K=4 mcg, layer graph, two processes each, y bit-identical, us: {(32, 2): 4} M=192
# 234.53 -> 240.63, M=256 239.89 -> 248.95; 6 for 16-row M=96 192.78 -> 202.16, M=128 196.58 -> 205.29; 5 for 16-row
# and 6 for 8-row M=16 104.31 -> 130.60 (docs/perf.md, thirty-ninth session). SM120 not measured.
MIN_CTAS_PER_SM: dict[tuple[int, int], int] = {}
# Where the gate/up GEMM does the intermediate, each of its CTAs lets the down GEMM launch once its partials are
# written (MoEGemmConfig.next_after_loop), and the down GEMM's CTAs read their block's expert and issue their first
# weight stage before their PDL wait (weights_before_wait): the weights come from HBM during gate/up's fused tail.
# H200, E=128 top-8 2048x768 K=4 mcg, layer graph over 4 L2-cold copies, three rounds, y bit-identical, us: M=1
# 27.94 / 27.78 / 27.92 -> 27.59 / 27.28 / 27.31, M=6 77.5 / 77.6 / 78.0 -> 75.4 / 75.6 / 76.3, M=7 81.7 / 82.1 /
# 82.4 -> 80.1 / 79.9 / 80.7, M=8 85.6 / 85.5 / 86.3 -> 84.7 / 84.7 / 84.9; M=2, 3 and 5 even. Not kept (another
# run): the down GEMM's weights before its wait behind the Intermediate launch (M=4 56.8 -> 62.0 / 62.3).
EARLY_DOWN_WEIGHTS = True
# From this many tokens on, the input rotation lets an mma.sync gate/up GEMM launch right after its own wait
# (RouteInputRotationConfig.early_next) and that GEMM issues its first weight stages before its PDL wait
# (weights_before_wait, as the down GEMM above): the blocks' experts come from the route kernel, which finished
# before the rotation's wait. The same MMAs: y bit-identical. H200, E=128 top-8 2048x768 K=4 mcg, layer graph over
# L2-cold copies, two processes each, us: M=16 111.22 -> 110.76, M=32 134.46 -> 133.15, M=64 161.67 -> 159.89,
# M=128 205.82 -> 203.58, M=256 246.85 -> 246.23; M=4 55.37 -> 55.18, and in s20 M=2 39.4 -> 40.4, M=4 56.8 ->
# 58.4-58.9 (M=64 177.8 / 181.3 -> 175.4 / 176.7), so from 16. With the block-ready counters (s36), from 16 ->
# from 4: M=4 53.82 -> 55.06, M=8 70.64 -> 70.03, M=12 89.83 -> 89.28, so from 8.
EARLY_GATE_UP_WEIGHTS_MIN_TOKENS = 8
# Up to this many tokens the route kernel lets the next kernel (the gate/up GEMM at M = 1, else the input rotation)
# launch right after its own wait (MoERouteConfig.early_next), so its CTAs are resident when the route ends; and a
# group of consecutive expert ids finds a route block's row in it as the expert minus its first id
# (MoEGemmConfig.group_first) instead of a group_row load between the block's expert and the first weight copies.
# H200, E=128 top-8 2048x768 K=4 mcg, layer graph over 4 L2-cold copies, three rounds, y bit-identical, us, base ->
# both: M=1 26.56 / 26.81 / 27.17 -> 26.07 / 26.52 / 26.22, M=2 39.4 / 39.6 / 39.8 -> 38.5 / 38.7 / 38.8, M=4 56.7 /
# 56.9 / 57.1 -> 55.7 / 56.5 / 56.4, M=8 84.0 / 84.7 / 85.1 -> 83.7 / 84.1 / 84.5, M=16 127.7 / 128.5 / 128.8 ->
# 127.4 / 127.7 / 128.4; M=64 and 256 (group rows only) even. The route's early launch at every M (another run):
# M=256 251.4 -> 252.8, so only up to 16 tokens.
EARLY_ROUTE_NEXT_TOKENS = 16
CONTIGUOUS_GROUP_ROWS = True
# The input rotation and the Intermediate launch find a route's group row (its suh, its rotations) as its expert minus
# the group's first id where CONTIGUOUS_GROUP_ROWS gives one (their group_first), and the top-k sum a slot's down_svh
# row as its expert where the layout makes them equal (TopKSumConfig.svh_by_expert): one dependent table load fewer
# before their scale loads (at M = 1 on the down GEMM's fused top-k sum, the layer's last chain). H100, y
# bit-identical, kernel us (profiler), tables -> indexed: rotation M=16 9.60 -> 9.28, M=256 11.06 -> 10.82, M=1024
# 29.29 -> 27.49, M=4096 124.53 -> 117.84; top-k sum M=1024 20.70 -> 20.46, M=4096 83.38 -> 81.26; Intermediate
# M=1024 19.32 -> 18.94; the layer within its spread (docs/perf.md, fifty-seventh session).
EXPERT_INDEXED_ROWS = True
# From this many tokens on, mma.sync route blocks of private decode (all but the 128-row ones) hand X2 from gate/up to
# down through block-ready counters (MoEGemmConfig.ready_signal / ready_wait; the intermediate fused into gate/up, which
# needs one tile column a warp): down's CTAs start as gate/up's last ones run, each waiting only for its own block.
# H200, E=128 top-8 2048x768 K=4 mcg, layer graph over L2-cold copies, two processes each, y bit-identical, us,
# grid-wide wait -> counters: M=4 55.39 -> 54.19, M=6 64.17 -> 60.16, M=8 75.01 -> 70.43, M=12 94.57 -> 90.73, M=16
# 111.13 -> 107.00, M=64 164.93 -> 163.16, M=128 209.39 -> 204.83, M=256 252.48 -> 244.86; M=2 33.98 -> 34.91 (two K
# splits), so from 4 (docs/perf.md, s35). s39: M=2 34.02 -> 35.08, M=3 43.66 -> 45.21. At M=1 they also work with the
# one-token GEMMs (the down GEMM's top-k sum then counts in at mSumCounter), and lost: 24.73 -> 26.18 (s40; down's CTAs
# launch early and spin beside gate/up).
READY_COUNTERS_MIN_TOKENS = 4
# Where the down GEMM waits at block-ready counters, each CTA counts itself out behind its first X copies
# (MoEGemmConfig.count_out_behind_x), not between its wait's barriers: in the trace (H100) every down CTA at M=16
# found its block ready and still took 2.59 us (median) from entry to its wait's end, the count-out's atomic round
# trip serial in it. H100, E=128 top-8 2048x768 K=4 mcg, layer graph, y bit-identical, us, 5 rounds (3): M=32 130.80
# -> 129.56 (130.37 -> 129.37), M=64 157.95 -> 156.56 (158.08 -> 156.65), M=16 104.81 -> 104.48; M=8, 128, 256 within
# 0.5 either way (s65).
COUNT_OUT_BEHIND_X = True
# Where the ready counters hand route blocks from gate/up to down, both GEMMs may run as one grid, gate/up's CTAs
# first (kernels.moe_gemm_pair): behind a running kernel a dependent launch gets one occupancy of CTAs an SM until that
# kernel's last CTA leaves (s74's trace: up to 109 SMs idle at M=256), and its CTAs wait for gate/up's unused ones to
# pass first (M=16: down's first CTA entered at 60.8 us, its blocks ready from 36). Off: the throttle went, but the
# pair's CTAs refilled a freed slot 2.1-2.4 us after it emptied (0.6 for the plain kernel). H100, E=128 top-8
# 2048x768 K=4 mcg, layer graph, three rounds, y bit-identical, us, two launches -> one grid: M=8 75.26 -> 72.27,
# M=16 105.44 -> 110.17, M=64 155.59 -> 164.22, M=96 179.21 -> 180.16, M=128 187.13 -> 186.83, M=256 226.05 -> 225.03,
# M=384 281.94 -> 281.20 (docs/perf.md, s77).
PAIRED_GEMMS = False
# The pair's launch bounds (MoEGemmPairConfig.min_ctas_per_sm) by (route block rows, warps): the CTAs an SM both
# halves reach alone (sm_90a, E=128 top-8 2048x768 K=4 mcg), where the pair's registers would fit fewer; 0: none (32
# rows: gate/up alone fits 3 at 80 registers, the pair 4 only with 21 spills; 64 rows: 2 either way).
PAIRED_MIN_CTAS_PER_SM = {(8, 4): 8, (8, 8): 4, (16, 8): 5}
PAIRED_EARLY_NEXT = False  # MoEGemmPairConfig.early_next
# Up to this many tokens the gate/up GEMM rotates x into shared memory itself, with each CTA's expert's suh, while
# its first weights load, instead of a RouteInputRotation launch (as the dense GEMM at M = 1); from 2 tokens it
# takes each route block's rows (MoEGemmConfig.resident_rows, a row a token: the router's routes of a token go to
# distinct experts, so an expert's routes fit one 8-row block), y bit-identical to the launch's. H100, E=128 top-8
# 2048x768 K=4 mcg, layer graph, 3 rounds, us: M=2 34.89 -> 34.15, M=3 44.11 -> 43.73, M=4 52.33 -> 51.82; 8 lost
# (M=6 61.90 -> 80.61, M=8 77.75 -> 97.22: 6-8 rows of x beside the weight stages leave fewer of them) (s52).
RESIDENT_INPUT_TOKENS = 4
# Up to this many tokens (one) the down GEMM's last CTA per 128 columns does the top-k sum instead of a TopKSum
# launch (the one token's k' routes are then k' blocks, known at plan time: the arrival count). The sum at several
# tokens (a counter per token and 128 columns; each down CTA counted its block's routes in, a thread a row, and summed
# the tokens it arrived last for) lost: H100, layer graph, one round, y bit-identical, us: M=2 34.34 -> 36.46, M=4
# 51.53 -> 53.84 (docs/perf.md, sixty-eighth session; removed, its code at 0a53f8f).
FUSED_TOPK_TOKENS = 1
# From this many tokens on, a GEMM of one K split stores its partials in fp16 (MoEGemmConfig.partials): half the
# bytes of P's stores and of the Intermediate / TopKSum reads (M=4096, H100 ncu: 246 and 287 MB, 101 and 105 us,
# at 72-82% of DRAM bandwidth). The GEMMs' fp32 accumulators rounded once more, as ExLlamaV3's fp16 outputs are.
# H100, E=128 top-8 2048x768 K=4 mcg, layer graph, 3 rounds, us (fp32 -> fp16): M=512 316.68 -> 311.53, M=1024
# 455.66 -> 454.66, M=4096 1,058.28 -> 1,039.73; from 16 tokens within 1% (M=64 161.22 -> 160.63, P in the L2).
HALF_PARTIALS_MIN_TOKENS = 512
# The down GEMM's most CTAs an SM, by tokens (spread_pad: shared memory they hold and never touch). Its CTAs launch
# while gate/up's last ones still run, and the GPU fills the SMs with room first: at M=1 (H100, the per-CTA trace,
# exl3tool.bench.trace) its 768 CTAs landed on 80 of the 132 SMs, up to 10 each, their main loops 2.7-6.0 us; held to 6
# they land on 128-129 SMs, loops 2.2-3.9 us. H200, E=128 top-8 2048x768 K=4 mcg, layer graph, three rounds, y
# bit-identical, us: M=1 24.04 -> 22.98 (7 an SM 23.28); at M=2 and 4 (8 an SM) within the spreads (34.93 -> 35.05,
# 52.14 -> 53.08) (docs/perf.md, sixtieth session).
DOWN_MAX_CTAS_PER_SM = {1: 6}
STATIC_SMEM_MARGIN = 1024  # shared memory a GEMM kernel may hold beyond MoEGemmConfig.smem_bytes (static, alignment)
# At one token the route kernel gives route block j to slot j (MoERouteConfig.slot_blocks) instead of packing, where
# the GEMMs rotate x themselves and do the intermediate and the top-k sum (nothing else reads the packing then): the
# trace put the packing at 0.93 us of M=1's route. H100, E=128 top-8 2048x768 K=4 mcg, layer graph, three rounds, y
# bit-identical, us: M=1 23.60 -> 22.36 (docs/perf.md, sixty-first session).
SLOT_BLOCKS = True
# At one token the gate/up GEMM that rotates x itself issues its prologue's loads of x and suh before its weight
# copies (MoEGemmConfig.early_prologue_loads): the trace put that prologue's end 1.1-6.5 us after the PDL wait at M=1
# (median 2.0; 3.9 on the CTAs that arrive last), while the loop after it is issue-bound; an L2 prefetch of the suh
# lines lost (M=1 22.34 -> 22.77). H100, E=128 top-8 2048x768 K=4 mcg, layer graph, two rounds, y bit-identical, us:
# M=1 22.28 -> 21.99 (spreads 0.02) (docs/perf.md, sixty-first session).
EARLY_PROLOGUE_LOADS = True
# With slot blocks, the route kernel writes only the logits, each gate/up CTA chooses its block's expert itself
# (MoERouteConfig.logits_only, MoEGemmConfig.route: the route's own selection, by warp 0), the first group's gate/up
# writes the routes and releases the block table, and the down GEMMs await it (awaits_block_expert): no route CTA
# waits for the others' logits to run the top-k (the trace, M=1 on an H100: logits stored 2.24-2.37 us, the top-k
# done 4.10, the route's end 4.22; with this, the route's end 2.40 and gate/up's prologue 5.98 -> 4.93 median).
# H100, E=128 top-8 2048x768 K=4 mcg, layer graph, three rounds, y and routes bit-identical, us: M=1 21.80 -> 21.00
# (21.72 -> 21.07 in an earlier call); with the down GEMMs choosing too 21.62 -> 21.74, and with every warp of both
# choosing 21.81 -> 24.63 (docs/perf.md, seventy-first session).
ROUTE_IN_GEMMS = True


@dataclass(frozen=True)
class GroupShape:
    """What the plan reads of an expert group (DeviceExpertGroup has these attributes, and its tensors): enough to
    plan and compile a layer without a GPU (``exl3tool bench --sass --moe``, the CPU tests)."""

    w13_bits: float
    w13_codebook: str
    w2_bits: float
    w2_codebook: str
    intermediate_padded: int
    first_expert: int = 0
    suh_shift: int = 0
    suh_aligned: bool = True
    gating: Gating = SILU_GATING


@dataclass(frozen=True)
class LayerShape:
    """What the plan reads of a MoE layer: DeviceMoE's route, hidden_padded and groups, without tensors."""

    route: MoERouteConfig
    hidden_padded: int
    groups: tuple[GroupShape, ...]
    down_biased: bool = False


def svh_rows_are_ids(groups) -> bool:
    """Is each expert's row of down_svh (every group's experts stacked in group order) its id? Where each group's
    experts are consecutive ids and the groups come in id order (TopKSumConfig.svh_by_expert)."""
    firsts = [g.first_expert for g in groups]
    return min(firsts) >= 0 and firsts == sorted(firsts)


@dataclass(frozen=True)
class StepShape:
    """What one M needs: route block, blocks bound, split-K of both GEMMs (the same for every group)."""

    tokens: int
    block_rows: int
    blocks: int
    splits13: int
    splits2: int
    fused_intermediate: bool = False  # the gate/up GEMM does the intermediate step (FUSED_INTERMEDIATE_ROWS)
    ready_counters: bool = False  # down waits for block-ready counters, not for gate/up's grid (READY_COUNTERS_...)
    wgmma: bool = False  # the GEMMs multiply with warpgroup MMAs (uses_wgmma)

    @property
    def rows(self) -> int:
        return self.blocks * self.block_rows


def _splits(ctas: int, k_tiles: int, stage: int, sm_count: int) -> int:
    max_splits = max(1, k_tiles // (2 * stage))
    splits = min(max(1, math.ceil(CTAS_PER_SM * sm_count / max(ctas, 1))), max_splits)
    per_split = math.ceil(k_tiles / splits / stage) * stage
    return math.ceil(k_tiles / per_split)


def block_rows_for(mean: float, largest: int = LARGEST_BLOCK_ROWS["sync"]) -> int:
    """Route block for ``mean`` routes per expert: at least twice the mean, so that most experts fill one block
    instead of spilling into a second (H200, E=128 top-8 2048x768 K=4, M=256: 16-row blocks 333.5 us, 32-row
    299.0), at most 64 rows; larger ones (up to ``largest``) only from their BLOCK_FROM_MEAN (M=1024, mean 64:
    64-row blocks 665.5 us, 128-row 727.8; M=4096, mean 256: 2140 against 1805-1885)."""
    reached = [b for b in BLOCK_ROWS if TWICE_THE_MEAN_MAX_ROWS < b <= largest and BLOCK_FROM_MEAN[b] <= mean]
    if reached:
        spread = mean + 3 * math.sqrt(mean)
        return min(reached, key=lambda b: (math.ceil(spread / b) * (b + BLOCK_FIXED_ROWS), -b))
    return next(b for b in BLOCK_ROWS if b == TWICE_THE_MEAN_MAX_ROWS or 2 * mean <= b)


def input_rotation_layout(tokens: int, blocks: int, routes_per_token: int, sm_count: int) -> tuple[int, int]:
    """(values a lane, slot groups) of the route input rotation for ``tokens`` rows of ``blocks`` 128-column
    blocks. A warp per (token, block) reads x once for all k' slots; when that leaves most of the GPU idle
    (decode), a warp per slot instead (x re-read from L2); at large M, WIDE_ROTATION."""
    pairs = tokens * blocks
    if pairs >= WIDE_ROTATION_PAIRS_PER_SM * sm_count:
        return WIDE_ROTATION[0], min(WIDE_ROTATION[1], routes_per_token)
    return 4, routes_per_token if pairs < ROTATION_WARPS_PER_SM * sm_count else 1


def intermediate_blocks_per_warp(blocks: int, partials: str = "float32") -> int:
    """128-column blocks of a packed row one warp of the ``Intermediate`` launch takes: the most that divide the
    intermediate's ``blocks``, up to INTERMEDIATE_MAX_BLOCKS_PER_WARP for the gate/up ``partials``."""
    return max(d for d in range(1, INTERMEDIATE_MAX_BLOCKS_PER_WARP[partials] + 1) if blocks % d == 0)


def intermediate_config(splits: int, x_order: str, blocks: int, block_rows: int = 0, partials: str = "float32",
                        gating: Gating = SILU_GATING, group_first: int = -1) -> IntermediateConfig:
    """The Intermediate launch for an intermediate of ``blocks`` 128-column blocks: blocks a warp as above, and
    INTERMEDIATE_LANE_VALUES a lane where they are even; route blocks of ``block_rows`` compiled in where
    INTERMEDIATE_CONSTANT_BLOCK_ROWS; the gate/up GEMM's ``partials`` dtype; the group's ``gating``; a warp per
    route where INTERMEDIATE_BY_ROUTE says so for those partials."""
    per_warp = intermediate_blocks_per_warp(blocks, partials)
    return IntermediateConfig(splits, x_order, per_warp, INTERMEDIATE_LANE_VALUES if per_warp % 2 == 0 else 4,
                              block_rows if INTERMEDIATE_CONSTANT_BLOCK_ROWS else 0, partials, gating,
                              INTERMEDIATE_BY_ROUTE[partials], group_first, INTERMEDIATE_MIN_CTAS_PER_SM)


def resident_input(tokens: int, given: bool, block_rows: int) -> bool:
    """Does the gate/up GEMM rotate x itself? A few tokens routed by the router: distinct experts a token, so an
    expert's routes (at most ``tokens``) fit its one route block of one token group, a row each (the caller's
    topk_ids may repeat an expert)."""
    return tokens <= RESIDENT_INPUT_TOKENS and tokens <= block_rows == 8 and not given


def resident_config(g13: MoEGemmConfig, x_dtype: str, per13: int, tokens: int) -> MoEGemmConfig | None:
    """The gate/up GEMM ``g13`` rotating its input itself (``resident_input``): x's rows of ``tokens`` tokens over its
    K split of ``per13`` k-tiles resident in shared memory, or None where its stages cannot take them
    (``GemmConfig.takes_input``: e.g. a K split of 4 k-tiles, 256 wide at 4 splits) or they do not fit beside its
    weight stages."""
    if not g13.mainloop.takes_input(per13):
        return None
    try:
        return replace(g13, input=x_dtype, resident_k_tiles=per13, resident_rows=tokens,
                       early_prologue_loads=EARLY_PROLOGUE_LOADS and tokens == 1)
    except SharedMemoryError:
        return None


def partials_dtype(tokens: int, splits: int) -> str:
    """P's dtype for a GEMM of ``splits`` K splits: fp16 from HALF_PARTIALS_MIN_TOKENS on with one split."""
    return "float16" if splits == 1 and tokens >= HALF_PARTIALS_MIN_TOKENS else "float32"


def fused_topk(tokens: int, given: bool) -> bool:
    """Does the down GEMM do the top-k sum? One token routed by the router: its k' routes in k' blocks."""
    return tokens <= FUSED_TOPK_TOKENS and not given


def sum_blocks_per_cta(tokens: int, col_blocks: int, sm_count: int) -> int:
    """128-column blocks of a token per top-k sum CTA: the most of SUM_BLOCKS_PER_CTA, halved down to 1, that still
    leaves 8 CTAs per SM (a slot's index loads serve all of a CTA's blocks). H200, E=128 top-8 hidden 2048, TopKSum
    us: M=4096 110.5 -> 86.3 with 4 (2: 95.9); M=256 (4 would leave 7.8 CTAs an SM) 8.70 -> 7.74 with 2, layer
    242.12 -> 241.45, y bit-identical (docs/perf.md, s36); M=16, 4 CTAs of 4 blocks instead of 16: 2.6 -> 3.3."""
    per_cta = SUM_BLOCKS_PER_CTA
    while per_cta > 1 and tokens * col_blocks < SUM_MIN_CTAS_PER_SM * per_cta * sm_count:
        per_cta //= 2
    return per_cta


def early_gate_up(tokens: int, resident: bool, wgmma: bool) -> bool:
    """Does the input rotation let the gate/up GEMM launch right after its wait, and that GEMM issue its first
    weight stages before its own (EARLY_GATE_UP_WEIGHTS_MIN_TOKENS)? mma.sync route blocks behind the rotation."""
    return tokens >= EARLY_GATE_UP_WEIGHTS_MIN_TOKENS and not resident and not wgmma


def uses_wgmma(block_rows: int, arch: str | None, mean: float) -> bool:
    """Do route blocks of ``block_rows`` multiply with warpgroup MMAs on ``arch`` (None: the arch-free plan) at
    ``mean`` routes an expert?"""
    return has_wgmma(arch) and block_rows >= MOE_WGMMA_MIN_ROWS and mean >= SYNC_BELOW_MEAN.get(block_rows, 0)


def x_order(block_rows: int, split: bool = False, wgmma: bool = False, gate_up: bool = False) -> str:
    """Column order of a GEMM's input for route blocks of ``block_rows``: gate/up's X (``gate_up``) or down's X2.
    Doubled for split halves, ``targets.wgmma_x_order`` for warpgroup MMAs."""
    if split:
        return "doubled"
    if wgmma:
        return targets.wgmma_x_order(block_rows)
    fragments = block_rows in FRAGMENT_ORDER_ROWS or (gate_up and block_rows in GATE_UP_FRAGMENT_ORDER_ROWS)
    return "fragments" if fragments else "rows"


def group_x_orders(arch: str, group, s: StepShape) -> tuple[str, str]:
    """Column orders of a group's X (gate/up's input) and X2 (down's) at step ``s`` (x_order)."""
    split13, split2 = group_splits(arch, group, s.block_rows)
    return x_order(s.block_rows, split13, s.wgmma, True), x_order(s.block_rows, split2, s.wgmma)


def group_splits(arch: str, group, block_rows: int) -> tuple[bool, bool]:
    """Split halves (targets.split_halves) for the gate/up and the down GEMM of a group, one token group a block."""
    tg = block_rows // 8
    return (split_halves(arch, group.w13_codebook, tg, group.w13_bits),
            split_halves(arch, group.w2_codebook, tg, group.w2_bits))


def eight_warp_small_blocks(tokens: int) -> bool:
    """Do 8- and 16-row route blocks take 8-warp CTAs at ``tokens``?"""
    return tokens >= EIGHT_WARP_SMALL_BLOCK_MIN_TOKENS or tokens in EIGHT_WARP_SMALL_BLOCK_TOKENS


def gemm_layout(block_rows: int, codebook: str, wgmma: bool = False, tokens: int = 0) -> dict:
    """MoEGemmConfig fields of the route block's GEMM layout at ``tokens`` beyond its defaults."""
    if wgmma:
        return {**WGMMA_LAYOUT, **WGMMA_BLOCK_LAYOUT.get(block_rows, {})}
    if block_rows in EIGHT_WARP_SMALL_BLOCK_ROWS and eight_warp_small_blocks(tokens):
        return dict(warps=8)
    return GEMM_LAYOUT.get(block_rows, dict(warps=decode_warps(codebook, block_rows // 8)))


def gemm_config(bits: float, codebook: str, planes: int, block_rows: int, wgmma: bool = False, tokens: int = 0,
                **fields) -> MoEGemmConfig:
    fields.setdefault("x_order", x_order(block_rows, fields.get("split_halves", False), wgmma, planes == 2))
    fields.setdefault("mbarriers", wgmma and block_rows >= MBARRIER_MIN_ROWS)
    fields.setdefault("skip_padding_tail", SKIP_PADDING_TAIL and wgmma and block_rows > 8 * WGMMA_MAX_GROUPS)
    fields.setdefault("group_loops", () if wgmma else GROUP_LOOPS.get(block_rows, ()))
    fields.setdefault("min_ctas_per_sm", 0 if wgmma else MIN_CTAS_PER_SM.get((block_rows, planes), 0))
    return fitting_config(MoEGemmConfig, bits=bits, codebook=codebook, planes=planes, token_groups=block_rows // 8,
                          **gemm_layout(block_rows, codebook, wgmma, tokens), **fields)


def block_warps(block_rows: int, codebook: str, wgmma: bool, tokens: int) -> int:
    """Warps a CTA of a route block's GEMM (its layout's)."""
    return gemm_layout(block_rows, codebook, wgmma, tokens).get("warps", MoEGemmConfig.warps)


def sync_pipeline(arch: str, block_rows: int, warps: int, wgmma: bool, splits: int, k_tiles: int) -> dict:
    """gemm_config's pipeline fields for a route block's GEMM of ``splits`` K splits over ``k_tiles`` on ``arch``:
    the first of UNSPLIT_SYNC_PIPELINES' choices whose stage divides ``k_tiles`` where they apply, else none given
    (the layout's)."""
    if wgmma or splits > 1:
        return {}
    for fields in UNSPLIT_SYNC_PIPELINES.get(arch.rstrip("af"), {}).get((block_rows, warps), ()):
        if k_tiles % fields.get("k_tiles_per_stage", MoEGemmConfig.k_tiles_per_stage) == 0:
            return dict(fields)
    return {}


def step_shape(dmoe: LayerShape, tokens: int, sm_count: int, arch: str | None = None) -> StepShape:
    cfg = dmoe.route
    k = cfg.routes_per_token
    routes = tokens * k
    largest = LARGEST_BLOCK_ROWS["wgmma" if has_wgmma(arch) else "sync"]
    mean = tokens * cfg.top_k / cfg.num_experts
    block_rows = block_rows_for(mean, largest)
    wgmma = uses_wgmma(block_rows, arch, mean)
    # split-K's estimate: the first group's layout
    layout = gemm_layout(block_rows, dmoe.groups[0].w13_codebook, wgmma, tokens)
    warps = block_warps(block_rows, dmoe.groups[0].w13_codebook, wgmma, tokens)
    stage = layout.get("k_tiles_per_stage", MoEGemmConfig.k_tiles_per_stage)
    blocks = block_bound(routes, cfg.packed_experts, block_rows)
    i_p = max(g.intermediate_padded for g in dmoe.groups)
    ctas_per_block13 = 2 * i_p // 16 // warps
    splits13 = _splits(ctas_per_block13 * blocks, dmoe.hidden_padded // 16, stage, sm_count)
    splits2 = _splits(dmoe.hidden_padded // 16 // warps * blocks, i_p // 16, stage, sm_count)
    short = ctas_per_block13 * expected_blocks(cfg, tokens, block_rows) * splits13 <= (
        FUSED_INTERMEDIATE_CTAS_PER_SM * sm_count)
    # the block-ready counters come with the fused intermediate, which the mma.sync 128-row blocks' shared decode
    # cannot take (GPUs without warpgroup MMAs, SM120 included, from a mean of 128 routes an expert)
    fusable = fuses_intermediate(block_rows, warps, layout.get("warp_cols", 1))
    ready = tokens >= READY_COUNTERS_MIN_TOKENS and not wgmma and fusable
    fused = ready or (block_rows <= FUSED_INTERMEDIATE_ROWS and short)
    return StepShape(tokens, block_rows, blocks, splits13, splits2, fused, ready, wgmma)


def block_bound(routes: int, experts: int, block_rows: int) -> int:
    """The most route blocks ``routes`` routes over ``experts`` experts can fill (the grids' block rows). An expert
    holding r routes fills ceil(r / T) = (r - 1) // T + 1 blocks, so n experts holding them all fill at most
    (routes - n) // T + n, most where n is largest. The looser ceil(routes / T) + n gave every grid idle CTAs, which
    took SM slots the live ones then lacked (M=1: a ninth 8-row block, 96 of the gate/up GEMM's 864 CTAs, up to 7 live
    ones an SM instead of 6). H200, E=128 top-8 2048x768 K=4 mcg, layer graph, three rounds, y bit-identical, us:
    M=1 24.53 -> 24.04; M=2, 4 and 256 within the spreads (35.56 -> 34.93, 53.94 -> 52.14, 229.12 -> 227.34)."""
    n = min(experts, routes)
    return (routes - n) // block_rows + n


def expected_blocks(cfg: MoERouteConfig, tokens: int, block_rows: int) -> float:
    """Route blocks in use, on average, when ``tokens`` tokens pick their experts uniformly at random: one per
    expert reached (``E * (1 - (1 - k/E)^M)`` of them), one more per ``block_rows`` routes beyond those, and the
    shared expert's ``ceil(M / block_rows)``."""
    routes = tokens * cfg.top_k
    reached = cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** tokens)
    shared = cfg.packed_experts - cfg.num_experts
    return reached + max(0.0, routes - reached) / block_rows + shared * math.ceil(tokens / block_rows)


@dataclass(frozen=True)
class GroupConfigs:
    """The kernels of one expert group at a step; a launch fused into a GEMM is None."""

    rotation: RouteInputRotationConfig | None  # None: the gate/up GEMM rotates x itself (gate_up.input)
    gate_up: MoEGemmConfig
    intermediate: IntermediateConfig | None  # None: fused into the gate/up GEMM's tail
    down: MoEGemmConfig  # down.topk_sum: it does the top-k sum too
    order13: str  # column order of X and X2 (x_order)
    order2: str
    per13: int  # k-tiles per K split of each GEMM
    per2: int
    pair: MoEGemmPairConfig | None = None  # both GEMMs as one launch (PAIRED_GEMMS), else None


@dataclass(frozen=True)
class StepConfigs:
    """Every kernel config of one call with ``shape.tokens`` tokens, in launch order: route, then per group the
    input rotation, gate/up, Intermediate and down, then the top-k sum (None: fused into the down GEMMs)."""

    shape: StepShape
    route: MoERouteConfig
    groups: tuple[GroupConfigs, ...]
    topk: TopKSumConfig | None

    def kernels(self) -> list[tuple[str, object]]:
        """(role, config) of each launch, in launch order."""
        out = [("route", self.route)]
        for g in self.groups:
            gemms = [("gate/up + down", g.pair)] if g.pair is not None else [
                ("gate/up", g.gate_up), ("intermediate", g.intermediate), ("down", g.down)]
            out += [(role, c) for role, c in [("input rotation", g.rotation), *gemms] if c is not None]
        return out + ([("top-k sum", self.topk)] if self.topk is not None else [])


def input_rotation_config(g, wgmma: bool, order13: str, lane_values: int, slot_groups: int, x_dtype: str,
                          k: int) -> RouteInputRotationConfig:
    """The route input rotation of group ``g``: on the tensor cores for warpgroup-MMA route blocks (X in rows or
    stages order) of fp16 x where INPUT_ROTATION_MMA, else the shuffle butterflies."""
    if INPUT_ROTATION_MMA and wgmma and x_dtype == "float16" and order13 in ("rows", "stages") and g.suh_aligned:
        return RouteInputRotationConfig(x_dtype, k, x_order=order13, hadamard="mma", suh_shift=g.suh_shift,
                                        group_first=indexed_first(g), min_ctas_per_sm=INPUT_ROTATION_MIN_CTAS_PER_SM)
    return RouteInputRotationConfig(x_dtype, k, slot_groups, order13, lane_values, group_first=indexed_first(g))


def gemm_first(g) -> int:
    """The group_first of group ``g``'s MoE GEMMs (CONTIGUOUS_GROUP_ROWS)."""
    return g.first_expert if CONTIGUOUS_GROUP_ROWS else -1


def indexed_first(g) -> int:
    """The group_first of the input rotation and the Intermediate launch for group ``g`` (EXPERT_INDEXED_ROWS)."""
    return gemm_first(g) if EXPERT_INDEXED_ROWS else -1


def step_configs(d: LayerShape, tokens: int, given: bool, arch: str, sm_count: int, x_dtype: str,
                 out_dtype: str) -> StepConfigs:
    """What a call with ``tokens`` tokens compiles and launches on ``arch`` with ``sm_count`` SMs (x and y of the
    kernel dtype names ``x_dtype`` / ``out_dtype``): from the layer's shapes, K and codebooks alone (``d``: a
    DeviceMoE or a LayerShape), so that the CPU can plan and compile it too."""
    s = step_shape(d, tokens, sm_count, arch)
    wgmma = s.wgmma
    cfg = d.route
    k, h_p = cfg.routes_per_token, d.hidden_padded
    route = replace(cfg, method="given" if given else cfg.method, x_dtype=x_dtype,
                    early_next=tokens <= EARLY_ROUTE_NEXT_TOKENS, **tiles_for(tokens))
    resident = resident_input(tokens, given, s.block_rows)
    lane_values, slot_groups = input_rotation_layout(tokens, h_p // 128, k, sm_count)
    partials13, partials2 = partials_dtype(tokens, s.splits13), partials_dtype(tokens, s.splits2)
    topk = TopKSumConfig(k, out_dtype, s.splits2, sum_blocks_per_cta(tokens, h_p // 128, sm_count), partials2,
                         d.down_biased, EXPERT_INDEXED_ROWS and svh_rows_are_ids(d.groups))
    topk_fused = fused_topk(tokens, given)
    groups = []
    for g in d.groups:
        i_p = g.intermediate_padded
        split13, split2 = group_splits(arch, g, s.block_rows)
        order13, order2 = group_x_orders(arch, g, s)
        # the fused intermediate's 8-row blocks (mma.sync): the down GEMM loads its first weights during its tail
        early = EARLY_DOWN_WEIGHTS and s.fused_intermediate and not s.ready_counters
        first = gemm_first(g)
        warps13 = block_warps(s.block_rows, g.w13_codebook, wgmma, tokens)
        warps2 = block_warps(s.block_rows, g.w2_codebook, wgmma, tokens)
        g13 = gemm_config(g.w13_bits, g.w13_codebook, 2, s.block_rows, wgmma, tokens, split_halves=split13,
                          **sync_pipeline(arch, s.block_rows, warps13, wgmma, s.splits13, h_p // 16),
                          x2_order=order2, intermediate_splits=s.splits13 if s.fused_intermediate else 0,
                          next_after_loop=early, group_first=first, ready_signal=s.ready_counters,
                          partials=partials13, gating=g.gating if s.fused_intermediate else SILU_GATING,
                          splits_in_x=tokens in SPLITS_IN_X_TOKENS and s.splits13 > 1)
        g2 = gemm_config(g.w2_bits, g.w2_codebook, 1, s.block_rows, wgmma, tokens, split_halves=split2,
                         **sync_pipeline(arch, s.block_rows, warps2, wgmma, s.splits2, i_p // 16),
                         weights_before_wait=early, group_first=first, ready_wait=s.ready_counters,
                         partials=partials2, splits_in_x=tokens in SPLITS_IN_X_TOKENS and s.splits2 > 1)
        per13 = _per_split(h_p // 16, s.splits13, g13.k_tiles_per_stage)
        per2 = _per_split(i_p // 16, s.splits2, g2.k_tiles_per_stage)
        resident13 = resident_config(g13, x_dtype, per13, tokens) if resident else None
        early13 = early_gate_up(tokens, resident13 is not None, wgmma)
        rotation = None if resident13 is not None else replace(
            input_rotation_config(g, wgmma, order13, lane_values, slot_groups, x_dtype, k), early_next=early13)
        g13 = resident13 or replace(g13, weights_before_wait=early13)
        if s.fused_intermediate and s.block_rows in FUSED_TAIL_ROW_PAIRS and g13.tail_rows_per_warp % 2 == 0:
            g13 = replace(g13, tail_row_pairs=True)
        intermediate = None if s.fused_intermediate else intermediate_config(
            s.splits13, order2, i_p // 128, s.block_rows, partials13, g.gating, indexed_first(g))
        if topk_fused:
            g2 = replace(g2, topk_sum=topk)
        if COUNT_OUT_BEHIND_X and g2.ready_wait:
            g2 = replace(g2, count_out_behind_x=True)
        g2 = replace(g2, smem_pad=spread_pad(arch, g2.smem_bytes, down_cap(tokens, h_p // 16 // warps2 * s.blocks
                                                                             * s.splits2, sm_count)))
        pair = None
        if PAIRED_GEMMS and pairs(g13, g2):
            pair = MoEGemmPairConfig(g13, g2, PAIRED_MIN_CTAS_PER_SM.get((s.block_rows, g13.warps), 0), s.splits2,
                                     PAIRED_EARLY_NEXT)
        groups.append(GroupConfigs(rotation, g13, intermediate, g2, order13, order2, per13, per2, pair))
    if tokens == 1 and SLOT_BLOCKS and all(g.gate_up.input is not None and g.intermediate is None
                                           and g.down.topk_sum is not None for g in groups):
        route = replace(route, slot_blocks=True)  # only the one-token GEMMs read the blocks
        if ROUTE_IN_GEMMS:
            route = replace(route, logits_only=True)
            groups = [replace(g, gate_up=replace(g.gate_up, route=route, writes_routes=i == 0),
                              down=replace(g.down, awaits_block_expert=True)) for i, g in enumerate(groups)]
    return StepConfigs(s, route, tuple(groups), None if topk_fused else topk)


def down_cap(tokens: int, ctas: int, sm_count: int) -> int | None:
    """DOWN_MAX_CTAS_PER_SM's cap for a down grid of ``ctas`` CTAs at ``tokens``, where the grid fits one wave under
    it (a larger one, e.g. hidden 7168's 1792 CTAs at M=1, would take more waves instead)."""
    cap = DOWN_MAX_CTAS_PER_SM.get(tokens)
    return cap if cap and ctas <= cap * sm_count else None


def spread_pad(arch: str, smem_bytes: int, ctas: int | None) -> int:
    """Shared memory (bytes, a multiple of 16) to add to a CTA of ``smem_bytes`` so that at most ``ctas`` fit an SM
    of ``arch`` (MoEGemmConfig.smem_pad); 0 for None."""
    if not ctas:
        return 0
    lim = targets.limits(arch)
    # ctas of them fit, one more does not, whatever up to STATIC_SMEM_MARGIN the kernel holds beside smem_bytes
    footprint = lim.smem_bytes // ctas // 16 * 16 - STATIC_SMEM_MARGIN
    return max(0, footprint - lim.smem_reserved_per_cta - smem_bytes)


def _per_split(k_tiles: int, splits: int, stage: int) -> int:
    """k-tiles per split (whole stages) so that exactly ``splits`` splits cover k_tiles; later ones may be empty
    (they write zeros), so every group fills the same partials."""
    check_whole_stages(k_tiles, stage)
    return math.ceil(k_tiles / splits / stage) * stage
