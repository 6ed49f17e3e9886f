"""The fold kernel (W' = diag(suh) Hbd W_hat Hbd diag(svh), one rounding) and the large-M path built on it, against
the fp32 reference on fresh random inputs, outputs NaN-poisoned first."""

import random

import pytest
import torch

from exl3tool.ops.fold import folded_forward, folded_weight
from exl3tool.reference import linear_forward
from exl3tool.reference.linear import reconstruct
from tests.gpu.test_linear_kernels import CASES, cosine, device_linear, poisoned, random_case, rel_l2

pytestmark = pytest.mark.gpu


def fold_tolerance(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The GEMM paths' tolerance (tests/gpu/test_linear_kernels.py, fp32 outputs), plus rounding y to x's dtype
    (cuBLAS writes it), plus W' rounded once to x's dtype: at most half an ulp per weight. bf16's half ulp (2^-8)
    matters: without it, 1 of 200 random bf16 cases exceeded the bound (H200: rel L2 3.79e-3 against 3.66e-3; the
    others at most 0.92 of it)."""
    return 2e-3 + rel_l2(ref.to(dtype), ref) + {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_folded_weight_is_the_reconstruction_rounded_once(seed, dtype):
    rng = random.Random(seed)
    for bits, codebook in [(4.0, "mcg")] + rng.sample(CASES, 3):
        in_f, out_f = rng.randrange(64, 700), rng.randrange(64, 700)
        tensors, lin = device_linear(seed, in_f, out_f, bits, codebook)
        out = poisoned((lin.info.in_padded, lin.info.out_padded), dtype)
        got = folded_weight(lin, dtype, out=out).float().cpu()
        ref = reconstruct(tensors)
        eps = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
        # fp32 rotations (reordered sums: ~1e-6 relative), then one round-to-nearest: half an ulp, plus subnormals.
        err = (got - ref).abs()
        assert torch.all(err <= ref.abs() * eps * 1.01 + 1e-6 * ref.abs().max()), (
            f"seed={seed} K={bits} {codebook} {in_f}x{out_f} max err {err.max().item():.3g}")


@pytest.mark.parametrize("tokens", [1, 130, 1000])
def test_folded_forward_matches_reference(seed, tokens):
    tensors, lin, x, what = random_case(seed, tokens)
    dtype = x.dtype
    w = folded_weight(lin, dtype)
    got = folded_forward(x, w, lin, out=poisoned((tokens, lin.info.out_features), dtype))
    ref = linear_forward(x, tensors)
    assert got.shape == ref.shape and torch.isfinite(got).all(), what
    assert rel_l2(got, ref) <= fold_tolerance(ref, dtype), what
    assert cosine(got, ref) >= 0.99999, what


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fold_path_of_linear_forward(seed, dtype, out_dtype):
    """path="fold" (auto from FOLD_MIN_TOKENS rows): planned once, into a NaN-poisoned y, bias included."""
    from exl3tool.ops import linear as ops

    rng = random.Random(seed)
    bits, codebook = rng.choice(CASES)
    in_f, out_f, tokens = rng.randrange(64, 900), rng.randrange(64, 900), rng.choice([1, 37, 300])
    tensors, lin = device_linear(seed, in_f, out_f, bits, codebook, bias=True)
    x = torch.randn(tokens, in_f, dtype=dtype, device="cuda")
    y_dtype = dtype if out_dtype is None else out_dtype
    ref = linear_forward(x, tensors)
    for _ in range(2):  # the second call reuses the plan
        got = ops.linear_forward(x, lin, out_dtype, path="fold", out=poisoned((tokens, out_f), y_dtype))
        what = f"seed={seed} K={bits} {codebook} {in_f}x{out_f} M={tokens} {dtype}->{y_dtype}"
        assert torch.isfinite(got).all() and rel_l2(got, ref) <= fold_tolerance(ref, dtype), what
