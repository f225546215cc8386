"""KV cache surgery: clone, truncate, delete, set/clear/copy, and generation continuing from an edited cache."""
from __future__ import annotations

import pytest
import torch

import workbench

PROMPT = [5, 17, 42, 99, 7, 23, 61, 8]
NEXT = [30, 12]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tiny_model):
    return tiny_model(request.param, n_layers=2, seed=5)


@pytest.fixture(scope="module")
def tiny32(tiny, tiny_model):
    """``tiny`` in float32 (on a GPU, a model's default is bfloat16), for the tests held to float32's batch bound."""
    return tiny_model(tiny.config.architecture, n_layers=2, seed=5, dtype=torch.float32)


def prefilled(model, ids=PROMPT):
    cache = model.new_cache()
    model.forward(ids, cache=cache)
    return cache


def test_clone_then_continue_equals_a_fresh_run_bit_for_bit(tiny):
    original = prefilled(tiny)
    clone = original.clone()
    from_clone = tiny.forward(NEXT, cache=clone)
    from_original = tiny.forward(NEXT, cache=original)
    from_fresh = tiny.forward(NEXT, cache=prefilled(tiny))
    assert torch.equal(from_clone, from_original) and torch.equal(from_clone, from_fresh)
    # and generation from a clone is generation from the original
    a, b = prefilled(tiny), prefilled(tiny)
    assert tiny.generate(NEXT, 5, cache=a.clone()) == tiny.generate(NEXT, 5, cache=b)


def test_embedded_clone_then_continue_is_bit_identical(model):
    ids = model.to_ids("The Eiffel Tower is in the city of")
    original = prefilled(model, ids)
    clone = original.clone()
    fresh = prefilled(model, ids)
    logits = [model.forward([7042], cache=c) for c in (clone, original, fresh)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_a_clone_is_independent(tiny):
    original = prefilled(tiny)
    keys, values = original.get(1)
    clone = original.clone()
    clone.clear(1)
    clone.truncate(3)
    assert original.length == len(PROMPT)
    assert all(torch.equal(a, b) for a, b in zip(original.get(1), (keys, values)))


def test_truncate_then_continue_equals_a_run_on_the_shorter_prompt(tiny):
    cache = prefilled(tiny)
    cache.truncate(5)
    assert cache.tokens == PROMPT[:5] and cache.next_position == 5
    shorter = prefilled(tiny, PROMPT[:5])
    # the kept slots were computed in a longer batch, so equality is up to matmul rounding
    torch.testing.assert_close(tiny.forward(NEXT, cache=cache), tiny.forward(NEXT, cache=shorter), rtol=1e-5, atol=1e-5)


def test_clone_positions_keeps_the_rope_positions(tiny):
    cache = prefilled(tiny)
    window = cache.clone_positions(2, 6)
    assert window.positions.tolist() == [2, 3, 4, 5] and window.tokens == PROMPT[2:6]
    assert window.next_position == 6
    assert all(torch.equal(a, b[:, 2:6]) for a, b in zip(window.get(0), cache.get(0)))
    prefix = cache.clone_positions(0, 5)
    truncated = prefilled(tiny)
    truncated.truncate(5)
    assert torch.equal(tiny.forward(NEXT, cache=prefix), tiny.forward(NEXT, cache=truncated))


def mask_keys_for_new_tokens(deleted: list[int], n_new: int):
    """Attention-score hook: the last ``n_new`` queries may not look at the ``deleted`` key slots."""

    def mask(scores, ctx):
        scores = scores.clone()
        scores[:, -n_new:, deleted] = float("-inf")
        return scores

    return ("blocks.*.attn.hook_attn_scores", mask)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_delete_positions_equals_masking_those_keys_from_the_new_tokens(arch, tiny_model):
    """The exact semantics: kept slots keep their positions and their (already computed) keys/values; the
    new tokens continue at last position + 1 and do not see the deleted slots."""
    # on the CPU: the bound is float32's, past which a GPU's default bfloat16 rounds
    tiny = tiny_model(arch, n_layers=2, seed=5, device="cpu")
    deleted = [1, 4, 5]
    cache = prefilled(tiny)
    cache.delete_positions(deleted)
    kept = [i for i in range(len(PROMPT)) if i not in deleted]
    assert cache.positions.tolist() == kept and cache.tokens == [PROMPT[i] for i in kept]
    assert cache.next_position == len(PROMPT)
    continued = tiny.forward(NEXT, cache=cache)

    full = PROMPT + NEXT
    masked = tiny.forward(full, interventions=[mask_keys_for_new_tokens(deleted, len(NEXT))])[-len(NEXT):]
    torch.testing.assert_close(continued, masked, rtol=1e-5, atol=1e-5)
    unmasked = tiny.forward(full)[-len(NEXT):]
    assert (continued - unmasked).abs().max() > 1e-3  # deleting slots really changed the continuation
    # it is not a run on the prompt without those tokens: rope and the kept keys remember them
    without = tiny.forward([t for i, t in enumerate(PROMPT) if i not in deleted] + NEXT)[-len(NEXT):]
    assert (continued - without).abs().max() > 1e-3


def test_deleting_the_last_slots_moves_the_next_position_back(tiny):
    cache = prefilled(tiny)
    cache.delete_positions([-1, -2])
    assert cache.next_position == len(PROMPT) - 2
    shorter = prefilled(tiny, PROMPT[:-2])
    torch.testing.assert_close(tiny.forward(NEXT, cache=cache), tiny.forward(NEXT, cache=shorter), rtol=1e-5, atol=1e-5)


def test_copying_every_layer_from_another_cache_continues_like_it(tiny):
    other_prompt = [9, 8, 7, 6, 5, 4, 3, 2]
    target, source = prefilled(tiny), prefilled(tiny, other_prompt)
    before = target.get(1)
    target.copy_layer_from(source, 0)
    assert all(torch.equal(a, b) for a, b in zip(target.get(0), source.get(0)))
    assert all(torch.equal(a, b) for a, b in zip(target.get(1), before))
    target.copy_layer_from(source, 1)
    assert torch.equal(tiny.forward(NEXT, cache=target), tiny.forward(NEXT, cache=source))


def test_set_and_clear(tiny):
    cache = prefilled(tiny)
    keys, values = cache.get(0)
    zeroed = cache.clone()
    zeroed.set(0, torch.zeros_like(keys), torch.zeros_like(values))
    cleared = cache.clone()
    cleared.clear(0)
    with tiny.hooks(record=["blocks.0.attn.hook_attn_scores"]) as recorder:
        from_cleared = tiny.forward(NEXT[:1], cache=cleared)
    assert torch.equal(from_cleared, tiny.forward(NEXT[:1], cache=zeroed))
    # a cleared layer scores exactly 0 against every cached slot (and still sees the new token's own key)
    scores = recorder.activations()["blocks.0.attn.hook_attn_scores"]
    assert torch.equal(scores[:, 0, :-1], torch.zeros(tiny.config.n_heads, len(PROMPT)))
    assert scores[:, 0, -1].abs().min() > 0
    doubled = cache.clone()
    doubled.set(0, keys, 2 * values)
    assert torch.equal(doubled.get(0)[1], 2 * values)


def test_bad_surgery_is_refused(tiny):
    cache = prefilled(tiny)
    keys, values = cache.get(0)
    bad_calls = {
        "shape": lambda: cache.set(0, keys[:, :3], values),
        "NaN": lambda: cache.set(0, keys, values * float("nan")),
        "floating": lambda: cache.set(0, keys.long(), values),
        "layer": lambda: cache.get(2),
        "outside": lambda: cache.truncate(len(PROMPT) + 1),
        "slots": lambda: cache.delete_positions([len(PROMPT)]),
        "integers": lambda: cache.delete_positions([1.0]),
        "slot range": lambda: cache.clone_positions(3, 2),
        "source cache": lambda: cache.copy_layer_from(prefilled(tiny, PROMPT[:3]), 0),
    }
    for expected, call in bad_calls.items():
        with pytest.raises(workbench.WorkbenchError, match=expected):
            call()
    assert cache.length == len(PROMPT) and all(torch.equal(a, b) for a, b in zip(cache.get(0), (keys, values)))


def test_integers_only_where_the_cache_takes_a_count_a_layer_or_slots(tiny):
    import numpy as np
    cache = prefilled(tiny)
    for call, message in [(lambda: cache.truncate(2.5), "length must be an integer, got 2.5"),
                          (lambda: cache.truncate(True), "length must be an integer, got True"),
                          (lambda: cache.get(True), "layer must be an integer, got True"),
                          (lambda: cache.clear(1.0), "layer must be an integer"),
                          (lambda: cache.delete_positions(3), r"got the single 3 \(pass \[3\]\)"),
                          (lambda: cache.delete_positions(None), "slots must be a list of integers")]:
        with pytest.raises(workbench.WorkbenchError, match=message):
            call()
    # nothing was changed by a refused call: the cache is whole and usable
    assert cache.length == len(PROMPT) and cache.tokens == PROMPT and cache.next_position == len(PROMPT)
    assert torch.equal(cache.get(np.int64(1))[0], cache.get(1)[0])  # a numpy integer is a layer
    cache.truncate(np.int64(6))
    assert cache.length == 6
    # a generator of slots is read once: both slots go
    cache = prefilled(tiny)
    cache.delete_positions(i for i in [3, 4])
    assert cache.tokens == PROMPT[:3] + PROMPT[5:]


def test_a_batch_cache_takes_caches_and_integer_rows_only(tiny):
    import numpy as np
    from workbench.kv_cache import BatchKVCache

    cache = prefilled(tiny)
    rows = BatchKVCache.from_caches([cache, cache.clone()])
    for call, message in [(lambda: cache.clone_positions("1", 2), "kv clone: start must be an integer, got '1'"),
                          (lambda: cache.copy_layer_from(None, 0), "kv copy takes a KVCache"),
                          (lambda: rows.set_row(0, None), "kv set_row takes a KVCache"),
                          (lambda: BatchKVCache.from_caches([1]), r"kv from_caches takes a KVCache .*, got int"),
                          (lambda: rows.keep_rows(0), "keep_rows: rows must be a list of integers, got 0"),
                          (lambda: BatchKVCache.from_prefixes(cache, [1.5]), "lengths must be a list of integers"),
                          (lambda: rows.row(2), r"row 2 outside 0..1")]:
        with pytest.raises(workbench.WorkbenchError, match=message):
            call()
    assert rows.row(np.int64(1)).tokens == PROMPT and rows.lengths == [len(PROMPT)] * 2  # a numpy integer is a row


def test_a_cache_of_another_model_is_refused_before_any_compute(tiny, tiny_model):
    from workbench.kv_cache import KVCache
    runner, config = tiny.runner, tiny.config
    heads, d_head = runner._cache_heads()
    others = {
        f"3 layers, this model has {config.n_layers}": KVCache(3, heads, d_head, runner.dtype, "cpu"),
        f"layer 0 holds {heads + 1} kv heads": KVCache(config.n_layers, heads + 1, d_head, runner.dtype, "cpu"),
        f"of size {d_head * 2}, this model's": KVCache(config.n_layers, heads, d_head * 2, runner.dtype, "cpu"),
        "the cache holds torch.float64": KVCache(config.n_layers, heads, d_head, torch.float64, "cpu"),
        "got BatchKVCache": tiny.new_batch_cache(1),
        "got dict": {},
    }
    for message, other in others.items():
        for call in (lambda: tiny.forward(PROMPT, cache=other), lambda: tiny.generate(PROMPT, 2, cache=other),
                     lambda: tiny.stream(PROMPT, 2, cache=other)):
            with pytest.raises(workbench.WorkbenchError, match=message):
                call()
        if isinstance(other, KVCache):
            assert other.length == 0
    assert tiny.forward(PROMPT, cache=tiny.new_cache()).shape[0] == len(PROMPT)


def test_positions_past_the_context_are_refused(tiny):
    runner, n_ctx = tiny.runner, tiny.config.n_ctx
    cache = runner.new_cache()
    runner.forward(torch.arange(n_ctx - 1) % 50, cache=cache)
    runner.forward(torch.tensor([3]), cache=cache)  # the last position of the context
    with pytest.raises(workbench.WorkbenchError, match=f"positions up to {n_ctx} lie past the model's context"):
        runner.forward(torch.tensor([3]), cache=cache)
    assert cache.length == n_ctx
    with pytest.raises(workbench.WorkbenchError, match="context"):
        runner.forward(torch.zeros(n_ctx + 1, dtype=torch.long))
    with pytest.raises(workbench.WorkbenchError, match="static cache holds"):
        runner.new_static_cache(n_ctx + 1)


def test_rows_continuing_one_cache_from_prefixes_of_their_own_equal_the_whole_forward(tiny32):
    """``BatchKVCache.from_prefixes``: each row continues the same tokens from its own point, as a patching sweep's
    cells do; from a later block too (``start_at_layer``), whose earlier layers the rows then do not hold."""
    from workbench.kv_cache import BatchKVCache
    from workbench.runner import BatchLayout

    tiny = tiny32
    runner, n_layers = tiny.runner, tiny.config.n_layers
    resid = {}
    whole = runner.forward(torch.tensor(PROMPT), hooks={"blocks.1.hook_resid_pre": [
        lambda x, ctx: resid.setdefault("x", x.clone())]})
    cache = prefilled(tiny)
    prefixes = [0, 3, 7]
    tails = torch.tensor([t for p in prefixes for t in PROMPT[p:]])
    for start in (0, 1):
        rows = BatchKVCache.from_prefixes(cache, prefixes, layers=range(start, n_layers))
        assert rows.lengths == prefixes and rows.next_positions == prefixes
        assert [rows.tokens(b) for b in range(3)] == [PROMPT[:p] for p in prefixes]
        layout = BatchLayout([len(PROMPT) - p for p in prefixes], runner.device, cached=prefixes)
        out = runner.forward(tails, cache=rows, layout=layout, start_at_layer=start,
                             resid=torch.cat([resid["x"][p:] for p in prefixes]) if start else None)
        for b, p in enumerate(prefixes):  # the batched kernels' rounding (docs/batches.md)
            torch.testing.assert_close(out[layout.rows(b)], whole[p:], atol=2e-4, rtol=0)
        assert rows.lengths == [len(PROMPT)] * 3
        assert rows.capacity > 7  # the forward's write grew the rows, and a layer left out still holds no memory
        assert (rows.buffers(0) is None) == (start == 1)
        for b, p in enumerate(prefixes):
            keys, _ = rows.row(b).get(n_layers - 1)
            assert torch.equal(keys[:, :p], cache.get(n_layers - 1)[0][:, :p])
        last = rows.row(2).get(n_layers - 1)
        rows.keep_rows([2, 0])  # in place, over every layer's stores
        assert rows.lengths == [len(PROMPT)] * 2
        assert all(torch.equal(a, b) for a, b in zip(rows.row(0).get(n_layers - 1), last))
    with pytest.raises(workbench.WorkbenchError, match="outside 0..8"):
        BatchKVCache.from_prefixes(cache, [2, 9])
    with pytest.raises(workbench.WorkbenchError, match="prefix lengths"):
        BatchKVCache.from_prefixes(cache, [])


def test_rows_continuing_caches_of_different_sequences_from_prefixes_equal_their_whole_forwards(tiny32):
    """``from_prefixes`` with a cache a row: rows of two sequences (a dataset's pairs), each continuing its own."""
    from workbench.kv_cache import BatchKVCache
    from workbench.runner import BatchLayout

    tiny = tiny32
    runner, other = tiny.runner, [9, 4, 77, 31, 2, 60]
    prompts = [PROMPT, other, PROMPT, other]
    caches = [prefilled(tiny, p) for p in (PROMPT, other)]
    wholes = [runner.forward(torch.tensor(p)) for p in (PROMPT, other)]
    sources, prefixes = [caches[0], caches[1], caches[0], caches[1]], [3, 5, 0, 2]
    rows = BatchKVCache.from_prefixes(sources, prefixes)
    assert rows.next_positions == prefixes and [rows.tokens(b) for b in range(4)] == [
        p[:n] for p, n in zip(prompts, prefixes)]
    layout = BatchLayout([len(p) - n for p, n in zip(prompts, prefixes)], runner.device, cached=prefixes)
    out = runner.forward(torch.tensor([t for p, n in zip(prompts, prefixes) for t in p[n:]]), cache=rows,
                         layout=layout)
    for b, (n, whole) in enumerate(zip(prefixes, [wholes[0], wholes[1]] * 2)):
        torch.testing.assert_close(out[layout.rows(b)], whole[n:], atol=2e-4, rtol=0)
    with pytest.raises(workbench.WorkbenchError, match="row 1's outside 0..6"):
        BatchKVCache.from_prefixes(caches, [2, 7])
    with pytest.raises(workbench.WorkbenchError, match="for 2 caches"):
        BatchKVCache.from_prefixes(caches, [2])


def test_surgery_on_a_layer_that_reuses_another_layers_keys_and_values_is_refused():
    """Gemma 4 E2B/E4B's last layers attend over an earlier layer's keys and values and hold none of their own: every
    surgery there is refused naming the layer to edit (on a cache and on a batch cache's rows), and nothing changes;
    the layer it reuses edits both."""
    from pathlib import Path

    model = workbench.load(Path(__file__).parent / "fixtures" / "families" / "gemma4e-Q8_0.gguf", device="cpu")
    sources = [model.config.kv_source(i) for i in range(model.config.n_layers)]
    shared = [i for i, source in enumerate(sources) if source != i]
    assert shared == [2, 3] and sources[3] == 1
    cache, other = prefilled(model), prefilled(model, PROMPT[::-1])
    untouched = model.forward(NEXT, cache=cache.clone())
    batch = model.runner.new_batch_cache(2)
    batch.set_row(0, cache)
    keys, values = cache.get(1)
    assert keys.abs().sum() > 0 and values.abs().sum() > 0
    for target in (cache, batch.row(0), cache.clone(), cache.select([2, 0])):
        donor = other if target.length == other.length else target
        for layer in shared:
            message = f"layer {layer} reuses layer {sources[layer]}'s keys and values: %s layer {sources[layer]}"
            calls = [("read", lambda: target.get(layer)), ("edit", lambda: target.clear(layer)),
                     ("edit", lambda: target.set(layer, keys[:, : target.length], values[:, : target.length])),
                     ("edit", lambda: target.copy_layer_from(donor, layer))]
            for verb, call in calls:
                with pytest.raises(workbench.WorkbenchError, match=message % verb):
                    call()
        assert target.kv_sources == tuple(sources)
    assert torch.equal(model.forward(NEXT, cache=cache.clone()), untouched)
    assert torch.equal(model.forward(NEXT, cache=batch.row(0)), untouched)
    # the layer reused is the one to edit: clearing layer 1 changes what layer 3 attends over
    cleared = cache.clone()
    cleared.clear(1)
    patterns = []
    for continued in (cleared, cache.clone()):
        with model.hooks(record=["blocks.3.attn.hook_pattern"]) as recorder:
            model.forward(NEXT[:1], cache=continued)
        patterns.append(recorder.activations()["blocks.3.attn.hook_pattern"])
    assert patterns[0].shape[-1] == len(PROMPT) + 1 and not torch.allclose(*patterns)


def test_dashboard_kv_page_on_layers_that_reuse_keys_and_values(monkeypatch):
    """The KV cache page shows a layer that reuses another's keys and values with that layer's, and offers to clear
    only layers that hold their own."""
    streamlit_testing = pytest.importorskip("streamlit.testing.v1")
    import json
    from pathlib import Path

    from workbench.app import common

    path = Path(__file__).parent / "fixtures" / "families" / "gemma4e-Q8_0.gguf"
    monkeypatch.setattr("sys.argv", ["main.py", "--model", str(path)])
    at = streamlit_testing.AppTest.from_file(str(Path(common.__file__).with_name("main.py")), default_timeout=240)
    at.run()
    at.switch_page("page_kv_cache.py").run()
    assert not at.exception, [e.message for e in at.exception]
    figure = next(json.loads(c.proto.spec) for c in at.get("plotly_chart") if c.key == "kv_heatmap")
    assert figure["layout"]["yaxis"]["ticktext"] == ["L0", "L1", "L2 (L0's)", "L3 (L1's)"]
    norms = figure["data"][0]["z"]
    assert norms[3] == norms[1] and norms[2] == norms[0] and min(norms[1]) > 0
    assert at.selectbox(key="kv_layer").options == ["0", "1"]
