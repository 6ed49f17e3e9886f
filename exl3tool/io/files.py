"""Which safetensors files make up a checkpoint, and what the optional index says about them.

With `model.safetensors.index.json` the files are those its `weight_map` names (each must lie inside the folder
and exist). Without one: `model.safetensors`, else the complete set of `model-XXXXX-of-YYYYY.safetensors`
shards, else every `*.safetensors` (as ExLlamaV3 globs them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from exl3tool.errors import Problem, ProblemKind, UnreadableInputError
from exl3tool.io.config import read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


@dataclass
class WeightFiles:
    files: list[str]  # relative names, in reading order
    weight_map: dict[str, str] | None  # tensor -> file, from the index
    problems: list[Problem] = field(default_factory=list)


def _inside(root: Path, name: str) -> bool:
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name or not name:
        return False
    return (root / name).resolve().is_relative_to(root.resolve())


def _from_index(root: Path) -> WeightFiles:
    data = read_json(root / INDEX, INDEX)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UnreadableInputError("malformed: weight_map must map tensor names to file names", path=INDEX)
    problems: list[Problem] = []
    first_tensor: dict[str, str] = {}
    for tensor, file in weight_map.items():
        first_tensor.setdefault(file, tensor)
    files = []
    for file, tensor in first_tensor.items():
        if not _inside(root, file):
            problems.append(Problem("index-file", f"the index names {file!r}, a path outside the checkpoint folder",
                                    INDEX, tensor, ProblemKind.UNREADABLE))
        elif not (root / file).is_file():
            problems.append(Problem("index-file", f"the index names {file!r}, which does not exist",
                                    INDEX, tensor, ProblemKind.UNREADABLE))
        else:
            files.append(file)
    return WeightFiles(files, dict(weight_map), problems)


def _without_index(root: Path) -> WeightFiles:
    if (root / SINGLE).is_file():
        return WeightFiles([SINGLE], None)
    shards = {}
    for path in root.glob("model-*-of-*.safetensors"):
        m = _SHARD.match(path.name)
        if m:
            shards.setdefault(int(m.group(2)), []).append((int(m.group(1)), path.name))
    if shards:
        total, found = max(shards.items(), key=lambda kv: len(kv[1]))
        present = {i for i, _ in found}
        width = len(found[0][1].split("-")[1])
        problems = [
            Problem("shard-missing", f"shard {i} of {total} is missing",
                    f"model-{i:0{width}d}-of-{total:0{width}d}.safetensors", kind=ProblemKind.UNREADABLE)
            for i in range(1, total + 1) if i not in present
        ]
        return WeightFiles([name for _, name in sorted(found)], None, problems)
    every = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    if not every:
        raise UnreadableInputError("no *.safetensors files: not a checkpoint folder", path=str(root))
    return WeightFiles(every, None)


def find_weight_files(root: Path) -> WeightFiles:
    return _from_index(root) if (root / INDEX).exists() else _without_index(root)
