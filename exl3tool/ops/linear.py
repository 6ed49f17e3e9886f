"""One EXL3 linear on the GPU: ``y = rot_out(rot_in(x) @ W_hat)`` with our kernels.

    DeviceLinear.from_tensors(tensors, device)   the weights in the layout the kernels read
    linear_forward(x, lin, out_dtype=None)        x [M, in_features] fp16/bf16 -> y [M, out_features]
    LinearPlan                                    what one (linear, M, dtypes, path) call needs, decided once
    rotate_input / trellis_gemm / rotate_output / dequantize_t   the stages, for tests and benchmarks

Small M streams the trellis through the decode GEMM (split over K so every SM has work), with the output
rotation in its own kernel or fused into the GEMM's epilogue (and at M = 1 the input rotation in its prologue);
from ``DEQUANT_MIN_TOKENS`` rows on, decoding W_hat once and letting torch's tensor-core GEMM multiply is faster,
and from ``FOLD_MIN_TOKENS`` on, decoding it with both rotations folded in (no rotation passes over the
activations). Where the GPU has warpgroup MMAs (sm_90a), the decode GEMM multiplies with them from
``WGMMA_MIN_TOKENS`` to ``WGMMA_MAX_TOKENS`` rows and stays the path there. The thresholds are H200 measurements.

Plan once, launch many: the first call with a given (M, dtypes, path) makes a ``LinearPlan`` (compiled kernels,
split-K, scratch views); every later call only launches. Warm up before capturing a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import torch

from exl3tool.format import Codebook, LinearInfo, LinearTensors
from exl3tool.kernels.dequant import DequantConfig
from exl3tool.kernels.gemm import GemmConfig, fitting_config
from exl3tool.kernels.rotate import SPLITS_IN_FLIGHT, InputRotationConfig, OutputRotationConfig
from exl3tool.kernels.trellis import x_doubled_word, x_fragment_slot, x_row_halves, x_stages_index
from exl3tool.ops import fold, launch, targets
from exl3tool.ops.launch import KERNEL_DTYPES
from exl3tool.ops.runtime import require_gpu, target_arch
from exl3tool.ops.targets import (
    WGMMA_LAYOUT,
    decode_warps,
    gemm_resident_ctas,
    has_wgmma,
    split_halves,
    split_k,
    wave_fill,
)
from exl3tool.ops.workspace import counters, scratch

# Measured crossover on the H200 (docs/perf.md, 2026-12-01, L2-cold, gemm-unfused vs dequant, 4096x14336 /
# 14336x4096 K4: M=128 72.5 vs 88.0 / 71.6 vs 92.4 us, M=160 107.1 vs 91.3 / 102.6 vs 95.5).
DEQUANT_MIN_TOKENS = 129
# The fused output rotation pays where few 128-column blocks make the last-CTA tail short (H200: -4..-8% at
# M <= 4 with N <= 4096) and costs elsewhere (its tail is serial over the CTA's rows), so it is used only there,
# and at M = 1 for any N: one row makes the tail short (4096x14336: 25.72 vs 25.74 us at K=4, 23.68 vs 23.75 at
# K=2, 27.28 vs 28.04 at K=6) and it saves a launch.
FUSED_MAX_TOKENS, FUSED_MAX_OUT = 8, 4096
PATHS = ("gemm", "gemm-unfused", "dequant", "fold")
# 8-warp CTAs (targets.decode_warps) for one token block, and for more on outputs up to this wide. H200, K=4 mcg,
# whole linear, graph (us, 4 -> 8 warps, 8 token groups): 14336x4096 M=64 41.49 -> 38.78, M=128 72.75 -> 68.20;
# 4096x4096 M=64 18.17 -> 17.06, M=128 27.44 -> 25.57; 2048x8192 M=64 18.50 -> 17.27; 4096x14336 M=40 41.50 ->
# 40.88, M=64 43.22 -> 42.16, but M=96 72.88 -> 74.64 and M=128 74.21 -> 75.59 (its 224 wide CTAs then run
# unsplit, a wave of 1-2 per SM).
EIGHT_WARP_MAX_OUT = 8192
# From here on the rotations folded into the weight (one fold kernel + one cuBLAS GEMM, ops.fold) beat dequantize +
# two rotation passes: H200 run of 2026-11-30, 4096x14336 K=4: M=4096 760 vs 854 us, M=256 196 vs 117 us.
FOLD_MIN_TOKENS = 2048
# Where the GPU has warpgroup MMAs (sm_90a), the decode GEMM multiplies with them (GemmConfig.mma = "wgmma") for
# WGMMA_MIN_TOKENS..WGMMA_MAX_TOKENS rows, laid out as targets.WGMMA_LAYOUT: CTAs of two warpgroups (128 output columns;
# one warpgroup re-reads X from L2 twice as often and lost 4-17%), 4 k-tiles per stage (at most 123 registers at 64
# tokens: two CTAs per SM) and 6 stages where shared memory holds them. H200, K=4 mcg, whole linear, graph, L2-cold, us
# (mma.sync or dequant -> wgmma): 4096x14336 M=64 39.7 -> 37.1, M=128 70.9 -> 55.4, M=256 104 (dequant) -> 87.5;
# 14336x4096 M=64 37.9 -> 34.3, M=128 66.3 -> 51.4, M=256 106 -> 80.8; M=512 even with dequant (156); below 33 tokens
# even or slower (M=16 28.9 vs 24.8). docs/perf.md, seventh session.
WGMMA_MIN_TOKENS, WGMMA_MAX_TOKENS = 33, 256


@dataclass
class DeviceLinear:
    """An EXL3 linear resident on the GPU: trellis words int32 ``(in_p/16, out_p/16, 8K)``, suh/svh/bias fp16,
    and its plans (one per M, dtypes and path, made on first use)."""

    info: LinearInfo
    words: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None = None
    plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_tensors(cls, tensors: LinearTensors, device: torch.device | str | None = None) -> "DeviceLinear":
        device = require_gpu(device)
        trellis = tensors.trellis.to(device=device, dtype=torch.int16).contiguous()
        half = lambda t: None if t is None else t.to(device=device, dtype=torch.float16).contiguous()  # noqa: E731
        # two int16 words = one little-endian ring word
        return cls(tensors.info, trellis.view(torch.int32), half(tensors.suh), half(tensors.svh), half(tensors.bias))

    @property
    def device(self) -> torch.device:
        return self.words.device

    @property
    def name(self) -> str:
        return self.info.name


# Which kernels of a warpgroup-MMA linear (M = WGMMA_MIN_TOKENS..WGMMA_MAX_TOKENS) let the next one launch right
# after their own wait (PDL, ``early_next``): "none", "input" (the input rotation, so the GEMM's CTAs are resident
# when it ends) or "all" (the GEMM and the output rotation too). H200, K=4 mcg, graph, y bit-identical, us (none ->
# input -> all): 4096x14336 M=64 35.6 -> 35.3 -> 35.3, M=256 60.1 -> 59.6 -> 59.4; 14336x4096 M=40 33.7 -> 33.1 ->
# 33.4, M=64 34.8 -> 33.9 -> 34.3. Not before the one-wave mma.sync GEMMs of M <= 32: with every kernel starting the
# next early, M=1 20.6 -> 24.6 and M=16 26.9 -> 31.8 (docs/perf.md, eighteenth session); with only the M = 9..32
# GEMM letting its output rotation launch early, mixed: 4096x14336 M=16 23.54 -> 23.31, 14336x4096 M=16 24.06 ->
# 24.36, 4096x4096 M=16 11.31 -> 11.59 (twenty-seventh session; its patch: git show
# 14c9841:docs/tried/unfused-sync-gemm-early-next.patch.gz).
EARLY_NEXT = "input"


def early_next(kernel: str, tokens: int, arch: str) -> bool:
    """Does the linear's ``kernel`` ("input", "gemm" or "output") let the next one launch right after its own wait
    (EARLY_NEXT), at ``tokens`` on ``arch``?"""
    return uses_wgmma(tokens, arch) and (EARLY_NEXT == "all" or (EARLY_NEXT == "input" and kernel == "input"))


@dataclass(frozen=True)
class GemmPlan:
    config: GemmConfig
    splits: int
    k_tiles_per_split: int


@lru_cache(maxsize=None)
def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_gemm(
    tokens: int,
    lin: DeviceLinear,
    sm_count: int,
    token_groups: int | None = None,
    arch: str | None = None,
    **config: int,
) -> GemmPlan:
    """Tokens per CTA from M; K split so that the grid fills at least ``targets.wave_fill(arch)`` of one wave of
    the CTAs ``arch``'s SMs hold at once (``targets``: H200 8 CTAs of the M <= 8 config per SM and 80% of a wave,
    SM120 7 and a whole wave), with the least work on the busiest SM.

    ``config`` overrides GemmConfig fields (warps, k_tiles_per_stage, stages, output, split_halves) for tuning
    runs; ``input`` (M = 1) makes the GEMM rotate x itself, its resident row sized by the split found here."""
    arch = arch or target_arch(lin.device)
    if config.get("mma", "wgmma" if uses_wgmma(tokens, arch) else "sync") == "wgmma":
        token_groups = token_groups or covering_groups(tokens, (1, 2, 4, 8, 16, 32))
        layout = {**WGMMA_LAYOUT, "stages": targets.DENSE_WGMMA_STAGES, "split_halves": False,
                  "x_order": targets.wgmma_x_order(8 * token_groups)}
        plan = _plan_gemm(tokens, lin, sm_count, token_groups, arch, {**layout, **config})
        small_layout = targets.DENSE_WGMMA_SMALL_LAYOUT
        if token_groups > targets.DENSE_WGMMA_SMALL_MAX_GROUPS or small_layout.keys() & config.keys():
            return plan  # past the small layout's tokens, or the caller chose its own stages
        # The small layout's 8-k-tile stages may split K more coarsely: it is measured at the same splits only.
        small = _plan_gemm(tokens, lin, sm_count, token_groups, arch, {**layout, **small_layout, **config})
        return small if small.splits == plan.splits else plan
    return _plan_gemm(tokens, lin, sm_count, token_groups, arch, config)


def _plan_gemm(tokens: int, lin: DeviceLinear, sm_count: int, token_groups: int | None, arch: str,
               config: dict) -> GemmPlan:
    info, codebook = lin.info, Codebook(lin.info.codebook).value
    token_groups = token_groups or covering_groups(tokens, (1, 2, 4, 8))
    config.setdefault("split_halves", split_halves(arch, codebook, token_groups, float(info.bits)))
    if tokens <= 8 * token_groups or info.out_padded <= EIGHT_WARP_MAX_OUT:
        config.setdefault("warps", decode_warps(codebook, token_groups))
    # The input rotation writes X as the main loop loads it (H200, K=4 mcg, GEMM alone: M=16 22.95 vs 23.68 us,
    # M=64 36.97 vs 42.13); for split halves already doubled (no HADD2 per B word in the loop).
    config.setdefault("x_order", "doubled" if config["split_halves"] else "fragments")
    rotated_input = config.pop("input", None)
    if rotated_input is not None:
        config.setdefault("stages", targets.rotated_input_stages(arch))
    cfg = fitting_config(bits=float(info.bits), codebook=codebook, token_groups=token_groups, **config)
    k_tiles = info.in_padded // 16
    ctas = (info.out_padded // 16 // cfg.warps) * math.ceil(tokens / cfg.tokens_per_cta)
    slots = gemm_resident_ctas(arch, cfg) * sm_count
    # With the input rotated in the prologue, a split's row of x must fit in shared memory beside the stages.
    fits = cfg.max_resident_k_tiles if rotated_input is not None else None
    per_split = split_k(k_tiles, cfg.k_tiles_per_stage, ctas, slots, sm_count, fits, wave_fill(arch))
    if rotated_input is not None:
        cfg = replace(cfg, input=rotated_input, resident_k_tiles=per_split)
    splits = math.ceil(k_tiles / per_split)
    if cfg.input is not None and cfg.output is not None and splits > SPLITS_IN_FLIGHT:
        # H200, graph, y bit-identical, us: 14336x4096 (14 splits) 19.8 -> 19.4, 4096x4096 10.1 -> 9.3, 8192x2048
        # 11.1 -> 9.8, K=2 mul1 14336x4096 20.3 -> 19.2; but 4096x14336 (4 splits) 18.8 -> 19.3 (docs/perf.md, s23).
        # From 9 splits since warp 0 loads 8 at once (s24); 5-8 splits against that batch were not measured.
        cfg = replace(cfg, spread_sum=True)
    if cfg.mma == "wgmma" and cfg.output is not None and splits == 1:
        cfg = replace(cfg, whole_k=True)  # its epilogue rotates the CTA's tiles in shared memory
    return GemmPlan(cfg, splits, per_split)


def covering_groups(tokens: int, choices: tuple[int, ...]) -> int:
    """The fewest token groups (8 tokens each) among ``choices`` that hold ``tokens``, else the most."""
    return next((g for g in choices if tokens <= 8 * g), choices[-1])


def uses_wgmma(tokens: int, arch: str) -> bool:
    return has_wgmma(arch) and WGMMA_MIN_TOKENS <= tokens <= WGMMA_MAX_TOKENS


def choose_path(tokens: int, lin: DeviceLinear) -> str:
    """What ``path="auto"`` runs, by the H200 crossovers above."""
    if tokens >= FOLD_MIN_TOKENS:
        return "fold"
    if tokens >= DEQUANT_MIN_TOKENS and not uses_wgmma(tokens, target_arch(lin.device)):
        return "dequant"
    if tokens == 1 or (tokens <= FUSED_MAX_TOKENS and lin.info.out_padded <= FUSED_MAX_OUT):
        return "gemm"
    # With one K split the warpgroup-MMA GEMM rotates its own output: each CTA its whole tiles, in shared memory
    # (GemmConfig.whole_k). H200, K=4 mcg, whole linear, graph, y bit-identical, us (gemm-unfused -> gemm): 4096x14336
    # M=128 47.61 -> 45.61, M=256 69.02 -> 64.99. With split-K (the last CTA of a block sums the partials and
    # rotates) it lost: 4096x14336 M=40 / 64 33.26 -> 35.40 / 34.65 -> 36.00, 14336x4096 M=64 / 128 / 256 32.67 ->
    # 35.93 / 43.82 -> 52.60 / 64.96 -> 76.88; so the rotation stays a launch there.
    if (WGMMA_MIN_TOKENS <= tokens <= WGMMA_MAX_TOKENS and uses_wgmma(tokens, target_arch(lin.device))
            and plan_gemm(tokens, lin, sm_count(lin.device)).splits == 1):
        return "gemm"
    return "gemm-unfused"


class LinearPlan:
    """One (linear, M, input dtype, output dtype, path): the compiled kernels, split-K and scratch, decided once.

    Calling it only launches: the input rotation (unless the M = 1 GEMM does it), then the decode GEMM (fused
    output rotation or not) or the dequantize + torch GEMM, then the output rotation; the output is the caller's
    ``out`` or a new tensor."""

    def __init__(self, lin: DeviceLinear, tokens: int, in_dtype: torch.dtype, out_dtype: torch.dtype, path: str):
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}: use auto, {', '.join(PATHS)}")
        info, device = lin.info, lin.device
        arch = target_arch(device)
        self.path, self.out_dtype = path, out_dtype
        self.out_shape = (tokens, info.out_features)
        self.gemm = self.dequant = self.rotate_in = self.rotate_out = None
        if path == "fold":
            self._plan_fold(lin, tokens, in_dtype, arch)
            return
        if path == "dequant":
            rows = ((tokens, info.in_padded), torch.float16)
            xr, partials, w_hat_t = scratch.views(device, rows, ((1, tokens, info.out_padded), torch.float16),
                                                  ((info.out_padded, info.in_padded), torch.float16))
            self.dequant = launch.dequant_launcher(
                launch.compiled(DequantConfig(float(info.bits), Codebook(info.codebook).value), arch), lin.words,
                w_hat_t)
            self.matmul = (xr, w_hat_t.t(), partials[0])  # views made once, not per call
            self._rotate_out(lin, partials, arch)
        else:
            output = KERNEL_DTYPES[out_dtype] if path == "gemm" else None
            # One token: the GEMM rotates x itself (one launch for the whole linear).
            rotated_input = KERNEL_DTYPES[in_dtype] if path == "gemm" and tokens == 1 else None
            self.gemm_plan = plan_gemm(tokens, lin, sm_count(device), output=output,
                                       has_bias=lin.bias is not None and output is not None, input=rotated_input,
                                       early_next=early_next("gemm", tokens, arch))
            x_order = self.gemm_plan.config.x_order
            rows = ((x_rows(tokens, self.gemm_plan.config), x_row_halves(info.in_padded, x_order)), torch.float16)
            xr, partials = scratch.views(device, rows,
                                         ((self.gemm_plan.splits, tokens, info.out_padded), torch.float32))
            fn, k_split = launch.compiled(self.gemm_plan.config, arch), self.gemm_plan.k_tiles_per_split
            if output is None:
                self.gemm = launch.gemm_launcher(fn, xr, lin.words, partials, k_split)
                self._rotate_out(lin, partials, arch)
            else:
                token_blocks = math.ceil(tokens / self.gemm_plan.config.tokens_per_cta)
                (arrivals,) = counters.views(device, ((token_blocks * (info.out_padded // 128),), torch.int32))
                if self.gemm_plan.config.input is not None:
                    self.gemm = launch.rotating_gemm_launcher(fn, lin.suh, lin.words, partials, k_split, lin.svh,
                                                              lin.bias, arrivals)
                    return
                fused = launch.gemm_launcher(fn, xr, lin.words, partials, k_split, lin.svh, lin.bias, arrivals)
                self.gemm = lambda x, y: fused(y)
        rotation = InputRotationConfig(KERNEL_DTYPES[in_dtype], "rows" if self.gemm is None else x_order,
                                       early_next=early_next("input", tokens, arch))
        self.rotate_in = launch.input_rotation_launcher(launch.compiled(rotation, arch), lin.suh, xr)

    def _plan_fold(self, lin: DeviceLinear, tokens: int, in_dtype: torch.dtype, arch: str) -> None:
        """W' (rotations folded in) into scratch, then y = x @ W' (+ bias) by cuBLAS, straight into y when the
        dtypes agree, else through an x-dtype scratch and one copy."""
        info = lin.info
        w_fold, tmp = scratch.views(lin.device, ((info.in_padded, info.out_padded), in_dtype),
                                    ((tokens, info.out_features), in_dtype))
        self.fold = fold.fold_launcher(fold.compiled_fold(lin, in_dtype, arch), lin, w_fold)
        w = w_fold[: info.in_features, : info.out_features]
        bias = None if lin.bias is None else lin.bias[: info.out_features].to(in_dtype)
        direct = self.out_dtype == in_dtype

        def matmul(x: torch.Tensor, y: torch.Tensor) -> None:
            dst = y if direct else tmp
            if bias is None:
                torch.mm(x, w, out=dst)
            else:
                torch.addmm(bias, x, w, out=dst)
            if not direct:
                y.copy_(dst)

        self.folded_matmul = matmul

    def _rotate_out(self, lin: DeviceLinear, partials: torch.Tensor, arch: str) -> None:
        cfg = OutputRotationConfig(KERNEL_DTYPES[self.out_dtype], KERNEL_DTYPES[partials.dtype], lin.bias is not None,
                                   early_next=early_next("output", partials.shape[1], arch))
        self.rotate_out = launch.output_rotation_launcher(launch.compiled(cfg, arch), partials, lin.svh, lin.bias)

    @property
    def launches(self) -> int:
        return {"gemm": 1 + (self.rotate_in is not None), "gemm-unfused": 3, "dequant": 4, "fold": 2}[self.path]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = x.new_empty(self.out_shape, dtype=self.out_dtype) if out is None else out  # 2.3 us, torch.empty 3.0
        if self.path == "fold":
            self.fold()
            self.folded_matmul(x, y)
            return y
        if self.rotate_in is not None:
            self.rotate_in(x)
        if self.path == "gemm":
            self.gemm(x, y)
            return y
        if self.path == "dequant":
            self.dequant()
            xr, w_hat, p = self.matmul
            torch.mm(xr, w_hat, out=p)
        else:
            self.gemm()
        self.rotate_out(y)
        return y


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The caller's buffer (tests pass NaN-poisoned ones) or a fresh one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != torch.device(device) or out.stride(-1) != 1:
        raise ValueError(f"out must be a {dtype} tensor of shape {shape} on {device} with contiguous rows")
    return out


def rotate_input(x: torch.Tensor, lin: DeviceLinear, out: torch.Tensor | None = None,
                 x_order: str = "rows", rows: int | None = None) -> torch.Tensor:
    """fp16 ``[M, in_p]`` = H128(x_pad * suh) per 128-column block, in a GEMM's column order (doubled order:
    ``[M, 2*in_p]``, ``trellis.x_doubled_word``; stages order: ``[rows, in_p]``, ``x_rows`` of the GEMM, the rows
    past M not written)."""
    fn = launch.compiled(InputRotationConfig(KERNEL_DTYPES[x.dtype], x_order), target_arch(x.device))
    rows = x.shape[0] if rows is None else rows
    xr = _output(out, (rows, x_row_halves(lin.info.in_padded, x_order)), torch.float16, x.device)
    launch.input_rotation_launcher(fn, lin.suh, xr)(x)
    return xr


def trellis_gemm(
    xr: torch.Tensor, lin: DeviceLinear, plan: GemmPlan | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 partial products ``[splits, M, out_p]`` of ``xr @ W_hat`` (xr fp16 ``[M, in_p]``, row order)."""
    tokens = xr.shape[0]
    if plan is None:
        plan = plan_gemm(tokens, lin, sm_count(xr.device))
    fn = launch.compiled(plan.config, target_arch(xr.device))
    partials = _output(out, (plan.splits, tokens, lin.info.out_padded), torch.float32, xr.device)
    launch.gemm_launcher(fn, arrange_x(xr, plan.config), lin.words, partials, plan.k_tiles_per_split)()
    return partials


