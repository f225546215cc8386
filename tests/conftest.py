from __future__ import annotations

import os

import pytest
import torch

import workbench
from workbench.loading import LoadedCheckpoint, default_model_path
from workbench.synthetic import random_checkpoint, random_config


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def model():
    """The embedded SmolLM2-135M (Q4_1), loaded once for the whole run, on CPU in float32."""
    return workbench.load(device="cpu")


def _key(*args, **kwargs) -> tuple:
    return args + tuple(sorted((name, str(value)) for name, value in kwargs.items()))


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """``tiny_checkpoint(arch="llama", fmt="Q8_0", seed=0, cached=True, **config)``: the random checkpoint
    (``workbench.synthetic.random_checkpoint``) of ``random_config(arch, **config)`` in ``fmt`` (a format or a mix),
    built once per arguments for the session, so tests must not edit it; ``cached=False`` builds a
    fresh one to edit."""
    built: dict[tuple, LoadedCheckpoint] = {}

    def make(arch: str = "llama", fmt: str = "Q8_0", *, seed: int = 0, cached: bool = True,
             **config) -> LoadedCheckpoint:
        if not cached:
            return random_checkpoint(random_config(arch, **config), fmt, seed=seed)
        key = _key(arch, fmt, seed, **config)
        if key not in built:
            built[key] = random_checkpoint(random_config(arch, **config), fmt, seed=seed)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    """``tiny_model(arch="llama", fmt="Q8_0", seed=0, device=None, dtype=None, cached=True, **config)``: a
    ``workbench.Model`` of ``tiny_checkpoint(arch, fmt, seed=seed, **config)`` on ``device`` (None: the Model's default,
    CUDA where present) in ``dtype``, built once per arguments for the session and shared by the tests that ask for the
    same: a test that changes it (its weights, its tokenizer's stop ids, a patched method) uses monkeypatch or
    ``cached=False``, a model of its own (of a fresh checkpoint)."""
    built: dict[tuple, workbench.Model] = {}

    def make(arch: str = "llama", fmt: str = "Q8_0", *, seed: int = 0, device: str | None = None,
             dtype: str | torch.dtype | None = None, cached: bool = True, **config) -> workbench.Model:
        if not cached:
            return workbench.Model(tiny_checkpoint(arch, fmt, seed=seed, cached=False, **config), device, dtype)
        key = _key(arch, fmt, seed, device=device, dtype=dtype, **config)
        if key not in built:
            built[key] = workbench.Model(tiny_checkpoint(arch, fmt, seed=seed, **config), device, dtype)
        return built[key]

    return make


def pytest_collection_modifyitems(config, items):
    """``WORKBENCH_TEST_SHARD=i/n`` keeps every n-th collected test from the i-th: ``test_interpreted_suite`` runs the
    interpreted Triton tests as shards side by side, one per core."""
    shard = os.environ.get("WORKBENCH_TEST_SHARD")
    if not shard:
        return
    index, count = map(int, shard.split("/"))
    config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index])
    items[:] = items[index::count]
