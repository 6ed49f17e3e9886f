"""The fused MoE layer against the fp32 reference: the Qwen3-MoE fixture (from its prepared folder, zero-copy, and
against ExLlamaV3's recorded block outputs) and synthetic MoE checkpoints (softmax and sigmoid grouped routing,
shared experts, two expert groups, all codebooks, K 2..6, E up to 128, top-k up to 8, hidden/intermediate up to
4096, M 1..4096). Scratch is NaN-poisoned first; graph replay is bit-identical to eager; no host sync inside the
call; every token's result is independent of the rest of the batch."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import exl3tool
from exl3tool import reference
from exl3tool.format import MoEBlock
from exl3tool.kernels.moe_gemm import MoEGemmConfig
from exl3tool.kernels.moe_rotate import IntermediateConfig, RouteInputRotationConfig, TopKSumConfig
from exl3tool.ops import moe as moe_ops
from exl3tool.ops import moe_configs
from exl3tool.ops import targets
from exl3tool.ops.moe import DeviceMoE, moe_forward, plan_moe, routes
from exl3tool.prepared import load_prepared, prepare_checkpoint
from exl3tool.synthetic import edit_checkpoint, write_checkpoint
from tests.helpers import edit_config, launched_partials, model_dir, outputs_dir

pytestmark = pytest.mark.gpu
MAX_REL = 1e-2  # verify's default threshold; fp16 activations land ~1e-3


def rel(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def poison(plan) -> None:
    for t in (plan.logits, plan.ids, plan.weights, plan.rank, plan.expert_row, plan.row_route, plan.route_row,
              plan.block_expert):
        t.fill_(-7 if t.dtype == torch.int32 else float("nan"))
    for t in (plan.xr, plan.p13, plan.x2, plan.p2, plan.y):
        t.fill_(float("nan"))


def reference_given(reader, moe, x, ids, weights) -> torch.Tensor:
    """fp32 reference of the layer for the given routes (k routed columns; the shared experts added as the
    reference does)."""
    block = moe.block
    out = torch.zeros(x.shape[0], moe.hidden, dtype=torch.float32, device=x.device)
    k = moe.routing.top_k
    for e in ids[:, :k].unique().tolist():
        rows, slots = (ids[:, :k] == e).nonzero(as_tuple=True)
        y = reference.gated_mlp_forward(x[rows], reader.mlp_tensors(block.experts[e], x.device))
        out.index_add_(0, rows, y * weights[rows, slots, None])
    if moe.shared is not None:
        y = reference.gated_mlp_forward(x, reader.mlp_tensors(block.shared_experts, x.device))
        if moe.shared_gate is not None:
            y = y * torch.sigmoid(x.float() @ moe.shared_gate.float().T)
        out += y
    return out


def check_routes(moe, x, ids, weights) -> None:
    """The kernel's top-k = the reference's, except where the reference's k-th and (k+1)-th choice are a
    near-tie (fp32 summation order alone can swap those)."""
    on = lambda t: None if t is None else t.to(x.device)  # noqa: E731
    w_ref, i_ref = reference.route(x, on(moe.router), moe.routing, on(moe.correction_bias), on(moe.router_bias))
    k = moe.routing.top_k
    same = (ids[:, :k].sort(1).values == i_ref.sort(1).values.int()).all(1)
    if not same.all():
        choice = x.float() @ moe.router.to(x.device).float().T
        if moe.router_bias is not None:
            choice = choice + moe.router_bias.to(x.device).float()
        if moe.routing.method == "sigmoid_noaux_tc":
            choice = choice.sigmoid() + (0 if moe.correction_bias is None else moe.correction_bias.to(x.device).float())
        top = choice.sort(1, descending=True).values
        near_tie = (top[:, k - 1] - top[:, k]).abs() < 1e-4 * top[:, 0].abs().clamp(min=1)
        assert (same | near_tie).all(), f"{(~same).sum().item()} tokens routed differently"
    order_k, order_r = ids[same, :k].argsort(1), i_ref[same].argsort(1)
    got = weights[same, :k].gather(1, order_k)
    want = w_ref[same].gather(1, order_r)
    assert torch.allclose(got, want.float(), rtol=1e-4, atol=1e-6)


def run_layer(reader, layer, tokens_list, *, scale=0.1, dtype=torch.float16, seed=0):
    moe = reader.moe(layer, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    plan = plan_moe(dmoe, max(tokens_list), dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for m in tokens_list:
        x = (torch.randn(m, moe.hidden, device="cuda", generator=g) * scale).to(dtype)
        poison(plan)
        y = moe_forward(x, plan).clone()
        ids, weights = (t.clone() for t in routes(plan, m))
        assert torch.isfinite(y).all()
        check_routes(moe, x, ids, weights)
        want = reference_given(reader, moe, x, ids.long(), weights)
        r = rel(y, want)
        assert r < MAX_REL, (m, r)
        if moe.shared is not None:
            assert (ids[:, -1] == moe.num_experts).all()
    return moe, dmoe, plan


# --- the genuine Qwen3-MoE fixture ---------------------------------------------------------------------------


def test_fixture_from_prepared_folder_zero_copy_and_recorded_outputs(tmp_path):
    prepare_checkpoint(model_dir("qwen3moe_mul1"), tmp_path / "prep")
    recorded = outputs_dir("qwen3moe_mul1") / "exllamav3_outputs.safetensors"
    with load_prepared(tmp_path / "prep", device="cuda") as prep, safe_open(recorded, "pt") as f:
        for layer in prep.layers:
            if not isinstance(layer.mlp, MoEBlock):
                continue
            moe = prep.moe(layer.index)
            dmoe = DeviceMoE.from_layer(moe)
            # zero-copy: the kernels read the loaded stacks themselves
            assert dmoe.groups[0].w13.data_ptr() == moe.w13.data_ptr()
            assert dmoe.groups[0].w2.data_ptr() == moe.w2.data_ptr()
            run_layer(prep, layer.index, [1, 7, 33, 200])
            name = layer.mlp.name
            if f"{name}.input" in f.keys():
                x = f.get_tensor(f"{name}.input").cuda().half()
                plan = plan_moe(dmoe, x.shape[0])
                poison(plan)
                y = moe_forward(x, plan).float()
                want = f.get_tensor(f"{name}.output").cuda().float()[:, : y.shape[1]]
                assert rel(y, want) < MAX_REL
                assert rel(y, prep.reference_forward(name, x)) < MAX_REL


# --- synthetic checkpoints -----------------------------------------------------------------------------------

SYNTHETIC = {
    "qwen3-30b-shape-k4-mcg": (dict(arch="qwen3_moe", hidden=2048, moe_intermediate=768, num_experts=128, top_k=8,
                                    bits=4, codebook="mcg"), [1, 16, 256, 4096]),
    "k2-3inst-unnormalised": (dict(arch="qwen3_moe", hidden=512, moe_intermediate=256, num_experts=16, top_k=4,
                                   bits=2, codebook="3inst", norm_topk_prob=False), [1, 9, 100]),
    "k3.5-mul1-shared-gated": (dict(arch="qwen2_moe", hidden=384, moe_intermediate=256, shared_intermediate=640,
                                    num_experts=8, top_k=2, bits=3.5, codebook="mul1"), [1, 5, 64]),
    "deepseek-grouped-sigmoid": (dict(arch="deepseek_v3", hidden=256, moe_intermediate=128, num_experts=32, top_k=6,
                                      n_group=4, topk_group=2, num_shared_experts=2, bits=6, codebook="mcg"),
                                 [1, 8, 77]),
    "two-groups-k3-k5": (dict(arch="qwen3_moe", hidden=256, moe_intermediate=384, num_experts=12, top_k=3, bits=5,
                              codebook="mcg", per_linear={"*.experts.[13579].*": (3, "3inst")}), [2, 40]),
    "hidden-intermediate-4096": (dict(arch="qwen3_moe", hidden=4096, moe_intermediate=4096, num_experts=4, top_k=2,
                                      bits=4, codebook="mul1"), [1, 64]),
    # MiniMax-M2's routing (sigmoid scores, a correction bias, one group, no shared expert; Mixtral's names)
    "minimax-m2-sigmoid-one-group": (dict(arch="minimax_m2", hidden=256, intermediate=256, num_experts=32, top_k=8,
                                          bits=4, codebook="mcg"), [1, 9, 150]),
    # Qwen3-Next's routing (512 experts, top-10, renormalised, a gated shared expert) at a small width
    "qwen3-next-512-experts-top-10": (dict(arch="qwen3_next", hidden=256, moe_intermediate=128,
                                           shared_intermediate=256, num_experts=512, top_k=10, bits=4,
                                           codebook="mcg"), [1, 6, 200]),
    # LFM2-MoE's routing (sigmoid scores chosen with its expert_bias, scaled by 2.5) in feed_forward blocks
    "lfm2-moe-expert-bias": (dict(arch="lfm2_moe", hidden=256, moe_intermediate=256, num_experts=32, top_k=4,
                                  bits=4, codebook="mcg"), [1, 7, 120]),
    # gpt-oss's blocks (a bias on the softmax router's logits, biased experts, the clamped SwiGLU) at widths that
    # pad, as its 2880 does; 1100 tokens take warpgroup-MMA route blocks with the Intermediate and TopKSum launches
    "gpt-oss-biased-swiglu": (dict(arch="gpt_oss", hidden=576, intermediate=448, num_experts=32, top_k=4, bits=4,
                                   codebook="mcg"), [1, 3, 16, 200, 1100]),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            spec, _ = SYNTHETIC[name]
            path = write_checkpoint(tmp_path_factory.mktemp(name), num_layers=1, vocab=256, head_bits=16,
                                    embeddings=False, **spec)
            made[name] = exl3tool.open_checkpoint(path)
        return made[name]

    yield get
    for ckpt in made.values():
        ckpt.close()


@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_synthetic_layers_match_the_reference(synthetic, name):
    moe, dmoe, plan = run_layer(synthetic(name), 0, SYNTHETIC[name][1])
    if name == "two-groups-k3-k5":
        assert len(dmoe.groups) == 2 and plan.launches(1) == 5  # route, 2 per group (top-k sum in the down GEMMs)
    if name == "qwen3-30b-shape-k4-mcg":
        # decode: the gate/up GEMM rotates x and does the intermediate, the down GEMM the top-k sum (given ids:
        # the intermediate only); the other mma.sync route blocks (block-ready counters) fuse the intermediate, and
        # the warpgroup-MMA ones launch every step
        assert plan.launches(1) == 3 and plan.launches(1, given=True) == 5
        assert plan.launches(16) == 5 and plan.launches(4096) == 6


def test_softmax_routing_with_ungated_shared_experts(tmp_path):
    """Mistral-Small-4's blocks (mistral4): a softmax router renormalised over the top-k beside DeepSeek-V3's ungated
    shared experts (the synthetic layers pair softmax with a gated shared expert, sigmoid with an ungated one)."""
    path = write_checkpoint(tmp_path / "m4", num_layers=1, vocab=256, head_bits=16, embeddings=False,
                            arch="deepseek_v3", hidden=256, moe_intermediate=128, num_experts=32, top_k=4, n_group=1,
                            topk_group=1, num_shared_experts=2, bits=4, codebook="mcg")
    edit_checkpoint(path, drop=["model.layers.0.mlp.gate.e_score_correction_bias"])
    edit_config(path, model_type="mistral4", routed_scaling_factor=None, scoring_func=None, topk_method=None)
    with exl3tool.open_checkpoint(path) as ckpt:
        moe, _, _ = run_layer(ckpt, 0, [1, 9, 100])
        assert moe.routing.method == "softmax_topk" and moe.shared is not None and moe.shared_gate is None


def test_gpt_oss_blocks_run_fused(synthetic):
    """gpt-oss through the fused kernel (its reference check: ``test_synthetic_layers_match_the_reference``): every
    step gates with the clamped SwiGLU and both biases, the router adds its logits' bias, and the layer's output
    moves when any of them changes (each reaches y). Graph replay is bit-identical to eager."""
    reader = synthetic("gpt-oss-biased-swiglu")
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    (g,) = dmoe.groups
    assert dmoe.route.logit_bias and dmoe.down_biased and g.gating.biased
    assert (g.gating.activation, g.gating.limit) == ("swiglu_oai", moe.block.experts[0].activation_limit)
    plan = plan_moe(dmoe, 64)
    x = (torch.randn(64, moe.hidden, device="cuda") * 0.1).half()
    for m in (1, 64):
        eager = moe_forward(x[:m], plan).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_forward(x[:m], plan)
        poison(plan)
        graph.replay()
        assert torch.equal(out, eager), m
        for table, cols in ((g.rotations, slice(3 * g.intermediate_padded, None)),
                            (dmoe.down_svh, slice(dmoe.hidden_padded, None)), (dmoe.route_bias, slice(None))):
            saved = table.clone()
            part = table[..., cols]  # every bias (gate and up, down, the router's), each moved differently
            part += torch.linspace(0.0, 1.0, part.shape[-1], device="cuda", dtype=part.dtype)
            moved = moe_forward(x[:m], plan).clone()
            table.copy_(saved)
            assert not torch.equal(moved, eager), (m, table.shape)
        assert torch.equal(moe_forward(x[:m], plan), eager)


def test_bf16_activations(synthetic):
    """bf16 x: the router logits run as bf16 MMAs against the fp16 router split exactly into two bf16 parts."""
    run_layer(synthetic("k3.5-mul1-shared-gated"), 0, [1, 5, 64], dtype=torch.bfloat16)


def test_gelu_experts_run_per_expert_not_fused(tmp_path):
    """A MoE block whose config gates with GELU (tanh form): the fused kernel, which computes SiLU, refuses it; the
    dense kernels per expert (verify's --moe-path per-expert) compute it, against the reference."""
    from exl3tool.errors import UnsupportedFeatureError
    from exl3tool.ops import blocks
    from exl3tool.ops.linear import DeviceLinear

    path = write_checkpoint(tmp_path / "gelu", arch="qwen3_moe", num_layers=1, hidden=256, moe_intermediate=128,
                            num_experts=8, top_k=2, embeddings=False, hidden_act="gelu_pytorch_tanh")
    with exl3tool.open_checkpoint(path) as reader:
        moe = reader.moe(0, device="cuda")
        with pytest.raises(UnsupportedFeatureError, match="gelu_tanh"):
            DeviceMoE.from_layer(moe)
        block = reader.block("model.layers.0.mlp")
        mlps = [blocks.DeviceGatedMLP(*(DeviceLinear.from_tensors(reader.load_linear(lin.name), "cuda")
                                        for lin in e.linears), e.activation) for e in block.experts]
        x = (torch.randn(5, 256, device="cuda") * 0.1).half()
        y = blocks.moe_forward(x, reader.load_tensor(block.router.name, "cuda"), block.routing, lambda e: mlps[e])
        assert rel(y, reader.reference_forward("model.layers.0.mlp", x.float())) < MAX_REL


@pytest.mark.parametrize("m", [300, 1100])
def test_skewed_routing_empty_experts_and_one_expert_for_all(synthetic, m):
    """M=1100 (a mean of 275 routes an expert) packs 256-row route blocks where the GPU has warpgroup MMAs: all
    routes to one expert fill 18 of them, the skewed case leaves experts empty and blocks partly filled."""
    reader = synthetic("k2-3inst-unnormalised")
    moe = reader.moe(0, device="cuda")
    plan = plan_moe(DeviceMoE.from_layer(moe), m)
    if m == 1100:
        assert plan.step(m, True).shape.block_rows == (256 if targets.has_wgmma(plan.arch) else 128)
    k, e = moe.routing.top_k, moe.num_experts
    x = (torch.randn(m, moe.hidden, device="cuda") * 0.1).half()
    cases = {
        "all to expert 5": torch.full((m, k), 5, dtype=torch.int32, device="cuda"),
        # 90% of the routes to experts 0..1, the rest spread; experts 12..15 get none
        "skewed": torch.where(torch.rand(m, k, device="cuda") < 0.9, torch.randint(0, 2, (m, k), device="cuda"),
                              torch.randint(2, e - 4, (m, k), device="cuda")).int(),
    }
    for what, ids in cases.items():
        weights = torch.rand(m, k, device="cuda")
        poison(plan)
        y = moe_forward(x, plan, topk_ids=ids, topk_weights=weights).clone()
        assert torch.equal(routes(plan, m)[0], ids)
        assert rel(y, reference_given(reader, moe, x, ids.long(), weights)) < MAX_REL, what


def test_graph_replay_is_bit_identical_without_host_sync(synthetic):
    reader = synthetic("qwen3-30b-shape-k4-mcg")
    plan = plan_moe(DeviceMoE.from_layer(reader.moe(0, device="cuda")), 64)
    for m in (1, 64):
        x = (torch.randn(m, 2048, device="cuda") * 0.1).half()
        eager = moe_forward(x, plan).clone()  # compiles and warms up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = moe_forward(x, plan).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(eager, again)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_forward(x, plan)
        for _ in range(3):
            poison(plan)
            graph.replay()
            assert torch.equal(out, eager)
        x.copy_((torch.randn(m, 2048, device="cuda") * 0.1).half())  # new input, same graph
        graph.replay()
        assert torch.equal(out.clone(), moe_forward(x, plan).clone())


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (1,)), ("k3.5-mul1-shared-gated", (1, 5)),
                                     ("two-groups-k3-k5", (1, 2)), ("gpt-oss-biased-swiglu", (1, 3))])
def test_steps_fused_into_the_gemms_are_bit_identical_to_their_launches(synthetic, name, ms, monkeypatch):
    """At decode the gate/up GEMM rotates x itself (M = 1: prologue, each expert's suh) and does the intermediate
    (one-wave grid: its last CTA per 128 columns), and the down GEMM does the top-k sum (M = 1: its last CTA per
    128 columns over every group's launch), shared experts' group included. Each is bit-identical to the launch
    it replaces (split halves off: they round each weight differently), also on a second call (arrival counters
    back at zero), and the launch count says which ran."""
    monkeypatch.setattr(moe_configs, "split_halves", lambda *args: False)
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    groups = len(dmoe.groups)
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs = []
        for resident_tokens, fused_rows, topk_tokens in ((1, 8, 1), (0, 8, 0), (1, 0, 0), (0, 0, 1), (0, 0, 0)):
            with monkeypatch.context() as patch:
                patch.setattr(moe_configs, "RESIDENT_INPUT_TOKENS", resident_tokens)
                patch.setattr(moe_configs, "FUSED_INTERMEDIATE_ROWS", fused_rows)
                patch.setattr(moe_configs, "FUSED_TOPK_TOKENS", topk_tokens)
                patch.setattr(moe_configs, "READY_COUNTERS_MIN_TOKENS", 1 << 30)  # (test_block_ready_counters_...)
                plan = plan_moe(dmoe, max(ms))
                assert plan.step(m, False).shape.fused_intermediate == (fused_rows > 0)  # one-wave grids here
                per_group = 4 - (m <= resident_tokens) - (fused_rows > 0)
                assert plan.launches(m) == 1 + (m > topk_tokens) + per_group * groups
                poison(plan)
                y = moe_forward(x, plan).clone()
                poison(plan)
                assert torch.equal(moe_forward(x, plan), y)
                outs.append(y)
        assert not outs[-1].isnan().any() and all(torch.equal(y, outs[-1]) for y in outs)


