"""`prepare_checkpoint`: write a checkpoint in the prepared layout (docs/prepared-layout.md), atomically and
resumably, streaming a bounded chunk at a time (memory stays far below one layer, whatever the model size).

    prepare_checkpoint(source, out, *, layers=None, revision=None, overwrite=False,
                       max_shard_bytes=DEFAULT_MAX_SHARD_BYTES, progress=None) -> PrepareReport
    parse_size("2GB") -> int

How a run stays safe to interrupt: every shard is written under a temporary name inside `OUT/.exl3tool-prepare/`,
fsynced, then renamed into OUT; when all shards of a unit (a decoder layer, or `globals`) are in place, the
unit's manifest fragment is written the same way. `manifest.json` is written last, so a folder without it is
never complete, and a re-run (same source, same options) redoes only the units without a fragment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from exl3tool.errors import CheckpointProblemsError, OutputError, UnreadableInputError, UsageError
from exl3tool.io.config import CONFIG, read_json
from exl3tool.io.reading import open_regular, read_bounded
from exl3tool.io.scan import Scan, scan_checkpoint
from exl3tool.selection import LayerSelection, parse_layers
from exl3tool.version import __version__
from exl3tool.prepared.layout import (
    DEFAULT_MAX_SHARD_BYTES, HASH, HEADER_ALIGN, LAYOUT_VERSION, LOCK_FILE, MANIFEST, REPORT_SCHEMA, SCHEMA,
    SHARD_RE, STATE_DIR, STATE_FILE, STATE_SCHEMA, canonical_json, config_to_json, manifest_digest, shard_name,
)
from exl3tool.prepared.plan import OutTensor, Piece, Unit, plan_units, select_layers

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, the rest works
    fcntl = None

CHUNK = 4 << 20  # bytes per read/hash/write step; the writer holds two such buffers
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class PrepareProgress:
    """Handed to the `progress` callback after every chunk written and every unit finished or skipped."""

    units_done: int
    units_total: int
    bytes_done: int  # tensor bytes of the finished and skipped units plus the current unit's so far
    bytes_total: int
    bytes_written: int  # by this run only (what throughput is measured on)
    unit: str | None  # the unit being written, None at the end
    skipped: bool = False  # this unit was already complete


@dataclass(frozen=True)
class PrepareReport:
    source: str  # as given (folder or hub id)
    path: str  # the resolved source folder
    out: str
    layout_version: int
    fingerprint: str
    layers: tuple[int, ...]  # decoder layers in OUT
    includes_globals: bool  # the head, linears outside the layers and non-layer tensors (not with --layers)
    units: int
    units_written: int
    units_skipped: int  # complete from an earlier run that was interrupted
    files: int
    bytes: int  # all shards in OUT
    bytes_written: int  # by this run
    seconds: float  # the whole run (scan and checks included)
    write_seconds: float  # writing shards (what throughput is measured on)
    up_to_date: bool  # OUT was already complete: nothing written
    resumed: bool

    @property
    def throughput_mb_s(self) -> float | None:
        return self.bytes_written / self.write_seconds / 1e6 if self.bytes_written and self.write_seconds > 0 else None

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items()}
        data["layers"] = list(self.layers)
        tp = self.throughput_mb_s
        data["throughput_mb_s"] = None if tp is None else round(tp, 1)
        data["seconds"], data["write_seconds"] = round(self.seconds, 3), round(self.write_seconds, 3)
        return {"schema": REPORT_SCHEMA, **data}


def parse_size(text: str | int) -> int:
    """'2GB' / '500MB' / '1.5GiB' / '1000000' -> bytes (> 0)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip().lower().replace(" ", "")
        number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = raw[len(number):]
        try:
            value = int(float(number) * _SIZE_UNITS[unit])
        except (ValueError, KeyError):
            raise UsageError(f"size {text!r}: expected a number of bytes or e.g. 500MB, 2GB, 1GiB") from None
    if value <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return value


