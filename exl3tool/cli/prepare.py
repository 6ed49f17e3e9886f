"""`exl3tool prepare MODEL OUT`: write the prepared W4A16 layout (docs/prepared-layout.md) of a checkpoint."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from exl3tool.cli.console import stderr, stdout
from exl3tool.cli.errors import command_errors, problems_exit_code
from exl3tool.cli.params import LAYER_HELP, FormatOpt, ModelArg, RevisionOpt, layers, wants_json
from exl3tool.cli.render.prepare import ProgressBar, render_human, render_json, render_refusal_json
from exl3tool.errors import CheckpointProblemsError
from exl3tool.prepared.layout import DEFAULT_MAX_SHARD_BYTES
from exl3tool.prepared.writer import prepare_checkpoint

OutArg = Annotated[str, typer.Argument(
    metavar="OUT", help="Folder to write (created if missing): safetensors shards plus manifest.json.",
    show_default=False)]
LayersOpt = Annotated[Optional[str], typer.Option(
    "--layer", "--layers", "-l", metavar="LAYERS", help=f"Only these decoder layers: {LAYER_HELP} (a selection "
    "other than all leaves out the head and the non-layer tensors).", show_default=False)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary (errors only).")]
OverwriteOpt = Annotated[bool, typer.Option(
    "--overwrite", help="Replace what an earlier prepare (another source or other options) left in OUT.")]
ShardOpt = Annotated[str, typer.Option(
    "--max-shard-size", metavar="SIZE", help="Upper bound of one shard's tensor data, e.g. 500MB, 2GB (a single "
    "larger tensor gets a shard of its own).")]


def prepare(
    model: ModelArg,
    out: OutArg,
    layer: LayersOpt = None,
    revision: RevisionOpt = None,
    output_format: FormatOpt = "human",
    quiet: QuietOpt = False,
    overwrite: OverwriteOpt = False,
    max_shard_size: ShardOpt = f"{DEFAULT_MAX_SHARD_BYTES // 10**9}GB",
) -> None:
    """Write MODEL in the prepared layout the fused kernels load directly (memory map, one copy to the GPU).

    Atomic and resumable: an interrupted run leaves no manifest.json, and running the same command again
    finishes only what is missing. Refuses a checkpoint that `exl3tool inspect` finds problems in.
    Exit code 0: written (or already complete); 1: problems in MODEL; 2: unreadable input, usage or output error.
    """
    as_json = wants_json(output_format)
    selection = layers(layer)
    bar = ProgressBar(stderr, enabled=not (quiet or as_json) and stderr.is_terminal)
    with command_errors(as_json):
        try:
            with bar:
                report = prepare_checkpoint(model, out, layers=selection, revision=revision, overwrite=overwrite,
                                            max_shard_bytes=max_shard_size, progress=bar.update)
        except CheckpointProblemsError as error:
            if not as_json:
                raise
            render_refusal_json(error)
            raise typer.Exit(problems_exit_code(error.problems)) from None
    if as_json:
        render_json(report)
    elif not quiet:
        render_human(report, stdout)
