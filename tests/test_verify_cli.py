"""`exl3tool verify` on the CPU: metrics, the JSON schema, and every way it refuses input before touching a GPU.
(The runs on real kernels are in tests/gpu/test_verify.py.)"""

import io
import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from exl3tool.cli.console import PIPED_WIDTH, ToolConsole
from exl3tool.cli.render.verify import render_human, render_json
from exl3tool.verify import Comparison, ModuleCheck, Thresholds, VerifyReport, compare
from helpers import model_dir, outputs_dir, run_cli

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_compare_measures_relative_l2_cosine_and_max_abs():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert compare(ref, ref) == Comparison(0.0, pytest.approx(1.0), 0.0)
    got = ref + torch.tensor([[0.0, 0.5], [0.0, 0.0]])
    c = compare(got, ref)
    assert c.rel_l2 == pytest.approx(0.1) and c.max_abs == pytest.approx(0.5) and 0.99 < c.cosine < 1.0
    assert compare(-ref, ref).cosine == pytest.approx(-1.0)


def test_nan_output_never_passes():
    ref = torch.ones(2, 3)
    c = compare(torch.full((2, 3), float("nan")), ref)
    assert math.isinf(c.rel_l2) and not c.passes(Thresholds())


def test_thresholds_are_inclusive_bounds():
    t = Thresholds(max_rel_l2=1e-2, min_cosine=0.9999, max_abs=0.5)
    assert Comparison(1e-2, 0.9999, 0.5).passes(t)
    assert not Comparison(1.01e-2, 0.99999, 0.1).passes(t)
    assert not Comparison(1e-3, 0.9998, 0.1).passes(t)
    assert not Comparison(1e-3, 0.99999, 0.6).passes(t)
    assert Comparison(1e-3, 0.99999, 9.0).passes(Thresholds())  # no max-abs bound by default


def test_json_schema_and_non_finite_numbers_become_null(capsys):
    check = ModuleCheck("model.layers.0.mlp.up_proj", "linear", 0, 4, "file", 256, 320, 4.0, "mul1",
                        Comparison(float("nan"), -1.0, float("inf")), None, False)
    render_json(VerifyReport("m", False, "GPU", "sm_90a", "float16", 0, Thresholds(), (0,), (check,)))
    data = json.loads(capsys.readouterr().out)  # strict JSON: no NaN/Infinity tokens
    assert data["schema"] == "exl3tool.verify/1" and data["passed"] is False
    assert data["checks"][0]["vs_reference"] == {"rel_l2": None, "cosine": -1.0, "max_abs": None}
    assert data["thresholds"] == {"max_rel_l2": 0.01, "min_cosine": 0.9999, "max_abs": None}


def _wide_report() -> VerifyReport:
    checks = tuple(
        ModuleCheck(f"model.layers.12.mlp.experts.{e}.down_proj", "linear", 12, 16, "file", 14336, 4096, 3.5, "3inst",
                    Comparison(1.2345e-3 * (e + 1), 0.9999876, 6.789e-2), Comparison(2.345e-3, 0.999912, 0.5), True)
        for e in range(3))
    return VerifyReport("/some/long/path/to/a/model-exl3", False, "NVIDIA H200", "sm_90a", "bfloat16", 7,
                        Thresholds(), (12,), checks)


def _render(console: ToolConsole) -> str:
    render_human(_wide_report(), console)
    return console.file.getvalue()


@pytest.mark.parametrize("columns", [None, "70"])
def test_piped_output_cuts_no_cell(monkeypatch, columns):
    """A pipe or file has no width: Rich would fit the table to 80 columns (or COLUMNS) and cut its cells."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)  # describes a terminal; some libraries set it without one
    console = ToolConsole(file=io.StringIO(), highlight=False)
    assert console.width == PIPED_WIDTH
    text = _render(console)
    assert "…" not in text
    for e in range(3):
        assert f"mlp.experts.{e}.down_proj" in text and f"{1.2345e-3 * (e + 1):.2e}" in text
    assert "0.9999876" in text and "2.34e-03 cos 0.999912" in text and text.count("PASS") == 3


def test_a_terminal_keeps_its_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "70")
    terminal = ToolConsole(file=io.StringIO(), force_terminal=True, color_system=None, highlight=False)
    assert terminal.width == 70 and max(map(len, _render(terminal).splitlines())) <= 70


@no_gpu
@pytest.mark.parametrize("cuda,advice", [(None, "is a CPU-only build; install a CUDA build of torch"),
                                         ("13.0", "(CUDA 13.0) finds no CUDA GPU; check the NVIDIA driver")])
def test_without_a_gpu_exit_2_with_one_line_saying_what_to_install(monkeypatch, cuda, advice):
    """A CPU-only torch build and a CUDA build on a machine without a GPU each get their own advice."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    result = run_cli("verify", model_dir("llama_mcg"), "--layer", "0")
    assert result.exit_code == 2
    assert result.stderr.startswith("exl3tool: no usable GPU: torch.cuda.is_available() is False: torch ")
    assert advice in result.stderr and result.stderr.count("GPU") == (1 if cuda is None else 2)
    assert len(result.stderr.strip().splitlines()) == 1


