"""Kernel benchmarks: medians over CUDA-graph replays, weights rotated past the L2, checked against the reference.

    python -m exl3tool.bench [--shape 4096x14336] [--bits 2,4,6] [--codebook mcg] [--tokens 1,16,256,4096]

Per shape, bitrate and M: our EXL3 linear (decode GEMM path and dequantize+GEMM path), torch's fp16 matmul on the
same shape, and the device-to-device copy bandwidth of this GPU, all measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import asdict, dataclass

import torch

from exl3tool.ops import linear as ops

L2_MULTIPLE = 3  # the weights a graph replay touches exceed 3x the L2, so they stream from HBM
PATHS = ("auto", "gemm-unfused", "gemm", "dequant")  # auto = what linear_forward picks by default


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    max_us: float


def time_graph(step, calls: int, replays: int = 30) -> Timing:
    """Capture ``step()`` (which makes ``calls`` launches of the thing measured) in a CUDA graph and time replays.

    Returns per-call microseconds: median/min/max over ``replays`` timed replays, after warm-up."""
    step()  # compile + warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return Timing(statistics.median(times), min(times), max(times))


def copy_bandwidth_tbs(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), TB/s: an elementwise copy kernel,
    median of ``repeats`` after warm-up (graph-captured memcpy nodes go through a slower path)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mul(src, 1.0, out=dst)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times) / 1e12


def random_device_linear(in_features: int, out_features: int, bits: float, codebook: str, seed: int):
    """A random EXL3 linear made directly on the GPU (random trellis bits, ±1-scaled suh/svh)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    in_p, out_p = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    words = torch.randint(-(2**31), 2**31 - 1, (in_p // 16, out_p // 16, int(8 * bits)), generator=g,
                          dtype=torch.int64, device="cuda").to(torch.int32)
    sign = lambda n: (torch.randint(0, 2, (n,), generator=g, device="cuda") * 2 - 1).half()  # noqa: E731
    from exl3tool.format import Codebook, LinearInfo

    info = LinearInfo("bench", in_features, out_features, in_p, out_p, bits, Codebook(codebook), False, False)
    return ops.DeviceLinear(info, words, sign(in_p) * 0.01, sign(out_p) * 0.01)


@dataclass(frozen=True)
class Row:
    shape: str
    bits: float
    codebook: str
    tokens: int
    what: str
    median_us: float
    min_us: float
    max_us: float
    weight_tbs: float  # EXL3 (or fp16) weight bytes streamed per second
    pct_copy_bw: float
    tflops: float
    rel_l2: float | None  # vs the fp32 torch reference, same inputs


def _rel_l2(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def bench_shape(in_f: int, out_f: int, bits: float, codebook: str, tokens_list, copy_tbs: float, l2_bytes: int):
    from exl3tool.reference import decode_trellis, rotate_input, rotate_output

    exl3_bytes = in_f * out_f * bits / 8 + 2 * (in_f + out_f)
    copies = max(2, math.ceil(L2_MULTIPLE * l2_bytes / exl3_bytes))
    lins = [random_device_linear(in_f, out_f, bits, codebook, seed=i) for i in range(copies)]
    w_hat = decode_trellis(lins[0].words.view(torch.int16), codebook, bits).float()
    fp16_bytes = in_f * out_f * 2
    fp16_copies = max(2, math.ceil(L2_MULTIPLE * l2_bytes / fp16_bytes))
    dense = [torch.randn(in_f, out_f, dtype=torch.float16, device="cuda") * 0.02 for _ in range(fp16_copies)]
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, in_f, dtype=torch.float16, device="cuda")
        x_pad = torch.nn.functional.pad(x.float(), (0, lins[0].info.in_padded - in_f))
        ref = rotate_output(rotate_input(x_pad, lins[0].suh) @ w_hat, lins[0].svh)[:, :out_f]
        flops = 2 * tokens * in_f * out_f
        for path in PATHS:
            got = ops.linear_forward(x, lins[0], path=path)
            t = time_graph(lambda: [ops.linear_forward(x, lin, path=path) for lin in lins], calls=copies)
            rows.append(_row(in_f, out_f, bits, codebook, tokens, f"exl3 {path}", t, exl3_bytes, copy_tbs, flops,
                             _rel_l2(got, ref)))
        t = time_graph(lambda: [x @ w for w in dense], calls=fp16_copies)
        rows.append(_row(in_f, out_f, bits, codebook, tokens, "fp16 torch", t, fp16_bytes, copy_tbs, flops, None))
    return rows


def _row(in_f, out_f, bits, codebook, tokens, what, t, nbytes, copy_tbs, flops, err):
    tbs = nbytes / (t.median_us * 1e-6) / 1e12
    return Row(f"{in_f}x{out_f}", bits, codebook, tokens, what, round(t.median_us, 2), round(t.min_us, 2),
               round(t.max_us, 2), round(tbs, 3), round(100 * tbs / copy_tbs, 1), round(flops / t.median_us / 1e6, 1),
               None if err is None else float(f"{err:.3g}"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None, help="INxOUT, repeatable (default 4096x14336)")
    parser.add_argument("--bits", default="2,4,6")
    parser.add_argument("--codebook", default="mcg")
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    ops.require_gpu()
    props = torch.cuda.get_device_properties(0)
    copy_tbs = copy_bandwidth_tbs()
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB, "
          f"copy bandwidth {copy_tbs:.2f} TB/s, torch {torch.__version__}")
    rows = []
    for shape in args.shape or ["4096x14336"]:
        in_f, out_f = (int(v) for v in shape.split("x"))
        for bits in (float(b) for b in args.bits.split(",")):
            rows += bench_shape(in_f, out_f, bits, args.codebook, [int(m) for m in args.tokens.split(",")],
                                copy_tbs, props.L2_cache_size)
            for r in rows[-(len(PATHS) + 1) * len(args.tokens.split(",")):]:
                print(" | ".join(str(v) for v in asdict(r).values()), flush=True)
    print(markdown_table(rows))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"gpu": props.name, "copy_tbs": copy_tbs, "rows": [asdict(r) for r in rows]}, f, indent=1)


def markdown_table(rows: list[Row]) -> str:
    """One line per (shape, K, M): the default path's median, its share of copy bandwidth, the other paths and
    torch fp16 on the same shape, and the default path's error vs the fp32 reference."""
    by_key: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_key.setdefault((r.shape, r.bits, r.codebook, r.tokens), {})[r.what] = r
    lines = ["| shape | K | cb | M | auto us | % copy BW | TFLOP/s | gemm-unfused | gemm (fused) | dequant | "
             "fp16 torch | auto vs fp16 | rel L2 |", "|" + "---|" * 13]
    for (shape, bits, cb, tokens), r in by_key.items():
        auto, fp16 = r["exl3 auto"], r["fp16 torch"]
        lines.append(
            f"| {shape} | {bits:g} | {cb} | {tokens} | {auto.median_us} | {auto.pct_copy_bw} | {auto.tflops} | "
            f"{r['exl3 gemm-unfused'].median_us} | {r['exl3 gemm'].median_us} | {r['exl3 dequant'].median_us} | "
            f"{fp16.median_us} | {fp16.median_us / auto.median_us:.2f}x | {auto.rel_l2:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
