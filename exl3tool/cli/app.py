"""The Typer application: one module per command, registered here."""

from __future__ import annotations

import typer

from exl3tool import __version__
from exl3tool.cli import inspect as inspect_command
from exl3tool.cli import prepare as prepare_command
from exl3tool.cli import verify as verify_command

app = typer.Typer(
    name="exl3tool",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"exl3tool {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Inspect, verify and run EXL3 (ExLlamaV3 trellis-quantized) checkpoints."""


app.command("inspect")(inspect_command.inspect)
app.command("prepare")(prepare_command.prepare)
app.command("verify")(verify_command.verify)


def main() -> None:
    app(prog_name="exl3tool")