@pytest.mark.parametrize("name,ms,rotated", [("qwen3-30b-shape-k4-mcg", (2, 3, 4), ()),
                                             ("k3.5-mul1-shared-gated", (2, 4), ()), ("two-groups-k3-k5", (2, 3), ()),
                                             ("deepseek-grouped-sigmoid", (3, 4), (4,))])
def test_resident_route_rows_change_no_bit(synthetic, name, ms, rotated, monkeypatch):
    """Up to RESIDENT_INPUT_TOKENS tokens (here 4) the gate/up GEMM rotates the x of each route block's rows itself
    (MoEGemmConfig.resident_rows: each route in the row of its rank) instead of a RouteInputRotation launch, and
    records route_row / row_route: y bit-identical to the launch's (each on NaN-poisoned scratch, again on a second
    call and in a graph replay: ``layer_with``), every route's row holding it, one launch fewer per group (and none
    fewer for the caller's routes, which may repeat an expert), shared experts' group included. At the token counts
    in ``rotated`` the gate/up stages cannot take the rows (DeepSeek's 256-wide layer at 4 tokens: a K split of 4
    k-tiles, ``GemmConfig.takes_input``) and the input rotation launches as with RESIDENT_INPUT_TOKENS 1."""
    reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    k, groups = dmoe.route.routes_per_token, len(dmoe.groups)
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs, launches = [], []
        takes = m not in rotated
        for resident in (4, 1):
            y, _, plan, _ = layer_with(monkeypatch, dmoe, x, {"RESIDENT_INPUT_TOKENS": resident})
            route_row = plan.route_row[: m * k].long()
            assert torch.equal(plan.row_route[route_row].long(), torch.arange(m * k, device="cuda"))
            with monkeypatch.context() as patch:
                patch.setattr(moe_configs, "RESIDENT_INPUT_TOKENS", resident)
                made = [c.gate_up for c in plan.configs(m, False).groups]
                assert all(c.resident_rows == (m if resident > 1 and takes else 1) for c in made)
                assert all((c.input is not None) == (resident > 1 and takes) for c in made)
                launches.append((plan.launches(m), plan.launches(m, True)))
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), m
        assert launches[0] == (launches[1][0] - groups * takes, launches[1][1]), (m, launches)
        ids, weights = (t.clone() for t in routes(plan, m))
        assert rel(outs[0], reference_given(reader, moe, x, ids.long(), weights)) < MAX_REL


@pytest.mark.parametrize("name,m,rows", [("qwen3-30b-shape-k4-mcg", 512, 64), ("qwen3-30b-shape-k4-mcg", 2048, 128),
                                         ("k2-3inst-unnormalised", 1100, 128), ("two-groups-k3-k5", 700, 128),
                                         ("k3.5-mul1-shared-gated", 600, 128)])
def test_plans_without_warpgroup_mmas_match_the_reference(synthetic, name, m, rows, monkeypatch):
    """What SM120 and SM80 plan, run on this GPU with its warpgroup MMAs hidden (moe.has_wgmma): mma.sync route
    blocks at every size, 64 rows with block-ready counters, 128 rows decoding into shared memory behind the
    Intermediate launch (they planned a fused intermediate there, which the config refused, until s46). y within
    MAX_REL of the reference, the same on a second call and in graph replay."""
    reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    x = (torch.randn(m, moe.hidden, device="cuda") * 0.1).half()
    y, made, plan, _ = layer_with(monkeypatch, dmoe, x, {"has_wgmma": lambda arch: False})
    shape = plan.step(m, False).shape
    assert shape.block_rows == rows and shape.ready_counters == (rows == 64) and made
    assert all(c.mma == "sync" for c in made)
    ids, weights = (t.clone() for t in routes(plan, m))
    check_routes(moe, x, ids, weights)
    assert rel(y, reference_given(reader, moe, x, ids.long(), weights)) < MAX_REL


def launched_gemms(plan, m: int, *given: bool) -> list:
    """The GEMM configs ``plan`` launches at ``m`` tokens (gate/up and down of each group in launch order) for the
    router's routes and / or given ones: as planned, after every later change to gemm_config's (resident rows,
    weights before the wait). Call it where the plan's settings are patched: configs are planned on first use."""
    made = []
    for g in given:
        for role, c in plan.configs(m, g).kernels():
            made += [c.gate_up, c.down] if role == "gate/up + down" else [c] if role in ("gate/up", "down") else []
    return made


def layer_with(monkeypatch, dmoe, x, settings: dict):
    """(y, the GEMM configs planned, plan, the step's configs) of the layer for x with moe's ``settings`` (a fresh,
    poisoned plan), y checked to be the same on a second call (arrival counters back at zero) and in graph replay;
    the GEMM configs are ``launched_gemms(plan, M, False)``, the step's ``plan.configs(M, False)``, both planned
    under ``settings`` (the plan plans afresh at each ``configs`` call: after this one, with moe's own settings)."""
    with monkeypatch.context() as patch:
        for attribute, value in settings.items():
            patch.setattr(moe_configs, attribute, value)
        plan = plan_moe(dmoe, x.shape[0])
        made = launched_gemms(plan, x.shape[0], False)
        configs = plan.configs(x.shape[0], False)
        poison(plan)
        y = moe_forward(x, plan).clone()
        poison(plan)
        assert torch.equal(moe_forward(x, plan), y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_forward(x, plan)
        poison(plan)
        graph.replay()
        assert torch.equal(out, y)
    assert not y.isnan().any()
    return y, made, plan, configs


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (1, 3)), ("two-groups-k3-k5", (1, 2)),
                                     ("k3.5-mul1-shared-gated", (1,))])
def test_down_weights_before_its_wait_change_no_bit(synthetic, name, ms, monkeypatch):
    """Behind a gate/up GEMM that does the intermediate, the down GEMM issues its first weight stage before its
    PDL wait (moe_configs.EARLY_DOWN_WEIGHTS: gate/up's next_after_loop, down's weights_before_wait): the same MMAs in
    the same order, so y is bit-identical, eagerly (twice: the counters are back at zero) and in graph replay, with one
    expert group or two (their down GEMMs share the top-k sum's counters) and the shared expert's."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs = []
        for early in (True, False):
            y, made, plan, _ = layer_with(monkeypatch, dmoe, x, {"EARLY_DOWN_WEIGHTS": early})
            assert plan.step(m, False).shape.fused_intermediate
            downs = [c for c in made if c.planes == 1]
            assert len(downs) == len(dmoe.groups) and all(c.weights_before_wait == early for c in downs)
            assert all(c.next_after_loop == early for c in made if c.planes == 2)
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), (name, m)


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (8, 16, 64, 256)), ("two-groups-k3-k5", (16,)),
                                     ("k3.5-mul1-shared-gated", (32,))])
def test_gate_up_weights_before_its_wait_change_no_bit(synthetic, name, ms, monkeypatch):
    """From moe_configs.EARLY_GATE_UP_WEIGHTS_MIN_TOKENS the input rotation lets the mma.sync gate/up GEMM launch after
    its wait and that GEMM issues its first weight stages before its own (8-, 16- and 32-row blocks here, one expert
    group or two, the shared expert's): the same MMAs in the same order, so y is bit-identical to the GEMM that waits
    first, eagerly (twice) and in graph replay."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs = []
        for early in (True, False):
            settings = {"EARLY_GATE_UP_WEIGHTS_MIN_TOKENS": m if early else m + 1}
            y, made, _, _ = layer_with(monkeypatch, dmoe, x, settings)
            gate_ups = [c for c in made if c.planes == 2]
            assert len(gate_ups) == len(dmoe.groups) and all(c.weights_before_wait == early for c in gate_ups)
            assert all(c.mma == "sync" for c in gate_ups)
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), (name, m)


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (1, 16, 64, 256)), ("two-groups-k3-k5", (1, 16, 40)),
                                     ("k3.5-mul1-shared-gated", (1, 32))])
def test_block_ready_counters_change_no_bit(synthetic, name, ms, monkeypatch):
    """From moe_configs.READY_COUNTERS_MIN_TOKENS gate/up does the intermediate and the down GEMM waits for each route
    block's ready counter instead of gate/up's whole grid (8- to 32-row blocks here, one expert group or two, the
    shared expert's): the same MMAs and the same intermediate code, so y is bit-identical to the Intermediate launch
    and the grid-wide wait, eagerly (twice) and in graph replay, with one launch fewer a group, and every arrival
    counter is back at zero after the call. At M = 1 too, where gate/up rotates its own input and down does the top-k
    sum (its counters apart from the ready ones)."""
    from exl3tool.ops.workspace import counters

    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs, launches = [], []  # the planned step's launches (plan.launches reads the module's settings)
        for ready in (True, False):
            y, made, plan, _ = layer_with(monkeypatch, dmoe, x, {"READY_COUNTERS_MIN_TOKENS": m if ready else m + 1})
            torch.cuda.synchronize()
            assert not any(arena.any() for arena in counters._arenas.values()), (name, m)
            shape = plan.step(m, False).shape
            gate_ups, downs = [c for c in made if c.planes == 2], [c for c in made if c.planes == 1]
            assert shape.ready_counters == ready and len(downs) == len(dmoe.groups)
            assert all(c.ready_signal == ready for c in gate_ups) and all(c.ready_wait == ready for c in downs)
            if ready:
                assert shape.fused_intermediate and all(c.intermediate_splits > 0 for c in gate_ups)
            outs.append(y)
            launches.append(len(plan.step(m, False).launches))
        assert torch.equal(outs[0], outs[1]), (name, m)
        assert launches[0] == launches[1] - len(dmoe.groups) * (not shape.fused_intermediate)


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (8, 16, 64, 96, 256, 384)),
                                     ("two-groups-k3-k5", (16, 40)), ("k3.5-mul1-shared-gated", (6, 32))])
