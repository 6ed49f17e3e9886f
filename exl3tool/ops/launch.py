"""One builder and one launcher per kernel: the only place that spells each kernel's argument list.

A builder compiles for fake tensors (dynamic sizes as symbolic ints, the dims that must agree sharing one symbol)
through TVM FFI, so the compiled function takes torch tensors directly: TVM FFI checks their dtypes, ranks,
agreeing sizes, alignment and device, and launches on torch's current stream (CUDA-graph capture included). A
launcher is that call, nothing else: no conversion, no allocation, no host sync.
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
import torch
import tvm_ffi
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from exl3tool.kernels.dequant import DequantConfig, Dequantize
from exl3tool.kernels.gemm import GemmConfig, TrellisGemm
from exl3tool.kernels.rotate import (
    DTYPES,
    InputRotation,
    InputRotationConfig,
    OutputRotation,
    OutputRotationConfig,
)
from exl3tool.kernels.trellis import TrellisPlan
from exl3tool.ops.runtime import compile_cached

# The kernels' name of each activation dtype (their configs name dtypes by string: hashable, printable).
KERNEL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def fake_tensor(dtype, *shape, align: int = 16):
    """A fake contiguous row-major tensor for compiling: ints are static sizes, ``cute.sym_int()`` symbols are
    dynamic ones (pass one symbol to several tensors for sizes that must agree), None a fresh symbol."""
    shape = tuple(cute.sym_int() if d is None else d for d in shape)
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape)))[::-1], assumed_align=align)


def fake_stream():
    """The stream argument: TVM FFI's environment stream, which it takes from torch's current stream."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def _rows(dtype, rows, cols, align: int = 2):
    """A fake matrix whose rows may be strided (a view into a wider tensor), elements contiguous."""
    return make_fake_tensor(dtype, (rows, cols), (cute.sym_int64(), 1), assumed_align=align)


def _vector(dtype, size=None, align: int = 8):
    """A vector of ``size`` (a symbol shared with another tensor, None for its own): suh/svh/bias, which the
    rotations load four fp16 at once (8 bytes; TVM FFI checks the alignment), or ``align`` for others."""
    return fake_tensor(dtype, size, align=align)


# --- builders: (config, options) -> compiled function ----------------------------------------------------


def build_gemm(cfg: GemmConfig, options: str):
    m, out_p = cute.sym_int(), cute.sym_int()
    x = fake_tensor(cutlass.Int32, cute.sym_int() if cfg.x_order == "stages" else m, cute.sym_int())  # linear.x_rows
    suh = None
    if cfg.input is not None:  # x itself, rotated by the GEMM's prologue
        x, suh = _rows(DTYPES[cfg.input], m, cute.sym_int()), _vector(cutlass.Float16)
    w = fake_tensor(cutlass.Int32, cute.sym_int(), cute.sym_int(), TrellisPlan(cfg.bits).words_per_tile)
    p = fake_tensor(cutlass.Float32, cute.sym_int(), m, out_p)
    epilogue = [None] * 4
    if cfg.output is not None:
        svh = _vector(cutlass.Float16, out_p)
        bias = _vector(cutlass.Float16, out_p) if cfg.has_bias else None
        epilogue = [svh, bias, _rows(DTYPES[cfg.output], m, cute.sym_int()), _vector(cutlass.Int32, align=4)]
    return cute.compile(TrellisGemm(cfg), x, w, p, 0, *epilogue, suh, fake_stream(), options=options)


def build_dequant(cfg: DequantConfig, options: str):
    w = fake_tensor(cutlass.Int32, cute.sym_int(), cute.sym_int(), TrellisPlan(cfg.bits).words_per_tile)
    out = fake_tensor(cutlass.Int32, cute.sym_int(), cute.sym_int())
    return cute.compile(Dequantize(cfg), w, out, fake_stream(), options=options)


