"""`exl3tool bench`: our kernels timed against peers on the same GPU in the same run, and their machine code.

    run_bench(BenchRequest(...), progress=None) -> BenchReport      needs a CUDA GPU
    sass_report(arch, bits, codebook, tokens) -> SassReport         CPU only (nvdisasm from the sass extra)
    moe_sass_report(arch, specs, bits, codebook, tokens)            the same for fused MoE blocks (MoESpec)
    write_plot(report, path)                                        matplotlib (the plot extra)

    request.py   BenchRequest and the parsers of its command-line strings
    report.py    the report dataclasses, derived-figure arithmetic, JSON (schema exl3tool.bench/1)
    timing.py    CUDA-graph / eager timing, copy bandwidth, the environment
    cases.py     linear, MLP and MoE groups and their implementation tables
    peers.py     ExLlamaV3's linear and MoE block
    run.py       the driver: check against the reference, then time
    sassreport.py, plot.py
    ab.py        A/B of tuning constants, each variant in its own processes (python -m exl3tool.bench.ab)

torch and the kernels are imported only when a function runs, so the CLI starts fast.
"""

from exl3tool.bench.report import SASS_SCHEMA, SCHEMA, BenchReport, SassReport
from exl3tool.bench.request import BenchRequest, MoESpec


def run_bench(request, progress=None, command=None):
    from exl3tool.bench.run import run_bench as run

    return run(request, progress, command)


def sass_report(arch, bits=(4.0,), codebook="mcg", tokens=(1, 16, 256, 4096), progress=None):
    from exl3tool.bench.sassreport import sass_report as report

    return report(arch, bits, codebook, tokens, progress)


def moe_sass_report(arch, specs, bits=(4.0,), codebook="mcg", tokens=(1, 16, 256, 4096), progress=None):
    from exl3tool.bench.sassreport import moe_sass_report as report

    return report(arch, specs, bits, codebook, tokens, progress)


def write_plot(report, path):
    from exl3tool.bench.plot import write_plot as plot

    return plot(report, path)


__all__ = ["SASS_SCHEMA", "SCHEMA", "BenchReport", "BenchRequest", "MoESpec", "SassReport", "moe_sass_report",
           "run_bench", "sass_report", "write_plot"]
