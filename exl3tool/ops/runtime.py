"""Compiling and calling the CuTe DSL kernels: target arch, the compile cache, pointers and streams.

Kernels are compiled once per (kernel, config, arch) with placeholder pointers and dynamic sizes, so a single
compiled function serves every shape; nothing is ever keyed by tensors. Later processes load them from disk
(``kernel_cache``). ``EXL3TOOL_ARCH`` (e.g. ``sm_120a``) overrides the GPU's own arch and lets CI compile without a
GPU.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable

import torch

from exl3tool.errors import GpuUnavailableError
from exl3tool.ops import kernel_cache

ARCH_ENV = "EXL3TOOL_ARCH"
# TVM FFI: the compiled function takes torch tensors and torch's current stream (a launch costs microseconds).
COMPILE_OPTIONS = "--enable-tvm-ffi"
_NAMED_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (12, 0): "sm_120a", (12, 1): "sm_121a"}

_cache: dict[tuple, Any] = {}
_lock = threading.Lock()


def require_gpu(device: torch.device | str | None = None) -> torch.device:
    """The CUDA device to run on, or GpuUnavailableError saying what is missing."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise GpuUnavailableError(
                f"torch.cuda.is_available() is False: torch {torch.__version__} is a CPU-only build; install a CUDA "
                "build of torch (https://pytorch.org/get-started/locally/)")
        raise GpuUnavailableError(f"torch.cuda.is_available() is False: torch {torch.__version__} (CUDA "
                                  f"{torch.version.cuda}) finds no CUDA GPU; check the NVIDIA driver with nvidia-smi")
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        raise GpuUnavailableError(f"the kernels run on a CUDA device, not {device}")
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        name = torch.cuda.get_device_name(device)
        raise GpuUnavailableError(f"{name} (SM{major}x) has no mma.sync.m16n8k16 fp16; SM80 or newer is needed")
    return device


def target_arch(device: torch.device | str | None = None) -> str:
    """The arch to compile for: ``EXL3TOOL_ARCH`` if set, else the GPU's own (``sm_90a`` on an H200)."""
    override = os.environ.get(ARCH_ENV)
    if override:
        return override
    device = require_gpu(device)
    major, minor = torch.cuda.get_device_capability(device)
    return _NAMED_ARCHS.get((major, minor), f"sm_{major}{minor}")


def compile_cached(key: tuple, arch: str, build: Callable[[str], Any]) -> Any:
    """``build(options)`` once per (key, arch); the result is reused for every later call, and later processes load
    it from the on-disk cache (``kernel_cache``) instead of compiling it again.

    Returned as ``direct_function`` of it: callers pass every argument positionally, as the launchers do."""
    from exl3tool.kernels.ptx import TRACE_ADDR

    full_key = (*key, arch) + ((TRACE_ADDR,) if TRACE_ADDR else ())  # traced kernels are others (bench.trace)
    entry = _cache.get(full_key)
    if entry is None:
        with _lock:
            entry = _cache.get(full_key)
            if entry is None:
                entry = _cache[full_key] = _load_or_compile(full_key, arch, build)
    return entry[1]


def _load_or_compile(full_key: tuple, arch: str, build: Callable[[str], Any]) -> tuple[Any, Any]:
    """(what keeps the kernel loaded, its function): from the disk cache, else compiled here and stored there."""
    from exl3tool.kernels.ptx import compiling_for

    options = f"{COMPILE_OPTIONS} --gpu-arch={arch}"
    name = kernel_cache.entry_name(full_key, options)
    loaded = kernel_cache.load(name) if name is not None else None
    if loaded is not None:
        return loaded, loaded  # the function keeps its module loaded
    with compiling_for(arch):
        compiled = build(options)
    kernel_cache.counts.compiled += 1
    if name is not None:
        kernel_cache.store(name, compiled)
    return compiled, direct_function(compiled)


def direct_function(compiled: Any) -> Any:
    """The TVM FFI function inside a compiled kernel, where it has one (a GPU is present): called with every
    argument positionally it skips the DSL's Python keyword-argument wrapper, about 1 us of host time per launch
    (H200 host: MoE GEMM launch 5.98 -> 4.80 us, a 1-tensor kernel 4.70 -> 4.06). The compiled object itself
    stays in the cache, which keeps its module loaded."""
    inner = getattr(compiled, "__tvm_ffi_object__", None)
    function = inner() if inner is not None else None
    return compiled if function is None else function


def compile_with_ptx(build: Callable[[str], Any], arch: str) -> str:
    """PTX text of a kernel compiled for ``arch`` (used by the compile-only tests; never cached).

    Keeping the PTX also writes it to a file, so that goes to a throwaway folder, not the working directory."""
    from exl3tool.kernels.ptx import compiling_for

    with tempfile.TemporaryDirectory(prefix="exl3tool-ptx-") as dump, compiling_for(arch):
        return build(f"{COMPILE_OPTIONS} --gpu-arch={arch} --keep-ptx --dump-dir={dump}").__ptx__
