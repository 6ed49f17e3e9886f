"""Our CuTe DSL kernels against the fp32 torch reference, on the GPU. Outputs are NaN-poisoned before each run,
every element is checked, inputs are fresh random data each run (seed printed)."""

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from exl3tool.kernels.gemm import GemmConfig
from exl3tool.kernels.rotate import SPREAD_LOADS
from exl3tool.kernels.trellis import CODEBOOKS, SUPPORTED_BITS
from exl3tool.ops import linear as ops
from exl3tool.reference import decode_trellis, linear_forward, rotate_input, rotate_output
from exl3tool.synthetic import random_linear

pytestmark = pytest.mark.gpu
# Half rates exist for mul1 only (format doc 2); the CPU emulation tests cover the decode of the rest.
CASES = [(bits, cb) for bits in SUPPORTED_BITS for cb in CODEBOOKS if bits == int(bits) or cb == "mul1"]


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def rel_l2(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def cosine(got, ref):
    return torch.nn.functional.cosine_similarity(got.double().flatten(), ref.double().flatten(), dim=0).item()


def device_linear(seed, in_features, out_features, bits, codebook, bias=False):
    tensors = random_linear(in_features, out_features, bits, codebook, seed=seed, bias=bias)
    return tensors, ops.DeviceLinear.from_tensors(tensors, "cuda")


def random_case(seed, tokens):
    """A random linear (any bitrate and codebook, odd sizes, bias or not) and fresh activations of either dtype:
    (tensors, lin, x, description)."""
    rng = random.Random(seed)
    bits, codebook = rng.choice(CASES)
    in_f, out_f = rng.randrange(64, 1200), rng.randrange(64, 1200)
    dtype = rng.choice([torch.float16, torch.bfloat16])
    tensors, lin = device_linear(seed, in_f, out_f, bits, codebook, bias=rng.random() < 0.5)
    x = torch.randn(tokens, in_f, dtype=dtype, device="cuda")
    return tensors, lin, x, f"seed={seed} K={bits} {codebook} {in_f}x{out_f} M={tokens} {dtype}"


@pytest.mark.parametrize("bits,codebook", CASES)
def test_dequantize_is_bit_exact(seed, bits, codebook):
    tensors, lin = device_linear(seed, 384, 256 + 128 * (seed % 3), bits, codebook)
    out = poisoned((lin.info.out_padded, lin.info.in_padded), torch.float16)
    got = ops.dequantize_t(lin, out=out).t().cpu()
    ref = decode_trellis(tensors.trellis, codebook, bits)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"seed={seed}"


@pytest.mark.parametrize("token_groups,warps", [(1, 4), (2, 4), (4, 8), (8, 4), (8, 8)])
@pytest.mark.parametrize("bits,codebook", CASES)
def test_one_hot_activations_reproduce_decoded_weights(seed, bits, codebook, token_groups, warps):
    """x_rot = I makes the GEMM output the decoded W_hat itself: every weight, bit for bit, in place."""
    tensors, lin = device_linear(seed, 256, 384, bits, codebook)
    xr = torch.eye(lin.info.in_padded, dtype=torch.float16, device="cuda")
    plan = ops.plan_gemm(xr.shape[0], lin, ops.sm_count("cuda"), token_groups, warps=warps, mma="sync")
    assert plan.config.warps == warps
    out = poisoned((plan.splits, xr.shape[0], lin.info.out_padded), torch.float32)
    partials = ops.trellis_gemm(xr, lin, plan, out=out)
    ref = decode_trellis(tensors.trellis, codebook, bits).float()
    got = partials.sum(0).cpu()
    if plan.config.split_halves:  # the two halves summed in fp32 (exact): fp16 rounding gives W_hat
        got = got.half().float()
    assert torch.equal(got, ref), f"seed={seed} plan={plan}"


@pytest.mark.parametrize("layout", [dict(token_groups=16, warps=8, warp_cols=4, k_tiles_per_stage=4),
                                    dict(token_groups=8, warps=8, warp_cols=2, k_tiles_per_stage=4, stages=3)])
@pytest.mark.parametrize("bits,codebook", [(1.0, "mcg"), (4.0, "3inst"), (3.5, "mul1"), (8.0, "mcg")])
def test_shared_decode_reproduces_decoded_weights(seed, bits, codebook, layout):
    """The same one-hot check through shared decode: tiles decoded by one warp, multiplied by others."""
    tensors, lin = device_linear(seed, 256, 384, bits, codebook)
    xr = torch.eye(lin.info.in_padded, dtype=torch.float16, device="cuda")
    plan = ops.plan_gemm(xr.shape[0], lin, ops.sm_count("cuda"), mma="sync", **layout)
    out = poisoned((plan.splits, xr.shape[0], lin.info.out_padded), torch.float32)
    got = ops.trellis_gemm(xr, lin, plan, out=out).sum(0).cpu()
    assert torch.equal(got, decode_trellis(tensors.trellis, codebook, bits).float()), f"seed={seed} plan={plan}"


@pytest.mark.parametrize("token_groups,warps,k_tiles_per_stage", [(1, 4, 8), (4, 8, 4), (8, 4, 8), (16, 8, 4),
                                                                   (32, 4, 4), (32, 8, 4)])
@pytest.mark.parametrize("bits,codebook", [(1.0, "mcg"), (2.0, "3inst"), (3.5, "mul1"), (4.0, "mcg"), (8.0, "mul1")])
@pytest.mark.parametrize("rows", [256, 200])
def test_warpgroup_mma_reproduces_decoded_weights(seed, bits, codebook, token_groups, warps, k_tiles_per_stage, rows):
    """The one-hot check through the warpgroup-MMA GEMM (sm_90a): decoded A fragments in registers times X read
    from the swizzled shared stages; 200 rows leave the last token block partly empty (zero-filled)."""
    if not ops.has_wgmma(ops.target_arch("cuda")):
        pytest.skip("warpgroup MMA needs sm_90a")
    tensors, lin = device_linear(seed, 256, 384, bits, codebook)
    xr = torch.eye(lin.info.in_padded, dtype=torch.float16, device="cuda")[:rows]
    plan = ops.plan_gemm(rows, lin, ops.sm_count("cuda"), token_groups, mma="wgmma", warps=warps,
                         k_tiles_per_stage=k_tiles_per_stage)
    assert (plan.config.mma, plan.config.token_groups, plan.config.warps) == ("wgmma", token_groups, warps)
    out = poisoned((plan.splits, rows, lin.info.out_padded), torch.float32)
    got = ops.trellis_gemm(xr, lin, plan, out=out).sum(0).cpu()
    assert torch.equal(got, decode_trellis(tensors.trellis, codebook, bits).float()[:rows]), f"seed={seed} {plan}"


@pytest.mark.parametrize("token_groups,k_tiles_per_stage,rows", [(8, 4, 40), (8, 8, 64), (32, 4, 200), (32, 8, 256),
                                                                   (40, 4, 300), (40, 4, 384)])
@pytest.mark.parametrize("bits,codebook", [(2.0, "3inst"), (4.0, "mcg")])
def test_warpgroup_mma_with_x_in_stages_order_reproduces_decoded_weights(seed, bits, codebook, token_groups,
                                                                          k_tiles_per_stage, rows):
    """X in the stages' layout (trellis.x_stages_index, linear.x_rows: whole token blocks): thread 0 brings each
    stage with one bulk copy per 64 columns (two with 8 k-tiles a stage) onto the stage's mbarrier; the one-hot
    check through 64-, 256- and 320-token CTAs, partly empty and several token blocks."""
    if not ops.has_wgmma(ops.target_arch("cuda")):
        pytest.skip("warpgroup MMA needs sm_90a")
    tensors, lin = device_linear(seed, 384, 384, bits, codebook)
    xr = torch.eye(lin.info.in_padded, dtype=torch.float16, device="cuda")[:rows]
    plan = ops.plan_gemm(rows, lin, ops.sm_count("cuda"), token_groups, mma="wgmma", warps=8,
                         k_tiles_per_stage=k_tiles_per_stage, x_order="stages")
    assert (plan.config.x_order, plan.config.tokens_per_cta) == ("stages", 8 * token_groups)
    out = poisoned((plan.splits, rows, lin.info.out_padded), torch.float32)
    got = ops.trellis_gemm(xr, lin, plan, out=out).sum(0).cpu()
    assert torch.equal(got, decode_trellis(tensors.trellis, codebook, bits).float()[:rows]), f"seed={seed} {plan}"


def eager_and_replayed(x, lin, out_features):
    """The planned linear on fp16 x into a NaN-poisoned y, then captured in a CUDA graph and replayed into poisoned
    memory: the replay must give y's bits. Returns y."""
    y = poisoned((x.shape[0], out_features), torch.float16)
    ops.linear_forward(x, lin, out=y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = ops.linear_forward(x, lin)
    replayed.fill_(float("nan"))
    graph.replay()
    assert torch.equal(replayed, y)
    return y


@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 4096)])
@pytest.mark.parametrize("tokens", [200, 256])
def test_linear_with_x_in_stages_order_is_bit_identical_to_row_order(seed, shape, tokens, monkeypatch):
    """The planner's wide-M wgmma linears (one K split with the fused rotation, and split-K): X in the stages' layout
    (targets.WGMMA_STAGES_MIN_TOKENS) feeds the same MMAs as row order, so y is bit-identical; replayed too."""
    if not ops.has_wgmma(ops.target_arch("cuda")):
        pytest.skip("warpgroup MMA needs sm_90a")
    _, lin = device_linear(seed, *shape, 4.0, "mcg")
    x = torch.randn(tokens, shape[0], dtype=torch.float16, device="cuda")
    outs = []
    for min_tokens in (256, 1 << 30):
        monkeypatch.setattr(ops.targets, "WGMMA_STAGES_MIN_TOKENS", min_tokens)
        lin.plans.clear()
        plan = ops.plan_for(lin, x)
        assert plan.gemm_plan.config.x_order == ("stages" if min_tokens == 256 else "rows")
        outs.append((eager_and_replayed(x, lin, shape[1]), plan))  # the plan keeps its scratch alive
    assert not outs[0][0].isnan().any() and torch.equal(outs[0][0], outs[1][0])


@pytest.mark.parametrize("shape", [(4096, 2048), (2048, 4096)])
@pytest.mark.parametrize("tokens", [40, 64])
@pytest.mark.parametrize("bits,codebook", [(2.0, "3inst"), (4.0, "mcg"), (6.0, "mul1")])
def test_rolled_small_wgmma_layout_changes_no_bit(seed, shape, tokens, bits, codebook, monkeypatch):
    """Up to 64 tokens the wgmma GEMM runs 4 rolled stages of 8 k-tiles (targets.DENSE_WGMMA_SMALL_LAYOUT, each stage
    waiting for every MMA before it decodes into their A registers): the same MMAs in the same order as 8 unrolled
    stages of 4 at the same K splits (the planner's condition), so y is bit-identical, outputs poisoned first;
    replayed too."""
    if not ops.has_wgmma(ops.target_arch("cuda")):
        pytest.skip("warpgroup MMA needs sm_90a")
    _, lin = device_linear(seed, *shape, bits, codebook)
    x = torch.randn(tokens, shape[0], dtype=torch.float16, device="cuda")
    outs = []
    for small in (ops.targets.DENSE_WGMMA_SMALL_LAYOUT, {}):
        monkeypatch.setattr(ops.targets, "DENSE_WGMMA_SMALL_LAYOUT", small)
        lin.plans.clear()
        plan = ops.plan_for(lin, x)
        assert plan.gemm_plan.config.rolled == bool(small)
        outs.append((eager_and_replayed(x, lin, shape[1]), plan))  # the plan keeps its scratch alive
    assert outs[0][1].gemm_plan.splits == outs[1][1].gemm_plan.splits
    assert not outs[0][0].isnan().any() and torch.equal(outs[0][0], outs[1][0])


