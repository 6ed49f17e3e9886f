"""`exl3tool prepare` on the command line: output modes, refusals with inspect's exit codes, bad input without
tracebacks, the progress bar, and memory that stays bounded while a large checkpoint streams through."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from rich.console import Console

from exl3tool.cli.render.prepare import ProgressBar
from exl3tool.prepared import is_prepared
from exl3tool.prepared.writer import PrepareProgress
from exl3tool.synthetic import ModelSpec, edit_checkpoint, write_checkpoint

from helpers import EXAMPLE, ROOT, model_dir, run_cli

Q = "model.layers.0.self_attn.q_proj"


def test_human_output(tmp_path):
    result = run_cli("prepare", EXAMPLE, tmp_path / "out")
    assert result.exit_code == 0 and result.stderr == ""
    for text in ("prepared ", "layers  2 (0..1) + head and non-layer tensors", "3 shard(s)", "layout version 1",
                 "wrote 3 of 3 unit(s)", "MB/s"):
        assert text in result.stdout, text
    assert is_prepared(tmp_path / "out")


def test_json_output(tmp_path):
    report = run_cli("prepare", model_dir("llama_mcg"), tmp_path / "out", "--format", "json").json()
    assert report["schema"] == "exl3tool.prepare/1"
    assert set(report) == {"schema", "source", "path", "out", "layout_version", "fingerprint", "layers",
                           "includes_globals", "units", "units_written", "units_skipped", "files", "bytes",
                           "bytes_written", "seconds", "write_seconds", "up_to_date", "resumed", "throughput_mb_s"}
    assert (report["layers"], report["units"], report["files"], report["up_to_date"]) == ([0], 2, 2, False)
    assert report["bytes"] == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    assert report["throughput_mb_s"] > 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert report["fingerprint"] == manifest["source"]["fingerprint"]


def test_quiet(tmp_path):
    result = run_cli("prepare", EXAMPLE, tmp_path / "out", "--quiet", "--layers", "1")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["layer-00001-p0.safetensors", "manifest.json"]


@pytest.fixture
def unsound(copy_of):
    path = copy_of(model_dir("llama_mcg"))
    edit_checkpoint(path, replace={f"{Q}.mcg": torch.tensor(12345, dtype=torch.int32),
                                   "model.layers.0.mlp.up_proj.svh": torch.full((384,), float("nan")).half()})
    return path


def test_unsound_checkpoint_is_refused_listing_every_problem(tmp_path, unsound):
    result = run_cli("prepare", unsound, tmp_path / "out")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert "refusing to prepare an unsound checkpoint (2 problem(s)" in lines[0] and "marker value" in lines[0]
    assert any("384 NaN/Inf value(s) in svh" in line for line in lines[1:])
    assert not (tmp_path / "out").exists()
    report = run_cli("prepare", unsound, tmp_path / "out", "-f", "json")
    assert report.exit_code == 1
    data = report.json()
    assert data["prepared"] is False
    assert sorted(p["check"] for p in data["problems"]) == ["marker-value", "scale-nonfinite"]
    assert run_cli("inspect", unsound).exit_code == 1  # the same verdict and exit code as inspect


def test_unreadable_checkpoint_exits_2(tmp_path, copy_of):
    path = copy_of(model_dir("llama_mul1"))
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    result = run_cli("prepare", path, tmp_path / "out")
    assert result.exit_code == 2 and "truncated" in result.stderr
    assert run_cli("inspect", path).exit_code == 2


def test_gate_up_mismatch_exits_1(tmp_path):
    src = write_checkpoint(tmp_path / "src", ModelSpec(arch="qwen3_moe", num_layers=1, num_experts=2, vocab=256,
                                                       per_linear={"*.experts.0.gate_proj": (3, "mcg")}))
    result = run_cli("prepare", src, tmp_path / "out", "-f", "json")
    assert result.exit_code == 1 and "unsupported" in result.stderr and "expert 0" in result.stderr
    assert result.json()["error"]["type"] == "UnsupportedFeatureError"


@pytest.mark.parametrize("args, message", [
    (["--layers", "5"], "no layer 5 in the checkpoint (layers: 0..1)"),
    (["--layers", "1-0"], "runs backwards"),
    (["--layers", "one"], "expected 'all' or layer numbers and ranges like 0-3,7,10-"),
    (["--max-shard-size", "lots"], "expected a number of bytes"),
    (["--max-shard-size", "0"], "must be positive"),
    (["--revision", "main"], "--revision applies to Hugging Face repo ids"),
    (["--format", "xml"], "--format must be human or json, not 'xml'"),
    (["--layer", "0-999999999"], "no layer 2 in the checkpoint"),
    (["-l", "all", "--layers", "x-"], "expected 'all' or layer numbers"),
])
def test_bad_options_exit_2(tmp_path, args, message):
    result = run_cli("prepare", EXAMPLE, tmp_path / "out", *args)
    assert result.exit_code == 2 and message in result.stderr + result.stdout, result.stderr
    assert not (tmp_path / "out").exists()


def test_missing_model_exits_2(tmp_path):
    result = run_cli("prepare", tmp_path / "no-such-model", tmp_path / "out")
    assert result.exit_code == 2 and "no-such-model" in result.stderr
    assert not (tmp_path / "out").exists()
    assert run_cli("prepare").exit_code == 2  # missing arguments: usage, no traceback


def test_progress_bar_shows_layers_bytes_and_speed():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=160)
    with ProgressBar(console, enabled=True) as bar:
        bar.update(PrepareProgress(2, 5, 3_000_000, 6_000_000, 3_000_000, "layer-00002"))
    text = buffer.getvalue()
    assert "preparing" in text and "layers 2/5" in text and "3.0/6.0 MB" in text
    silent = io.StringIO()
    with ProgressBar(Console(file=silent, force_terminal=True), enabled=False) as bar:
        bar.update(PrepareProgress(1, 1, 1, 1, 1, None))
    assert silent.getvalue() == ""


MEASURE = textwrap.dedent("""
    import json, sys
    from exl3tool.prepared import prepare_checkpoint
    def kib(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))
    prepare_checkpoint(sys.argv[3], sys.argv[2] + "-warmup")  # every import done, the chunk buffer allocated
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = kib("VmRSS")
    report = prepare_checkpoint(sys.argv[1], sys.argv[2])
    print(json.dumps({"base": base, "peak": kib("VmHWM"), "bytes": report.bytes}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_stays_far_below_one_layer(tmp_path):
    """~160 MB of checkpoint in 3 layers of ~53 MB: the writer's peak grows by two 4 MiB buffers, not a layer."""
    spec = ModelSpec(arch="qwen3_moe", hidden=1024, moe_intermediate=1024, num_experts=32, num_layers=3,
                     num_heads=8, num_kv_heads=2, head_dim=128, vocab=512, embeddings=False)
    src = write_checkpoint(tmp_path / "src", spec)
    done = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(tmp_path / "out"), str(EXAMPLE)],
                          capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)
    layer_bytes = m["bytes"] / 3
    assert layer_bytes > 50e6
    grown = (m["peak"] - m["base"]) * 1024
    assert grown < 0.3 * layer_bytes, (grown, layer_bytes)


def test_a_fifo_planted_in_out_is_not_read(tmp_path):
    """OUT's manifest.json being a FIFO: refused at once (a blocking read would hang), replaced with --overwrite."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "manifest.json")
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "exl3tool", "prepare", str(EXAMPLE), str(out), "-q", *extra], capture_output=True,
        text=True, timeout=120, cwd=ROOT)
    refused = run()
    assert refused.returncode == 2 and "manifest/state cannot be read; use --overwrite" in refused.stderr
    assert run("--overwrite").returncode == 0 and (out / "manifest.json").is_file()