def test_gemm_pairs_change_no_bit(synthetic, name, ms, monkeypatch):
    """Where the ready counters hand route blocks from gate/up to down, both GEMMs run as one grid
    (moe_configs.PAIRED_GEMMS, kernels.moe_gemm_pair): each CTA does its plain grid's work, so y is bit-identical to
    the two launches, eagerly (twice: every counter back at zero) and in graph replay, with one launch fewer a group
    (4- and 8-warp CTAs, 8- to 64-row blocks, launch bounds or none, one expert group or two, the shared expert's)."""
    from exl3tool.ops.workspace import counters

    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs, launches = [], []
        for paired in (True, False):
            y, _, plan, configs = layer_with(monkeypatch, dmoe, x, {"PAIRED_GEMMS": paired})
            torch.cuda.synchronize()
            assert not any(arena.any() for arena in counters._arenas.values()), (name, m)
            assert configs.shape.ready_counters
            assert all((g.pair is not None) == paired for g in configs.groups), (name, m)
            outs.append(y)
            launches.append(len(configs.kernels()))
        assert torch.equal(outs[0], outs[1]), (name, m)
        assert launches[0] == launches[1] - len(dmoe.groups)


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (14, 64, 96)), ("two-groups-k3-k5", (16, 24)),
                                     ("k2-3inst-unnormalised", (16, 24))])
def test_eight_warp_small_blocks_change_no_bit(synthetic, name, ms, monkeypatch):
    """From moe_configs.EIGHT_WARP_SMALL_BLOCK_MIN_TOKENS the 8- and 16-row route blocks take 8 warps a CTA (twice the
    columns a CTA; each column's MMAs, the intermediate and the block-ready counters as with 4, at the same K
    splits): y is bit-identical, eagerly (twice) and in graph replay (K=4 mcg, K=3 3inst and K=5 mcg groups, K=2
    3inst; 8 rows at the smaller M, 16 at the larger)."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    rows = []
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs, splits = [], []
        for eight in (True, False):
            settings = {"EIGHT_WARP_SMALL_BLOCK_MIN_TOKENS": m + (not eight)}
            y, made, plan, _ = layer_with(monkeypatch, dmoe, x, settings)
            shape = plan.step(m, False).shape
            assert {c.warps for c in made} == {8 if eight else 4}, (name, m)
            outs.append(y)
            splits.append((shape.splits13, shape.splits2))
        rows.append(shape.block_rows)
        assert splits[0] == splits[1] and torch.equal(outs[0], outs[1]), (name, m)
    assert rows[0] == 8 and rows[-1] == 16, (name, rows)


@pytest.mark.parametrize("name", ["qwen3-30b-shape-k4-mcg", "two-groups-k3-k5", "k3.5-mul1-shared-gated"])
def test_eight_warp_small_blocks_at_their_own_splits(synthetic, name, monkeypatch):
    """With 4 in moe_configs.EIGHT_WARP_SMALL_BLOCK_TOKENS the 8-row route blocks of M = 4 take 8-warp CTAs, whose
    gate/up GEMM splits K three ways where 4 warps split it two: y is within MAX_REL of the fp32 reference, the same
    eagerly (twice) and in graph replay, and within fp32 rounding of the 4-warp plan's."""
    m = 4
    reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs, splits = [], []
    for tokens in ((4,), ()):
        y, made, plan, _ = layer_with(monkeypatch, dmoe, x, {"EIGHT_WARP_SMALL_BLOCK_TOKENS": tokens})
        shape = plan.step(m, False).shape
        assert shape.block_rows == 8 and {c.warps for c in made} == {8 if tokens else 4}, name
        outs.append(y)
        splits.append(shape.splits13)
    if name == "qwen3-30b-shape-k4-mcg":
        assert splits == [3, 2]
    ids, weights = (t.clone() for t in routes(plan, m))
    want = reference_given(reader, moe, x, ids.long(), weights)
    assert rel(outs[0], want) < MAX_REL and rel(outs[0], outs[1]) < 1e-3, (name, rel(outs[0], outs[1]))


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 256), ("qwen3-30b-shape-k4-mcg", 96),
                                    ("k2-3inst-unnormalised", 16)])
def test_launch_bounds_change_no_bit(synthetic, name, m, monkeypatch):
    """moe_configs.MIN_CTAS_PER_SM: launch bounds on the mma.sync route blocks' GEMMs change their registers (and may
    spill), not their arithmetic: y is bit-identical, eagerly (twice) and in graph replay (32-row gate/up at 4 CTAs
    an SM, 16-row both GEMMs at 6, 8-row K=2 3inst at 6)."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    rows = plan_moe(dmoe, m).step(m, False).shape.block_rows
    bounds = {32: {(32, 2): 4}, 16: {(16, 2): 6, (16, 1): 6}, 8: {(8, 2): 6, (8, 1): 6}}[rows]
    outs = []
    for on in (True, False):
        y, made, _, _ = layer_with(monkeypatch, dmoe, x, {"MIN_CTAS_PER_SM": bounds if on else {}})
        assert [c.min_ctas_per_sm for c in made] == [bounds.get((rows, c.planes), 0) if on else 0 for c in made]
        outs.append(y)
    assert torch.equal(outs[0], outs[1]), (name, m)


@pytest.mark.parametrize("name", ["qwen3-30b-shape-k4-mcg", "two-groups-k3-k5", "k3.5-mul1-shared-gated"])
def test_down_spread_over_the_sms_changes_no_bit(synthetic, name, monkeypatch):
    """moe_configs.DOWN_MAX_CTAS_PER_SM at M=1, where each layer's down grid fits one wave at 6 CTAs an SM
    (moe_configs.down_cap): the down GEMM's CTAs hold shared memory they never touch (MoEGemmConfig.smem_pad), so that
    at most 6 fit an SM (the 30B layer's needs a pad for it); the same code and arithmetic, so y is bit-identical,
    eagerly (twice) and in graph replay, and within MAX_REL of the reference."""
    reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    x = (torch.randn(1, dmoe.hidden, device="cuda") * 0.1).half()
    outs = []
    for cap in (6, None):
        y, made, plan, _ = layer_with(monkeypatch, dmoe, x, {"DOWN_MAX_CTAS_PER_SM": {1: cap} if cap else {}})
        downs = [c for c in made if c.planes == 1]
        assert downs and all(c.smem_pad == 0 for c in made if c.planes == 2)
        if cap:
            assert all(targets.resident_ctas(plan.arch, 32 * c.warps, c.smem_bytes, 32) <= cap for c in downs)
            assert name != "qwen3-30b-shape-k4-mcg" or all(c.smem_pad > 0 for c in downs)
        else:
            assert all(c.smem_pad == 0 for c in downs)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]), name
    ids, weights = (t.clone() for t in routes(plan, 1))
    assert rel(outs[0], reference_given(reader, moe, x, ids.long(), weights)) < MAX_REL


def setting_changes_no_bit(monkeypatch, synthetic, name, m, attribute, values, check) -> None:
    """The layer at ``m`` tokens with moe's ``attribute`` at each of ``values`` (``layer_with``: eager twice, graph
    replay), ``check(i, dmoe, made, plan, configs)`` after the i-th; y bit-identical between them and within MAX_REL
    of the reference."""
    reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = []
    for i, value in enumerate(values):
        y, made, plan, configs = layer_with(monkeypatch, dmoe, x, {attribute: value})
        check(i, dmoe, made, plan, configs)
        outs.append(y)
    assert all(torch.equal(y, outs[0]) for y in outs), (name, m)
    ids, weights = (t.clone() for t in routes(plan, m))
    assert rel(outs[0], reference_given(reader, moe, x, ids.long(), weights)) < MAX_REL


def one_token_setting_changes_no_bit(monkeypatch, synthetic, name, attribute, check) -> None:
    """``setting_changes_no_bit`` at one token with ``attribute`` True, then False: ``check(on, ...)``."""
    setting_changes_no_bit(monkeypatch, synthetic, name, 1, attribute, (True, False),
                           lambda i, *rest: check(i == 0, *rest))


@pytest.mark.parametrize("name", ["qwen3-30b-shape-k4-mcg", "two-groups-k3-k5", "k3.5-mul1-shared-gated",
                                  "gpt-oss-biased-swiglu"])
def test_early_prologue_loads_change_no_bit(synthetic, name, monkeypatch):
    """moe_configs.EARLY_PROLOGUE_LOADS: at one token the gate/up GEMM issues its prologue's loads of x and suh before
    its weight copies (MoEGemmConfig.early_prologue_loads): the same values, so y is bit-identical, eagerly (twice) and
    in graph replay, and within MAX_REL of the reference (gpt-oss's 576 pads to 640: lanes past x's width take the
    scalar path, zeros)."""
    def check(on, dmoe, made, plan, configs):
        assert [c.early_prologue_loads for c in made if c.planes == 2] == [on] * len(dmoe.groups), name

    one_token_setting_changes_no_bit(monkeypatch, synthetic, name, "EARLY_PROLOGUE_LOADS", check)


@pytest.mark.parametrize("name", ["qwen3-30b-shape-k4-mcg", "two-groups-k3-k5", "k3.5-mul1-shared-gated"])
def test_slot_blocks_at_one_token_change_no_bit(synthetic, name, monkeypatch):
    """moe_configs.SLOT_BLOCKS: at one token the route kernel gives route block j to slot j (MoERouteConfig.slot_blocks)
    instead of packing the routes by expert: each block's GEMM work is the same, so y is bit-identical, eagerly
    (twice) and in graph replay, and within MAX_REL of the reference; the blocks hold the slots' experts."""
    def check(on, dmoe, made, plan, configs):
        assert configs.route.slot_blocks == on
        ids = routes(plan, 1)[0].view(-1)
        assert torch.equal(plan.block_expert[: ids.numel()], ids if on else ids.sort().values)

    one_token_setting_changes_no_bit(monkeypatch, synthetic, name, "SLOT_BLOCKS", check)


