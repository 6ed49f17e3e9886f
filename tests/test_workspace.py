"""The scratch workspace: plans take disjoint, aligned views at plan time; a larger request gets a new arena and
leaves the views handed out earlier intact; the counter arena starts zeroed."""

import torch

from exl3tool.ops.workspace import ALIGN, Workspace

CPU = torch.device("cpu")


def test_views_are_disjoint_aligned_and_shaped():
    ws = Workspace()
    a, b, c = ws.views(CPU, ((3, 5), torch.float16), ((2, 7, 9), torch.float32), ((1,), torch.int32))
    assert (a.shape, b.shape, c.shape) == ((3, 5), (2, 7, 9), (1,))
    assert (a.dtype, b.dtype, c.dtype) == (torch.float16, torch.float32, torch.int32)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (a, b, c))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    # offsets from the arena's base (a CUDA allocation is itself 512-byte aligned; a CPU one need not be)
    assert all((t.data_ptr() - a.data_ptr()) % ALIGN == 0 for t in (b, c))


def test_growth_keeps_earlier_views_alive_and_unshared():
    ws = Workspace()
    (small,) = ws.views(CPU, ((16,), torch.float32))
    small.fill_(3.0)
    (big,) = ws.views(CPU, ((1 << 20,), torch.float32))  # 4 MiB: more than the first arena holds
    big.fill_(-1.0)
    assert torch.equal(small, torch.full((16,), 3.0))
    # A later small request shares the new arena, not the old one.
    (again,) = ws.views(CPU, ((16,), torch.float32))
    assert again.data_ptr() == big.data_ptr()


def test_counter_arena_starts_zeroed():
    (counters,) = Workspace(zeroed=True).views(CPU, ((4096,), torch.int32))
    assert torch.count_nonzero(counters) == 0
