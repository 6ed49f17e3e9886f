"""The fold kernel (kernels/fold.py) on the CPU: its lane/register/shared-memory index plan, emulated with NumPy on
one 128x128 block, is the reference reconstruction; it compiles for SM120 and SM90 with both H128 passes, no
spills, and a CTA within SM120's 99 KB of shared memory."""

import numpy as np
import pytest
import torch

from exl3tool import sass
from exl3tool.kernels import emulate
from exl3tool.kernels.fold import SMEM_BYTES, STRIDE, FoldConfig, register_butterflies
from exl3tool.kernels.trellis import TrellisPlan, codebook_constants, decode_lane, lane_word_indices
from exl3tool.reference.linear import reconstruct
from exl3tool.synthetic import random_linear
from exl3tool.ops.fold import fold_builder
from exl3tool.ops.runtime import compile_with_ptx

LANES = np.arange(32)


def butterflies(v, lane_bits):
    """fold.butterflies on NumPy: v is a list of [32]-lane arrays (one per register); the register stages are the
    kernel's own code, the lane exchange mirrors shfl.bfly."""
    v = register_butterflies(v)
    for bit in lane_bits:
        sign = 1.0 - 2.0 * ((LANES >> bit) & 1)
        v = [x[LANES ^ (1 << bit)] + sign * x for x in v]
    return v


def emulated_fold_block(t, bits, codebook, bi, bj):
    """W'[bi block, bj block] exactly as the kernel indexes it, in float64 (the copy-out moves rows as they are)."""
    plan = TrellisPlan(bits)
    words = t.trellis.numpy().view(np.uint32).reshape(t.trellis.shape[0], t.trellis.shape[1], -1)
    suh, svh = t.suh.double().numpy(), t.svh.double().numpy()
    idx, shift = lane_word_indices(plan, LANES)
    g, q, s = LANES // 4, LANES % 4, LANES % 8
    block = np.full(128 * STRIDE, np.nan)
    for warp in range(8):
        rows = [[None] * 16 for _ in range(4)]
        for n in range(8):
            pairs = decode_lane(plan, codebook, [words[bi * 8 + warp, bj * 8 + n, i] for i in idx], shift, emulate,
                                codebook_constants(codebook, emulate))
            for p in range(4):
                halves = emulate._halves(pairs[p])
                for h in range(2):
                    j = 2 * p + h
                    rows[j % 4][2 * n + j // 4] = halves[h]
        scale = [svh[bj * 128 + 8 * m + g] / 128.0 for m in range(16)]
        for r4 in range(4):
            v = butterflies(rows[r4], (2, 3, 4))
            row = warp * 16 + 2 * q + (0, 1, 8, 9)[r4]
            for m in range(16):
                block[row * STRIDE + 8 * m + g] = v[m] * scale[m]
    out = np.full((128, 128), np.nan)
    for warp in range(8):
        for c in range(4):
            col = warp * 16 + 4 * c + LANES // 8
            v = butterflies([block[(s + 8 * r) * STRIDE + col] for r in range(16)], (0, 1, 2))
            for r in range(16):
                out[s + 8 * r, col] = v[r] * suh[bi * 128 + s + 8 * r]
    return out


@pytest.mark.parametrize("bits,codebook", [(4.0, "mcg"), (3.0, "3inst"), (2.5, "mul1")])
def test_fold_index_plan_is_the_reconstruction(bits, codebook):
    t = random_linear(256, 384, bits, codebook, seed=5)
    ref = reconstruct(t).double().numpy()
    for bi, bj in [(0, 0), (1, 2)]:
        got = emulated_fold_block(t, bits, codebook, bi, bj)
        np.testing.assert_allclose(got, ref[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128], rtol=1e-5,
                                   atol=1e-6 * np.abs(ref).max())  # ref: fp32 torch



@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("cfg", [FoldConfig(4.0, "mcg"), FoldConfig(2.0, "3inst", "bfloat16"),
                                 FoldConfig(3.5, "mul1"), FoldConfig(6.0, "mcg", "bfloat16")], ids=str)
def test_fold_compiles(cfg, arch):
    ptx = compile_with_ptx(lambda options: fold_builder(cfg, options), arch)
    # Per warp: 4 rows x 16 values and 4 column groups x 16 values, three exchanges each; the rest in registers.
    assert ptx.count("shfl.sync.bfly") == 2 * 4 * 16 * 3
    # W' leaves as 16-byte row pieces only: 128 rows x 16 pieces over 256 threads.
    assert ptx.count("st.global.v4") == ptx.count("st.global") == 8
    assert SMEM_BYTES <= 99 * 1024


@pytest.mark.compile
def test_fold_sm120_resources():
    cfg = FoldConfig(4.0, "mcg")
    (k,) = sass.analyze_cubin(sass.compile_cubin(lambda options: fold_builder(cfg, options), "sm_120a"),
                              dynamic_smem_bytes=SMEM_BYTES)
    assert k.spill_instructions == 0 and k.frame_bytes == 0 and k.registers <= 96  # 3 CTAs per H200 SM
    assert k.smem_per_cta_bytes <= 99 * 1024
