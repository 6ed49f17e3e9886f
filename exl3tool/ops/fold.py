"""The large-M linear: fold both rotations into the weight once per plan, then one cuBLAS GEMM per call.

    fold_builder(cfg, options) / fold_launcher(fn, lin, out)     the fold kernel's builder and launcher
    compiled_fold(lin, dtype, arch)                               the compiled kernel, from the cache
    folded_weight(lin, dtype)                                     W' (in_p, out_p) = diag(suh) Hbd W_hat Hbd diag(svh)
    folded_forward(x, w_fold, lin, out)                           y = x @ W'[:in, :out] (+ bias): no rotation passes

Where the decode GEMM pays rotations and a split-K reduction per call, this path pays one weight-sized write per
fold (the weight is the same on every call, so a plan may keep it) and then runs at cuBLAS fp16 speed.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch

from exl3tool.format import Codebook
from exl3tool.kernels.fold import Fold, FoldConfig
from exl3tool.kernels.rotate import DTYPES
from exl3tool.kernels.trellis import TrellisPlan
from exl3tool.ops.launch import KERNEL_DTYPES, fake_stream, fake_tensor
from exl3tool.ops.runtime import compile_cached, target_arch


def fold_builder(cfg: FoldConfig, options: str):
    in_p, out_p = cute.sym_int(), cute.sym_int()
    w = fake_tensor(cutlass.Int32, cute.sym_int(), cute.sym_int(), TrellisPlan(cfg.bits).words_per_tile)
    suh, svh = fake_tensor(cutlass.Float16, in_p, align=2), fake_tensor(cutlass.Float16, out_p, align=2)
    out = fake_tensor(DTYPES[cfg.out_dtype], in_p, out_p)
    return cute.compile(Fold(cfg), w, suh, svh, out, fake_stream(), options=options)


def fold_config(lin, dtype: torch.dtype) -> FoldConfig:
    return FoldConfig(float(lin.info.bits), Codebook(lin.info.codebook).value, KERNEL_DTYPES[dtype])


def fold_launcher(fn, lin, out: torch.Tensor):
    """``launch()``: W' into ``out`` (in_p, out_p)."""
    return lambda: fn(lin.words, lin.suh, lin.svh, out)


def compiled_fold(lin, dtype: torch.dtype, arch: str):
    cfg = fold_config(lin, dtype)
    return compile_cached(("FoldConfig", cfg), arch, lambda options: fold_builder(cfg, options))


def folded_weight(lin, dtype: torch.dtype = torch.float16, out: torch.Tensor | None = None) -> torch.Tensor:
    """W' ``(in_p, out_p)`` in the activations' dtype (fp16 or bf16)."""
    fn = compiled_fold(lin, dtype, target_arch(lin.device))
    info = lin.info
    if out is None:
        out = torch.empty((info.in_padded, info.out_padded), dtype=dtype, device=lin.device)
    fold_launcher(fn, lin, out)()
    return out


def folded_forward(x: torch.Tensor, w_fold: torch.Tensor, lin, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y [M, out_features] = x @ W' + bias`` with x ``[M, in_features]`` in W''s dtype (cuBLAS reads the
    true-size corner of W' in place: no padding copy)."""
    info = lin.info
    w = w_fold[: info.in_features, : info.out_features]
    if lin.bias is None:
        return torch.mm(x, w, out=out)
    return torch.addmm(lin.bias[: info.out_features].to(x.dtype), x, w, out=out)
