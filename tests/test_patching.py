"""Activation patching sweeps: invariants on the embedded model, axes, metrics and progress on a random one."""
from __future__ import annotations

import pytest
import torch

import workbench
from workbench import hooks
from workbench.hooks import patching
from workbench.synthetic import random_hf_checkpoint

from test_loading import write_hf_tokenizer

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
    return tiny_model("llama", n_layers=2, seed=4, device="cpu")  # float32 bounds, on a machine with a GPU too


CLEAN_IDS, CORRUPT_IDS = [5, 17, 42, 99, 7], [5, 17, 60, 99, 7]


def test_cells_continue_the_corrupt_run_as_the_rows_of_batched_forwards(tiny, monkeypatch):
    calls = []
    forward = tiny.runner.forward
    def counted(ids, *args, **kwargs):
        layout = kwargs.get("layout")
        calls.append((len(ids), kwargs.get("start_at_layer", 0), kwargs.get("stop_at_layer"),
                      layout.cached if layout else None))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(tiny.runner, "forward", counted)
    progress = []
    result = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, answers=(10, 11),
                                  progress=lambda done, total: progress.append((done, total)))
    assert result.grid.shape == (2, 5)
    # clean (recorded once), corrupt (its keys and values kept), then the 10 cells as rows of one forward, each row
    # continuing the corrupt run from its cell's position: 5 + 4 + 3 + 2 + 1 tokens a layer
    assert calls == [(5, 0, None, None), (5, 0, None, None), (30, 0, None, (0, 1, 2, 3, 4, 0, 1, 2, 3, 4))]
    assert progress == [(10, 10)]
    # where forwards cost nothing beyond their blocks, the sweep goes block by block: each layer's cells join the rows at their own block,
    # from the corrupt run's residual stream there, and the rows so far go on from where the last block stopped
    monkeypatch.setitem(patching.FORWARD_FLOPS, "cpu", 0.0)
    calls.clear()
    again = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, answers=(10, 11), progress=False)
    assert calls[2:] == [(15, 0, 1, (0, 1, 2, 3, 4)), (30, 1, None, (0, 1, 2, 3, 4, 0, 1, 2, 3, 4))]
    torch.testing.assert_close(again.grid, result.grid, atol=BOUND, rtol=0)
    # positions before the first differing token have no effect at any layer
    torch.testing.assert_close(result.grid[:, :2], torch.full((2, 2), result.corrupt_metric), atol=BOUND, rtol=0)


def all_positions(logits: torch.Tensor) -> float:
    """A metric of every position: the log-probability of token 10 summed over positions."""
    return float(logits.log_softmax(-1)[:, 10].sum())


def one_patched_run(model, clean, corrupt, metric, name, position, head):
    """A cell as a plain forward of the whole corrupt prompt with one Patch."""
    donor = model.run(clean, record=[name])
    patch = hooks.Patch(name, positions=None if position is None else [position],
                        heads=None if head is None else [head], donor=donor)
    return metric(model.run(corrupt, interventions=[patch]).logits)


def assert_cells_are_patched_runs(model, result, clean, corrupt, metric, layers, positions, bound):
    """Every cell of ``result`` (``positions`` None for a heads-only sweep) equals its plain patched run."""
    heads = [int(h[1:]) for h in result.labels["heads"]] if "heads" in result.over else [None]
    for i, layer in enumerate(layers):
        for j, position in enumerate(positions or [None]):
            for k, head in enumerate(heads):
                index = (i,) + ((j,) if positions else ()) + ((k,) if head is not None else ())
                expected = one_patched_run(model, clean, corrupt, metric, result.hook.format(layer=layer), position,
                                           head)
                assert result.grid[index].item() == pytest.approx(expected, abs=bound), (layer, position, head)


SWEEPS = [  # (over, hook, metric, positions)
    (("layers", "positions"), None, None, None),
    (("layers", "positions"), "blocks.{layer}.mlp.hook_post", all_positions, None),
    (("layers", "heads"), None, None, None),
    (("layers", "heads"), None, all_positions, None),
    (("layers", "positions", "heads"), None, all_positions, [1, 2, -1]),
    (("layers", "positions", "heads"), "blocks.{layer}.attn.hook_v", None, [0, 3]),
]


