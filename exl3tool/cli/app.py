"""The Typer application: one module per command, registered here."""

from __future__ import annotations

import typer
from typer.core import TyperCommand

from exl3tool.cli import bench as bench_command
from exl3tool.cli import inspect as inspect_command
from exl3tool.cli import prepare as prepare_command
from exl3tool.cli import verify as verify_command
from exl3tool.version import __version__



class Command(TyperCommand):
    """Usage and help that name arguments as the README does (`MODEL OUT`), without Typer's `{MODEL}` and
    `MODEL <str>` decorations. Every command is registered with it (`cls=Command`)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.removeprefix("{").removesuffix("}") for piece in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                argument = param.param_type_name == "argument"
                sections["Arguments" if argument else "Options"].append(
                    (param.metavar or param.name.upper(), record[1]) if argument else record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(
    name="exl3tool",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
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


app.command("inspect", cls=Command)(inspect_command.inspect)
app.command("prepare", cls=Command)(prepare_command.prepare)
app.command("verify", cls=Command)(verify_command.verify)
app.command("bench", cls=Command)(bench_command.bench)


def main() -> None:
    app(prog_name="exl3tool")