@pytest.mark.parametrize("rows", [320, 300, 384])
@pytest.mark.parametrize("bits,codebook", [(2.0, "3inst"), (4.0, "mcg"), (3.5, "mul1")])
def test_320_token_warpgroup_mma_reproduces_decoded_weights(seed, bits, codebook, rows):
    """The one-hot check through 320-token CTAs (sm_90a): each k-tile takes two warpgroup MMAs, N = 256 from token
    row 0 and N = 64 from row 256 (mainloop.wgmma_token_chunks); 300 rows leave the second partly empty, 384 rows
    make a second token block."""
    if not ops.has_wgmma(ops.target_arch("cuda")):
        pytest.skip("warpgroup MMA needs sm_90a")
    tensors, lin = device_linear(seed, 384, 384, bits, codebook)
    xr = torch.eye(lin.info.in_padded, dtype=torch.float16, device="cuda")[:rows]
    plan = ops.plan_gemm(rows, lin, ops.sm_count("cuda"), 40, mma="wgmma", warps=8, k_tiles_per_stage=4)
    assert (plan.config.mma, plan.config.tokens_per_cta) == ("wgmma", 320)
    out = poisoned((plan.splits, rows, lin.info.out_padded), torch.float32)
    got = ops.trellis_gemm(xr, lin, plan, out=out).sum(0).cpu()
    assert torch.equal(got, decode_trellis(tensors.trellis, codebook, bits).float()[:rows]), f"seed={seed} {plan}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width,pitch", [(300, 300), (300, 306), (302, 302)])
