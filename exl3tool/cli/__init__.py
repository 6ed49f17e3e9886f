"""exl3tool's command line (the only place that imports typer and rich).

    app.py        the Typer app; each command lives in its own module and is registered there
    params.py     shared Annotated parameter aliases
    errors.py     the one error -> exit code table, and `command_errors`
    console.py    stdout/stderr Rich consoles
    render/       renderers from report dataclasses to Rich or JSON
"""

from exl3tool.cli.app import app, main

__all__ = ["app", "main"]
