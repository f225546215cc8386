"""Shared fixtures: the embedded model, and tiny random models (``tiny_model``, ``tiny_checkpoint``) built once each.

The suite runs on pytest-xdist workers (``-n auto --dist loadgroup`` in pyproject.toml's addopts; ``-n 0`` runs it in
one process). Each test module is one xdist group, run on one worker in its order with its module fixtures built once,
except ``TestInterpreted``, whose tests spread over every worker. Without CUDA, every process of it runs Triton's interpreter (``TRITON_INTERPRET=1``), so that the Triton kernels'
tests (tests/test_triton_kernels.py ``TestInterpreted``) check their logic on the CPU: the switch is read when triton is
imported, so it is set here, before anything imports workbench. The CUDA backend registers its kernels only where a
GPU is present, so nothing else runs interpreted.
"""
from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import workbench  # noqa: E402
from workbench.loading import LoadedCheckpoint, default_model_path  # noqa: E402
from workbench.synthetic import random_checkpoint, random_config  # noqa: E402

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # Workers side by side share the cores: each takes its part of torch's threads instead of all of them, since
    # OpenMP threads that outnumber the cores wait on each other.
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


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


# The tests that go to any worker, one by one: those of the Triton interpreter, which runs on one core.
_SPREAD = ("test_triton_kernels.py::TestInterpreted::", "test_triton_kernels.py::TestByExpert::")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Put each test module's tests in one xdist group (the module's path), but for those of ``_SPREAD``."""
    for item in items:
        if not any(spread in item.nodeid for spread in _SPREAD):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
