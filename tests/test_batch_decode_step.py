"""Batched greedy decode steps as one static step (``generate_batch_tokens(static_step=...)``): every row's step over a
``StaticBatchKVCache`` whose lengths, rope positions, mask and write slots live on the device, captured as a CUDA graph
on CUDA. On the CPU the same step runs eagerly: it must give the eager batched steps' logits and tokens.

The static step attends over the cache's whole capacity, the eager one over the longest row's slots, so their logits
may differ in the last bits of the softmax's and the weighted sum's reductions: on the CPU in float32 the measured
difference is 1.1e-7 of the logits' range; STATIC_BOUND allows ten times that.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import workbench.generation as generation
from workbench import hooks
from workbench.generation import Sampling, generate_batch_tokens
from workbench.kv_cache import StaticBatchKVCache
from workbench.runner import BatchLayout, capturable

PROMPTS = [[5, 17, 42, 99, 7, 23, 61], [8, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [40, 41, 42, 43]]
STATIC_BOUND = 1e-6  # max |logit diff| over the logits' largest magnitude, static step against eager batched steps
# the same on CUDA in float32, not yet measured there (the test prints what it sees: run it with -s)
CUDA_STATIC_BOUND = 1e-5


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama", seed=3, device="cpu")


def steer(model, positions):
    vector = torch.randn(model.config.d_model, generator=torch.Generator().manual_seed(2))
    return hooks.Steer("blocks.0.hook_resid_post", vector, scale=6.0, positions=positions)


def batch_hooks(model, interventions, new_tokens: int = 8):
    """The batch-level hooks of ``interventions`` shared by every prompt of PROMPTS, as ``model.stream_batch`` makes
    them."""
    compiled = hooks.compile_prompt_hooks(model, [interventions] * len(PROMPTS), [len(p) for p in PROMPTS],
                                          [len(p) + new_tokens for p in PROMPTS])
    return hooks.per_prompt_hooks({i: h for i, (h, _) in enumerate(compiled)}) or None


def prefilled(runner, hooks_, capacity: int):
    """A batch cache of PROMPTS after one batched prefill, and each row's greedy first token."""
    cache = runner.new_batch_cache(len(PROMPTS), capacity)
    layout = BatchLayout([len(p) for p in PROMPTS], runner.device, cached=cache.lengths)
    logits = runner.forward(torch.tensor([t for p in PROMPTS for t in p]), cache=cache, hooks=hooks_, layout=layout,
                            last_logits_only=True)
    return cache, logits.argmax(-1)


def count_static_steps(monkeypatch) -> list:
    """A list that each static batch step built gets appended to."""
    built = []
    make = generation._batch_step
    monkeypatch.setattr(generation, "_batch_step", lambda *a: built.append(make(*a)) or built[-1])
    return built


@pytest.mark.parametrize("positions", ["none", None, "generated"])
def test_static_batch_cache_steps_give_the_eager_batched_logits(llama, positions):
    """Prompts of different lengths, each row at a length of its own: every step's logits over the static cache (rope
    positions, mask and write slots from the device-side lengths) equal the eager batched step's within STATIC_BOUND,
    with and without a Steer that every row shares, and pick the same tokens."""
    runner = llama.runner
    hooks_ = None if positions == "none" else batch_hooks(llama, [steer(llama, positions)])
    capacity = max(map(len, PROMPTS)) + 8
    eager, first = prefilled(runner, hooks_, capacity)
    static_from, _ = prefilled(runner, hooks_, capacity)
    static = StaticBatchKVCache(static_from)
    static_layout = BatchLayout([1] * len(PROMPTS), runner.device)
    tokens = first
    for step in range(1, 8):
        layout = BatchLayout([1] * len(PROMPTS), runner.device, cached=eager.lengths)
        expected = runner.forward(tokens, cache=eager, hooks=hooks_, layout=layout, last_logits_only=True, step=step)
        got = runner.forward(tokens, cache=static, hooks=hooks_, layout=static_layout, last_logits_only=True)
        assert (got - expected).abs().max().item() <= STATIC_BOUND * expected.abs().max().item()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        # feed varied tokens, not only the random model's repeats, so that every step tests new keys
        tokens = (expected.argmax(-1) + step * 7) % llama.config.vocab_size
    assert static.device_length.tolist() == [len(p) + 7 for p in PROMPTS]


def per_row(events) -> dict[int, list[int]]:
    return {i: [t for j, t in events if j == i] for i in range(len(PROMPTS))}


def assert_static_equals_eager(runner, hooks_, stop_ids, built: list, new_tokens: int = 8) -> list:
    """The static step's events equal the eager batched path's (same tokens, same order); returns them."""
    prompts = dict(enumerate(PROMPTS))
    eager = list(generate_batch_tokens(runner, prompts, new_tokens, stop_ids=stop_ids, hooks=hooks_, static_step=False))
    assert not built
    static = list(generate_batch_tokens(runner, prompts, new_tokens, stop_ids=stop_ids, hooks=hooks_, static_step=True))
    assert static == eager and len(built) == 1
    built.clear()
    return static


@pytest.mark.parametrize("positions", ["none", None, "generated"])
def test_static_step_generates_the_eager_batched_tokens(llama, monkeypatch, positions):
    """``generate_batch_tokens`` through the static step yields exactly the eager batched path's (prompt, token)
    events, in the same order, with and without a shared Steer, with and without a row that stops at its first token
    (it keeps running inside the step, unread)."""
    hooks_ = None if positions == "none" else batch_hooks(llama, [steer(llama, positions)])
    built = count_static_steps(monkeypatch)
    plain = assert_static_equals_eager(llama.runner, hooks_, frozenset(), built)
    stopped = per_row(assert_static_equals_eager(llama.runner, hooks_, {per_row(plain)[1][0]}, built))
    assert stopped[1] == per_row(plain)[1][:1] and len(stopped[2]) == 8


def test_a_row_stopping_during_static_steps(llama, monkeypatch):
    """One row stops at its first token, one at its second (inside the static steps, read one step behind on CUDA),
    the others run to the end: the events are the eager path's."""
    hooks_ = batch_hooks(llama, [steer(llama, "generated")])
    built = count_static_steps(monkeypatch)
    plain = per_row(assert_static_equals_eager(llama.runner, hooks_, frozenset(), built))
    stop_ids = {plain[1][0], plain[0][1]}
    assert not stop_ids & {*plain[2], *plain[3]} and plain[0][0] not in stop_ids  # the steered model's tokens
    stopped = per_row(assert_static_equals_eager(llama.runner, hooks_, stop_ids, built))
    assert [len(stopped[i]) for i in range(4)] == [2, 1, 8, 8]


def test_which_hooks_a_static_step_holds(llama, monkeypatch):
    """Shared whole-token edits at positions None or "generated" (Steer, Scale, ZeroAblate, MeanAblate) qualify;
    positions given as a list, a selection of heads or neurons, a Patch, a plain function hook, a recorder, per-prompt
    edits that differ, sampling with a temperature, and per-prompt adapters stay eager, with the same tokens."""
    d = llama.config.d_model
    held = [[steer(llama, None)], [steer(llama, "generated")], [hooks.Scale("blocks.1.hook_mlp_out", 0.5)],
            [hooks.ZeroAblate("blocks.0.attn.hook_z"), hooks.MeanAblate("ln_final.hook_normalized", torch.ones(d),
                                                                         positions="generated")]]
    for interventions in held:
        assert capturable(batch_hooks(llama, interventions))
    eager = [[hooks.Steer("blocks.0.hook_resid_post", torch.ones(d), positions=[0, 1, 9])],
             [hooks.ZeroAblate("blocks.0.attn.hook_z", heads=[1])],
             [hooks.Scale("blocks.0.mlp.hook_post", 2.0, neurons=[3])],
             [hooks.Patch("blocks.0.hook_resid_post", donor=PROMPTS[0], positions=[0])],
             [("blocks.0.hook_resid_post", lambda x, ctx: None)]]
    for interventions in eager:
        assert not capturable(batch_hooks(llama, interventions))
    recorder = hooks.BatchRecorder(["blocks.0.hook_resid_post"])
    assert not capturable(recorder.hooks())
    own = hooks.compile_prompt_hooks(llama, [[steer(llama, None)], [steer(llama, None)]], [7, 2], [15, 10])
    assert not capturable(hooks.per_prompt_hooks({0: own[0][0], 1: own[1][0]}))  # equal edits, other objects

    built = count_static_steps(monkeypatch)
    prompts = dict(enumerate(PROMPTS))
    for interventions in eager[:2]:
        hooks_ = batch_hooks(llama, interventions)
        assert list(generate_batch_tokens(llama.runner, prompts, 4, hooks=hooks_, static_step=True)) == list(
            generate_batch_tokens(llama.runner, prompts, 4, hooks=hooks_, static_step=False))
    sampled = Sampling(temperature=0.8, seed=1)
    assert list(generate_batch_tokens(llama.runner, prompts, 4, sampled, static_step=True)) == list(
        generate_batch_tokens(llama.runner, prompts, 4, sampled, static_step=False))
    assert not built
    list(generate_batch_tokens(llama.runner, prompts, 4, static_step=True))
    assert len(built) == 1


def test_model_batches_on_the_cpu_take_eager_steps(llama, monkeypatch):
    """By default ``generate_batch`` takes the static step on CUDA alone: on the CPU the eager batched step, attending
    over the longest row, is less work than over the capacity, and there are no launches to save."""
    built = count_static_steps(monkeypatch)
    llama.generate_batch(PROMPTS, 4, interventions=[steer(llama, "generated")])
    assert not built


# -------------------------------------------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cuda_llama(tiny_model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return tiny_model("llama", "Q4_K", seed=3, device="cuda", dtype="float32", d_model=256, n_heads=4, d_mlp=512)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("positions", ["none", None, "generated"])
def test_cuda_graph_of_the_batched_step_generates_the_eager_tokens(cuda_llama, monkeypatch, positions):
    """The captured and replayed batched step (tokens read back one step behind) yields the eager batched path's
    events exactly, with and without a shared Steer, with rows that stop early; its logits are the eager static
    step's and the eager batched step's within CUDA_STATIC_BOUND, and it picks their tokens."""
    model, runner = cuda_llama, cuda_llama.runner
    hooks_ = None if positions == "none" else batch_hooks(model, [steer(model, positions)])
    prompts = dict(enumerate(PROMPTS))
    plain = list(generate_batch_tokens(runner, prompts, 12, hooks=hooks_, static_step=False))
    per_row = {i: [t for j, t in plain if j == i] for i in prompts}
    stop_ids = {per_row[1][0], per_row[0][3]}
    built = count_static_steps(monkeypatch)
    for stops in (frozenset(), stop_ids):
        eager = list(generate_batch_tokens(runner, prompts, 12, stop_ids=stops, hooks=hooks_, static_step=False))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a capture that fails back to eager fails the test
            graph = list(generate_batch_tokens(runner, prompts, 12, stop_ids=stops, hooks=hooks_))
        assert graph == eager and len(built) == 1 and built[0] is not None
        built.clear()

    capacity = max(map(len, PROMPTS)) + 12
    eager_cache, first = prefilled(runner, hooks_, capacity)
    graph_from, _ = prefilled(runner, hooks_, capacity)
    twin_from, _ = prefilled(runner, hooks_, capacity)
    step = generation._batch_step(runner, StaticBatchKVCache(graph_from), hooks_, None, list(prompts))
    twin, twin_layout = StaticBatchKVCache(twin_from), BatchLayout([1] * len(PROMPTS), runner.device)
    tokens, worst = first, 0.0
    for i in range(1, 6):
        layout = BatchLayout([1] * len(PROMPTS), runner.device, cached=eager_cache.lengths)
        expected = runner.forward(tokens, cache=eager_cache, hooks=hooks_, layout=layout, last_logits_only=True,
                                  step=i)
        replayed = step(tokens.tolist()).clone()
        eager_static = runner.forward(tokens, cache=twin, hooks=hooks_, layout=twin_layout, last_logits_only=True)
        for other in (eager_static, expected):
            difference = (replayed - other).abs().max().item() / other.abs().max().item()
            assert difference <= CUDA_STATIC_BOUND
            worst = max(worst, difference)
        assert torch.equal(step.token, expected.argmax(-1))  # the next inputs, picked on the device
        tokens = (expected.argmax(-1) + i * 7) % model.config.vocab_size
    print(f"captured batched step against eager steps, max |logit diff| / max |logit|: {worst:.2e}")


@pytest.mark.cuda
@needs_cuda
def test_cuda_batched_capture_failure_decodes_eagerly(cuda_llama, monkeypatch):
    runner, prompts = cuda_llama.runner, dict(enumerate(PROMPTS))
    hooks_ = batch_hooks(cuda_llama, [steer(cuda_llama, "generated")])
    eager = list(generate_batch_tokens(runner, prompts, 8, hooks=hooks_, static_step=False))

    def no_graph(*args, **kwargs):
        raise RuntimeError("no graphs here")

    monkeypatch.setattr(torch.cuda, "graph", no_graph)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed, decoding eagerly: no graphs here"):
        assert list(generate_batch_tokens(runner, prompts, 8, hooks=hooks_)) == eager
