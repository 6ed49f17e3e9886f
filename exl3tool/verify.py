"""`exl3tool verify`: our GPU kernels against the fp32 reference on the same inputs, module by module.

    verify(model, layers, *, tokens=16, seed=0, inputs=None, thresholds=Thresholds(), ...) -> VerifyReport

For every EXL3 linear of each requested layer (attention projections, MLP projections, experts, shared experts)
and for the layer's MLP or MoE block, the kernel output and the reference output are compared: relative L2,
cosine, max abs error, pass/fail against ``Thresholds``. When an input file also holds ``<name>.output``
(ExLlamaV3's recorded outputs of our fixtures), the kernel output is compared with that too, by the same bounds.
Works on a source checkpoint and on a prepared folder. torch (and the kernels) are imported only when a
function runs, so the CLI starts fast for every other command.
"""

from __future__ import annotations

import math
import os
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from exl3tool import selection
from exl3tool.errors import UnreadableInputError, UnsupportedFeatureError, UsageError
from exl3tool.format import GatedMLP, Layer, LinearInfo, MoEBlock

if TYPE_CHECKING:
    import torch

DTYPES = ("float16", "bfloat16")
MOE_PATHS = ("fused", "per-expert")


@dataclass(frozen=True)
class Thresholds:
    """Pass bounds. The defaults leave room for fp16 activations (the kernels round x_rot to fp16, like
    ExLlamaV3) while any decode or layout error lands orders of magnitude outside them."""

    max_rel_l2: float = 1e-2
    min_cosine: float = 0.9999
    max_abs: float | None = None


@dataclass(frozen=True)
class Comparison:
    rel_l2: float
    cosine: float
    max_abs: float

    def passes(self, t: Thresholds) -> bool:
        ok = self.rel_l2 <= t.max_rel_l2 and self.cosine >= t.min_cosine
        return ok and (t.max_abs is None or self.max_abs <= t.max_abs)


@dataclass(frozen=True)
class ModuleCheck:
    name: str
    kind: str  # "linear" | "mlp" | "moe"
    layer: int
    tokens: int
    input_source: str  # "random" | "file"
    in_features: int
    out_features: int
    bits: float | None  # None for blocks
    codebook: str | None
    vs_reference: Comparison
    vs_recorded: Comparison | None
    passed: bool
    path: str | None = None  # MoE blocks: "fused" (the fused MoE kernel) or "per-expert" (dense kernel per expert)


@dataclass(frozen=True)
class VerifyReport:
    source: str
    prepared: bool
    gpu: str
    arch: str
    dtype: str
    seed: int
    thresholds: Thresholds
    layers: tuple[int, ...]
    checks: tuple[ModuleCheck, ...] = field(default=())
    moe_path: str = "fused"

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> tuple[ModuleCheck, ...]:
        return tuple(c for c in self.checks if not c.passed)


def compare(got: torch.Tensor, ref: torch.Tensor) -> Comparison:
    import torch

    got, ref = got.double(), ref.double()
    diff = got - ref
    ref_norm = ref.norm().item()
    rel = diff.norm().item() / ref_norm if ref_norm > 0 else (0.0 if diff.abs().max().item() == 0 else math.inf)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    if not torch.isfinite(got).all():
        rel, cos = math.inf, -1.0
    return Comparison(rel, cos, diff.abs().max().item() if diff.numel() else 0.0)


def open_model(path: str, revision: str | None = None):
    """A prepared folder (our manifest) or a source checkpoint (local folder or hub id)."""
    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.prepared import is_prepared, load_prepared

    if is_prepared(path):
        if revision is not None:
            raise UsageError("--revision applies to hub checkpoints, not a prepared folder", path=path)
        return load_prepared(path), True
    return open_checkpoint(path, revision), False


def parse_layers(spec, model) -> tuple[int, ...]:
    """A layer selection (N, 0-3,7,10- or all; `exl3tool.selection`) -> the layer indices, checked against the
    checkpoint."""
    return tuple(selection.parse_layers(spec).resolve((layer.index for layer in model.layers), model.source))


