"""Shared fixtures (helpers live in helpers.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from exl3tool.ops.kernel_cache import CACHE_ENV


def pytest_configure(config):
    """One kernel cache for the run, in a folder of its own (xdist workers inherit it from the controller), so the
    tests neither use nor fill the user's; EXL3TOOL_KERNEL_CACHE set beforehand wins."""
    if not hasattr(config, "workerinput") and CACHE_ENV not in os.environ:
        config._kernel_cache = os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="exl3tool-test-kernels-")


def pytest_unconfigure(config):
    made = getattr(config, "_kernel_cache", None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[CACHE_ENV]


@pytest.fixture
def copy_of(tmp_path):
    """copy_of(src) -> a private copy of a checkpoint folder, safe to damage."""

    def copy(src: Path, name: str = "ckpt") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy
