"""Builders and launchers of the fused MoE kernels, side by side: each kernel's argument list is spelled here once.

A builder compiles with fake tensors (dynamic dims as SymInts, 16-byte aligned) and TVM FFI's environment
stream; a launcher calls the compiled function with torch tensors, which TVM FFI checks (dtype, rank, alignment)
and launches on torch's current stream, so the launches are CUDA-graph capturable.
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
import torch

from exl3tool.kernels.moe_gemm import MoEGemm, MoEGemmConfig
from exl3tool.kernels.moe_gemm_pair import MoEGemmPair, MoEGemmPairConfig
from exl3tool.kernels.moe_rotate import (
    Intermediate, IntermediateConfig, RouteInputRotation, RouteInputRotationConfig, TopKSum, TopKSumConfig,
)
from exl3tool.kernels.moe_route import MoERoute, MoERouteConfig
from exl3tool.kernels.rotate import DTYPES
from exl3tool.ops.launch import fake_stream, fake_tensor
from exl3tool.ops.runtime import compile_cached

F16, F32, I32 = cutlass.Float16, cutlass.Float32, cutlass.Int32


def _compile(kernel, args, options: str):
    return cute.compile(kernel, *args, fake_stream(), options=options)


# --- builders ------------------------------------------------------------------------------------------------


def build_route(cfg: MoERouteConfig, options: str):
    m, h = cute.sym_int(), cute.sym_int()
    args = [fake_tensor(DTYPES[cfg.x_dtype], m, h), fake_tensor(F16, None, h), fake_tensor(F32, None),
            fake_tensor(I32, None, None), fake_tensor(F32, None, None), fake_tensor(F32, m, None),
            fake_tensor(I32, m, None), fake_tensor(F32, m, None), fake_tensor(I32, None), fake_tensor(I32, None),
            fake_tensor(I32, None), fake_tensor(I32, None), fake_tensor(I32, None), fake_tensor(I32, None), 0]
    return _compile(MoERoute(cfg), args, options)


def build_gemm(cfg: MoEGemmConfig, options: str):
    rows = cute.sym_int()
    words = int(16 * cfg.bits) // 2
    x = fake_tensor(I32, cfg.planes, rows, None)
    suh, routes, topk = [None] * 2, [None] * 3, [None] * 4
    if cfg.input is not None:  # x itself; gate and up suh
        x = fake_tensor(DTYPES[cfg.input], cfg.resident_rows, None, align=2)
        suh = [fake_tensor(F16, None, None), fake_tensor(F16, None, None)]
    if cfg.input is not None or cfg.topk_sum is not None:  # topk_ids, route_row; the ranks with resident rows or
        # where the GEMM writes the routes
        routes = [fake_tensor(I32, cfg.resident_rows, None), fake_tensor(I32, None),
                  fake_tensor(I32, None) if cfg.resident_rows > 1 or cfg.writes_routes else None]
    if cfg.topk_sum is not None:  # down_svh, svh_row, topk_weights, y
        topk = [fake_tensor(F16, None, None), fake_tensor(I32, None), fake_tensor(F32, 1, None),
                fake_tensor(DTYPES[cfg.topk_sum.out_dtype], 1, None)]
    if cfg.writes_routes:  # topk_weights
        topk[2] = fake_tensor(F32, 1, None)
    chooser = [None] * 2
    if cfg.route is not None:  # the router's logits and bias
        chooser = [fake_tensor(F32, 1, None), fake_tensor(F32, None)]
    args = [x, fake_tensor(I32, cfg.planes, None, None, None, words), partials_tensor(cfg, rows),
            fake_tensor(I32, None), fake_tensor(I32, None), 0]
    inter = [None] * 2
    if cfg.intermediate_splits:  # rotations, X2
        inter = [fake_tensor(F16, None, None), fake_tensor(F16, rows, None)]
    row_route = fake_tensor(I32, rows) if cfg.takes_row_route else None
    counter = fake_tensor(I32, None) if cfg.intermediate_splits or cfg.ready_wait else None
    sum_counter = fake_tensor(I32, None) if cfg.topk_sum is not None else None
    return _compile(MoEGemm(cfg), args + inter + [row_route, counter, 0] + suh + routes + topk + [sum_counter]
                    + chooser, options)


def build_gemm_pair(cfg: MoEGemmPairConfig, options: str):
    rows = cute.sym_int()

    def weights(c: MoEGemmConfig):
        return fake_tensor(I32, c.planes, None, None, None, int(16 * c.bits) // 2)

    g13, g2 = cfg.gate_up, cfg.down
    args = [fake_tensor(I32, 2, rows, None), weights(g13), partials_tensor(g13, rows),
            fake_tensor(I32, 1, rows, None), weights(g2), partials_tensor(g2, rows), fake_tensor(I32, None),
            fake_tensor(I32, None), 0, 0, fake_tensor(F16, None, None), fake_tensor(F16, rows, None),
            fake_tensor(I32, rows), fake_tensor(I32, None), 0]
    return _compile(MoEGemmPair(cfg), args, options)


def build_input_rotation(cfg: RouteInputRotationConfig, options: str):
    m = cute.sym_int()
    args = [fake_tensor(DTYPES[cfg.x_dtype], m, None), fake_tensor(F16, None, None), fake_tensor(F16, None, None),
            fake_tensor(F16, 2, None, None), fake_tensor(I32, m, cfg.routes_per_token), fake_tensor(I32, None),
            fake_tensor(I32, None), fake_tensor(I32, None), fake_tensor(I32, None), fake_tensor(I32, None)]
    return _compile(RouteInputRotation(cfg), args, options)


def build_intermediate(cfg: IntermediateConfig, options: str):
    args = [partials_tensor(cfg), fake_tensor(F16, None, None), fake_tensor(F16, None, None), fake_tensor(I32, None),
            fake_tensor(I32, None), fake_tensor(I32, None), fake_tensor(I32, None, None), fake_tensor(I32, None), 0, 0]
    return _compile(Intermediate(cfg), args, options)


def build_topk_sum(cfg: TopKSumConfig, options: str):
    m = cute.sym_int()
    args = [partials_tensor(cfg), fake_tensor(F16, None, None), fake_tensor(I32, None),
            fake_tensor(I32, m, cfg.routes_per_token), fake_tensor(F32, m, cfg.routes_per_token), fake_tensor(I32, None),
            fake_tensor(DTYPES[cfg.out_dtype], m, None)]
    return _compile(TopKSum(cfg), args, options)


def partials_tensor(cfg, rows=None):
    """P ``[splits, rows, columns]`` in the config's ``partials`` dtype."""
    return fake_tensor(DTYPES[cfg.partials], None, rows, None)


BUILDERS = {
    MoERouteConfig: build_route, MoEGemmConfig: build_gemm, MoEGemmPairConfig: build_gemm_pair,
    RouteInputRotationConfig: build_input_rotation,
    IntermediateConfig: build_intermediate, TopKSumConfig: build_topk_sum,
}


def compiled(cfg, arch: str):
    return compile_cached(("moe", type(cfg).__name__, cfg), arch, partial(BUILDERS[type(cfg)], cfg))


# --- launchers (argument order = the kernels' __call__) -----------------------------------------------------


def launch_route(fn, x, router, bias, given_ids, given_w, logits, ids, w, rank, counters, counts, expert_row,
                 block_expert, row_route, block_rows: int):
    fn(x, router, bias, given_ids, given_w, logits, ids, w, rank, counters, counts, expert_row, block_expert,
       row_route, block_rows)


def launch_gemm(fn, x_words, w_words, partials, block_expert, group_row, k_tiles_per_split: int, rotations=None,
                x2=None, row_route=None, counters=None, inter_true: int = 0, gate_suh=None, up_suh=None, ids=None,
                route_row=None, rank=None, svh=None, svh_row=None, weights=None, y=None, sum_counters=None,
                logits=None, bias=None):
    fn(x_words, w_words, partials, block_expert, group_row, k_tiles_per_split, rotations, x2, row_route, counters,
       inter_true, gate_suh, up_suh, ids, route_row, rank, svh, svh_row, weights, y, sum_counters, logits, bias)


def launch_gemm_pair(fn, x_words, w13_words, p13, x2_words, w2_words, p2, block_expert, group_row, per13: int,
                     per2: int, rotations, x2, row_route, counters, inter_true: int):
    fn(x_words, w13_words, p13, x2_words, w2_words, p2, block_expert, group_row, per13, per2, rotations, x2,
       row_route, counters, inter_true)


def launch_input_rotation(fn, x, gate_suh, up_suh, xr, ids, rank, expert_row, group_row, row_route, route_row):
    fn(x, gate_suh, up_suh, xr, ids, rank, expert_row, group_row, row_route, route_row)


def launch_intermediate(fn, partials, rotations, x2, row_route, block_expert, group_row, ids, route_row,
                        inter_true: int, block_rows: int):
    fn(partials, rotations, x2, row_route, block_expert, group_row, ids, route_row, inter_true, block_rows)


def launch_topk_sum(fn, partials, svh, svh_row, ids, w, route_row, y):
    fn(partials, svh, svh_row, ids, w, route_row, y)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """int16 trellis / fp16 activations as the int32 words the GEMM reads (a view, no copy)."""
    return t.view(torch.int32)
