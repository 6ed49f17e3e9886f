"""One EXL3 linear in fp32: y = H128(H128(x_pad * suh) @ W_hat) * svh + bias (format doc section 5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3tool.format import PAD, LinearTensors
from exl3tool.reference.hadamard import hadamard128, rotate_input, rotate_output
from exl3tool.reference.trellis import decode_trellis


def _check_input(x: torch.Tensor, width: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name}: input must be [M, {width}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: input must be floating point, got {x.dtype}")


def decode_w_hat(tensors: LinearTensors) -> torch.Tensor:
    """W_hat fp16 (in_p, out_p) of a loaded linear."""
    return decode_trellis(tensors.trellis, tensors.info.codebook, tensors.info.bits)


def linear_forward(x: torch.Tensor, tensors: LinearTensors) -> torch.Tensor:
    """fp32 [M, out_features] for x [M, in_features] (true size, any float dtype), computed on x's device."""
    info = tensors.info
    _check_input(x, info.in_features, info.name)
    t = tensors.to(x.device)
    x_padded = F.pad(x.float(), (0, info.in_padded - info.in_features))
    y_hat = rotate_input(x_padded, t.suh) @ decode_w_hat(t).float()
    return rotate_output(y_hat, t.svh, t.bias)[:, : info.out_features]


def reconstruct(tensors: LinearTensors) -> torch.Tensor:
    """The padded weight W = diag(suh) Hbd W_hat Hbd diag(svh), fp32 (in_p, out_p), so that y = x_pad @ W."""
    in_p, out_p = tensors.info.in_padded, tensors.info.out_padded
    w = decode_w_hat(tensors).float()
    h = hadamard128(torch.float32, w.device)
    w = (h @ w.reshape(in_p // PAD, PAD, out_p)).reshape(in_p, out_p)  # Hbd from the left: per row block
    w = (w.reshape(in_p, out_p // PAD, PAD) @ h).reshape(in_p, out_p)  # Hbd from the right: per column block
    return w * tensors.suh.float()[:, None] * tensors.svh.float()[None, :]


def dequantize(tensors: LinearTensors) -> torch.Tensor:
    """fp32 weight in HF orientation [out_features, in_features] (true sizes); bias not included."""
    info = tensors.info
    return reconstruct(tensors)[: info.in_features, : info.out_features].T.contiguous()
