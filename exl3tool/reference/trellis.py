"""Trellis tiles -> W_hat, vectorized (format doc sections 4.1, 4.2, 4.4, 4.5).

A tile is 16K int16 words forming a circular ring of R = 256K bits (MSB first within little-endian uint32
pairs). Weight i's 16-bit state is the ring window ending at S(i), read modulo R. Weight i of a tile lands at
tile row/column given by the mma.m16n8k16 B-fragment order. Everything position-dependent is a 256-entry
table per K, so decoding is a few gathers over all tiles at once (in chunks to bound memory).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from exl3tool.format import TILE, Codebook, bits_from_words
from exl3tool.reference.codebooks import decode_states

TILE_WEIGHTS = TILE * TILE
_HALF_RATE_EXTRA = 0xAAAA  # at K = A + 0.5, weight i takes A bits plus one when bit (i % 16) of this is set
_CHUNK_TILES = 1 << 14  # tiles decoded per step: bounds the int64 temporaries to ~100 MB


def window_ends(bits: float) -> list[int]:
    """S(i) for i = 0..255: the ring position just past weight i's state."""
    whole = int(bits)
    half = bits != whole
    ends, pos = [], 0
    for i in range(TILE_WEIGHTS):
        pos += whole + (1 if half and (_HALF_RATE_EXTRA >> (i % 16)) & 1 else 0)
        ends.append(pos)
    return ends


def tile_position(i: int) -> tuple[int, int]:
    """(row, col) inside the 16x16 tile of weight i in trellis order: lane t = i // 8 holds B-fragment slot j."""
    t, j = divmod(i, 8)
    row = 2 * (t % 4) + (0, 1, 8, 9)[j % 4]
    col = t // 4 + 8 * (j >= 4)
    return row, col


@lru_cache(maxsize=None)
def _tables(bits: float, device_str: str):
    """Per weight: index of the high uint32 word of its window, and the right shift of the joined 64 bits."""
    ring_bits = TILE_WEIGHTS * bits
    words32 = int(ring_bits) // 32
    starts = [(end - 16) % int(ring_bits) for end in window_ends(bits)]
    hi_word = torch.tensor([s // 32 for s in starts], dtype=torch.int64)
    lo_word = (hi_word + 1) % words32
    shift = torch.tensor([48 - s % 32 for s in starts], dtype=torch.int64)
    # scatter destination of weight i inside the flattened 16x16 tile
    dest = torch.tensor([r * TILE + c for r, c in map(tile_position, range(TILE_WEIGHTS))], dtype=torch.int64)
    device = torch.device(device_str)
    return hi_word.to(device), lo_word.to(device), shift.to(device), dest.to(device)


def tile_states(tiles: torch.Tensor, bits: float) -> torch.Tensor:
    """States (int64, trellis order) of `tiles` [N, 16K] int16 -> [N, 256]."""
    hi_word, lo_word, shift, _ = _tables(bits, str(tiles.device))
    u = tiles.to(torch.int64) & 0xFFFF
    w32 = u[:, 0::2] | (u[:, 1::2] << 16)  # [N, 8K] little-endian word pairs
    joined = (w32[:, hi_word] << 32) | w32[:, lo_word]  # 64 bits holding the whole 16-bit window
    return (joined >> shift) & 0xFFFF


def decode_tiles(tiles: torch.Tensor, codebook: Codebook | str, bits: float) -> torch.Tensor:
    """fp16 [N, 16, 16] tiles (row = input offset, col = output offset) from int16 [N, 16K] trellis tiles."""
    *_, dest = _tables(bits, str(tiles.device))
    values = decode_states(tile_states(tiles, bits), codebook)
    out = torch.empty_like(values)
    out[:, dest] = values
    return out.view(-1, TILE, TILE)


def decode_trellis(trellis: torch.Tensor, codebook: Codebook | str, bits: float | None = None) -> torch.Tensor:
    """W_hat fp16 (in_p, out_p) from a trellis int16 (in_p/16, out_p/16, 16K). K is read from the last dim;
    `bits`, when given, must agree with it."""
    if trellis.dim() != 3:
        raise ValueError(f"trellis must be 3-D (in_p/16, out_p/16, 16K), got shape {tuple(trellis.shape)}")
    rows, cols, words = trellis.shape
    inferred = bits_from_words(words)
    if inferred is None:
        raise ValueError(f"trellis last dim {words} is not 16*K for any EXL3 K")
    if bits is not None and float(bits) != inferred:
        raise ValueError(f"bits={bits} disagrees with the trellis last dim {words} (K={inferred})")
    flat = trellis.reshape(rows * cols, words)
    tiles = torch.empty((rows * cols, TILE, TILE), dtype=torch.float16, device=trellis.device)
    for start in range(0, rows * cols, _CHUNK_TILES):  # chunks of many tiles, to bound memory
        tiles[start : start + _CHUNK_TILES] = decode_tiles(flat[start : start + _CHUNK_TILES], codebook, inferred)
    return tiles.view(rows, cols, TILE, TILE).permute(0, 2, 1, 3).reshape(rows * TILE, cols * TILE)