CUDA_F32 = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))


# (a forward per block / one forward from the first, rows from their cells' positions / from the first token)
@pytest.mark.parametrize("forward_flops, cached_forward_flops", [(0.0, 0.0), (1e30, 0.0), (0.0, 1e30), (1e30, 1e30)])
@pytest.mark.parametrize("over, hook, metric, positions", SWEEPS)
@pytest.mark.parametrize("device", ["cpu", CUDA_F32])
def test_continued_cells_equal_plain_patched_runs(over, hook, metric, positions, forward_flops, cached_forward_flops,
                                                  device, tiny_model, monkeypatch):
    model = tiny_model("llama", n_layers=3, seed=4, device=device, dtype=torch.float32)
    monkeypatch.setitem(patching.FORWARD_FLOPS, device, forward_flops)
    monkeypatch.setitem(patching.CACHED_FORWARD_FLOPS, device, cached_forward_flops)
    clean, corrupt = [5, 17, 42, 99, 7, 8, 9], [5, 17, 60, 99, 7, 3, 9]
    result = hooks.patching_sweep(model, clean, corrupt, metric, over=over, hook=hook, positions=positions,
                                  answers=None if metric else (10, 11), progress=False)
    swept = [p % 7 for p in positions or range(7)] if "positions" in over else None
    # on CUDA a cell's rows and the plain run's take kernels of other shapes, which sum in other orders
    assert_cells_are_patched_runs(model, result, clean, corrupt, metric or hooks.patching.logit_diff(10, 11),
                                  range(3), swept, BOUND if device == "cpu" else 1e-5 * result.grid.abs().max().item())


@pytest.mark.parametrize("architecture", ["gemma2", "qwen3moe"])  # sliding windows and soft caps; experts
def test_continued_cells_of_other_families_equal_plain_patched_runs(architecture, tiny_model, monkeypatch):
    model = tiny_model(architecture, n_layers=2, seed=1, device="cpu")
    monkeypatch.setitem(patching.FORWARD_FLOPS, "cpu", 0.0)  # the second layer's cells go on from the first's
    clean, corrupt = [5, 17, 42, 99, 7, 8, 9, 11], [5, 17, 60, 99, 7, 3, 9, 11]  # past gemma2's window of 4
    result = hooks.patching_sweep(model, clean, corrupt, all_positions, progress=False)
    assert_cells_are_patched_runs(model, result, clean, corrupt, all_positions, range(2), range(8), BOUND)


def test_embedded_continued_cells_equal_plain_patched_runs(model):
    """A few cells of the embedded model, each against a plain forward of the corrupt prompt with its Patch."""
    result = hooks.patching_sweep(model, CLEAN, CORRUPT, answers=(" Paris", " Rome"), layers=[0, 17, 29],
                                  positions=[1, 8], progress=False)
    answers = [model.tokenize(a, add_bos=False)[0] for a in (" Paris", " Rome")]
    assert_cells_are_patched_runs(model, result, CLEAN, CORRUPT, hooks.patching.logit_diff(*answers), [0, 17, 29],
                                  [1, 8], BOUND)
    heads = hooks.patching_sweep(model, CLEAN, CORRUPT, all_positions, over=("layers", "positions", "heads"),
                                 layers=[12], positions=[3], progress=False)
    assert_cells_are_patched_runs(model, heads, CLEAN, CORRUPT, all_positions, [12], [3], BOUND)


def test_a_sweep_inside_a_hooks_block_reruns_every_cell_with_its_edits(tiny):
    ablate = hooks.ZeroAblate("blocks.0.hook_mlp_out", positions=[3])
    with tiny.hooks(interventions=[ablate]):
        result = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, answers=(10, 11), progress=False)
    metric = hooks.patching.logit_diff(10, 11)
    for layer in range(2):
        for position in range(5):
            donor = tiny.run(CLEAN_IDS, record=[f"blocks.{layer}.hook_resid_pre"], interventions=[ablate])
            patch = hooks.Patch(f"blocks.{layer}.hook_resid_pre", positions=[position], donor=donor)
            expected = metric(tiny.run(CORRUPT_IDS, interventions=[ablate, patch]).logits)
            assert result.grid[layer, position].item() == pytest.approx(expected, abs=BOUND)


