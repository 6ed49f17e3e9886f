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
    Checkpoint.moe(layer, device=None) -> MoELayer       the experts stacked in memory exactly as prepare does

Lookups, block tensors, moe() and the reference come from `exl3tool.reader.CheckpointReader`, shared with
prepared folders.

Anything with problems is refused with CheckpointProblemsError (listing them) rather than decoded. A
Checkpoint keeps file descriptors open: use it as a context manager or call close().
"""

from __future__ import annotations

from pathlib import Path

import torch

from exl3tool import reference
from exl3tool.errors import CheckpointProblemsError, NotFoundError, Problem
from exl3tool.format import LinearInfo, LinearTensors, MoEBlock
from exl3tool.io.config import GLOBAL_BLOCKERS
from exl3tool.io.data_checks import check_scales
from exl3tool.io.scan import Scan, scan_checkpoint
from exl3tool.reader import CheckpointReader, stack_group

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def open_checkpoint(path: str | Path, revision: str | None = None) -> "Checkpoint":
    """Open the EXL3 checkpoint at `path` (a folder, or a Hugging Face repo id fetched through the hub cache)."""
    return Checkpoint(scan_checkpoint(path, revision))


class Checkpoint(CheckpointReader):
    def __init__(self, scan: Scan):
        self._scan = scan
        self.source, self.root, self.model = scan.source, scan.root, scan.model
        self._data_problems: dict[str, list[Problem]] = {}

    @property
    def problems(self) -> list[Problem]:
        return list(self._scan.problems)

    def check(self) -> list[Problem]:
        """Every problem: the header checks plus the data checks of every linear (reads all suh/svh)."""
        found = list(self._scan.problems)
        for info in self.linears.values():
            found.extend(self._scale_problems(info))
        return found

    def _missing(self, name: str, what: str):
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

    def _group_tensors(self, block: MoEBlock, g: int, ids: list[int], device) -> dict[str, torch.Tensor]:
        return stack_group(self.load_linear, block, ids, device)

    # --- lifetime --------------------------------------------------------------------------------------

    def close(self) -> None:
        self._scan.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
