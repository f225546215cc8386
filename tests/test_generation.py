"""Sampling, the decode loop over the KV cache, and the built decode steps (CUDA graphs, compiled CPU step)."""
from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch

from workbench import model as model_module
from workbench.errors import WorkbenchError
from workbench.kernels import cpu, layer_ops
from workbench.generation import (
    _BUILT, MIN_STEP_CAPACITY, DecodeStep, Sampling, _built_step, _forward_and_pick, argmax_by_chunks, generate_tokens,
)


@pytest.fixture(scope="module")
def small(tiny_model):
    return tiny_model("qwen2", "Q8_0", seed=3, n_layers=2, n_ctx=64, device="cpu")


def greedy_by_full_forward(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model.forward(ids)[-1].argmax()))
    return ids[-n:]


def test_cached_decode_equals_full_recompute(small):
    prompt = [10, 20, 30, 40]
    assert list(generate_tokens(small.runner, prompt, 8)) == greedy_by_full_forward(small, prompt, 8)


def test_a_callers_cache_stays_editable_after_generation(small):
    """Generation runs its own cache under inference mode, never a caller's: a cache grown during generation keeps
    ordinary tensors, which surgery edits in place afterwards, and the tokens are those of the loop's own cache."""
    prompt = [10, 20, 30, 40]
    cache = small.runner.new_cache(capacity=2)  # grown inside the forward
    tokens = list(generate_tokens(small.runner, prompt, 8, cache=cache))
    assert tokens == list(generate_tokens(small.runner, prompt, 8))
    assert not any(t.is_inference() for t in (*cache._keys, *cache._values))
    cache.delete_positions([1])
    cache.truncate(5)
    assert cache.length == 5


def test_cache_logits_match_full_forward(small):
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    full = small.runner.forward(ids)
    for cache in (small.runner.new_cache(), small.runner.new_static_cache(16)):
        pieces = [small.runner.forward(ids[:5], cache=cache), small.runner.forward(ids[5:6], cache=cache),
                  small.runner.forward(ids[6:], cache=cache)]
        assert torch.allclose(torch.cat(pieces), full, atol=1e-4), type(cache).__name__


def test_static_cache_generation_matches_dynamic(small):
    runner, prompt = small.runner, [7, 8, 9]
    cache = runner.new_static_cache(len(prompt) + 6)
    via_static = list(generate_tokens(runner, prompt, 6, cache=cache))
    assert via_static == list(generate_tokens(runner, prompt, 6))
    assert int(cache.device_length) == len(prompt) + 6  # a caller's cache ends holding every generated token


def test_sampling_is_seeded_and_bounded():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    draws = lambda s: [s.pick(logits, g) for g in [s.generator()] for _ in range(50)]
    assert draws(Sampling(temperature=1.0, seed=7)) == draws(Sampling(temperature=1.0, seed=7))
    assert set(draws(Sampling(temperature=1.0, top_k=2, seed=1))) <= {1, 2}
    assert set(draws(Sampling(temperature=1.0, top_p=0.5, seed=1))) == {1}
    assert Sampling().pick(logits, Sampling().generator()) == 1
    assert len(set(draws(Sampling(temperature=5.0, seed=2)))) == 4
    # an infinite temperature samples uniformly over what the cuts keep, the cuts ranking by the logits
    inf = float("inf")
    assert set(draws(Sampling(temperature=inf, top_k=2, seed=3))) == {1, 2}
    assert set(draws(Sampling(temperature=inf, top_k=1, seed=3))) == {1}
    assert set(draws(Sampling(temperature=inf, top_p=0.5, seed=3))) == {1, 2}  # 2 of 4 equal shares reach 0.5
    assert set(draws(Sampling(temperature=inf, seed=3))) == {0, 1, 2, 3}


