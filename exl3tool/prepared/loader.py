"""Read a prepared folder back: `load_prepared(path, device="cpu", verify_hashes=True) -> PreparedCheckpoint`.

The manifest is validated (schema, layout version, its own content hash, every name, shape and view), every
shard's size and safetensors header are checked against it, and (when asked) every shard's sha256: a file that
changed by one byte is reported, never decoded. Shards are memory-mapped copy-on-write, so CPU tensors are
zero-copy views of the page cache and moving one to a GPU is its only copy; nothing moves before it is asked
for (per linear, per layer).

    PreparedCheckpoint   an exl3tool.reader.CheckpointReader, like a source Checkpoint (model, layers, linears,
                         blocks, layer/linear/block, load_tensor, load_linear, moe, dequantize,
                         reference_forward, check, close); moe(layer) gives views of the stored stacks
    PreparedMoE / PreparedExpertGroup   = exl3tool.reader.MoELayer / ExpertGroup
"""

from __future__ import annotations

import hashlib
import mmap
from math import prod
from pathlib import Path
from typing import Callable, Literal

import torch

from exl3tool.checkpoint import TORCH_DTYPES
from exl3tool.errors import (
    NotFoundError, Problem, ProblemKind, UnreadableInputError, UnsupportedFeatureError, UsageError,
)
from exl3tool.format import (
    PAD, TILE, Attention, CheckpointModel, Codebook, FileInfo, GatedMLP, Layer, LinearInfo, LinearTensors,
    MoEBlock, TensorInfo, padded, words_from_bits,
)
from exl3tool.io.config import read_json
from exl3tool.io.safetensors import DTYPE_SIZES, SafetensorsHeader, read_header
from exl3tool.prepared.layout import (
    GROUP_BIAS_FIELDS, GROUP_FIELDS, HASH, LAYOUT_VERSION, MANIFEST, SCHEMA, SHARD_RE, STATE_DIR, UNIT_RE,
    config_from_json, group_shapes, linear_from_entry, manifest_digest, routing_from_json,
)

from exl3tool.reader import CheckpointReader, ExpertGroup, MoELayer

VerifyMode = bool | Literal["lazy"]


# What moe() returns is shared with source checkpoints (exl3tool.reader); the old names stay.
PreparedExpertGroup = ExpertGroup
PreparedMoE = MoELayer


# --- the manifest --------------------------------------------------------------------------------------------


class _Bad(Exception):
    """A manifest inconsistency (turned into UnreadableInputError naming manifest.json)."""


def _require(cond: bool, message: str | Callable[[], str]) -> None:
    """``message``: text, or (checks run once per tensor or view) a function making it only when the check fails:
    the reprs of 100k passing checks took most of a 48-layer MoE manifest's validation."""
    if not cond:
        raise _Bad(message() if callable(message) else message)


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        if (root / STATE_DIR).is_dir():
            raise UnreadableInputError("incomplete: an exl3tool prepare run into this folder did not finish; run "
                                       "the same `exl3tool prepare` again to complete it", path=str(root))
        raise UnreadableInputError("not a prepared folder: no manifest.json (write one with exl3tool prepare)",
                                   path=str(root))
    data = read_json(path, MANIFEST, missing="not a prepared folder: no manifest.json")
    version = data.get("layout_version")
    if type(version) is int and version > LAYOUT_VERSION:
        raise UnsupportedFeatureError(f"prepared layout version {version} is newer than this exl3tool reads "
                                      f"({LAYOUT_VERSION}): upgrade exl3tool", path=MANIFEST)
    if data.get("schema") != SCHEMA or version != LAYOUT_VERSION:
        raise UnreadableInputError(f"not an exl3tool prepared manifest (schema {data.get('schema')!r}, layout "
                                   f"version {version!r}; expected {SCHEMA!r}, {LAYOUT_VERSION})", path=MANIFEST)
    if data.get("manifest_sha256") != manifest_digest(data):
        raise UnreadableInputError("edited or damaged: its content hash (manifest_sha256) does not match; re-run "
                                   "exl3tool prepare --overwrite", path=MANIFEST)
    return data


