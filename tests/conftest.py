"""Shared fixtures (helpers live in helpers.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def copy_of(tmp_path):
    """copy_of(src) -> a private copy of a checkpoint folder, safe to damage."""

    def copy(src: Path, name: str = "ckpt") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy
