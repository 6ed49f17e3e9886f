"""Scratch memory planned ahead: plans take views of one arena per device when they are made, never per call.

Plans on one device run one after another on a stream, so they can share their scratch (rotated activations,
split-K partials, dequantized weights). When a new plan needs more than the arena holds, a larger arena is made
for it and later plans; earlier plans keep the views they hold (and so their memory) for as long as they live.

Arrival counters are different: the kernels leave them at zero after every launch, so they live in an arena of
their own that is zeroed once and never handed out as ordinary scratch.
"""

from __future__ import annotations

from math import prod

import torch

ALIGN = 256  # bytes: every view starts on a 256-byte boundary (16-byte vector loads, cp.async, cuBLAS)


class Workspace:
    def __init__(self, zeroed: bool = False):
        self.zeroed = zeroed
        self._arenas: dict[torch.device, torch.Tensor] = {}

    def views(self, device: torch.device, *specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        """Disjoint tensors of the given (shape, dtype), views of the device's arena."""
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            total += -(-prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        arena = self._arenas.get(device)
        if arena is None or arena.numel() < total:
            size = max(total, 2 * arena.numel() if arena is not None else 0, 1 << 20)
            make = torch.zeros if self.zeroed else torch.empty
            arena = self._arenas[device] = make(size, dtype=torch.uint8, device=device)
        return [arena[off: off + prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for off, (shape, dtype) in zip(offsets, specs)]


scratch = Workspace()
counters = Workspace(zeroed=True)
