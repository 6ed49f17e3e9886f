"""The 128-point Hadamard rotations that wrap every EXL3 linear (format doc section 5)."""

from __future__ import annotations

from functools import lru_cache

import torch

from exl3tool.format import PAD


@lru_cache(maxsize=None)
def _hadamard_cpu() -> torch.Tensor:
    idx = torch.arange(PAD)
    popcount = torch.zeros(PAD, PAD, dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    for bit in range(7):
        popcount += (both >> bit) & 1
    return (1.0 - 2.0 * (popcount % 2)).to(torch.float64) / PAD**0.5


def hadamard128(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Normalised natural-order Sylvester Hadamard, H[i, j] = (-1)^popcount(i & j) / sqrt(128): symmetric,
    its own inverse."""
    return _hadamard_cpu().to(dtype=dtype, device=device)


def _blockwise(x: torch.Tensor) -> torch.Tensor:
    """x [M, n*128] fp32 -> each consecutive 128 block times H128."""
    rows, width = x.shape
    if width % PAD:
        raise ValueError(f"width {width} is not a multiple of {PAD}")
    h = hadamard128(torch.float32, x.device)
    return (x.reshape(rows, width // PAD, PAD) @ h).reshape(rows, width)


def rotate_input(x_padded: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
    """fp32 [M, in_p]: H128 per 128 block of (x * suh). `x_padded` is [M, in_p], already zero-padded."""
    return _blockwise(x_padded.float() * suh.float())


def rotate_output(y_hat: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, out_p]: H128 per 128 block of y_hat, times svh, plus bias."""
    y = _blockwise(y_hat.float()) * svh.float()
    return y if bias is None else y + bias.float()
