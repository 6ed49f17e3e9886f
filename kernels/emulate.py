"""NumPy mirror of ``kernels.ptx``: the same instruction names with exact uint32 / fp16 semantics.

Used on the CPU to run the device decode sequence (``kernels.trellis``) bit for bit, so CI checks the very
algorithm the GPU executes. Arguments are uint32 arrays (or anything NumPy broadcasts); results are uint32.
"""

import numpy as np

_MASK = np.uint64(0xFFFFFFFF)


def _u64(x):
    return np.asarray(x).astype(np.uint64)


def _u32(x):
    return (np.asarray(x).astype(np.uint64) & _MASK).astype(np.uint32)


def shf_l(lo, hi, shift):
    n = np.minimum(_u64(shift), np.uint64(32))
    joined = (_u64(hi) << np.uint64(32)) | _u64(lo)
    return _u32((joined << n) >> np.uint64(32))


def shf_l_imm(lo, hi, shift):
    return shf_l(lo, hi, shift)


def shl(x, shift):
    n = _u64(shift)
    return np.where(n >= 32, np.uint32(0), _u32(_u64(x) << np.minimum(n, np.uint64(31))))


def shl_imm(x, shift):
    return _u32(_u64(x) << np.uint64(shift))


def half_sums(a, b):
    alo, ahi = _halves(a)
    blo, bhi = _halves(b)
    return _pack(alo + ahi, blo + bhi)


def cut16(x, byte):
    return _u32((_u64(x) >> np.uint64(16 - 8 * byte)) & np.uint64(0xFFFF))



def mul_lo_imm(x, factor):
    return _u32(_u64(x) * np.uint64(factor & 0xFFFFFFFF))


def mad_lo_imm(x, factor, addend):
    return _u32(_u64(x) * np.uint64(factor & 0xFFFFFFFF) + np.uint64(addend & 0xFFFFFFFF))


def mad_lo_imm_add(x, factor, addend):
    return _u32(_u64(x) * np.uint64(factor & 0xFFFFFFFF) + _u64(addend))


def pinned(value):
    return np.uint32(value)


def and_xor(x, mask, flip):
    return _u32((_u64(x) & np.uint64(mask)) ^ _u64(flip))


def prmt_imm(a, b, selector):
    pool = (_u64(b) << np.uint64(32)) | _u64(a)  # bytes 0-3 from a, 4-7 from b
    out = np.zeros(np.broadcast(np.asarray(a), np.asarray(b)).shape, dtype=np.uint64)
    for byte in range(4):
        src = (selector >> (4 * byte)) & 0x7
        out |= ((pool >> np.uint64(8 * src)) & np.uint64(0xFF)) << np.uint64(8 * byte)
    return _u32(out)


def dp4a_bytesum(x, base):
    v = _u64(x)
    total = sum((v >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4))
    return _u32(total + np.uint64(base))


def _halves(x):
    v = _u32(x)
    lo = (v & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
    hi = (v >> np.uint32(16)).astype(np.uint16).view(np.float16)
    return lo.astype(np.float64), hi.astype(np.float64)


def _pack(lo, hi):
    # float64 holds every fp16 sum/product below exactly, so one rounding to fp16 = PTX's .rn result.
    lo16 = np.asarray(lo).astype(np.float16).view(np.uint16).astype(np.uint32)
    hi16 = np.asarray(hi).astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo16 | (hi16 << np.uint32(16))



def dup_half(x, half):
    h = (_u32(x) >> np.uint32(16 * half)) & np.uint32(0xFFFF)
    return h | (h << np.uint32(16))  # x + (-0.0) is x for every fp16 value but NaN payloads


def hfma2_imm(a, mul, add):
    alo, ahi = _halves(a)
    mlo, mhi = _halves(np.uint32(mul))
    clo, chi = _halves(np.uint32(add))
    return _pack(alo * mlo + clo, ahi * mhi + chi)


def mma_m16n8k16(a, b, c):
    """Warp-wide ``mma.m16n8k16.row.col`` on per-lane fragments (arrays indexed [lane]) in float64.

    a: 4 fp16x2 registers per lane, b: 2, c: 4 float accumulators. Returns the 4 D registers per lane.
    """
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for reg, (row, col) in enumerate(((g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8))):
            lo, hi = _halves(a[reg][lane])
            A[row, col], A[row, col + 1] = lo, hi
        for reg, k in enumerate((2 * q, 2 * q + 8)):
            lo, hi = _halves(b[reg][lane])
            B[k, g], B[k + 1, g] = lo, hi
    D = A @ B
    out = [np.zeros(32) for _ in range(4)]
    for lane in range(32):
        g, q = lane // 4, lane % 4
        out[0][lane] = D[g, 2 * q] + c[0][lane]
        out[1][lane] = D[g, 2 * q + 1] + c[1][lane]
        out[2][lane] = D[g + 8, 2 * q] + c[2][lane]
        out[3][lane] = D[g + 8, 2 * q + 1] + c[3][lane]
    return out


def mma_m16n8k16_f32(a, b, c, dtype):
    """``ptx.mma_m16n8k16_f32`` for fp16 operands (``mma_m16n8k16``)."""
    assert dtype == "float16"
    return mma_m16n8k16(a, b, c)


def split_product(x, s):
    """``ptx.split_product``: fp16x2 hi = round(x * s), lo = round(x * s - hi) (fp16 arithmetic, one rounding each)."""
    xl, xh = _halves(x)
    sl, sh = _halves(s)
    hi = _pack(xl * sl, xh * sh)
    hl, hh = _halves(hi)
    return hi, _pack(xl * sl - hl, xh * sh - hh)
