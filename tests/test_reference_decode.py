"""Bit-exact decode: codebooks, ring windows, tile positions, Hadamard, legacy signs (format doc section 4).

The independent scalar decoder below is a line-by-line transcription of the format doc using Python ints and
numpy fp16; the vectorized reference must agree with it bit for bit.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from exl3tool.format import Codebook, words_from_bits
from exl3tool.reference import (
    decode_states, decode_trellis, hadamard128, pack_signs, tile_position, unpack_signs,
)
from exl3tool.reference.trellis import tile_states

ALL_RATES = [(cb, k) for cb in Codebook for k in range(1, 9)] + [(Codebook.MUL1, k) for k in (1.5, 2.5, 3.5)]


def fp16_bits(t: torch.Tensor) -> list[int]:
    return (t.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()


# --- the scalar transcription of the doc -----------------------------------------------------------------

def _half(bits: int) -> np.float16:
    return np.array([bits], dtype=np.uint16).view(np.float16)[0]


def scalar_state_to_fp16_bits(state: int, codebook: Codebook) -> int:
    if codebook is Codebook.MUL1:
        x = (state * 0x83DCD12D) & 0xFFFFFFFF
        t = sum((x >> s) & 0xFF for s in (0, 8, 16, 24))
        exact = (1024 + t) * float(_half(0x1EEE)) + float(_half(0xC931))  # exact in fp64
        value = np.float16(exact)  # one rounding: the fp16 FMA
    else:
        mul, add = (89226354, 64248484) if codebook is Codebook.INST3 else (0xCBAC1FED, 0)
        x = (state * mul + add) & 0xFFFFFFFF
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        value = np.float16(np.float32(_half(x & 0xFFFF)) + np.float32(_half(x >> 16)))
    return int(np.array([value]).view(np.uint16)[0])


def scalar_ring_bit(words: list[int], p: int) -> int:
    u = [w & 0xFFFF for w in words]
    w32 = u[2 * (p // 32)] | (u[2 * (p // 32) + 1] << 16)
    return (w32 >> (31 - p % 32)) & 1


def scalar_states(words: list[int], bits: float) -> list[int]:
    ring = 256 * bits
    whole, half = int(bits), bits != int(bits)
    states, end = [], 0
    for i in range(256):
        end += whole + (1 if half and (0xAAAA >> (i % 16)) & 1 else 0)
        s = 0
        for p in range(end - 16, end):
            s = (s << 1) | scalar_ring_bit(words, int(p % ring))
        states.append(s)
    return states


def scalar_position(i: int) -> tuple[int, int]:
    t, j = i // 8, i % 8
    return 2 * (t % 4) + (0, 1, 8, 9)[j % 4], t // 4 + 8 * (j >= 4)


# --- codebooks -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("codebook, vectors", [
    (Codebook.INST3, {0: 0x3A25, 1: 0xBB5B, 0x1234: 0xC066}),
    (Codebook.MCG, {0: 0x3F60, 1: 0x304E}),
    (Codebook.MUL1, {0: 0xC2E8, 1: 0x3921, 0xFFFF: 0xB936}),
])
def test_codebook_test_vectors(codebook, vectors):
    assert fp16_bits(decode_states(torch.tensor(list(vectors)), codebook)) == list(vectors.values())


@pytest.mark.parametrize("codebook", list(Codebook))
def test_every_state_matches_scalar_transcription(codebook):
    states = torch.arange(1 << 16)
    got = fp16_bits(decode_states(states, codebook))
    sample = list(range(0, 1 << 16, 97)) + [0xFFFF]
    assert [got[s] for s in sample] == [scalar_state_to_fp16_bits(s, codebook) for s in sample]


def test_decode_states_same_on_int16_and_int64_input():
    states = torch.arange(1 << 16)
    as_int16 = (states - ((states & 0x8000) << 1)).to(torch.int16)
    for codebook in Codebook:
        assert torch.equal(decode_states(states, codebook).view(torch.int16),
                           decode_states(as_int16, codebook).view(torch.int16))


# --- ring windows and positions --------------------------------------------------------------------------

def test_ring_test_vector():
    tile = torch.arange(32, dtype=torch.int16).view(1, 32)
    assert tile_states(tile, 2.0)[0, :8].tolist() == [0x78, 0x1E0, 0x780, 0x1E00, 0x7800, 0xE000, 0x8000, 0x1]


def test_position_table_first_entries():
    flat = [r * 16 + c for r, c in map(tile_position, range(8))]
    assert flat == [0, 16, 128, 144, 8, 24, 136, 152]
    assert sorted(r * 16 + c for r, c in map(tile_position, range(256))) == list(range(256))


@pytest.mark.parametrize("codebook, bits", ALL_RATES)
def test_random_tiles_match_scalar_transcription(codebook, bits):
    g = torch.Generator().manual_seed(int(bits * 10) + len(codebook.value))
    trellis = torch.randint(-(1 << 15), 1 << 15, (2, 1, words_from_bits(bits)), dtype=torch.int16, generator=g)
    w_hat = decode_trellis(trellis, codebook)
    assert w_hat.shape == (32, 16) and w_hat.dtype == torch.float16
    got = w_hat.view(torch.int16).to(torch.int64) & 0xFFFF
    for a in range(2):
        states = scalar_states(trellis[a, 0].tolist(), bits)
        for i, s in enumerate(states):
            r, c = scalar_position(i)
            assert got[16 * a + r, c].item() == scalar_state_to_fp16_bits(s, codebook), (a, i)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5])
def test_one_hot_ring_bits_land_where_the_permutation_says(bits):
    """Tile p has only ring bit p set: exactly the weights whose 16-bit window covers p see a nonzero state,
    each 1 << (S(i) - 1 - p), and each must appear at tile (row, col) of its trellis position."""
    words = words_from_bits(bits)
    ring = int(256 * bits)
    trellis = torch.zeros(ring, 1, words, dtype=torch.int32)
    for p in range(ring):
        b = 31 - p % 32  # bit of the little-endian uint32 pair
        word = 2 * (p // 32) + (b >= 16)
        trellis[p, 0, word] = 1 << (b % 16)
    trellis = (trellis - ((trellis & 0x8000) << 1)).to(torch.int16)
    codebook = Codebook.MUL1  # every state decodes to a distinct-enough value; checked via expected states
    w_hat = decode_trellis(trellis, codebook).view(ring, 16, 16)

    ends, end = [], 0
    for i in range(256):
        end += int(bits) + (1 if bits != int(bits) and (0xAAAA >> (i % 16)) & 1 else 0)
        ends.append(end)
    expected_states = torch.zeros(ring, 16, 16, dtype=torch.int64)
    for p in range(ring):
        for i, e in enumerate(ends):
            offset = (e - 1 - p) % ring  # distance of p from the window's last bit, circularly
            if offset < 16:
                r, c = scalar_position(i)
                expected_states[p, r, c] = 1 << offset
    expected = decode_states(expected_states, codebook)
    assert torch.equal(w_hat.view(torch.int16), expected.view(torch.int16))
    # the test can fail: a transposed tile would not match
    assert not torch.equal(w_hat.transpose(1, 2).contiguous().view(torch.int16), expected.view(torch.int16))


def test_tiles_map_to_row_and_column_blocks():
    g = torch.Generator().manual_seed(7)
    trellis = torch.randint(-(1 << 15), 1 << 15, (3, 2, 64), dtype=torch.int16, generator=g)
    full = decode_trellis(trellis, Codebook.MCG)
    for a in range(3):
        for b in range(2):
            alone = decode_trellis(trellis[a : a + 1, b : b + 1], Codebook.MCG)
            assert torch.equal(full[16 * a : 16 * a + 16, 16 * b : 16 * b + 16], alone)


def test_bits_argument_must_agree_with_trellis():
    trellis = torch.zeros(1, 1, 64, dtype=torch.int16)
    with pytest.raises(ValueError):
        decode_trellis(trellis, Codebook.MCG, bits=3)
    with pytest.raises(ValueError):
        decode_trellis(torch.zeros(1, 1, 50, dtype=torch.int16), Codebook.MCG)


def test_decode_large_linear_takes_seconds():
    """4096 x 14336 at K=4 (a Llama-3-8B MLP projection): vectorized, not a Python loop per tile."""
    trellis = torch.randint(-(1 << 15), 1 << 15, (4096 // 16, 14336 // 16, 64), dtype=torch.int16)
    start = time.perf_counter()
    w_hat = decode_trellis(trellis, Codebook.MUL1)
    elapsed = time.perf_counter() - start
    assert w_hat.shape == (4096, 14336)
    # the vectorized decode of the whole matrix puts every tile where decoding that tile alone does
    for r, c in ((0, 0), (255, 895), (17, 600)):
        tile = decode_trellis(trellis[r:r + 1, c:c + 1], Codebook.MUL1)
        assert torch.equal(w_hat[16 * r:16 * r + 16, 16 * c:16 * c + 16], tile)
    assert elapsed < 60, f"decode took {elapsed:.1f}s"


# --- Hadamard and signs ----------------------------------------------------------------------------------

def test_hadamard128_is_normalised_sylvester():
    h = hadamard128(torch.float64)
    popcount = torch.tensor([[bin(a & b).count("1") for b in range(128)] for a in range(128)])
    assert torch.equal(h * 128**0.5, (1 - 2 * (popcount % 2)).double())
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)


def test_legacy_signs_bit_order():
    packed = torch.tensor([0b101, -0x8000], dtype=torch.int16)  # word 1: only bit 15 set
    signs = unpack_signs(packed)
    expected = torch.ones(32, dtype=torch.float16)
    expected[[0, 2, 31]] = -1
    assert torch.equal(signs, expected)
    assert torch.equal(pack_signs(signs), packed)
