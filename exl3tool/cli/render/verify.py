"""Renderers for `exl3tool verify`: a Rich table per run, and the stable JSON schema `exl3tool.verify/1`."""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console
from rich.table import Table
from rich.text import Text

from exl3tool.cli.render.common import bits, emit_json, safe
from exl3tool.verify import Comparison, VerifyReport

SCHEMA = "exl3tool.verify/1"


def _num(value: float, fmt: str) -> str:
    return format(value, fmt) if value == value and abs(value) != float("inf") else str(value)


def _short(name: str, layer: int) -> str:
    """`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj` (the layer has its own column)."""
    prefix = f"model.layers.{layer}."
    return name[len(prefix):] if name.startswith(prefix) else name


def render_human(report: VerifyReport, console: Console) -> None:
    t = report.thresholds
    console.print(safe(f"{report.source}{' (prepared)' if report.prepared else ''} on {report.gpu} ({report.arch}), "
                       f"{report.dtype} activations, seed {report.seed}"))
    console.print(safe(f"pass: rel L2 <= {t.max_rel_l2:g}, cosine >= {t.min_cosine:g}"
                       + (f", max abs <= {t.max_abs:g}" if t.max_abs is not None else "")))
    table = Table(show_edge=False, pad_edge=False)
    for col in ("layer", "module", "kind", "K", "cb", "M", "in x out", "rel L2", "cosine", "max abs",
                "vs recorded", "result"):
        table.add_column(col, justify="left" if col in ("module", "kind", "cb", "result") else "right",
                         no_wrap=col != "vs recorded")
    for c in report.checks:
        rec = c.vs_recorded
        table.add_row(
            str(c.layer), safe(_short(c.name, c.layer)), c.kind + (f" ({c.path})" if c.path else ""), bits(c.bits),
            c.codebook or "-",
            f"{c.tokens}{'*' if c.input_source == 'file' else ''}",
            f"{c.in_features}x{c.out_features}", _num(c.vs_reference.rel_l2, ".2e"),
            _num(c.vs_reference.cosine, ".7f"), _num(c.vs_reference.max_abs, ".2e"),
            "-" if rec is None else f"{_num(rec.rel_l2, '.2e')} cos {_num(rec.cosine, '.6f')}",
            Text("PASS", style="green") if c.passed else Text("FAIL", style="bold red"),
        )
    console.print(table)
    failed = len(report.failures)
    verdict = Text(f"{len(report.checks) - failed}/{len(report.checks)} passed", style="green" if not failed else "red")
    from_file = any(c.input_source == "file" for c in report.checks)
    console.print(verdict, safe("  (M* = activations from --input; 'vs recorded' = their <name>.output)")
                  if from_file else "")


def _comparison(c: Comparison | None) -> dict | None:
    """Non-finite numbers (a NaN output) become null: JSON has no NaN/Infinity."""
    if c is None:
        return None
    return {k: (v if v == v and abs(v) != float("inf") else None) for k, v in asdict(c).items()}


def render_json(report: VerifyReport) -> None:
    emit_json({
        "schema": SCHEMA,
        "source": report.source,
        "prepared": report.prepared,
        "gpu": report.gpu,
        "arch": report.arch,
        "dtype": report.dtype,
        "seed": report.seed,
        "thresholds": asdict(report.thresholds),
        "layers": list(report.layers),
        "moe_path": report.moe_path,
        "passed": report.passed,
        "checks": [
            {
                "name": c.name, "kind": c.kind, "layer": c.layer, "tokens": c.tokens, "input": c.input_source,
                "in_features": c.in_features, "out_features": c.out_features, "bits": c.bits,
                "codebook": c.codebook, "vs_reference": _comparison(c.vs_reference),
                "vs_recorded": _comparison(c.vs_recorded), "passed": c.passed, "path": c.path,
            }
            for c in report.checks
        ],
    })
