"""The prepared W4A16 layout, version 1: constants, names, and the manifest <-> format-model mapping.

Pure data: no file IO, no torch. `docs/prepared-layout.md` is the spec this module implements; a change to
anything a reader sees (tensor names, shapes, manifest keys) is a new LAYOUT_VERSION.

    LAYOUT_VERSION, SCHEMA, MANIFEST, STATE_DIR       the constants
    layer_unit(i) / GLOBALS / shard_name(unit, part)  file names;  SHARD_RE matches every shard we write
    group_tensor(block, g, field)                     names of the stacked MoE tensors
    group_shapes(...) / stack_order(field, experts)   their shapes and which expert tensors they stack
    config_to_json / config_from_json                 ModelConfig <-> JSON
    linear_entry(info, role, storage)                 one EXL3 linear's manifest entry
    manifest_digest(manifest)                         the manifest's own content hash
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict

from exl3tool.format import TILE, Codebook, LinearInfo, ModelConfig, ModelDims, QuantConfig, Routing, words_from_bits

LAYOUT_VERSION = 1
SCHEMA = "exl3tool.prepared/1"  # manifest.json
REPORT_SCHEMA = "exl3tool.prepare/1"  # `exl3tool prepare --format json`
STATE_SCHEMA = "exl3tool.prepare-state/1"  # the in-progress state of an unfinished run
MANIFEST = "manifest.json"
STATE_DIR = ".exl3tool-prepare"  # temp files, per-unit fragments and the lock of a run; gone once complete
STATE_FILE = "state.json"
LOCK_FILE = "lock"
GLOBALS = "globals"  # the unit holding the head, linears outside the decoder layers and non-layer tensors
SHARD_RE = re.compile(r"^(?:layer-\d{5,}|globals)-p\d+\.safetensors$")
UNIT_RE = re.compile(r"^(?:layer-\d{5,}|globals)$")
HEADER_ALIGN = 64  # the data section of every shard starts at a multiple of this many bytes
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
HASH = "sha256"

# The stacked tensors of one expert group (design.md, "The prepared W4A16 layout"), E = experts in the group:
#   w13  I16 [2, E, H_p/16, I_p/16, 16*K13]   gate trellis plane, then up
#   w2   I16 [E, I_p/16, H_p/16, 16*K2]       down trellis
#   gate_suh, up_suh  F16 [E, H_p];  intermediate_rotations F16 [E, 3*I_p] = gate_svh | up_svh | down_suh
#   down_svh F16 [E, H_p];  w13_bias F16 [2, E, I_p] and w2_bias F16 [E, H_p] only when the experts have biases
GROUP_FIELDS = ("w13", "w2", "gate_suh", "up_suh", "intermediate_rotations", "down_svh")
GROUP_BIAS_FIELDS = ("w13_bias", "w2_bias")
# How each field stacks the experts' own tensors: (plane_major, (role, leaf) parts). Plane-major fields hold
# every expert's first part, then every expert's second (w13: all gates, then all ups); the others hold each
# expert's parts back to back (intermediate_rotations: gate svh | up svh | down suh of expert 0, then 1, ...).
GROUP_STACKS = {
    "w13": (True, (("gate", "trellis"), ("up", "trellis"))),
    "w2": (True, (("down", "trellis"),)),
    "gate_suh": (True, (("gate", "suh"),)),
    "up_suh": (True, (("up", "suh"),)),
    "intermediate_rotations": (False, (("gate", "svh"), ("up", "svh"), ("down", "suh"))),
    "down_svh": (True, (("down", "svh"),)),
    "w13_bias": (True, (("gate", "bias"), ("up", "bias"))),
    "w2_bias": (True, (("down", "bias"),)),
}


def group_shapes(n: int, hidden_padded: int, intermediate_padded: int, w13_bits: float, w2_bits: float,
                 w13_bias: bool = False, w2_bias: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """field -> (dtype, shape) of the stacked tensors of a group of `n` experts: the one definition prepare,
    the loader, the in-memory stacking of a source checkpoint and the fused MoE kernel all read."""
    h_p, i_p = hidden_padded, intermediate_padded
    shapes = {
        "w13": ("I16", (2, n, h_p // TILE, i_p // TILE, words_from_bits(w13_bits))),
        "w2": ("I16", (n, i_p // TILE, h_p // TILE, words_from_bits(w2_bits))),
        "gate_suh": ("F16", (n, h_p)), "up_suh": ("F16", (n, h_p)),
        "intermediate_rotations": ("F16", (n, 3 * i_p)), "down_svh": ("F16", (n, h_p)),
    }
    if w13_bias:
        shapes["w13_bias"] = ("F16", (2, n, i_p))
    if w2_bias:
        shapes["w2_bias"] = ("F16", (n, h_p))
    return shapes


def stack_order(field: str, experts: list) -> list[tuple[int, str, str]]:
    """(position in the group, role, leaf) of every part of stacked `field`, in storage order."""
    plane_major, parts = GROUP_STACKS[field]
    if plane_major:
        return [(p, role, leaf) for role, leaf in parts for p in range(len(experts))]
    return [(p, role, leaf) for p in range(len(experts)) for role, leaf in parts]


def layer_unit(index: int) -> str:
    return f"layer-{index:05d}"


def shard_name(unit: str, part: int) -> str:
    return f"{unit}-p{part}.safetensors"


def group_tensor(block: str, group: int, field: str) -> str:
    return f"{block}.expert_group.{group}.{field}"


# --- JSON forms of the format model ------------------------------------------------------------------------


def routing_to_json(routing: Routing | None) -> dict | None:
    return None if routing is None else asdict(routing)


def routing_from_json(data: dict | None) -> Routing | None:
    return None if data is None else Routing(**data)


def config_to_json(config: ModelConfig) -> dict:
    quant = asdict(config.quant)
    quant["extra_keys"] = list(config.quant.extra_keys)
    return {
        "architecture": config.architecture, "model_type": config.model_type, "dims": asdict(config.dims),
        "quant": quant, "routing": routing_to_json(config.routing), "tie_word_embeddings": config.tie_word_embeddings,
        "activation": config.activation, "activation_limit": config.activation_limit,
    }


def config_from_json(data: dict) -> ModelConfig:
    quant = dict(data["quant"])
    quant["extra_keys"] = tuple(quant["extra_keys"])
    return ModelConfig(
        architecture=data["architecture"], model_type=data["model_type"], dims=ModelDims(**data["dims"]),
        quant=QuantConfig(**quant), routing=routing_from_json(data["routing"]),
        tie_word_embeddings=bool(data["tie_word_embeddings"]),
        activation=str(data.get("activation", "silu")),  # manifests before it was recorded: SiLU, as then assumed
        activation_limit=data.get("activation_limit"),
    )


LINEAR_FIELDS = ("in_features", "out_features", "in_padded", "out_padded", "bits", "codebook", "has_bias",
                 "legacy_signs", "dims_from_config")


def linear_entry(info: LinearInfo, role: str, storage: dict[str, dict]) -> dict:
    """The manifest entry of one EXL3 linear. `storage` maps trellis/suh/svh(/bias) to a view of a stored
    tensor: {"tensor": name, "index": [leading indices], "slice": [start, stop] of the last dim}."""
    return {
        "name": info.name, "role": role, "in_features": info.in_features, "out_features": info.out_features,
        "in_padded": info.in_padded, "out_padded": info.out_padded, "bits": info.bits,
        "codebook": info.codebook.value, "has_bias": info.has_bias, "legacy_signs": info.legacy_signs,
        "dims_from_config": info.dims_from_config, "storage": storage,
    }


def linear_from_entry(entry: dict, tensors: dict) -> LinearInfo:
    """LinearInfo of a manifest entry; `tensors` maps leaf -> TensorInfo of the view (file = the shard)."""
    return LinearInfo(
        name=entry["name"], in_features=entry["in_features"], out_features=entry["out_features"],
        in_padded=entry["in_padded"], out_padded=entry["out_padded"], bits=float(entry["bits"]),
        codebook=Codebook(entry["codebook"]), has_bias=entry["has_bias"], legacy_signs=entry["legacy_signs"],
        tensors=tensors, dims_from_config=entry["dims_from_config"],
    )


# --- hashing -------------------------------------------------------------------------------------------------


def canonical_json(data: object) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest without its own `manifest_sha256` key, in canonical JSON. Catches an edited or
    damaged manifest (a changed codebook would otherwise decode every weight wrongly without any error)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(canonical_json(body)).hexdigest()