def load_inputs(path: str | None) -> dict[str, torch.Tensor]:
    if path is None:
        return {}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError) as err:
        raise UnreadableInputError(f"cannot read the input file: {str(err).splitlines()[0]}", path=path) from None


def save_outputs(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``<name>.reference`` / ``<name>.kernel`` atomically: a temp file in the same folder, then rename."""
    from safetensors.torch import save_file

    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    os.close(fd)
    try:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def input_width(model, name: str) -> int | None:
    """The activation width module or block ``name`` takes, or None if the checkpoint has no such thing."""
    if name in model.linears:
        return model.linears[name].in_features
    block = model.blocks.get(name)
    if isinstance(block, GatedMLP):
        return block.gate.in_features
    if isinstance(block, MoEBlock):
        return block.router.shape[1]
    return None


class _Inputs:
    """Activations per module: from the input file when it has ``<name>.input``, else seeded random."""

    def __init__(self, file_tensors, tokens, seed, dtype, source):
        self.file, self.tokens, self.seed, self.dtype = file_tensors, tokens, seed, dtype
        self.source, self.device = source, None

    def validate(self, model) -> None:
        """Every ``<name>.input`` for a module of the checkpoint is a float [M, width]: checked before any work."""
        for key, x in self.file.items():
            if not key.endswith(".input"):
                continue
            width = input_width(model, key[: -len(".input")])
            if width is not None and (x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != width
                                      or not x.is_floating_point()):
                raise UsageError(f"input must be a float tensor [M, {width}], got {x.dtype} {list(x.shape)}",
                                 path=self.source, tensor=key)

    def get(self, name: str, width: int) -> tuple[torch.Tensor, str]:
        import torch

        key = f"{name}.input"
        if key in self.file:
            return self.file[key].to(device=self.device, dtype=self.dtype), "file"
        g = torch.Generator().manual_seed(self.seed ^ zlib.crc32(name.encode()))
        return torch.randn(self.tokens, width, generator=g).to(device=self.device, dtype=self.dtype), "random"

    def recorded(self, name: str) -> torch.Tensor | None:
        return self.file.get(f"{name}.output")


def verify(
    model_path: str,
    layers: str | int,
    *,
    tokens: int = 16,
    seed: int = 0,
    input_file: str | None = None,
    save_output: str | None = None,
    thresholds: Thresholds = Thresholds(),
    dtype: str = "float16",
    device: str = "cuda",
    revision: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    moe_path: str = "fused",
) -> VerifyReport:
    """``moe_path``: MoE blocks through the fused MoE kernel ("fused") or the dense kernel per routed expert
    ("per-expert"); every expert projection is also checked on its own with the dense kernel either way."""
    if moe_path not in MOE_PATHS:
        raise UsageError(f"--moe-path must be {' or '.join(MOE_PATHS)}, not {moe_path!r}")
    if tokens < 1:  # arguments first: a typo is answered before torch takes seconds to import
        raise UsageError("--tokens must be at least 1")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be {' or '.join(DTYPES)}")
    selection.parse_layers(layers)

    import torch

    from exl3tool.ops import blocks as kernel_blocks
    from exl3tool.ops.linear import DeviceLinear, linear_forward
    from exl3tool.ops.moe import DeviceMoE, moe_forward, plan_moe
    from exl3tool.reader import reference_forward
    from exl3tool.ops.runtime import require_gpu, target_arch

    file_tensors = load_inputs(input_file)
    model, prepared = open_model(model_path, revision)
    try:
        layer_ids = parse_layers(layers, model)
        inputs = _Inputs(file_tensors, tokens, seed, getattr(torch, dtype), input_file)
        inputs.validate(model)
        gpu = inputs.device = require_gpu(device)
        saved: dict[str, torch.Tensor] = {}
        checks: list[ModuleCheck] = []
        device_linears: dict[str, DeviceLinear] = {}

        loaded: dict = {}  # each linear's tensors, loaded once per layer for both the kernel and the reference

        def load(name: str, _device=None):
            if name not in loaded:
                loaded[name] = model.load_linear(name, gpu)
            return loaded[name]

        def lin(name: str) -> DeviceLinear:
            if name not in device_linears:
                device_linears[name] = DeviceLinear.from_tensors(load(name), gpu)
            return device_linears[name]

        def gated(mlp: GatedMLP) -> kernel_blocks.DeviceGatedMLP:
            return kernel_blocks.DeviceGatedMLP(lin(mlp.gate.name), lin(mlp.up.name), lin(mlp.down.name),
                                                mlp.activation, mlp.activation_limit)

        def record(name, kind, layer, x, source, width_out, kernel_out, info: LinearInfo | None, path=None):
            ref = reference_forward(model, name, x, gpu, load_linear=load)
            recorded = inputs.recorded(name)
            vs_recorded = None
            if recorded is not None:
                vs_recorded = compare(kernel_out, recorded.to(gpu).float()[:, :width_out])
            vs_ref = compare(kernel_out, ref)
            passed = vs_ref.passes(thresholds) and (vs_recorded is None or vs_recorded.passes(thresholds))
            checks.append(ModuleCheck(
                name, kind, layer, x.shape[0], source, x.shape[1], width_out,
                None if info is None else info.bits, None if info is None else info.codebook.value,
                vs_ref, vs_recorded, passed, path))
            if save_output:
                saved[f"{name}.reference"] = ref.float().cpu()
                saved[f"{name}.kernel"] = kernel_out.float().cpu()

        for done, index in enumerate(layer_ids):
            layer: Layer = model.layer(index)
            for info in layer.linears:
                x, source = inputs.get(info.name, info.in_features)
                record(info.name, "linear", index, x, source, info.out_features,
                       linear_forward(x, lin(info.name), torch.float32), info)
            block = layer.mlp
            if isinstance(block, GatedMLP):
                x, source = inputs.get(block.name, block.gate.in_features)
                record(block.name, "mlp", index, x, source, block.down.out_features,
                       kernel_blocks.gated_mlp_forward(x, gated(block)), None)
            elif isinstance(block, MoEBlock):
                width = block.router.shape[1]
                x, source = inputs.get(block.name, width)
                if moe_path == "fused":
                    layer_moe = model.moe(index, device=gpu)
                    try:
                        device_moe = DeviceMoE.from_layer(layer_moe, gpu)
                    except UnsupportedFeatureError as err:  # say what runs it instead
                        raise UnsupportedFeatureError(f"{err.message} (--moe-path per-expert runs it)",
                                                      path=err.path, tensor=err.tensor) from None
                    plan = plan_moe(device_moe, x.shape[0], x.dtype, torch.float32)
                    out = moe_forward(x.contiguous(), plan)
                else:
                    optional = lambda t: None if t is None else model.load_tensor(t.name, gpu)  # noqa: E731
                    out = kernel_blocks.moe_forward(
                        x, model.load_tensor(block.router.name, gpu), block.routing,
                        lambda e: gated(block.experts[e]),
                        shared=None if block.shared_experts is None else gated(block.shared_experts),
                        shared_gate=optional(block.shared_expert_gate),
                        correction_bias=optional(block.correction_bias),
                        router_bias=optional(block.router_bias),
                    )
                record(block.name, "moe", index, x, source, width, out, None, path=moe_path)
            device_linears.clear()
            loaded.clear()
            if progress is not None:
                progress(done + 1, len(layer_ids))
        if save_output:
            save_outputs(save_output, saved)
        return VerifyReport(
            source=str(model_path), prepared=prepared, gpu=torch.cuda.get_device_name(gpu),
            arch=target_arch(gpu), dtype=dtype, seed=seed, thresholds=thresholds, layers=layer_ids,
            checks=tuple(checks), moe_path=moe_path,
        )
    finally:
        model.close()