def test_a_model_whose_later_layers_read_earlier_ones_continues_from_the_tokens(tmp_path):
    """Gemma 4 E2B's shape (per-layer inputs from the embedding, layers reusing earlier keys and values): no forward
    can start past block 0, so the cells start there, still each from its own position."""
    random_hf_checkpoint("gemma4e", tmp_path, initializer_range=0.2)
    write_hf_tokenizer(tmp_path)
    gemma = workbench.load(tmp_path, device="cpu")
    assert not any(gemma.runner.can_start_at_layer(i) for i in range(gemma.config.n_layers))
    result = hooks.patching_sweep(gemma, CLEAN_IDS, CORRUPT_IDS, all_positions, progress=False)
    assert_cells_are_patched_runs(gemma, result, CLEAN_IDS, CORRUPT_IDS, all_positions, range(gemma.config.n_layers),
                                  range(5), BOUND)


def test_a_cell_is_the_metric_of_one_patched_run(tiny):
    clean = tiny.run(CLEAN_IDS, record=["blocks.1.attn.hook_z"])
    metric = lambda logits: float(logits[-1].log_softmax(-1)[10])  # noqa: E731
    result = hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, metric, over=("layers", "positions", "heads"),
                                  layers=[1], positions=[2, -1], progress=False)
    assert result.grid.shape == (1, 2, 4) and result.labels["heads"] == ["H0", "H1", "H2", "H3"]
    patch = hooks.Patch("blocks.1.attn.hook_z", positions=[4], heads=[3], donor=clean)
    assert result.grid[0, 1, 3].item() == pytest.approx(metric(tiny.forward(CORRUPT_IDS, interventions=[patch])), abs=BOUND)
    assert result.metric_name == "<lambda>"
    with pytest.raises(workbench.HookError, match="metric must return a number or a one-element tensor"):
        hooks.patching_sweep(tiny, CLEAN_IDS, CORRUPT_IDS, lambda logits: logits[-1, :3], layers=[1], progress=False)


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
    # a single answer or a string (walked character by character) is not the pair the default metric needs
    (dict(answers="ab"), "must be a pair"),
    (dict(answers=(10,)), "must be a pair"),
    (dict(answers=(10, 1.5)), "must be an integer"),
    (dict(layers=[0.7]), "list of integers"),  # not floored to layer 0
    (dict(layers="01"), "list of integers"),
    (dict(positions=[1.5]), "list of integers"),
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


# Two pairs of one length (8 tokens), differing at positions 1 and 2, and a pair of 9 tokens
PAIRS = [("The Louvre is in the city of", "The Prado is in the city of"),
         ("The Kremlin is in the city of", "The Acropolis is in the city of")]
LONGER = (CLEAN, CORRUPT)