def build_input_rotation(cfg: InputRotationConfig, options: str):
    m, in_p = cute.sym_int(), cute.sym_int()
    x = _rows(DTYPES[cfg.in_dtype], m, cute.sym_int())
    xr_cols = cute.sym_int() if cfg.x_order == "doubled" else in_p  # doubled: 2*in_p
    xr_rows = cute.sym_int() if cfg.x_order == "stages" else m  # stages: whole token blocks (linear.x_rows)
    return cute.compile(InputRotation(cfg), x, _vector(cutlass.Float16, in_p),
                        fake_tensor(cutlass.Float16, xr_rows, xr_cols), fake_stream(), options=options)


def build_output_rotation(cfg: OutputRotationConfig, options: str):
    m, out_p = cute.sym_int(), cute.sym_int()
    p = fake_tensor(DTYPES[cfg.partial_dtype], cute.sym_int(), m, out_p)
    svh = _vector(cutlass.Float16, out_p)
    bias = _vector(cutlass.Float16, out_p) if cfg.has_bias else None
    y = _rows(DTYPES[cfg.out_dtype], m, cute.sym_int())
    return cute.compile(OutputRotation(cfg), p, svh, bias, y, fake_stream(), options=options)


BUILDERS = {
    GemmConfig: build_gemm,
    DequantConfig: build_dequant,
    InputRotationConfig: build_input_rotation,
    OutputRotationConfig: build_output_rotation,
}


def compiled(cfg, arch: str):
    """The compiled kernel for a config (GemmConfig, DequantConfig, ...) on ``arch``, from the cache."""
    return compile_cached((type(cfg).__name__, cfg), arch, partial(BUILDERS[type(cfg)], cfg))


# --- launchers: bound once to a plan's persistent tensors, called with the per-call ones -----------------------
# Persistent tensors are handed to TVM FFI once, as its own tensors. Every launch still passes at least one torch
# CUDA tensor: TVM FFI takes torch's current stream from it (so launches follow torch.cuda.stream and graph
# capture).


def to_ffi(t: torch.Tensor | None):
    """A persistent tensor as TVM FFI's own (its DLPack conversion done once, not at every launch)."""
    return None if t is None else tvm_ffi.from_dlpack(t)


def gemm_launcher(fn, xr: torch.Tensor, words: torch.Tensor, partials: torch.Tensor, k_tiles_per_split: int,
                  svh: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  counters: torch.Tensor | None = None):
    """``launch()`` without a fused output rotation, ``launch(y)`` with one (svh, bias, counters given)."""
    x_words, w, p = xr.view(torch.int32), to_ffi(words), to_ffi(partials)
    if svh is None:
        return lambda: fn(x_words, w, p, k_tiles_per_split, None, None, None, None, None)
    s, b, c = to_ffi(svh), to_ffi(bias), to_ffi(counters)
    return lambda y: fn(x_words, w, p, k_tiles_per_split, s, b, y, c, None)


def rotating_gemm_launcher(fn, suh: torch.Tensor, words: torch.Tensor, partials: torch.Tensor,
                           k_tiles_per_split: int, svh: torch.Tensor, bias: torch.Tensor | None,
                           counters: torch.Tensor):
    """``launch(x, y)``: the M = 1 GEMM that rotates x itself (``GemmConfig.input``), output rotation fused."""
    u, w, p, s, b, c = to_ffi(suh), to_ffi(words), to_ffi(partials), to_ffi(svh), to_ffi(bias), to_ffi(counters)
    return lambda x, y: fn(x, w, p, k_tiles_per_split, s, b, y, c, u)


def dequant_launcher(fn, words: torch.Tensor, out_t: torch.Tensor):
    """``launch()``: W_hat^T fp16 ``(out_p, in_p)`` into ``out_t``."""
    w, out_words = to_ffi(words), out_t.view(torch.int32)
    return lambda: fn(w, out_words)


def input_rotation_launcher(fn, suh: torch.Tensor, xr: torch.Tensor):
    """``launch(x)``: ``xr = H128(x * suh)``."""
    s, r = to_ffi(suh), to_ffi(xr)
    return lambda x: fn(x, s, r)


def output_rotation_launcher(fn, partials: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None):
    """``launch(y)``: ``y = H128(sum of partials) * svh + bias``."""
    p, s, b = to_ffi(partials), to_ffi(svh), to_ffi(bias)
    return lambda y: fn(p, s, b, y)
