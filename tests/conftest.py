from __future__ import annotations

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
