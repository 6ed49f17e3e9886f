"""Where checkpoints come from: a Hugging Face hub cache (snapshots of symlinks into blobs/), a folder written by
`exl3tool prepare`, and local paths that are not folders. Every refusal is one line naming folder and file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import EXAMPLE, ROOT, model_dir, run_cli

REPO = "someone/llama-mcg-exl3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache, source, repo_id=REPO, commit=COMMIT):
    """A hub cache holding `source` as huggingface_hub lays one out (blobs by sha256, a snapshot of relative
    symlinks, refs/main), written with huggingface_hub's own helpers."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision, _create_symlink, _get_pointer_path, repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (storage / "blobs").mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            blob = storage / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, blob)
            pointer = _get_pointer_path(str(storage), commit, path.name)
            os.makedirs(os.path.dirname(pointer), exist_ok=True)  # as hf_hub_download does before linking
            _create_symlink(str(blob), pointer, new_blob=False)
    _cache_commit_hash_for_specific_revision(str(storage), "main", commit)
    return storage / "snapshots" / commit


def run_offline(cache, *args):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "exl3tool", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_a_sharded_checkpoint_in_the_hub_cache(tmp_path):
    from huggingface_hub import scan_cache_dir

    snapshot = hub_cache(tmp_path / "hub", model_dir("llama_mcg"))
    shard = snapshot / "model-00001-of-00002.safetensors"
    assert shard.is_symlink() and os.readlink(shard).startswith("../../blobs/")  # a real snapshot's layout
    info = scan_cache_dir(tmp_path / "hub")
    assert not info.warnings and [r.repo_id for r in info.repos] == [REPO]
    for revision in ([], ["--revision", "main"]):
        result = run_offline(tmp_path / "hub", "inspect", REPO, "-f", "json", *revision)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["sound"] and report["summary"]["files"] == 2 and report["path"] == str(snapshot.resolve())
    out = tmp_path / "out"
    result = run_offline(tmp_path / "hub", "prepare", REPO, out, "-q")
    assert result.returncode == 0 and (out / "manifest.json").is_file(), result.stderr


def test_not_in_the_cache_while_offline(tmp_path):
    (tmp_path / "hub").mkdir()
    result = run_offline(tmp_path / "hub", "inspect", REPO)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"exl3tool: unreadable input: {REPO}: not in the local Hugging Face cache, and the hub cannot be reached "
        "(offline mode or no network)")


def test_inspect_a_prepared_folder(tmp_path):
    out = tmp_path / "prepared"
    assert run_cli("prepare", EXAMPLE, out, "-q").exit_code == 0
    source = run_cli("inspect", EXAMPLE, "-f", "json").json()
    report = run_cli("inspect", out, "-f", "json", "-l", "1").json()
    assert report["prepared"] is True and report["sound"] is True
    for key in ("layers", "moe_layers", "experts_per_layer", "top_k", "routing", "exl3_linears", "codebooks",
                "mean_bits"):
        assert report["summary"][key] == source["summary"][key], key
    def same(rows):  # a prepared folder stores no codebook markers: bytes differ, nothing else
        return [{k: v for k, v in r.items() if k not in ("bytes", "effective_bits")} for r in rows]

    assert report["model"] == source["model"] and same(report["layers"]) == same(source["layers"])
    assert [r["name"] for r in report["layer_detail"]["linears"]] == \
        [r["name"] for r in run_cli("inspect", EXAMPLE, "-f", "json", "-l", "1").json()["layer_detail"]["linears"]]
    assert run_cli("inspect", out).stdout.startswith("prepared folder (exl3tool prepare) ")


def test_inspect_a_damaged_prepared_folder(tmp_path):
    out = tmp_path / "prepared"
    assert run_cli("prepare", EXAMPLE, out, "-q").exit_code == 0
    shard = next(out.glob("layer-00001-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    report = run_cli("inspect", out, "-f", "json")
    assert report.exit_code == 2
    assert [(p["check"], p["file"]) for p in report.json()["problems"]] == [("file-hash", shard.name)]
    assert run_cli("inspect", out, "--no-data-checks").exit_code == 0  # the hashes are the data checks


def test_inspect_an_unfinished_prepare(tmp_path):
    out = tmp_path / "prepared"
    (out / ".exl3tool-prepare").mkdir(parents=True)
    result = run_cli("inspect", out)
    assert result.exit_code == 2 and "did not finish" in result.stderr and str(out) in result.stderr


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_text("x"), "a file, not a folder"),
    (lambda p: os.mkfifo(p), "a FIFO, not a folder"),
    (lambda p: p.symlink_to(p.name), "a symlink loop, not a folder"),
])
def test_model_paths_that_are_not_folders(tmp_path, make, words):
    path = tmp_path / "model"
    make(path)
    result = run_cli("inspect", path)
    assert result.exit_code == 2 and result.stderr == f"exl3tool: unreadable input: {path}: {words}: point " \
        "exl3tool at the checkpoint folder\n"