# --- the source ----------------------------------------------------------------------------------------------


SAMPLES, SAMPLE_BYTES = 32, 4096


def source_fingerprint(scan: Scan) -> dict:
    """Per source file: name, size, the sha256 of its header and of SAMPLES blocks of SAMPLE_BYTES spread evenly
    over its data (all of it when small); plus config.json's sha256. Cheap (a few hundred kB read whatever the
    model size), and a re-conversion changes it even when every shape stays the same. `fingerprint` hashes all."""
    files = []
    for name, header in sorted(scan.headers.items()):
        try:
            with os.fdopen(open_regular(header.path, name), "rb") as f:  # still a regular file, not swapped
                n = int.from_bytes(f.read(8), "little")
                digest = hashlib.sha256(f.read(n)).hexdigest()
                start = 8 + n
                span = header.file_size - start
                sample = hashlib.sha256()
                if span <= SAMPLES * SAMPLE_BYTES:
                    sample.update(os.pread(f.fileno(), span, start))
                else:
                    step = (span - SAMPLE_BYTES) // (SAMPLES - 1)
                    for i in range(SAMPLES):
                        sample.update(os.pread(f.fileno(), SAMPLE_BYTES, start + i * step))
        except OSError as e:
            raise UnreadableInputError(f"cannot read: {e.strerror or e}", path=name) from None
        files.append({"name": name, "size": header.file_size, "header_sha256": digest,
                      "sample_sha256": sample.hexdigest()})
    config_sha = hashlib.sha256(read_bounded(scan.root / CONFIG, str(scan.root / CONFIG))).hexdigest()
    body = {"config_sha256": config_sha, "files": files}
    return {"fingerprint": hashlib.sha256(canonical_json(body)).hexdigest(), **body}


class _SourceReader:
    """Streams source tensors in CHUNK pieces by position (one descriptor per file), alternating between two
    buffers: a chunk's view stays valid while the next one is read (the hash of one overlaps the next read)."""

    def __init__(self, scan: Scan):
        self.scan = scan
        self.fds: dict[str, int] = {}
        self.bufs = (bytearray(CHUNK), bytearray(CHUNK))
        self.turn = 0

    def chunks(self, piece: Piece) -> Iterator[memoryview]:
        file, entry = self.scan.locations[piece.tensor]
        if piece.expand:
            yield memoryview(_expand_signs(self.scan.read(piece.tensor)))
            return
        header = self.scan.headers[file]
        try:
            fd = self.fds.get(file)
            if fd is None:
                fd = self.fds[file] = open_regular(header.path, file)
            pos = entry.begin
            while pos < entry.end:
                self.turn ^= 1
                view = memoryview(self.bufs[self.turn])
                n = os.preadv(fd, [view[: min(CHUNK, entry.end - pos)]], pos)
                if n <= 0:
                    raise UnreadableInputError("file ended while reading tensor data", path=file, tensor=entry.name)
                pos += n
                yield view[:n]
        except OSError as e:
            raise UnreadableInputError(f"cannot read: {e.strerror or e}", path=file, tensor=entry.name) from None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _expand_signs(packed: bytearray) -> bytes:
    import torch

    from exl3tool.reference import unpack_signs

    return unpack_signs(torch.frombuffer(packed, dtype=torch.int16)).numpy().tobytes()


