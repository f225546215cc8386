"""Bad interventions are refused with a clear HookError before any forward runs (donor runs included)."""
from __future__ import annotations

import pytest
import torch

import workbench
from workbench import hooks

IDS = [5, 17, 42, 99, 7]
D = 64  # d_model of the random model; 4 heads / 2 kv heads of 16, d_mlp 128


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama", n_layers=2, seed=1)


@pytest.fixture()
def forwards(tiny, monkeypatch):
    """Runner forwards started during the test (there must be none)."""
    calls = []
    monkeypatch.setattr(tiny.runner, "forward", lambda *a, **k: calls.append(1))
    return calls


BAD = {
    "unknown hook": (lambda: hooks.ZeroAblate("blocks.0.hook_resid_pr"), "did you mean blocks.0.hook_resid_pre"),
    "unknown glob": (lambda: hooks.ZeroAblate("blocks.*.attn.hook_zz"), "did you mean blocks.0.attn.hook_z"),
    "layer": (lambda: hooks.ZeroAblate("blocks.2.hook_resid_pre"), "layers 0..1"),
    "head": (lambda: hooks.ZeroAblate("blocks.0.attn.hook_z", heads=[4]), r"heads \[4\] out of range 0..3"),
    "kv head": (lambda: hooks.ZeroAblate("blocks.0.attn.hook_k", heads=[2]), r"out of range 0..1"),
    "no head axis": (lambda: hooks.ZeroAblate("blocks.0.hook_resid_pre", heads=[0]), "no head axis"),
    "neuron": (lambda: hooks.ZeroAblate("blocks.0.mlp.hook_post", neurons=[128]), "out of range 0..127"),
    "position": (lambda: hooks.ZeroAblate("hook_embed", positions=[5]), "position 5 is out of range"),
    "negative position": (lambda: hooks.ZeroAblate("hook_embed", positions=[-6]), "position -6 is out of range"),
    "float position": (lambda: hooks.ZeroAblate("hook_embed", positions=[1.5]), "list of integers"),
    "positions word": (lambda: hooks.ZeroAblate("hook_embed", positions="prompt"), "'generated'"),
    "vector length": (lambda: hooks.Steer("blocks.0.hook_resid_post", torch.ones(D + 1)), r"shape \(64,\)"),
    "vector rank": (lambda: hooks.Steer("blocks.0.hook_resid_post", torch.ones(2, D)), r"shape \(64,\)"),
    "head vector": (lambda: hooks.Steer("blocks.0.attn.hook_z", torch.ones(D), heads=[0]), r"shape \(16,\)"),
    "no feature axis": (lambda: hooks.Steer("blocks.0.attn.hook_pattern", torch.ones(D)), "no feature axis"),
    "mean shape": (lambda: hooks.MeanAblate("blocks.0.attn.hook_z", torch.ones(D)), r"shape \(4, 16\)"),
    "mean of pattern": (lambda: hooks.MeanAblate("blocks.0.attn.hook_pattern", torch.ones(5)), "fixed per-token shape"),
    "scale factor": (lambda: hooks.Scale("hook_embed", factor=float("inf")), "finite"),
    "resample donors": (lambda: hooks.ResampleAblate("hook_embed", donors=[]), "list of donor prompts"),
    "resample pattern": (lambda: hooks.ResampleAblate("blocks.0.attn.hook_pattern", donors=[[1, 2]]), "token-major"),
    "resample seed": (lambda: hooks.ResampleAblate("hook_embed", donors=[[1, 2]], seed=10**30),
                      r"resample seed must be an integer in -2\*\*63"),
    "empty donor": (lambda: hooks.Patch("hook_embed", donor=""), "empty"),
    "short donor": (lambda: hooks.Patch("hook_embed", donor=[1, 2]), "donor has 2 tokens"),
    "no donor": (lambda: hooks.Patch("hook_embed"), "needs a donor"),
    "not callable": (lambda: hooks.FunctionHook("hook_embed", 3), "callable"),
    "unknown type": (lambda: {"type": "explode", "hook": "hook_embed"}, "unknown intervention type"),
    "bad spec keys": (lambda: {"type": "zero_ablate", "hook": "hook_embed", "strength": 2}, "bad zero_ablate spec"),
    "not a spec": (lambda: "zero everything", "a dict with a 'type'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_intervention_is_refused_before_any_compute(tiny, forwards, case):
    make, message = BAD[case]
    with pytest.raises(workbench.HookError, match=message):
        tiny.run(IDS, interventions=[make()])
    assert forwards == []


def test_a_donor_trace_of_another_model_is_refused_before_any_compute(tiny, tiny_model, forwards):
    other = tiny_model("llama", n_layers=2, seed=2).run(IDS, record=["blocks.0.hook_resid_pre"])
    with pytest.raises(workbench.HookError, match="another model"):
        tiny.run(IDS, interventions=[hooks.Patch("blocks.0.hook_resid_pre", donor=other)])
    assert forwards == []


@pytest.mark.parametrize("vector, message", [
    (torch.full((D,), float("nan")), "NaN or Inf"),
    ([1.0] * (D - 1) + [float("inf")], "NaN or Inf"),
    (torch.ones(D, dtype=torch.bool), "real numbers"),
    (torch.ones(D, dtype=torch.complex64), "real numbers"),
    (["a"] * D, "tensor or a list of numbers"),
    (None, "tensor or a list of numbers"),
])
def test_bad_vectors_are_refused_when_built(vector, message):
    with pytest.raises(workbench.HookError, match=message):
        hooks.Steer("blocks.0.hook_resid_post", vector)
    with pytest.raises(workbench.HookError, match=message):
        hooks.MeanAblate("blocks.0.hook_resid_post", vector)


def test_a_donor_trace_without_the_hook(tiny, forwards):
    donor = hooks.Trace(IDS, IDS, [], torch.zeros(5, 8), fingerprint=tiny.fingerprint())
    with pytest.raises(workbench.HookError, match="did not record blocks.1.hook_resid_pre"):
        tiny.run(IDS, interventions=[hooks.Patch("blocks.1.hook_resid_pre", donor=donor)])
    assert forwards == []


@pytest.mark.parametrize("name, recorded, message", [
    ("blocks.0.hook_resid_pre", torch.zeros(D), "kept one row per point"),
    ("blocks.0.hook_resid_pre", torch.zeros(5, D + 1), r"has shape \(5, 65\), not this model's"),
    ("blocks.0.attn.hook_pattern", torch.zeros(4, 5, 4), r"has shape \(4, 5, 4\)"),
])
def test_a_donor_trace_that_cannot_be_patched_from(tiny, forwards, name, recorded, message):
    """A reduced batch trace, or a loaded one whose activation is not this model's shape, is refused by name."""
    donor = hooks.Trace(IDS, IDS, [], torch.zeros(5, 8), {name: recorded}, fingerprint=tiny.fingerprint(),
                        reduce="last" if recorded.dim() == 1 else None)
    with pytest.raises(workbench.HookError, match=message):
        tiny.run(IDS, interventions=[hooks.Patch(name, donor=donor)])
    assert forwards == []


def test_a_later_bad_intervention_stops_an_earlier_donor_run(tiny, forwards):
    good = hooks.Patch("blocks.0.hook_resid_pre", donor=[1, 2, 3, 4, 5])
    bad = hooks.Steer("blocks.0.hook_resid_post", torch.ones(3))
    with pytest.raises(workbench.HookError, match="steering vector"):
        tiny.run(IDS, interventions=[good, bad])
    assert forwards == []


def test_bad_record_patterns_and_contexts(tiny, forwards):
    with pytest.raises(workbench.HookError, match="did you mean blocks.1.hook_resid_post"):
        tiny.run(IDS, record=["blocks.1.hook_resid_pst"])
    with pytest.raises(workbench.HookError, match="non-empty string"):
        tiny.run(IDS, record=[""])
    with pytest.raises(workbench.HookError, match="unknown hook point"):
        with tiny.hooks(record=["nonsense"]):
            pass
    with pytest.raises(workbench.HookError, match="heads"):
        with tiny.hooks([hooks.ZeroAblate("blocks.0.attn.hook_z", heads=[9])]):
            tiny.forward(IDS)
    assert forwards == []
