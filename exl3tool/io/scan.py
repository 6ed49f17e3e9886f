"""Open a checkpoint header-first: resolve it, read config.json and every safetensors header, read the 0-dim
codebook markers, and build the checked format model. No other tensor data is read here.

    scan_checkpoint(source, revision=None) -> Scan
    Scan.model, Scan.problems, Scan.read(tensor_name) -> bytearray, Scan.problems_for(module) -> list[Problem]
    Scan.check(data_checks=True) -> list[Problem]     every problem, with the suh/svh data checks (what inspect
                                                      reports and prepare refuses on)
"""

from __future__ import annotations

import gc
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from exl3tool.errors import NotFoundError, Problem, ProblemKind, UnreadableInputError
from exl3tool.format import CheckpointModel, FileInfo, LinearInfo, TensorInfo
from exl3tool.io.config import read_config
from exl3tool.io.data_checks import check_scales
from exl3tool.io.files import INDEX, find_weight_files
from exl3tool.io.linears import MARKERS, check_linear, group_tensors
from exl3tool.io.safetensors import SafetensorsHeader, TensorEntry, TensorReader, read_header
from exl3tool.io.source import resolve_source
from exl3tool.io.structure import build_model


@dataclass
class Scan:
    """The result of reading a checkpoint's structure. Holds open file descriptors: `close()` when done."""

    source: str
    root: Path
    model: CheckpointModel
    problems: list[Problem]
    headers: dict[str, SafetensorsHeader]  # file name -> header
    locations: dict[str, tuple[str, TensorEntry]]  # tensor name -> (file name, entry)
    reader: TensorReader = field(default_factory=TensorReader)

    def read(self, tensor: str) -> bytearray:
        """The raw bytes of one tensor."""
        if tensor not in self.locations:
            raise NotFoundError("no such tensor in the checkpoint", tensor=tensor)
        file, entry = self.locations[tensor]
        return self.reader.read(self.headers[file], entry)

    def problems_for(self, module: str) -> list[Problem]:
        return [p for p in self.problems if p.module == module]

    def check(self, data_checks: bool = True) -> list[Problem]:
        found = list(self.problems)
        if data_checks:
            for info in self.model.linears.values():
                found.extend(check_scales(info, self.read))
        return found

    @property
    def complete(self) -> bool:
        return not any(p.kind is ProblemKind.UNREADABLE for p in self.problems)

    def close(self) -> None:
        self.reader.close()


def _read_headers(root: Path, files: list[str], problems: list[Problem]) -> dict[str, SafetensorsHeader]:
    headers = {}
    for name in files:
        try:
            headers[name] = read_header(root / name, name)
        except UnreadableInputError as e:
            problems.append(Problem("safetensors", e.message, name, e.tensor, ProblemKind.UNREADABLE))
    return headers


def _locate(headers, weight_map, problems) -> dict[str, tuple[str, TensorEntry]]:
    locations: dict[str, tuple[str, TensorEntry]] = {}
    for file, header in headers.items():
        for name, entry in header.tensors.items():
            if name in locations:
                problems.append(Problem("duplicate-tensor", f"also stored in {locations[name][0]}", file, name))
                continue
            locations[name] = (file, entry)
            if weight_map is not None and weight_map.get(name) != file:
                listed = weight_map.get(name)
                problems.append(Problem(
                    "index-mismatch", "not listed in the index" if listed is None else f"the index places it in {listed}",
                    file, name))
    if weight_map is not None:
        for name, file in weight_map.items():
            if file in headers and name not in headers[file].tensors and name not in locations:
                problems.append(Problem("missing-tensor", f"missing: the index places it in {file}, which lacks it",
                                        file, name))
    return locations


def _read_markers(locations, headers, reader: TensorReader) -> dict[str, int | None]:
    """Values of the 0-dim int32 codebook markers (the only tensor data the header pass reads)."""
    values: dict[str, int | None] = {}
    for name, (file, entry) in locations.items():
        leaf = name.rpartition(".")[2]
        if leaf in MARKERS and entry.dtype == "I32" and entry.shape == ():
            values[name] = struct.unpack("<i", reader.read(headers[file], entry))[0]
    return values


@contextmanager
def _collector_paused():
    """Reading headers builds millions of small objects and no reference cycles; the cyclic collector would
    rescan them over and over (40% of the time for a header of 300k tensors)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def scan_checkpoint(source: str | Path, revision: str | None = None) -> Scan:
    """Read a checkpoint's structure. Raises UnreadableInputError/UsageError only when nothing can be read
    (no folder, no config.json, not EXL3, no weights); everything else is collected in `Scan.problems`."""
    with _collector_paused():
        return _scan(source, revision)


def _scan(source: str | Path, revision: str | None) -> Scan:
    root = resolve_source(source, revision)
    config, problems = read_config(root)
    weight_files = find_weight_files(root)
    problems.extend(weight_files.problems)
    headers = _read_headers(root, weight_files.files, problems)
    locations = _locate(headers, weight_files.weight_map, problems)
    reader = TensorReader()
    try:
        markers = _read_markers(locations, headers, reader)
    except UnreadableInputError:
        reader.close()
        raise
    tensors = {name: TensorInfo(name, file, e.dtype, e.shape, e.nbytes) for name, (file, e) in locations.items()}
    groups = group_tensors(tensors)
    problems.extend(groups.problems)
    linears: dict[str, LinearInfo] = {}
    for prefix, leaves in groups.linears.items():
        info, found = check_linear(prefix, leaves, markers)
        problems.extend(found)
        if info is not None:
            linears[prefix] = info
    complete = not any(p.kind is ProblemKind.UNREADABLE for p in problems)
    files = [FileInfo(name, h.file_size, len(h.tensors)) for name, h in headers.items()]
    model, found = build_model(config, files, linears, groups.unquantized, complete)
    problems.extend(found)
    if not headers and not problems:
        problems.append(Problem("no-weights", "no readable safetensors file", INDEX, kind=ProblemKind.UNREADABLE))
    return Scan(str(source), root, model, problems, headers, locations, reader)
