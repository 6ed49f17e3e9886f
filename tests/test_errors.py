"""Errors are one terminal-safe line naming file and tensor; the CLI table maps each type to its exit code."""

from __future__ import annotations

from exl3tool.cli.errors import classify, problems_exit_code
from exl3tool.errors import (
    CheckpointProblemsError, Exl3Error, GpuUnavailableError, NotFoundError, Problem, ProblemKind,
    UnreadableInputError, UnsupportedFeatureError, UsageError, terminal_safe,
)


def test_message_names_file_and_tensor_on_one_line():
    error = UnreadableInputError("bad\nthing", path="model.safetensors", tensor="a.\x1b[2Jb\u202e")
    assert str(error) == "model.safetensors: a.\\x1b[2Jb\\u202e: bad\\x0athing"
    assert "\n" not in str(error) and error.path == "model.safetensors"


def test_terminal_safe_keeps_printable_unicode():
    assert terminal_safe("µ-experts.ü/\\") == "µ-experts.ü/\\\\"


def test_problems_error_carries_all_problems():
    problems = [Problem("a", "first", "f1", "t1"), Problem("b", "second", "f2", "t2", ProblemKind.UNREADABLE)]
    error = CheckpointProblemsError(problems)
    assert error.problems == tuple(problems) and error.unreadable
    assert str(error) == "f1: t1: first (and 1 more)"


def test_exit_code_table():
    unreadable = CheckpointProblemsError([Problem("x", "m", kind=ProblemKind.UNREADABLE)])
    cases = {UsageError("u"): 2, NotFoundError("n"): 2, UnreadableInputError("r"): 2, GpuUnavailableError("g"): 2,
             CheckpointProblemsError([Problem("x", "m")]): 1, unreadable: 2, UnsupportedFeatureError("s"): 1,
             Exl3Error("e"): 1, FileNotFoundError(2, "gone"): 2, RuntimeError("bug"): 3}
    for error, code in cases.items():
        assert classify(error)[0] == code, repr(error)
    assert problems_exit_code([]) == 0
    assert problems_exit_code([Problem("x", "m", kind=ProblemKind.UNSUPPORTED)]) == 1