@pytest.mark.parametrize("name,ties", [("qwen3-30b-shape-k4-mcg", False), ("qwen3-30b-shape-k4-mcg", True),
                                       ("two-groups-k3-k5", False), ("k3.5-mul1-shared-gated", False),
                                       ("k3.5-mul1-shared-gated", True), ("deepseek-grouped-sigmoid", False),
                                       ("lfm2-moe-expert-bias", False), ("gpt-oss-biased-swiglu", False),
                                       ("qwen3-next-512-experts-top-10", False)])
def test_routes_chosen_in_the_gemms_change_no_bit(synthetic, name, ties, monkeypatch):
    """moe_configs.ROUTE_IN_GEMMS: at one token the route kernel writes only the logits, every gate/up CTA chooses
    its block's expert itself (MoERouteConfig.logits_only, MoEGemmConfig.route), the first group's gate/up writes the
    routes and the down GEMMs await the block table it releases (awaits_block_expert): the routes (ids, weights,
    ranks, block_expert) and y are bit-identical to the route kernel's top-k, eagerly (twice) and in graph replay,
    and y within MAX_REL of the reference (softmax, grouped sigmoid with correction bias and scale, a logit bias,
    shared experts gated, two groups, 512 experts). ``ties``: the routed experts' router rows zeroed, so that every
    logit ties and the selection takes its exact search (experts 0 .. k-1)."""
    reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    if ties:
        dmoe.router[: moe.num_experts].zero_()
    x = (torch.randn(1, dmoe.hidden, device="cuda") * 0.1).half()
    k = dmoe.route.routes_per_token
    seen = []
    for on in (True, False):
        y, made, plan, configs = layer_with(monkeypatch, dmoe, x, {"ROUTE_IN_GEMMS": on})
        assert configs.route.logits_only == on and configs.route.slot_blocks
        assert [c.route is not None for c in made] == [on, False] * (len(made) // 2), name
        assert [c.awaits_block_expert for c in made] == [False, on] * (len(made) // 2), name
        assert [c.writes_routes for c in made] == [on] + [False] * (len(made) - 1), name
        seen.append((y, *(t.clone() for t in routes(plan, 1)), plan.rank[:k].clone(), plan.block_expert[:k].clone()))
    for a, b in zip(*seen):
        assert torch.equal(a, b), name
    y, ids, weights = seen[0][:3]
    if ties:
        assert ids[0, : moe.routing.top_k].tolist() == list(range(moe.routing.top_k))
    assert rel(y, reference_given(reader, moe, x, ids.long(), weights)) < MAX_REL


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 96), ("qwen3-30b-shape-k4-mcg", 128),
                                    ("two-groups-k3-k5", 24), ("k2-3inst-unnormalised", 24)])
def test_gate_up_x_in_fragment_order_changes_no_bit(synthetic, name, m, monkeypatch):
    """moe_configs.GATE_UP_FRAGMENT_ORDER_ROWS: 16-row route blocks with gate/up's X in fragment order (the input
    rotation writes it so, the GEMM reads a k-tile's B words by one 16-byte load) run the same MMAs as with X in rows: y
    is bit-identical, eagerly (twice) and in graph replay, and within MAX_REL of the reference."""
    def check(i, dmoe, made, plan, configs):
        assert plan.step(m, False).shape.block_rows == 16
        assert [c.x_order for c in made] == [("fragments" if i == 0 and c.planes == 2 else "rows") for c in made]

    setting_changes_no_bit(monkeypatch, synthetic, name, m, "GATE_UP_FRAGMENT_ORDER_ROWS", ((16,), ()), check)


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (1, 16, 64)), ("k3.5-mul1-shared-gated", (1, 5)),
                                     ("two-groups-k3-k5", (2,))])
def test_route_early_launch_and_contiguous_group_rows_change_no_bit(synthetic, name, ms, monkeypatch):
    """Up to moe_configs.EARLY_ROUTE_NEXT_TOKENS the route kernel lets the next one launch right after its wait, and a
    group of consecutive expert ids finds a block's row without the group_row table (moe_configs.CONTIGUOUS_GROUP_ROWS:
    the routed experts' group from 0, the shared expert's from E; interleaved groups keep the table): only the timing
    and one index load change, so y is bit-identical, eagerly and in graph replay."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    firsts = {g.first_expert for g in dmoe.groups}
    want = {"qwen3-30b-shape-k4-mcg": {0}, "k3.5-mul1-shared-gated": {0, dmoe.num_experts},  # shared: id E
            "two-groups-k3-k5": {-1}}
    assert firsts == want[name]
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs = []
        for on in (True, False):
            settings = {"EARLY_ROUTE_NEXT_TOKENS": 16 if on else 0, "CONTIGUOUS_GROUP_ROWS": on}
            y, made, _, _ = layer_with(monkeypatch, dmoe, x, settings)
            assert {c.group_first for c in made} == (firsts if on else {-1})
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), (name, m)


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (4, 8, 16)), ("two-groups-k3-k5", (16,)),
                                     ("k3.5-mul1-shared-gated", (8,))])
def test_three_stage_unsplit_route_blocks_change_no_bit(synthetic, name, ms, monkeypatch):
    """8-row mma.sync route blocks whose K is not split pipeline 3 stages (moe_configs.UNSPLIT_SYNC_PIPELINES, here 3 of
    8 for both CTA sizes on this GPU's arch), split ones 2: the same MMAs in the same order, so y is bit-identical to 2
    stages everywhere, eagerly and in graph replay."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    three = {moe_ops.target_arch(torch.device("cuda")).rstrip("af"): {(8, 4): (dict(stages=3),),
                                                                      (8, 8): (dict(stages=3),)}}
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs = []
        for on in (True, False):
            # 4 warps at M = 4 (not moe_configs.EIGHT_WARP_SMALL_BLOCK_TOKENS' 8): gate/up splits K, down runs all of it
            settings = {"UNSPLIT_SYNC_PIPELINES": three if on else {}, "EIGHT_WARP_SMALL_BLOCK_TOKENS": ()}
            y, made, plan, _ = layer_with(monkeypatch, dmoe, x, settings)
            shape = plan.step(m, False).shape
            splits = {2: shape.splits13, 1: shape.splits2}  # by planes: gate/up, down
            assert shape.block_rows == 8 and 1 in splits.values()  # some GEMM here runs its whole K
            assert [c.stages for c in made] == [3 if on and splits[c.planes] == 1 else 2 for c in made]
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), (name, m)


@pytest.mark.parametrize("m", [16, 64])
def test_sixteen_k_tile_stages_change_no_bit(synthetic, m, monkeypatch):
    """The unsplit GEMMs of 8-warp 8-row route blocks pipeline 2 stages of 16 k-tiles
    (moe_configs.UNSPLIT_SYNC_PIPELINES on sm_90; here on this GPU's arch either way) instead of 3 of 8: the same MMAs
    in the same order, so y is bit-identical, eagerly and in graph replay."""
    dmoe = DeviceMoE.from_layer(synthetic("qwen3-30b-shape-k4-mcg").moe(0, device="cuda"))
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    arch = moe_ops.target_arch(torch.device("cuda")).rstrip("af")
    outs = []
    for pipeline in (dict(stages=2, k_tiles_per_stage=16), dict(stages=3)):
        y, made, plan, _ = layer_with(monkeypatch, dmoe, x, {"UNSPLIT_SYNC_PIPELINES": {arch: {(8, 8): (pipeline,)}}})
        shape = plan.step(m, False).shape
        assert (shape.block_rows, shape.splits13, shape.splits2) == (8, 1, 1)
        assert [(c.warps, c.stages, c.k_tiles_per_stage) for c in made] == [
            (8, pipeline["stages"], pipeline.get("k_tiles_per_stage", 8))] * 2
        outs.append(y)
    assert torch.equal(outs[0], outs[1])


def assert_no_bit_changes(monkeypatch, dmoe, x, module, attribute, values, check) -> None:
    """y of the layer for x is bit-identical with ``module.attribute`` set to each of ``values`` (a fresh, poisoned
    plan each); ``check(plan, value)`` asserts that the setting took effect."""
    outs = []
    for value in values:
        with monkeypatch.context() as patch:
            patch.setattr(module, attribute, value)
            plan = plan_moe(dmoe, x.shape[0])
            check(plan, value)
            poison(plan)
            outs.append(moe_forward(x, plan).clone())
    assert not outs[0].isnan().any() and all(torch.equal(y, outs[0]) for y in outs)


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 256), ("hidden-intermediate-4096", 64)])
def test_x_column_order_changes_no_bit(synthetic, name, m, monkeypatch):
    """32- and 64-row route blocks keep X and X2 in the GEMMs' fragment order: the same MMA operands, so y is
    bit-identical to row order."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()

    def check(plan, rows):
        assert (moe_configs.x_order(plan.step(m, False).shape.block_rows) == "fragments") == bool(rows)

    assert_no_bit_changes(monkeypatch, dmoe, x, moe_configs, "FRAGMENT_ORDER_ROWS",
                          (moe_configs.FRAGMENT_ORDER_ROWS, ()), check)


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 2), ("qwen3-30b-shape-k4-mcg", 8),
                                    ("qwen3-30b-shape-k4-mcg", 128), ("qwen3-30b-shape-k4-mcg", 256),
                                    ("qwen3-30b-shape-k4-mcg", 384), ("k3.5-mul1-shared-gated", 96),
                                    ("gpt-oss-biased-swiglu", 200)])
def test_fused_tail_row_pairs_change_no_bit(synthetic, name, m, monkeypatch):
    """moe_configs.FUSED_TAIL_ROW_PAIRS: the gate/up GEMM's fused intermediate takes two rows a warp at a time (8
    values a lane, a row a half-warp; padding rows unwritten): the same butterflies in the same order, so y is
    bit-identical, eagerly (twice) and in graph replay; the resident rows of M=2 and gpt-oss's gating included."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = []
    for on in (True, False):
        y, made, _, _ = layer_with(monkeypatch, dmoe, x, {"FUSED_TAIL_ROW_PAIRS": (8, 16, 32, 64) if on else ()})
        assert [c.tail_row_pairs for c in made if c.planes == 2] == [on] * len(dmoe.groups), (name, m)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]), (name, m)


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 4), ("qwen3-30b-shape-k4-mcg", 16),
                                    ("qwen3-30b-shape-k4-mcg", 256), ("two-groups-k3-k5", 33),
                                    ("k3.5-mul1-shared-gated", 17)])
