"""Direct logit attribution: the contributions sum to the model's logit (difference)."""
from __future__ import annotations

import numpy as np
import pytest

import workbench
from workbench import probes


@pytest.fixture(scope="module")
def small(tiny_model):
    return tiny_model("qwen2", n_layers=3, n_heads=4, n_kv_heads=2, device="cpu")


def test_contributions_sum_to_the_logit(small):
    prompt = "the cat sat on the mat"
    attribution = probes.direct_logit_attribution(small, prompt, target=40, position=3)
    logits = small.run(prompt).logits
    assert attribution.logit == pytest.approx(float(logits[3, 40]))
    assert attribution.error < 1e-5 * max(1.0, abs(attribution.logit))
    assert len(attribution.labels) == 1 + 3 * (4 + 1)
    assert attribution.labels[:3] == ["embed", "L0H0", "L0H1"] and attribution.labels[5] == "L0 MLP"
    assert tuple(attribution.heads().shape) == (3, 4)
    # a logit difference is the difference of the two attributions, component by component
    other = probes.direct_logit_attribution(small, prompt, target=50, position=3)
    difference = probes.direct_logit_attribution(small, prompt, target=40, baseline=50, position=3)
    assert (difference.contributions - (attribution.contributions - other.contributions)).abs().max() < 1e-9
    assert difference.logit == pytest.approx(float(logits[3, 40] - logits[3, 50]), abs=1e-5)


def test_bad_attribution_requests(small):
    with pytest.raises(workbench.WorkbenchError, match="out of range"):
        probes.direct_logit_attribution(small, "the cat", target=40, position=9)
    with pytest.raises(workbench.WorkbenchError, match="not one"):
        probes.direct_logit_attribution(small, "the cat", target="the cat sat")


def test_position_and_token_are_checked_before_the_forward(small, monkeypatch):
    calls = []
    monkeypatch.setattr(small, "run", lambda *a, **k: calls.append(1))
    with pytest.raises(workbench.WorkbenchError, match="position must be an integer"):
        probes.direct_logit_attribution(small, "the cat", target=40, position=1.0)
    with pytest.raises(workbench.WorkbenchError, match="out of range"):
        probes.direct_logit_attribution(small, "the cat", target=40, position=9)
    assert calls == []
    monkeypatch.undo()
    assert probes.direct_logit_attribution(small, "the cat", target=np.int64(40), position=np.int64(1)).position == 1


def test_sum_check_on_the_embedded_model(model):
    attribution = probes.direct_logit_attribution(model, "The capital of France is", " Paris", baseline=" London")
    assert attribution.logit > 0  # the model prefers Paris
    assert attribution.error < 1e-4
    n_components = 1 + model.config.n_layers * (model.config.n_heads + 1)
    assert len(attribution.contributions) == n_components
    bars = attribution.figure(top=10).data[0]
    assert len(bars.x) == 10 and abs(bars.y[0]) == max(abs(float(c)) for c in attribution.contributions)


def test_attention_output_bias_is_a_component(tmp_path):
    """GPT-OSS adds a bias to attention's output that no head's result holds: it is a component of its own, so the
    contributions still sum to the logit."""
    from moe_reference import hf_moe_model

    hf_moe_model("gpt-oss", tmp_path, n_layers=2)
    model = workbench.load(tmp_path, device="cpu")
    attribution = probes.direct_logit_attribution(model, [5, 77, 120, 3, 250], target=40, baseline=50)
    assert attribution.error < 1e-5 * max(1.0, abs(attribution.logit))
    assert [l for l, k in zip(attribution.labels, attribution.kinds) if k == "bias"] == ["L0 O bias", "L1 O bias"]
    assert attribution.labels.index("L0 O bias") == 1 + model.config.n_heads
    assert tuple(attribution.heads().shape) == (2, model.config.n_heads)
