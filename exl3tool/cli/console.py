"""The two Rich consoles. Checkpoint-derived text is always printed as plain text (markup=False or Text
objects) after `terminal_safe`, so tensor names can neither inject Rich markup nor terminal control codes."""

from rich.console import Console, ConsoleDimensions

PIPED_WIDTH = 1000  # columns when writing to a pipe or file: wide enough that no table cell is cut


class ToolConsole(Console):
    """A terminal's width (or COLUMNS) on a terminal; PIPED_WIDTH anywhere else. Rich would fit a pipe or file to
    80 columns, or to COLUMNS, and cut the cells that do not fit (`1.64e…`), so a log would lose numbers. COLUMNS
    describes a terminal, and is not always the user's: in pytest-xdist workers on the GPU machine it read 80."""

    def __init__(self, *args, width: int | None = None, **kwargs):
        super().__init__(*args, width=width, **kwargs)
        self._fixed_width = width is not None  # Rich also fixes _width from COLUMNS at construction

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if not self._fixed_width and not self.is_terminal:
            return ConsoleDimensions(PIPED_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


stdout = ToolConsole(highlight=False)
stderr = ToolConsole(stderr=True, highlight=False)
