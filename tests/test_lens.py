"""Logit lens: the last layer equals the model's logits; tracks agree with the full lens logits."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import workbench
from workbench import probes


@pytest.fixture(scope="module")
def small(tiny_model):
    return tiny_model("llama", n_layers=3, device="cpu")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: final logits soft-capped
def test_last_layer_lens_is_the_models_output(arch, tiny_model):
    small = tiny_model(arch, n_layers=3, device="cpu")
    prompt = "the cat sat on the mat"
    lens = probes.logit_lens(small, prompt, points=("resid_pre", "resid_mid", "resid_post"), k=5)
    logits = small.run(prompt).logits
    assert torch.equal(lens.logits(-1, "resid_post"), logits)
    assert lens.top_tokens(-1, -1, "resid_post") == logits[-1].topk(5).indices.tolist()
    expected = logits.softmax(-1).topk(5).values
    torch.testing.assert_close(lens.top_probs["resid_post"][-1], expected, rtol=1e-5, atol=1e-7)
    batched = probes.logit_lens_batch(small, [prompt, "a dog"], k=5)[0]
    torch.testing.assert_close(batched.top_probs["resid_post"][-1], expected, rtol=1e-5, atol=1e-7)
    # the residual after block l is the residual before block l + 1
    assert torch.equal(lens.top_ids["resid_post"][:-1], lens.top_ids["resid_pre"][1:])
    probs = lens.top_probs["resid_mid"]
    assert probs.shape == (3, len(small.tokenize(prompt)), 5)
    assert bool((probs[..., :-1] >= probs[..., 1:]).all()) and float(probs.sum(-1).max()) <= 1 + 1e-6


def test_track_race_matches_the_full_lens(small):
    lens = probes.logit_lens(small, "the cat sat")
    candidates = [lens.top_tokens(1, -1)[0], lens.top_tokens(1, -1)[3], 7]
    track = lens.track_race(candidates)
    assert track.probs.shape == track.ranks.shape == (3, 3, len(lens.ids))
    for layer in range(3):
        full = lens.logits(layer).softmax(-1)
        torch.testing.assert_close(track.probs[:, layer].T, full[:, candidates], rtol=1e-5, atol=1e-7)
        order = full.argsort(-1, descending=True)
        for i, token in enumerate(candidates):
            assert track.ranks[i, layer].tolist() == (order == token).nonzero()[:, 1].tolist()
    assert track.ranks[0, 1, -1] == 0 and track.ranks[1, 1, -1] == 3
    single = lens.track_token(candidates[1])
    assert torch.equal(single.probs[0], track.probs[1])
    assert len(track.figure().data) == 3


def test_bad_lens_requests(small):
    with pytest.raises(workbench.WorkbenchError, match="lens points"):
        probes.logit_lens(small, "the cat", points=("resid_after",))
    lens = probes.logit_lens(small, "the cat")
    with pytest.raises(workbench.WorkbenchError, match="computed at"):
        lens.top_tokens(point="resid_pre")
    with pytest.raises(workbench.WorkbenchError, match="not one"):
        lens.track_token("the cat sat on")
    with pytest.raises(workbench.WorkbenchError, match="token must be an id"):
        lens.track_token(10**9)
    with pytest.raises(workbench.WorkbenchError, match="position 10 is out of range"):
        lens.track_token(5).figure(position=10)
    with pytest.raises(workbench.WorkbenchError, match="empty"):
        probes.logit_lens(small, "   ")
    # a single string is not read as one token per character
    with pytest.raises(workbench.WorkbenchError, match="must be a list of tokens"):
        lens.track_race("ab")
    with pytest.raises(workbench.WorkbenchError, match="layer 3 is out of range"):
        lens.top_tokens(3)
    with pytest.raises(workbench.WorkbenchError, match="layer -4 is out of range"):
        lens.logits(-4)
    with pytest.raises(workbench.WorkbenchError, match="k must be an integer"):
        probes.logit_lens(small, "the cat", k=2.5)
    assert lens.top_tokens(np.int64(2)) == lens.top_tokens(2)  # numpy integers are integers
    assert lens.track_token(np.int64(10)).token_ids == [10]


def test_tuned_lens_arguments_are_checked_before_any_forward(small, monkeypatch):
    calls = []
    monkeypatch.setattr(small, "iter_batch", lambda *a, **k: calls.append(1) or iter(()))
    for kwargs, message in [(dict(ridge=float("nan")), "ridge must be finite"), (dict(ridge=0), "ridge must be"),
                            (dict(prompts=["the cat"]), "too few")]:
        with pytest.raises(workbench.WorkbenchError, match=message):
            probes.train_tuned_lens(small, **({"prompts": ["the cat sat on the mat"] * 40} | kwargs))
    assert calls == []


def test_lens_on_the_embedded_model(model):
    prompt = "The capital of France is"
    lens = probes.logit_lens(model, prompt, k=10)
    trace = model.run(prompt)
    assert (lens.logits(-1) - trace.logits).abs().max() <= 1e-5
    assert lens.top_tokens() == trace.logits[-1].topk(10).indices.tolist()
    paris = lens.track_token(" Paris")
    ranks = paris.ranks[0, :, -1]
    assert ranks[-1] < 5 and ranks[0] > 1000  # found late, unknown to the embedding
    fig = lens.figure()
    heatmap = fig.data[0]
    assert (len(heatmap.z), len(heatmap.z[0])) == (model.config.n_layers, len(trace.ids))
    assert "' Paris'" in heatmap.customdata[-1][-1]


def mean_kl_to_output(lens, logits: torch.Tensor, layers) -> float:
    final = logits.log_softmax(-1)
    kl = [float((final.exp() * (final - lens.logits(l).log_softmax(-1))).sum(-1).mean()) for l in layers]
    return sum(kl) / len(kl)


def test_tuned_lens_is_closer_to_the_output_and_round_trips(small, tmp_path, tiny_model):
    rng = random.Random(0)
    words = "the cat sat on mat in an hot sun tea is at".split()
    prompts = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(44)]
    tuned = probes.train_tuned_lens(small, prompts[:40])
    assert tuned.weight.shape == (3, 64, 64) and torch.equal(tuned.weight[-1], torch.eye(64, dtype=torch.float64))
    for prompt in prompts[40:]:  # held out
        logits = small.run(prompt).logits
        plain, translated = probes.logit_lens(small, prompt), probes.logit_lens(small, prompt, tuned=tuned)
        assert mean_kl_to_output(translated, logits, [0, 1]) < mean_kl_to_output(plain, logits, [0, 1])
        assert torch.equal(translated.logits(-1), logits)

    tuned.save(tmp_path / "tuned")
    loaded = probes.TunedLens.load(tmp_path / "tuned.json", small)
    assert torch.equal(loaded.weight, tuned.weight) and loaded.n_positions == tuned.n_positions
    wider = tiny_model("llama", n_layers=3, d_model=128, device="cpu")
    with pytest.raises(workbench.WorkbenchError, match="d_model 64"):
        probes.TunedLens.load(tmp_path / "tuned", wider)
    with pytest.raises(workbench.WorkbenchError, match="resid_post only"):
        probes.logit_lens(small, "the cat", points=("resid_pre",), tuned=tuned)
    with pytest.raises(workbench.WorkbenchError, match="too few"):
        probes.train_tuned_lens(small, ["the cat"])
