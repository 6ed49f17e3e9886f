"""Parameter types shared by every command (Typer `Annotated` aliases), so options read the same everywhere."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer


class OutputFormat(str, Enum):
    human = "human"
    json = "json"


ModelArg = Annotated[str, typer.Argument(
    help="EXL3 checkpoint: a local folder or a Hugging Face repo id (owner/name).",
    show_default=False)]
RevisionOpt = Annotated[Optional[str], typer.Option(
    "--revision", help="Hub revision (branch, tag or commit) when MODEL is a repo id.", show_default=False)]
FormatOpt = Annotated[OutputFormat, typer.Option(
    "--format", "-f", case_sensitive=False, help="human (Rich tables) or json (stable schema, see README).")]
LayerOpt = Annotated[Optional[int], typer.Option(
    "--layer", "-l", min=0, help="Also list every EXL3 linear of decoder layer N.", show_default=False)]
DataChecksOpt = Annotated[bool, typer.Option(
    "--data-checks/--no-data-checks", help="Read every suh/svh to check for NaN/Inf and padding (small reads).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="torch device for reference computations, e.g. cpu, cuda:0.")]