def test_count_out_behind_x_changes_no_bit(synthetic, name, m, monkeypatch):
    """moe_configs.COUNT_OUT_BEHIND_X: each down CTA counts itself out at its block's ready counter behind its first
    X copies, not inside its wait: the same MMAs, so y is bit-identical, eagerly (twice) and in graph replay
    (``layer_with``: the last reader of each block still resets its counter), and every counter is back at zero."""
    from exl3tool.ops.workspace import counters

    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = []
    for on in (True, False):
        y, made, _, _ = layer_with(monkeypatch, dmoe, x, {"COUNT_OUT_BEHIND_X": on})
        torch.cuda.synchronize()
        assert not any(arena.any() for arena in counters._arenas.values()), (name, m)
        downs = [c for c in made if c.planes == 1]
        assert downs and all(c.ready_wait and c.count_out_behind_x == on for c in downs), (name, m)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]), (name, m)


@pytest.mark.parametrize("name,m,ctas", [("qwen3-30b-shape-k4-mcg", 1, 7), ("qwen3-30b-shape-k4-mcg", 2, 7),
                                         ("qwen3-30b-shape-k4-mcg", 4, 7), ("qwen3-30b-shape-k4-mcg", 16, 16),
                                         ("hidden-intermediate-4096", 3, 7), ("k3.5-mul1-shared-gated", 2, 7)])
def test_splits_in_x_change_no_bit(synthetic, name, m, ctas, monkeypatch):
    """moe_configs.SPLITS_IN_X_TOKENS: a GEMM's K splits go in its grid's x beside the columns instead of in z (a
    block's splits dispatched together): each CTA's work is the same, so y is bit-identical, eagerly (twice: the
    counters are back at zero) and in graph replay, at split counts of the default (CTAS_PER_SM 7) and of 16 CTAs an
    SM."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = []
    for on in (True, False):
        y, made, _, configs = layer_with(monkeypatch, dmoe, x, {"SPLITS_IN_X_TOKENS": (m,) if on else (),
                                                                "CTAS_PER_SM": ctas})
        split = [c for c in made if c.mma == "sync" and (c.planes == 2 and configs.shape.splits13 > 1
                                                           or c.planes == 1 and configs.shape.splits2 > 1)]
        assert split and all(c.splits_in_x == on for c in split), (name, m)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]), (name, m)


def test_eight_warp_route_blocks_change_no_bit(synthetic, monkeypatch):
    """64-row mcg route blocks run their GEMMs with 8 warps (targets.decode_warps): each output column's sums are
    the same MMAs in the same order as with 4, so y is bit-identical."""
    from exl3tool.ops import targets

    dmoe = DeviceMoE.from_layer(synthetic("qwen3-30b-shape-k4-mcg").moe(0, device="cuda"))
    m = 1024
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()

    def check(plan, codebooks):
        block_rows = plan.step(m, False).shape.block_rows
        assert block_rows == 64
        assert moe_configs.gemm_config(4.0, "mcg", 2, block_rows).warps == (8 if codebooks else 4)

    assert_no_bit_changes(monkeypatch, dmoe, x, targets, "EIGHT_WARP_CODEBOOKS", (targets.EIGHT_WARP_CODEBOOKS, ()),
                          check)


def test_wide_route_blocks_change_no_bit(synthetic, monkeypatch):
    """sm_90a's 320-row route blocks (moe_configs.LARGEST_BLOCK_ROWS: two warpgroup MMAs a k-tile, N = 256 and 64) and
    256-row ones multiply each output column by the same k-tiles in the same order as 128-row ones, so y is
    bit-identical."""
    dmoe = DeviceMoE.from_layer(synthetic("qwen3-30b-shape-k4-mcg").moe(0, device="cuda"))
    m = 4096
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    if not targets.has_wgmma(moe_ops.target_arch(x.device)):
        pytest.skip("256-row route blocks need warpgroup MMAs (sm_90a)")

    def check(plan, largest):
        assert plan.step(m, False).shape.block_rows == largest["wgmma"]

    assert moe_configs.LARGEST_BLOCK_ROWS["wgmma"] == 320
    assert_no_bit_changes(monkeypatch, dmoe, x, moe_configs, "LARGEST_BLOCK_ROWS",
                          (moe_configs.LARGEST_BLOCK_ROWS, {"sync": 128, "wgmma": 256}, {"sync": 128, "wgmma": 128}),
                          check)


@pytest.mark.parametrize("largest", [320, 256])
def test_x_in_stages_order_changes_no_bit(synthetic, monkeypatch, largest):
    """Route blocks of 256 and more rows (320: the mbarrier loop, 256: the CTA-barrier loop) read X and X2 in the
    stages' layout (targets.WGMMA_STAGES_MIN_TOKENS: one bulk copy a stage, written so by the input rotation and
    the Intermediate): the same MMA operands as row order, so y is bit-identical."""
    from exl3tool.ops import targets

    dmoe = DeviceMoE.from_layer(synthetic("qwen3-30b-shape-k4-mcg").moe(0, device="cuda"))
    if not targets.has_wgmma(moe_ops.target_arch(torch.device("cuda"))):
        pytest.skip("the stages order is the warpgroup-MMA GEMM's (sm_90a)")
    monkeypatch.setattr(moe_configs, "LARGEST_BLOCK_ROWS", {"sync": 128, "wgmma": largest})
    m = 4096
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()

    def check(plan, min_tokens):
        rows = plan.step(m, False).shape.block_rows
        assert rows == largest and moe_configs.x_order(rows, False, True) == ("stages" if min_tokens == 256 else "rows")

    assert targets.WGMMA_STAGES_MIN_TOKENS == 256
    assert_no_bit_changes(monkeypatch, dmoe, x, targets, "WGMMA_STAGES_MIN_TOKENS", (256, 1 << 30), check)


def given_routes(m: int, k: int, e: int, edges: list[int]) -> torch.Tensor:
    """top-k ids (int32 [m, k], on the GPU) putting ``edges[i]`` routes on expert i and the rest evenly on the others:
    expert ids sorted by expert, slot j of token t at position j*m + t, so a token's slots are distinct experts."""
    rest = m * k - sum(edges)
    counts = edges + [rest // (e - len(edges)) + (i < rest % (e - len(edges))) for i in range(e - len(edges))]
    return torch.repeat_interleave(torch.arange(e), torch.tensor(counts)).view(k, m).T.contiguous().int().cuda()


def routed_and_given(monkeypatch, dmoe, x, given, weights, settings: dict):
    """((y for the router's routes, those routes' ids, y for the ``given`` ones), plan, ``launched_gemms`` for both)
    of the layer with moe's ``settings``: a fresh plan, NaN-poisoned before each call."""
    m = x.shape[0]
    with monkeypatch.context() as patch:
        for attribute, value in settings.items():
            patch.setattr(moe_configs, attribute, value)
        plan = plan_moe(dmoe, m)
        made = launched_gemms(plan, m, False, True)
        poison(plan)
        routed = moe_forward(x, plan).clone()
        ids = routes(plan, m)[0].clone()
        poison(plan)
        return (routed, ids, moe_forward(x, plan, topk_ids=given, topk_weights=weights).clone()), plan, made


def test_padding_tail_skip_changes_no_bit(synthetic, monkeypatch):
    """320-row route blocks whose row 256 is padding skip their N = 64 MMAs and those rows' partial stores
    (moe_configs.SKIP_PADDING_TAIL): y bit-identical to the blocks that compute every row, with the scratch NaN-poisoned
    (nothing reads a skipped row), for the router's routes and for given ones that put 0, 1, 255, 256, 257, 320,
    321, 640 and 641 routes on single experts (blocks just below, at and past each edge)."""
    reader = synthetic("qwen3-30b-shape-k4-mcg")
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    if not targets.has_wgmma(moe_ops.target_arch(torch.device("cuda"))):
        pytest.skip("320-row route blocks are sm_90a's")
    m, k, e = 4096, moe.routing.top_k, moe.num_experts
    given = given_routes(m, k, e, [256, 257, 320, 321, 0, 1, 255, 640, 641])
    weights = torch.rand(m, k, device="cuda")
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = {}
    for skip in (True, False):
        outs[skip], plan, made = routed_and_given(monkeypatch, dmoe, x, given, weights, {"SKIP_PADDING_TAIL": skip})
        assert plan.step(m, False).shape.block_rows == 320 and len(made) == 4
        assert all(c.skip_padding_tail == skip for c in made)
    per_expert = torch.bincount(outs[True][1].flatten().long(), minlength=e)
    assert (per_expert <= 256).any() and (per_expert > 256).any()  # the router's routes take both kinds of block
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)
    assert not outs[True][0].isnan().any()
    assert rel(outs[True][2], reference_given(reader, moe, x, given.long(), weights)) < MAX_REL


@pytest.mark.parametrize("m,rows,loops", [(256, 32, (2, 4)), (256, 32, (1, 2, 3, 4)), (96, 16, (1, 2)),
                                         (384, 64, (2, 4, 6, 8))])
