"""The fp32 torch reference for EXL3: the oracle every kernel is checked against. CPU or CUDA, torch only.

    decode_states(states, codebook) -> fp16                      16-bit state -> weight, bit-exact
    decode_trellis(trellis, codebook, bits=None) -> fp16 (in_p, out_p)   W_hat, vectorized over all tiles
    hadamard128(dtype=torch.float32, device=None) -> (128, 128)  normalised Sylvester Hadamard
    rotate_input(x_padded, suh) -> fp32 [M, in_p]                H128 per 128 block of x * suh
    rotate_output(y_hat, svh, bias=None) -> fp32 [M, out_p]      H128 per block, * svh, + bias
    linear_forward(x, tensors) -> fp32 [M, out_features]         x is [M, in_features], any float dtype
    reconstruct(tensors) -> fp32 (in_p, out_p)                   padded W with y = x_pad @ W
    dequantize(tensors) -> fp32 [out_features, in_features]      HF orientation, true sizes
    gated_mlp_forward / route / moe_forward                      whole dense-MLP and MoE blocks
    ACTIVATIONS, activation_fn(kind, tensor, limit)(gate, up)    the MLPs' intermediates (format.ACTIVATION_KINDS)
    unpack_signs / pack_signs                                    legacy su/sv <-> +-1 vectors
"""

from exl3tool.reference.blocks import (
    ACTIVATIONS, GatedMLPTensors, activation_fn, gated_mlp_forward, moe_forward, route,
)
from exl3tool.reference.codebooks import decode_states, fp16_from_bits
from exl3tool.reference.hadamard import hadamard128, rotate_input, rotate_output
from exl3tool.reference.linear import decode_w_hat, dequantize, linear_forward, reconstruct
from exl3tool.reference.signs import pack_signs, unpack_signs
from exl3tool.reference.trellis import decode_tiles, decode_trellis, tile_position, window_ends

__all__ = [
    "ACTIVATIONS", "GatedMLPTensors", "activation_fn", "decode_states", "decode_tiles", "decode_trellis",
    "decode_w_hat", "dequantize", "fp16_from_bits", "gated_mlp_forward", "hadamard128", "linear_forward",
    "moe_forward", "pack_signs", "reconstruct", "rotate_input", "rotate_output", "route", "tile_position",
    "unpack_signs", "window_ends",
]
