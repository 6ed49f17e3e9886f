"""exl3tool: inspect, verify and run EXL3 (ExLlamaV3 trellis-quantized) checkpoints.

Public API (see the module docstrings for details):

    exl3tool.open_checkpoint(path, revision=None) -> Checkpoint      exl3tool.checkpoint
    exl3tool.inspect_checkpoint(path, revision=None, ...) -> InspectReport     exl3tool.inspection
    exl3tool.prepare_checkpoint(source, out, *, layers=None, ...) -> PrepareReport  exl3tool.prepared
    exl3tool.load_prepared(path, device="cpu", verify_hashes=True) -> PreparedCheckpoint   exl3tool.prepared
    exl3tool.is_prepared(path) -> bool      a folder written by `exl3tool prepare` (docs/prepared-layout.md)
    exl3tool.format        the format model (Codebook, LinearInfo, LinearTensors, blocks, layers)
    exl3tool.reference     the fp32 torch reference (decode, rotations, linear and block forward)
    exl3tool.synthetic     synthetic checkpoints for tests and benchmarks
    exl3tool.errors        the error hierarchy (Exl3Error and subclasses) and Problem

torch is imported only by what needs it (loading tensors, the reference), so structure-only use stays fast.
"""

from __future__ import annotations

from exl3tool.errors import (
    CheckpointProblemsError, Exl3Error, NotFoundError, Problem, ProblemKind, UnreadableInputError,
    UnsupportedFeatureError, UsageError,
)
from exl3tool.version import __version__

__all__ = [
    "CheckpointProblemsError", "Exl3Error", "NotFoundError", "Problem", "ProblemKind", "UnreadableInputError",
    "UnsupportedFeatureError", "UsageError", "open_checkpoint", "inspect_checkpoint", "Checkpoint", "__version__",
    "load_prepared", "is_prepared", "prepare_checkpoint", "PreparedCheckpoint",
]


def open_checkpoint(path, revision=None):
    """Open an EXL3 checkpoint (a local folder or a Hugging Face repo id); see exl3tool.checkpoint."""
    from exl3tool.checkpoint import open_checkpoint as _open

    return _open(path, revision)


def inspect_checkpoint(path, revision=None, **kwargs):
    """Everything `exl3tool inspect` reports, as an InspectReport; see exl3tool.inspection."""
    from exl3tool.inspection import inspect_checkpoint as _inspect

    return _inspect(path, revision, **kwargs)


def __getattr__(name):
    if name == "Checkpoint":
        from exl3tool.checkpoint import Checkpoint

        return Checkpoint
    if name in ("load_prepared", "is_prepared", "prepare_checkpoint", "PreparedCheckpoint"):
        import exl3tool.prepared

        return getattr(exl3tool.prepared, name)
    raise AttributeError(f"module 'exl3tool' has no attribute {name!r}")
