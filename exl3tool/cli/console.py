"""The two Rich consoles. Checkpoint-derived text is always printed as plain text (markup=False or Text
objects) after `terminal_safe`, so tensor names can neither inject Rich markup nor terminal control codes."""

from rich.console import Console

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)
