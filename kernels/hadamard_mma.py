"""H128 of 16 rows at once on the tensor cores (beside ``rotate.hadamard128``'s shuffle butterflies).

Layout ("runs"): thread (g, q) of a warp holds rows g and g + 8 of the 16 and, of the 128-column block, the four
16-byte pieces ``32i + 8q .. 32i + 8q + 7`` (i < 4), in and out: its run value ``j = 8i + u`` is column
``run_column(q, j) = 32i + 8q + u``. A warp's 16-byte access to piece i then covers 64 contiguous bytes of each
fp16 row it touches (whole 32-byte sectors). Below, ``j = 4b + 2h + e``.

The Sylvester H128 is a product over the bits of the column index, ``H[c, c'] = (-1)^popcount(c & c')``, so it
splits into an H16 over column bits (4, 3, 1, 0) = (q, h, e) and an H8 over bits (6, 5, 2) = b. The H16 part runs
on the tensor cores with the 16 rows as M: the bits (q, h, e) are exactly where the mma fragments put a quad's K
values (A) and N values (C), so no value moves between lanes. The H8 part is three add/sub stages over b in each
thread's registers. Output value ``j = 4d + 2t + e'``: d from the H8, (t, e') the mma's N tile and column.

Operands must be exact for the sums to be fp32-accurate, so each fp16 product x * s goes in as two parts summed
by the MMAs (``ptx.split_product``): hi = fp16(x * s), lo = fp16(x * s - hi), one HMUL2 and one HFMA2 a word;
exact while lo stays a normal fp16, which a power-of-two prescale of s into [1/2, 1] keeps for any |x| >= 1/8
(smaller x lose bits below 2^-25), and x * s cannot overflow then.
The sums run in another order than the butterflies', so the bits differ from ``hadamard128``'s in the last
places. Written over ``ops`` (``kernels.ptx`` on the GPU, ``kernels.emulate`` on per-lane NumPy arrays), so CI
runs the very fragment plan the kernels use.
"""

from .rotate import INV_SQRT_128

RUN = 32  # columns of a row a thread holds (run_column)
ONE_F16 = 0x3C00  # 1.0; the sign bit makes -1.0


def run_column(q, j):
    """The block column of run value ``j`` of quad q (Int32 on the GPU, integer arrays on the CPU)."""
    return ((j >> 3) << 5) + (q << 3) + (j & 7)


def h16_index(q, h, e):
    """The H16 index (column bits 4, 3, 1, 0) of run value ``4b + 2h + e`` of quad q."""
    return (q << 2) | (h << 1) | e


def _negative(i, k):
    """popcount(i & k) & 1 for 4-bit indices (Int32 on the GPU, integer arrays on the CPU)."""
    x = i & k
    return (x ^ (x >> 1) ^ (x >> 2) ^ (x >> 3)) & 1


def _out_index(g, t):
    """The H16 index of the output column a B fragment's column n = g of N tile t stands for: n = 2q' + e'."""
    return h16_index(g >> 1, t, g & 1)


def f16_fragments(lane):
    """B of ``mma.m16n8k16`` (H16, fp16 +-1) for N tiles t = 0, 1: thread (g, q) holds k = 2q, 2q+1 (b0) and
    2q+8, 2q+9 (b1) of column n = g; k = 8h + 2q + e is run value 2h + e of quad q."""
    g, q = lane // 4, lane % 4
    tiles = []
    for t in range(2):
        words = []
        for h in range(2):
            lo, hi = (ONE_F16 | (_negative(h16_index(q, h, e), _out_index(g, t)) << 15) for e in range(2))
            words.append(lo | (hi << 16))
        tiles.append(tuple(words))
    return tiles


def h8(z, c):
    """The 8-point Walsh-Hadamard transform of ``z`` (Sylvester order) times ``c``: three add/sub stages, the
    first as ``a * c + b * c`` and ``a * c - b * c`` (one multiply and two FMAs a pair instead of a multiply per
    output after the stages)."""
    out = list(z)
    for i in range(0, 8, 2):
        t = z[i + 1] * c
        out[i], out[i + 1] = z[i] * c + t, z[i] * c - t
    z = out
    for step in (2, 4):
        out = list(z)
        for i in range(8):
            if i & step == 0:
                out[i], out[i + step] = z[i] + z[i + step], z[i] - z[i + step]
        z = out
    return z


def _finish(z, scale: float):
    """``z[r][t][e][b]`` (the H16 pass) -> run values ``out[r][4d + 2t + e]`` after the H8 pass, times
    ``scale / sqrt(128)``."""
    scale = scale * INV_SQRT_128
    out = [[None] * RUN for _ in range(2)]
    for r in range(2):
        for t in range(2):
            for e in range(2):
                w = h8(z[r][t][e], scale)
                for d in range(8):
                    out[r][4 * d + 2 * t + e] = w[d]
    return out


def hadamard128_f16(hi, lo, lane, ops, zero, scale):
    """``hi[r][w]``, ``lo[r][w]``: fp16x2 words of the thread's rows g + 8r, word w = run values 2w, 2w + 1 (w =
    2b + h). Returns each row's H128 (orthonormal) of hi + lo, times ``scale`` (a float), as run values
    ``out[r][j]``."""
    fragments = f16_fragments(lane)
    z = [[[[None] * 8 for _ in range(2)] for _ in range(2)] for _ in range(2)]
    for b in range(8):
        # A: (row g, k 2q..), (row g+8, k 2q..), (row g, k 2q+8..), (row g+8, k 2q+8..): words 2b + h
        parts = [[src[r][2 * b + h] for h in range(2) for r in range(2)] for src in (hi, lo)]
        for t in range(2):
            c = ops.mma_m16n8k16_f32(parts[0], fragments[t], [zero] * 4, "float16")
            c = ops.mma_m16n8k16_f32(parts[1], fragments[t], c, "float16")
            z[0][t][0][b], z[0][t][1][b], z[1][t][0][b], z[1][t][1][b] = c
    return _finish(z, scale)
