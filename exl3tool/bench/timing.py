"""How a call is timed, and what the run was measured on.

Graph mode: ``step()`` (one call per weight copy) is captured in a CUDA graph once and replayed; CUDA events
around each replay, the median of ``repeats`` replays. Eager mode: the same calls launched from Python, CUDA
events around the loop, and the host's wall time to enqueue them (launch overhead: what an engine without
graphs pays). Both report per-call figures. Warm-up (compiles, plans) happens before either, and the
implementations of one case take turns replay by replay (``time_interleaved``), so their ratios compare runs
at the same clocks.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import time
from typing import Callable

import torch

from exl3tool.bench.report import Environment, Timing
from exl3tool.version import source_digest

L2_MULTIPLE = 3  # one timed loop streams more than 3x the L2 of distinct weights: they come from HBM
WARMUP = 3


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _timing(gpu_ms: list[float], host_s: list[float], calls: int) -> Timing:
    per_call = [t * 1000.0 / calls for t in gpu_ms]
    return Timing(statistics.median(per_call), min(per_call), max(per_call),
                  statistics.median(host_s) * 1e6 / calls, len(per_call))


def capture_graph(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``step()`` (already warmed up) captured in a CUDA graph, after one run on a side stream (torch's recipe)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def warm_up(launch: Callable[[], object]) -> None:
    """A few untimed launches, then a sync: a launch that fails raises here, before any timing."""
    for _ in range(WARMUP):
        launch()
    torch.cuda.synchronize()


def time_interleaved(launches: list[tuple[Callable[[], object], int]], repeats: int = 30) -> list[Timing]:
    """Per-call timings of ``launch()`` (a graph replay or an eager step of ``calls`` calls) for each pair, taken
    in turns: every round times each launch once, so all of them run at the same clocks. The H200 drifts from
    boost to its power limit within one run (torch's 4096x4096x14336 fp16 GEMM: 643 us cool, 742-759 us warm),
    and one implementation timed after another would carry that drift into their ratio. Warm each up first."""
    gpu: list[list[float]] = [[] for _ in launches]
    host: list[list[float]] = [[] for _ in launches]
    for _ in range(repeats):
        for i, (launch, _) in enumerate(launches):
            start, end = _events()
            start.record()
            t0 = time.perf_counter()
            launch()
            host[i].append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            gpu[i].append(start.elapsed_time(end))
    return [_timing(g, h, calls) for g, h, (_, calls) in zip(gpu, host, launches)]


def first_call_s(call: Callable[[], object]) -> tuple[object, float]:
    """(result, seconds) of a first call: compiles kernels and builds plans, then synchronizes."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def copy_bandwidth_tbs(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), TB/s: an elementwise copy kernel,
    median of ``repeats`` after warm-up (graph-captured memcpy nodes go through a slower path)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + WARMUP):
        start, end = _events()
        start.record()
        torch.mul(src, 1.0, out=dst)
        end.record()
        end.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times) / 1e12


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), or None outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device, arch: str) -> Environment:
    with torch.cuda.device(device):
        props = torch.cuda.get_device_properties(device)
        copy_tbs = copy_bandwidth_tbs()
    return Environment(
        gpu=props.name, arch=arch, device=str(device), sm_count=props.multi_processor_count,
        l2_bytes=props.L2_cache_size, copy_tbs=copy_tbs, torch=torch.__version__, cuda=torch.version.cuda,
        commit=git_commit(), source=source_digest(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
