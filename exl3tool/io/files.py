"""Which safetensors files make up a checkpoint, and what the optional index says about them.

With `model.safetensors.index.json` the files are those its `weight_map` names (each name must stay inside the
folder, and the file exist). Without one: `model.safetensors`, else the complete set of
`model-XXXXX-of-YYYYY.safetensors` shards, else every `*.safetensors` (as ExLlamaV3 globs them).

Names are checked, not where they lead: a Hugging Face hub snapshot is a folder of symlinks into `../../blobs/`.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

from exl3tool.errors import Problem, ProblemKind, UnreadableInputError
from exl3tool.io.config import read_json
from exl3tool.io.reading import brief, kind_of
from exl3tool.io.structure import gaps

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


@dataclass
class WeightFiles:
    files: list[str]  # relative names, in reading order
    weight_map: dict[str, str] | None  # tensor -> file, from the index
    problems: list[Problem] = field(default_factory=list)


def _name_problem(name: str) -> str | None:
    """Why an index entry's file name is unacceptable, or None. Lexical only: a hub snapshot's files are
    symlinks out of the folder, and that is fine; a name that climbs out of it is not."""
    if not name or "\x00" in name or "\\" in name:
        return "not a file name"
    if name.startswith("/") or posixpath.normpath(name).split("/")[0] == "..":
        return "a path outside the checkpoint folder"
    return None


def _from_index(root: Path) -> WeightFiles:
    data = read_json(root / INDEX, str(root / INDEX))
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UnreadableInputError("malformed: weight_map must map tensor names to file names", path=root / INDEX)
    problems: list[Problem] = []
    first_tensor: dict[str, str] = {}
    for tensor, file in weight_map.items():
        first_tensor.setdefault(file, tensor)
    files = []
    for file, tensor in first_tensor.items():
        reason = _name_problem(file) or kind_of(root / file)
        if reason is None:
            files.append(file)
            continue
        reason = "which does not exist" if reason == "missing" else reason
        problems.append(Problem("index-file", f"the index names {brief(file, 200)}, {reason}", INDEX, tensor,
                                ProblemKind.UNREADABLE))
    return WeightFiles(files, dict(weight_map), problems)


MAX_SHARDS = 100_000  # transformers and ExLlamaV3 number shards with five digits: "-of-NNNNN"


def _without_index(root: Path) -> WeightFiles:
    if (root / SINGLE).is_symlink() or (root / SINGLE).exists():  # then read (or refused) as the checkpoint
        return WeightFiles([SINGLE], None)
    shards: dict[int, list[tuple[int, str]]] = {}
    for path in root.glob("model-*-of-*.safetensors"):
        m = _SHARD.match(path.name)
        if m:
            shards.setdefault(int(m.group(2)), []).append((int(m.group(1)), path.name))
    if shards:
        total, found = max(shards.items(), key=lambda kv: len(kv[1]))
        width = len(found[0][1].split("-")[1])
        shard = lambda i: f"model-{i:0{width}d}-of-{total:0{width}d}.safetensors"  # noqa: E731
        if total > MAX_SHARDS:
            return WeightFiles([], None, [Problem(
                "shard-missing", f"claims to be one of {total} shards: no checkpoint has more than {MAX_SHARDS}",
                found[0][1], kind=ProblemKind.UNREADABLE)])
        problems = [
            Problem("shard-missing", f"shard {a} of {total} is missing" if a == b else
                    f"shards {a}..{b} of {total} are missing", shard(a), kind=ProblemKind.UNREADABLE)
            for a, b in gaps({i for i, _ in found}, 1, total)
        ]
        return WeightFiles([name for _, name in sorted(found)], None, problems)
    every = sorted(p.name for p in root.glob("*.safetensors"))
    if not every:
        raise UnreadableInputError("no *.safetensors files: not a checkpoint folder", path=root)
    return WeightFiles(every, None)


def find_weight_files(root: Path) -> WeightFiles:
    return _from_index(root) if kind_of(root / INDEX) != "missing" else _without_index(root)