def test_input_rotation_matches_reference(seed, dtype, width, pitch):
    """Rows whose four columns a lane loads are whole and 8-byte aligned take one vector load, others (a pitch of
    306 leaves odd rows misaligned; a width of 302 leaves the last lane two columns) one load per column."""
    tensors, lin = device_linear(seed, width, 256, 4.0, "mcg")
    x = torch.randn(37, pitch, dtype=dtype, device="cuda")[:, :width]
    got = ops.rotate_input(x, lin, out=poisoned((37, lin.info.in_padded), torch.float16)).float()
    x_pad = torch.nn.functional.pad(x.float(), (0, lin.info.in_padded - width))
    ref = rotate_input(x_pad, lin.suh)
    # fp32 math, one rounding to fp16 at the end.
    assert torch.allclose(got, ref.half().float(), rtol=2e-3, atol=1e-4), f"seed={seed}"


@pytest.mark.parametrize("x_order", ["fragments", "doubled", "stages"])
def test_input_rotation_writes_the_gemms_column_order(seed, x_order):
    """The rotation in fragment, doubled or stages order = the row-order rotation rearranged, bit for bit (stages:
    into whole 64-token blocks, rows past M left as they were)."""
    tensors, lin = device_linear(seed, 300, 256, 4.0, "mcg")
    x = torch.randn(19, 300, dtype=torch.float16, device="cuda")
    if x_order == "stages":
        cfg = GemmConfig(4.0, "mcg", token_groups=8, x_order=x_order, mma="wgmma", warps=8, k_tiles_per_stage=4,
                         stages=6)
    else:
        cfg = GemmConfig(4.0, "mcg", x_order=x_order, split_halves=x_order == "doubled")
    rows = ops.rotate_input(x, lin)
    want = ops.arrange_x(rows, cfg)
    out = poisoned((want.shape[0], (1 + (x_order == "doubled")) * lin.info.in_padded), torch.float16)
    got = ops.rotate_input(x, lin, out=out, x_order=x_order, rows=want.shape[0])
    if x_order == "stages":  # the padding rows' places: untouched (poison), zero in arrange_x
        written = torch.from_numpy(ops.x_stages_index(np.arange(19)[:, None], np.arange(lin.info.in_padded)[None, :],
                                                      want.shape[0]).reshape(-1)).cuda()
        got, want = got.reshape(-1)[written], want.reshape(-1)[written]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"seed={seed}"


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width,pitch", [(300, 300), (300, 302), (302, 302)])
def test_output_rotation_matches_reference(seed, out_dtype, bias, width, pitch):
    """One vector store per lane where its four columns are whole and aligned, else one per column (a pitch of
    302 misaligns odd rows; a width of 302 leaves the last lane two columns); nothing past the width."""
    tensors, lin = device_linear(seed, 256, width, 4.0, "mul1", bias=bias)
    partials = torch.randn(3, 21, lin.info.out_padded, device="cuda")
    out = poisoned((21, pitch), out_dtype)
    got = ops.rotate_output(partials, lin, out_dtype, out=out[:, :width]).float()
    ref = rotate_output(partials.sum(0), lin.svh, lin.bias)[:, :width]
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
    assert torch.allclose(got, ref, rtol=tol, atol=tol), f"seed={seed}"
    assert out[:, width:].isnan().all()


