"""`exl3tool bench` on the CPU: what it refuses before touching a GPU (exit 2, one line), and `--sass` end to end
(compiles for sm_120a: marker `compile`). The timed runs are in tests/gpu/test_bench.py."""

import importlib.util

import pytest
import torch

from helpers import run_cli

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def _one_error_line(result, *needles):
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0]


@no_gpu
def test_no_gpu_exits_2():
    _one_error_line(run_cli("bench", "--shape", "256x512", "--tokens", "1,16"), "no usable GPU")


@no_gpu
def test_no_gpu_json_error_object():
    result = run_cli("bench", "--shape", "256x512", "-f", "json")
    assert result.exit_code == 2 and result.json()["error"]["label"] == "no usable GPU"


def test_missing_peer_exits_2_before_the_gpu(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "exllamav3" else real(name, *a))
    _one_error_line(run_cli("bench", "--peer", "exllamav3"), "--peer exllamav3", "pip install exllamav3")


def test_peer_build_lock_exits_2_naming_the_lock(monkeypatch, tmp_path):
    """An interrupted ExLlamaV3 build leaves torch's lock file; the import would wait for it forever."""
    from exl3tool.bench import request

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "exllamav3" else real(name, *a))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert request.peer_build_lock("exllamav3") is None
    lock = tmp_path / "exllamav3_ext" / "lock"
    assert lock.parent.is_dir()  # where torch builds it (TORCH_EXTENSIONS_DIR/<name>)
    lock.touch()
    _one_error_line(run_cli("bench", "--peer", "exllamav3"), "--peer exllamav3", str(lock), "interrupted")
    lock.unlink()
    assert request.peer_build_lock("exllamav3") is None


def test_missing_matplotlib_exits_2(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    _one_error_line(run_cli("bench", "--plot", str(tmp_path / "p.png")), "exl3tool[plot]")


@pytest.mark.parametrize("args,needle", [
    (["--shape", "4096"], "--shape must be INxOUT"),
    (["--tokens", "1,x"], "--tokens"),
    (["--tokens", "0"], "--tokens"),
    (["--bits", "5.5"], "not an EXL3 bitrate"),
    (["--bits", "2.5"], "mul1 codebook only"),
    (["--codebook", "nf4"], "--codebook"),
    (["--mode", "fast"], "--mode"),
    (["--moe", "8:16:64:64"], "TOPK <= EXPERTS"),
    (["--peer", "marlin"], "unknown peer"),
    (["--dtype", "float32"], "--dtype"),
    (["some/model"], "needs --layer"),
    (["--layer", "0"], "--layer needs MODEL"),
    (["m", "--layer", "0", "--shape", "8x8"], "not both"),
    (["--sass", "--shape", "8x8"], "drop --shape"),
    (["--sass", "--moe", "8:2:64"], "--moe must be EXPERTS:TOPK:HIDDEN:INTERMEDIATE"),
    (["--sass", "--mode", "both"], "drop --mode"),
    (["--sass", "--arch", "hopper"], "--arch"),
    (["--sass", "--arch", "sm_75"], "--arch sm_75: no SM limits known for it; known: sm_80"),
    (["--sass", "--moe", "8:2:256:128", "--arch", "sm_75"], "--arch sm_75: no SM limits"),
    (["--format", "xml"], "--format"),
    (["--from-json", "r.json", "--shape", "8x8"], "drop --shape"),
])
def test_usage_errors_exit_2(args, needle):
    _one_error_line(run_cli("bench", *args), needle)


@pytest.mark.compile
def test_sass_on_sm120_end_to_end():
    human = run_cli("bench", "--sass", "--arch", "sm_120a", "--bits", "4", "--tokens", "1,16")
    assert human.exit_code == 0, human.stderr
    assert "SASS for sm_120a" in human.stdout and "gemm K4 mcg M8/CTA split halves" in human.stdout
    result = run_cli("bench", "--sass", "--arch", "sm_120a", "--bits", "4", "--tokens", "1,16", "-f", "json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert data["schema"] == "exl3tool.bench.sass/1" and data["arch"] == "sm_120a"
    kernels = {k["kernel"]: k for k in data["kernels"]}
    # the planner's kernels for M=1 (split halves at K=4) and M=16, the fused epilogue (M <= 8), the one-launch M=1
    # GEMM (both rotations fused; 2 stages on SM120), dequantize, the two rotations
    m8_label = "gemm K4 mcg M8/CTA split halves"
    assert set(kernels) == {m8_label, "gemm K4 mcg M16/CTA", m8_label + " fused fp16 out", "dequant K4 mcg",
                            m8_label + " one launch (2 stages)", "rotate in fp16", "rotate out fp32>fp16"}
    m8 = kernels[m8_label]
    assert m8["spill_bytes"] == 0 and m8["spill_instructions"] == 0 and 16 <= m8["registers"] <= 96
    assert m8["smem_per_cta_bytes"] <= 99 * 1024
    assert 3.0 < m8["per_weight"] <= 4.5  # the decode GEMM's issue cost on SM120 (issue 9's target)
    assert m8["per_weight"] == pytest.approx(sum(m8["per_weight_by_pipe"].values()))
    assert m8["per_weight_by_pipe"]["tensor"] == pytest.approx(2 / 8)  # two m16n8k16 per 8 weights of a lane
    assert kernels["gemm K4 mcg M16/CTA"]["per_weight_by_pipe"]["tensor"] == pytest.approx(2 / 8)  # 2 groups, 1 each
    assert m8["per_weight"] < m8["stall_cycles_per_weight"] < 12  # ptxas's fixed stalls a weight, one warp
    assert kernels["dequant K4 mcg"]["per_weight"] is None  # no MMA loop
    assert kernels["dequant K4 mcg"]["stall_cycles_per_weight"] is None


def test_from_json_renders_and_plots_without_a_gpu(tmp_path):
    import gzip
    import json

    from test_bench_report import hand_made_report

    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(hand_made_report().to_json()))
    result = run_cli("bench", "--from-json", saved, "--plot", tmp_path / "perf.png")
    assert result.exit_code == 1  # the hand-made report has a wrong row
    assert "linear 4096x14336 K4 mcg" in result.stdout and "2.00x" in result.stdout
    assert (tmp_path / "perf.png").read_bytes()[:4] == b"\x89PNG"
    assert run_cli("bench", "--from-json", saved, "-f", "json").json() == json.loads(saved.read_text())
    packed = tmp_path / "report.json.gz"  # the raw reports in docs/perf-raw are kept gzipped
    packed.write_bytes(gzip.compress(saved.read_bytes()))
    assert run_cli("bench", "--from-json", packed, "-f", "json").json() == json.loads(saved.read_text())
    from exl3tool.cli.bench import _write_json  # what --json-out FILE.json.gz writes

    _write_json(hand_made_report(), str(tmp_path / "out.json.gz"))
    assert json.loads(gzip.decompress((tmp_path / "out.json.gz").read_bytes())) == json.loads(saved.read_text())
    (tmp_path / "bad.json.gz").write_bytes(saved.read_bytes())  # not gzip
    _one_error_line(run_cli("bench", "--from-json", tmp_path / "bad.json.gz"), "bad.json.gz")
    (tmp_path / "bad.json").write_text('{"schema": "exl3tool.verify/1"}')
    _one_error_line(run_cli("bench", "--from-json", tmp_path / "bad.json"), "not an exl3tool bench JSON report")
    _one_error_line(run_cli("bench", "--from-json", tmp_path / "absent.json"), "absent.json")


@pytest.mark.compile
def test_sass_of_a_moe_block_on_sm120():
    """`--sass --moe`: the kernels the fused MoE plans on an RTX 5090 (170 SMs) at each M, every distinct config
    once, labelled with the token counts that launch it (the route's tiles differ by M): at M=1 the route and the two
    GEMMs (x rotated, intermediate and top-k sum fused), at M=600 (150 routes an expert) 128-row mma.sync blocks with
    every launch of their own."""
    result = run_cli("bench", "--sass", "--moe", "16:4:512:256", "--tokens", "1,600", "--arch", "sm_120a", "-f",
                     "json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert data["arch"] == "sm_120a" and data["sm_count"] == 170
    kernels = {k["kernel"]: k for k in data["kernels"]}
    block = "moe 16e top-4 512x256 K4 mcg"
    assert set(kernels) == {f"{block} route (M=1)", f"{block} route (M=600)", f"{block} gate/up 8-row sync (M=1)",
                            f"{block} down 8-row sync (M=1)", f"{block} input rotation (M=600)",
                            f"{block} gate/up 128-row sync (M=600)", f"{block} intermediate (M=600)",
                            f"{block} down 128-row sync (M=600)", f"{block} top-k sum (M=600)"}
    for name, k in kernels.items():
        assert k["spill_bytes"] == 0 and k["spill_instructions"] == 0, name
        if " sync " in name:  # the decode GEMMs: within SM120's shared memory, resident, decoding on the MMAs
            assert k["smem_per_cta_bytes"] <= 99 * 1024 and k["ctas_per_sm"] >= 1, name
            assert k["per_weight_by_pipe"]["tensor"] > 0 and 3.0 < k["per_weight"] < 14, name
            assert k["per_weight"] < k["stall_cycles_per_weight"] and 0 < k["issue_cap"] <= 1, name
        else:
            assert k["ctas_per_sm"] is None and k["issue_cap"] is None, name
    # one token: enough resident warps to issue every cycle by ptxas's fixed stalls
    assert kernels[f"{block} gate/up 8-row sync (M=1)"]["issue_cap"] == 1.0
    human = run_cli("bench", "--sass", "--moe", "16:4:512:256", "--tokens", "1", "--arch", "sm_120a")
    assert human.exit_code == 0 and "MoE plans for 170 SMs" in human.stdout and "CTAs/SM" in human.stdout
    assert "stalls" in human.stdout

