"""A/B of tuning constants: each variant in its own processes, taking turns, y digests compared.

    python -m exl3tool.bench.ab [--rounds N] [--replays R] [--profile] [--timeline] [--budget-s S] [--lines-out FILE]
                                [--worker-timeout-s S]
                                --variant NAME[:MODULE.ATTR=VALUE;...] ... [--cases-for NAME=CASE,...] CASE ...

A variant sets module attributes (``VALUE`` a Python literal) before anything runs, e.g. ``--variant base --variant
fused:exl3tool.ops.linear.FUSED_MAX_TOKENS=16``. A case is ``dense:INxOUT:M[:BITS[:CB]]`` (a random linear, K=4 mcg
by default) or ``moe:M`` (E=128 top-8 2048x768 K=4 mcg). Every process times each case as one CUDA graph over enough
L2-cold weight copies and prints its median and a digest of y; the report gives each case's median over the
processes of a variant, their spread (max - min) and where variants' y differ; ``--profile`` adds each kernel's GPU
time a call, ``--timeline`` each kernel's start and end in a call (us from its first kernel's start: with PDL a
kernel starts before the one it waits for ends, so its time alone says little about the call's critical path).
``--cases-for`` gives a variant fewer cases than the others (where its override matters); ``--budget-s`` starts no
worker past that many seconds and reports the rounds that ran, and ``--lines-out`` keeps every worker's lines as
they come, so that a machine's time limit leaves the measurements taken so far. A worker that fails, or that
``--worker-timeout-s`` kills (a kernel that hangs), drops its variant from the later rounds; the others go on, and
the exit status is 1.

Why processes, in turns: two processes of one variant differ by up to ~1 us at M=1 while one process's replays agree
within 0.1 (docs/perf.md, Method), and two compiled copies of one kernel config in one process are unsafe.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from exl3tool.ops import kernel_cache

RESULT = "AB-RESULT"
KERNEL = "AB-KERNEL"
TIMELINE = "AB-TIMELINE"
PROFILE_REPLAYS = 5  # graph replays traced for --profile and --timeline (the timeline takes the middle one)
MOE_SHAPE = (128, 8, 2048, 768)  # the moe:M case: experts, top-k, hidden, intermediate (Qwen3-30B-A3B)
MOE_COPIES = 10  # layer copies of the MoE case: 10 x 302 MB, past 3x any current L2


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[tuple[str, str, object], ...]  # (module, attribute, value)


@dataclass(frozen=True)
class Case:
    kind: str  # "dense" | "moe"
    tokens: int
    in_features: int = 0
    out_features: int = 0
    bits: float = 4.0
    codebook: str = "mcg"


def parse_variant(text: str) -> Variant:
    name, _, rest = text.partition(":")
    if not name.isidentifier():
        raise ValueError(f"variant {text!r}: NAME[:MODULE.ATTR=VALUE;...] with NAME an identifier")
    overrides = []
    for item in filter(None, rest.split(";")):
        target, eq, value = item.partition("=")
        module, _, attr = target.strip().rpartition(".")
        if not eq or not module or not attr:
            raise ValueError(f"variant {name}: {item!r} is not MODULE.ATTR=VALUE")
        try:
            overrides.append((module, attr, ast.literal_eval(value.strip())))
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name}: {value.strip()!r} is not a Python literal") from None
    return Variant(name, tuple(overrides))


def parse_case(text: str) -> Case:
    kind, *fields = text.split(":")
    try:
        if kind == "moe" and len(fields) == 1:
            return Case("moe", int(fields[0]))
        if kind == "dense" and 2 <= len(fields) <= 4:
            k, n = (int(v) for v in fields[0].split("x"))
            bits = float(fields[2]) if len(fields) > 2 else 4.0
            return Case("dense", int(fields[1]), k, n, bits, fields[3] if len(fields) > 3 else "mcg")
    except ValueError:
        pass
    raise ValueError(f"case {text!r}: dense:INxOUT:M[:BITS[:CODEBOOK]] or moe:M")


def apply(variant: Variant, dry_run: bool = False) -> None:
    """Set the variant's attributes (``dry_run``: only check them); each must already exist, so that a typo does
    not pass as a variant that changes nothing. A variant's kernels are compiled or taken from the kernel cache under
    names that include its switches (``kernel_cache.keyed_switch``); one that sets anything else turns the cache off."""
    for module, attr, value in variant.overrides:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            raise ValueError(f"variant {variant.name}: no module {module}") from None
        if not hasattr(mod, attr):
            raise ValueError(f"variant {variant.name}: {module} has no attribute {attr}")
        if not dry_run:
            setattr(mod, attr, value)
            if not kernel_cache.keyed_switch(module, attr, value):  # the cache could not tell this variant apart
                os.environ[kernel_cache.CACHE_ENV] = kernel_cache.OFF


def summarize(lines: list[str]) -> str:
    """The report of a run from its workers' result lines (``RESULT variant case us digest plan...``)."""
    times: dict[tuple[str, str], list[float]] = {}
    digests: dict[tuple[str, str], set[str]] = {}
    plans: dict[tuple[str, str], str] = {}
    kernels: dict[str, dict[str, dict[str, list[float]]]] = {}  # case -> kernel -> variant -> us per process
    # case -> (kernel index, name) -> variant -> (start, end) per process: variants whose launches differ (another
    # kernel at an index) get a row each for what they ran there
    spans: dict[str, dict[tuple[int, str], dict[str, list[tuple[float, float]]]]] = {}
    for line in lines:
        if line.startswith(KERNEL):
            _, variant, case, us, name = line.split()
            kernels.setdefault(case, {}).setdefault(name, {}).setdefault(variant, []).append(float(us))
        if line.startswith(TIMELINE):
            _, variant, case, index, start, end, name = line.split()
            per_variant = spans.setdefault(case, {}).setdefault((int(index), name), {})
            per_variant.setdefault(variant, []).append((float(start), float(end)))
        if not line.startswith(RESULT):
            continue
        _, variant, case, us, digest, *plan = line.split()
        times.setdefault((case, variant), []).append(float(us))
        digests.setdefault((case, variant), set()).add(digest)
        plans[(case, variant)] = " ".join(plan)
    cases = list(dict.fromkeys(c for c, _ in times))
    variants = list(dict.fromkeys(v for _, v in times))
    names = [n for c in cases for n in kernels.get(c, {})]
    names += [f"{i} {name}" for c in cases for i, name in spans.get(c, {})]
    width = max([len(c) for c in cases] + [len(n) + 2 for n in names] + [4]) + 2

    def row(label: str, per_variant: dict[str, list[float]], stat) -> str:
        """``label``, then ``stat`` of each variant's per-process values (``-`` where it has none)."""
        return label.ljust(width) + "".join(f"{stat(per_variant[v]):12.2f}" if v in per_variant else " " * 11 + "-"
                                            for v in variants)

    out = ["case".ljust(width) + "".join(v.rjust(12) for v in variants) + "  y"]
    for c in cases:
        by_variant = {v: times[(c, v)] for v in variants if (c, v) in times}
        seen = set().union(*(digests.get((c, v), set()) for v in variants))
        out.append(row(c, by_variant, statistics.median) + ("  same" if len(seen) == 1 else "  DIFFERS"))
        if len(seen) > 1:  # which variant (or which of its processes) gave which y
            out.append(" " * width + " | ".join(f"{v}: {','.join(sorted(digests[(c, v)]))}" for v in variants
                                                 if (c, v) in digests))
        # the spread between processes of one variant: how far apart its medians would have to be to mean anything
        out.append(row("  spread", by_variant, lambda ts: max(ts) - min(ts)))
        out.append(" " * width + " | ".join(f"{v}: {plans[(c, v)]}" for v in variants if (c, v) in plans))
        for name, us in sorted(kernels.get(c, {}).items(), key=lambda kv: -max(map(max, kv[1].values()))):
            out.append(row(f"  {name}", us, statistics.median))
        for (index, name), per_variant in sorted(spans.get(c, {}).items(), key=lambda kv: kv[0][0]):
            cells = [f"{statistics.median(s for s, _ in per_variant[v]):.1f}-"
                     f"{statistics.median(e for _, e in per_variant[v]):.1f}" if v in per_variant else "-"
                     for v in variants]
            out.append(f"  {index} {name}".ljust(width) + "".join(cell.rjust(12) for cell in cells))
    return "\n".join(out)


