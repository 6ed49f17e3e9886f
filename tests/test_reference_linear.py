"""The fp32 linear reference on synthetic linears: all codebooks, K 1..8 and half rates, legacy su/sv, bias,
odd true sizes. Checked against an independent float64 construction with explicit block-diagonal Hadamards."""

from __future__ import annotations

import pytest
import torch

from exl3tool.format import Codebook
from exl3tool.reference import (
    decode_trellis, dequantize, hadamard128, linear_forward, reconstruct, rotate_input, rotate_output,
)
from exl3tool.synthetic import random_linear

CASES = [(cb, k) for cb in Codebook for k in range(1, 9)] + [(Codebook.MUL1, k) for k in (1.5, 2.5, 3.5)]


def dense_weight_f64(t) -> torch.Tensor:
    """W = diag(suh) Hbd W_hat Hbd diag(svh), built with explicit block-diagonal matrices in float64."""
    info = t.info
    h = hadamard128(torch.float64)
    h_in = torch.block_diag(*[h] * (info.in_padded // 128))
    h_out = torch.block_diag(*[h] * (info.out_padded // 128))
    w_hat = decode_trellis(t.trellis, info.codebook).double()
    return torch.diag(t.suh.double()) @ h_in @ w_hat @ h_out @ torch.diag(t.svh.double())


@pytest.mark.parametrize("codebook, bits", CASES)
@pytest.mark.parametrize("legacy, bias", [(False, False), (True, True)])
def test_linear_forward_matches_dense_construction(codebook, bits, legacy, bias):
    t = random_linear(200, 330, bits, codebook, seed=int(bits * 8), bias=bias, legacy_signs=legacy)
    w = dense_weight_f64(t)
    x = torch.randn(5, 200, dtype=torch.float64)
    expected = torch.nn.functional.pad(x, (0, 56)) @ w
    if bias:
        expected = expected + t.bias.double()
    expected = expected[:, :330]
    got = linear_forward(x.half(), t)  # any float dtype in; fp16 input rounding is part of the comparison
    expected_from_half = (torch.nn.functional.pad(x.half().double(), (0, 56)) @ w
                          + (t.bias.double() if bias else 0))[:, :330]
    assert got.dtype == torch.float32 and got.shape == (5, 330)
    rel = (got.double() - expected_from_half).norm() / expected_from_half.norm()
    assert rel < 1e-5
    assert (got.double() - expected).norm() / expected.norm() < 2e-3  # only the fp16 input rounding differs
    deq = dequantize(t)
    assert deq.shape == (330, 200) and deq.dtype == torch.float32
    assert torch.allclose(deq.double(), w[:200, :330].T, rtol=0, atol=1e-6 * w.abs().max().item())


@pytest.mark.parametrize("codebook", list(Codebook))
def test_one_hot_inputs_give_the_dequantized_weight(codebook):
    t = random_linear(130, 260, 3 if codebook is not Codebook.MUL1 else 2.5, codebook, seed=3)
    out = linear_forward(torch.eye(130), t)  # row i of the output is input row i of W
    assert torch.allclose(out, dequantize(t).T, atol=1e-6, rtol=1e-5)


def test_padded_output_columns_are_exactly_zero():
    t = random_linear(128, 300, 4, Codebook.MCG, seed=1)
    w = reconstruct(t)
    assert w.shape == (128, 384)
    assert torch.count_nonzero(w[:, 300:]) == 0
    assert torch.count_nonzero(w[:, :300]) > 0.99 * 128 * 300


def test_rotations_are_blockwise_hadamard():
    h = hadamard128(torch.float64)
    x = torch.randn(3, 256, dtype=torch.float64)
    suh = torch.randn(256).half()
    svh = torch.randn(256).half()
    bias = torch.randn(256).half()
    hbd = torch.block_diag(h, h)
    assert torch.allclose(rotate_input(x, suh).double(), (x * suh.double()) @ hbd, atol=1e-5)
    assert torch.allclose(rotate_output(x, svh, bias).double(), (x @ hbd) * svh.double() + bias.double(), atol=1e-5)


@pytest.mark.gpu
def test_reference_runs_on_cuda():
    t = random_linear(128, 128, 4, Codebook.MCG, seed=5)
    x = torch.randn(2, 128)
    assert torch.allclose(linear_forward(x.cuda(), t).cpu(), linear_forward(x, t), atol=1e-5)
