"""`exl3tool bench --sass`: the kernels a linear (or, with ``--moe``, a fused MoE block) launches, compiled for any
arch on the CPU (no GPU), read with `exl3tool.sass`: registers, spills, shared memory per CTA, CTAs an SM (decode
GEMMs), main-loop SASS per decoded weight by pipe.

The kernels are the ones the planners pick for the requested K, codebook and token counts. A linear
(`exl3tool.ops.linear.plan_gemm`): the decode GEMM per token-group count, its fused-epilogue variant (M <= 8), the
dequantize kernel, the fold kernel (large M) and the two rotations. A MoE block
(`exl3tool.ops.moe_configs.step_configs`, for the arch's typical SM count): each step's route, input rotation, gate/up
and down GEMMs, Intermediate and top-k sum, where they are launches of their own.
"""

from __future__ import annotations

from types import SimpleNamespace

from exl3tool.bench.report import SassReport, SassRow
from exl3tool.format import Codebook, LinearInfo


def _row(label: str, k, arch: str, config=None) -> SassRow:
    """``config``: a decode GEMM's, for its CTAs an SM (threads from its warps; static and dynamic shared memory)
    and the issue its resident warps can reach by ptxas's fixed stalls alone."""
    from exl3tool.ops.targets import limits, resident_ctas

    ctas = None if config is None else resident_ctas(arch, 32 * config.warps, k.smem_per_cta_bytes, k.registers)
    issue_cap = None
    if ctas is not None and k.stall_cycles_per_weight:
        warps_a_scheduler = ctas * config.warps / limits(arch).schedulers
        issue_cap = min(1.0, warps_a_scheduler * k.per_weight / k.stall_cycles_per_weight)
    return SassRow(
        kernel=label, symbol=k.name, registers=k.registers, spill_bytes=k.frame_bytes,
        spill_instructions=k.spill_instructions, static_smem_bytes=k.static_smem_bytes,
        smem_per_cta_bytes=k.smem_per_cta_bytes,
        loop_instructions=None if k.main_loop is None else len(k.main_loop.instructions),
        per_weight=k.per_weight, per_weight_by_pipe=k.per_weight_by_pipe, ctas_per_sm=ctas,
        stall_cycles_per_weight=k.stall_cycles_per_weight, issue_cap=issue_cap,
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
        jobs += [(label, lambda cfg=cfg: gemm_report(cfg, arch), cfg) for cfg, label in configs.items()]
        dq = DequantConfig(float(k), codebook)
        jobs.append((f"dequant K{k:g} {codebook}", lambda dq=dq: _analyze(dq, arch), None))
        if max(tokens) >= FOLD_MIN_TOKENS:
            fc = FoldConfig(float(k), codebook, "float16")
            jobs.append((f"fold K{k:g} {codebook} fp16", lambda fc=fc: _analyze(fc, arch, fold_builder), None))
    jobs.append(("rotate in fp16", lambda: _analyze(InputRotationConfig("float16"), arch), None))
    jobs.append(("rotate out fp32>fp16",
                 lambda: _analyze(OutputRotationConfig("float16", "float32", False), arch), None))
    return SassReport(arch, _run(jobs, arch, progress))


def _run(jobs, arch: str, progress) -> tuple[SassRow, ...]:
    """(label, analysis, decode GEMM config or None) jobs, compiled in turn."""
    rows = []
    for i, (label, job, config) in enumerate(jobs):
        if progress is not None:
            progress(i, len(jobs), label)
        rows.append(_row(label, job(), arch, config))
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return tuple(rows)


def moe_layer(spec, bits: float, codebook: str):
    """The ``moe_configs.LayerShape`` of a synthetic MoE block (``MoESpec``, Qwen3-MoE routing, one expert group of K
    ``bits`` / ``codebook``)."""
    from exl3tool.format import padded
    from exl3tool.kernels.moe_route import MoERouteConfig
    from exl3tool.ops.moe_configs import GroupShape, LayerShape

    experts = GroupShape(float(bits), codebook, float(bits), codebook, padded(spec.intermediate))
    return LayerShape(MoERouteConfig("softmax_topk", spec.experts, spec.top_k), padded(spec.hidden), (experts,))


def moe_sass_report(arch: str, specs, bits=(4.0,), codebook: str = "mcg", tokens=(1, 16, 256, 4096),
                    progress=None) -> SassReport:
    """The fused MoE's kernels for each block in ``specs`` (``MoESpec``) at each token count: every distinct config
    once, labelled with the token counts that launch it."""
    from exl3tool.kernels.moe_gemm import MoEGemmConfig
    from exl3tool.ops.moe_configs import step_configs
    from exl3tool.ops.moe_kernels import BUILDERS
    from exl3tool.ops.targets import typical_sms
    from exl3tool.sass import gemm_report, nvdisasm_path

    nvdisasm_path()  # SassToolError (naming the extra) before any compile
    sm_count = typical_sms(arch)
    found: dict[tuple, list[int]] = {}  # (block name, role, config) -> token counts
    for spec in specs:
        for k in bits:
            layer = moe_layer(spec, k, codebook)
            name = f"moe {spec.experts}e top-{spec.top_k} {spec.hidden}x{spec.intermediate} K{k:g} {codebook}"
            for m in tokens:
                for role, config in step_configs(layer, m, False, arch, sm_count, "float16", "float16").kernels():
                    found.setdefault((name, role, config), []).append(m)
    jobs = []
    for (name, role, config), ms in found.items():
        gemm = isinstance(config, MoEGemmConfig)
        head = getattr(config, "gate_up", config)  # a GEMM pair: its gate/up half's rows
        rows = f" {head.tokens_per_cta}-row {head.mma}" if isinstance(head, MoEGemmConfig) else ""
        label = f"{name} {role}{rows} (M={','.join(map(str, ms))})"
        job = (lambda c=config: gemm_report(c, arch)) if gemm else (
            lambda c=config: _analyze(c, arch, BUILDERS[type(c)]))
        jobs.append((label, job, config if gemm else None))
    return SassReport(arch, _run(jobs, arch, progress), sm_count)