@pytest.mark.parametrize("width,pitch", [(300, 306), (1100, 1100), (1024, 1024)])
def test_rotations_give_the_same_bits_with_four_or_eight_values_a_lane(seed, width, pitch):
    """Eight values a lane (16-byte accesses, a warp per two blocks; 300 and 1100 columns pad to an odd block
    count) run the butterfly stages in the same order as four: X and y bit-identical, for every X order, dtype,
    partial dtype and bias; nothing written past the width."""
    from exl3tool.kernels.rotate import InputRotationConfig, OutputRotationConfig
    from exl3tool.ops import launch

    arch = ops.target_arch("cuda")
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    rng = random.Random(seed)
    dtype = rng.choice([torch.float16, torch.bfloat16])
    tensors, lin = device_linear(seed, width, width, 4.0, "mcg", bias=True)
    x = torch.randn(23, pitch, dtype=dtype, device="cuda")[:, :width]
    for x_order in ("rows", "fragments", "doubled"):
        got = []
        for n in (4, 8):
            cfg = InputRotationConfig(name[dtype], x_order, lane_values=n)
            xr = poisoned((23, (1 + (x_order == "doubled")) * lin.info.in_padded), torch.float16)
            launch.input_rotation_launcher(launch.compiled(cfg, arch), lin.suh, xr)(x)
            assert not xr.isnan().any(), f"seed={seed} n={n} {x_order}"
            got.append(xr.view(torch.int16))
        assert torch.equal(got[0], got[1]), f"seed={seed} {x_order}"
    for partial_dtype in (torch.float32, torch.float16):
        partials = torch.randn(3, 23, lin.info.out_padded, device="cuda").to(partial_dtype)
        for out_dtype in (torch.float16, torch.bfloat16, torch.float32):
            got = []
            for n in (4, 8):
                cfg = OutputRotationConfig(name[out_dtype], name[partial_dtype], True, lane_values=n)
                y = poisoned((23, pitch), out_dtype)
                launch.output_rotation_launcher(launch.compiled(cfg, arch), partials, lin.svh, lin.bias)(y[:, :width])
                assert y[:, width:].isnan().all(), f"seed={seed} n={n}"
                got.append(y[:, :width].contiguous().view(torch.int16 if out_dtype != torch.float32 else torch.int32))
            assert torch.equal(got[0], got[1]), f"seed={seed} {partial_dtype} {out_dtype}"