BAD_SAMPLING = [
    (dict(temperature=-1), "temperature must be >= 0"), (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(temperature="0.5"), "temperature must be a number"), (dict(temperature=True), "temperature must be a number"),
    # logits / 1e-45 overflow float32: the softmax would be NaN
    (dict(temperature=1e-45), "temperature must be 0 .greedy. or at least 1e-06"),
    (dict(top_k=-2), "top_k must be >= 0"), (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    (dict(top_k=True), "top_k must be an integer, got True"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=float("nan")), "top_p"), (dict(top_p="1"), "top_p must be a number"),
    (dict(seed=1.5), "seed must be an integer, got 1.5"), (dict(seed="a"), "seed must be an integer"),
    (dict(seed=False), "seed must be an integer"), (dict(seed=2 ** 64), "seed must be an integer in"),
    (dict(seed=-(2 ** 63) - 1), "seed must be an integer in"),
]


@pytest.mark.parametrize("kwargs, message", BAD_SAMPLING)
def test_bad_sampling(kwargs, message):
    with pytest.raises(WorkbenchError, match=message):
        Sampling(**kwargs)


def test_sampling_keeps_plain_numbers_and_torchs_seed_range():
    import numpy as np
    s = Sampling(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1, seed=2 ** 64 - 1)
    assert (s.temperature, s.top_k, s.top_p) == (0.5, 3, 1.0) and type(s.top_k) is int
    assert s.generator().initial_seed() == 2 ** 64 - 1
    assert Sampling(temperature=1e-6).temperature == 1e-6 and Sampling(temperature=float("inf"), seed=-1)


@pytest.mark.parametrize("kwargs, message", BAD_SAMPLING[:9])
def test_bad_sampling_leaves_a_callers_cache_untouched(small, kwargs, message):
    cache = small.new_cache()
    small.forward([3, 4, 5], cache=cache)
    keys = cache.get(0)[0]
    with pytest.raises(WorkbenchError, match=message):
        small.stream([6, 7], 4, cache=cache, **{"temperature": 1.0, **kwargs})  # refused at the call
    assert cache.tokens == [3, 4, 5] and torch.equal(cache.get(0)[0], keys)


def test_continuing_a_cache_after_generating_equals_a_fresh_run(small):
    """The cache ends holding the prompt and every generated token, so a second turn through it is a fresh run on
    the whole text."""
    first, more = [10, 20, 30, 40], [7, 8]
    cache = small.new_cache()
    generated = [t for t, _ in small.stream(first, 6, cache=cache)]
    assert cache.tokens == first + generated
    second = [t for t, _ in small.stream(more, 6, cache=cache)]
    assert second == [t for t, _ in small.stream(first + generated + more, 6)]
    assert cache.tokens == first + generated + more + second
    # next-token logits through the cache equal the full forward's
    assert torch.allclose(small.forward([9], cache=cache), small.forward(cache.tokens[:-1] + [9])[-1:], atol=1e-4)


def test_a_stop_token_and_a_prompt_alone_reach_the_cache(small):
    prompt = [10, 20, 30, 40]
    free = list(generate_tokens(small.runner, prompt, 6))
    stop = free[2]
    cache = small.runner.new_cache()
    tokens = list(generate_tokens(small.runner, prompt, 6, stop_ids={stop}, cache=cache))
    assert tokens == free[:free.index(stop) + 1] and cache.tokens == prompt + tokens  # the stop token included
    cache = small.runner.new_cache()
    assert list(generate_tokens(small.runner, prompt, 0, cache=cache)) == [] and cache.tokens == prompt
    assert list(generate_tokens(small.runner, prompt, 0)) == []


def test_a_reader_leaving_early_has_the_tokens_it_read_in_the_cache(small):
    prompt = [10, 20, 30, 40]
    cache = small.runner.new_cache()
    tokens = generate_tokens(small.runner, prompt, 8, cache=cache)
    read = [next(tokens), next(tokens)]
    tokens.close()
    assert cache.tokens == prompt + read
    # a cache edited between reads is left as the edit made it
    cache = small.runner.new_cache()
    tokens = generate_tokens(small.runner, prompt, 8, cache=cache)
    next(tokens)
    cache.truncate(2)
    tokens.close()
    assert cache.tokens == prompt[:2]


def test_context_overflow_is_refused_before_compute(small):
    with pytest.raises(WorkbenchError, match="exceed the context of 64"):
        next(generate_tokens(small.runner, [1] * 60, 10))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = [5, 6, 7, 8]


