"""`exl3tool verify MODEL --layer LAYERS`: our GPU kernels against the fp32 reference, per module.

Every argument is checked before `exl3tool.verify` imports torch (seconds), so a typo is answered at once."""

from __future__ import annotations

import math
from typing import Annotated, Optional

import typer

from exl3tool.cli.console import stderr, stdout
from exl3tool.cli.errors import EXIT_PROBLEMS, EXIT_SOUND, command_errors
from exl3tool.cli.params import LAYER_HELP, FormatOpt, ModelArg, RevisionOpt, choice, layers, wants_json
from exl3tool.cli.render.verify import render_human, render_json
from exl3tool.errors import UnreadableInputError, UsageError
from exl3tool.io.reading import kind_of
from exl3tool.verify import DTYPES, MOE_PATHS, Thresholds, verify as run_verify

DEFAULTS = Thresholds()


def verify(
    model: ModelArg,
    layer: Annotated[str, typer.Option("--layer", "-l", metavar="LAYERS", show_default=False,
                                       help=f"Decoder layers: {LAYER_HELP} (several: with a progress bar).")],
    tokens: Annotated[int, typer.Option("--tokens", "-m", metavar="M", min=1, help="Rows of random activations.")]
    = 16,
    seed: Annotated[int, typer.Option("--seed", metavar="S", help="Seed of the random activations.")] = 0,
    input_file: Annotated[Optional[str], typer.Option(
        "--input", metavar="FILE", help="safetensors with <module>.input / <block>.input activations (and "
        "optionally <name>.output recorded outputs to compare with).", show_default=False)] = None,
    save_output: Annotated[Optional[str], typer.Option(
        "--save-output", metavar="FILE", help="Write <name>.reference and <name>.kernel (fp32) to this "
        "safetensors file.", show_default=False)] = None,
    max_rel_l2: Annotated[float, typer.Option(
        "--max-rel-l2", metavar="X", help="Fail above this relative L2 error.")] = DEFAULTS.max_rel_l2,
    min_cosine: Annotated[float, typer.Option(
        "--min-cosine", metavar="X", help="Fail below this cosine similarity.")] = DEFAULTS.min_cosine,
    max_abs: Annotated[Optional[float], typer.Option(
        "--max-abs", metavar="X", help="Also fail above this max abs error.", show_default=False)] = None,
    dtype: Annotated[str, typer.Option("--dtype", metavar="float16|bfloat16", help="Activation dtype.")]
    = "float16",
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="CUDA device to run on, e.g. cuda:1.")]
    = "cuda",
    moe_path: Annotated[str, typer.Option(
        "--moe-path", metavar="fused|per-expert", help="MoE blocks through the fused MoE kernel or the dense "
        "kernel per routed expert (each expert projection is checked with the dense kernel either way).")]
    = "fused",
    revision: RevisionOpt = None,
    output_format: FormatOpt = "human",
) -> None:
    """Run our kernels and the fp32 reference on every EXL3 linear and MLP/MoE block of a layer and compare.

    Works on a source checkpoint and on a folder written by `exl3tool prepare`.
    Exit code 0: all pass; 1: any fail; 2: unusable input or no usable GPU.
    """
    as_json = wants_json(output_format)
    selection = layers(layer)
    dtype = choice("--dtype", dtype, DTYPES)
    moe_path = choice("--moe-path", moe_path, MOE_PATHS)
    with command_errors(as_json):
        thresholds = _thresholds(max_rel_l2, min_cosine, max_abs)
        if input_file is not None and (why := kind_of(input_file)):  # a FIFO would block the safetensors reader
            raise UnreadableInputError(f"--input: {why}", path=input_file)
        with _progress(enabled=not as_json and not selection.single) as progress:
            report = run_verify(model, selection, tokens=tokens, seed=seed, input_file=input_file,
                                save_output=save_output, thresholds=thresholds, dtype=dtype, device=device,
                                revision=revision, progress=progress, moe_path=moe_path)
    if as_json:
        render_json(report)
    else:
        render_human(report, stdout)
    raise typer.Exit(EXIT_SOUND if report.passed else EXIT_PROBLEMS)


def _thresholds(max_rel_l2: float, min_cosine: float, max_abs: float | None) -> Thresholds:
    """Bounds a comparison can meet (a NaN bound fails everything, and JSON has no NaN to report it in)."""
    for option, value, low, high in (("--max-rel-l2", max_rel_l2, 0, math.inf), ("--min-cosine", min_cosine, -1, 1),
                                     ("--max-abs", max_abs, 0, math.inf)):
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            want = f"a number from {low} to {high}" if math.isfinite(high) else f"a finite number >= {low}"
            raise UsageError(f"{option} must be {want}, not {value}")
    return Thresholds(max_rel_l2, min_cosine, max_abs)


class _progress:
    """A Rich progress bar over layers on stderr (only for --layer all on a terminal)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and stderr.is_terminal
        self._bar = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress("verifying layers", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             console=stderr, transient=True)
        self._bar.start()
        task = self._bar.add_task("layers", total=None)
        return lambda done, total: self._bar.update(task, completed=done, total=total)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()
