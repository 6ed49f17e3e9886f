"""`exl3tool verify` on the GPU: every genuine fixture passes against the reference AND against ExLlamaV3's own
recorded outputs; a prepared folder gives the same numbers as its source; wrong recorded outputs fail."""

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import GENUINE, model_dir, outputs_dir, run_cli

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", GENUINE)
def test_every_fixture_passes_against_reference_and_exllamav3(name):
    recorded = outputs_dir(name) / "exllamav3_outputs.safetensors"
    result = run_cli("verify", model_dir(name), "--layer", "all", "--input", recorded, "--format", "json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json()
    assert report["passed"] and report["checks"]
    recorded_names = {k[: -len(".output")] for k in load_file(recorded) if k.endswith(".output")}
    compared = {c["name"] for c in report["checks"] if c["vs_recorded"] is not None}
    assert recorded_names <= compared  # every recorded module was run on its recorded input and compared
    for check in report["checks"]:
        assert check["vs_reference"]["rel_l2"] <= 1e-2 and check["vs_reference"]["cosine"] >= 0.9999, check
        if check["vs_recorded"] is not None:
            assert check["vs_recorded"]["rel_l2"] <= 1e-2 and check["vs_recorded"]["cosine"] >= 0.9999, check


def test_prepared_folder_gives_the_source_numbers(tmp_path):
    prepared = tmp_path / "prepared"
    assert run_cli("prepare", model_dir("qwen3moe_mul1"), prepared, "--quiet").exit_code == 0
    runs = [run_cli("verify", path, "--layer", "1", "--seed", "7", "--format", "json").json()
            for path in (model_dir("qwen3moe_mul1"), prepared)]
    assert runs[1]["prepared"] and not runs[0]["prepared"]
    assert [c["vs_reference"] for c in runs[0]["checks"]] == [c["vs_reference"] for c in runs[1]["checks"]]
    assert runs[0]["passed"]


def test_wrong_recorded_outputs_fail_with_exit_1(tmp_path):
    """The kernels run on llama_mcg's recorded inputs but are compared with llama_mul1's recorded outputs."""
    inputs = load_file(outputs_dir("llama_mcg") / "exllamav3_outputs.safetensors")
    other = load_file(outputs_dir("llama_mul1") / "exllamav3_outputs.safetensors")
    mixed = {k: (other[k] if k.endswith(".output") else v) for k, v in inputs.items()}
    save_file(mixed, tmp_path / "mixed.safetensors")
    result = run_cli("verify", model_dir("llama_mcg"), "--layer", "0", "--input", tmp_path / "mixed.safetensors",
                     "--format", "json")
    assert result.exit_code == 1
    checks = result.json()["checks"]
    assert all(c["vs_reference"]["rel_l2"] <= 1e-2 for c in checks)  # kernels still match the reference
    assert all(not c["passed"] for c in checks if c["vs_recorded"] is not None)


def test_save_output_holds_reference_and_kernel_tensors(tmp_path):
    out = tmp_path / "out.safetensors"
    result = run_cli("verify", model_dir("llama_mul1"), "--layer", "0", "--tokens", "5", "--save-output", out,
                     "--format", "json")
    assert result.exit_code == 0, result.stderr
    saved = load_file(out)
    for check in result.json()["checks"]:
        ref, kern = saved[f"{check['name']}.reference"], saved[f"{check['name']}.kernel"]
        assert ref.shape == kern.shape == (5, check["out_features"])
        rel = ((kern - ref).norm() / ref.norm()).item()
        assert math.isclose(rel, check["vs_reference"]["rel_l2"], rel_tol=1e-3, abs_tol=1e-9)


def test_human_output_lists_every_module_and_the_verdict(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # piped output ignores it (under pytest-xdist, something sets it to 80)
    result = run_cli("verify", model_dir("llama_3inst"), "--layer", "0", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.stderr
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert proj in result.stdout
    assert "8/8 passed" in result.stdout and "FAIL" not in result.stdout


@pytest.mark.parametrize("path", ["fused", "per-expert"])
def test_moe_path_is_chosen_and_reported(path):
    recorded = outputs_dir("qwen3moe_mul1") / "exllamav3_outputs.safetensors"
    result = run_cli("verify", model_dir("qwen3moe_mul1"), "--layer", "all", "--input", recorded, "--moe-path", path,
                     "--format", "json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json()
    assert report["moe_path"] == path and report["passed"]
    moe = [c for c in report["checks"] if c["kind"] == "moe"]
    assert moe and all(c["path"] == path for c in moe)
    assert any(c["vs_recorded"] is not None for c in moe)  # layer 0's block was recorded by ExLlamaV3
    # the expert projections are still checked one by one with the dense kernel
    assert any(".experts." in c["name"] and c["kind"] == "linear" for c in report["checks"])


def test_gpt_oss_moe_runs_fused_and_per_expert(tmp_path):
    """gpt-oss: a router with a bias, experts with biases and the clamped SwiGLU. Both of verify's paths check the
    block against the reference: the fused kernel (the logits' bias in the route kernel, the gate/up biases and
    the clamped SwiGLU in the intermediate, the down biases in the top-k sum) and the per-expert one (routing in
    torch with the bias, each expert through the dense kernels with its biases)."""
    from exl3tool.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path / "oss", arch="gpt_oss", num_layers=1, hidden=256, intermediate=256,
                            num_experts=8, top_k=4, embeddings=False)
    for moe_path in ("fused", "per-expert"):
        result = run_cli("verify", path, "--layer", "0", "--moe-path", moe_path, "--format", "json")
        assert result.exit_code == 0, result.stdout + result.stderr
        moe = [c for c in result.json()["checks"] if c["kind"] == "moe"]
        assert len(moe) == 1 and moe[0]["passed"] and moe[0]["path"] == moe_path