def x_rows(tokens: int, cfg: GemmConfig) -> int:
    """Rows of the GEMM's X for ``tokens`` tokens: in "stages" order whole token blocks (a block's stage is one bulk
    copy, so the last block's rows past M exist; nothing reads what they multiply to)."""
    return math.ceil(tokens / cfg.tokens_per_cta) * cfg.tokens_per_cta if cfg.x_order == "stages" else tokens


def arrange_x(xr: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """A row-order X ``[M, in_p]`` in the column order ``cfg`` reads (``trellis.X_ORDERS``; "stages": ``x_rows``
    rows, those past M zero)."""
    if cfg.x_order == "rows":
        return xr
    cols = np.arange(xr.shape[1])
    if cfg.x_order == "stages":
        rows = x_rows(xr.shape[0], cfg)
        out = xr.new_zeros(rows * xr.shape[1])
        index = x_stages_index(np.arange(xr.shape[0])[:, None], cols[None, :], rows)
        out[torch.from_numpy(index.reshape(-1)).to(xr.device)] = xr.reshape(-1)
        return out.view(rows, xr.shape[1])
    if cfg.x_order == "doubled":
        out = xr.new_empty((xr.shape[0], x_row_halves(xr.shape[1], "doubled")))
        words = torch.from_numpy(2 * x_doubled_word(cols)).to(xr.device)
        out[:, words], out[:, words + 1] = xr, xr
        return out
    out = torch.empty_like(xr)
    out[:, torch.from_numpy(x_fragment_slot(cols)).to(xr.device)] = xr
    return out


def rotate_output(
    partials: torch.Tensor, lin: DeviceLinear, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[M, out_features]`` = H128(sum of partials) * svh + bias, in ``out_dtype``."""
    cfg = OutputRotationConfig(
        out_dtype=KERNEL_DTYPES[out_dtype],
        partial_dtype=KERNEL_DTYPES[partials.dtype],
        has_bias=lin.bias is not None,
    )
    fn = launch.compiled(cfg, target_arch(partials.device))
    y = _output(out, (partials.shape[1], lin.info.out_features), out_dtype, partials.device)
    launch.output_rotation_launcher(fn, partials, lin.svh, lin.bias)(y)
    return y


def dequantize_t(lin: DeviceLinear, out: torch.Tensor | None = None) -> torch.Tensor:
    """W_hat^T fp16 ``(out_p, in_p)``; its transpose is bit-identical to ``exl3tool.reference.decode_trellis``."""
    info = lin.info
    fn = launch.compiled(DequantConfig(float(info.bits), Codebook(info.codebook).value), target_arch(lin.device))
    w_hat_t = _output(out, (info.out_padded, info.in_padded), torch.float16, lin.device)
    launch.dequant_launcher(fn, lin.words, w_hat_t)()
    return w_hat_t


def check_input(x: torch.Tensor, lin: DeviceLinear) -> None:
    name, width = lin.info.name, lin.info.in_features
    if x.dim() != 2 or x.shape[1] != width or x.shape[0] < 1:
        raise ValueError(f"{name}: input must be [M >= 1, {width}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: activations must be float16 or bfloat16, got {x.dtype}")
    if x.device != lin.device:
        raise ValueError(f"{name}: input is on {x.device}, weights on {lin.device}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: input rows must be contiguous")


def plan_for(lin: DeviceLinear, x: torch.Tensor, out_dtype: torch.dtype | None = None, path: str = "auto"):
    """The plan ``linear_forward(x, lin, out_dtype, path)`` runs (made and kept on first use)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    key = (x.shape, x.dtype, x.get_device(), out_dtype, path)
    plan = lin.plans.get(key)
    if plan is None:
        check_input(x, lin)
        tokens = x.shape[0]
        plan = lin.plans[key] = LinearPlan(lin, tokens, x.dtype, out_dtype,
                                           choose_path(tokens, lin) if path == "auto" else path)
    return plan


def linear_forward(
    x: torch.Tensor,
    lin: DeviceLinear,
    out_dtype: torch.dtype | None = None,
    path: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [M, out_features] = x @ W^T + bias`` for x ``[M, in_features]`` fp16/bf16 (rows contiguous).

    ``path``: "auto" (by M and N), "gemm" (decode GEMM, output rotation fused into its epilogue),
    "gemm-unfused" (the same GEMM, then the output rotation kernel), "dequant" (decode W_hat, then torch's
    tensor-core GEMM) or "fold" (W_hat with both rotations folded in, then one torch GEMM on x itself).
    ``out``: a buffer for y (rows contiguous); the first call with a new (shape, dtypes, path) makes its plan.
    """
    plan = plan_for(lin, x, out_dtype, path)
    if out is not None:
        out = _output(out, plan.out_shape, plan.out_dtype, x.device)
    return plan(x, out)
