"""Which decoder layers a command works on: one grammar for inspect, prepare and verify.

    parse_layers("0-3,7,10-") -> LayerSelection     'all', or indices and inclusive ranges ('10-' runs to the end)
    LayerSelection.resolve(have) -> list[int]       the checkpoint's layers it names; NotFoundError for an absent one

Ranges stay ranges until resolved against the layers a checkpoint has, so `0-999999999` costs nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from exl3tool.errors import NotFoundError, UsageError

_PART = re.compile(r"^(\d+)(?:(-)(\d*))?$")
GRAMMAR = "'all' or layer numbers and ranges like 0-3,7,10-"


@dataclass(frozen=True)
class LayerSelection:
    text: str
    ranges: tuple[tuple[int, int | None], ...] | None  # inclusive (first, last or None = to the end); None: all

    @property
    def single(self) -> bool:
        """Exactly one layer, named by its number."""
        return self.ranges is not None and len(self.ranges) == 1 and self.ranges[0][0] == self.ranges[0][1]

    def resolve(self, have: Iterable[int], source: str | None = None) -> list[int]:
        """The indices of `have` (the layers of the checkpoint `source`) this selection names, ascending. A number
        or closed range that names a layer the checkpoint lacks is NotFoundError; an open range takes what exists."""
        have = sorted(set(have))
        if self.ranges is None:
            return have
        present = set(have)
        span = f"{have[0]}..{have[-1]}" if have else "none"
        chosen: set[int] = set()
        for first, last in self.ranges:
            if last is not None:
                gap = next((i for i in range(first, min(last, first + len(have)) + 1) if i not in present), None)
                if gap is not None:
                    raise NotFoundError(f"no layer {gap} in the checkpoint (layers: {span})", path=source)
            chosen.update(i for i in have if i >= first and (last is None or i <= last))
        if not chosen:
            raise NotFoundError(f"--layer {self.text}: no such layer in the checkpoint (layers: {span})", path=source)
        return sorted(chosen)


def parse_layers(text: str | int | LayerSelection) -> LayerSelection:
    """Parse a layer selection (an int is one layer); UsageError naming the grammar for anything else."""
    if isinstance(text, LayerSelection):
        return text
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str):
        raise UsageError(f"--layer must be {GRAMMAR}")
    spec = text.replace(" ", "")
    if spec.lower() == "all":
        return LayerSelection(text, None)
    ranges = []
    for part in spec.split(","):
        m = _PART.match(part)
        if not m:
            raise UsageError(f"--layer {text!r}: expected {GRAMMAR}")
        first = int(m.group(1))
        last = first if m.group(2) is None else int(m.group(3)) if m.group(3) else None
        if last is not None and last < first:
            raise UsageError(f"--layer {text!r}: the range {first}-{last} runs backwards")
        ranges.append((first, last))
    return LayerSelection(text, tuple(ranges))
