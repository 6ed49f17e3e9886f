"""GPU tests run on the GPU machine only (``pytest -m gpu``); each draws fresh random inputs and prints its seed."""

import os
import random

import pytest
import torch


@pytest.fixture
def seed(request):
    """A fresh seed per test (``EXL3TOOL_SEED`` pins it to reproduce a failure)."""
    value = int(os.environ.get("EXL3TOOL_SEED", random.SystemRandom().randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value}")
    torch.manual_seed(value)
    return value


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
