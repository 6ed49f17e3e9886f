"""The benchmark driver: a `BenchRequest` in, a `BenchReport` out.

For every case: each implementation's first call (compiles, plans; timed apart), its output against the fp32
reference (a wrong output is reported and never timed), every weight copy warmed, then per mode the timed loops
of all implementations that passed, taking turns (``timing.time_interleaved``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from exl3tool.bench import cases as C
from exl3tool.bench.report import (
    BenchReport, Case, Check, Result, Settings, exl3_weight_bytes, fill_ratios, timed_result,
)
from exl3tool.bench.request import BenchRequest, MoESpec, require_peers
from exl3tool.bench.timing import (
    L2_MULTIPLE, capture_graph, environment, first_call_s, time_interleaved, warm_up,
)
from exl3tool.errors import terminal_safe
from exl3tool.ops.runtime import require_gpu, target_arch
from exl3tool.verify import Thresholds, compare

THRESHOLDS = Thresholds()  # verify's pass bounds: fp16 activations pass, any decode or layout error fails
Progress = Callable[[int, int, str], None]  # (cases done, cases in all, what runs next)


@dataclass(frozen=True)
class Context:
    device: torch.device
    dtype: torch.dtype
    seed: int
    l2_bytes: int
    copy_tbs: float
    peers: tuple[str, ...]


def check_output(out: torch.Tensor, ref: torch.Tensor) -> Check:
    if tuple(out.shape) != tuple(ref.shape):
        return Check(float("inf"), -1.0, float("inf"), False)
    c = compare(out.float(), ref)
    return Check(c.rel_l2, c.cosine, c.max_abs, c.passes(THRESHOLDS))


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return terminal_safe(f"{type(error).__name__}: {text[0] if text else ''}")[:300]


def measure(setup: C.Setup, ctx: Context, request: BenchRequest) -> Case:
    case = setup.case
    rows: dict[str, list[Result]] = {}  # by implementation, in the setup's order; modes in the request's
    checked = []  # (name, impl, step, common) of the implementations that passed the check: timed below

    def failed_rows(name, status, weight_bytes=0, **fields):
        return [Result(name, mode, status, weight_bytes, **fields) for mode in request.modes]

    for name, build in setup.impls:
        try:
            impl = build()
        except Exception as error:  # noqa: BLE001 - a peer or kernel that cannot be built is reported
            rows[name] = failed_rows(name, "failed", note=_one_line(error))
            continue
        if impl is None:
            continue  # not part of this version
        if impl.call is None:
            rows[name] = failed_rows(name, "skipped", impl.weight_bytes, note=impl.note)
            continue
        try:
            out, compile_s = first_call_s(lambda: impl.call(0))
            check = check_output(out, setup.reference) if impl.checked else None
            del out
            if check is None or check.passed:
                for c in range(1, impl.copies):  # every copy's first call (its plans) before any timing
                    impl.call(c)
                torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001
            rows[name] = failed_rows(name, "failed", impl.weight_bytes, copies=impl.copies, note=_one_line(error))
            continue
        common = dict(weight_bytes=impl.weight_bytes, copies=impl.copies, check=check, compile_s=compile_s)
        if check is not None and not check.passed:
            rows[name] = failed_rows(name, "wrong", note="output differs from the fp32 reference: not timed",
                                     **common)
            continue

        def step(impl=impl):
            for c in range(impl.copies):
                impl.call(c)

        rows[name] = []
        checked.append((name, impl, step, common))

    for mode in request.modes:
        turns = []  # (launch, name, impl, common): timed together, in turns
        for name, impl, step, common in checked:
            if mode == "graph" and not impl.capturable:
                rows[name].append(Result(name, mode, "eager-only", note=impl.note, **common))
                continue
            try:
                launch = capture_graph(step).replay if mode == "graph" else step
                warm_up(launch)
            except Exception as error:  # noqa: BLE001 - e.g. a peer whose capture fails at this M
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
                status = "eager-only" if mode == "graph" else "failed"
                rows[name].append(Result(name, mode, status, note=_one_line(error), **common))
                continue
            turns.append((launch, name, impl, common))
        try:
            timings = time_interleaved([(launch, impl.copies) for launch, _, impl, _ in turns], request.replays)
        except Exception as error:  # noqa: BLE001 - nothing of this mode is timed then
            timings = [error] * len(turns)
        for (_, name, impl, common), timing in zip(turns, timings):
            if isinstance(timing, Exception):
                rows[name].append(Result(name, mode, "failed", note=_one_line(timing), **common))
            else:
                rows[name].append(timed_result(name, mode, timing, flops=case.flops, copy_tbs=ctx.copy_tbs,
                                               note=impl.note, **common))
        del turns  # the graphs and their memory pools
    results = [r for name in rows for r in rows[name]]
    fill_ratios(results)
    case.results = results
    return case


# --- groups of cases ---------------------------------------------------------------------------------------


def _linear_copies(make, nbytes: int, ctx: Context) -> list:
    n = min(C.weight_copies(nbytes, ctx.l2_bytes), C.memory_limit(nbytes, ctx.device))
    first = make()
    return [first] + [C.clone(first) for _ in range(n - 1)]


def _synthetic_linear(in_f: int, out_f: int, bits: float, request: BenchRequest, ctx: Context):
    from exl3tool.synthetic import random_linear

    name = f"{in_f}x{out_f}"
    n = min(C.weight_copies(exl3_weight_bytes(in_f, out_f, bits), ctx.l2_bytes),
            C.memory_limit(exl3_weight_bytes(in_f, out_f, bits), ctx.device))
    # distinct random weights per copy (seeded): only copy 0 is checked, all are timed
    copies = [random_linear(in_f, out_f, bits, request.codebook, seed=request.seed * 7919 + i, name=name)
              .to(ctx.device) for i in range(n)]
    return C.LinearGroup(name, copies, ctx)


class _SyntheticMoE:
    """A one-layer Qwen3-MoE checkpoint written for --moe (ExLlamaV3 can load the same folder)."""

    def __init__(self, spec: MoESpec, bits: float, request: BenchRequest, ctx: Context):
        from exl3tool.checkpoint import open_checkpoint
        from exl3tool.synthetic import moe_layer_head_dim, write_moe_layer

        self.dir = Path(tempfile.mkdtemp(prefix="exl3tool-bench-moe-"))
        write_moe_layer(self.dir, spec.experts, spec.top_k, spec.hidden, spec.intermediate, bits, request.codebook,
                        request.seed)
        folder = None
        if "exllamav3" in ctx.peers:
            from exl3tool.bench.peers import prepare_moe_folder

            prepare_moe_folder(self.dir, 1, moe_layer_head_dim(spec.hidden))
            folder = self.dir
        self.reader = open_checkpoint(str(self.dir))
        name = f"{spec.hidden}x{spec.hidden}"  # the group label says experts and top-k
        self.group = C.MoEGroup(self.reader, 0, ctx, name, peer_folder=folder)

    def close(self):
        self.reader.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _short(name: str, layer: int) -> str:
    prefix = f"model.layers.{layer}."
    return name[len(prefix):] if name.startswith(prefix) else name


def _model_groups(reader, index: int, ctx: Context) -> Iterator:
    from exl3tool.format import GatedMLP, MoEBlock

    layer = reader.layer(index)
    distinct: dict[tuple, list] = {}
    for info in layer.linears:
        distinct.setdefault((info.in_features, info.out_features, info.bits, info.codebook), []).append(info)
    for infos in distinct.values():
        info = infos[0]
        name = _short(info.name, index) + (f" (+{len(infos) - 1} alike)" if len(infos) > 1 else "")
        nbytes = exl3_weight_bytes(info.in_features, info.out_features, info.bits, info.has_bias)
        yield lambda info=info, name=name, nbytes=nbytes: C.LinearGroup(
            name, _linear_copies(lambda: reader.load_linear(info.name, ctx.device), nbytes, ctx), ctx)
    block = layer.mlp
    if isinstance(block, GatedMLP):
        nbytes = sum(exl3_weight_bytes(i.in_features, i.out_features, i.bits, i.has_bias) for i in block.linears)
        yield lambda: C.MLPGroup(_short(block.name, index), block,
                                 _linear_copies(lambda: reader.mlp_tensors(block, ctx.device), nbytes, ctx), ctx)
    elif isinstance(block, MoEBlock):
        yield lambda: C.MoEGroup(reader, index, ctx, _short(block.name, index))


def run_bench(request: BenchRequest, progress: Progress | None = None, command: str | None = None) -> BenchReport:
    """Measure what ``request`` asks for on its GPU (GpuUnavailableError without one; UsageError for a requested
    peer that cannot be imported)."""
    require_peers(request.peers)
    device = require_gpu(request.device)
    if device.type == "cuda" and device.index is None:  # "cuda:N" everywhere (ExLlamaV3 loads onto a named one)
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        env = environment(device, target_arch(device))
        ctx = Context(device, getattr(torch, request.dtype), request.seed, env.l2_bytes, env.copy_tbs,
                      request.peers)
        report = BenchReport(env, Settings(request.modes, request.replays, L2_MULTIPLE, request.dtype,
                                           request.seed, request.peers, command))
        reader = None
        try:
            makers: list[Callable] = []  # each makes one group (its weights on the GPU) when its turn comes
            for in_f, out_f in request.shapes:
                for bits in request.bits:
                    makers.append(lambda i=in_f, o=out_f, b=bits: _synthetic_linear(i, o, b, request, ctx))
            for spec in request.moe:
                for bits in request.bits:
                    makers.append(lambda s=spec, b=bits: _SyntheticMoE(s, b, request, ctx))
            if request.model is not None:
                from exl3tool.verify import open_model

                reader, _ = open_model(request.model, request.revision)
                makers += list(_model_groups(reader, request.layer, ctx))
            total, done = len(makers) * len(request.tokens), 0
            for make in makers:
                made = make()
                group = made.group if isinstance(made, _SyntheticMoE) else made
                try:
                    for tokens in request.tokens:
                        if progress is not None:
                            progress(done, total, f"{group.kind} {group.name} M={tokens}")
                        report.cases.append(measure(group.setup(tokens), ctx, request))
                        done += 1
                finally:
                    if isinstance(made, _SyntheticMoE):
                        made.close()
                    del group, made
                    torch.cuda.empty_cache()
            if progress is not None:
                progress(total, total, "done")
        finally:
            if reader is not None:
                reader.close()
    return report
