"""Pieces every renderer shares: safe text, sizes, the problem list, JSON output."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.text import Text

from exl3tool.errors import Problem, terminal_safe
from exl3tool.inspection import cap_problems


def safe(value: object, style: str = "") -> Text:
    """Checkpoint-derived text as a Rich Text: never parsed as markup, control characters escaped."""
    return Text(terminal_safe(value), style=style)


def size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def bits(value: float | None) -> str:
    return "-" if value is None else (f"{value:g}")


def problems(console: Console, found: tuple[Problem, ...] | list[Problem]) -> None:
    """One line per problem: `[kind] file: tensor: message`, never wrapped into several lines; at most
    PROBLEMS_PER_CHECK of each check, then '... and N more'."""
    if not found:
        return
    console.print(Text(f"Problems ({len(found)})", style="bold red"))
    shown, left_out = cap_problems(found)
    for p in shown:
        line = Text("  ")
        line.append(f"[{p.kind.value}] ", style="red")
        line.append(str(p))  # Problem.__str__ is already terminal-safe
        console.print(line, soft_wrap=True)
    for check, count in left_out.items():
        console.print(Text(f"  ... and {count} more {check}", style="red"), soft_wrap=True)


def emit_json(data: dict) -> None:
    """Strict JSON (RFC 8259: no NaN or Infinity); a non-finite number here is a bug, and fails loudly."""
    typer.echo(json.dumps(data, indent=2, allow_nan=False))
