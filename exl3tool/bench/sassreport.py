"""`exl3tool bench --sass`: the kernels a linear launches, compiled for any arch on the CPU (no GPU), read with
`exl3tool.sass`: registers, spills, shared memory per CTA, main-loop SASS per decoded weight by pipe.

The kernels are the ones the planner picks (`exl3tool.ops.linear.plan_gemm`) for the requested K, codebook and
token counts: the decode GEMM per token-group count, its fused-epilogue variant (M <= 8), the dequantize kernel,
the fold kernel (large M) and the two rotations.
"""

from __future__ import annotations

from types import SimpleNamespace

from exl3tool.bench.report import SassReport, SassRow
from exl3tool.format import Codebook, LinearInfo


def _row(label: str, k) -> SassRow:
    return SassRow(
        kernel=label, symbol=k.name, registers=k.registers, spill_bytes=k.frame_bytes,
        spill_instructions=k.spill_instructions, static_smem_bytes=k.static_smem_bytes,
        smem_per_cta_bytes=k.smem_per_cta_bytes,
        loop_instructions=None if k.main_loop is None else len(k.main_loop.instructions),
        per_weight=k.per_weight, per_weight_by_pipe=k.per_weight_by_pipe,
    )


def _gemm_label(bits: float, codebook: str, cfg) -> str:
    halves = " split halves" if getattr(cfg, "split_halves", False) else ""
    wgmma = " wgmma" if getattr(cfg, "mma", "sync") == "wgmma" else ""
    return f"gemm K{bits:g} {codebook} M{cfg.tokens_per_cta}/CTA{halves}{wgmma}"


def _analyze(config, arch: str, build=None):
    from exl3tool.ops import launch
    from exl3tool.sass import analyze_cubin, compile_cubin

    build = build or launch.BUILDERS[type(config)]
    cubin = compile_cubin(lambda options: build(config, options), arch)
    # the dynamic shared memory is the launch's to decide: known from configs that size it (else None)
    (kernel,) = analyze_cubin(cubin, dynamic_smem_bytes=getattr(config, "smem_bytes", None))
    return kernel


def planned_gemm_config(bits: float, codebook: str, tokens: int, arch: str, **config):
    """The decode GEMM config the planner picks for ``tokens`` on ``arch`` (it depends on K, codebook and M only:
    sizes set split-K, not the kernel)."""
    from exl3tool.ops.linear import plan_gemm

    stand_in = SimpleNamespace(info=LinearInfo("sass", 4096, 4096, 4096, 4096, float(bits), Codebook(codebook),
                                               False, False))
    return plan_gemm(tokens, stand_in, sm_count=1, arch=arch, **config).config


def sass_report(arch: str, bits=(4.0,), codebook: str = "mcg", tokens=(1, 16, 256, 4096),
                progress=None) -> SassReport:
    from exl3tool.kernels.dequant import DequantConfig
    from exl3tool.kernels.rotate import InputRotationConfig, OutputRotationConfig
    from exl3tool.kernels.fold import FoldConfig
    from exl3tool.ops.fold import fold_builder
    from exl3tool.ops.linear import FOLD_MIN_TOKENS, FUSED_MAX_TOKENS
    from exl3tool.sass import gemm_report, nvdisasm_path

    nvdisasm_path()  # SassToolError (naming the extra) before any compile
    jobs = []
    for k in bits:
        configs = {}
        for m in tokens:
            cfg = planned_gemm_config(k, codebook, m, arch)
            configs.setdefault(cfg, _gemm_label(k, codebook, cfg))
        if min(tokens) <= FUSED_MAX_TOKENS:
            cfg = planned_gemm_config(k, codebook, min(tokens), arch, output="float16")
            configs[cfg] = _gemm_label(k, codebook, cfg) + " fused fp16 out"
        if 1 in tokens:  # what one token runs: one launch, both rotations fused (its own stage count per arch)
            cfg = planned_gemm_config(k, codebook, 1, arch, output="float16", input="float16")
            configs[cfg] = _gemm_label(k, codebook, cfg) + f" one launch ({cfg.stages} stages)"
        jobs += [(label, lambda cfg=cfg: gemm_report(cfg, arch)) for cfg, label in configs.items()]
        dq = DequantConfig(float(k), codebook)
        jobs.append((f"dequant K{k:g} {codebook}", lambda dq=dq: _analyze(dq, arch)))
        if max(tokens) >= FOLD_MIN_TOKENS:
            fc = FoldConfig(float(k), codebook, "float16")
            jobs.append((f"fold K{k:g} {codebook} fp16", lambda fc=fc: _analyze(fc, arch, fold_builder)))
    jobs.append(("rotate in fp16", lambda: _analyze(InputRotationConfig("float16"), arch)))
    jobs.append(("rotate out fp32>fp16",
                 lambda: _analyze(OutputRotationConfig("float16", "float32", False), arch)))
    rows = []
    for i, (label, job) in enumerate(jobs):
        if progress is not None:
            progress(i, len(jobs), label)
        rows.append(_row(label, job()))
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return SassReport(arch, tuple(rows))
