"""One EXL3 linear on the GPU: ``y = rot_out(rot_in(x) @ W_hat)`` with our kernels.

    DeviceLinear.from_tensors(tensors, device)   the weights in the layout the kernels read
    linear_forward(x, lin, out_dtype=None)        x [M, in_features] fp16/bf16 -> y [M, out_features]
    rotate_input / trellis_gemm / rotate_output / fused_gemm / dequantize_t   the stages, for tests and benchmarks

Small M streams the trellis through the decode GEMM (split over K so every SM has work), with the output
rotation in its own kernel or fused into the GEMM's epilogue; from ``DEQUANT_MIN_TOKENS`` rows on, decoding W_hat
once and letting torch's tensor-core GEMM multiply is faster. The thresholds are H200 measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from exl3tool.format import Codebook, LinearTensors
from exl3tool.kernels.dequant import DequantConfig
from exl3tool.kernels.gemm import GemmConfig, fitting_config
from exl3tool.kernels.rotate import InputRotationConfig, OutputRotationConfig
from exl3tool.ops import launch
from exl3tool.ops.runtime import require_gpu, target_arch

DEQUANT_MIN_TOKENS = 112  # measured crossover on the H200 (docs/perf.md)
# The fused output rotation pays where few 128-column blocks make the last-CTA tail short (H200: -4..-8% at
# M <= 4 with N <= 4096) and costs elsewhere (its tail is serial over the CTA's rows), so it is used only there.
FUSED_MAX_TOKENS, FUSED_MAX_OUT = 8, 4096
CTAS_PER_SM = 8  # split-K aims for this many CTAs per SM (tuned on the H200, docs/perf.md)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class DeviceLinear:
    """An EXL3 linear resident on the GPU: trellis words int32 ``(in_p/16, out_p/16, 8K)``, suh/svh/bias fp16."""

    name: str
    in_features: int
    out_features: int
    in_padded: int
    out_padded: int
    bits: float
    codebook: str
    words: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None = None
    _counters: dict = field(default_factory=dict, repr=False)

    def counters(self, n: int) -> torch.Tensor:
        """Zeroed int32 arrival counters for the fused GEMM epilogue (it resets them after use, so one buffer
        serves every later launch, CUDA-graph replays included). Made on first use: warm up before capture."""
        if n not in self._counters:
            self._counters[n] = torch.zeros(n, dtype=torch.int32, device=self.device)
        return self._counters[n]

    @classmethod
    def from_tensors(cls, tensors: LinearTensors, device: torch.device | str | None = None) -> "DeviceLinear":
        device = require_gpu(device)
        info = tensors.info
        trellis = tensors.trellis.to(device=device, dtype=torch.int16).contiguous()
        return cls(
            name=info.name,
            in_features=info.in_features,
            out_features=info.out_features,
            in_padded=info.in_padded,
            out_padded=info.out_padded,
            bits=float(info.bits),
            codebook=Codebook(info.codebook).value,
            words=trellis.view(torch.int32),  # two int16 words = one little-endian ring word
            suh=tensors.suh.to(device=device, dtype=torch.float16).contiguous(),
            svh=tensors.svh.to(device=device, dtype=torch.float16).contiguous(),
            bias=None if tensors.bias is None else tensors.bias.to(device=device, dtype=torch.float16).contiguous(),
        )

    @property
    def device(self) -> torch.device:
        return self.words.device


@dataclass(frozen=True)
class GemmPlan:
    config: GemmConfig
    splits: int
    k_tiles_per_split: int


def plan_gemm(
    tokens: int,
    lin: DeviceLinear,
    sm_count: int,
    token_groups: int | None = None,
    ctas_per_sm: int = CTAS_PER_SM,
    **config: int,
) -> GemmPlan:
    """Tokens per CTA from M; K splits so that about ``ctas_per_sm`` CTAs per SM stream the weights.

    ``config`` overrides GemmConfig fields (warps, k_tiles_per_stage, stages) for tuning runs."""
    if token_groups is None:
        token_groups = next(g for g in (1, 2, 4, 8) if tokens <= 8 * g or g == 8)
    cfg = fitting_config(bits=lin.bits, codebook=lin.codebook, token_groups=token_groups, **config)
    k_tiles = lin.in_padded // 16
    stage = cfg.k_tiles_per_stage
    ctas = (lin.out_padded // 16 // cfg.warps) * math.ceil(tokens / cfg.tokens_per_cta)
    max_splits = max(1, k_tiles // (2 * stage))  # keep at least two stages of work per split
    splits = min(max(1, math.ceil(ctas_per_sm * sm_count / ctas)), max_splits)
    per_split = math.ceil(k_tiles / splits / stage) * stage
    return GemmPlan(cfg, math.ceil(k_tiles / per_split), per_split)


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The caller's buffer (tests pass NaN-poisoned ones) or a fresh one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != torch.device(device) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape} on {device}")
    return out


def rotate_input(x: torch.Tensor, lin: DeviceLinear, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 ``[M, in_p]`` = H128(x_pad * suh) per 128-column block."""
    fn = launch.compiled(InputRotationConfig(_DTYPE_NAMES[x.dtype]), target_arch(x.device))
    xr = _output(out, (x.shape[0], lin.in_padded), torch.float16, x.device)
    launch.launch_input_rotation(fn, x, lin.suh, xr)
    return xr


