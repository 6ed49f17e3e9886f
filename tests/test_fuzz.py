"""Hostile files, generated on the fly from the genuine fixtures: special files where a regular one belongs,
nesting, wrong types, absurd sizes, truncations and random byte flips in safetensors headers.

Every case runs `inspect`, `inspect -f json` and `prepare -f json` in one child process whose address space is
capped (an unbounded read fails instead of swapping) under a per-command deadline (a blocked open fails instead
of hanging). Each must exit with the case's code (a byte flip's code comes from an oracle: 0 only when the header
still parses to the same tensors), print no traceback, write strict JSON, and a refused prepare writes nothing.
EXL3TOOL_FUZZ_SEED varies the random cases (default 0, so CI is repeatable).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from helpers import EXAMPLE, FIXTURES, ROOT

SEED = int(os.environ.get("EXL3TOOL_FUZZ_SEED", "0"))
MEMORY_LIMIT = 3 << 30  # address space of the child: far above what inspect/prepare of these need
DEADLINE_S = 30  # per command; each takes well under a second
BASES = {"moe": EXAMPLE, "sharded": FIXTURES / "llama_mcg"}
SINGLE, SHARD, INDEX = "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True)
class Case:
    id: str
    base: str
    mutate: Callable[[Path], None]
    exit_code: int
    words: str = ""  # in the error line (exit 2 raised) or in some problem's message


# --- mutations -----------------------------------------------------------------------------------------------

def replace_with(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        make(path)
    return mutate


def fifo(path: Path) -> None:
    os.mkfifo(path)


def dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def loop(path: Path) -> None:
    path.symlink_to(path.name)


def folder(path: Path) -> None:
    path.mkdir()


def edit_json(name: str, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        data = edit(data) or data
        (folder / name).write_text(json.dumps(data) if not isinstance(data, str) else data)
    return mutate


def set_key(**values) -> Callable[[dict], None]:
    return lambda config: config.update(values)


def raw_text(name: str, transform: Callable[[str], str]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        (folder / name).write_text(transform((folder / name).read_text()))
    return mutate


def header_edit(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rewrite a safetensors header (data section unchanged)."""
    def mutate(folder: Path) -> None:
        raw = (folder / name).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        edit(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        (folder / name).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return mutate


def set_bytes(name: str, offset: int, data: bytes) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        raw = bytearray((folder / name).read_bytes())
        raw[offset:offset + len(data)] = data
        (folder / name).write_bytes(bytes(raw))
    return mutate


def truncate(name: str, size: int) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        raw = (folder / name).read_bytes()
        (folder / name).write_bytes(raw[:size])
    return mutate


def rename_shards_to(total: int) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        (folder / INDEX).unlink()
        for i, path in enumerate(sorted(folder.glob("model-*.safetensors")), start=1):
            path.rename(folder / f"model-{i:05d}-of-{total:08d}.safetensors")
    return mutate


DEEP = "[" * 5000 + "]" * 5000


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


# --- the cases -----------------------------------------------------------------------------------------------

def _special_files() -> list[Case]:
    cases = []
    for kind, make, words in (("fifo", fifo, "a FIFO, not a regular file"),
                              ("devzero", dev_zero, "a character device, not a regular file"),
                              ("loop", loop, "a symlink loop"), ("folder", folder, "a folder, not a regular file")):
        cases += [
            Case(f"config-{kind}", "moe", replace_with("config.json", make), 2, f"config.json: {words}"),
            Case(f"single-{kind}", "moe", replace_with(SINGLE, make), 2, words),
            Case(f"shard-{kind}", "sharded", replace_with(SHARD, make), 2, f"the index names {SHARD!r}, {words}"),
            Case(f"index-{kind}", "sharded", replace_with(INDEX, make), 2, f"{INDEX}: {words}"),
            Case(f"side-config-{kind}", "moe", replace_with("quantization_config.json", make), 2, words),
        ]
    return [c for c in cases if not (c.id == "side-config-loop")]  # a loop there is simply no side file


def _structure() -> list[Case]:
    nested = lambda text: text.replace('"hidden_size":', f'"deep": {DEEP}, "hidden_size":', 1)  # noqa: E731
    return [
        Case("config-deep", "moe", raw_text("config.json", nested), 2, "config.json: malformed JSON: nested"),
        Case("index-deep", "sharded", edit_json(INDEX, lambda d: json.dumps(d).replace("{", '{"x": ' + DEEP + ", ", 1)),
             2, "malformed JSON: nested"),
        Case("header-deep", "moe", header_edit(SINGLE, lambda h: h[_first_tensor(h)].update(shape=[[[[[[1]]]]]])),
             2, "malformed shape a list of 1 item(s)"),
        Case("header-deeper", "moe", set_bytes(SINGLE, 8, b'{"a":' + b"[" * 3000), 2, "malformed safetensors header"),
        Case("header-dtype-list", "moe", header_edit(SINGLE, lambda h: h[_first_tensor(h)].update(dtype=["BF16"])),
             2, "unknown dtype ['BF16']"),
        Case("header-metadata-int", "moe", header_edit(SINGLE, lambda h: h.update(__metadata__={"format": 1})),
             2, "__metadata__ value 'format' is 1, not a string"),
        Case("header-nul-name", "moe", header_edit(SINGLE, lambda h: h.update(
            {"model.layers.0.self_attn.q_proj\x00.suh": h.pop("model.layers.0.self_attn.q_proj.suh")})), 1,
             "missing: every EXL3 linear has suh"),
        Case("header-length-huge", "moe", set_bytes(SINGLE, 0, struct.pack("<Q", 1 << 63)), 2, "header length"),
        Case("header-shape-huge", "moe", header_edit(SINGLE, lambda h: h[_first_tensor(h)].update(
            shape=[1 << 40, 1 << 40])), 2, "data_offsets span"),
        Case("index-map-list", "sharded", edit_json(INDEX, lambda d: d.update(weight_map=[SHARD])), 2,
             "weight_map must map tensor names to file names"),
        Case("index-value-int", "sharded", edit_json(INDEX, lambda d: d["weight_map"].update({"lm_head.svh": 3})), 2,
             "weight_map must map"),
        Case("index-outside", "sharded", edit_json(INDEX, lambda d: d["weight_map"].update(
            {"lm_head.svh": "../../x.safetensors"})), 2, "a path outside the checkpoint folder"),
        Case("index-nul", "sharded", edit_json(INDEX, lambda d: d["weight_map"].update({"lm_head.svh": "a\x00b"})), 2,
             "not a file name"),
        Case("config-not-object", "moe", raw_text("config.json", lambda t: f"[{t}]"), 2, "not a JSON object"),
    ]


def _values() -> list[Case]:
    cases = [
        Case("layers-1e9", "moe", edit_json("config.json", set_key(num_hidden_layers=10**9)), 1,
             "num_hidden_layers = 1000000000 is not an integer from 1 to"),
        Case("layers-9999", "moe", edit_json("config.json", set_key(num_hidden_layers=9999)), 1,
             "layers 2..9998 of 9999 are missing"),
        Case("experts-1e12", "moe", edit_json("config.json", set_key(num_experts=10**12)), 1, "num_experts = "),
        Case("top-k", "moe", edit_json("config.json", set_key(num_experts_per_tok=100)), 1,
             "num_experts_per_tok = 100 is more than the 4 experts"),
        Case("dense-model-type", "moe", edit_json("config.json", set_key(model_type="llama")), 1,
             "'llama' is a dense architecture"),
        Case("shards-1e8", "sharded", rename_shards_to(99_999_999), 2, "one of 99999999 shards"),
    ]
    for word in ("NaN", "Infinity", "-Infinity", "1e400"):
        cases.append(Case(f"bits-{word}", "moe", raw_text("config.json", lambda t, w=word: t.replace(
            '"bits": 4.0', f'"bits": {w}', 1)), 2, "config.json: malformed JSON: "))
    rng = random.Random(SEED)
    keys = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "head_dim", "vocab_size", "num_key_value_heads", "model_type")
    wrong = ([1], {"a": 1}, "12", 1.5, -3, True, [[[[[1]]]]], 10**30)
    for i in range(12):
        key, value = rng.choice(keys), rng.choice(wrong)
        if key == "model_type" and isinstance(value, str):
            value = 7
        cases.append(Case(f"type-{i}-{key}", "moe", edit_json("config.json", set_key(**{key: value})), 1,
                          f"{key} = "))
    return cases