def _verify_without(module: str, *args: str) -> subprocess.CompletedProcess:
    """`exl3tool verify ARGS` in a fresh interpreter where importing `module` fails as if it were not installed."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['exl3tool', 'verify', *sys.argv[1:]]; "
            "from exl3tool.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, words", [
    (["--layer", "x"], "--layer 'x': expected 'all' or layer numbers"),
    (["--layer", "-1"], "--layer '-1': expected"),
    (["--layer", "3-1"], "the range 3-1 runs backwards"),
    (["--layer", "0", "--dtype", "float32"], "--dtype must be float16 or bfloat16, not 'float32'"),
    (["--layer", "0", "--format", "yaml"], "--format must be human or json, not 'yaml'"),
    (["--layer", "0", "--moe-path", "loop"], "--moe-path must be fused or per-expert, not 'loop'"),
    (["--layer", "0", "--max-rel-l2", "nan"], "--max-rel-l2 must be a finite number >= 0, not nan"),
    (["--layer", "0", "--min-cosine", "2"], "--min-cosine must be a number from -1 to 1, not 2.0"),
])
def test_bad_arguments_are_refused_before_torch_is_imported(args, words):
    """With torch impossible to import, a bad argument is still the usage error (not 'missing dependency')."""
    result = _verify_without("torch", str(model_dir("llama_mcg")), *args)
    assert result.returncode == 2 and result.stderr.startswith("exl3tool: usage error: ") and words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_layer_the_checkpoint_lacks_is_exit_2():
    result = run_cli("verify", model_dir("llama_mcg"), "--layer", "7")
    assert result.exit_code == 2 and "llama_mcg: no layer 7 in the checkpoint (layers: 0..0)" in result.stderr


def test_without_the_cute_dsl_exit_2_saying_what_to_install():
    result = _verify_without("cutlass", str(model_dir("llama_mcg")), "--layer", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("exl3tool: missing dependency: no module named 'cutlass': "
                                     "pip install 'nvidia-cutlass-dsl==4.8.1'")


def test_missing_layer_option_is_a_usage_error():
    assert run_cli("verify", model_dir("llama_mcg")).exit_code == 2


def test_unreadable_input_file(tmp_path):
    bad = tmp_path / "in.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    result = run_cli("verify", model_dir("llama_mcg"), "--layer", "0", "--input", bad)
    assert result.exit_code == 2 and "in.safetensors" in result.stderr


def test_input_that_is_not_a_regular_file(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    result = run_cli("verify", model_dir("llama_mcg"), "--layer", "0", "--input", tmp_path / "fifo")
    assert result.exit_code == 2 and result.stderr == \
        f"exl3tool: unreadable input: {tmp_path / 'fifo'}: --input: a FIFO, not a regular file\n"


def test_input_of_the_wrong_width_is_refused_before_any_gpu_work(tmp_path):
    path = tmp_path / "in.safetensors"
    save_file({"model.layers.0.self_attn.q_proj.input": torch.zeros(4, 7, dtype=torch.float16)}, path)
    result = run_cli("verify", model_dir("llama_mcg"), "--layer", "0", "--input", path)
    assert result.exit_code == 2
    assert "model.layers.0.self_attn.q_proj.input" in result.stderr and "[M, 256]" in result.stderr


def test_unreadable_checkpoint(tmp_path):
    result = run_cli("verify", tmp_path / "nothing-here", "--layer", "0")
    assert result.exit_code == 2 and "nothing-here" in result.stderr


@no_gpu
def test_recorded_fixture_inputs_pass_validation():
    """The fixtures' own recorded activations are accepted: only the GPU (checked last) is missing."""
    result = run_cli("verify", model_dir("llama_mul1"), "--layer", "0",
                     "--input", outputs_dir("llama_mul1") / "exllamav3_outputs.safetensors")
    assert result.exit_code == 2 and result.stderr.startswith("exl3tool: no usable GPU: ")


def test_the_cli_starts_without_importing_torch_or_the_dsl():
    """verify/bench pull in torch and the CuTe DSL only when they run, so inspect and --help start fast."""
    code = "import sys, exl3tool.cli.app; print(sorted(m for m in ('torch', 'cutlass') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
