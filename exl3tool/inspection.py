"""What `exl3tool inspect` reports, as data: a summary, a bitrate histogram, per-layer rows, optionally some
layers' linears in detail, and every problem the checks found. No printing; torch only for a prepared folder.

    inspect_checkpoint(source, revision=None, *, layer=None, data_checks=True) -> InspectReport
        source: a checkpoint folder, a hub repo id, or a folder written by `exl3tool prepare`
        layer: a layer selection ("0-3,7,10-", "all", or an index) whose linears to list
    InspectReport.sound -> bool;  InspectReport.to_json() -> dict   (schema "exl3tool.inspect/1", see README)
    cap_problems(problems) -> (shown, left_out)     at most PROBLEMS_PER_CHECK of each check, for display
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from exl3tool.errors import Exl3Error, Problem, ProblemKind, UsageError
from exl3tool.format import ACTIVATION_KINDS, CheckpointModel, GatedMLP, Layer, LinearInfo, MoEBlock, TensorInfo
from exl3tool.io.config import CONFIG
from exl3tool.io.scan import scan_checkpoint
from exl3tool.prepared import is_prepared
from exl3tool.prepared.layout import STATE_DIR
from exl3tool.selection import parse_layers

SCHEMA = "exl3tool.inspect/1"
PROBLEMS_PER_CHECK = 20  # shown per check id; the rest is counted ("... and N more"), never printed


def cap_problems(problems) -> tuple[list[Problem], dict[str, int]]:
    """The problems to show (the first PROBLEMS_PER_CHECK of each check, in order) and how many of each check
    were left out: 300k identical problems are one line and a count, not 300k lines."""
    seen: Counter = Counter()
    shown = []
    for p in problems:
        seen[p.check] += 1
        if seen[p.check] <= PROBLEMS_PER_CHECK:
            shown.append(p)
    return shown, {check: n - PROBLEMS_PER_CHECK for check, n in seen.items() if n > PROBLEMS_PER_CHECK}


def problem_json(p: Problem) -> dict:
    return {"check": p.check, "kind": p.kind.value, "file": p.path, "tensor": p.tensor, "module": p.module,
            "message": p.message}


@dataclass(frozen=True)
class LinearRow:
    name: str
    role: str  # attention | mlp | expert | shared_expert | head | other
    in_features: int
    out_features: int
    in_padded: int
    out_padded: int
    bits: float
    codebook: str
    bias: bool
    legacy_signs: bool
    bytes: int
    effective_bits: float
    file: str


@dataclass(frozen=True)
class BitsBin:
    bits: float
    linears: int
    weights: int
    share: float  # of the true weights of all non-head EXL3 linears


@dataclass(frozen=True)
class LayerRow:
    index: int
    attention: tuple[str, ...]  # projection names
    attention_kind: str | None  # "full" | "linear" | "conv" (format.Attention.kind) | None
    mlp: str | None  # "dense" | "moe" | None
    experts: int
    shared_experts: bool
    linears: int
    bits: tuple[float, ...]  # distinct K, ascending
    codebooks: tuple[str, ...]
    bytes: int
    effective_bits: float


@dataclass(frozen=True)
class HeadInfo:
    kind: str  # "exl3" | "unquantized" | "absent"
    bits: float | None = None
    codebook: str | None = None
    effective_bits: float | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class LayerDetail:
    index: int
    linears: tuple[LinearRow, ...]


@dataclass(frozen=True)
class InspectReport:
    source: str
    path: str
    architecture: str | None
    model_type: str | None
    converter_version: str | None
    config_bits: float | None
    config_head_bits: float | None
    files: int
    tensors: int
    file_bytes: int
    exl3_bytes: int
    num_layers: int
    moe_layers: int
    experts_per_layer: int
    top_k: int | None
    routing: str | None
    activation: str | None  # the gated MLPs' (format.ACTIVATION_KINDS); None without any MLP block
    exl3_linears: int
    codebooks: dict[str, int]
    histogram: tuple[BitsBin, ...]
    mean_bits: float | None  # weighted by true weights, head excluded (what config's `bits` means)
    effective_bits: float | None  # stored bits per true weight incl. suh/svh, head excluded
    head: HeadInfo
    layers: tuple[LayerRow, ...]
    details: tuple[LayerDetail, ...]  # the selected layers' linears (empty without a selection)
    problems: tuple[Problem, ...]
    notes: tuple[str, ...]
    prepared: bool = False  # a folder written by `exl3tool prepare`

    @property
    def sound(self) -> bool:
        return not self.problems

    @property
    def unreadable(self) -> bool:
        return any(p.kind is ProblemKind.UNREADABLE for p in self.problems)

    def to_json(self) -> dict:
        """The stable machine-readable form (documented in the README)."""
        row = lambda obj: {k: v for k, v in obj.__dict__.items()}  # noqa: E731
        detail = lambda d: {"index": d.index, "linears": [row(r) for r in d.linears]}  # noqa: E731
        shown, left_out = cap_problems(self.problems)
        return {
            "schema": SCHEMA,
            "source": self.source,
            "path": self.path,
            "prepared": self.prepared,
            "sound": self.sound,
            "model": {
                "architecture": self.architecture, "model_type": self.model_type,
                "converter_version": self.converter_version, "config_bits": self.config_bits,
                "config_head_bits": self.config_head_bits,
            },
            "summary": {
                "files": self.files, "tensors": self.tensors, "file_bytes": self.file_bytes,
                "exl3_bytes": self.exl3_bytes, "layers": self.num_layers, "moe_layers": self.moe_layers,
                "experts_per_layer": self.experts_per_layer, "top_k": self.top_k, "routing": self.routing,
                "activation": self.activation, "exl3_linears": self.exl3_linears, "codebooks": dict(self.codebooks),
                "mean_bits": self.mean_bits, "effective_bits": self.effective_bits,
            },
            "bits_histogram": [row(b) for b in self.histogram],
            "head": row(self.head),
            "layers": [{**row(r), "attention": list(r.attention), "bits": list(r.bits),
                        "codebooks": list(r.codebooks)} for r in self.layers],
            "layer_detail": detail(self.details[0]) if len(self.details) == 1 else None,
            "layer_details": [detail(d) for d in self.details],
            "problems": [problem_json(p) for p in shown],
            "problems_left_out": left_out,
            "notes": list(self.notes),
        }


def _roles(layer: Layer) -> dict[str, str]:
    """Module name -> role of every EXL3 linear in `layer`."""
    roles = {lin.name: "other" for lin in layer.other_linears}
    if layer.attention is not None:
        roles.update((lin.name, "attention") for lin in layer.attention.linears)
    if isinstance(layer.mlp, GatedMLP):
        roles.update((lin.name, "mlp") for lin in layer.mlp.linears)
    elif isinstance(layer.mlp, MoEBlock):
        roles.update((lin.name, "expert") for e in layer.mlp.experts for lin in e.linears)
        if layer.mlp.shared_experts is not None:
            roles.update((lin.name, "shared_expert") for lin in layer.mlp.shared_experts.linears)
    return roles


def _linear_row(info: LinearInfo, role: str) -> LinearRow:
    return LinearRow(info.name, role, info.in_features, info.out_features, info.in_padded, info.out_padded,
                     info.bits, info.codebook.value, info.has_bias, info.legacy_signs, info.stored_bytes,
                     round(info.effective_bits, 4), info.file)


def _bits_per_weight(linears) -> float | None:
    weights = sum(lin.weights for lin in linears)
    return round(sum(lin.stored_bytes for lin in linears) * 8 / weights, 4) if weights else None


def _layer_row(layer: Layer) -> LayerRow:
    linears = layer.linears
    mlp = layer.mlp
    return LayerRow(
        index=layer.index,
        attention=tuple(layer.attention.projections) if layer.attention else (),
        attention_kind=layer.attention.kind if layer.attention else None,
        mlp="moe" if isinstance(mlp, MoEBlock) else "dense" if isinstance(mlp, GatedMLP) else None,
        experts=len(mlp.experts) if isinstance(mlp, MoEBlock) else 0,
        shared_experts=isinstance(mlp, MoEBlock) and mlp.shared_experts is not None,
        linears=len(linears),
        bits=tuple(sorted({lin.bits for lin in linears})),
        codebooks=tuple(sorted({lin.codebook.value for lin in linears})),
        bytes=sum(lin.stored_bytes for lin in linears),
        effective_bits=_bits_per_weight(linears) or 0.0,
    )


def _head(head) -> HeadInfo:
    if isinstance(head, LinearInfo):
        return HeadInfo("exl3", head.bits, head.codebook.value, round(head.effective_bits, 4))
    if isinstance(head, TensorInfo):
        return HeadInfo("unquantized", dtype=head.dtype)
    return HeadInfo("absent")


def _histogram(linears: list[LinearInfo]) -> tuple[BitsBin, ...]:
    total = sum(lin.weights for lin in linears) or 1
    bins = []
    for bits in sorted({lin.bits for lin in linears}):
        group = [lin for lin in linears if lin.bits == bits]
        weights = sum(lin.weights for lin in group)
        bins.append(BitsBin(bits, len(group), weights, round(weights / total, 6)))
    return tuple(bins)


def _notes(model: CheckpointModel) -> tuple[str, ...]:
    notes = []
    quant = model.config.quant
    if quant.extra_keys:
        notes.append(f"quantization_config keys exl3tool does not interpret: {', '.join(quant.extra_keys)}")
    unknown_dims = [lin.name for lin in model.linears.values() if not lin.dims_from_config]
    if unknown_dims:
        notes.append(f"{len(unknown_dims)} linear(s) whose true size config.json does not give: padded sizes shown "
                     f"(first: {unknown_dims[0]})")
    activation = model.config.activation
    if activation not in ACTIVATION_KINDS.values():
        notes.append(f"MLP activation {activation!r} is not known: the reference refuses whole MLP and MoE blocks "
                     "(single linears still work)")
    routing = model.config.routing
    if routing is not None and routing.method == "unknown":
        notes.append(f"MoE routing of model_type {model.config.model_type!r} is not known: the reference will "
                     "refuse whole MoE blocks (single linears still work)")
    return tuple(notes)


def build_report(model: CheckpointModel, problems: list[Problem], source: str, path: Path, *,
                 layer=None, prepared: bool = False) -> InspectReport:
    """The report on `model` (a source checkpoint's or a prepared folder's) and the problems found in it."""
    body = [lin for lin in model.linears.values() if lin.name != "lm_head"]
    moe = [lay.mlp for lay in model.layers if isinstance(lay.mlp, MoEBlock)]
    routing = model.config.routing
    details = []
    if layer is not None:
        chosen = set(parse_layers(layer).resolve((lay.index for lay in model.layers), source))
        for lay in model.layers:
            if lay.index in chosen:
                roles = _roles(lay)
                details.append(LayerDetail(lay.index, tuple(_linear_row(lin, roles[lin.name]) for lin in lay.linears)))
    return InspectReport(
        source=source,
        path=str(Path(path).resolve()),
        architecture=model.config.architecture,
        model_type=model.config.model_type,
        converter_version=model.config.quant.version,
        config_bits=model.config.quant.bits,
        config_head_bits=model.config.quant.head_bits,
        files=len(model.files),
        tensors=sum(f.num_tensors for f in model.files),
        file_bytes=sum(f.size for f in model.files),
        exl3_bytes=sum(lin.stored_bytes for lin in model.linears.values()),
        num_layers=len(model.layers),
        moe_layers=len(moe),
        experts_per_layer=max((len(b.experts) for b in moe), default=0),
        top_k=routing.top_k if routing and moe else None,
        routing=routing.method if routing and moe else None,
        activation=model.config.activation if any(lay.mlp for lay in model.layers) else None,
        exl3_linears=len(model.linears),
        codebooks=dict(sorted(Counter(lin.codebook.value for lin in model.linears.values()).items())),
        histogram=_histogram(body),
        mean_bits=round(sum(lin.bits * lin.weights for lin in body) / sum(lin.weights for lin in body), 4)
        if body else None,
        effective_bits=_bits_per_weight(body),
        head=_head(model.head),
        layers=tuple(_layer_row(lay) for lay in model.layers),
        details=tuple(details),
        problems=tuple(problems),
        notes=_notes(model),
        prepared=prepared,
    )


def _unfinished_prepare(source) -> bool:
    """A folder `exl3tool prepare` is still writing (or was killed while writing): no config.json of its own."""
    folder = Path(str(source)).expanduser()
    return (folder / STATE_DIR).is_dir() and not (folder / CONFIG).exists()


def inspect_checkpoint(source, revision: str | None = None, *, layer=None, data_checks: bool = True) -> InspectReport:
    """Read a checkpoint header-first (plus markers and, with `data_checks`, every suh/svh) and report on it.
    A prepared folder is read through its manifest (with `data_checks`, every shard's sha256: all of its data).
    Raises only when nothing can be read (UnreadableInputError, UsageError) or `layer` names an absent layer."""
    layer = None if layer is None else parse_layers(layer)  # a malformed selection fails before any reading
    if is_prepared(source) or _unfinished_prepare(source):
        if revision is not None:
            raise UsageError("--revision applies to Hugging Face repo ids, not to a prepared folder", path=source)
        return _inspect_prepared(source, layer, data_checks)
    scan = scan_checkpoint(source, revision)
    try:
        return build_report(scan.model, scan.check(data_checks), scan.source, scan.root, layer=layer)
    finally:
        scan.close()


def _inspect_prepared(source, layer, data_checks: bool) -> InspectReport:
    from exl3tool.prepared import load_prepared  # imports torch: only for a prepared folder

    try:
        prepared = load_prepared(source, verify_hashes=False)  # check() below hashes, collecting what differs
    except Exl3Error as e:  # the loader names files relative to the folder: name the folder too
        if e.path is not None and not Path(e.path).is_absolute() and e.path != str(source):
            e.path = str(Path(str(source)) / e.path)
        raise
    try:
        problems = prepared.check() if data_checks else []
        return build_report(prepared.model, problems, str(source), prepared.root, layer=layer, prepared=True)
    finally:
        prepared.close()


__all__ = ["InspectReport", "LayerRow", "LinearRow", "LayerDetail", "BitsBin", "HeadInfo", "inspect_checkpoint",
           "cap_problems", "SCHEMA"]
