"""The reader: safetensors headers (cross-checked with the safetensors library), speed on a big checkpoint,
and Hugging Face hub resolution (mocked: no network in tests)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import exl3tool
from exl3tool.errors import UnreadableInputError
from exl3tool.io import source
from exl3tool.io.safetensors import TensorReader, read_header
from exl3tool.io.scan import scan_checkpoint
from exl3tool.synthetic import ModelSpec, save_safetensors, write_checkpoint
from helpers import EXAMPLE


def test_reader_reads_the_safetensors_library_output(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.int16).view(2, 3), "b": torch.tensor(-877912083, dtype=torch.int32),
               "c": torch.randn(5).to(torch.bfloat16), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "x.safetensors")
    header = read_header(tmp_path / "x.safetensors", "x.safetensors")
    assert {k: (e.dtype, e.shape) for k, e in header.tensors.items()} == {
        "a": ("I16", (2, 3)), "b": ("I32", ()), "c": ("BF16", (5,)), "empty": ("F32", (0, 4))}
    reader = TensorReader()
    assert bytes(reader.read(header, header.tensors["a"])) == tensors["a"].numpy().tobytes()
    reader.close()


def test_our_writer_is_read_by_the_safetensors_library(tmp_path):
    tensors = {"w": torch.randn(3, 4).half(), "m": torch.tensor(7, dtype=torch.int32), "e": torch.zeros(0)}
    save_safetensors(tmp_path / "y.safetensors", tensors)
    with safe_open(tmp_path / "y.safetensors", "pt") as f:
        for name, value in tensors.items():
            assert torch.equal(f.get_tensor(name), value)


def test_header_with_a_gap_or_overlap_is_rejected(tmp_path):
    for offsets in ([[0, 4], [8, 12]], [[0, 4], [2, 6]]):
        header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": offsets[0]},
                  "b": {"dtype": "F32", "shape": [1], "data_offsets": offsets[1]}}
        raw = json.dumps(header).encode()
        path = tmp_path / "g.safetensors"
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(max(o[1] for o in offsets)))
        with pytest.raises(UnreadableInputError) as err:
            read_header(path, "g.safetensors")
        assert err.value.tensor == "b"


def _big_checkpoint(root: Path, shards: int = 100, layers: int = 50, experts: int = 166) -> int:
    """A DeepSeek-sized tensor count with tiny tensors: every expert linear is trellis + suh + svh + marker."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
              "moe_intermediate_size": 128, "intermediate_size": 128, "num_hidden_layers": layers,
              "num_experts": experts, "num_experts_per_tok": 8, "num_attention_heads": 2, "head_dim": 64,
              "num_key_value_heads": 2, "vocab_size": 128,
              "quantization_config": {"quant_method": "exl3", "version": "1.6.5", "bits": 1.0, "head_bits": 16}}
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    linear = {"trellis": ("I16", (8, 8, 16), bytes(2048)), "suh": ("F16", (128,), bytes(256)),
              "svh": ("F16", (128,), bytes(256)), "mcg": ("I32", (), (-877912083).to_bytes(4, "little", signed=True))}
    names = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(layers) for e in range(experts)
             for p in ("gate_proj", "up_proj", "down_proj")]
    names += [f"model.layers.{i}.self_attn.{p}" for i in range(layers) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    per_shard = -(-len(names) // shards)
    weight_map, count = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"{n}.{leaf}": v for n in names[s * per_shard:(s + 1) * per_shard] for leaf, v in linear.items()}
        if s == shards - 1:
            tensors.update({f"model.layers.{i}.mlp.gate.weight": ("F16", (experts, 128), bytes(experts * 256))
                            for i in range(layers)})
        save_safetensors(root / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
        count += len(tensors)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return count


def test_100_shards_100k_tensors_read_in_seconds(tmp_path):
    count = _big_checkpoint(tmp_path / "big")
    assert count >= 100_000
    start = time.perf_counter()
    scan = scan_checkpoint(tmp_path / "big")
    header_seconds = time.perf_counter() - start
    scan.close()
    assert scan.problems == []
    assert len(scan.model.layers) == 50 and len(scan.model.layers[0].mlp.experts) == 166
    assert sum(f.num_tensors for f in scan.model.files) == count
    start = time.perf_counter()
    report = exl3tool.inspect_checkpoint(tmp_path / "big")  # headers + markers + every suh/svh
    inspect_seconds = time.perf_counter() - start
    assert report.sound and report.exl3_linears == 25_100
    # generous bounds for a slow CI machine; a laptop does both in a few seconds
    assert header_seconds < 20, header_seconds
    assert inspect_seconds < 40, inspect_seconds


# --- Hugging Face hub ------------------------------------------------------------------------------------

def test_repo_id_goes_through_snapshot_download(monkeypatch):
    calls = []

    def fake_download(**kwargs):
        calls.append(kwargs)
        return str(EXAMPLE)

    monkeypatch.setattr(source, "snapshot_download", fake_download)
    with exl3tool.open_checkpoint("someone/qwen3moe-exl3", revision="v1") as ckpt:
        assert ckpt.root == EXAMPLE and len(ckpt.layers) == 2
    assert calls == [{"repo_id": "someone/qwen3moe-exl3", "revision": "v1",
                      "allow_patterns": ["*.json", "*.safetensors"]}]


def _fake_hub_cache(cache: Path, repo: str, commit: str = "a" * 40) -> Path:
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in EXAMPLE.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_offline_mode_resolves_from_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    snapshot = _fake_hub_cache(tmp_path / "hub", "org/model")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert source.resolve_source("org/model") == snapshot
    report = exl3tool.inspect_checkpoint("org/model")
    assert report.sound and report.exl3_linears == 33


def test_offline_and_not_cached_is_unreadable(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UnreadableInputError) as err:
        source.resolve_source("org/absent")
    assert err.value.path == "org/absent" and "cache" in err.value.message


def test_hub_errors_become_unreadable_input(monkeypatch):
    from huggingface_hub import errors as hub_errors

    def fail(**kwargs):
        error = hub_errors.RevisionNotFoundError.__new__(hub_errors.RevisionNotFoundError)
        error.args = ("404: no revision 'nope'",)  # built without an HTTP response object
        raise error

    monkeypatch.setattr(source, "snapshot_download", fail)
    from helpers import run_cli

    result = run_cli("inspect", "org/model", "--revision", "nope")
    assert result.exit_code == 2 and "revision 'nope' not found" in result.stderr


@pytest.mark.parametrize("text, ok", [("org/model", True), ("model", True), ("org/model/extra", False),
                                      ("../x", False), ("org/..", False), ("", False)])
def test_repo_id_shape(text, ok):
    assert source.looks_like_repo_id(text) is ok


def test_synthetic_big_moe_writer_agrees(tmp_path):
    path = write_checkpoint(tmp_path / "m", ModelSpec(arch="qwen3_moe", num_experts=8, shards=4, num_layers=3))
    with exl3tool.open_checkpoint(path) as ckpt:
        assert ckpt.check() == [] and len(ckpt.model.files) == 4
