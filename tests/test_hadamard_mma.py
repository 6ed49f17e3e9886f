"""The tensor-core H128 of 16 rows (kernels/hadamard_mma.py) on the CPU: its fragment plan, emulated with NumPy
(kernels/emulate.py), against H128 as a matrix."""

import numpy as np

from exl3tool.kernels import emulate
from exl3tool.kernels.hadamard_mma import RUN, hadamard128_f16, run_column

LANES = np.arange(32)
G, Q = LANES // 4, LANES % 4


def h128() -> np.ndarray:
    i = np.arange(128)
    parity = np.array([bin(x).count("1") & 1 for x in range(128)])[np.bitwise_and.outer(i, i)]
    return (1 - 2 * parity) / np.sqrt(128.0)


def spread(tile):
    """A 16 x 128 tile as the threads hold it: v[r][j] = per-lane arrays (rows g + 8r, run_column(q, j))."""
    return [[tile[G + 8 * r, run_column(Q, j)] for j in range(RUN)] for r in range(2)]


def gather(v):
    out = np.full((16, 128), np.nan)
    for r in range(2):
        for j in range(RUN):
            assert np.isnan(out[G + 8 * r, run_column(Q, j)]).all()  # each position written once
            out[G + 8 * r, run_column(Q, j)] = v[r][j]
    return out


def words(tile16):
    """fp16 tile -> w[r][w] per-lane uint32 words of run values 2w, 2w+1."""
    bits = tile16.view(np.uint16).astype(np.uint32)
    return [[bits[G + 8 * r, run_column(Q, 2 * w)] | (bits[G + 8 * r, run_column(Q, 2 * w + 1)] << 16)
             for w in range(16)] for r in range(2)]


def test_f16_products_split_exactly_and_come_out_as_h128():
    """x * s of fp16 values (s prescaled into [1/2, 1]) splits exactly into hi + lo, so only the fp32 sums
    round; x from 1/8 up to fp16's largest values, no overflow."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((16, 128)) * np.exp(rng.uniform(-2, 9, (16, 1)))).clip(-65504, 65504)
    x = np.where(np.abs(x) < 0.125, 0.125, x).astype(np.float16)
    s = rng.uniform(0.5, 1.0, (16, 128)).astype(np.float16)
    pairs = [[emulate.split_product(a, b) for a, b in zip(xr, sr)] for xr, sr in zip(words(x), words(s))]
    hi = [[p[0] for p in row] for row in pairs]
    lo = [[p[1] for p in row] for row in pairs]
    out = gather(hadamard128_f16(hi, lo, LANES, emulate, np.zeros(32), 1.0))
    exact = x.astype(np.float64) * s.astype(np.float64)
    want = exact @ h128()
    assert np.isfinite(out).all()
    assert (np.abs(out - want).max(axis=1) < 1e-6 * np.abs(want).max(axis=1)).all()
    only_hi = gather(hadamard128_f16(hi, [[np.zeros(32, np.uint32)] * 16] * 2, LANES, emulate, np.zeros(32), 1.0))
    assert np.abs(only_hi - want).max() > 1e-5 * np.abs(want).max()  # lo carries bits hi does not


def test_a_warps_piece_covers_whole_sectors():
    """Piece i (run values 8i .. 8i+7) of the four lanes of a quad is 32 contiguous columns: 64 bytes of fp16."""
    for i in range(4):
        cols = sorted(int(run_column(q, 8 * i + u)) for q in range(4) for u in range(8))
        assert cols == list(range(32 * i, 32 * i + 32))
    assert sorted(int(run_column(q, j)) for q in range(4) for j in range(RUN)) == list(range(128))