def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def trellis_gemm(
    xr: torch.Tensor, lin: DeviceLinear, plan: GemmPlan | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 partial products ``[splits, M, out_p]`` of ``xr @ W_hat`` (xr fp16 ``[M, in_p]``)."""
    tokens = xr.shape[0]
    if plan is None:
        plan = plan_gemm(tokens, lin, sm_count(xr.device))
    fn = launch.compiled(plan.config, target_arch(xr.device))
    partials = _output(out, (plan.splits, tokens, lin.out_padded), torch.float32, xr.device)
    launch.launch_gemm(fn, xr, lin.words, partials, plan.k_tiles_per_split)
    return partials


def fused_gemm(
    xr: torch.Tensor, lin: DeviceLinear, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[M, out_features]``: the decode GEMM with the split reduction and output rotation in its epilogue."""
    tokens = xr.shape[0]
    plan = plan_gemm(tokens, lin, sm_count(xr.device), output=_DTYPE_NAMES[out_dtype], has_bias=lin.bias is not None)
    fn = launch.compiled(plan.config, target_arch(xr.device))
    partials = torch.empty((plan.splits, tokens, lin.out_padded), dtype=torch.float32, device=xr.device)
    y = _output(out, (tokens, lin.out_features), out_dtype, xr.device)
    counters = lin.counters(math.ceil(tokens / plan.config.tokens_per_cta) * (lin.out_padded // 128))
    launch.launch_gemm(fn, xr, lin.words, partials, plan.k_tiles_per_split, fused=(lin.svh, lin.bias, y, counters))
    return y


def rotate_output(
    partials: torch.Tensor, lin: DeviceLinear, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[M, out_features]`` = H128(sum of partials) * svh + bias, in ``out_dtype``."""
    cfg = OutputRotationConfig(
        out_dtype=_DTYPE_NAMES[out_dtype],
        partial_dtype=_DTYPE_NAMES[partials.dtype],
        has_bias=lin.bias is not None,
    )
    fn = launch.compiled(cfg, target_arch(partials.device))
    y = _output(out, (partials.shape[1], lin.out_features), out_dtype, partials.device)
    launch.launch_output_rotation(fn, partials, lin.svh, lin.bias, y)
    return y


def dequantize_t(lin: DeviceLinear, out: torch.Tensor | None = None) -> torch.Tensor:
    """W_hat^T fp16 ``(out_p, in_p)``; its transpose is bit-identical to ``exl3tool.reference.decode_trellis``."""
    fn = launch.compiled(DequantConfig(lin.bits, lin.codebook), target_arch(lin.device))
    w_hat_t = _output(out, (lin.out_padded, lin.in_padded), torch.float16, lin.device)
    launch.launch_dequant(fn, lin.words, w_hat_t)
    return w_hat_t


def check_input(x: torch.Tensor, lin: DeviceLinear) -> None:
    if x.dim() != 2 or x.shape[1] != lin.in_features or x.shape[0] < 1:
        raise ValueError(f"{lin.name}: input must be [M >= 1, {lin.in_features}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{lin.name}: activations must be float16 or bfloat16, got {x.dtype}")
    if x.device != lin.device:
        raise ValueError(f"{lin.name}: input is on {x.device}, weights on {lin.device}")
    if x.stride(1) != 1:
        raise ValueError(f"{lin.name}: input rows must be contiguous")


def linear_forward(
    x: torch.Tensor,
    lin: DeviceLinear,
    out_dtype: torch.dtype | None = None,
    path: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [M, out_features] = x @ W^T + bias`` for x ``[M, in_features]`` fp16/bf16.

    ``path``: "auto" (by M and N), "gemm" (decode GEMM, output rotation fused into its epilogue),
    "gemm-unfused" (the same GEMM, then the output rotation kernel) or "dequant" (decode W_hat, then torch's
    tensor-core GEMM).
    """
    check_input(x, lin)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if path == "auto":
        tokens = x.shape[0]
        if tokens >= DEQUANT_MIN_TOKENS:
            path = "dequant"
        elif tokens <= FUSED_MAX_TOKENS and lin.out_padded <= FUSED_MAX_OUT:
            path = "gemm"
        else:
            path = "gemm-unfused"
    if path == "gemm":
        return fused_gemm(rotate_input(x, lin), lin, out_dtype, out)
    if path == "gemm-unfused":
        partials = trellis_gemm(rotate_input(x, lin), lin)
    elif path == "dequant":
        partials = (rotate_input(x, lin) @ dequantize_t(lin).t()).unsqueeze(0)
    else:
        raise ValueError(f"unknown path {path!r}: use auto, gemm, gemm-unfused or dequant")
    return rotate_output(partials, lin, out_dtype, out)
