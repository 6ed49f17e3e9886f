"""The public entry point: open an EXL3 checkpoint, look at its structure, load and decode it in fp32.

    open_checkpoint(path, revision=None) -> Checkpoint        path: local folder or Hugging Face repo id

    Checkpoint.model / .config / .layers / .linears / .blocks / .head     the format model (exl3tool.format)
    Checkpoint.problems                     problems found reading headers and markers (nothing raised for them)
    Checkpoint.check() -> list[Problem]     all problems, including data checks (NaN/Inf in suh/svh, ...)
    Checkpoint.linear(name) -> LinearInfo
    Checkpoint.block(name) -> GatedMLP | MoEBlock      e.g. "model.layers.0.mlp", "...mlp.experts.3"
    Checkpoint.layer(n) -> Layer                       its EXL3 linears (`.linears`) and blocks (`.blocks`)
    Checkpoint.load_tensor(name, device=None) -> Tensor                  any stored tensor, its own dtype
    Checkpoint.load_linear(name, device=None) -> LinearTensors           legacy su/sv expanded to +-1 fp16
    Checkpoint.dequantize(module_name, device=None) -> Tensor            fp32 [out, in], true sizes
    Checkpoint.reference_forward(name, x, device=None) -> Tensor         fp32; an EXL3 linear or a whole
        dense-MLP / MoE block (router, top-k, renormalisation per config, SiLU-gated experts, shared experts)

Anything with problems is refused with CheckpointProblemsError (listing them) rather than decoded. A
Checkpoint keeps file descriptors open: use it as a context manager or call close().
"""

from __future__ import annotations

from pathlib import Path

import torch

from exl3tool import reference
from exl3tool.errors import CheckpointProblemsError, NotFoundError, Problem, UsageError
from exl3tool.format import Block, GatedMLP, Layer, LinearInfo, LinearTensors, MoEBlock, TensorInfo
from exl3tool.io.config import GLOBAL_BLOCKERS
from exl3tool.io.data_checks import check_scales
from exl3tool.io.scan import Scan, scan_checkpoint

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def open_checkpoint(path: str | Path, revision: str | None = None) -> "Checkpoint":
    """Open the EXL3 checkpoint at `path` (a folder, or a Hugging Face repo id fetched through the hub cache)."""
    return Checkpoint(scan_checkpoint(path, revision))