def cuda_model_and_eager_tokens(tiny_model):
    """A fresh 2-layer Q4_K model on CUDA (nothing captured yet) and its eager greedy 12 tokens after PROMPT."""
    model = tiny_model("llama", "Q4_K", n_layers=2, d_model=256, d_mlp=512, device="cuda", dtype="float32",
                       cached=False)
    return model, list(generate_tokens(model.runner, PROMPT, 12, compiled=False))


@needs_cuda
def test_cuda_graph_decode_matches_eager(tiny_model):
    model, eager = cuda_model_and_eager_tokens(tiny_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the eager capture fails the test
        with_compiled_graph = list(generate_tokens(model.runner, PROMPT, 12, compiled=True))
    assert with_compiled_graph == eager


@needs_cuda
def test_cuda_graph_decode_stops_and_samples_like_eager(tiny_model):
    model, eager = cuda_model_and_eager_tokens(tiny_model)
    # greedy tokens are read one step behind the GPU: a stop token must still end the stream at once
    stop = eager[6]
    assert list(generate_tokens(model.runner, PROMPT, 12, stop_ids={stop}, compiled=True)) == eager[:eager.index(stop) + 1]
    assert list(generate_tokens(model.runner, PROMPT, 1, compiled=True)) == eager[:1]
    assert list(generate_tokens(model.runner, PROMPT, 2, compiled=True)) == eager[:2]
    # the captured step is kept for the next call of the same size; a second stream meanwhile gets its own
    captured = _BUILT[model.runner]["exact"]
    first, second = generate_tokens(model.runner, PROMPT, 12, compiled=True), generate_tokens(model.runner, [9, 3], 12, compiled=True)
    interleaved = list(zip(first, second))
    assert next(second, None) is None  # zip left it suspended after its last token; this finishes it
    assert [a for a, _ in interleaved] == eager
    assert [b for _, b in interleaved] == list(generate_tokens(model.runner, [9, 3], 12, compiled=False))
    replacement = _BUILT[model.runner]["exact"]
    assert replacement is not captured and not captured.busy and not replacement.busy
    assert list(generate_tokens(model.runner, PROMPT, 12, compiled=True)) == eager
    assert _BUILT[model.runner]["exact"] is replacement  # reused, not captured again
    sampling = Sampling(temperature=0.8, top_k=20, seed=3)
    sampled_eager = list(generate_tokens(model.runner, PROMPT, 12, sampling, compiled=False))
    assert list(generate_tokens(model.runner, PROMPT, 12, sampling, compiled=True)) == sampled_eager


def test_built_step_is_reused_only_under_its_numerics(small):
    """A CUDA graph replays the kernels it captured: a step built under one numerics is not taken under another, and
    runs in its own whatever block it is called in."""
    runner = small.runner
    seen = []
    step = DecodeStep(lambda: seen.append(cpu.get_numerics()), runner.new_static_cache(MIN_STEP_CAPACITY // 4),
                      torch.zeros(1, dtype=torch.long))
    assert step.numerics == "exact"
    _BUILT[runner] = {"exact": step}
    try:
        assert _built_step(runner, step.cache.capacity, "llamacpp") is None
        assert _built_step(runner, step.cache.capacity, "exact") is step
        with cpu.numerics("llamacpp"):
            step(3)
        assert seen == ["exact"] and int(step.token) == 3
    finally:
        del _BUILT[runner]


@needs_cuda
def test_cuda_graph_decode_under_llamacpp_numerics(tiny_model):
    model, _ = cuda_model_and_eager_tokens(tiny_model)
    list(generate_tokens(model.runner, PROMPT, 12, compiled=True))
    exact_step = _BUILT[model.runner]["exact"]
    with cpu.numerics("llamacpp"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every matmul of the model has a llama.cpp kernel on CUDA
        eager = list(generate_tokens(model.runner, PROMPT, 12, compiled=False))
        assert list(generate_tokens(model.runner, PROMPT, 12, compiled=True)) == eager
        step = _BUILT[model.runner]["llamacpp"]
        assert step is not exact_step and step.numerics == "llamacpp"
        quantized, quantized_eager = compiled_step_logits(model.runner, step, eager[:3]), eager_logits(model.runner, eager[:3])
    exact = compiled_step_logits(model.runner, exact_step, eager[:3])
    assert max_difference(quantized, quantized_eager) < 1e-4 < max_difference(exact, quantized_eager)


def break_torch_compile(monkeypatch) -> None:
    """Make every ``torch.compile`` build fail when first called, as on a machine without a working compiler."""
    def broken_compile(fn, **kwargs):
        def fails(*args, **kw):
            raise RuntimeError("no compiler here")
        return fails

    monkeypatch.setattr(torch, "compile", broken_compile)


@needs_cuda
def test_cuda_graph_falls_back_to_eager_capture_when_compiling_fails(monkeypatch, tiny_model):
    model, eager = cuda_model_and_eager_tokens(tiny_model)
    break_torch_compile(monkeypatch)
    with pytest.warns(RuntimeWarning, match="capturing the eager forward instead: no compiler here"):
        with_graph = list(generate_tokens(model.runner, PROMPT, 12, compiled=True))
    assert with_graph == eager


def compiled_step_logits(runner, step, tokens: list[int]) -> list[torch.Tensor]:
    """The built step's logits for each of ``tokens`` in turn, after PROMPT prefilled eagerly into its cache, all in the
    step's numerics."""
    step.cache.rewind(torch.zeros_like(step.cache.device_length))
    with cpu.numerics(step.numerics):
        runner.forward(torch.tensor(PROMPT), cache=step.cache)
    return [step(token).clone() for token in tokens]


def eager_logits(runner, tokens: list[int]) -> list[torch.Tensor]:
    """The full forward's last logits over PROMPT + tokens[:i + 1], for each i."""
    return [runner.forward(torch.tensor(PROMPT + tokens[:i + 1]), last_logits_only=True) for i in range(len(tokens))]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_compiled_cpu_decode_matches_eager(small, tiny_model):
    # The CPU compiles of the suite (~1 min on 2 cores without torch's on-disk cache). Two models' steps live in one
    # process, each must run its own build; the steps' logits over four decode positions match the eager forward's.
    model = tiny_model("llama", "Q4_K", seed=5, n_layers=2, d_model=256, d_mlp=512, tied_embeddings=False,  # varied tokens
                       device="cpu", cached=False)
    greedy = {m: list(generate_tokens(m.runner, PROMPT, 12)) for m in (model, small)}  # eager: the CPU default
    assert model.runner not in _BUILT
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager decoding fails the test
        for m in (model, small):
            assert list(generate_tokens(m.runner, PROMPT, 12, compiled=True)) == greedy[m]
    built = {m: _BUILT[m.runner]["exact"] for m in (model, small)}
    for m in (model, small):
        tokens = greedy[m][:4]
        assert max_difference(compiled_step_logits(m.runner, built[m], tokens), eager_logits(m.runner, tokens)) < 1e-4

    runner, tokens = model.runner, greedy[model]
    assert len(set(tokens)) > 6
    stop = tokens[6]
    assert list(generate_tokens(runner, PROMPT, 12, stop_ids={stop}, compiled=True)) == tokens[:tokens.index(stop) + 1]
    sampling = Sampling(temperature=0.8, top_k=20, seed=3)
    assert list(generate_tokens(runner, PROMPT, 12, sampling, compiled=True)) == list(
        generate_tokens(runner, PROMPT, 12, sampling))
    assert _BUILT[runner]["exact"] is built[model] and not built[model].busy  # kept for the next call of its size

    # torch.compile reads the numerics as a constant of the graph, unguarded: a step built in exact numerics computes
    # them in a llama.cpp-numerics block too, and generating there builds (and keeps) a step of those numerics. A
    # compiled step takes llama.cpp's matmuls but keeps the torch formulas of the glue between them (the eager forward
    # emulates ggml's: docs/kernels.md), so both run under exact_glue() (the step's prefill is an eager forward).
    with cpu.numerics("llamacpp"), layer_ops.exact_glue():
        quantized_eager = eager_logits(runner, tokens[:2])
        still_exact = compiled_step_logits(runner, built[model], tokens[:2])
        list(generate_tokens(runner, PROMPT, 3, compiled=True))
        quantized_step = _BUILT[runner]["llamacpp"]
        quantized = compiled_step_logits(runner, quantized_step, tokens[:2])
    assert quantized_step is not built[model] and _BUILT[runner]["exact"] is built[model]
    exact_eager = eager_logits(runner, tokens[:2])
    assert max_difference(still_exact, exact_eager) < 1e-4 < max_difference(still_exact, quantized_eager)
    assert max_difference(quantized, quantized_eager) < 1e-4 < max_difference(quantized, exact_eager)


def test_compiled_cpu_step_does_not_keep_its_model_alive(tiny_model):
    model = tiny_model("llama", "Q8_0", seed=4, n_layers=1, device="cpu", cached=False)
    list(generate_tokens(model.runner, PROMPT, 3, compiled=True))
    assert model.runner in _BUILT
    runner = weakref.ref(model.runner)
    del model
    gc.collect()
    assert runner() is None  # and with it, its entry in _BUILT


def test_compiled_cpu_decode_falls_back_to_eager_when_compiling_fails(monkeypatch, tiny_model):
    runner = tiny_model("llama", "Q8_0", seed=4, n_layers=1, device="cpu", cached=False).runner
    eager = list(generate_tokens(runner, PROMPT, 8))
    break_torch_compile(monkeypatch)
    with pytest.warns(RuntimeWarning, match="decoding eagerly: no compiler here"):
        assert list(generate_tokens(runner, PROMPT, 8, compiled=True)) == eager
    assert runner not in _BUILT


def test_argmax_by_chunks_is_argmax():
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 127, 128, 129, 1000, 49152):
        values = torch.randn(n, generator=g)
        assert argmax_by_chunks(values) == values.argmax(), n
    ties = torch.zeros(1000)
    ties[[300, 700]] = 5.0
    assert argmax_by_chunks(ties) == 300  # the first of equal maxima, as argmax
    assert argmax_by_chunks(torch.full((300,), float("-inf"))) == 0


def test_decode_step_compiles_without_graph_breaks(small):
    # A break inside the captured step makes torch.compile guard on (and recompile for) every replay's
    # temporaries, which invalidates the CUDA graph capture; dynamo's tracing is device-independent.
    runner = small.runner
    cache = runner.new_static_cache(16)
    runner.forward(torch.tensor([1, 2, 3]), cache=cache)
    explained = torch._dynamo.explain(_forward_and_pick)(runner, torch.tensor([4]), cache)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_eager_code_beside_a_compile_in_another_thread_is_not_traced():
    from workbench.kernels.tracing import compiling

    if not hasattr(torch.compiler, "_compile_session_context"):
        pytest.skip("this torch has no _compile_session_context to stand in for another thread's compile")
    with torch.compiler._compile_session_context():  # what another thread's compile sets, process-wide
        assert torch.compiler.is_compiling() and not compiling()
    assert torch.compile(lambda x: x + compiling(), fullgraph=True)(torch.zeros(1)).item() == 1


def _join_builds() -> None:
    for thread in threading.enumerate():
        if thread.name == "workbench-decode-build":
            thread.join()


def test_background_build_answers_eagerly_then_takes_over(monkeypatch, tiny_model):
    """The first tokens come from the eager forward while the step builds; the built step then decodes the rest from
    a copy of the eager cache, the greedy tokens unchanged. A build its generation outlives is kept, free."""
    import workbench.generation as generation

    runner = tiny_model("llama", "Q8_0", seed=4, n_layers=1, device="cpu", cached=False).runner
    eager = list(generate_tokens(runner, PROMPT, 10))
    release, real_build = threading.Event(), generation._compile_on_cpu
    monkeypatch.setattr(generation, "_compile_on_cpu", lambda *a: release.wait() and real_build(*a))
    steps = []
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, t, call=DecodeStep.__call__: steps.append(t) or call(self, t))

    tokens = generate_tokens(runner, PROMPT, 10, compiled="background")
    first = [next(tokens) for _ in range(4)]  # answered before the build finished
    assert runner not in _BUILT and not steps
    # a generation that starts meanwhile decodes eagerly without starting a second build
    assert list(generate_tokens(runner, PROMPT, 5, compiled="background")) == eager[:5]
    assert sum(t.name == "workbench-decode-build" for t in threading.enumerate()) == 1
    release.set()
    _join_builds()
    assert first + list(tokens) == eager
    assert steps and not _BUILT[runner]["exact"].busy
    del _BUILT[runner]

    release.clear()
    assert list(generate_tokens(runner, PROMPT, 3, compiled="background")) == eager[:3]  # done before the build
    release.set()
    _join_builds()
    assert not _BUILT[runner]["exact"].busy
    with pytest.raises(WorkbenchError, match="compiled must be"):
        generate_tokens(runner, PROMPT, 3, compiled="later")


@needs_cuda
def test_cuda_background_build_answers_eagerly_then_replays(tiny_model):
    model, eager = cuda_model_and_eager_tokens(tiny_model)
    _BUILT.pop(model.runner, None)
    assert list(generate_tokens(model.runner, PROMPT, 12, compiled="background")) == eager
    if any(t.name == "workbench-decode-build" for t in threading.enumerate()):  # still compiling: the graph of the
        provisional = _BUILT[model.runner]["exact"]                              # eager forward answers meanwhile
        assert provisional.provisional
        assert list(generate_tokens(model.runner, PROMPT, 12, compiled="background")) == eager
    _join_builds()
    assert list(generate_tokens(model.runner, PROMPT, 12)) == eager
    assert not _BUILT[model.runner]["exact"].busy and not _BUILT[model.runner]["exact"].provisional


def test_decoding_with_interventions_alone_runs_under_inference_mode(small, monkeypatch):
    """A steered generation (its hooks keep no tensor) decodes under inference mode, one prompt or a batch; a function
    hook or a recorder could keep the forward's tensors, so with one the forward runs as a plain one."""
    from workbench import hooks

    seen = []
    forward = small.runner.forward
    monkeypatch.setattr(small.runner, "forward", lambda *a, **k: seen.append(torch.is_inference_mode_enabled())
                        or forward(*a, **k))
    steer = hooks.Steer("blocks.0.hook_resid_post", torch.ones(small.config.d_model), positions="generated")
    prompt = [5, 17, 42, 99]
    steered = [t for t, _ in small.stream(prompt, 4, interventions=[steer])]
    list(small.stream_batch([prompt, prompt[:2]], 4, interventions=[steer]))
    assert seen and all(seen)
    seen.clear()
    kept = []
    with small.hooks(record=["blocks.0.hook_resid_post"]) as recorder:
        recorded = [t for t, _ in small.stream(prompt, 4, interventions=[steer, ("blocks.1.hook_resid_post",
                                                                                 lambda x, ctx: kept.append(x))])]
    assert recorded == steered and seen and not any(seen)
    assert not any(t.is_inference() for t in kept)
    assert not recorder.activations()["blocks.0.hook_resid_post"].is_inference()


def test_generated_text_keeps_a_character_left_unfinished(small, monkeypatch):
    """Generation ending inside a character (its first two bytes of four, "🤔" cut short) shows U+FFFD, as
    StreamDecoder.flush does, rather than dropping the bytes; a stop token after them ends the text the same way."""
    byte_token = {small.tokenizer.token_bytes(i): i for i in range(small.tokenizer.vocab_size)}
    cut = [byte_token[bytes([b])] for b in "🤔".encode()[:2]]
    stop = next(iter(small.tokenizer.stop_ids))
    monkeypatch.setattr(model_module, "generate_tokens", lambda *args, **kwargs: iter(cut))
    assert small.generate([5, 6], 2) == "\ufffd"
    monkeypatch.setattr(model_module, "generate_tokens", lambda *args, **kwargs: iter([*cut, stop]))
    assert small.generate([5, 6], 8) == "\ufffd"
    monkeypatch.setattr(model_module, "generate_batch_tokens",
                        lambda runner, rows, *args: iter([(i, t) for t in cut for i in rows]))
    assert small.generate_batch([[5, 6], [7]], 2) == ["\ufffd", "\ufffd"]
