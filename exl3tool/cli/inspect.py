"""`exl3tool inspect MODEL`: what is in an EXL3 checkpoint (or a prepared folder) and whether it is sound."""

from __future__ import annotations

import typer

from exl3tool.cli.console import stdout
from exl3tool.cli.errors import command_errors, problems_exit_code
from exl3tool.cli.params import DataChecksOpt, FormatOpt, LayerOpt, ModelArg, RevisionOpt, layers, wants_json
from exl3tool.cli.render.inspect import render_human, render_json
from exl3tool.inspection import inspect_checkpoint


def inspect(
    model: ModelArg,
    layer: LayerOpt = None,
    revision: RevisionOpt = None,
    output_format: FormatOpt = "human",
    data_checks: DataChecksOpt = True,
) -> None:
    """Summarise an EXL3 checkpoint (architecture, codebooks, bitrates, sizes, layers) and check it.

    MODEL may also be a folder written by `exl3tool prepare`.
    Exit code 0: sound; 1: problems found; 2: unreadable input or usage error.
    """
    as_json = wants_json(output_format)
    selection = layers(layer)
    with command_errors(as_json):
        report = inspect_checkpoint(model, revision, layer=selection, data_checks=data_checks)
    if as_json:
        render_json(report)
    else:
        render_human(report, stdout)
    raise typer.Exit(problems_exit_code(report.problems))
