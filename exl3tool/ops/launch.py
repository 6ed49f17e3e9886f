"""One builder and one launcher per kernel: the only place that knows each kernel's argument list.

A builder compiles with placeholder pointers (dynamic sizes), a launcher passes real device pointers, sizes and
torch's current stream, so launches are cheap and CUDA-graph capturable (no allocation, no compile inside).
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
import torch
from cuda.bindings import driver as cuda_driver
from cutlass.cute.runtime import make_fake_stream, make_ptr, nullptr

from exl3tool.kernels.dequant import DequantConfig, Dequantize
from exl3tool.kernels.gemm import GemmConfig, TrellisGemm
from exl3tool.kernels.rotate import (
    DTYPES,
    InputRotation,
    InputRotationConfig,
    OutputRotation,
    OutputRotationConfig,
)
from exl3tool.ops.runtime import compile_cached

GMEM = cute.AddressSpace.gmem
_TORCH_TO_CUTE = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.int16: cutlass.Int16,
}


def _placeholder(dtype, align: int):
    return nullptr(dtype, GMEM, assumed_align=align)


def _ptr(t: torch.Tensor, align: int):
    return make_ptr(_TORCH_TO_CUTE[t.dtype], t.data_ptr(), GMEM, assumed_align=align)


def _stream():
    return cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)


# --- builders: (config, options) -> compiled function ----------------------------------------------------


def build_gemm(cfg: GemmConfig, options: str):
    args = [_placeholder(cutlass.Int32, 16), _placeholder(cutlass.Int32, 16), _placeholder(cutlass.Float32, 16)]
    epilogue = [_placeholder(cutlass.Float16, 2), _placeholder(cutlass.Float16, 2),
                _placeholder(DTYPES[cfg.output or "float32"], 2), _placeholder(cutlass.Int32, 4)]
    return cute.compile(TrellisGemm(cfg), *args, 0, 0, 0, 0, 0, *epilogue, 0, 0, make_fake_stream(),
                        options=options)


def build_dequant(cfg: DequantConfig, options: str):
    args = [_placeholder(cutlass.Int32, 16), _placeholder(cutlass.Int16, 16)]
    return cute.compile(Dequantize(cfg), *args, 0, 0, make_fake_stream(), options=options)


def build_input_rotation(cfg: InputRotationConfig, options: str):
    x = _placeholder(DTYPES[cfg.in_dtype], 2)
    args = [x, _placeholder(cutlass.Float16, 2), _placeholder(cutlass.Float16, 16)]
    return cute.compile(InputRotation(cfg), *args, 0, 0, 0, 0, make_fake_stream(), options=options)


def build_output_rotation(cfg: OutputRotationConfig, options: str):
    out = DTYPES[cfg.out_dtype]
    args = [
        _placeholder(DTYPES[cfg.partial_dtype], 4),
        _placeholder(cutlass.Float16, 2),
        _placeholder(cutlass.Float16, 2),
        _placeholder(out, 2),
    ]
    return cute.compile(OutputRotation(cfg), *args, 0, 0, 0, 0, 0, make_fake_stream(), options=options)


BUILDERS = {
    GemmConfig: build_gemm,
    DequantConfig: build_dequant,
    InputRotationConfig: build_input_rotation,
    OutputRotationConfig: build_output_rotation,
}


def compiled(cfg, arch: str):
    """The compiled kernel for a config (GemmConfig, DequantConfig, ...) on ``arch``, from the cache."""
    return compile_cached((type(cfg).__name__, cfg), arch, partial(BUILDERS[type(cfg)], cfg))


# --- launchers ---------------------------------------------------------------------------------------------


def launch_gemm(fn, xr, words, partials, k_tiles_per_split: int, fused=None):
    """``fused``: (svh, bias or None, y, counters) when the config has a fused output rotation."""
    tokens, in_p = partials.shape[1], xr.shape[1]
    out_p = words.shape[1] * 16
    if fused is None:  # ignored by the kernel; any valid pointers of the right types
        fused = (words.view(torch.float16), None, partials, words)
    svh, bias, y, counters = fused
    fn(
        _ptr(xr.view(torch.int32), 16),
        _ptr(words, 16),
        _ptr(partials, 16),
        tokens,
        in_p,
        out_p,
        partials.shape[0],
        k_tiles_per_split,
        _ptr(svh, 2),
        _ptr(svh if bias is None else bias, 2),
        _ptr(y, 2),
        _ptr(counters, 4),
        y.shape[1],
        y.stride(0),
        _stream(),
    )


def launch_dequant(fn, words: torch.Tensor, out_t: torch.Tensor):
    out_p, in_p = out_t.shape
    fn(_ptr(words, 16), _ptr(out_t.view(torch.int16), 16), in_p, out_p, _stream())


def launch_input_rotation(fn, x: torch.Tensor, suh: torch.Tensor, xr: torch.Tensor):
    tokens, in_true = x.shape
    fn(_ptr(x, 2), _ptr(suh, 2), _ptr(xr, 16), tokens, in_true, x.stride(0), xr.shape[1], _stream())


def launch_output_rotation(fn, partials, svh, bias, y):
    splits, tokens, out_p = partials.shape
    bias = svh if bias is None else bias  # never read without a bias; any valid pointer will do
    fn(
        _ptr(partials, 4),
        _ptr(svh, 2),
        _ptr(bias, 2),
        _ptr(y, 2),
        splits,
        tokens,
        out_p,
        y.shape[1],
        y.stride(0),
        _stream(),
    )
