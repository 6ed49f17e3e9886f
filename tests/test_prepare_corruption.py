"""`load_prepared` on damaged folders: a flipped byte, a truncated or missing shard, an edited manifest. Each is
reported naming the file; damaged data is never handed out."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

import exl3tool
from exl3tool.errors import ProblemKind, UnreadableInputError, UnsupportedFeatureError
from exl3tool.prepared import load_prepared, prepare_checkpoint
from exl3tool.prepared.layout import manifest_digest

from helpers import EXAMPLE

SHARD = "layer-00001-p0.safetensors"
W13 = "model.layers.1.mlp.expert_group.0.w13"
GATE = "model.layers.1.mlp.experts.0.gate_proj"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "out"
    prepare_checkpoint(EXAMPLE, out)
    return out


@pytest.fixture
def out(tmp_path, pristine) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "out"))


def data_offset(path: Path, tensor: str) -> int:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n + json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


def test_flipped_data_byte_is_reported_not_decoded(out):
    flip(out / SHARD, data_offset(out / SHARD, W13) + 1000)
    with pytest.raises(UnreadableInputError, match="sha256 mismatch") as info:
        load_prepared(out)
    assert info.value.path == SHARD and SHARD in str(info.value)

    with load_prepared(out, verify_hashes="lazy") as p:  # per shard, before its first tensor
        p.load_linear("model.layers.0.mlp.experts.0.gate_proj")  # another shard: fine
        with pytest.raises(UnreadableInputError, match="sha256 mismatch"):
            p.load_linear(GATE)
        with pytest.raises(UnreadableInputError, match="sha256 mismatch"):
            p.moe(1)
        problems = p.check()
        assert [(q.check, q.path, q.kind) for q in problems] == [("file-hash", SHARD, ProblemKind.UNREADABLE)]

    # without the hash the damage would be decoded: the check is what stands between it and the kernels
    with load_prepared(out, verify_hashes=False) as p, exl3tool.open_checkpoint(EXAMPLE) as src:
        assert not torch.equal(p.load_linear(GATE).trellis, src.load_linear(GATE).trellis)


def test_header_edits_are_caught_without_hashing(out):
    raw = (out / SHARD).read_bytes()
    at = raw.index(b'"F16"')
    (out / SHARD).write_bytes(raw[:at] + b'"I16"' + raw[at + 5:])  # same length, another dtype
    with pytest.raises(UnreadableInputError, match="header disagrees with the manifest") as info:
        load_prepared(out, verify_hashes=False)
    assert info.value.path == SHARD and info.value.tensor is not None

    (out / SHARD).write_bytes(raw[:12] + b"\x00" + raw[13:])  # not JSON any more
    with pytest.raises(UnreadableInputError, match="malformed safetensors header") as info:
        load_prepared(out, verify_hashes=False)
    assert info.value.path == SHARD


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "truncated: .* bytes, the manifest says"),
    (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "grown"),
    (lambda p: p.unlink(), "missing: the manifest lists this shard"),
])
def test_truncated_grown_missing_shard(out, damage, message):
    damage(out / SHARD)
    for verify in (True, False):
        with pytest.raises(UnreadableInputError, match=message) as info:
            load_prepared(out, verify_hashes=verify)
        assert info.value.path == SHARD


def edit_manifest(out: Path, edit, rehash: bool = True) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    if rehash:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def layer1(m: dict) -> dict:
    return next(u for u in m["units"] if u["id"] == "layer-00001")


def test_edited_manifest_is_refused(out):
    """A codebook swap keeps every shape: only the manifest's own hash can tell."""
    edit_manifest(out, lambda m: layer1(m)["structure"]["linears"][GATE].update(codebook="mcg"), rehash=False)
    with pytest.raises(UnreadableInputError, match="edited or damaged"):
        load_prepared(out)


def _set_bits(m):
    layer1(m)["structure"]["linears"][GATE]["bits"] = 5.0


def _bad_index(m):
    layer1(m)["structure"]["linears"][GATE]["storage"]["trellis"]["index"] = [0, 4]


def _unknown_tensor(m):
    layer1(m)["structure"]["linears"][GATE]["storage"]["suh"]["tensor"] = "nowhere"


def _escape(m):
    layer1(m)["files"][0]["name"] = "../elsewhere.safetensors"


def _group_bits(m):
    layer1(m)["structure"]["mlp"]["groups"][0]["w13"]["bits"] = 3.0


def _missing_units(m):
    del m["units"]


def _stored_shape(m):
    layer1(m)["tensors"][W13]["shape"][1] = 3


Q = "model.layers.1.self_attn.q_proj"


