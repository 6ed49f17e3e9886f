"""`exl3tool verify MODEL --layer N|all`: our GPU kernels against the fp32 reference, per module."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from exl3tool.cli.console import stderr, stdout
from exl3tool.cli.errors import EXIT_PROBLEMS, EXIT_SOUND, command_errors
from exl3tool.cli.params import FormatOpt, ModelArg, OutputFormat, RevisionOpt
from exl3tool.cli.render.verify import render_human, render_json
from exl3tool.verify import Thresholds, verify as run_verify

DEFAULTS = Thresholds()


def verify(
    model: ModelArg,
    layer: Annotated[str, typer.Option("--layer", "-l", help="Decoder layer N, or 'all' (with a progress bar).",
                                       show_default=False)],
    tokens: Annotated[int, typer.Option("--tokens", "-m", min=1, help="Rows of random activations.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random activations.")] = 0,
    input_file: Annotated[Optional[str], typer.Option(
        "--input", help="safetensors with <module>.input / <block>.input activations (and optionally "
        "<name>.output recorded outputs to compare with).", show_default=False)] = None,
    save_output: Annotated[Optional[str], typer.Option(
        "--save-output", help="Write <name>.reference and <name>.kernel (fp32) to this safetensors file.",
        show_default=False)] = None,
    max_rel_l2: Annotated[float, typer.Option("--max-rel-l2", help="Fail above this relative L2 error.")]
    = DEFAULTS.max_rel_l2,
    min_cosine: Annotated[float, typer.Option("--min-cosine", help="Fail below this cosine similarity.")]
    = DEFAULTS.min_cosine,
    max_abs: Annotated[Optional[float], typer.Option("--max-abs", help="Also fail above this max abs error.",
                                                     show_default=False)] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Activation dtype: float16 or bfloat16.")] = "float16",
    device: Annotated[str, typer.Option("--device", help="CUDA device to run on.")] = "cuda",
    revision: RevisionOpt = None,
    output_format: FormatOpt = OutputFormat.human,
) -> None:
    """Run our kernels and the fp32 reference on every EXL3 linear and MLP/MoE block of a layer and compare.

    Works on a source checkpoint and on a folder written by `exl3tool prepare`.
    Exit code 0: all pass; 1: any fail; 2: unusable input or no usable GPU.
    """
    as_json = output_format is OutputFormat.json
    thresholds = Thresholds(max_rel_l2, min_cosine, max_abs)
    with command_errors(as_json):
        with _progress(enabled=not as_json and layer.strip().lower() == "all") as progress:
            report = run_verify(model, layer, tokens=tokens, seed=seed, input_file=input_file,
                                save_output=save_output, thresholds=thresholds, dtype=dtype, device=device,
                                revision=revision, progress=progress)
    if as_json:
        render_json(report)
    else:
        render_human(report, stdout)
    raise typer.Exit(EXIT_SOUND if report.passed else EXIT_PROBLEMS)


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