def _header(raw: bytes) -> dict | None:
    """What a lenient reader makes of a safetensors header (None: it cannot), metadata aside."""
    try:
        n = struct.unpack("<Q", raw[:8])[0]
        if 8 + n > len(raw):
            return None
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (ValueError, struct.error):
        return None
    if not isinstance(header, dict):
        return None
    meta = header.pop("__metadata__", {})
    ok = isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    return header if ok else None


def _outside_names(header: bytes) -> list[int]:
    """Offsets in a header's JSON that are not inside a key string. A flip inside a name can rename a norm
    weight, which no check can tell from the real one; anywhere else it changes a dtype, a shape, an offset or
    the syntax, which the checks must catch."""
    inside = set()
    for m in re.finditer(rb'"((?:[^"\\]|\\.)*)"\s*:', header):
        inside.update(range(m.start(1), m.end(1)))
    return [i for i in range(len(header)) if i not in inside]


def _header(raw: bytes) -> dict | None:
    """What a lenient reader makes of a safetensors header (None: it cannot)."""
    try:
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n].decode("utf-8")) if 8 + n <= len(raw) else None
    except (ValueError, struct.error):
        return None
    return header if isinstance(header, dict) else None


def _random_bytes() -> list[Case]:
    rng = random.Random(SEED + 1)
    cases = []
    for base, name in (("moe", SINGLE), ("sharded", SHARD)):
        raw = (BASES[base] / name).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        original = _header(raw)
        places = list(range(8)) + [8 + i for i in _outside_names(raw[8:8 + n])]
        for i in range(12):
            at = rng.choice(places)
            byte = bytes([rng.choice([b for b in range(256) if b != raw[at]])])
            same = _header(raw[:at] + byte + raw[at + 1:]) == original  # e.g. a space of the padding -> a tab
            cases.append(Case(f"flip-{base}-{i}-at{at}", base, set_bytes(name, at, byte), 0 if same else -1))
        for i in range(4):
            size = rng.randrange(0, len(raw))
            cases.append(Case(f"truncate-{base}-{i}-to{size}", base, truncate(name, size), 2))
    return cases


