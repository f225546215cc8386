"""Interventions during generation: active at every step, with the documented position semantics, on the KV cache."""
from __future__ import annotations

import pytest
import torch

import workbench
from workbench import hooks

PROMPT = [5, 17, 42, 99, 7]
NEW = 6


@pytest.fixture()
def tiny(tiny_model, monkeypatch):
    model = tiny_model("llama", n_layers=2, seed=11)
    monkeypatch.setattr(model.tokenizer, "stop_ids", set())  # a random model may emit an end token; these tests want every step
    return model


@pytest.fixture()
def count_forwards(monkeypatch):
    """``count_forwards(model)``: record how many tokens each runner forward of ``model`` is fed, for the test."""
    def count(model) -> list[int]:
        fed, forward = [], model.runner.forward

        def counting(ids, *args, **kwargs):
            fed.append(len(ids))
            return forward(ids, *args, **kwargs)

        monkeypatch.setattr(model.runner, "forward", counting)
        return fed

    return count


def tokens(model, prompt=PROMPT, **kwargs) -> list[int]:
    return [t for t, _ in model.stream(prompt, NEW, **kwargs)]


def test_hooked_generation_uses_the_kv_cache(tiny, count_forwards):
    fed = count_forwards(tiny)
    steer = hooks.Steer("blocks.0.hook_resid_post", torch.ones(tiny.config.d_model))
    out = tokens(tiny, interventions=[steer])
    assert len(out) == NEW
    assert fed == [len(PROMPT)] + [1] * (NEW - 1)  # the prefix is never fed again


def test_no_op_hooks_give_the_same_tokens(tiny):
    plain = tokens(tiny)
    no_ops = [("*", lambda x, ctx: None), hooks.Steer("blocks.*.hook_resid_pre", torch.zeros(tiny.config.d_model)),
              hooks.Scale("blocks.*.attn.hook_pattern", factor=1.0)]
    with tiny.hooks(record=["*"]) as recorder:
        assert tokens(tiny, interventions=no_ops) == plain
    # every point was recorded at every step: the prompt, then one row per token fed back
    assert recorder.activations()["blocks.1.hook_resid_post"].shape[0] == len(PROMPT) + NEW - 1


def test_embedded_no_op_hooks_give_the_same_tokens(model):
    prompt = "The capital of France is"
    plain = model.generate(prompt, 5)
    no_op = hooks.Steer("blocks.*.hook_resid_post", torch.zeros(model.config.d_model))
    assert model.generate(prompt, 5, interventions=[no_op, ("*", lambda x, ctx: None)]) == plain


def steering_rows(model, steer) -> torch.Tensor:
    """What a steer on blocks.0.hook_resid_pre added at each position (its input is just the token embedding)."""
    with model.hooks(record=["hook_embed", "blocks.0.hook_resid_pre"]) as recorder:
        tokens(model, interventions=[steer])
    acts = recorder.activations()
    return acts["blocks.0.hook_resid_pre"] - acts["hook_embed"]


def test_generated_positions_are_steered_at_every_step_and_the_prompt_is_not(tiny):
    vector = torch.randn(tiny.config.d_model, generator=torch.Generator().manual_seed(0))
    steer = hooks.Steer("blocks.0.hook_resid_pre", vector, scale=10.0, positions="generated")
    added = steering_rows(tiny, steer)
    n = len(PROMPT)
    assert added.shape[0] == n + NEW - 1
    assert torch.equal(added[:n], torch.zeros(n, tiny.config.d_model))
    # within the model's rounding of the steered stream (bfloat16 on CUDA)
    atol = 1e-4 + 2 * torch.finfo(tiny.dtype).eps * (10.0 * vector).abs().max().item()
    torch.testing.assert_close(added[n:], (10.0 * vector).expand(NEW - 1, -1), rtol=1e-5, atol=atol)
    # the first new token comes from the last prompt position, which "generated" leaves alone
    plain, steered = tokens(tiny), tokens(tiny, interventions=[steer])
    assert steered[0] == plain[0] and steered != plain


def test_absolute_and_negative_positions_during_generation(tiny):
    vector = torch.ones(tiny.config.d_model)
    n = len(PROMPT)
    beyond = steering_rows(tiny, hooks.Steer("blocks.0.hook_resid_pre", vector, positions=[n + 2]))
    assert beyond.abs().sum(-1).nonzero().flatten().tolist() == [n + 2]
    last_prompt = steering_rows(tiny, hooks.Steer("blocks.0.hook_resid_pre", vector, positions=[-1]))
    assert last_prompt.abs().sum(-1).nonzero().flatten().tolist() == [n - 1]


def test_hook_context_sees_positions_and_steps(tiny):
    seen = []
    tokens(tiny, interventions=[("blocks.1.hook_resid_mid",
                                 lambda x, ctx: seen.append((ctx.step, ctx.positions.tolist())))])
    n = len(PROMPT)
    assert seen == [(0, list(range(n)))] + [(step, [n + step - 1]) for step in range(1, NEW)]


def test_positions_beyond_the_generation_are_refused_before_any_compute(tiny, count_forwards):
    fed = count_forwards(tiny)
    steer = hooks.Steer("blocks.0.hook_resid_pre", torch.ones(tiny.config.d_model), positions=[len(PROMPT) + NEW])
    with pytest.raises(workbench.HookError, match="out of range"):
        tokens(tiny, interventions=[steer])
    assert fed == []


def test_generation_continues_a_cache_with_interventions(tiny):
    steer = hooks.Steer("blocks.1.hook_resid_post", torch.ones(tiny.config.d_model), positions="generated")
    whole = tokens(tiny, interventions=[steer])
    cache = tiny.new_cache()
    tiny.forward(PROMPT[:-1], cache=cache)
    # the last prompt token continues the cache; positions stay absolute, so "generated" means the same
    assert tokens(tiny, prompt=PROMPT[-1:], cache=cache, interventions=[steer]) == whole