def test_skipping_empty_token_groups_changes_no_bit(synthetic, m, rows, loops, monkeypatch):
    """16-, 32- and 64-row mma.sync route blocks multiply only their token groups that hold routes, rounded up to a
    count of the main loops compiled, and store only their partials (moe_configs.GROUP_LOOPS): y bit-identical to blocks
    that multiply every group, with the scratch NaN-poisoned (nothing reads a padding row), for the router's routes and
    for given ones that put 0, 1, 7, 8, 9, 15, 16, 17, 24, 25, 31, 32, 33, 40, 63, 64 and 65 routes on single experts
    (each group edge of a block, and a second and third block), and within MAX_REL of the reference."""
    reader = synthetic("qwen3-30b-shape-k4-mcg")
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    k, e = moe.routing.top_k, moe.num_experts
    given = given_routes(m, k, e, [0, 1, 7, 8, 9, 15, 16, 17, 24, 25, 31, 32, 33, 40, 63, 64, 65])
    weights = torch.rand(m, k, device="cuda")
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = {}
    for skip in (True, False):
        outs[skip], plan, made = routed_and_given(monkeypatch, dmoe, x, given, weights,
                                                  {"GROUP_LOOPS": {rows: loops} if skip else {}})
        assert plan.step(m, False).shape.block_rows == rows and len(made) == 4
        assert all(c.group_loops == (loops if skip else ()) and c.mma == "sync" for c in made)
        if skip:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe_forward(x, plan, topk_ids=given, topk_weights=weights)
            poison(plan)
            graph.replay()
            assert torch.equal(out, outs[True][2])
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)
    assert not outs[True][0].isnan().any()
    assert rel(outs[True][2], reference_given(reader, moe, x, given.long(), weights)) < MAX_REL


def test_mbarrier_stages_change_no_bit(synthetic, monkeypatch):
    """320-row route blocks hand their warpgroup-MMA stages over through mbarriers (moe_configs.MBARRIER_MIN_ROWS,
    GemmConfig.mbarriers) instead of a CTA barrier per stage: the same MMAs in the same order, so y is bit-identical
    to the CTA-barrier loop's, at 320-row blocks (M=4096) and, forced, at 64-row ones (M=1024)."""
    dmoe = DeviceMoE.from_layer(synthetic("qwen3-30b-shape-k4-mcg").moe(0, device="cuda"))
    if not targets.has_wgmma(moe_ops.target_arch(torch.device("cuda"))):
        pytest.skip("mbarrier stages are a pipeline of the warpgroup-MMA loop (sm_90a)")
    for m, rows in ((4096, 320), (1024, 64)):
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs = []
        for min_rows in (rows, 1 << 30):
            with monkeypatch.context() as patch:
                patch.setattr(moe_configs, "MBARRIER_MIN_ROWS", min_rows)
                plan = plan_moe(dmoe, m)
                poison(plan)
                outs.append(moe_forward(x, plan).clone())
                assert plan.step(m, False).shape.block_rows == rows
                wgmma = [c for c in launched_gemms(plan, m, False) if c.mma == "wgmma"]
                assert wgmma and all(c.mbarriers == (min_rows == rows) for c in wgmma)
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1]), m


@pytest.mark.parametrize("name,ms", [("qwen3-30b-shape-k4-mcg", (1, 16, 1024, 4096)),
                                     ("k3.5-mul1-shared-gated", (1, 64)), ("two-groups-k3-k5", (1, 40))])
def test_expert_indexed_rows_change_no_bit(synthetic, name, ms, monkeypatch):
    """moe_configs.EXPERT_INDEXED_ROWS: the input rotation and the Intermediate launch take a route's group row as its
    expert minus the group's first id where the group's ids are consecutive (the shared expert's group too), and the
    top-k sum (a launch, or the down GEMM's fused tail at M = 1) a slot's down_svh row as its expert where those rows
    are the ids; two groups of interleaved ids keep the tables. The launches take the setting, and y is
    bit-identical."""
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    tables = name == "two-groups-k3-k5"
    assert moe_configs.svh_rows_are_ids(dmoe.groups) != tables
    assert all((g.first_expert < 0) == tables for g in dmoe.groups)
    for m in ms:
        x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
        outs = []
        for on in (False, True):
            with monkeypatch.context() as patch:
                patch.setattr(moe_configs, "EXPERT_INDEXED_ROWS", on)
                plan = plan_moe(dmoe, m)
                kernels = [c for _, c in plan.configs(m, False).kernels()]
                firsts = [c.group_first for c in kernels if isinstance(c, (RouteInputRotationConfig, IntermediateConfig))]
                sums = [c for c in kernels if isinstance(c, TopKSumConfig)]
                sums += [c.topk_sum for c in kernels if isinstance(c, MoEGemmConfig) and c.topk_sum is not None]
                assert sums and all(c.svh_by_expert == (on and not tables) for c in sums)
                assert (m == 1 or firsts) and all((f >= 0) == (on and not tables) for f in firsts)
                poison(plan)
                outs.append(moe_forward(x, plan).clone())
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1]), (name, m)


def test_intermediate_blocks_per_warp_change_no_bit(synthetic, monkeypatch):
    """The Intermediate launch computes each 128-column block of a row the same way however many blocks a warp
    takes (moe_configs.INTERMEDIATE_MAX_BLOCKS_PER_WARP) and however many values a lane holds
    (moe_configs.INTERMEDIATE_LANE_VALUES: 8 where the blocks a warp are even), whether it knows the route block size at
    compile time (moe_configs.INTERMEDIATE_CONSTANT_BLOCK_ROWS) and whether its warps go by packed row or by route
    (moe_configs.INTERMEDIATE_BY_ROUTE), so y is bit-identical; the launched kernel is the planned config."""
    dmoe = DeviceMoE.from_layer(synthetic("qwen3-30b-shape-k4-mcg").moe(0, device="cuda"))
    m = 1024
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    blocks = dmoe.groups[0].intermediate_padded // 128
    outs = []
    for most, lane_values, constant, by_route in (
            (1, 4, True, False), (2, 4, True, False), (3, 4, True, False), (2, 8, True, False), (3, 8, True, False),
            (2, 8, False, False), (6, 8, True, False), (6, 8, True, True), (2, 8, True, True), (1, 4, False, True)):
        with monkeypatch.context() as patch:
            patch.setattr(moe_configs, "INTERMEDIATE_MAX_BLOCKS_PER_WARP", {"float32": most, "float16": most})
            patch.setattr(moe_configs, "INTERMEDIATE_LANE_VALUES", lane_values)
            patch.setattr(moe_configs, "INTERMEDIATE_CONSTANT_BLOCK_ROWS", constant)
            patch.setattr(moe_configs, "INTERMEDIATE_BY_ROUTE", {"float32": by_route, "float16": by_route})
            plan = plan_moe(dmoe, m)
            shape = plan.step(m, False).shape
            order = moe_configs.group_x_orders(plan.arch, dmoe.groups[0], shape)[1]
            wanted = IntermediateConfig(shape.splits13, order, most, lane_values if most % 2 == 0 else 4,
                                        shape.block_rows if constant else 0,
                                        moe_configs.partials_dtype(m, shape.splits13), by_route=by_route,
                                        group_first=moe_configs.indexed_first(dmoe.groups[0]))
            inter = [fn for launch, fn, _ in plan.step(m, False).launches if launch is moe_ops.K.launch_intermediate]
            assert blocks % most == 0 and inter == [moe_ops.K.compiled(wanted, plan.arch)]
            poison(plan)
            outs.append(moe_forward(x, plan).clone())
    assert not outs[0].isnan().any() and all(torch.equal(y, outs[0]) for y in outs)


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 4096), ("qwen3-30b-shape-k4-mcg", 64),
                                    ("two-groups-k3-k5", 1), ("deepseek-grouped-sigmoid", 3),
                                    ("k3.5-mul1-shared-gated", 16)])
def test_half_partials_stay_as_close_to_the_reference(synthetic, name, m, monkeypatch):
    """GEMMs of one K split store their partials in fp16 from moe_configs.HALF_PARTIALS_MIN_TOKENS tokens on: every such
    launch and the one that sums its partials take ``partials`` float16, the rest float32 (here: 320-row warpgroup
    blocks; 8-row blocks with the fused intermediate and block-ready counters; one token with the resident input
    and the fused top-k sum; 3 tokens' resident rows; gate/up unsplit beside a split down). With the scratch
    NaN-poisoned, y is within fp16 rounding of the fp32 partials' plan, as close to the fp32 reference, the same on a
    second call and in graph replay."""
    reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = {}
    for half in (True, False):
        with monkeypatch.context() as patch:  # plan.configs plans anew: under the same setting as the launches
            patch.setattr(moe_configs, "HALF_PARTIALS_MIN_TOKENS", 1 if half else m + 1)
            y, _, plan, _ = layer_with(monkeypatch, dmoe, x, {})
            c = plan.configs(m, False)
        launched = launched_partials(c)
        assert [partials for _, partials, _ in launched] == [
            "float16" if half and splits == 1 else "float32" for _, _, splits in launched]
        assert not half or any(partials == "float16" for _, partials, _ in launched)
        outs[half] = y, *(t.clone() for t in routes(plan, m))
    (half, ids, weights), (full, ids_full, _) = outs[True], outs[False]
    assert torch.equal(ids, ids_full)
    want = reference_given(reader, moe, x, ids.long(), weights)
    # 2e-3: the one-token layer's y is ~2e-4, and its fp16 partials near fp16's subnormals (measured 1.15e-3)
    assert rel(half, full) < 2e-3 and rel(half, want) < 1.2 * rel(full, want) + 1e-4, (
        rel(half, full), rel(half, want), rel(full, want))