# --- the output folder ---------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data: dict, tmp_dir: Path) -> None:
    tmp = tmp_dir / f"{path.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        # strict JSON, or a loud bug; compact: indented, a 48-layer MoE's manifest took 8x longer to write (Python's
        # encoder instead of C's) and 1.6x the bytes
        f.write(json.dumps(data, separators=(",", ":"), allow_nan=False).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _read_json(path: Path) -> dict | None:
    """A JSON object of ours from OUT, or None for anything else (a FIFO planted there is refused, not read)."""
    try:
        return read_json(path, path.name)
    except UnreadableInputError:
        return None


def _ours(name: str) -> bool:
    return name in (MANIFEST, STATE_DIR) or bool(SHARD_RE.match(name))


def _files_intact(out: Path, entry: dict) -> bool:
    """A finished unit's files are all there with the sizes its fragment records (hashes are the loader's)."""
    try:
        return all((out / f["name"]).stat().st_size == f["size"] for f in entry["files"])
    except (OSError, KeyError, TypeError):
        return False


def _matches_plan(entry: dict, unit: Unit) -> bool:
    try:
        specs = {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in entry["tensors"].items()}
        return (entry["id"] == unit.id and canonical_json(specs) == canonical_json(unit.tensor_specs())
                and canonical_json(entry["structure"]) == canonical_json(unit.structure))
    except (KeyError, TypeError, AttributeError):
        return False


class _Output:
    """OUT while a run owns it: the state folder, the lock, fragments, and shard writing."""

    def __init__(self, out: Path):
        self.out = out
        self.state = out / STATE_DIR
        self.lock_fd: int | None = None
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exl3tool-hash")

    # -- opening ---------------------------------------------------------------------------------------

    def open(self, identity: dict, overwrite: bool) -> tuple[dict[str, dict], bool]:
        """Lock OUT and decide what is already done: ({unit id: finished entry}, resumed). A refusal leaves OUT
        as it found it."""
        created = not self.state.exists()
        try:
            return self._open(identity, overwrite)
        except Exception:
            if created:
                self.close()
                self.remove_state()
            raise

    def _open(self, identity: dict, overwrite: bool) -> tuple[dict[str, dict], bool]:
        out = self.out
        if out.exists() and not out.is_dir():
            raise UsageError("OUT exists and is not a folder", path=out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            foreign = sorted(p.name for p in out.iterdir() if not _ours(p.name))
            if foreign:
                raise UsageError(f"OUT holds files exl3tool prepare did not write (e.g. {foreign[0]!r}); "
                                 "choose a new or empty folder", path=out)
            self.state.mkdir(exist_ok=True)
            self._lock()
            for tmp in self.state.glob("*.tmp"):  # left by a run that was killed
                tmp.unlink()
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", path=e.filename or out) from None
        manifest = _read_json(out / MANIFEST) if (out / MANIFEST).exists() else None
        if manifest is not None and manifest.get("manifest_sha256") != manifest_digest(manifest):
            manifest = None  # edited or damaged: its file list cannot be trusted
        state = _read_json(self.state / STATE_FILE)
        has_manifest = (out / MANIFEST).exists()
        shards = any(SHARD_RE.match(p.name) for p in out.iterdir())
        if overwrite:
            self._clear()
            self._start(identity)
            return {}, False
        if has_manifest:
            self._refuse_other(manifest, identity, "a complete prepared folder")
            units = manifest.get("units")
            units = units if isinstance(units, list) else []
            return {u["id"]: u for u in units if isinstance(u, dict) and isinstance(u.get("id"), str)}, True
        if state is not None or (self.state / STATE_FILE).exists():
            self._refuse_other(state, identity, "an unfinished exl3tool prepare run")
            done = {}
            for frag in sorted(self.state.glob("unit-*.json")):
                entry = _read_json(frag)
                if entry is not None and isinstance(entry.get("id"), str):
                    done[entry["id"]] = entry
            return done, True
        if shards:
            raise UsageError("OUT holds prepared shards without a manifest or run state (unknown source); "
                             "use --overwrite to replace them", path=out)
        self._start(identity)
        return {}, False

    def _refuse_other(self, found: dict | None, identity: dict, what: str) -> None:
        if found is None or found.get("schema") not in (SCHEMA, STATE_SCHEMA):
            raise UsageError(f"OUT holds {what} whose manifest/state cannot be read; use --overwrite to replace it",
                             path=self.out)
        if found.get("layout_version") != identity["layout_version"]:
            raise UsageError(f"OUT holds {what} of layout version {found.get('layout_version')!r} (this exl3tool "
                             f"writes {LAYOUT_VERSION}); use --overwrite to replace it", path=self.out)
        fingerprint = (found.get("source") or {}).get("fingerprint")
        if fingerprint != identity["source"]["fingerprint"]:
            raise UsageError(f"OUT holds {what} from another source checkpoint; use --overwrite to replace it",
                             path=self.out)
        if canonical_json(found.get("options")) != canonical_json(identity["options"]):
            old = found.get("options") or {}
            raise UsageError(
                f"OUT holds {what} made with other options (layers {_layers_text(old.get('layers'))}, max shard "
                f"{old.get('max_shard_bytes')} bytes); re-run with those or use --overwrite", path=self.out)

    def _lock(self) -> None:
        self.lock_fd = os.open(self.state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            return
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock_fd)
            self.lock_fd = None
            raise UsageError("another exl3tool prepare is writing to this folder", path=self.out) from None

    def _clear(self) -> None:
        """--overwrite: the manifest first (the folder stops looking complete), then shards and the state."""
        (self.out / MANIFEST).unlink(missing_ok=True)
        for p in self.out.iterdir():
            if SHARD_RE.match(p.name):
                p.unlink()
        for p in self.state.iterdir():
            if p.name != LOCK_FILE:
                p.unlink()

    def _start(self, identity: dict) -> None:
        _write_json_atomic(self.state / STATE_FILE, {"schema": STATE_SCHEMA, **identity}, self.state)

    def resume_from_manifest(self, identity: dict, done: dict[str, dict]) -> None:
        """A complete OUT that lost files: drop the manifest, keep the intact units as fragments."""
        (self.out / MANIFEST).unlink(missing_ok=True)
        _fsync_dir(self.out)
        self._start(identity)
        for entry in done.values():
            self.save_fragment(entry)

    # -- writing ---------------------------------------------------------------------------------------

    def save_fragment(self, entry: dict) -> None:
        _write_json_atomic(self.state / f"unit-{entry['id']}.json", entry, self.state)

    def write_shard(self, name: str, unit: str, tensors: list[OutTensor], source: _SourceReader,
                    on_bytes: Callable[[int], None]) -> dict:
        ordered = sorted(tensors, key=lambda t: -t.itemsize)  # stable: natural alignment for every tensor
        header: dict = {"__metadata__": {"format": "exl3tool.prepared", "layout_version": str(LAYOUT_VERSION),
                                         "unit": unit}}
        offset = 0
        for t in ordered:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
        tmp = self.state / f"{name}.{os.getpid()}.tmp"
        digest = hashlib.new(HASH)
        pending: deque[Future] = deque()  # hashes in flight, in order; at most one while the next chunk is read
        size = 0
        try:
            with open(tmp, "wb", buffering=0) as f:
                for block in (len(raw).to_bytes(8, "little"), raw):
                    digest.update(block)
                    _write_all(f, memoryview(block))
                    size += len(block)
                for t in ordered:
                    written = 0
                    for piece in t.pieces:
                        for chunk in source.chunks(piece):
                            pending.append(self.hasher.submit(digest.update, chunk))  # hashlib drops the GIL
                            _write_all(f, chunk)
                            while len(pending) > 1:
                                pending.popleft().result()
                            written += len(chunk)
                            on_bytes(len(chunk))
                    if written != t.nbytes:
                        raise UnreadableInputError(f"source data for {t.name} is {written} bytes, not {t.nbytes}",
                                                   tensor=t.name)
                    size += written
                while pending:
                    pending.popleft().result()
                os.fsync(f.fileno())
            os.replace(tmp, self.out / name)
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", path=self.out / name) from None
        finally:
            for future in pending:  # the buffers must not be reused under a running hash
                future.cancel() or future.exception()
            tmp.unlink(missing_ok=True)
        return {"name": name, "size": size, HASH: digest.hexdigest()}

    def finish(self, manifest: dict) -> None:
        """Sweep shards no unit owns, then the manifest (atomically, last), then the state folder."""
        keep = {f["name"] for u in manifest["units"] for f in u["files"]}
        for p in self.out.iterdir():
            if SHARD_RE.match(p.name) and p.name not in keep:
                p.unlink()
        _fsync_dir(self.out)
        _write_json_atomic(self.out / MANIFEST, manifest, self.state)
        self.remove_state()

    def remove_state(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)

    def close(self) -> None:
        self.hasher.shutdown(wait=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def _write_all(f, view: memoryview) -> None:
    while view:
        n = f.write(view)
        view = view[n:]


def _layers_text(layers) -> str:
    return "all" if layers is None else ",".join(map(str, layers))


def _shards(unit: Unit, max_bytes: int) -> list[list[OutTensor]]:
    """Consecutive tensors per shard, each shard at most `max_bytes` of data unless one tensor alone is larger."""
    shards: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    size = 0
    for t in unit.tensors:
        if current and size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


# --- the run -------------------------------------------------------------------------------------------------


def _unit_entry(unit: Unit, files: list[dict], tensor_files: dict[str, str]) -> dict:
    tensors = {t.name: {"file": tensor_files[t.name], "dtype": t.dtype, "shape": list(t.shape)}
               for t in unit.tensors}
    return {"id": unit.id, "kind": unit.kind, "files": files, "tensors": tensors, "structure": unit.structure}


def _refuse_unsound(scan: Scan) -> None:
    problems = scan.check(data_checks=True)
    if problems:
        error = CheckpointProblemsError(
            problems, message=f"refusing to prepare an unsound checkpoint ({len(problems)} problem(s), as "
            f"`exl3tool inspect` reports them); first: {problems[0].message}")
        error.path = str(scan.root / problems[0].path) if problems[0].path else str(scan.root)  # name the folder
        raise error


def prepare_checkpoint(
    source: str | Path,
    out: str | Path,
    *,
    layers: str | LayerSelection | list[int] | None = None,
    revision: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[PrepareProgress], None] | None = None,
) -> PrepareReport:
    """Write the prepared layout of `source` (a folder or hub id) into the folder `out`.

    Refuses (CheckpointProblemsError) a checkpoint `exl3tool inspect` finds problems in, and
    (UnsupportedFeatureError) experts whose gate and up differ in K or codebook. `layers` ("0-3,7,10-" or
    indices) limits the run to those decoder layers, without the head and the non-layer tensors ("all":
    everything). An OUT holding another source's (or other options') output is refused unless `overwrite`; an
    interrupted run of the same source and options is resumed. `progress` is called after each chunk (see
    PrepareProgress)."""
    started = time.perf_counter()
    max_bytes = parse_size(max_shard_bytes)
    out = Path(out).expanduser()
    scan = scan_checkpoint(source, revision)
    reader = _SourceReader(scan)
    output = _Output(out)
    try:
        if out.exists() and out.resolve() == scan.root.resolve():
            raise UsageError("OUT is the source checkpoint's own folder; choose another", path=out)
        _refuse_unsound(scan)
        if isinstance(layers, (str, int, LayerSelection)):  # the CLI grammar; 'all': everything, head included
            chosen = parse_layers(layers)
            have = (layer.index for layer in scan.model.layers)
            layers = None if chosen.ranges is None else chosen.resolve(have, str(source))
        selected = select_layers(scan.model, layers)
        units = plan_units(scan.model, selected)
        fingerprint = source_fingerprint(scan)
        identity = {"layout_version": LAYOUT_VERSION,
                    "source": {"model": str(source), "path": str(scan.root.resolve()), "revision": revision,
                               **fingerprint},
                    "options": {"layers": selected, "max_shard_bytes": max_bytes}}
        try:
            return _write(source, scan, out, identity, units, output, reader, overwrite, max_bytes, progress, started)
        except OSError as e:  # source reads raise UnreadableInputError: an OSError here is about OUT
            raise OutputError(f"cannot write: {e.strerror or e}", path=e.filename or out) from None
    finally:
        reader.close()
        output.close()
        scan.close()


def _write(source, scan: Scan, out: Path, identity: dict, units: list[Unit], output: _Output, reader: _SourceReader,
           overwrite: bool, max_bytes: int, progress, started: float) -> PrepareReport:
    """Open OUT, skip the units already done, write the rest, then the manifest."""
    done, resumed = output.open(identity, overwrite)
    had_manifest = (out / MANIFEST).exists()
    finished = {u.id: done[u.id] for u in units
                if u.id in done and _matches_plan(done[u.id], u) and _files_intact(out, done[u.id])}
    if had_manifest and len(finished) == len(units):
        output.remove_state()
        return _report(source, scan, out, identity, units, finished, 0, 0, started, 0.0, True, False)
    if had_manifest:
        output.resume_from_manifest(identity, finished)

    total = sum(u.nbytes for u in units)
    counters = {"done": 0, "written": 0, "units": 0}

    def tell(unit: str | None, skipped: bool = False) -> None:
        if progress is not None:
            progress(PrepareProgress(counters["units"], len(units), counters["done"], total, counters["written"],
                                     unit, skipped))

    def on_bytes(n: int) -> None:
        counters["done"] += n
        counters["written"] += n
        tell(current)

    current = None
    tell(None)
    entries: list[dict] = []
    write_started = time.perf_counter()
    file_bytes = 0
    for unit in units:
        current = unit.id
        if unit.id in finished:
            entries.append(finished[unit.id])
            counters["done"] += unit.nbytes
            counters["units"] += 1
            tell(unit.id, skipped=True)
            continue
        files, tensor_files = [], {}
        for part, tensors in enumerate(_shards(unit, max_bytes)):
            name = shard_name(unit.id, part)
            files.append(output.write_shard(name, unit.id, tensors, reader, on_bytes))
            file_bytes += files[-1]["size"]
            tensor_files.update((t.name, name) for t in tensors)
        entry = _unit_entry(unit, files, tensor_files)
        output.save_fragment(entry)
        entries.append(entry)
        counters["units"] += 1
        tell(unit.id)
    write_seconds = time.perf_counter() - write_started
    manifest = {
        "schema": SCHEMA, "layout_version": LAYOUT_VERSION, "created_by": f"exl3tool {__version__}",
        **identity, "config": config_to_json(scan.model.config),
        "source_config": read_json(scan.root / CONFIG, CONFIG), "units": entries,
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    output.finish(manifest)
    tell(None)
    return _report(source, scan, out, identity, units, {e["id"]: e for e in entries}, len(units) - len(finished),
                   file_bytes, started, write_seconds, False, resumed and bool(finished))


def _report(source, scan, out, identity, units, entries, written, file_bytes, started, write_seconds, up_to_date,
            resumed) -> PrepareReport:
    files = [f for u in units for f in entries[u.id]["files"]]
    return PrepareReport(
        source=str(source), path=str(scan.root.resolve()), out=str(out.resolve()), layout_version=LAYOUT_VERSION,
        fingerprint=identity["source"]["fingerprint"],
        layers=tuple(u.structure["index"] for u in units if u.kind == "layer"),
        includes_globals=any(u.kind == "globals" for u in units), units=len(units), units_written=written,
        units_skipped=len(units) - written, files=len(files), bytes=sum(f["size"] for f in files),
        bytes_written=file_bytes, seconds=time.perf_counter() - started, write_seconds=write_seconds,
        up_to_date=up_to_date, resumed=resumed,
    )