CASES = _special_files() + _structure() + _values() + _random_bytes()
COMMANDS = {"inspect": ["inspect", "{ckpt}"], "inspect-json": ["inspect", "{ckpt}", "-f", "json"],
            "prepare-json": ["prepare", "{ckpt}", "{out}", "-f", "json"]}


# --- the child process ---------------------------------------------------------------------------------------

def _drive(plan_file: str, results_file: str) -> None:
    """Run every planned command in this process, under a memory cap and a deadline each; write the results."""
    import resource
    import signal
    import time

    from typer.testing import CliRunner

    from exl3tool.cli import app

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    class Overdue(BaseException):  # not an Exception: no handler in the tool may turn a hang into an exit code
        pass

    def overdue(*_):
        raise Overdue(f"still running after {DEADLINE_S} s")

    signal.signal(signal.SIGALRM, overdue)
    results = {}
    for key, args in json.loads(Path(plan_file).read_text()).items():
        start = time.perf_counter()
        signal.alarm(DEADLINE_S)
        try:
            r = CliRunner().invoke(app, args)
            error = None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)
            results[key] = {"exit": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "exception": error}
        except Overdue as e:
            results[key] = {"exit": None, "stdout": "", "stderr": "", "exception": repr(e)}
        finally:
            signal.alarm(0)
        results[key]["seconds"] = time.perf_counter() - start
    results["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(results_file).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    plan = {}
    for case in CASES:
        ckpt = root / case.id / "ckpt"
        shutil.copytree(BASES[case.base], ckpt, ignore=shutil.ignore_patterns("exllamav3_outputs*"))
        case.mutate(ckpt)
        for command, args in COMMANDS.items():
            plan[f"{case.id}/{command}"] = [a.format(ckpt=ckpt, out=root / case.id / "out") for a in args]
    (root / "plan.json").write_text(json.dumps(plan))
    code = "import sys; sys.path[:0] = ['tests']; import test_fuzz; test_fuzz._drive(*sys.argv[1:])"
    child = subprocess.run([sys.executable, "-c", code, str(root / "plan.json"), str(root / "results.json")],
                           cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S * len(plan))
    assert child.returncode == 0, child.stderr[-3000:]
    return root, json.loads((root / "results.json").read_text())


def _strict(text: str) -> dict:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hostile_file(outcomes, case):
    root, results = outcomes
    runs = {command: results[f"{case.id}/{command}"] for command in COMMANDS}
    for command, run in runs.items():
        assert run["exception"] is None, (command, run["exception"])
        assert "Traceback" not in run["stdout"] + run["stderr"], command
        assert run["seconds"] < 10, (command, run["seconds"])
        if case.exit_code >= 0:
            assert run["exit"] == case.exit_code, (command, run["exit"], run["stderr"] or run["stdout"][-2000:])
        else:  # a flip that changes what the header says: never claimed sound, never an internal error
            assert run["exit"] in (1, 2), (command, run["exit"], run["stderr"] or run["stdout"][-2000:])
        for line in run["stderr"].splitlines():
            assert line.startswith(("exl3tool: ", "  ")), (command, line)
    human, as_json, prepare = runs["inspect"], runs["inspect-json"], runs["prepare-json"]
    assert len(human["stderr"].splitlines()) <= 1 and len(as_json["stderr"].splitlines()) <= 1
    report, prepared = _strict(as_json["stdout"]), _strict(prepare["stdout"])
    found = report.get("error", {}).get("message", "") + "\n".join(p["message"] for p in report.get("problems", ()))
    assert case.words in found, found
    out = root / case.id / "out"
    if prepare["exit"] == 0:
        assert prepared["schema"] == "exl3tool.prepare/1"
        _strict((out / "manifest.json").read_text())
    else:
        assert not out.exists(), "a refused prepare wrote into OUT"


def test_the_child_stayed_small(outcomes):
    assert outcomes[1]["peak_rss_kb"] < 1 << 20  # 1 GiB: every read is bounded by the format, not the file
