"""Legacy packed sign vectors (`su`/`sv`): bit j of int16 word i is element 16i+j, a set bit meaning -1."""

from __future__ import annotations

import torch


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """fp16 +-1 vector of length 16 * len(packed) from int16 words (LSB first)."""
    bits = (packed.to(torch.int32).unsqueeze(-1) >> torch.arange(16, device=packed.device, dtype=torch.int32)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """Inverse of `unpack_signs`: int16 words from a +-1 vector whose length is a multiple of 16."""
    bits = (signs.reshape(-1, 16) < 0).to(torch.int32)
    words = (bits << torch.arange(16, device=signs.device, dtype=torch.int32)).sum(-1)
    return (words - ((words & 0x8000) << 1)).to(torch.int16)
