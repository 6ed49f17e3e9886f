"""The prepared W4A16 layout (docs/prepared-layout.md): write it, recognise it, load it.

    prepare_checkpoint(source, out, *, layers=None, revision=None, overwrite=False, max_shard_bytes=...,
                       progress=None) -> PrepareReport                                    exl3tool.prepared.writer
    load_prepared(path, device="cpu", verify_hashes=True) -> PreparedCheckpoint          exl3tool.prepared.loader
    is_prepared(path) -> bool        a folder holding a manifest.json of ours (cheap: reads only the manifest)

torch is imported only by the loader and the writer, so `is_prepared` stays light.
"""

from __future__ import annotations

from pathlib import Path

from exl3tool.errors import Exl3Error
from exl3tool.io.config import read_json
from exl3tool.prepared.layout import LAYOUT_VERSION, MANIFEST, SCHEMA

__all__ = [
    "LAYOUT_VERSION", "MANIFEST", "SCHEMA", "PrepareProgress", "PrepareReport", "PreparedCheckpoint",
    "PreparedExpertGroup", "PreparedMoE", "is_prepared", "load_prepared", "prepare_checkpoint",
]


def is_prepared(path: str | Path) -> bool:
    """True when `path` is a folder holding an exl3tool prepared manifest (of any layout version: loading then
    says whether this exl3tool reads it). Never raises."""
    try:
        data = read_json(Path(str(path)).expanduser() / MANIFEST, MANIFEST)  # a regular file, bounded, strict
    except Exl3Error:
        return False
    return isinstance(data.get("schema"), str) and data["schema"].startswith("exl3tool.prepared/")


def __getattr__(name):
    if name in ("load_prepared", "PreparedCheckpoint", "PreparedMoE", "PreparedExpertGroup"):
        from exl3tool.prepared import loader

        return getattr(loader, name)
    if name in ("prepare_checkpoint", "PrepareReport", "PrepareProgress", "parse_size"):
        from exl3tool.prepared import writer

        return getattr(writer, name)
    raise AttributeError(f"module 'exl3tool.prepared' has no attribute {name!r}")
