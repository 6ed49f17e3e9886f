"""`exl3tool inspect` on the genuine checkpoints: the facts it reports, human and JSON, and the entry points."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import EXAMPLE, ROOT, model_dir, run_cli


def test_example_human_output():
    result = run_cli("inspect", EXAMPLE)
    assert result.exit_code == 0
    out = result.stdout
    for text in ("Qwen3MoeForCausalLM (qwen3_moe)", "ExLlamaV3 1.6.5", "2 MoE, 4 experts, top-2",
                 "33 (mul1 33)", "EXL3 K=6 mul1", "K=4", "100.0%", "sound: no problems found"):
        assert text in out, text


def test_example_json_schema_and_facts():
    report = run_cli("inspect", EXAMPLE, "--format", "json").json()
    assert report["schema"] == "exl3tool.inspect/1"
    assert report["sound"] is True and report["problems"] == []
    assert set(report) == {"schema", "source", "path", "prepared", "sound", "model", "summary", "bits_histogram",
                           "head", "layers", "layer_detail", "layer_details", "problems", "problems_left_out",
                           "notes"}
    assert report["prepared"] is False and report["problems_left_out"] == {} and report["layer_details"] == []
    assert report["model"] == {"architecture": "Qwen3MoeForCausalLM", "model_type": "qwen3_moe",
                               "converter_version": "1.6.5", "config_bits": 4.0, "config_head_bits": 6.0}
    s = report["summary"]
    assert (s["layers"], s["moe_layers"], s["experts_per_layer"], s["top_k"]) == (2, 2, 4, 2)
    assert s["exl3_linears"] == 33 and s["codebooks"] == {"mul1": 33}
    assert s["mean_bits"] == 4.0
    # K=4 -> 0.5 byte per weight, plus suh/svh fp16 and the 4-byte marker per linear
    assert 4.0 < s["effective_bits"] < 4.3
    assert s["files"] == 1 and s["tensors"] == 143
    assert report["bits_histogram"] == [{"bits": 4.0, "linears": 32, "weights": 1179648, "share": 1.0}]
    assert report["head"]["kind"] == "exl3" and report["head"]["bits"] == 6.0
    assert [row["experts"] for row in report["layers"]] == [4, 4]
    assert report["layers"][0]["attention"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert report["layer_detail"] is None


def test_layer_detail():
    report = run_cli("inspect", EXAMPLE, "--format", "json", "--layer", "1").json()
    detail = report["layer_detail"]
    assert detail["index"] == 1 and len(detail["linears"]) == 16
    roles = [row["role"] for row in detail["linears"]]
    assert roles == ["attention"] * 4 + ["expert"] * 12
    down = next(r for r in detail["linears"] if r["name"] == "model.layers.1.mlp.experts.2.down_proj")
    assert (down["in_features"], down["out_features"], down["bits"], down["codebook"]) == (128, 256, 4.0, "mul1")
    human = run_cli("inspect", EXAMPLE, "--layer", "1").stdout
    assert "layer 1: model.layers.1.*" in human and "mlp.experts.2.down_proj" in human


@pytest.mark.parametrize("name, codebooks, head, files", [
    ("llama_3inst", {"3inst": 7}, {"kind": "absent"}, 1),
    ("llama_mcg", {"mcg": 8}, {"kind": "exl3", "bits": 6.0, "codebook": "mcg"}, 2),
    ("llama_mul1", {"mul1": 8}, {"kind": "exl3", "bits": 3.5, "codebook": "mul1"}, 1),
])
def test_llama_fixtures(name, codebooks, head, files):
    report = run_cli("inspect", model_dir(name), "-f", "json", "-l", "0").json()
    assert report["sound"] and report["summary"]["codebooks"] == codebooks
    assert {k: report["head"][k] for k in head} == head
    assert report["summary"]["files"] == files
    down = next(r for r in report["layer_detail"]["linears"] if r["name"].endswith("down_proj"))
    assert (down["in_features"], down["in_padded"]) == (320, 384)


def test_python_dash_m_and_console_script_agree():
    ok = subprocess.run([sys.executable, "-m", "exl3tool", "inspect", str(EXAMPLE), "-f", "json"],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and '"sound": true' in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "exl3tool", "inspect", str(ROOT / "no-such-dir")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "no-such-dir" in bad.stderr


def test_version():
    result = run_cli("--version")
    assert result.exit_code == 0 and result.stdout.startswith("exl3tool ")


def test_help_of_every_command():
    """-h is --help; arguments read as the README writes them (MODEL), never Typer's {model} or <str>."""
    import re

    import typer

    from exl3tool.cli import app

    commands = typer.main.get_command(app).commands
    assert {"inspect", "prepare", "verify"} <= set(commands)
    assert run_cli("-h").stdout == run_cli("--help").stdout
    for name in commands:
        short, long = run_cli(name, "-h"), run_cli(name, "--help")
        assert short.exit_code == 0 and short.stdout == long.stdout
        assert short.stdout.startswith(f"Usage: exl3tool {name} [OPTIONS]"), short.stdout
        assert not re.search(r"\{\w+\}|<(str|int|float|bool|path|int range|float range)>", short.stdout)


@pytest.mark.parametrize("args, message", [
    (["-f", "yaml"], "--format must be human or json, not 'yaml'"),
    (["--layer", "one"], "--layer 'one': expected 'all' or layer numbers and ranges like 0-3,7,10-"),
])
def test_choice_and_layer_errors_read_like_every_other_usage_error(args, message):
    result = run_cli("inspect", EXAMPLE, *args)
    assert result.exit_code == 2 and result.stderr == f"exl3tool: usage error: {message}\n"


def test_json_output_is_strict_json():
    def refuse(name):
        raise ValueError(name)

    text = run_cli("inspect", EXAMPLE, "-f", "json").stdout
    assert json.loads(text, parse_constant=refuse)["sound"] is True
