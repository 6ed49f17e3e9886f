"""The one table from error type to exit code, and the wrapper every command runs its library call in.

Exit codes: 0 sound, 1 problems found (or something unsupported), 2 unreadable input, usage error, no usable GPU
or a missing dependency, 3 an internal error (a bug: set EXL3TOOL_DEBUG=1 to see its traceback). Never a
traceback for bad input.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from importlib import metadata

import typer

from exl3tool.cli.console import stderr
from exl3tool.errors import (
    CheckpointProblemsError, Exl3Error, GpuUnavailableError, NotFoundError, OutputError, Problem, ProblemKind,
    UnreadableInputError, UnsupportedFeatureError, UsageError, terminal_safe,
)
from exl3tool.inspection import cap_problems

EXIT_SOUND, EXIT_PROBLEMS, EXIT_UNREADABLE, EXIT_INTERNAL = 0, 1, 2, 3

# Modules the GPU commands import only when they run -> the distribution that provides them. Missing one is a
# set-up problem (exit 2, saying what to install), not a bug.
DEPENDENCIES = {"torch": "torch", "cutlass": "nvidia-cutlass-dsl", "cuda": "nvidia-cutlass-dsl",
                "tvm_ffi": "apache-tvm-ffi"}

# First matching row wins; order subclasses before their bases.
EXIT_CODES: tuple[tuple[type[BaseException], int, str], ...] = (
    (UsageError, EXIT_UNREADABLE, "usage error"),
    (NotFoundError, EXIT_UNREADABLE, "not found"),
    (UnreadableInputError, EXIT_UNREADABLE, "unreadable input"),
    (GpuUnavailableError, EXIT_UNREADABLE, "no usable GPU"),
    (OutputError, EXIT_UNREADABLE, "cannot write output"),
    (CheckpointProblemsError, EXIT_PROBLEMS, "checkpoint problem"),
    (UnsupportedFeatureError, EXIT_PROBLEMS, "unsupported"),
    (Exl3Error, EXIT_PROBLEMS, "error"),
    (OSError, EXIT_UNREADABLE, "unreadable input"),
)


def problems_exit_code(problems: tuple[Problem, ...] | list[Problem]) -> int:
    if any(p.kind is ProblemKind.UNREADABLE for p in problems):
        return EXIT_UNREADABLE
    return EXIT_PROBLEMS if problems else EXIT_SOUND


def _missing_dependency(error: BaseException) -> str | None:
    """The distribution to install when `error` is the import of a known dependency failing, else None."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    return DEPENDENCIES.get(error.name.partition(".")[0])


def _requirement(distribution: str) -> str:
    """`distribution` with the version exl3tool's metadata pins (nvidia-cutlass-dsl==4.8.1), if it pins one."""
    try:
        pins = metadata.requires("exl3tool") or []
    except metadata.PackageNotFoundError:
        pins = []
    found = next((r for r in pins if re.match(rf"{re.escape(distribution)}\s*[=<>~!]", r) and ";" not in r), None)
    return found.replace(" ", "") if found else distribution


def classify(error: BaseException) -> tuple[int, str]:
    """(exit code, label) for an exception, from the table."""
    if _missing_dependency(error):
        return EXIT_UNREADABLE, "missing dependency"
    for kind, code, label in EXIT_CODES:
        if isinstance(error, kind):
            if isinstance(error, CheckpointProblemsError):
                code = problems_exit_code(error.problems)
            return code, label
    return EXIT_INTERNAL, "internal error"


def _message(error: BaseException) -> str:
    if distribution := _missing_dependency(error):
        return f"no module named {terminal_safe(error.name)!r}: pip install '{_requirement(distribution)}'"
    if isinstance(error, Exl3Error):
        return str(error)  # already one terminal-safe line naming file and tensor
    if isinstance(error, OSError):
        where = f"{terminal_safe(error.filename)}: " if error.filename else ""
        return f"{where}{terminal_safe(error.strerror or error)}"
    text = str(error).strip().splitlines()
    return terminal_safe(f"{type(error).__name__}: {text[0] if text else ''}")


@contextmanager
def command_errors(json_output: bool = False):
    """Run a command's library call; turn any error into one stderr line (plus a JSON error object on stdout
    with --format json) and the exit code from the table."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt:
        stderr.print("interrupted", style="red", highlight=False)
        raise typer.Exit(130) from None
    except Exception as error:  # noqa: BLE001 - every error becomes one line and an exit code
        if os.environ.get("EXL3TOOL_DEBUG") and not isinstance(error, Exl3Error):
            raise
        code, label = classify(error)
        message = _message(error)
        hint = " (a bug in exl3tool: EXL3TOOL_DEBUG=1 shows the traceback)" if code == EXIT_INTERNAL else ""
        stderr.print(f"exl3tool: {label}: {message}{hint}", style="red", markup=False, highlight=False,
                     soft_wrap=True)
        if isinstance(error, CheckpointProblemsError):
            shown, left_out = cap_problems(error.problems)
            for problem in shown[1:]:
                stderr.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
            for check, count in left_out.items():
                stderr.print(f"  ... and {count} more {check}", markup=False, highlight=False, soft_wrap=True)
        if json_output:
            typer.echo(json.dumps({"schema": "exl3tool.error/1", "error": {
                "type": type(error).__name__, "label": label, "exit_code": code, "message": message,
                "file": getattr(error, "path", None), "tensor": getattr(error, "tensor", None)}}, indent=2,
                allow_nan=False))
        raise typer.Exit(code) from None
