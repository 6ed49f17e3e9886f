"""The route kernel's selection, exactly, against its own fp32 logits: the k highest (ties to the lower expert id),
with tied logits (equal router rows), all-zero tokens and ordinary ones, for the one-token-block path and several
token blocks. The ties take the kernel's exact search; the rest its one-redux-per-route chain."""

from __future__ import annotations

import pytest
import torch

from exl3tool.kernels.moe_route import MoERouteConfig, tiles_for
from exl3tool.ops import moe_kernels as K
from exl3tool.ops.runtime import target_arch

pytestmark = pytest.mark.gpu


def order_key(v: torch.Tensor) -> torch.Tensor:
    """ptx.order_key: fp32 bits -> unsigned order (as int64)."""
    b = v.view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)


@pytest.mark.parametrize("m", [1, 8, 16, 33, 300])
def test_route_top_k_exact_with_ties(seed, m):
    e, k = 128, 8
    cfg = MoERouteConfig("softmax_topk", e, k, **tiles_for(m))
    fn = K.compiled(cfg, target_arch())
    g = torch.Generator(device="cuda").manual_seed(seed)
    router = (torch.randn(e, 2048, device="cuda", generator=g) * 0.05).half()
    router[1:64:2] = router[0:63:2]  # experts 2j and 2j+1 alike: tied logits
    x = (torch.randn(m, 2048, device="cuda", generator=g) * 0.1).half()
    x[0] = 0  # every logit +0: the lowest k ids
    T = 8
    blocks = -(-m * k // T) + min(e, m * k)
    logits = torch.full((m, e), float("nan"), device="cuda")  # poisoned: every logit must be written
    ids = torch.empty(m, k, dtype=torch.int32, device="cuda")
    w = torch.empty(m, k, device="cuda")
    rank = torch.empty(m * k, dtype=torch.int32, device="cuda")
    counters = torch.zeros(-(-m // cfg.token_tile) + 1, dtype=torch.int32, device="cuda")
    counts = torch.zeros(e, dtype=torch.int32, device="cuda")
    expert_row = torch.empty(e, dtype=torch.int32, device="cuda")
    block_expert = torch.empty(blocks, dtype=torch.int32, device="cuda")
    row_route = torch.empty(blocks * T, dtype=torch.int32, device="cuda")
    none_i, none_f = torch.zeros(1, 1, dtype=torch.int32, device="cuda"), torch.zeros(1, 1, device="cuda")
    K.launch_route(fn, x, router, torch.zeros(1, device="cuda"), none_i, none_f, logits, ids, w, rank, counters,
                   counts, expert_row, block_expert, row_route, T)
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    # each logit in its (token, expert) place, whatever the tiles
    torch.testing.assert_close(logits, x.float() @ router.float().t(), rtol=1e-3, atol=1e-4)
    ranked = (order_key(logits) << 8) + (255 - torch.arange(e, device="cuda"))  # higher key, then lower id
    want = ranked.topk(k, dim=1).indices
    plain = (logits != 0).all(1)  # -0 and +0 compare equal inside a lane: key order only without zeros
    assert torch.equal(ids[plain].long(), want[plain])
    if (logits[0].view(torch.int32) == 0).all():
        assert torch.equal(ids[0].long(), torch.arange(k, device="cuda"))
    assert (logits[1:, :64:2] == logits[1:, 1:64:2]).all()  # the ties are there
    p = logits.softmax(1).gather(1, want)
    assert torch.allclose(w, p / p.sum(1, keepdim=True), rtol=1e-5, atol=1e-7)
    assert not counters.any() and not counts.any()
