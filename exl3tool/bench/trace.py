"""Where a fused MoE layer's time goes, CTA by CTA: a per-CTA timer trace of the route kernel and the two GEMMs.

    python -m exl3tool.bench.trace [--set MODULE.ATTR=VALUE ...] [--save DIR] M [M ...]
    python -m exl3tool.bench.trace --load FILE [FILE ...]      # a saved trace's report again, no GPU

Kernels compiled inside ``tracing()`` (``kernels.ptx.TRACE_ADDR`` set to a device buffer) have thread 0 of every CTA
store %globaltimer (ns, one clock for every SM) at the points ``ptx.trace_stamp`` marks: entry, the PDL wait
returned, the main loop and its partial stores done, the arrival at the fused tail's counter, the end (the route:
entry, its logits stored, its arrival, its top-k, the end; a GEMM that rotates x itself also where warp 0's part of
that prologue is done), and its SM id with a "last to arrive" flag. Outside it the kernels hold no trace code. The
report takes the last of MOE_COPIES L2-cold calls of one graph replay of the synthetic Qwen3-30B-A3B-shaped layer
(as ``exl3tool.bench.ab``'s moe:M case), in us from the route's first entry: each point's spread over the CTAs that
did work (min, p10, median, p90, max), the same for the CTAs that arrived last (they run the fused tails), each
phase's length a CTA (the last CTAs' arrival and tail apart too), the CTAs an SM (in all and at once), the CTAs
without a route block, how long freed GEMM slots waited for their next CTA (``slot_refills``), where the GEMMs' CTA
slots went (``slot_budget``) and each GEMM's main loops by when they started (``waves``). One expert group's GEMMs
(the regions are by kernel). The timer ticks in 32 ns on an H100 / H200.
``--save DIR`` also writes each M's raw stamps (``trace-m{M}.npz``: ``stamps``, ``us``, ``tokens``, ``device``), so
that a later question about the same call (a CTA's own timeline, a histogram) needs no device time: ``--load``
prints their report again, and ``load()`` gives the arrays.

The trace code can move ptxas's register allocation, and with it the CTAs an SM: sm_90a K=4 mcg at M=256, gate/up 80
-> 64 registers (3 -> 4 CTAs an SM) and down 60 -> 80 (4 -> 3) traced (CPU: ``exl3tool.sass.gemm_report`` of the same
configs with and without ``ptx.TRACE_ADDR`` set), so read "at once" against the plain kernels' occupancy before
blaming slots.

What it found first (H100, M=1): the down GEMM's 768 CTAs landed on 80 of 132 SMs
(``moe_configs.DOWN_MAX_CTAS_PER_SM``). Later (M=16-256): the gate/up grid's CTAs without a route block entered last,
as live ones ended, and the down GEMM launched only behind the last of them; taking them first moved its launch
10 us earlier at M=16 but not the layer's end (docs/perf.md, s65).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import shutil
import statistics
import sys
from collections.abc import Iterator

import numpy as np

from exl3tool.ops import kernel_cache

ROUTE_POINTS = ("entry", "logits", "arrived", "top-k", "end")
GEMM_POINTS = ("entry", "waited", "loop+P", "arrived", "end", "prologue")  # by slot (kernels.ptx.TRACE_*)
# (name, from slot, to slot): a phase whose slots a CTA did not stamp this call is left out (the prologue's: only
# the GEMMs that rotate x themselves stamp it)
PHASES = (("wait", 0, 1), ("prologue", 1, 5), ("loop", 1, 2), ("arrive", 2, 3), ("tail", 3, 4))


@contextlib.contextmanager
def tracing(device) -> Iterator:
    """Kernels compiled (planned) inside trace into the yielded int64 tensor ``[regions, CTAs, points]`` (zeroed);
    the on-disk kernel cache is off meanwhile (traced kernels hold the buffer's address)."""
    import torch

    from exl3tool.kernels import ptx

    stamps = torch.zeros(ptx.TRACE_REGIONS, ptx.TRACE_REGION_CTAS, ptx.TRACE_POINTS, dtype=torch.int64,
                         device=device)
    saved = ptx.TRACE_ADDR, os.environ.get(kernel_cache.CACHE_ENV)
    ptx.TRACE_ADDR = stamps.data_ptr()
    os.environ[kernel_cache.CACHE_ENV] = kernel_cache.OFF
    try:
        yield stamps
    finally:
        ptx.TRACE_ADDR = saved[0]
        if saved[1] is None:
            os.environ.pop(kernel_cache.CACHE_ENV, None)
        else:
            os.environ[kernel_cache.CACHE_ENV] = saved[1]


def live_ctas(stamps: np.ndarray, region: int) -> np.ndarray:
    """The rows ``[CTAs, points]`` of a region's CTAs that did work (their flags slot set)."""
    from exl3tool.kernels import ptx

    rows = stamps[region]
    return rows[(rows[:, -1] & ptx.TRACE_LIVE) != 0]


def unused_ctas(stamps: np.ndarray, region: int, t0: int) -> np.ndarray:
    """The rows of a region's CTAs that entered at ``t0`` or later (this call) without a route block to work on."""
    from exl3tool.kernels import ptx

    rows = stamps[region]
    return rows[((rows[:, -1] & ptx.TRACE_LIVE) == 0) & (rows[:, ptx.TRACE_ENTRY] >= t0)]


def spread(values) -> str:
    """min p10 median p90 max of ``values``, or "-"."""
    v = sorted(values)
    if not v:
        return "-"
    picks = (v[0], v[len(v) // 10], statistics.median(v), v[9 * len(v) // 10], v[-1])
    return " ".join(f"{p:8.2f}" for p in picks)


def report(stamps: np.ndarray) -> list[str]:
    """The text report of one traced call (``stamps``: ``tracing()``'s tensor on the CPU, as numpy)."""
    from exl3tool.kernels import ptx

    route = live_ctas(stamps, ptx.TRACE_ROUTE)
    if len(route) == 0:
        return ["no traced route CTAs (were the kernels compiled inside tracing()?)"]
    t0 = route[:, ptx.TRACE_ENTRY].min()
    us = lambda ns: (ns - t0) / 1000.0  # noqa: E731
    out = ["us from the route's first entry: min p10 median p90 max"]
    names = {ptx.TRACE_ROUTE: ("route", ROUTE_POINTS), ptx.TRACE_GATE_UP: ("gate/up", GEMM_POINTS),
             ptx.TRACE_DOWN: ("down", GEMM_POINTS)}
    for region, (name, points) in names.items():
        live = live_ctas(stamps, region)
        if len(live) == 0:
            continue
        last = live[(live[:, -1] & ptx.TRACE_LAST) != 0]
        per_sm = np.unique(live[:, -1] >> 8, return_counts=True)[1]
        at_once = most_at_once(live)  # e.g. 3, where registers hold three CTAs an SM and another kernel holds four
        out.append(f"{name}: {len(live)} CTAs on {len(per_sm)} SMs ({per_sm.min()}-{per_sm.max()} an SM, median "
                   f"{statistics.median(per_sm.tolist()):g}; {at_once.min()}-{at_once.max()} at once), {len(last)} "
                   "last to arrive")
        unused = unused_ctas(stamps, region, t0)[:, ptx.TRACE_ENTRY]
        if len(unused):  # the grid's blocks past the used ones: they hold a slot as they enter and leave
            out.append(f"  {'unused':14s}{len(unused)} CTAs without a block, entered {us(unused.min()):.2f}-"
                       f"{us(unused.max()):.2f}")
        for rows, prefix in ((live, ""), (last, "last ")):
            for p, point in enumerate(points):
                # a point a CTA did not reach this call holds 0 or an earlier call's stamp: before t0
                out.append(f"  {prefix + point:14s}{spread([us(t) for t in rows[:, p] if t >= t0])}")
        def took(rows, a, b):  # each CTA's phase from slot a to slot b, where it stamped both this call
            return [(y - x) / 1000.0 for x, y in zip(rows[:, a], rows[:, b]) if x >= t0 and y >= x]

        for phase, a, b in PHASES:
            if b < len(points):
                out.append(f"  {'d ' + phase:14s}{spread(took(live, a, b))}")
        for phase, a, b in PHASES:  # the last CTAs' own arrivals and tails (the fused tails' work)
            if phase in ("arrive", "tail") and len(last):
                out.append(f"  {'last d ' + phase:14s}{spread(took(last, a, b))}")
    refills = slot_refills(stamps, t0)
    if refills:  # min p10 median p90 max, as the points
        out.append(f"GEMM slot refills: {len(refills)} (a GEMM CTA's end to the next entry on its SM), us: "
                   + " ".join(spread(refills).split()))
    return out + slot_budget(stamps, t0)


def most_at_once(rows: np.ndarray) -> np.ndarray:
    """The most of ``rows``' CTAs each SM held at once (entry to end; an end before an entry at the same time)."""
    from exl3tool.kernels import ptx

    most = []
    for sm in np.unique(rows[:, -1] >> 8):  # +1 at each entry, -1 at each end (ends first)
        mine = rows[(rows[:, -1] >> 8) == sm]
        events = sorted([(t, 1) for t in mine[:, ptx.TRACE_ENTRY]] + [(t, -1) for t in mine[:, ptx.TRACE_END]])
        most.append(int(np.cumsum([step for _, step in events]).max()))
    return np.array(most, dtype=np.int64)


def slot_budget(stamps: np.ndarray, t0: int) -> list[str]:
    """Where the GEMMs' CTA slots went, from the first GEMM CTA's entry to the last one's end (us from ``t0``), each
    SM holding as many slots as the most GEMM CTAs it held at once: the slot time of each GEMM's entries (entry to
    the wait's end), loops (to the loop's end) and tails (to the CTA's end), and the idle rest (the unused CTAs'
    brief stays included), each in us of every slot, so that they add up to the span."""
    from exl3tool.kernels import ptx

    gemms = [(name, live_ctas(stamps, region)) for name, region in (("gate/up", ptx.TRACE_GATE_UP),
                                                                    ("down", ptx.TRACE_DOWN))]
    gemms = [(name, rows) for name, rows in gemms if len(rows)]
    if not gemms:
        return []
    every = np.concatenate([rows for _, rows in gemms])
    begin, end = every[:, ptx.TRACE_ENTRY].min(), every[:, ptx.TRACE_END].max()
    slots = int(most_at_once(every).sum())
    phases = (("entries", ptx.TRACE_ENTRY, ptx.TRACE_WAITED), ("loops", ptx.TRACE_WAITED, ptx.TRACE_LOOP),
              ("tails", ptx.TRACE_LOOP, ptx.TRACE_END))
    span = (end - begin) / 1000.0
    parts, busy = [], 0.0
    for name, rows in gemms:
        took = [(phase, (rows[:, b] - rows[:, a]).sum() / 1000.0) for phase, a, b in phases]
        busy += sum(t for _, t in took)
        parts.append(f"{name} " + ", ".join(f"{phase} {t / slots:.1f}" for phase, t in took))
    return [f"GEMM slots: {slots} over {(begin - t0) / 1000.0:.1f}-{(end - t0) / 1000.0:.1f} us, in us of every slot: "
            + "; ".join(parts) + f"; idle {(span * slots - busy) / slots:.1f}"]


def slot_refills(stamps: np.ndarray, t0: int) -> list[float]:
    """How long a freed GEMM slot waited for its next CTA (us): each GEMM CTA's end matched, on its SM, to the first
    later entry of a GEMM CTA not matched to an earlier end, both of CTAs that did work (unused CTAs stamp no SM, so
    a gap holds their stays); ends that no entry follows are left out. s77's two GEMMs in one grid: 1.82 us median
    over an M=16 call against 0.96 for the two launches (H100; from 30 to 70 us, gate/up's second wave, 2.11 against
    0.64)."""
    from exl3tool.kernels import ptx

    ends, entries = {}, {}
    for region in (ptx.TRACE_GATE_UP, ptx.TRACE_DOWN):
        for row in live_ctas(stamps, region):
            if row[ptx.TRACE_ENTRY] >= t0:
                sm = int(row[-1] >> 8)
                entries.setdefault(sm, []).append(int(row[ptx.TRACE_ENTRY]))
                ends.setdefault(sm, []).append(int(row[ptx.TRACE_END]))
    gaps = []
    for sm, sm_ends in ends.items():
        later, taken = sorted(entries[sm]), 0
        for end in sorted(sm_ends):
            while taken < len(later) and later[taken] < end:
                taken += 1
            if taken < len(later):
                gaps.append((later[taken] - end) / 1000.0)
                taken += 1
    return gaps


def waves(stamps: np.ndarray, bin_us: float = 5.0) -> list[str]:
    """Each GEMM's CTAs that did work, by when their wait ended (bins of ``bin_us`` from the route's first entry):
    how many, their main loops' median and longest, and their latest end: whether CTAs that start later (a second
    wave) stream slower than the first."""
    from exl3tool.kernels import ptx

    route = live_ctas(stamps, ptx.TRACE_ROUTE)
    if len(route) == 0:
        return []
    t0 = route[:, ptx.TRACE_ENTRY].min()
    out = []
    for name, region in (("gate/up", ptx.TRACE_GATE_UP), ("down", ptx.TRACE_DOWN)):
        rows = live_ctas(stamps, region)
        rows = rows[(rows[:, ptx.TRACE_WAITED] >= t0) & (rows[:, ptx.TRACE_LOOP] >= rows[:, ptx.TRACE_WAITED])]
        if len(rows) == 0:
            continue
        waited = (rows[:, ptx.TRACE_WAITED] - t0) / 1000.0
        loop = (rows[:, ptx.TRACE_LOOP] - rows[:, ptx.TRACE_WAITED]) / 1000.0
        end = (rows[:, ptx.TRACE_END] - t0) / 1000.0
        bins = np.floor(waited / bin_us)
        out.append(f"{name} loops by start (us): start, CTAs, median loop, longest loop, latest end")
        for b in np.unique(bins):
            mine = bins == b
            out.append(f"  {b * bin_us:6.0f}-{(b + 1) * bin_us:<6.0f}{mine.sum():6d} {np.median(loop[mine]):8.2f} "
                       f"{loop[mine].max():8.2f} {end[mine].max():8.2f}")
    return out


def trace_layer(tokens: int, layers) -> tuple[float, np.ndarray]:
    """(us a call, the stamps of the last call) of one graph replay over ``layers`` (DeviceMoE copies) at ``tokens``
    tokens (``exl3tool.bench.ab``'s moe:M case), planned and compiled traced."""
    import torch

    from exl3tool.bench import ab, timing

    with tracing(layers[0].device) as stamps:
        plans, step, _ = ab.moe_step(tokens, layers)
        step()
        torch.cuda.synchronize()
        graph = timing.capture_graph(step)
        timing.warm_up(graph.replay)
        (t,) = timing.time_interleaved([(graph.replay, len(plans))], 10)
        stamps.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return t.median_us, stamps.cpu().numpy()


def save(folder: str, tokens: int, us: float, stamps: np.ndarray, device: str) -> str:
    """Write one traced call's raw stamps to ``folder/trace-m{tokens}.npz`` (written whole, then renamed into
    place); returns the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"trace-m{tokens}.npz")
    part = path + ".part.npz"
    np.savez_compressed(part, stamps=stamps, us=np.float64(us), tokens=np.int64(tokens), device=np.str_(device))
    os.replace(part, path)
    return path


def load(path: str) -> tuple[int, float, np.ndarray, str]:
    """(tokens, us a call, stamps, device) of a trace ``save`` wrote; ValueError naming the file if it is not one."""
    try:
        with np.load(path, allow_pickle=False) as f:
            stamps = f["stamps"]
            tokens, us, device = int(f["tokens"]), float(f["us"]), str(f["device"])
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"{path}: not a saved trace ({error})") from None
    if stamps.ndim != 3 or stamps.dtype != np.int64:
        raise ValueError(f"{path}: stamps must be int64 [regions, CTAs, points], found {stamps.dtype} "
                         f"{list(stamps.shape)}")
    return tokens, us, stamps, device


def print_report(tokens: int, us: float, stamps: np.ndarray) -> None:
    print(f"M={tokens}: {us:.2f} us a call (graph replay, traced kernels)")
    print("\n".join("  " + line for line in report(stamps) + waves(stamps)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exl3tool.bench.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="set a module attribute (a Python literal) before anything compiles")
    p.add_argument("--save", metavar="DIR", help="also write each M's raw stamps to DIR/trace-m{M}.npz")
    p.add_argument("--load", nargs="+", metavar="FILE", help="print saved traces' reports again (no GPU)")
    p.add_argument("tokens", nargs="*", type=int, metavar="M")
    args = p.parse_args(argv)
    if args.load:
        if args.tokens or args.set or args.save:
            p.error("--load takes saved files only (no M, --set or --save)")
        for path in args.load:
            try:
                tokens, us, stamps, device = load(path)
            except ValueError as error:
                p.error(str(error))
            print(f"{device}; {path}")
            print_report(tokens, us, stamps)
        return 0
    if not args.tokens:
        p.error("give at least one token count M (or --load FILE)")
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (none is visible to torch)")
    for item in args.set:
        target, eq, value = item.partition("=")
        module, _, attr = target.rpartition(".")
        try:
            setattr(importlib.import_module(module), attr, ast.literal_eval(value))
        except (ImportError, ValueError, SyntaxError) as error:
            p.error(f"--set {item}: {error}")
    from exl3tool.bench import ab

    folder = ab._moe_folder()
    try:
        layers = ab._moe_layers(folder)
        print(f"{torch.cuda.get_device_name()}; E=128 top-8 2048x768 K=4 mcg, {len(layers)} L2-cold copies a replay")
        for m in args.tokens:
            us, stamps = trace_layer(m, layers)
            print_report(m, us, stamps)
            if args.save:
                print(f"  saved {save(args.save, m, us, stamps, torch.cuda.get_device_name())}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