# --- the worker (GPU) ------------------------------------------------------------------------------------------


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()[:10]


def kernel_name(name: str) -> str:
    """A CUDA kernel's name, short and without spaces: ours (CuTe DSL) as module and class, e.g. moe_gemmMoEGemm."""
    ours = re.search(r"exl3toolkernels(\w+?)_object", name)
    return re.sub(r"\s+", "_", ours.group(1) if ours else name.split("(")[0])[:60]


def layer_timeline(events: list[tuple[float, float, str]], replays: int, calls: int) -> list[tuple[str, float, float]]:
    """(name, start, end) of each kernel of a call, in launch order, from the GPU kernels ``(ts, dur, name)`` (us)
    of ``replays`` graph replays of ``calls`` calls each: us from the call's first kernel's start, the median over
    the calls of the middle replay. Empty when the kernels do not split evenly into calls."""
    events = sorted(events)
    if not events or len(events) % (replays * calls):
        return []
    per = len(events) // (replays * calls)
    first = replays // 2 * calls * per
    by_call = [events[first + c * per: first + (c + 1) * per] for c in range(calls)]
    return [(kernel_name(by_call[0][k][2]),
             statistics.median(call[k][0] - call[0][0] for call in by_call),
             statistics.median(call[k][0] + call[k][1] - call[0][0] for call in by_call)) for k in range(per)]


