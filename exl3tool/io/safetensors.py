"""A strict safetensors header reader and a positional tensor reader (no torch, no memory map).

The header is parsed and validated completely (dtypes, shapes, offsets that tile the data section exactly, the
file long enough) before anything trusts it; tensor bytes are then read on request with `pread`, so reading a
whole checkpoint's structure costs one small read per file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from exl3tool.errors import UnreadableInputError
from exl3tool.io.reading import brief, loads_strict, open_regular

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
WIDE_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # the floats torch computes with as they are
FLOAT_DTYPES = WIDE_FLOAT_DTYPES | {"F8_E4M3", "F8_E5M2"}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    display_name: str  # relative to the checkpoint folder, used in messages
    file_size: int
    tensors: dict[str, TensorEntry]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parse_entry(name: str, raw: object, fail) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(raw, dict):
        fail("header entry is not an object", name)
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        fail(f"unknown dtype {brief(dtype)}", name)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        fail(f"malformed shape {brief(shape)}", name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        fail(f"malformed data_offsets {brief(offsets)}", name)
    begin, end = offsets
    shape = tuple(shape)
    if end - begin != _numel(shape) * DTYPE_SIZES[dtype]:
        fail(f"data_offsets span {end - begin} bytes but {dtype} {list(shape)} needs "
             f"{_numel(shape) * DTYPE_SIZES[dtype]}", name)
    return dtype, shape, begin, end


def read_header(path: Path, display_name: str) -> SafetensorsHeader:
    """Parse and validate the header of `path`; UnreadableInputError naming the file (and tensor) otherwise."""

    def fail(message: str, tensor: str | None = None):
        raise UnreadableInputError(message, path=display_name, tensor=tensor)

    fd = open_regular(path, display_name)  # a FIFO or a device is refused, never read
    try:
        file_size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            fail(f"not a safetensors file: {file_size} bytes, shorter than the 8-byte header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            fail(f"not a safetensors file or truncated: header length {header_len}, file size {file_size}")
        raw = os.pread(fd, header_len, 8)
        if len(raw) < header_len:
            fail(f"truncated while reading: the header is {header_len} bytes, {len(raw)} could be read")
    except OSError as e:
        fail(f"cannot read: {e.strerror or e}")
    finally:
        os.close(fd)
    try:
        header = loads_strict(raw, display_name, check_depth=False)  # entries are type-checked, never walked
    except UnreadableInputError as e:
        fail(f"malformed safetensors header: {e.message.removeprefix('malformed JSON: ')}")
    if not isinstance(header, dict):
        fail("malformed safetensors header: not a JSON object")
    metadata = header.get("__metadata__", {})  # the safetensors library refuses a file whose metadata is not
    if not isinstance(metadata, dict):        # a map of strings to strings
        fail(f"__metadata__ is {brief(metadata)}, not a map of strings to strings")
    odd = next((k for k, v in metadata.items() if not isinstance(v, str)), None)
    if odd is not None:
        fail(f"__metadata__ value {brief(odd)} is {brief(metadata[odd])}, not a string")

    data_start = 8 + header_len
    data_size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _parse_entry(name, entry, fail)
        tensors[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
        spans.append((begin, end, name))
    # the data section must be covered exactly: no overlap, no hole, nothing missing at the end
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            fail(("overlaps the previous tensor" if begin < cursor else f"leaves a gap before byte {begin}"), name)
        cursor = end
    if cursor > data_size:
        cut = next(name for _, end, name in spans if end > data_size)  # the first tensor the cut reaches
        fail(f"truncated: the header describes {cursor} bytes of tensor data, the file holds {data_size}", cut)
    if cursor < data_size:
        fail(f"{data_size - cursor} bytes after the last tensor that no header entry describes")
    return SafetensorsHeader(Path(path), display_name, file_size, tensors)


class TensorReader:
    """Reads tensor bytes by position. Keeps one descriptor per file open until `close()`."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def read(self, header: SafetensorsHeader, entry: TensorEntry) -> bytearray:
        try:
            fd = self._fds.get(header.path)
            if fd is None:
                fd = self._fds[header.path] = open_regular(header.path, header.display_name)
            buf = bytearray(entry.nbytes)
            view, done = memoryview(buf), 0
            while done < entry.nbytes:  # pread may return less than asked for large reads
                n = os.preadv(fd, [view[done:]], entry.begin + done)
                if n <= 0:
                    raise UnreadableInputError("file ended while reading tensor data", path=header.display_name,
                                               tensor=entry.name)
                done += n
            return buf
        except OSError as e:
            raise UnreadableInputError(f"cannot read: {e.strerror or e}", path=header.display_name,
                                       tensor=entry.name) from None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
