"""Tensor names -> groups, and one group's tensors -> a checked LinearInfo (format doc section 2).

Every check here reads headers only, except the 0-dim codebook markers, whose values the caller passes in.
A linear whose trellis shape is readable always yields a LinearInfo (so structure checks do not report it as
missing); its problems carry its module name, and the reference refuses a linear that has any.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from exl3tool.errors import Problem, ProblemKind
from exl3tool.format import (
    EXL3_ONLY_LEAVES, HALF_RATE_WORDS, LINEAR_LEAVES, MCG_MARKER, MUL1_MARKER, PAD, TILE, Codebook, LinearInfo,
    TensorInfo, bits_from_words, format_bits,
)
from exl3tool.io.safetensors import FLOAT_DTYPES

MARKERS = {"mcg": (Codebook.MCG, MCG_MARKER), "mul1": (Codebook.MUL1, MUL1_MARKER)}


@dataclass
class Groups:
    """Tensors split by module key (the name up to the last dot)."""

    linears: dict[str, dict[str, TensorInfo]] = field(default_factory=dict)  # prefix -> leaf -> tensor
    unquantized: list[TensorInfo] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def group_tensors(tensors: dict[str, TensorInfo]) -> Groups:
    """Sort every tensor into an EXL3 linear group or the unquantized tensors; flag what fits neither."""
    by_prefix: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        by_prefix[prefix][leaf] = info
    groups = Groups()
    for prefix, leaves in by_prefix.items():
        trellis = leaves.get("trellis")
        if trellis is not None and ("signs" in leaves or len(trellis.shape) == 1):
            groups.problems.append(Problem(
                "ring-format", "quantized in ExLlamaV3's 1-D ring format (.trellis + .signs, e.g. a quantized "
                "embedding): recognised, not decodable by exl3tool", trellis.file, trellis.name, ProblemKind.UNSUPPORTED,
                module=prefix))
        elif trellis is not None:
            groups.linears[prefix] = {}
            for leaf, info in leaves.items():
                if leaf in LINEAR_LEAVES:
                    groups.linears[prefix][leaf] = info
                else:
                    groups.problems.append(Problem(
                        "unknown-tensor", f"unknown tensor '{leaf}' beside an EXL3 trellis", info.file, info.name,
                        ProblemKind.UNSUPPORTED, module=prefix))
        elif EXL3_ONLY_LEAVES & leaves.keys():
            some = leaves[sorted(EXL3_ONLY_LEAVES & leaves.keys())[0]]
            groups.problems.append(Problem(
                "missing-tensor", f"missing: {', '.join(sorted(leaves))} stored without the trellis", some.file,
                f"{prefix}.trellis", module=prefix))
        else:
            for info in leaves.values():
                if info.dtype in FLOAT_DTYPES:
                    groups.unquantized.append(info)
                else:
                    groups.problems.append(Problem(
                        "unknown-tensor", f"{info.dtype} tensor outside any EXL3 linear: exl3tool does not know it",
                        info.file, info.name, ProblemKind.UNSUPPORTED))
    return groups


def check_linear(
    prefix: str, leaves: dict[str, TensorInfo], marker_values: dict[str, int | None]
) -> tuple[LinearInfo | None, list[Problem]]:
    """Validate one EXL3 linear. `marker_values[tensor name]` is the int32 value read from the file."""
    problems: list[Problem] = []

    def bad(check: str, info: TensorInfo, message: str, tensor: str | None = None) -> None:
        problems.append(Problem(check, message, info.file, tensor or info.name, module=prefix))

    trellis = leaves["trellis"]
    if trellis.dtype != "I16":
        bad("trellis-dtype", trellis, f"trellis dtype is {trellis.dtype}, EXL3 stores int16 (I16)")
    if len(trellis.shape) != 3 or 0 in trellis.shape:
        bad("trellis-shape", trellis, f"trellis shape {list(trellis.shape)} is not (in_p/16, out_p/16, 16*K)")
        return None, problems
    rows, cols, words = trellis.shape
    bits = bits_from_words(words)
    if bits is None:
        bad("trellis-shape", trellis, f"trellis last dim {words} is not 16*K for K in 1..8 (or 24/40/56 words "
            "for K = 1.5/2.5/3.5)")
        return None, problems
    in_p, out_p = rows * TILE, cols * TILE
    for what, size in (("input", in_p), ("output", out_p)):
        if size % PAD:
            bad("padded-dims", trellis, f"padded {what} size {size} is not a multiple of {PAD}")

    codebook = _codebook(leaves, marker_values, bad)
    if words in HALF_RATE_WORDS and codebook is not Codebook.MUL1:
        bad("half-rate-codebook", trellis, f"K={format_bits(bits)} ({words} words) is defined for the mul1 "
            f"codebook only, this linear is {codebook.value}")

    legacy = False
    for scaled, packed, size in (("suh", "su", in_p), ("svh", "sv", out_p)):
        legacy |= _check_scale(prefix, leaves, scaled, packed, size, bad)
    bias = leaves.get("bias")
    if bias is not None and (bias.dtype != "F16" or bias.shape != (out_p,)):
        bad("bias", bias, f"bias is {bias.dtype} {list(bias.shape)}, expected F16 [{out_p}]")

    info = LinearInfo(
        name=prefix, in_features=in_p, out_features=out_p, in_padded=in_p, out_padded=out_p, bits=bits,
        codebook=codebook, has_bias=bias is not None, legacy_signs=legacy, tensors=dict(leaves),
        dims_from_config=False,
    )
    return info, problems


def _codebook(leaves, marker_values, bad) -> Codebook:
    present = [leaf for leaf in ("mcg", "mul1") if leaf in leaves]
    for leaf in present:
        info = leaves[leaf]
        expected = MARKERS[leaf][1]
        if info.dtype != "I32" or info.shape != ():
            bad("marker-dtype", info, f"codebook marker is {info.dtype} {list(info.shape)}, expected a 0-dim I32")
        elif marker_values.get(info.name) != expected:
            value = marker_values.get(info.name)
            shown = "unreadable" if value is None else f"0x{value & 0xFFFFFFFF:08X}"
            bad("marker-value", info, f"codebook marker value is {shown}, expected 0x{expected & 0xFFFFFFFF:08X}")
    if len(present) > 1:
        bad("marker-conflict", leaves["mul1"], "both .mcg and .mul1 markers are present: the codebook is ambiguous")
    return MARKERS[present[0]][0] if present else Codebook.INST3


def _check_scale(prefix, leaves, scaled: str, packed: str, size: int, bad) -> bool:
    """Check suh/svh (fp16, padded length) or legacy su/sv (int16, padded length / 16). Returns legacy-ness."""
    vec, legacy = leaves.get(scaled), leaves.get(packed)
    if vec is None and legacy is None:
        bad("missing-tensor", leaves["trellis"], f"missing: every EXL3 linear has {scaled} (or legacy {packed})",
            tensor=f"{prefix}.{scaled}")
        return False
    if vec is not None and legacy is not None:
        bad("scale-conflict", legacy, f"both {scaled} and legacy {packed} are present")
    if vec is not None and (vec.dtype != "F16" or vec.shape != (size,)):
        bad("scale-shape", vec, f"{scaled} is {vec.dtype} {list(vec.shape)}, expected F16 [{size}] to match the trellis")
    if legacy is not None and (legacy.dtype != "I16" or legacy.shape != (size // TILE,)):
        bad("scale-shape", legacy, f"{packed} is {legacy.dtype} {list(legacy.shape)}, expected I16 [{size // TILE}] "
            "to match the trellis")
    return vec is None