def kernel_times(events: list[tuple[float, float, str]], replays: int, calls: int) -> dict[str, float]:
    """Each kernel's GPU time a call (us), from the GPU kernels ``(ts, dur, name)`` of ``replays`` graph replays of
    ``calls`` calls each; a kernel launched early by PDL counts its wait."""
    times: dict[str, float] = {}
    for _, dur, name in events:
        key = kernel_name(name)
        times[key] = times.get(key, 0.0) + dur / (replays * calls)
    return times


def _traced_kernels(graph, replays: int) -> list[tuple[float, float, str]]:
    """The GPU kernels ``(ts, dur, name)`` (us) of ``replays`` replays of ``graph``, from torch.profiler's trace."""
    import json
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(f"{folder}/trace.json")
        with open(f"{folder}/trace.json") as f:
            trace = json.load(f)
    return [(e["ts"], e["dur"], e["name"]) for e in trace["traceEvents"] if e.get("cat") == "kernel"]


def _measure(step, calls: int, replays: int, profile: bool, timeline: bool = False):
    """Median us a call over ``replays`` graph replays of ``step`` (``calls`` calls); with ``profile`` also each
    kernel's GPU time a call (``kernel_times``), with ``timeline`` each kernel's (name, start, end) in a call
    (``layer_timeline``), both from one trace of PROFILE_REPLAYS replays."""
    from exl3tool.bench import timing

    graph = timing.capture_graph(step)
    timing.warm_up(graph.replay)
    (t,) = timing.time_interleaved([(graph.replay, calls)], replays)
    events = _traced_kernels(graph, PROFILE_REPLAYS) if profile or timeline else []
    kernels = kernel_times(events, PROFILE_REPLAYS, calls) if profile else {}
    spans = layer_timeline(events, PROFILE_REPLAYS, calls) if timeline else []
    return t.median_us, kernels, spans


@functools.lru_cache(maxsize=None)
def _linears(in_features: int, out_features: int, bits: float, codebook: str) -> list:
    """The L2-cold weight copies of one random linear, made once for every M of the process."""
    import torch

    from exl3tool.bench import cases
    from exl3tool.ops.linear import DeviceLinear
    from exl3tool.synthetic import random_linear

    dev = torch.device("cuda")
    first = random_linear(in_features, out_features, bits, codebook, seed=1)
    copies = cases.weight_copies(first.trellis.numel() * 2, torch.cuda.get_device_properties(dev).L2_cache_size)
    return [DeviceLinear.from_tensors(first if i == 0 else cases.clone(first), dev) for i in range(copies)]


@functools.lru_cache(maxsize=None)
def _moe_layers(folder: str) -> list:
    """MOE_COPIES copies of the folder's MoE layer on the GPU, made once for every M of the process."""
    import torch

    from exl3tool.bench import cases
    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.ops import moe

    dev = torch.device("cuda")
    reader = open_checkpoint(folder)
    try:
        base = reader.moe(0, dev)
    finally:
        reader.close()
    return [moe.DeviceMoE.from_layer(base if i == 0 else cases.clone(base), dev) for i in range(MOE_COPIES)]


def _dense(case: Case):
    import torch

    from exl3tool.ops.linear import linear_forward, plan_for

    dev = torch.device("cuda")
    lins = _linears(case.in_features, case.out_features, case.bits, case.codebook)
    g = torch.Generator(device=dev).manual_seed(7 + case.tokens)
    x = torch.randn(case.tokens, case.in_features, generator=g, device=dev).half()
    ys = [torch.full((case.tokens, case.out_features), float("nan"), device=dev, dtype=torch.float16) for _ in lins]

    def step():
        for lin, y in zip(lins, ys):
            linear_forward(x, lin, out=y)

    step()
    torch.cuda.synchronize()
    plan = plan_for(lins[0], x)
    gemm = getattr(plan, "gemm_plan", None)
    info = plan.path + (f" splits={gemm.splits} mma={gemm.config.mma}" if gemm else "")
    return _digest(ys[0]), step, len(lins), info


def moe_step(tokens: int, layers: list) -> tuple[list, object, list]:
    """(plans, step, ys) of the moe:M case over ``layers`` (DeviceMoE copies): x seeded by M, as in every process
    and in ``exl3tool.bench.trace``, a plan per layer, and ``step()`` running each layer once on x, its outputs in
    ``ys``."""
    import torch

    from exl3tool.ops import moe

    g = torch.Generator(device=layers[0].device).manual_seed(11 + tokens)
    x = torch.randn(tokens, layers[0].hidden, generator=g, device=layers[0].device).half()
    plans = [moe.plan_moe(layer, tokens, x.dtype) for layer in layers]
    ys = []

    def step():
        ys.clear()
        ys.extend(moe.moe_forward(x, p) for p in plans)

    return plans, step, ys


def _moe(case: Case, folder: str):
    import torch

    plans, step, ys = moe_step(case.tokens, _moe_layers(folder))
    step()
    torch.cuda.synchronize()
    return _digest(ys[0]), step, len(plans), f"launches={plans[0].launches(case.tokens)}"


def worker(variant: Variant, cases: list[tuple[str, Case]], replays: int, moe_folder: str | None,
           profile: bool, timeline: bool = False) -> None:
    apply(variant)
    for text, case in cases:
        digest, step, calls, info = _dense(case) if case.kind == "dense" else _moe(case, moe_folder)
        us, kernels, spans = _measure(step, calls, replays, profile, timeline)
        print(f"{RESULT} {variant.name} {text} {us:.3f} {digest} {info}", flush=True)
        for name, kernel_us in kernels.items():
            print(f"{KERNEL} {variant.name} {text} {kernel_us:.3f} {name}", flush=True)
        for index, (name, start, end) in enumerate(spans):
            print(f"{TIMELINE} {variant.name} {text} {index} {start:.3f} {end:.3f} {name}", flush=True)


def _moe_folder() -> str:
    import tempfile

    from exl3tool.synthetic import write_moe_layer

    folder = tempfile.mkdtemp(prefix="exl3tool-ab-moe-")
    write_moe_layer(folder, *MOE_SHAPE, bits=4.0, codebook="mcg")
    return folder


@dataclass
class Run:
    lines: list[str]  # the workers' output lines
    stopped: str | None = None  # why it ended before its last round, if it did
    dropped: list[str] = field(default_factory=list)  # why each variant was dropped (its worker failed or was killed)

    @property
    def failed(self) -> bool:
        """A worker failed or timed out (the budget running out is not a failure)."""
        return bool(self.dropped)


def _text(output) -> str:
    """A worker's captured stdout: a timed-out run leaves it as bytes (or None) whatever ``text`` asked for."""
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def run_workers(commands: list[tuple[str, list[str]]], rounds: int, budget_s: float | None = None,
                lines_out=None, run=subprocess.run, clock=time.monotonic,
                worker_timeout_s: float | None = None) -> Run:
    """Run each ``(variant name, worker command)`` once per round, variants in turns. No worker starts once
    ``budget_s`` seconds have passed. A worker that fails, or runs past ``worker_timeout_s`` (a hung kernel: it
    is killed), drops its variant from the later rounds; the others go on, and the lines it printed stay. Progress
    goes to stderr; ``lines_out`` (a text file) gets each worker's lines as it ends."""
    start, lines, dropped = clock(), [], {}
    for r in range(1, rounds + 1):
        for name, cmd in commands:
            if name in dropped:
                continue
            if budget_s is not None and clock() - start >= budget_s:
                return Run(lines, f"budget of {budget_s:g} s spent after {clock() - start:.0f} s (round {r} of "
                                  f"{rounds} not finished)", list(dropped.values()))
            began = clock()
            try:
                done = run(cmd, capture_output=True, text=True, timeout=worker_timeout_s)
                out, ended = done.stdout.splitlines(), ""
                if done.returncode:
                    dropped[name] = f"variant {name}: worker failed (exit {done.returncode})\n{done.stderr[-2000:]}"
                    ended = ", failed"
            except subprocess.TimeoutExpired as timeout:
                out, ended = _text(timeout.stdout).splitlines(), f", killed after {worker_timeout_s:g} s"
                dropped[name] = (f"variant {name}: worker killed after {worker_timeout_s:g} s (round {r}; a hung "
                                 f"kernel?); its later cases did not run")
            lines += out
            if lines_out is not None:
                lines_out.write("".join(f"{line}\n" for line in out))
                lines_out.flush()
            print(f"round {r}/{rounds} {name}: {clock() - began:.1f} s{ended}, {clock() - start:.0f} s in all",
                  file=sys.stderr, flush=True)
    return Run(lines, None, list(dropped.values()))


def variant_cases(texts: list[str], variants: list[Variant], cases: list[str]) -> dict[str, list[str]]:
    """``--cases-for NAME=CASE,...``: each named variant's cases (from the run's CASE list); the rest take all."""
    chosen = {v.name: list(cases) for v in variants}
    for text in texts:
        name, eq, listed = text.partition("=")
        subset = [c.strip() for c in listed.split(",") if c.strip()]
        if not eq or name not in chosen or not subset:
            raise ValueError(f"--cases-for {text!r}: NAME=CASE[,CASE...] with NAME one of the variants")
        unknown = [c for c in subset if c not in cases]
        if unknown:
            raise ValueError(f"--cases-for {name}: {', '.join(unknown)} not among the CASEs")
        chosen[name] = subset
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exl3tool.bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+", metavar="CASE")
    p.add_argument("--variant", action="append", required=True, metavar="NAME[:MODULE.ATTR=VALUE;...]")
    p.add_argument("--cases-for", action="append", default=[], metavar="NAME=CASE,...",
                   help="run variant NAME on these of the CASEs only")
    p.add_argument("--rounds", type=int, default=3, help="processes per variant, taken in turns")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="also each kernel's GPU time a call (torch.profiler)")
    p.add_argument("--timeline", action="store_true", help="also each kernel's start and end in a call")
    p.add_argument("--budget-s", type=float, help="start no worker after this many seconds; report what ran")
    p.add_argument("--lines-out", metavar="FILE", help="append every worker's output lines here as it ends")
    p.add_argument("--worker-timeout-s", type=float, metavar="S",
                   help="kill a worker after this many seconds and drop its variant (a hung kernel)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--moe-folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
        parsed = [parse_case(c) for c in args.cases]
        for v in variants:
            apply(v, dry_run=True)
        if len({v.name for v in variants}) != len(variants):
            raise ValueError("variant names must differ")
        cases_for = variant_cases(args.cases_for, variants, args.cases)
        if args.worker_timeout_s is not None and not args.worker_timeout_s > 0:
            raise ValueError(f"--worker-timeout-s {args.worker_timeout_s:g}: a number of seconds above 0")
    except ValueError as error:
        p.error(str(error))
    if args.worker:
        worker(variants[0], list(zip(args.cases, parsed)), args.replays, args.moe_folder, args.profile,
               args.timeline)
        return 0
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (none is visible to torch)")
    try:
        lines_out = open(args.lines_out, "a") if args.lines_out else None
    except OSError as error:
        p.error(f"--lines-out {args.lines_out}: {error.strerror}")
    folder = _moe_folder() if any(c.kind == "moe" for c in parsed) else None
    commands = [(v.name, [sys.executable, "-m", "exl3tool.bench.ab", "--worker", "--variant", text,
                          "--replays", str(args.replays), *(["--profile"] if args.profile else []),
                          *(["--timeline"] if args.timeline else []),
                          *(["--moe-folder", folder] if folder else []), *cases_for[v.name]])
                for v, text in zip(variants, args.variant)]
    try:
        ran = run_workers(commands, args.rounds, args.budget_s, lines_out, worker_timeout_s=args.worker_timeout_s)
    finally:
        if lines_out is not None:
            lines_out.close()
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    print(summarize(ran.lines))
    for why in [*ran.dropped, *([ran.stopped] if ran.stopped else [])]:
        print(why, file=sys.stderr)
    return 1 if ran.failed else 0


if __name__ == "__main__":
    sys.exit(main())
