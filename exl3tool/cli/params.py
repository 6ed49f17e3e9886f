"""Parameter types shared by every command (Typer `Annotated` aliases), so options read the same everywhere.

Choices (`--format`, `--dtype`, ...) are plain strings checked by `choice`, so a wrong one is the same one-line
usage error as every other ("exl3tool: usage error: --format must be human or json"), not Typer's own wording.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from exl3tool.cli.errors import command_errors
from exl3tool.errors import UsageError
from exl3tool.selection import LayerSelection, parse_layers

FORMATS = ("human", "json")


def choice(option: str, value: str, choices: tuple[str, ...]) -> str:
    """`value` (any case) when it is one of `choices`; else the usage error (exit 2)."""
    with command_errors():
        picked = value.strip().lower()
        if picked not in choices:
            listed = ", ".join(choices[:-1]) + " or " + choices[-1]
            raise UsageError(f"{option} must be {listed}, not {value!r}")
        return picked


def wants_json(output_format: str) -> bool:
    """--format: True for json, False for human."""
    return choice("--format", output_format, FORMATS) == "json"


def layers(spec: str | None) -> LayerSelection | None:
    """--layer: checked against the grammar before any file is read (exit 2 otherwise)."""
    with command_errors():
        return None if spec is None else parse_layers(spec)


ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", help="EXL3 checkpoint: a local folder or a Hugging Face repo id (owner/name).",
    show_default=False)]
RevisionOpt = Annotated[Optional[str], typer.Option(
    "--revision", metavar="REV", help="Hub revision (branch, tag or commit) when MODEL is a repo id.",
    show_default=False)]
FormatOpt = Annotated[str, typer.Option(
    "--format", "-f", metavar="human|json", help="human (Rich tables) or json (stable schema, see README).")]
LAYER_HELP = "N, a list of layers and ranges such as 0-3,7,10- (10- runs to the last layer), or all"
LayerOpt = Annotated[Optional[str], typer.Option(
    "--layer", "-l", metavar="LAYERS", help=f"Also list every EXL3 linear of these decoder layers: {LAYER_HELP}.",
    show_default=False)]
DataChecksOpt = Annotated[bool, typer.Option(
    "--data-checks/--no-data-checks", help="Read every suh/svh to check for NaN/Inf and padding (small reads).")]