@pytest.mark.parametrize("tokens", [1, 2, 7, 9, 16, 17, 33, 128, 1000])
@pytest.mark.parametrize("path", ["gemm", "gemm-unfused", "dequant"])
def test_linear_matches_reference_on_random_shapes(seed, tokens, path):
    tensors, lin, x, what = random_case(seed, tokens)
    got = ops.linear_forward(x, lin, out_dtype=torch.float32, path=path,
                             out=poisoned((tokens, lin.info.out_features), torch.float32))
    ref = linear_forward(x, tensors)
    assert got.shape == ref.shape and torch.isfinite(got).all(), what
    assert rel_l2(got, ref) <= 2e-3, what
    assert cosine(got, ref) >= 0.99999, what


@pytest.mark.parametrize("tokens,whole_k", [(40, False), (100, True), (256, True)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_warpgroup_gemm_fused_epilogue_equals_separate_rotation(seed, tokens, whole_k, out_dtype):
    """sm_90a, output rotation fused: with one K split (``whole_k``, 100 and 256 tokens) each CTA rotates its whole
    tiles from shared memory, with two (40 tokens, two CTAs an SM) the last CTA of a block sums the partials. Both
    give the bits of the same GEMM writing partials + the rotation kernel, on every launch into NaN-poisoned
    outputs, and the reference within tolerance (an output width that ends inside a lane's four columns)."""
    if not ops.has_wgmma(ops.target_arch("cuda")):
        pytest.skip("the warpgroup-MMA GEMM needs sm_90a")
    tensors, lin = device_linear(seed, 2048, 14334, 4.0, "mcg", bias=True)
    x = torch.randn(tokens, 2048, dtype=torch.float16, device="cuda")
    gp = ops.plan_for(lin, x, out_dtype, "gemm").gemm_plan
    assert gp.config.mma == "wgmma" and gp.config.output is not None
    assert gp.config.whole_k == whole_k == (gp.splits == 1)
    unfused = ops.GemmPlan(replace(gp.config, output=None, has_bias=False, whole_k=False), gp.splits,
                           gp.k_tiles_per_split)
    separate = ops.rotate_output(ops.trellis_gemm(ops.rotate_input(x, lin), lin, unfused), lin, out_dtype)
    for _ in range(3):
        fused = ops.linear_forward(x, lin, out_dtype, path="gemm", out=poisoned((tokens, 14334), out_dtype))
        assert torch.equal(fused, separate), f"seed={seed}"
    assert rel_l2(fused.float(), linear_forward(x, tensors)) <= 2e-3, f"seed={seed}"


@pytest.mark.parametrize("tokens", [1, 5, 8])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_fused_epilogue_equals_separate_rotation_on_every_launch(seed, tokens, out_dtype):
    """The fused output rotation sums splits in the same order as the rotation kernel: identical bits. Three
    launches into NaN-poisoned outputs also prove the arrival counters reset themselves."""
    tensors, lin = device_linear(seed, 2048, 384, 4.0, "mcg", bias=True)  # 2048 rows: several K splits
    x = torch.randn(tokens, 2048, dtype=torch.float16, device="cuda")
    separate = ops.linear_forward(x, lin, out_dtype, path="gemm-unfused")
    for _ in range(3):
        fused = ops.linear_forward(x, lin, out_dtype, path="gemm", out=poisoned((tokens, 384), out_dtype))
        assert torch.equal(fused, separate), f"seed={seed}"


@pytest.mark.parametrize("bits,codebook", [(4.0, "mcg"), (3.5, "mul1"), (2.0, "3inst")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_rotating_its_input_equals_the_rotation_kernel(seed, bits, codebook, dtype):
    """M = 1: the GEMM whose prologue rotates x (one launch for the whole linear) gives the bits of the rotation
    kernel + the same GEMM, for a width that is not a multiple of 128 (zero padding) and x a row inside a wider,
    oddly offset tensor; twice into NaN-poisoned outputs (the arrival counters reset themselves)."""
    in_f = 1000 + 8 * (seed % 7)
    tensors, lin = device_linear(seed, in_f, 384, bits, codebook, bias=True)
    x = torch.randn(3, in_f + 101, dtype=dtype, device="cuda")[1:2, 37 : 37 + in_f]
    separate = ops.linear_forward(x, lin, torch.float32, path="gemm-unfused")
    assert ops.plan_for(lin, x, torch.float32, "gemm").launches == 1
    assert ops.plan_for(lin, x, torch.float32, "gemm").gemm_plan.splits > 1  # several CTAs rotate their range
    for _ in range(2):
        fused = ops.linear_forward(x, lin, torch.float32, path="gemm", out=poisoned((1, 384), torch.float32))
        assert torch.equal(fused, separate), f"seed={seed}"


@pytest.mark.parametrize("in_features", [7168, 14336])
def test_one_token_epilogue_sums_many_splits_as_the_rotation_kernel(seed, in_features):
    """M = 1 with more K splits than a lane loads at once (``rotate.SPREAD_LOADS``; both widths leave a part-filled
    last batch): every warp of the last CTA sums its columns in split order (``spread_sum``), so y has the rotation
    kernel's bits; twice into NaN-poisoned outputs, and once in graph replay."""
    tensors, lin = device_linear(seed, in_features, 256, 4.0, "mcg", bias=True)
    x = torch.randn(1, in_features, dtype=torch.float16, device="cuda")
    plan = ops.plan_for(lin, x, torch.float16, "gemm")
    assert plan.launches == 1 and plan.gemm_plan.splits > SPREAD_LOADS and plan.gemm_plan.config.spread_sum
    separate = ops.linear_forward(x, lin, torch.float16, path="gemm-unfused")
    for _ in range(2):
        fused = ops.linear_forward(x, lin, torch.float16, path="gemm", out=poisoned((1, 256), torch.float16))
        assert torch.equal(fused, separate), f"seed={seed}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = ops.linear_forward(x, lin, torch.float16, path="gemm")
    static_y.fill_(float("nan"))
    graph.replay()
    assert torch.equal(static_y, separate), f"seed={seed}"
    assert rel_l2(fused.float(), linear_forward(x, tensors)) <= 2e-3, f"seed={seed}"


@pytest.mark.parametrize("tokens", [1, 64])
def test_cuda_graph_replay_is_bit_identical(seed, tokens):
    tensors, lin = device_linear(seed, 512, 640, 3.0, "3inst", bias=True)
    x = torch.randn(tokens, 512, dtype=torch.float16, device="cuda")
    eager = ops.linear_forward(x, lin)  # compiles and warms up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = ops.linear_forward(x, lin)
    static_y.fill_(float("nan"))
    graph.replay()
    first = static_y.clone()
    graph.replay()
    assert torch.equal(first, eager) and torch.equal(static_y, eager), f"seed={seed}"


@pytest.mark.parametrize("path", ["gemm", "gemm-unfused", "dequant", "fold"])
@pytest.mark.parametrize("tokens", [1, 9, 130])
def test_planned_call_allocates_nothing_syncs_nothing_and_replays_bit_identical(seed, path, tokens):
    """After the first call made the plan, a call into ``out`` only launches: no allocation, no host sync (so
    it captures), and its graph replays equal eager bit for bit, also after the input changes in place."""
    tensors, lin = device_linear(seed, 640, 384, 4.0, "mcg", bias=True)
    x = torch.randn(tokens, 640, dtype=torch.float16, device="cuda")
    eager = ops.linear_forward(x, lin, path=path)  # makes the plan: compiles, takes scratch
    y = poisoned((tokens, 384), torch.float16)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.linear_forward(x, lin, path=path, out=y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_allocated() == allocated
    assert torch.equal(y, eager), f"seed={seed}"

    graph = torch.cuda.CUDAGraph()
    y.fill_(float("nan"))
    with torch.cuda.graph(graph):
        ops.linear_forward(x, lin, path=path, out=y)
    graph.replay()
    assert torch.equal(y, eager), f"seed={seed}"
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    assert torch.equal(y, ops.linear_forward(x, lin, path=path)), f"seed={seed}"


@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_chained_linears_queued_or_replayed_equal_each_run_alone(seed, tokens):
    """Kernels may start while the kernel before them finishes (programmatic dependent launch): each linear of a
    chain reads the previous one's output and reuses the scratch it just used (every path, random widths).
    Queued without a sync, and replayed as one graph, every output equals that linear run alone, synchronized."""
    rng = random.Random(seed)
    widths = [rng.randrange(64, 1200) for _ in range(5)]
    lins = [device_linear(seed + i, widths[i], widths[i + 1], rng.choice([2.0, 4.0]), rng.choice(CODEBOOKS))[1]
            for i in range(4)]
    paths = rng.sample(ops.PATHS, 4)
    x = torch.randn(tokens, widths[0], dtype=torch.float16, device="cuda")
    alone, h = [], x
    for lin, path in zip(lins, paths):
        h = ops.linear_forward(h, lin, path=path)
        torch.cuda.synchronize()
        alone.append(h)
    outs = [poisoned(a.shape, torch.float16) for a in alone]

    def chain():
        h = x
        for lin, path, out in zip(lins, paths, outs):
            h = ops.linear_forward(h, lin, path=path, out=out)

    chain()
    torch.cuda.synchronize()
    assert all(torch.equal(o, a) for o, a in zip(outs, alone)), f"seed={seed} paths={paths}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    graph.replay()
    assert all(torch.equal(o, a) for o, a in zip(outs, alone)), f"seed={seed} paths={paths}"


def test_plans_are_made_once_per_shape_dtype_and_path(seed):
    tensors, lin = device_linear(seed, 256, 256, 2.0, "mul1")
    x1 = torch.randn(1, 256, dtype=torch.float16, device="cuda")
    x5 = torch.randn(5, 256, dtype=torch.float16, device="cuda")
    plan = ops.plan_for(lin, x1)
    assert ops.plan_for(lin, x1.clone()) is plan
    assert ops.plan_for(lin, x5) is not plan and ops.plan_for(lin, x1, torch.float32) is not plan
    assert ops.plan_for(lin, x1, path="dequant").path == "dequant" and plan.path == ops.choose_path(1, lin)


@pytest.mark.parametrize("policy", ["input", "all"])
@pytest.mark.parametrize("tokens", [40, 64, 200])
def test_early_starts_change_no_bit_in_a_chain(seed, tokens, policy, monkeypatch):
    """Warpgroup-MMA linears whose kernels let the next one launch right after their own wait (linear.EARLY_NEXT).
    Four linears in a chain (each y is the next x, so a kernel that read x before the one before it finished would
    show), graph-replayed with every output NaN-poisoned first: bit-identical to the chain run eagerly without
    early starts."""
    if not ops.has_wgmma(ops.target_arch("cuda")):
        pytest.skip("warpgroup MMA needs sm_90a")
    lins = [device_linear(seed + i, 1024, 1024, 4.0, "mcg")[1] for i in range(4)]
    x = torch.randn(tokens, 1024, dtype=torch.float16, device="cuda")

    def chain(outs):
        y = x
        for lin, out in zip(lins, outs):
            y = ops.linear_forward(y, lin, out=out)
        return y

    monkeypatch.setattr(ops, "EARLY_NEXT", "none")
    for lin in lins:
        lin.plans.clear()
    want = chain([poisoned((tokens, 1024), torch.float16) for _ in lins]).clone()
    plans_off = [dict(lin.plans) for lin in lins]  # keep their scratch alive

    monkeypatch.setattr(ops, "EARLY_NEXT", policy)
    for lin in lins:
        lin.plans.clear()
    outs = [poisoned((tokens, 1024), torch.float16) for _ in lins]
    assert torch.equal(chain(outs), want)  # eager (compiles)
    plan = ops.plan_for(lins[0], x)
    assert plan.gemm_plan.config.mma == "wgmma" and plan.gemm_plan.config.early_next == (policy == "all")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(outs)
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(y, want)
    assert not want.isnan().any() and plans_off
