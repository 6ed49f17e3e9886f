"""Codebooks: a 16-bit trellis state -> one fp16 weight, bit-exact (format doc section 4.3).

All arithmetic is uint32 modulo 2**32, done here in int64 so that it is exact on any torch device.
"""

from __future__ import annotations

import torch

from exl3tool.format import Codebook

_MASK32 = 0xFFFFFFFF
_INST3_MUL, _INST3_ADD = 89226354, 64248484
_MCG_MUL = 0xCBAC1FED
_MUL1_MUL = 0x83DCD12D
_LUT_MASK, _LUT_XOR = 0x8FFF8FFF, 0x3B603B60
_MUL1_INV_BITS, _MUL1_BIAS_BITS = 0x1EEE, 0xC931


def fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers 0..0xFFFF as fp16 bit patterns."""
    return ((bits & 0xFFFF) - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.float16)


def _halves_sum(x: torch.Tensor) -> torch.Tensor:
    # fp16(lo + hi): the sum of two fp16 values is exact in fp32, so one rounding to fp16 matches the GPU's
    # add.f16 bit for bit.
    lo = fp16_from_bits(x & 0xFFFF).float()
    hi = fp16_from_bits(x >> 16).float()
    return (lo + hi).half()


def _mul1(x: torch.Tensor) -> torch.Tensor:
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    k_inv = fp16_from_bits(torch.tensor(_MUL1_INV_BITS)).float().item()
    k_bias = fp16_from_bits(torch.tensor(_MUL1_BIAS_BITS)).float().item()
    # (1024 + t) has <= 11 significant bits and k_inv 11, so the product and the sum are exact in fp32 (the result
    # spans < 24 bits): rounding that once to fp16 is exactly the fp16 FMA.
    return ((byte_sum + 1024).float() * k_inv + k_bias).half()


def decode_states(states: torch.Tensor, codebook: Codebook | str) -> torch.Tensor:
    """fp16 weights for 16-bit trellis `states` (any integer dtype, any shape, values 0..0xFFFF)."""
    codebook = Codebook(codebook)
    s = states.to(torch.int64) & 0xFFFF
    if codebook is Codebook.INST3:
        x = (s * _INST3_MUL + _INST3_ADD) & _MASK32
        return _halves_sum((x & _LUT_MASK) ^ _LUT_XOR)
    if codebook is Codebook.MCG:
        x = (s * _MCG_MUL) & _MASK32
        return _halves_sum((x & _LUT_MASK) ^ _LUT_XOR)
    return _mul1((s * _MUL1_MUL) & _MASK32)