def _view_shape(ref: dict, tensors: dict) -> tuple[str, tuple[int, ...]]:
    _require(isinstance(ref, dict) and ref.get("tensor") in tensors, lambda: f"view of an unknown tensor: {ref!r}")
    spec = tensors[ref["tensor"]]
    shape = list(spec["shape"])
    for i in ref.get("index", []):
        _require(type(i) is int and shape and 0 <= i < shape[0], lambda: f"index {i} out of range in {ref!r}")
        shape = shape[1:]
    if "slice" in ref:
        a, b = ref["slice"]
        _require(type(a) is int and type(b) is int and shape and 0 <= a <= b <= shape[-1],
                 lambda: f"slice out of range in {ref!r}")
        shape[-1] = b - a
    _require(set(ref) <= {"tensor", "index", "slice"}, lambda: f"unknown keys in {ref!r}")
    return spec["dtype"], tuple(shape)


def _check_linear(entry: dict, tensors: dict) -> None:
    name = entry["name"]
    codebook = Codebook(entry["codebook"])
    words = words_from_bits(float(entry["bits"]))
    _require(words % TILE == 0 or codebook is Codebook.MUL1, lambda: f"{name}: half-rate K with {codebook.value}")
    for side in ("in", "out"):
        true, pad = entry[f"{side}_features"], entry[f"{side}_padded"]
        _require(type(true) is int and type(pad) is int and true > 0 and pad % PAD == 0 and padded(true) == pad,
                 lambda: f"{name}: {side} size {true!r} / padded {pad!r} inconsistent")
    in_p, out_p = entry["in_padded"], entry["out_padded"]
    expected = {"trellis": ("I16", (in_p // TILE, out_p // TILE, words)), "suh": ("F16", (in_p,)),
                "svh": ("F16", (out_p,))}
    if entry["has_bias"]:
        expected["bias"] = ("F16", (out_p,))
    storage = entry["storage"]
    _require(set(storage) == set(expected),
             lambda: f"{name}: stored leaves {sorted(storage)}, expected {sorted(expected)}")
    for leaf, want in expected.items():
        got = _view_shape(storage[leaf], tensors)
        _require(got == want,
                 lambda: f"{name}.{leaf}: stored as {got[0]} {list(got[1])}, expected {want[0]} {list(want[1])}")


def _check_group(group: dict, block: dict, linears: dict, tensors: dict) -> None:
    ids = group["experts"]
    w13, w2 = group["w13"], group["w2"]
    expected = group_shapes(len(ids), group["hidden_padded"], group["intermediate_padded"], float(w13["bits"]),
                            float(w2["bits"]), True, True)
    _require(set(GROUP_FIELDS) <= set(group["tensors"]) <= set(GROUP_FIELDS + GROUP_BIAS_FIELDS),
             f"group tensors {sorted(group['tensors'])}")
    for field, name in group["tensors"].items():
        got = (tensors[name]["dtype"], tuple(tensors[name]["shape"]))
        _require(got == expected[field], lambda: f"{name}: {got[0]} {list(got[1])}, expected {expected[field][0]} "
                                                 f"{list(expected[field][1])}")
    for e in ids:
        x = block["experts"][e]
        for role, want in (("gate", w13), ("up", w13), ("down", w2)):
            lin = linears[x[role]]
            _require((float(lin["bits"]), lin["codebook"]) == (float(want["bits"]), want["codebook"]),
                     lambda: f"{x[role]}: K/codebook disagree with its expert group")


def _check_structure(manifest: dict) -> dict[str, dict]:
    """Validate names, dtypes, shapes and views; returns tensor name -> {file, dtype, shape}."""
    tensors: dict[str, dict] = {}
    files: set[str] = set()
    for unit in manifest["units"]:
        _require(UNIT_RE.match(unit["id"]) is not None, f"unit id {unit['id']!r}")
        for f in unit["files"]:
            _require(SHARD_RE.match(f["name"]) is not None and f["name"] not in files, f"file name {f['name']!r}")
            _require(type(f["size"]) is int and isinstance(f[HASH], str), f"file entry {f!r}")
            files.add(f["name"])
        unit_files = {f["name"] for f in unit["files"]}
        for name, spec in unit["tensors"].items():
            _require(name not in tensors, lambda: f"tensor {name!r} listed twice")
            _require(spec["file"] in unit_files, lambda: f"{name}: file {spec['file']!r}")
            _require(spec["dtype"] in DTYPE_SIZES and all(type(d) is int and d >= 0 for d in spec["shape"]),
                     lambda: f"{name}: {spec['dtype']!r} {spec['shape']!r}")
            tensors[name] = spec
    for unit in manifest["units"]:
        s = unit["structure"]
        for entry in s["linears"].values():
            _check_linear(entry, tensors)
        for name in s["unquantized"]:
            _require(name in tensors, lambda: f"unquantized tensor {name!r} not stored")
        mlp = s.get("mlp") if unit["kind"] == "layer" else None
        if mlp and mlp["kind"] == "moe":
            _require(mlp["router"] in tensors, "router not stored")
            covered = sorted(e for g in mlp["groups"] for e in g["experts"])
            _require(covered == list(range(len(mlp["experts"]))), f"{mlp['name']}: groups do not cover the experts")
            for group in mlp["groups"]:
                _check_group(group, mlp, s["linears"], tensors)
    return tensors


# --- the checkpoint ------------------------------------------------------------------------------------------


def load_prepared(path: str | Path, device: str | torch.device = "cpu",
                  verify_hashes: VerifyMode = True) -> "PreparedCheckpoint":
    """Open a folder written by `exl3tool prepare`. `verify_hashes`: True checks every shard's sha256 now,
    "lazy" checks each shard the first time a tensor of it is used, False never. `device`: where load_linear,
    moe and load_tensor put tensors when not told otherwise."""
    return PreparedCheckpoint(path, device, verify_hashes)


class PreparedCheckpoint(CheckpointReader):
    def __init__(self, path: str | Path, device: str | torch.device = "cpu", verify_hashes: VerifyMode = True):
        if verify_hashes not in (True, False, "lazy"):
            raise UsageError(f"verify_hashes must be True, False or 'lazy', got {verify_hashes!r}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise UsageError(f"not a torch device: {device!r}") from None
        self.root = Path(path).expanduser()
        self.source = str(path)
        if not self.root.is_dir():
            raise UnreadableInputError("no such folder" if not self.root.exists() else "not a folder", path=str(path))
        self.manifest = _read_manifest(self.root)
        self._verify = verify_hashes
        self._maps: dict[str, mmap.mmap] = {}
        self._verified: set[str] = set()
        try:
            self._tensors = _check_structure(self.manifest)
            self._files = {f["name"]: f for u in self.manifest["units"] for f in u["files"]}
            self._entries = {name: e for u in self.manifest["units"] for name, e in u["structure"]["linears"].items()}
            self.model = self._build_model()
        except _Bad as e:
            raise UnreadableInputError(f"inconsistent: {e}", path=MANIFEST) from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise UnreadableInputError(f"malformed: {type(e).__name__} {e}", path=MANIFEST) from None
        self._headers = {name: self._check_file(name) for name in self._files}
        if verify_hashes is True:
            for name in self._files:
                self._verify_file(name)

    # --- structure (as Checkpoint) -----------------------------------------------------------------------

    layout_version = property(lambda self: self.manifest["layout_version"])
    fingerprint = property(lambda self: self.manifest["source"]["fingerprint"])

    @property
    def problems(self) -> list[Problem]:
        """Always empty: prepare refuses a checkpoint with problems (file damage is raised, or see check())."""
        return []

    def check(self) -> list[Problem]:
        """Hash every shard now; one problem per shard that changed since prepare wrote it."""
        found = []
        for name in self._files:
            try:
                self._verify_file(name)
            except UnreadableInputError as e:
                found.append(Problem("file-hash", e.message, name, kind=ProblemKind.UNREADABLE))
        return found

    def _missing(self, name: str, what: str):
        raise NotFoundError(f"no {what} of that name in the prepared checkpoint", path=self.source, tensor=name)

    def _tinfo(self, ref: dict) -> TensorInfo:
        dtype, shape = _view_shape(ref, self._tensors)
        return TensorInfo(ref["tensor"], self._tensors[ref["tensor"]]["file"], dtype, shape,
                          prod(shape) * DTYPE_SIZES[dtype])

    def _linear_info(self, entry: dict) -> LinearInfo:
        return linear_from_entry(entry, {leaf: self._tinfo(ref) for leaf, ref in entry["storage"].items()})

    def _build_model(self) -> CheckpointModel:
        m = self.manifest
        layers, head, other, unquantized = [], None, [], []
        self._structures: dict[int, dict] = {}
        for unit in m["units"]:
            s = unit["structure"]
            lin = {name: self._linear_info(e) for name, e in s["linears"].items()}
            unquantized.extend(self._tinfo({"tensor": n}) for n in s["unquantized"])
            used = set()

            def take(name: str, used=used, lin=lin) -> LinearInfo:
                used.add(name)
                return lin[name]

            def mlp_of(d: dict, take=take) -> GatedMLP:
                limit = d.get("activation_limit")  # manifests before gpt-oss: none
                _require(limit is None or type(limit) in (int, float), lambda: f"activation_limit {limit!r}")
                return GatedMLP(d["name"], take(d["gate"]), take(d["up"]), take(d["down"]), d["activation"], limit)

            if unit["kind"] == "layer":
                a, mlp = s["attention"], s["mlp"]
                attention = None if a is None else \
                    Attention(a["name"], {k: take(v) for k, v in a["projections"].items()})
                block = None
                if mlp is not None and mlp["kind"] == "dense":
                    block = mlp_of(mlp)
                elif mlp is not None:
                    _require(mlp["kind"] == "moe", f"mlp kind {mlp['kind']!r}")
                    optional = lambda n: None if n is None else self._tinfo({"tensor": n})  # noqa: E731
                    block = MoEBlock(
                        mlp["name"], self._tinfo({"tensor": mlp["router"]}), tuple(mlp_of(x) for x in mlp["experts"]),
                        routing_from_json(mlp["routing"]),
                        None if mlp["shared_experts"] is None else mlp_of(mlp["shared_experts"]),
                        optional(mlp["shared_expert_gate"]), optional(mlp["correction_bias"]),
                        optional(mlp.get("router_bias")))  # manifests before gpt-oss: none
                layers.append(Layer(s["index"], attention, block, tuple(take(n) for n in s["other_linears"])))
                _require(s["index"] not in self._structures, f"layer {s['index']} listed twice")
                self._structures[s["index"]] = s
            else:
                _require(unit["kind"] == "globals", f"unit kind {unit['kind']!r}")
                h = s["head"]
                if h is not None and h["kind"] == "exl3":
                    head = take(h["linear"])
                elif h is not None:
                    _require(h["kind"] == "unquantized" and h["tensor"] in s["unquantized"], "head")
                    head = self._tinfo({"tensor": h["tensor"]})
                other.extend(take(n) for n in s["other_linears"])
            _require(used == set(lin), f"linears no structure uses: {sorted(set(lin) - used)[:3]}")
        files = [FileInfo(f["name"], f["size"], sum(t["file"] == f["name"] for t in self._tensors.values()))
                 for u in m["units"] for f in u["files"]]
        layers.sort(key=lambda layer: layer.index)
        return CheckpointModel.build(config_from_json(m["config"]), files, layers, head, other, unquantized)

    # --- files ----------------------------------------------------------------------------------------

    def _check_file(self, name: str) -> SafetensorsHeader:
        path = self.root / name
        expected = self._files[name]["size"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise UnreadableInputError("missing: the manifest lists this shard", path=name) from None
        except OSError as e:
            raise UnreadableInputError(f"cannot read: {e.strerror or e}", path=name) from None
        if size != expected:
            raise UnreadableInputError(f"{'truncated' if size < expected else 'grown'}: {size} bytes, the manifest "
                                       f"says {expected}", path=name)
        header = read_header(path, name)
        listed = {t: (s["dtype"], tuple(s["shape"])) for t, s in self._tensors.items() if s["file"] == name}
        stored = {t: (e.dtype, e.shape) for t, e in header.tensors.items()}
        if listed != stored:
            odd = sorted(set(listed.items()) ^ set(stored.items()))[0][0]
            raise UnreadableInputError("header disagrees with the manifest", path=name, tensor=odd)
        return header

    def _verify_file(self, name: str) -> None:
        if name in self._verified:
            return
        digest = hashlib.new(HASH)
        try:
            with open(self.root / name, "rb", buffering=0) as f:
                buf = bytearray(8 << 20)
                view = memoryview(buf)
                while n := f.readinto(buf):
                    digest.update(view[:n])
        except OSError as e:
            raise UnreadableInputError(f"cannot read: {e.strerror or e}", path=name) from None
        if digest.hexdigest() != self._files[name][HASH]:
            raise UnreadableInputError(f"{HASH} mismatch: the shard changed since exl3tool prepare wrote it (damaged "
                                       "or edited); its data is not used. Re-run exl3tool prepare --overwrite",
                                       path=name)
        self._verified.add(name)

    def _map(self, name: str) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is None:
            if self._verify:
                self._verify_file(name)
            try:
                with open(self.root / name, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except OSError as e:
                raise UnreadableInputError(f"cannot map: {e.strerror or e}", path=name) from None
            if len(mm) != self._files[name]["size"]:
                raise UnreadableInputError("changed size while being opened", path=name)
            self._maps[name] = mm
        return mm

    # --- tensors --------------------------------------------------------------------------------------

    def _stored(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise NotFoundError("no such tensor in the prepared checkpoint", path=self.source, tensor=name)
        file = self._tensors[name]["file"]
        entry = self._headers[file].tensors[name]
        dtype = TORCH_DTYPES[entry.dtype]
        count = prod(entry.shape)
        if count == 0:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(self._map(file), dtype=dtype, count=count, offset=entry.begin).view(entry.shape)

    def _view(self, ref: dict) -> torch.Tensor:
        t = self._stored(ref["tensor"])
        for i in ref.get("index", []):
            t = t[i]
        if "slice" in ref:
            a, b = ref["slice"]
            t = t[..., a:b]
        return t

    def _device(self, device) -> torch.device:
        return self.device if device is None else torch.device(device)

    def load_tensor(self, name: str, device=None) -> torch.Tensor:
        """A stored tensor by its prepared name (e.g. a router, `...expert_group.0.w13`), on `device`."""
        return self._stored(name).to(self._device(device))

    def load_linear(self, name: str, device=None) -> LinearTensors:
        """The tensors of one EXL3 linear (dense or one expert's gate/up/down): views of the stored tensors on
        CPU, bit-identical to what the source checkpoint's load_linear returns."""
        info = self.linear(name)
        storage = self._entries[name]["storage"]
        bias = self._view(storage["bias"]) if "bias" in storage else None
        tensors = LinearTensors(info, self._view(storage["trellis"]), self._view(storage["suh"]),
                                self._view(storage["svh"]), bias)
        device = self._device(device)
        return tensors if device.type == "cpu" else tensors.to(device)

    def _group_tensors(self, block: MoEBlock, g: int, ids: list[int], device) -> dict[str, torch.Tensor]:
        """Views of the stored stacks (zero-copy on CPU: moving them to a GPU is their only copy)."""
        mlp = next(s["mlp"] for s in self._structures.values() if s["mlp"] and s["mlp"]["name"] == block.name)
        entry = mlp["groups"][g]
        if list(entry["experts"]) != list(ids):
            raise UnreadableInputError(f"inconsistent: {block.name} group {g} holds experts {entry['experts']}, "
                                       f"its K/codebook say {ids}", path=MANIFEST)
        return {field: self.load_tensor(name, device) for field, name in entry["tensors"].items()}

    # --- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the memory maps (a map still viewed by a live tensor stays until that tensor is freed)."""
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()

    def __enter__(self) -> "PreparedCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



__all__ = ["PreparedCheckpoint", "PreparedExpertGroup", "PreparedMoE", "load_prepared"]