@pytest.mark.parametrize("method, steps", [("activation", 1), ("attribution", 1), ("attribution", 2)])
def test_a_datasets_grid_is_the_mean_of_its_pairs(model, method, steps):
    """Each pair's cells are what its single-pair call gives (the pairs' runs batched: within the batched kernels'
    rounding), the grid and both metrics their means over the pairs."""
    single = (lambda clean, corrupt, **kw: hooks.patching_sweep(model, clean, corrupt, progress=False, **kw)) \
        if method == "activation" else \
        (lambda clean, corrupt, **kw: hooks.attribution_patching(model, clean, corrupt, steps=steps, **kw))
    layers = [0, 3, 11]
    dataset = hooks.dataset_patching(model, PAIRS, method=method, steps=steps, layers=layers, progress=False)
    pairs = [single(clean, corrupt, layers=layers) for clean, corrupt in PAIRS]
    assert dataset.pairs == 2 and pairs[0].pairs == 1 and dataset.method == pairs[0].method
    bound = 1e-4
    torch.testing.assert_close(dataset.grid, (pairs[0].grid + pairs[1].grid) / 2, atol=bound, rtol=0)
    assert dataset.clean_metric == pytest.approx((pairs[0].clean_metric + pairs[1].clean_metric) / 2, abs=bound)
    assert dataset.corrupt_metric == pytest.approx((pairs[0].corrupt_metric + pairs[1].corrupt_metric) / 2, abs=bound)
    # each pair's default metric has its own answers; a position's label has its token where the pairs share it
    assert dataset.metric_name == "logit diff of each pair's answers"
    assert dataset.labels["positions"][:4] == ["0: The", "1", "2", "3:  is"] == pairs[0].labels["positions"][:1] + [
        "1", "2"] + pairs[1].labels["positions"][3:4]
    assert (dataset.grid[0, 1] - dataset.corrupt_metric).abs() > 0.1  # the differing token matters at layer 0
    assert dataset.to_dict()["pairs"] == 2 and "mean of 2 pairs" in dataset.figure().layout.title.text


def test_a_dataset_normalizes_by_the_mean_change_and_takes_a_metric_and_answers_per_pair(model):
    answers = [(" Paris", " Madrid"), (" Moscow", " Athens")]
    def sweep(*args, **kwargs):
        return hooks.dataset_patching(model, PAIRS, *args, method="attribution", layers=[2], progress=False, **kwargs)

    plain, normalized = sweep(answers=answers), sweep(answers=answers, normalize=True)
    span = plain.clean_metric - plain.corrupt_metric
    torch.testing.assert_close(normalized.grid, (plain.grid - plain.corrupt_metric) / span)
    # the same answers given as metrics, one per pair
    ids = [[model.tokenize(a, add_bos=False)[0] for a in pair] for pair in answers]
    metrics = [lambda logits, a=a: logits[-1, a[0]] - logits[-1, a[1]] for a in ids]
    by_metric = sweep(metrics)
    torch.testing.assert_close(by_metric.grid, plain.grid, atol=1e-5, rtol=0)
    assert by_metric.metric_name == "<lambda>"


def test_pairs_of_different_lengths_sweep_heads_not_positions(model):
    pairs = [*PAIRS, LONGER]
    heads = hooks.dataset_patching(model, pairs, method="attribution", over=("layers", "heads"), layers=[5],
                                   progress=False)
    alone = [hooks.attribution_patching(model, clean, corrupt, over=("layers", "heads"), layers=[5])
             for clean, corrupt in pairs]
    torch.testing.assert_close(heads.grid, sum(r.grid for r in alone) / 3, atol=1e-4, rtol=0)
    with pytest.raises(workbench.HookError, match=r"pair 2: 9 tokens where pair 0 has 8: a sweep over positions"):
        hooks.dataset_patching(model, pairs, method="attribution", layers=[5], progress=False)


LAST_MEAN = [lambda logits, a=a: logits[:, a].mean() for a in (10, 11, 12)]  # a metric of every position, a pair