class Checkpoint:
    def __init__(self, scan: Scan):
        self._scan = scan
        self.source, self.root, self.model = scan.source, scan.root, scan.model
        self._data_problems: dict[str, list[Problem]] = {}

    # --- structure -------------------------------------------------------------------------------------

    config = property(lambda self: self.model.config)
    layers = property(lambda self: self.model.layers)
    linears = property(lambda self: self.model.linears)
    blocks = property(lambda self: self.model.blocks)
    head = property(lambda self: self.model.head)

    @property
    def problems(self) -> list[Problem]:
        return list(self._scan.problems)

    def check(self) -> list[Problem]:
        """Every problem: the header checks plus the data checks of every linear (reads all suh/svh)."""
        found = list(self._scan.problems)
        for info in self.linears.values():
            found.extend(self._scale_problems(info))
        return found

    def linear(self, name: str) -> LinearInfo:
        if name not in self.linears:
            self._raise_missing(name, "EXL3 linear")
        return self.linears[name]

    def block(self, name: str) -> Block:
        if name not in self.blocks:
            self._raise_missing(name, "MLP or MoE block")
        return self.blocks[name]

    def layer(self, index: int) -> Layer:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise NotFoundError(f"no layer {index}; layers are {self._layer_range()}")

    def _layer_range(self) -> str:
        return f"{self.layers[0].index}..{self.layers[-1].index}" if self.layers else "none"

    def _raise_missing(self, name: str, what: str):
        problems = self._scan.problems_for(name)
        if problems:
            raise CheckpointProblemsError(problems)
        raise NotFoundError(f"no {what} of that name in the checkpoint", path=self._scan.source, tensor=name)

    # --- loading ---------------------------------------------------------------------------------------

    def load_tensor(self, name: str, device=None) -> torch.Tensor:
        if name not in self._scan.locations:
            raise NotFoundError("no such tensor in the checkpoint", path=self._scan.source, tensor=name)
        _, entry = self._scan.locations[name]
        data = self._scan.read(name)
        tensor = torch.frombuffer(data, dtype=TORCH_DTYPES[entry.dtype]) if data else \
            torch.empty(0, dtype=TORCH_DTYPES[entry.dtype])
        tensor = tensor.reshape(entry.shape)
        return tensor if device is None else tensor.to(device)

    def _scale_problems(self, info: LinearInfo) -> list[Problem]:
        if info.name not in self._data_problems:
            self._data_problems[info.name] = check_scales(info, self._scan.read)
        return self._data_problems[info.name]

    def load_linear(self, name: str, device=None) -> LinearTensors:
        """The tensors of one EXL3 linear; CheckpointProblemsError if it (or the checkpoint) has problems."""
        info = self.linear(name)
        blockers = [p for p in self._scan.problems if p.check in GLOBAL_BLOCKERS]
        blockers += self._scan.problems_for(name) + self._scale_problems(info)
        if blockers:
            raise CheckpointProblemsError(blockers)
        load = lambda leaf: self.load_tensor(info.tensor_name(leaf), device)  # noqa: E731
        suh = load("suh") if "suh" in info.tensors else reference.unpack_signs(load("su"))
        svh = load("svh") if "svh" in info.tensors else reference.unpack_signs(load("sv"))
        return LinearTensors(info, load("trellis"), suh, svh, load("bias") if info.has_bias else None)

    def _mlp_tensors(self, mlp: GatedMLP, device) -> reference.GatedMLPTensors:
        gate, up, down = (self.load_linear(lin.name, device) for lin in mlp.linears)
        return reference.GatedMLPTensors(gate, up, down, mlp.activation)

    def _optional(self, info: TensorInfo | None, device) -> torch.Tensor | None:
        return None if info is None else self.load_tensor(info.name, device)

    # --- reference -------------------------------------------------------------------------------------

    def dequantize(self, module_name: str, device=None) -> torch.Tensor:
        """fp32 weight of an EXL3 linear in HF orientation [out_features, in_features]."""
        return reference.dequantize(self.load_linear(module_name, device))

    def reference_forward(self, module_or_block_name: str, x: torch.Tensor, device=None) -> torch.Tensor:
        """fp32 output of an EXL3 linear or a block (dense MLP, MoE block, one expert, shared experts) for
        x [M, in] (true size, any float dtype). Runs on `device` (default: x's device)."""
        name = module_or_block_name
        device = x.device if device is None else torch.device(device)
        x = x.to(device)
        if name in self.linears:
            info = self.linears[name]
            self._check_input(x, info.in_features, name)
            return reference.linear_forward(x, self.load_linear(name, device))
        block = self.block(name)
        if isinstance(block, GatedMLP):
            self._check_input(x, block.gate.in_features, name)
            return reference.gated_mlp_forward(x, self._mlp_tensors(block, device))
        return self._moe_forward(block, x, device)

    def _moe_forward(self, block: MoEBlock, x: torch.Tensor, device) -> torch.Tensor:
        router = self.load_tensor(block.router.name, device)
        self._check_input(x, router.shape[1], block.name)
        shared = None if block.shared_experts is None else self._mlp_tensors(block.shared_experts, device)
        return reference.moe_forward(
            x, router, block.routing, lambda e: self._mlp_tensors(block.experts[e], device),
            shared=shared, shared_gate=self._optional(block.shared_expert_gate, device),
            correction_bias=self._optional(block.correction_bias, device),
        )

    @staticmethod
    def _check_input(x: torch.Tensor, width: int, name: str) -> None:
        if x.dim() != 2 or x.shape[1] != width or not x.is_floating_point():
            raise UsageError(f"input must be a float tensor [M, {width}], got {x.dtype} {list(x.shape)}", tensor=name)

    # --- lifetime --------------------------------------------------------------------------------------

    def close(self) -> None:
        self._scan.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
