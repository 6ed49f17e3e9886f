"""The one error hierarchy of exl3tool, and the problems a check reports.

The library raises these and never prints or exits; the CLI maps each type to a message and an exit code in
one table (`exl3tool.cli.errors`). Every message is a single terminal-safe line that names the file and the
tensor it concerns, so a hostile tensor name cannot move the cursor, recolour the terminal or forge lines.

    Exl3Error(message, path=None, tensor=None)
      UnreadableInputError     a file or folder that cannot be read as an EXL3 checkpoint (CLI exit 2)
      UsageError               a request that makes no sense, e.g. --revision on a local folder (exit 2)
      NotFoundError            a module, block or layer name the checkpoint does not have (exit 2)
      UnsupportedFeatureError  something exl3tool recognises but refuses to decode (exit 1)
      CheckpointProblemsError  carries the collected `Problem`s that make a request impossible (exit 1)
      GpuUnavailableError      the kernels need a CUDA GPU that is not there or too old (exit 2)
      OutputError              an output file or folder that cannot be written (disk full, no permission) (exit 2)
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from enum import Enum


def terminal_safe(text: object) -> str:
    """`text` as one printable line: control and format characters (newlines, ESC, bidi overrides) escaped."""
    out = []
    for ch in str(text):
        if ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def locate(path: object | None, tensor: str | None) -> str:
    """'file: tensor' prefix of a message (whichever parts are known), terminal-safe."""
    parts = [terminal_safe(p) for p in (path, tensor) if p is not None and p != ""]
    return ": ".join(parts)


class ProblemKind(str, Enum):
    """How bad a problem is: it decides the CLI exit code (unreadable -> 2, the others -> 1)."""

    UNREADABLE = "unreadable"  # a file that cannot be parsed, or one that the index names but is not there
    INVALID = "invalid"  # violates the EXL3 format or disagrees with config.json
    UNSUPPORTED = "unsupported"  # recognised but not decodable by exl3tool (ring embedding, tile_order, ...)


@dataclass(frozen=True)
class Problem:
    """One finding of a check. `check` is a stable identifier (e.g. "marker-value") for scripts and tests."""

    check: str
    message: str
    path: str | None = None  # file relative to the checkpoint folder, e.g. "model-00001-of-00002.safetensors"
    tensor: str | None = None
    kind: ProblemKind = ProblemKind.INVALID
    module: str | None = None  # the module key (e.g. an EXL3 linear) the problem belongs to, when there is one

    def __str__(self) -> str:
        where = locate(self.path, self.tensor)
        return f"{where}: {terminal_safe(self.message)}" if where else terminal_safe(self.message)


class Exl3Error(Exception):
    """Base of every error exl3tool raises on purpose."""

    def __init__(self, message: str, *, path: object | None = None, tensor: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = None if path is None else str(path)
        self.tensor = tensor

    def __str__(self) -> str:
        where = locate(self.path, self.tensor)
        return f"{where}: {terminal_safe(self.message)}" if where else terminal_safe(self.message)


class UnreadableInputError(Exl3Error):
    """The input cannot be read at all: no such folder, no config.json, not EXL3, a hub lookup that failed."""


class UsageError(Exl3Error):
    """The caller asked for something contradictory or malformed."""


class NotFoundError(Exl3Error):
    """A name (module, block, layer) that the checkpoint does not contain."""


class UnsupportedFeatureError(Exl3Error):
    """Something exl3tool recognises but refuses to decode rather than guess."""


class GpuUnavailableError(Exl3Error):
    """No CUDA device the kernels can run on (none, CPU requested, or older than SM80)."""


class OutputError(Exl3Error):
    """An output (e.g. `exl3tool prepare`'s folder) that cannot be written: no space, no permission, ..."""


class CheckpointProblemsError(Exl3Error):
    """Problems found by the checks that stand in the way of a request; `problems` holds all of them."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...], *, message: str | None = None):
        problems = tuple(problems)
        if not problems:
            raise ValueError("CheckpointProblemsError needs at least one problem")
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__((message or first.message) + more, path=first.path, tensor=first.tensor)
        self.problems = problems

    @property
    def unreadable(self) -> bool:
        return any(p.kind is ProblemKind.UNREADABLE for p in self.problems)
