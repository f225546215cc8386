"""Activation patching sweeps: invariants on the embedded model, axes, metrics and progress on a random one."""
from __future__ import annotations

import pytest
import torch

import workbench
from workbench import hooks

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
SAME_TOKENS = [0, 4, 5, 6, 7, 8]  # positions where the two prompts have the same token
BOUND = 2e-4  # batched against one-prompt logits, tests/test_batch.py


def test_embedded_layer0_positions_with_the_same_token_have_no_effect(model):
    result = hooks.patching_sweep(model, CLEAN, CORRUPT, layers=[0], progress=False)
    assert result.grid.shape == (1, 9) and result.hook == "blocks.{layer}.hook_resid_pre"
    assert result.labels["positions"][1] == "1:  E" and result.labels["layers"] == ["L0"]
    assert "' Paris' - ' Rome'" in result.metric_name and result.clean_metric > 0 > result.corrupt_metric
    # resid_pre at layer 0 is the token embedding: where the tokens agree, the patch changes nothing
    # (cells run batched, the baselines alone: they agree within the batched kernels' rounding, docs/batches.md)
    torch.testing.assert_close(result.grid[0, SAME_TOKENS], torch.full((6,), result.corrupt_metric), atol=BOUND, rtol=0)
    assert ((result.grid[0, 1:4] - result.corrupt_metric).abs() > 0.1).all()


def test_embedded_last_layer_final_position_restores_the_clean_metric(model):
    last = model.config.n_layers - 1
    result = hooks.patching_sweep(model, CLEAN, CORRUPT, hook="blocks.{layer}.hook_resid_post", layers=[last],
                                  normalize=True, progress=False)
    # after the last block nothing mixes positions: only the final position matters, and it restores fully
    assert result.grid[0, -1].item() == pytest.approx(1.0, abs=BOUND)
    torch.testing.assert_close(result.grid[0, :-1], torch.zeros(8), atol=BOUND, rtol=0)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama", n_layers=2, seed=4)


CLEAN_IDS, CORRUPT_IDS = [5, 17, 42, 99, 7], [5, 17, 60, 99, 7]


def test_cells_run_as_the_rows_of_batched_forwards(tiny, monkeypatch):
    calls = []
    forward = tiny.runner.forward
    monkeypatch.setattr(tiny.runner, "forward", lambda ids, *a, **k: calls.append(len(ids)) or forward(ids, *a, **k))
    progress = []
    result = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, answers=(10, 11),
                                  progress=lambda done, total: progress.append((done, total)))
    assert result.grid.shape == (2, 5)
    assert calls == [5, 5, 50]  # clean (recorded once), corrupt baseline, then the 10 cells as rows of one forward
    assert progress == [(10, 10)]
    # positions before the first differing token have no effect at any layer
    torch.testing.assert_close(result.grid[:, :2], torch.full((2, 2), result.corrupt_metric), atol=BOUND, rtol=0)


def test_a_cell_is_the_metric_of_one_patched_run(tiny):
    clean = tiny.run(CLEAN_IDS, record=["blocks.1.attn.hook_z"])
    metric = lambda logits: float(logits[-1].log_softmax(-1)[10])  # noqa: E731
    result = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, metric, over=("layers", "positions", "heads"),
                                  layers=[1], positions=[2, -1], progress=False)
    assert result.grid.shape == (1, 2, 4) and result.labels["heads"] == ["H0", "H1", "H2", "H3"]
    patch = hooks.Patch("blocks.1.attn.hook_z", positions=[4], heads=[3], donor=clean)
    assert result.grid[0, 1, 3].item() == pytest.approx(metric(tiny.forward(CORRUPT_IDS, interventions=[patch])), abs=BOUND)
    assert result.metric_name == "<lambda>"


def test_heads_sweep_and_figure(tiny):
    result = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, over=("layers", "heads"), answers=(10, 11),
                                  normalize=True, progress=False)
    assert result.hook == "blocks.{layer}.attn.hook_z" and result.grid.shape == (2, 4)
    figure = result.figure()
    heatmap = figure.data[0]
    assert list(heatmap.y) == ["L0", "L1"] and list(heatmap.x) == ["H0", "H1", "H2", "H3"]
    assert torch.allclose(torch.tensor(heatmap.z, dtype=torch.float32), result.grid)
    three_d = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, over=("layers", "positions", "heads"),
                                   answers=(10, 11), progress=False)
    assert len(three_d.figure().data) == 4  # one panel per head
    assert three_d.to_dict()["grid"] == three_d.grid.tolist()


@pytest.mark.parametrize("kwargs, message", [
    (dict(corrupt=[5, 17, 60]), "same number of tokens"),
    (dict(over=("positions",)), "over must be one of"),
    (dict(hook="blocks.0.hook_resid_pre"), "template"),
    (dict(hook="blocks.{layer}.hook_resid_pree"), "did you mean"),
    (dict(hook="blocks.{layer}.hook_resid_pre", over=("layers", "heads")), "no head axis"),
    (dict(layers=[2]), "out of range"),
    (dict(positions=[5]), "out of range"),
    (dict(answers=("the cat", 3)), "single token"),
])
def test_bad_sweeps_are_refused_before_any_compute(tiny, monkeypatch, kwargs, message):
    calls = []
    monkeypatch.setattr(tiny.runner, "forward", lambda *a, **k: calls.append(1))
    args = dict(clean=CLEAN_IDS, corrupt=CORRUPT_IDS, answers=(10, 11), progress=False) | kwargs
    with pytest.raises(workbench.HookError, match=message):
        hooks.patching_sweep(tiny, **args)
    assert calls == []


def test_default_answers_must_differ(tiny):
    with pytest.raises(workbench.HookError, match="predict the same token"):
        hooks.patching_sweep(tiny, CLEAN_IDS, CLEAN_IDS, progress=False)
