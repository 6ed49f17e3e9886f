"""Render `exl3tool prepare`: a Rich progress bar (layers, bytes, throughput), the summary, or JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from exl3tool.cli.render.common import emit_json, safe, size
from exl3tool.errors import CheckpointProblemsError
from exl3tool.inspection import cap_problems, problem_json
from exl3tool.prepared.layout import REPORT_SCHEMA
from exl3tool.prepared.writer import PrepareProgress, PrepareReport


class ProgressBar:
    """Context manager; `update(PrepareProgress)` is the library's progress callback (a no-op when disabled)."""

    def __init__(self, console: Console, enabled: bool):
        self.console, self.enabled = console, enabled
        self._bar = self._task = None

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            from rich.progress import (
                BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("preparing"), BarColumn(), TextColumn("{task.fields[units]}"), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(), console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("prepare", total=None, units="")
        return self

    def update(self, p: PrepareProgress) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=p.bytes_done, total=p.bytes_total,
                             units=f"layers {p.units_done}/{p.units_total}")

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def render_json(report: PrepareReport) -> None:
    emit_json(report.to_json())


def render_refusal_json(error: CheckpointProblemsError) -> None:
    """An unsound source: the refusal and its problems, in the shape `inspect --format json` lists them."""
    shown, left_out = cap_problems(error.problems)
    emit_json({"schema": REPORT_SCHEMA, "prepared": False, "message": error.message,
               "problems": [problem_json(p) for p in shown], "problems_left_out": left_out})


def render_human(report: PrepareReport, console: Console) -> None:
    console.print(Text.assemble(("prepared ", "bold"), safe(report.source, "bold cyan"), " -> ",
                                safe(report.out, "bold cyan")))
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    layers = report.layers
    span = "none" if not layers else f"{layers[0]}..{layers[-1]}" if list(layers) == list(
        range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))
    table.add_row("layers", safe(f"{len(layers)} ({span})" + (" + head and non-layer tensors"
                                                                if report.includes_globals else "")))
    table.add_row("output", safe(f"{report.files} shard(s), {size(report.bytes)}, layout version "
                                 f"{report.layout_version}"))
    if report.up_to_date:
        work = "already complete: nothing to do"
    else:
        work = f"wrote {report.units_written} of {report.units} unit(s), {size(report.bytes_written)}"
        if report.throughput_mb_s is not None:
            work += f" in {report.write_seconds:.2f} s ({report.throughput_mb_s:.0f} MB/s)"
        if report.units_skipped:
            work += f"; {report.units_skipped} already done by an interrupted run"
    table.add_row("work", safe(work))
    console.print(table)
