"""The fold kernel (kernels/fold.py) on the CPU: its lane/register/shared-memory index plan, emulated with NumPy in
fp32 on one 128x128 block, is the canonical fp32 order bit for bit (so W' is the same as before the index plan
changed) and the reference reconstruction within rounding; its shared-memory accesses are free of bank conflicts;
it compiles for SM120 and SM90 with one shuffle stage, no spills, and a CTA within SM120's 99 KB of shared memory."""

import numpy as np
import pytest

from exl3tool import sass
from exl3tool.kernels import emulate
from exl3tool.kernels import fold
from exl3tool.kernels.fold import SMEM_BYTES, FoldConfig, register_butterflies
from exl3tool.kernels.trellis import TrellisPlan, codebook_constants, decode_lane, lane_word_indices
from exl3tool.reference.linear import reconstruct
from exl3tool.synthetic import random_linear
from exl3tool.ops.fold import fold_builder
from exl3tool.ops.runtime import compile_with_ptx

LANES = np.arange(32)
f32 = np.float32


def butterflies(v, lane_bits):
    """fold.butterflies on NumPy fp32: v is a list of [32]-lane arrays (one per register); the register stages are
    the kernel's own code, the lane exchange mirrors shfl.bfly (partner + sign * self)."""
    v = register_butterflies(v)
    for bit in lane_bits:
        sign = (1.0 - 2.0 * ((LANES >> bit) & 1)).astype(f32)
        v = [x[LANES ^ (1 << bit)] + sign * x for x in v]
    return v