@pytest.mark.parametrize("over, hook, metrics, cached_forward_flops", [
    (("layers", "heads"), None, None, 0.0),
    (("layers", "heads"), None, LAST_MEAN, 0.0),
    (("layers", "heads"), "blocks.{layer}.attn.hook_pattern", None, 0.0),  # not continued: whole prompts
    (("layers", "positions"), None, None, 0.0),  # each pair's rows continue its own cache rows
    (("layers", "positions"), None, None, 1e30),  # the pairs' rows from the first token, in shared forwards
    (("layers", "positions"), None, LAST_MEAN, 1e30),
])
def test_an_activation_datasets_pairs_share_forwards_and_give_each_pairs_sweep(model, monkeypatch, over, hook,
                                                                                metrics, cached_forward_flops):
    """Rows of several pairs in one forward, each patched from its own clean run, its metric on its own corrupt run's
    logits (pairs of different lengths over heads), or each pair's cells continuing its own cache rows: each pair's
    grid is its own sweep's, in fewer forwards than pair by pair."""
    monkeypatch.setitem(patching.CACHED_FORWARD_FLOPS, "cpu", cached_forward_flops)
    pairs = [*PAIRS, LONGER] if "heads" in over else [*PAIRS, (PAIRS[1][1], PAIRS[0][0])]
    forwards = []
    forward = model.runner.forward
    monkeypatch.setattr(model.runner, "forward", lambda ids, **kw: forwards.append(len(ids)) or forward(ids, **kw))
    dataset = hooks.dataset_patching(model, pairs, metrics, over=over, hook=hook, layers=[2, 7], progress=False)
    shared = len(forwards)
    forwards.clear()
    alone = [hooks.patching_sweep(model, clean, corrupt, None if metrics is None else metrics[i], over=over, hook=hook,
                                  layers=[2, 7], progress=False) for i, (clean, corrupt) in enumerate(pairs)]
    assert shared < len(forwards)
    torch.testing.assert_close(dataset.grid, sum(r.grid for r in alone) / 3, atol=BOUND, rtol=0)
    assert dataset.corrupt_metric == pytest.approx(sum(r.corrupt_metric for r in alone) / 3, abs=BOUND)


def test_a_dataset_in_chunks_gives_what_it_gives_at_once(model, monkeypatch):
    """Integrated gradients of three pairs, two steps each: one batched gradient call, or chunks of one pair."""
    pairs = [*PAIRS, ("The Kremlin is in the city of", "The Louvre is in the city of")]
    whole = hooks.dataset_patching(model, pairs, method="attribution", steps=2, layers=[1, 6], progress=False)
    seen = []
    monkeypatch.setattr(patching, "_GRADIENT_ROWS", 2)
    chunked = hooks.dataset_patching(model, pairs, method="attribution", steps=2, layers=[1, 6],
                                     progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    torch.testing.assert_close(chunked.grid, whole.grid, atol=1e-4, rtol=0)


def test_an_activation_datasets_progress_counts_every_pairs_cells(model, monkeypatch):
    """Over the pairs together, or a pair at a time where their clean runs' recordings pass DONOR_BYTES."""
    seen = []
    together = hooks.dataset_patching(model, PAIRS, layers=[0], positions=[-1],
                                      progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (2, 2) and all(t == 2 for _, t in seen)
    monkeypatch.setattr(patching, "DONOR_BYTES", 1)
    seen.clear()
    apart = hooks.dataset_patching(model, PAIRS, layers=[0], positions=[-1], progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 2), (2, 2)]
    torch.testing.assert_close(apart.grid, together.grid, atol=BOUND, rtol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pairs=[]), "pairs must be a non-empty list"),
    (dict(pairs="The Louvre"), "pairs must be a non-empty list"),
    (dict(pairs=[PAIRS[0], ("The Louvre is in the city of",)]), r"pair 1: a pair is \(clean prompt, corrupt prompt\)"),
    (dict(pairs=[PAIRS[0], ("The Louvre is in the city of", "Paris")]), "pair 1: clean and corrupt prompts must have"),
    (dict(pairs=PAIRS, metric=[lambda logits: logits[-1, 0]]), "a list of one per pair"),
    (dict(pairs=PAIRS, metric=[lambda logits: logits[-1, 0], 3]), "metric must be a function"),
    (dict(pairs=PAIRS, answers=[(" Paris", " Madrid")]), "answers must be a list of one"),
    (dict(pairs=PAIRS, answers=[(" Paris", " Madrid"), (" Moscow", " Athens and more")]), "pair 1: answer"),
    (dict(pairs=PAIRS, method="gradients"), "method must be 'activation' or 'attribution'"),
    (dict(pairs=PAIRS, steps=4), "steps applies to method='attribution'"),
    (dict(pairs=PAIRS, method="attribution", steps=0), "steps must be at least 1"),
    (dict(pairs=PAIRS, positions=[9]), "pair 0: positions"),
    (dict(pairs=PAIRS, layers=[99]), "out of range"),
])
def test_bad_datasets_are_refused_before_any_run(model, monkeypatch, kwargs, message):
    monkeypatch.setattr(model.runner, "forward", lambda *a, **k: pytest.fail("ran a forward"))
    with pytest.raises(workbench.HookError, match=message):
        hooks.dataset_patching(model, progress=False, **kwargs)


def test_a_pair_whose_runs_predict_the_same_token_is_named(model):
    pairs = [PAIRS[0], ("The Louvre is in the city of", "The Louvre is in the city of")]
    for method in ("activation", "attribution"):
        with pytest.raises(workbench.HookError, match="pair 1: the clean and corrupt runs predict the same token"):
            hooks.dataset_patching(model, pairs, method=method, layers=[0], progress=False)


def test_attribution_verifies_its_largest_cells_by_patching(model):
    """verify=k patches the k cells of the largest estimated effect: each the value patching_sweep gives it (the cells
    run batched, within the batched kernels' rounding), the rest NaN; verified() lists them largest first."""
    estimated = hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[0, 4, 12], verify=5)
    patched = hooks.patching_sweep(model, CLEAN, CORRUPT, layers=[0, 4, 12], progress=False)
    plain = hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[0, 4, 12])
    assert torch.equal(estimated.grid, plain.grid) and plain.patched is None and plain.verified() == []
    ran = ~estimated.patched.isnan()
    effect = (estimated.grid - estimated.corrupt_metric).abs()
    assert int(ran.sum()) == 5 and effect[ran].min() >= effect[~ran].max()
    torch.testing.assert_close(estimated.patched[ran], patched.grid[ran], atol=BOUND, rtol=0)
    listed = estimated.to_dict()["verified"]
    assert [abs(c["estimated"] - estimated.corrupt_metric) for c in listed] == sorted(effect[ran].tolist(), reverse=True)
    first = listed[0]
    assert first["labels"] == [estimated.labels["layers"][first["index"][0]],
                               estimated.labels["positions"][first["index"][1]]]
    assert first["patched"] == pytest.approx(float(patched.grid[tuple(first["index"])]), abs=BOUND)
    normalized = hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[0, 4, 12], verify=5, normalize=True)
    span = estimated.clean_metric - estimated.corrupt_metric
    torch.testing.assert_close(normalized.patched[ran], (estimated.patched[ran] - estimated.corrupt_metric) / span)


def test_a_dataset_verifies_the_cells_of_its_largest_mean_estimate_in_every_pair(model):
    result = hooks.dataset_patching(model, PAIRS, method="attribution", over=("layers", "heads"), layers=[2, 9],
                                    verify=3, progress=False)
    ran = ~result.patched.isnan()
    patched = [hooks.patching_sweep(model, clean, corrupt, over=("layers", "heads"), layers=[2, 9], progress=False)
               for clean, corrupt in PAIRS]
    assert int(ran.sum()) == 3
    torch.testing.assert_close(result.patched[ran], ((patched[0].grid + patched[1].grid) / 2)[ran], atol=BOUND,
                               rtol=0)
    seen = []
    hooks.dataset_patching(model, PAIRS, method="attribution", layers=[2], positions=[-1], verify=1,
                           progress=lambda done, total: seen.append((done, total)))
    assert seen == [(2, 4), (4, 4)]  # the pairs attributed, then verified together


@pytest.mark.parametrize("verify, message", [(-1, "between 0 and the sweep's 9 cells"),
                                             (10, "between 0 and the sweep's 9 cells"),
                                             (1.5, "verify must be an integer"), (True, "verify must be an integer")])
def test_bad_verification_is_refused(model, monkeypatch, verify, message):
    monkeypatch.setattr(model.runner, "forward", lambda *a, **k: pytest.fail("ran a forward"))
    with pytest.raises(workbench.HookError, match=message):
        hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[3], verify=verify)
    with pytest.raises(workbench.HookError, match="verify applies to method='attribution'"):
        hooks.dataset_patching(model, PAIRS, layers=[3], verify=1, progress=False)
