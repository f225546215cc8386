"""Building blocks of the forward, checked against their definitions."""
from __future__ import annotations

import pytest
import torch

from workbench.model import Model
from workbench.synthetic import random_checkpoint, random_config


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # adjacent pairs / the two halves of each head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_each_pair_by_its_angle(device, architecture, dtype):
    checkpoint = random_checkpoint(random_config(architecture, n_layers=1, n_ctx=64), "F32")
    runner = Model(checkpoint, device=device, dtype=dtype).runner
    d_head, half = runner.config.d_head, runner.config.d_head // 2
    positions = torch.tensor([0, 5, 63], device=device)
    x = torch.randn(3, 4, d_head, generator=torch.Generator().manual_seed(0)).to(device, dtype)

    # (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) in float32, rounded once: the bits the forward promises
    xf = x.float()
    first, second = (slice(0, None, 2), slice(1, None, 2)) if runner.config.rope_interleaved else (
        slice(0, half), slice(half, None))
    x0, x1 = xf[..., first], xf[..., second]
    cos, sin = runner.rope_cos[positions][:, None, :], runner.rope_sin[positions][:, None, :]
    expected = torch.empty_like(xf)
    expected[..., first], expected[..., second] = x0 * cos - x1 * sin, x0 * sin + x1 * cos

    rotated = runner.rope(x, runner.rotation(positions))
    assert rotated.dtype == dtype
    assert torch.equal(rotated, expected.to(dtype))
    assert not torch.equal(rotated[1:], x[1:])  # positions past 0 do rotate