def decoded_rows(t, bits, codebook, bi, bj, warp):
    """Step D's registers of one warp: rows[r4][m] ([32] lanes, fp32), as the kernel decodes them."""
    plan = TrellisPlan(bits)
    words = t.trellis.numpy().view(np.uint32).reshape(t.trellis.shape[0], t.trellis.shape[1], -1)
    idx, shift = lane_word_indices(plan, LANES)
    rows = [[None] * 16 for _ in range(4)]
    for n in range(8):
        pairs = decode_lane(plan, codebook, [words[bi * 8 + warp, bj * 8 + n, i] for i in idx], shift, emulate,
                            codebook_constants(codebook, emulate))
        for p in range(4):
            halves = emulate._halves(pairs[p])
            for h in range(2):
                j = 2 * p + h
                rows[j % 4][2 * n + j // 4] = halves[h].astype(f32)  # fp16 values: exact
    return rows


def read_pieces(smem, word, rows_cols, warp):
    """A warp's 8 x 8 values of a phase (``word``: its 16-byte pieces' first words), each word checked against
    the (row, column) address map ``rows_cols`` the phase claims to read."""
    values = [[None] * 8 for _ in range(8)]
    for a in range(8):
        for hp in range(2):
            w = word(warp, LANES, a, hp)
            for e in range(4):
                assert np.array_equal(w + e, fold.smem_word(*rows_cols(warp, LANES, a, 4 * hp + e)))
                values[a][4 * hp + e] = smem[w + e]
    return values


def emulated_fold_block(t, bits, codebook, bi, bj):
    """W'[bi block, bj block] in fp32 exactly as the kernel computes and indexes it (before the final rounding),
    with every shared-memory address checked against ``smem_word`` of the row and column it stands for."""
    suh, svh = t.suh.float().numpy(), t.svh.float().numpy()
    smem = np.full(128 * 128, np.nan, dtype=f32)
    for warp in range(8):  # D
        rows = decoded_rows(t, bits, codebook, bi, bj, warp)
        for r4 in range(4):
            v = register_butterflies(rows[r4])
            for m in range(16):
                w = fold.d_word(warp, LANES, r4, m)
                assert np.array_equal(w, fold.smem_word(*fold.d_rows_cols(warp, LANES, r4, m)))
                smem[w] = v[m]
    assert not np.isnan(smem).any()
    stored = np.zeros(128 * 128, int)
    for warp in range(8):  # E: each thread rewrites the words it read
        x = read_pieces(smem, fold.e_word, fold.e_rows_cols, warp)
        cq = LANES // 16 + 2 * warp
        scale = [svh[bj * 128 + 8 * cq + k] * f32(1.0 / 128.0) for k in range(8)]
        for a in range(8):
            x[a] = [v * scale[k] for k, v in enumerate(register_butterflies(x[a]))]
        for k in range(8):
            col = butterflies([x[a][k] for a in range(8)], (3,))
            for a in range(8):
                x[a][k] = col[a]
        for a in range(8):
            for hp in range(2):
                w = fold.e_word(warp, LANES, a, hp)
                for e in range(4):
                    smem[w + e] = x[a][4 * hp + e]
                    np.add.at(stored, w + e, 1)
    assert (stored == 1).all()
    out = np.full((128, 128), np.nan, dtype=f32)
    for warp in range(8):  # F
        y = read_pieces(smem, fold.f_word, fold.f_rows_cols, warp)
        for k in range(8):
            col = register_butterflies([y[b][k] for b in range(8)])
            for b in range(8):
                i, c = fold.f_rows_cols(warp, LANES, b, k)
                out[i, c] = col[b] * suh[bi * 128 + i]
    return out


def canonical_fold_block(t, bits, codebook, bi, bj, order=(3, 4, 5, 6, 0, 1, 2)):
    """The fp32 arithmetic W' is defined by (module docstring): butterflies over the column bits in ``order``,
    times svh/128, then over the row bits in ``order``, times suh."""
    suh, svh = t.suh.float().numpy(), t.svh.float().numpy()
    w = np.zeros((128, 128), f32)
    for warp in range(8):
        rows = decoded_rows(t, bits, codebook, bi, bj, warp)
        for r4 in range(4):
            for m in range(16):
                w[fold.d_rows_cols(warp, LANES, r4, m)] = rows[r4][m]

    def hadamard(x, axis):
        x = np.moveaxis(x.copy(), axis, 0)
        for bit in order:
            lo = np.arange(128)[(np.arange(128) >> bit) & 1 == 0]
            a, b = x[lo].copy(), x[lo | (1 << bit)].copy()
            x[lo], x[lo | (1 << bit)] = a + b, a - b
        return np.moveaxis(x, 0, axis)

    w = hadamard(w, 1) * (svh[bj * 128:(bj + 1) * 128] * f32(1.0 / 128.0))[None, :]
    return hadamard(w, 0) * suh[bi * 128:(bi + 1) * 128][:, None]


@pytest.mark.parametrize("bits,codebook", [(4.0, "mcg"), (3.0, "3inst"), (2.5, "mul1"), (8.0, "mcg")])
def test_fold_index_plan_is_the_canonical_order_and_the_reconstruction(bits, codebook):
    t = random_linear(256, 384, bits, codebook, seed=5)
    ref = reconstruct(t).double().numpy()
    for bi, bj in [(0, 0), (1, 2)]:
        got = emulated_fold_block(t, bits, codebook, bi, bj)
        canonical = canonical_fold_block(t, bits, codebook, bi, bj)
        assert np.array_equal(got.view(np.uint32), canonical.view(np.uint32))
        # The order matters (so the identity above says something): natural bit order rounds differently.
        assert not np.array_equal(canonical, canonical_fold_block(t, bits, codebook, bi, bj, order=range(7)))
        np.testing.assert_allclose(got, ref[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128], rtol=1e-5,
                                   atol=1e-6 * np.abs(ref).max())  # ref: fp32 torch


def test_fold_shared_memory_accesses_are_free_of_bank_conflicts():
    for warp in range(8):
        for r4 in range(4):
            for m in range(16):  # scalar stores: 32 lanes, 32 banks
                assert len(set(fold.d_word(warp, LANES, r4, m) % 32)) == 32
        for word in (fold.e_word, fold.f_word):
            for a in range(8):
                for hp in range(2):  # 16-byte accesses: each quarter warp covers the 8 16-byte bank groups
                    w = word(warp, LANES, a, hp)
                    assert (w % 4 == 0).all()
                    for quarter in range(4):
                        assert len(set(w[8 * quarter:8 * quarter + 8] // 4 % 8)) == 8


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
@pytest.mark.parametrize("cfg", [FoldConfig(4.0, "mcg"), FoldConfig(2.0, "3inst", "bfloat16"),
                                 FoldConfig(3.5, "mul1"), FoldConfig(6.0, "mcg", "bfloat16")], ids=str)
def test_fold_compiles(cfg, arch):
    ptx = compile_with_ptx(lambda options: fold_builder(cfg, options), arch)
    # One shuffle stage (i6) on each of a thread's 64 values; every other butterfly in registers.
    assert ptx.count("shfl.sync.bfly") == 64
    # Shared memory: 64 scalar stores (D), 16-byte loads and stores (E), 16-byte loads (F).
    assert ptx.count("st.shared.f32") == 64 and ptx.count("st.shared.v4") == 16 and ptx.count("ld.shared.v4") == 32
    # W' leaves as 16-byte row pieces only: 8 rows of 8 columns per thread.
    assert ptx.count("st.global.v4") == ptx.count("st.global") == 8
    assert "mul.rn.f32" in ptx  # the svh scale is never contracted into the column butterflies
    assert SMEM_BYTES <= 99 * 1024


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_fold_resources(arch):
    cfg = FoldConfig(4.0, "mcg")
    (k,) = sass.analyze_cubin(sass.compile_cubin(lambda options: fold_builder(cfg, options), arch),
                              dynamic_smem_bytes=SMEM_BYTES)
    assert k.spill_instructions == 0 and k.frame_bytes == 0 and k.registers <= 80  # 3 CTAs per H200 SM
    assert k.smem_per_cta_bytes <= 99 * 1024
