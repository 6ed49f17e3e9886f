"""Renderers for `exl3tool bench`: one Rich table per case group, the SASS table, and their JSON
(`BenchReport.to_json()`, schema exl3tool.bench/1; `SassReport.to_json()`, exl3tool.bench.sass/1)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from exl3tool.bench.report import BenchReport, Case, Result, SassReport
from exl3tool.cli.render.common import emit_json, safe, size

STATUS_STYLE = {"wrong": "bold red", "failed": "bold red", "eager-only": "yellow", "skipped": "dim"}


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _implementations(cases: list[Case]) -> list[str]:
    return list(dict.fromkeys(r.implementation for c in cases for r in c.results))


def render_human(report: BenchReport, console: Console) -> None:
    e, s = report.environment, report.settings
    console.print(safe(f"{e.gpu} ({e.arch}, {e.sm_count} SMs, L2 {size(e.l2_bytes)}), copy bandwidth "
                       f"{e.copy_tbs:.2f} TB/s; torch {e.torch}, CUDA {e.cuda or '-'}; commit {e.commit or '-'}"
                       f"{f', source {e.source}' if e.source else ''}; {e.date}"))
    console.print(safe(f"{s.dtype} activations, seed {s.seed}; graph: median of {s.replays} CUDA-graph replays, "
                       f"eager: the same calls launched from Python; weights rotated past {s.l2_multiple}x the L2. "
                       "vs X = X's median / this median (above 1: faster than X)."))
    notes: dict[str, int] = {}
    for group, cases in report.groups().items():
        impls = _implementations(cases)
        first = cases[0]
        title = f"{group}: {size(first.weight_bytes)} of EXL3 weights per call" if first.kind != "moe" else \
            f"{group}: EXL3 bytes of the experts the tokens are routed to"
        table = Table(title=safe(title), title_justify="left", show_edge=False, pad_edge=False)
        columns = ["M", "implementation", "mode", "median us", "min", "max", "host us", "GB/s", "% copy",
                   "TFLOP/s", "floor us"] + [f"vs {i}" for i in impls] + ["1st call s", "rel L2", "note"]
        for col in columns:
            table.add_column(col, justify="left" if col in ("implementation", "mode", "note") else "right")
        for c in cases:
            for n, r in enumerate(c.results):
                table.add_row(*_row(c, r, impls, notes, first_of_case=n == 0,
                                    first_of_impl=n == 0 or c.results[n - 1].implementation != r.implementation),
                              end_section=n == len(c.results) - 1)
        console.print()
        console.print(table)
    for note, n in notes.items():
        console.print(safe(f"[{n}] {note}"))
    wrong = report.wrong
    if wrong:
        console.print(Text(f"{len(wrong)} result(s) wrong or failed: see the rows marked above", style="bold red"))


def _row(c: Case, r: Result, impls: list[str], notes: dict[str, int], first_of_case: bool,
         first_of_impl: bool) -> list:
    note = ""
    if r.note:
        note = f"[{notes.setdefault(r.note, len(notes) + 1)}]"
    tokens = str(c.tokens) if first_of_case else ""
    if c.experts and first_of_case:
        tokens += f" ({c.experts['touched']} experts)"
    check = "-" if r.check is None else _f(r.check.rel_l2, ".1e")
    first = _f(r.compile_s, ".3f") if first_of_impl else ""
    floor = _f(c.floor_us, ".2f") if first_of_case else ""
    if r.timing is None:
        status = Text(r.status.upper() if r.status in ("wrong", "failed") else r.status,
                      style=STATUS_STYLE.get(r.status, ""))
        return [tokens, safe(r.implementation), r.mode, status] + [""] * 6 + [floor] + [""] * len(impls) + \
            [first, check, note]
    t = r.timing
    vs = [_f(r.vs.get(i), ".2f") + ("x" if i in r.vs else "") if i != r.implementation else "" for i in impls]
    return [tokens, safe(r.implementation), r.mode, f"{t.median_us:.2f}", f"{t.min_us:.2f}", f"{t.max_us:.2f}",
            f"{t.host_us:.1f}", _f(r.weight_gbs, ".0f"), _f(r.pct_copy_bw, ".1f"), _f(r.tflops, ".2f"), floor,
            *vs, first, check, note]


def render_json(report: BenchReport) -> None:
    emit_json(report.to_json())


def render_sass_human(report: SassReport, console: Console) -> None:
    pipes = ("alu", "fma", "tensor", "memory", "other")
    planned = f", MoE plans for {report.sm_count} SMs" if report.sm_count else ""
    table = Table(title=f"SASS for {report.arch}{planned}: main-loop instructions per decoded weight (per lane)",
                  title_justify="left", show_edge=False, pad_edge=False)
    columns = ("kernel", "regs", "spill B", "LDL/STL", "smem/CTA", "CTAs/SM", "loop", "per weight", "stalls",
               "issue cap", *pipes)
    for col in columns:
        table.add_column(col, justify="left" if col == "kernel" else "right", no_wrap=True)
    for r in report.rows:
        by_pipe = r.per_weight_by_pipe or {}
        spills = Text(str(r.spill_bytes), style="bold red" if r.spill_bytes else "")
        table.add_row(safe(r.kernel), str(r.registers), spills, str(r.spill_instructions),
                      f">= {r.static_smem_bytes / 1024:.1f} KiB" if r.smem_per_cta_bytes is None
                      else f"{r.smem_per_cta_bytes / 1024:.1f} KiB", _f(r.ctas_per_sm, "d"),
                      _f(r.loop_instructions, "d"), _f(r.per_weight, ".2f"), _f(r.stall_cycles_per_weight, ".2f"),
                      _f(r.issue_cap, ".0%"), *(_f(by_pipe.get(p), ".2f") for p in pipes))
    console.print(table)
    console.print(safe("per weight: the static instruction count of the innermost loop holding the MMAs / the weights "
                       "a lane decodes per iteration, split by issue pipe (kernels without MMAs: -). stalls: ptxas's "
                       "fixed stall cycles over that loop per weight, one warp's least time a weight. issue cap: the "
                       "share of a scheduler's issue slots its resident warps can fill by those stalls alone (decode "
                       "GEMMs; scoreboard waits lower it further). smem >=: static only, the launch sizes the dynamic "
                       "part. CTAs/SM: resident at once by threads, registers and shared memory (decode GEMMs)"))


def render_sass_json(report: SassReport) -> None:
    emit_json(report.to_json())
