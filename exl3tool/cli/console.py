"""The two Rich consoles. Checkpoint-derived text is always printed as plain text (markup=False or Text
objects) after `terminal_safe`, so tensor names can neither inject Rich markup nor terminal control codes."""

from rich.console import Console, ConsoleDimensions

PIPED_WIDTH = 1000  # columns when writing to a pipe or file: wide enough that no table cell is cut


class ToolConsole(Console):
    """A terminal's width on a terminal (or COLUMNS where set); PIPED_WIDTH anywhere else. Rich would assume 80
    columns for a pipe or file and cut the cells that do not fit (`1.64e…`), so a log would lose numbers."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal and not self._environ.get("COLUMNS", "").isdigit():
            return ConsoleDimensions(PIPED_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


stdout = ToolConsole(highlight=False)
stderr = ToolConsole(stderr=True, highlight=False)