ODD_HIDDEN = dict(arch="qwen3_moe", hidden=260, moe_intermediate=256, num_experts=8, top_k=2, bits=3,
                  codebook="mcg")  # hidden % 8 = 4: x's last 16-byte piece is read by column


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 1024), ("qwen3-30b-shape-k4-mcg", 4096),
                                    ("hidden-intermediate-4096", 300), ("two-groups-k3-k5", 1000), ("odd-hidden", 900)])
def test_input_rotation_on_tensor_cores_matches_the_shuffle_rotation(synthetic, tmp_path, name, m, monkeypatch):
    """Warpgroup-MMA route blocks rotate their input on the tensor cores (moe_configs.INPUT_ROTATION_MMA: a warp per 8
    routes, their two planes as the MMAs' rows, kernels.hadamard_mma; suh prescaled by 2^suh_shift): the launched
    kernel is that config, and y is within fp16 rounding of the shuffle rotation's and as close to the fp32
    reference, with the scratch NaN-poisoned (hidden 260: the zero columns past x)."""
    if name == "odd-hidden":
        reader = exl3tool.open_checkpoint(write_checkpoint(tmp_path, num_layers=1, vocab=256, head_bits=16,
                                                           embeddings=False, **ODD_HIDDEN))
    else:
        reader = synthetic(name)
    moe = reader.moe(0, device="cuda")
    dmoe = DeviceMoE.from_layer(moe)
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    k = dmoe.route.routes_per_token
    outs = {}
    for mma in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(moe_configs, "INPUT_ROTATION_MMA", mma)
            plan = plan_moe(dmoe, m)
            step = plan.step(m, False)
            block_rows = step.shape.block_rows
            assert step.shape.wgmma
            order = moe_configs.x_order(block_rows, False, True)
            launched = [fn for launch, fn, _ in step.launches if launch is moe_ops.K.launch_input_rotation]
            for g in dmoe.groups:
                assert 1 / 2 <= max(g.gate_suh.abs().max(), g.up_suh.abs().max()) * 2.0 ** g.suh_shift <= 1
                want = (RouteInputRotationConfig("float16", k, x_order=order, hadamard="mma", suh_shift=g.suh_shift,
                                                 group_first=moe_configs.indexed_first(g))
                        if mma else moe_configs.input_rotation_config(
                            g, True, order, *moe_configs.input_rotation_layout(m, dmoe.hidden_padded // 128, k,
                                                                               plan.sm_count), "float16", k))
                assert want.hadamard == ("mma" if mma else "shuffle")
                assert moe_ops.K.compiled(want, plan.arch) in launched
            poison(plan)
            outs[mma] = moe_forward(x, plan).clone(), routes(plan, m)[0].clone(), routes(plan, m)[1].clone()
    (mma, ids, weights), (shuffle, ids_shuffle, _) = outs[True], outs[False]
    assert torch.equal(ids, ids_shuffle) and torch.isfinite(mma).all()
    want = reference_given(reader, moe, x, ids.long(), weights)
    if name == "odd-hidden":
        reader.close()
    assert rel(mma, shuffle) < 1e-3 and rel(mma, want) < 1.2 * rel(shuffle, want) + 1e-4, (
        rel(mma, shuffle), rel(mma, want), rel(shuffle, want))


@pytest.mark.parametrize("name,m", [("qwen3-30b-shape-k4-mcg", 1024), ("k3.5-mul1-shared-gated", 64),
                                    ("two-groups-k3-k5", 40)])
def test_input_rotation_lane_values_change_no_bit(synthetic, name, m, monkeypatch):
    """The route input rotation with 8 values a lane (a warp per two 128-blocks, 16-byte x and X; with hidden 384 a
    half-warp past the last block stores nothing) and a token's slots split over 1, 2 or 4 CTAs writes the same X
    as with 4 values a lane, so y is bit-identical; the launched kernel is the planned config."""
    monkeypatch.setattr(moe_configs, "INPUT_ROTATION_MMA", False)  # the shuffle rotation's layouts
    dmoe = DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda"))
    k = dmoe.route.routes_per_token
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    outs = []
    for lane_values, slot_groups in ((4, 0), (8, 1), (8, 2), (8, 4)):
        with monkeypatch.context() as patch:
            # slot_groups 0: the 4-value rule as planned for m; else 8 values from any M
            patch.setattr(moe_configs, "WIDE_ROTATION_PAIRS_PER_SM", 10**9 if slot_groups == 0 else 0)
            patch.setattr(moe_configs, "WIDE_ROTATION", (lane_values, slot_groups))
            plan = plan_moe(dmoe, m)
            step = plan.step(m, False)
            if slot_groups:
                shape = step.shape
                wgmma = shape.wgmma
                for g in dmoe.groups:
                    cfg = RouteInputRotationConfig("float16", k, min(slot_groups, k),
                                                   moe_configs.group_x_orders(plan.arch, g, shape)[0], lane_values,
                                                   early_next=moe_configs.early_gate_up(m, False, wgmma),
                                                   group_first=moe_configs.indexed_first(g))
                    assert moe_ops.K.compiled(cfg, plan.arch) in [
                        fn for launch, fn, _ in step.launches if launch is moe_ops.K.launch_input_rotation]
            poison(plan)
            outs.append(moe_forward(x, plan).clone())
    assert not outs[0].isnan().any() and all(torch.equal(y, outs[0]) for y in outs)


def test_route_tiles_change_no_bit(synthetic, monkeypatch):
    """Any route kernel tiles give the same logits (a fixed sum per logit), so the same routes and y:
    ``moe_route.tiles_for`` picks them for speed alone. Token tiles of 8, 16 and 32 take one token block or
    several at this M."""
    dmoe = DeviceMoE.from_layer(synthetic("qwen3-30b-shape-k4-mcg").moe(0, device="cuda"))
    m = 24
    x = (torch.randn(m, dmoe.hidden, device="cuda") * 0.1).half()
    tiles = [lambda t, e=e, tt=tt: dict(expert_tile=e, token_tile=tt) for e in (16, 32) for tt in (8, 16, 32)]

    def check(plan, tiles_for):  # the plan's arrival counters: one per token block, one for the last
        assert plan.counters.numel() == -(-m // tiles_for(m)["token_tile"]) + 1

    assert_no_bit_changes(monkeypatch, dmoe, x, moe_configs, "tiles_for", tiles, check)


def test_each_token_is_independent_of_the_batch(synthetic):
    reader = synthetic("qwen3-30b-shape-k4-mcg")
    plan = plan_moe(DeviceMoE.from_layer(reader.moe(0, device="cuda")), 256)
    x = (torch.randn(256, 2048, device="cuda") * 0.1).half()
    y = moe_forward(x, plan).clone()
    other = x.clone()
    other[10:] = (torch.randn(246, 2048, device="cuda") * 0.1).half()  # the rest of the batch changes
    assert torch.equal(moe_forward(other, plan)[:10], y[:10])  # bit-identical at the same M
    ids = routes(plan, 256)[0].clone()
    for t in (0, 3):  # alone (another M: other route tiles and split-K): same routes, same output up to rounding
        assert rel(moe_forward(x[t: t + 1].contiguous(), plan), y[t: t + 1]) < 1e-3
        assert torch.equal(routes(plan, 1)[0], ids[t: t + 1])


@pytest.mark.parametrize("name", ["qwen3-30b-shape-k4-mcg", "k3.5-mul1-shared-gated"])
def test_route_packing_one_token_block_or_several(synthetic, name):
    """Around the route kernel's one-token-block path (counts in shared memory, M <= 8): every route has its own
    rank inside its expert, the experts' first rows are the prefix sums of their padded counts, each expert's blocks
    and only those hold it in the block table (the rest -1), its rows after its routes are padding (row_route -1) and
    its routes' rows hold routes to it, on poisoned scratch; the counters and counts are back at zero after each
    call, and a token's logits are the same whatever the batch."""
    plan = plan_moe(DeviceMoE.from_layer(synthetic(name).moe(0, device="cuda")), 256)
    cfg = plan.dmoe.route
    k, e_r, e_p = cfg.routes_per_token, cfg.router_rows, cfg.packed_experts
    x = (torch.randn(256, plan.dmoe.hidden, device="cuda") * 0.1).to(plan.x_dtype)
    logits = {}
    for m in (1, 8, 9, 16, 17, 32, 33, 64, 100, 256):
        poison(plan)
        moe_forward(x[:m].contiguous(), plan)
        assert not plan.counters.any() and not plan.counts.any(), m
        ids, rank = routes(plan, m)[0].long().view(-1), plan.rank[: m * k].long()
        count = torch.bincount(ids, minlength=e_p)
        for e in range(e_p):
            assert torch.equal(rank[ids == e].sort().values, torch.arange(count[e].item(), device="cuda")), (m, e)
        t = plan.step(m, False).shape.block_rows
        padded = (count + t - 1) // t * t
        if plan.configs(m, False).route.slot_blocks:  # one token: route block j is slot j's, no packing
            assert m == 1 and torch.equal(plan.block_expert[:k].long(), ids)
        else:
            first = padded.cumsum(0) - padded
            assert torch.equal(plan.expert_row.long(), first), m
            owner = torch.full_like(plan.block_expert[: plan.step(m, False).shape.blocks], -1)
            for e in range(e_p):
                rows = slice(first[e].item(), first[e].item() + count[e].item())
                owner[first[e].item() // t: (first[e] + padded[e]).item() // t] = e
                assert (ids[plan.row_route[rows].long()] == e).all(), (m, e)
                assert (plan.row_route[rows.stop: first[e].item() + padded[e].item()] == -1).all(), (m, e)
            assert torch.equal(plan.block_expert[: owner.numel()], owner), m
        logits[m] = plan.logits[: m * e_r].view(m, e_r).clone()
    for m, got in logits.items():
        assert torch.equal(got.view(torch.int32), logits[256][:m].view(torch.int32)), m