def _q(m: dict) -> dict:
    return layer1(m)["structure"]["linears"][Q]


def _slice(m):
    _q(m)["storage"]["suh"]["slice"] = [0, 999]


def _unknown_view_key(m):
    _q(m)["storage"]["suh"]["stride"] = 1


def _half_rate_mcg(m):
    _q(m).update(bits=3.5, codebook="mcg")


def _padding(m):
    _q(m)["in_padded"] = 200


def _leaves(m):
    del _q(m)["storage"]["svh"]


def _expert_codebook(m):
    layer1(m)["structure"]["linears"][GATE]["codebook"] = "mcg"


def _twice(m):
    first = next(u for u in m["units"] if u["id"] == "layer-00000")
    first["tensors"][f"{Q}.suh"] = dict(layer1(m)["tensors"][f"{Q}.suh"], file=first["files"][0]["name"])


def _tensor_file(m):
    layer1(m)["tensors"][f"{Q}.suh"]["file"] = "layer-00009-p0.safetensors"


def _dtype(m):
    layer1(m)["tensors"][f"{Q}.suh"]["dtype"] = "X99"


def _unquantized(m):
    layer1(m)["structure"]["unquantized"].append("model.layers.1.nowhere.weight")


@pytest.mark.parametrize("edit, error, message", [
    (_set_bits, UnreadableInputError, r"inconsistent: .*gate_proj.trellis: stored as I16 \[16, 8, 64\], expected"),
    (_bad_index, UnreadableInputError, "inconsistent: index 4 out of range"),
    (_unknown_tensor, UnreadableInputError, "inconsistent: view of an unknown tensor"),
    (_escape, UnreadableInputError, "inconsistent: file name"),
    (_group_bits, UnreadableInputError,
     r"inconsistent: .*expert_group.0.w13: I16 \[2, 4, 16, 8, 64\], expected I16 \[2, 4, 16, 8, 48\]"),
    (_missing_units, UnreadableInputError, "malformed: KeyError"),
    (_stored_shape, UnreadableInputError, "inconsistent: index 3 out of range"),
    (lambda m: m.update(layout_version=2, schema="exl3tool.prepared/2"), UnsupportedFeatureError,
     "layout version 2 is newer"),
    (lambda m: m.update(schema="someone.else/1"), UnreadableInputError, "not an exl3tool prepared manifest"),
    (_slice, UnreadableInputError, r"inconsistent: slice out of range in \{'tensor': .*q_proj.suh', 'slice'"),
    (_unknown_view_key, UnreadableInputError, "inconsistent: unknown keys in .*'stride': 1"),
    (_half_rate_mcg, UnreadableInputError, "inconsistent: .*q_proj: half-rate K with mcg"),
    (_padding, UnreadableInputError, "inconsistent: .*q_proj: in size 256 / padded 200 inconsistent"),
    (_leaves, UnreadableInputError, r"inconsistent: .*q_proj: stored leaves \['suh', 'trellis'\], expected"),
    (_expert_codebook, UnreadableInputError, "inconsistent: .*experts.0.gate_proj: K/codebook disagree"),
    (_twice, UnreadableInputError, "inconsistent: tensor .*q_proj.suh' listed twice"),
    (_tensor_file, UnreadableInputError, "inconsistent: .*q_proj.suh: file 'layer-00009-p0.safetensors'"),
    (_dtype, UnreadableInputError, r"inconsistent: .*q_proj.suh: 'X99' \[256\]"),
    (_unquantized, UnreadableInputError, "inconsistent: unquantized tensor .*nowhere.weight' not stored"),
])
def test_inconsistent_manifest_even_with_a_matching_hash(out, edit, error, message):
    edit_manifest(out, edit)
    with pytest.raises(error, match=message) as info:
        load_prepared(out, verify_hashes=False)
    assert info.value.path == "manifest.json"


def test_manifest_not_json(out):
    (out / "manifest.json").write_text("{")
    with pytest.raises(UnreadableInputError, match="malformed JSON"):
        load_prepared(out)
    (out / "manifest.json").write_text("[1, 2]")
    with pytest.raises(UnreadableInputError, match="not a JSON object"):
        load_prepared(out)


def test_not_a_prepared_folder(tmp_path):
    with pytest.raises(UnreadableInputError, match="no manifest.json"):
        load_prepared(EXAMPLE)
    with pytest.raises(UnreadableInputError, match="no such folder"):
        load_prepared(tmp_path / "nowhere")
    (tmp_path / "f").write_text("x")
    with pytest.raises(UnreadableInputError, match="not a folder"):
        load_prepared(tmp_path / "f")
