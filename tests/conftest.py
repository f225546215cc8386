from __future__ import annotations

import os

import pytest

import workbench
from workbench.loading import default_model_path


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def model():
    """The embedded SmolLM2-135M (Q4_1), loaded once for the whole run, on CPU in float32."""
    return workbench.load(device="cpu")


def pytest_collection_modifyitems(config, items):
    """``WORKBENCH_TEST_SHARD=i/n`` keeps every n-th collected test from the i-th: ``test_interpreted_suite`` runs the
    interpreted Triton tests as shards side by side, one per core."""
    shard = os.environ.get("WORKBENCH_TEST_SHARD")
    if not shard:
        return
    index, count = map(int, shard.split("/"))
    config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index])
    items[:] = items[index::count]
