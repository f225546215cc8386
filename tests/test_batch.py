"""Batched runs: many prompts in one forward mean what each prompt means alone.

Batched logits differ from one prompt's only where the quantized matmuls take another kernel for more rows; the bound
checked here (BOUND) is what bench/batch_parity.py measures on the CPU in float32 (docs/batches.md, "Correctness").
"""
from __future__ import annotations

import os

import pytest
import torch

from workbench import hooks
from workbench.errors import HookError, WorkbenchError
from workbench.kernels import layer_ops
from workbench.kv_cache import PrefixGroup, prefix_groups
from workbench.runner import BatchLayout

# ids prompts of different lengths for the random models (their tokenizer is byte-level)
PROMPTS = [[5, 17, 42, 99, 7, 23, 61], [8, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [40, 41, 42, 43]]
TEXTS = ["The capital of France is", "Hello", "One two three four five six seven eight nine ten", "Water boils at"]
BOUND = 2e-4  # max |logit diff|, batched against one prompt at a time (float32, CPU)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tiny_model):
    return tiny_model(request.param, seed=3, device="cpu")


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama", seed=3, device="cpu")


def assert_close_logits(batched: torch.Tensor, single: torch.Tensor) -> None:
    assert batched.shape == single.shape
    assert (batched - single).abs().max().item() <= BOUND
    assert torch.equal(batched.argmax(-1), single.argmax(-1))


# ------------------------------------------------------------------------------------------- forward


def test_batched_logits_equal_each_prompt_alone(tiny):
    traces = tiny.run_batch(PROMPTS)
    for prompt, trace in zip(PROMPTS, traces):
        assert trace.ids == prompt
        assert_close_logits(trace.logits, tiny.forward(prompt))


def test_batched_logits_on_the_embedded_model(model):
    for text, logits in zip(TEXTS, model.forward_batch(TEXTS)):
        assert_close_logits(logits, model.forward(text))


def test_a_much_longer_or_shorter_neighbour_changes_nothing(llama):
    base = llama.run_batch(PROMPTS[:2])
    longer = llama.run_batch(PROMPTS[:2] + [list(range(1, 200))])
    shorter = llama.run_batch([[9]] + PROMPTS[:2])
    for a, b, c in zip(base, longer, shorter[1:]):
        assert_close_logits(b.logits, a.logits)
        assert_close_logits(c.logits, a.logits)


def test_padding_never_reaches_a_real_token(llama):
    """Two rows of equal lengths take the reshape path, unequal ones the gather path; both give each row what it gives
    alone, and a row's result does not depend on what the padding holds (the zero row appended past the end)."""
    ids = PROMPTS[0]
    runner = llama.runner
    alone = runner.forward(torch.tensor(ids))
    layout = BatchLayout([len(ids), 3], runner.device)
    packed = runner.forward(torch.tensor(ids + [1, 2, 3]), layout=layout)
    assert_close_logits(packed[layout.rows(0)], alone)
    assert not layout.uniform and layout.pad(torch.ones(layout.n_tokens, 1))[1, 3:].eq(0).all()


def test_recording_everything_in_a_batch_is_bit_identical(tiny):
    plain = tiny.run_batch(PROMPTS)
    recorded = tiny.run_batch(PROMPTS, record=["*"])
    for a, b in zip(plain, recorded):
        assert torch.equal(a.logits, b.logits)
        assert set(b.activations) == set(tiny.hook_points())


def test_recorded_activations_have_run_shapes_and_values(llama):
    names = ["blocks.*.hook_resid_post", "blocks.1.attn.hook_pattern", "blocks.0.attn.hook_z", "ln_final.hook_scale"]
    for prompt, trace in zip(PROMPTS, llama.run_batch(PROMPTS, record=names)):
        single = llama.run(prompt, record=names)
        assert set(trace.activations) == set(single.activations)
        for name, value in single.activations.items():
            assert trace.activations[name].shape == value.shape, name
            assert torch.allclose(trace.activations[name], value, atol=1e-3, rtol=1e-3), name


def test_reduced_recording_keeps_one_row_per_prompt(llama):
    name = "blocks.1.hook_resid_post"
    full = llama.run_batch(PROMPTS, record=[name])
    for reduce, pick in (("last", lambda a: a[-1]), ("mean", lambda a: a.mean(0)), (1, lambda a: a[1]),
                         (-2, lambda a: a[-2])):
        reduced = llama.run_batch(PROMPTS, record=[name], reduce=reduce, record_dtype=torch.float16)
        for a, b in zip(full, reduced):
            assert b.activations[name].dtype == torch.float16
            torch.testing.assert_close(b.activations[name].float(), pick(a.activations[name]), atol=2e-3, rtol=1e-3)


def test_last_logits_only(llama):
    last = llama.forward_batch(PROMPTS, last_only=True)
    for prompt, row in zip(PROMPTS, last):
        assert row.shape == (1, llama.config.vocab_size)
        assert_close_logits(row, llama.forward(prompt)[-1:])


def test_without_logits_the_forwards_stop_after_the_deepest_recorded_block(llama, monkeypatch):
    """``logits=None`` (TransformerLens' ``stop_at_layer``): the recorded bits of the whole run, through shared
    prefixes and a prompt in chunks too, with no block after the deepest recorded one and no unembedding run."""
    names = ["hook_embed", "blocks.0.attn.hook_z", "blocks.0.hook_resid_post"]  # of 2 blocks
    shared, long = PROMPTS + [TEMPLATE + p for p in PROMPTS[:2]], [list(range(1, 40))]
    whole = llama.run_batch(shared, record=names)
    with monkeypatch.context() as patch:
        patch.setattr(llama, "max_batch_tokens", lambda: 32)
        whole += llama.run_batch(long, record=names)
    stops, widths = [], []
    forward = llama.runner.forward

    def watched(ids, *args, **kwargs):
        stops.append(kwargs.get("stop_at_layer"))
        widths.append(len(ids))
        return forward(ids, *args, **kwargs)
    monkeypatch.setattr(llama.runner, "forward", watched)
    monkeypatch.setattr(llama.runner, "_logits", lambda *a, **k: pytest.fail("the unembedding ran"))
    stopped = llama.run_batch(shared, record=names, logits=None)
    monkeypatch.setattr(llama, "max_batch_tokens", lambda: 32)
    stopped += llama.run_batch(long, record=names, logits=None)
    assert widths[0] == len(TEMPLATE) and widths[-2:] == [32, 7]  # the shared prefix once; the long prompt in chunks
    assert set(stops) == {1}
    for a, b in zip(whole, stopped, strict=True):
        assert b.logits is None and all(torch.equal(a.activations[n], b.activations[n]) for n in names)
    monkeypatch.undo()
    late = llama.run_batch(shared, record=names + ["ln_final.hook_normalized"], logits=None)  # runs every block
    for a, b in zip(whole, late):
        assert b.logits is None and all(torch.equal(a.activations[n], b.activations[n]) for n in names)
    with llama.hooks(record=["blocks.1.hook_resid_post"]) as outer:  # an enclosing block's points are reached too
        llama.run_batch(PROMPTS, record=names, logits=None)
    assert outer.activations()["blocks.1.hook_resid_post"].shape[0] == sum(map(len, PROMPTS))
    alone = llama.run(PROMPTS[0], record=names)  # one prompt's run keeps the same choice
    assert llama.run(PROMPTS[0], record=names, logits=None).logits is None
    assert torch.equal(llama.run(PROMPTS[0], logits="last").logits, alone.logits[-1:])
    assert all(torch.equal(llama.run(PROMPTS[0], record=names, logits=None).activations[n], alone.activations[n])
               for n in names)
    with pytest.raises(WorkbenchError, match="records nothing"):
        llama.run_batch(PROMPTS, logits=None)
    with pytest.raises(WorkbenchError, match="logits must be 'all', 'last' or None"):
        llama.run_batch(PROMPTS, logits="none")


@pytest.mark.parametrize("name", ["ln_final.hook_scale", "ln_final.hook_normalized", "hook_logits"])
def test_points_after_the_last_block_see_every_row_whatever_logits_are_kept(llama, name):
    """The final norm and the logits run on every row where they are recorded or edited, as in the whole run; only
    then are the last rows kept (they used to see each prompt's last row alone, so a recorded trace could not load and
    its mean mixed prompts)."""
    prompts = PROMPTS + [TEMPLATE + PROMPTS[0]]  # a shared prefix too
    for interventions in ([], [hooks.Scale(name, 0.5, positions=[0])]):
        for reduce in (None, "mean", "last", 0):
            whole = llama.run_batch(prompts, record=[name], reduce=reduce, interventions=interventions)
            for logits in ("last", None):
                kept = llama.run_batch(prompts, record=[name], reduce=reduce, logits=logits,
                                       interventions=interventions)
                for a, b in zip(whole, kept, strict=True):
                    assert torch.equal(a.activations[name], b.activations[name]), (logits, reduce)
                    assert b.logits is None if logits is None else torch.equal(b.logits, a.logits[-1:])
        alone = llama.run(prompts[0], record=[name], interventions=interventions)
        last = llama.run(prompts[0], record=[name], logits="last", interventions=interventions)
        assert torch.equal(last.activations[name], alone.activations[name])
        assert torch.equal(last.logits, alone.logits[-1:])


def test_batch_size_splits_into_forwards_with_the_same_results(llama, monkeypatch):
    calls = []
    forward = llama.runner.forward
    monkeypatch.setattr(llama.runner, "forward", lambda *a, **k: calls.append(k["layout"].size) or forward(*a, **k))
    whole = llama.run_batch(PROMPTS)
    assert calls == [4]
    calls.clear()
    split = llama.run_batch(PROMPTS, batch_size=3)
    assert sorted(calls) == [1, 3]
    for a, b in zip(whole, split):
        assert_close_logits(b.logits, a.logits)


def test_batches_group_prompts_by_length_within_the_memory_budget(llama, monkeypatch):
    per_token, per_score, _ = llama.batch_bytes()
    longest = max(len(p) for p in PROMPTS)
    budget = 2 * longest * (per_token + per_score * longest)
    real = llama.batch_bytes
    monkeypatch.setattr(llama, "batch_bytes", lambda vocab_rows=True, backward=False: (
        *real(vocab_rows, backward)[:2], budget))
    layouts = list(llama._batches([len(p) for p in PROMPTS], None, False, True))
    assert [list(layout.prompts) for layout in layouts] == [[2, 0], [3, 1]]  # longest first, two rows a forward
    # a backward keeps every layer's activations: the same budget holds fewer prompts a forward
    backward_token, backward_score, _ = real(True, True)
    assert backward_token > per_token and backward_score == llama.config.n_layers * per_score
    layouts = list(llama._batches([len(p) for p in PROMPTS], None, False, True, backward=True))
    assert len(layouts) > 2 and sorted(i for layout in layouts for i in layout.prompts) == [0, 1, 2, 3]
    for layout in layouts:
        width = max(layout.lengths)
        assert layout.size == 1 or layout.size * width * (backward_token + backward_score * width) <= budget


# ------------------------------------------------------------------------------------- interventions


def test_interventions_keep_their_per_prompt_meaning(llama):
    """Negative positions count from each prompt's end; heads and neurons select as in one run."""
    vector = torch.randn(llama.config.d_model, generator=torch.Generator().manual_seed(0))
    edits = [hooks.Steer("blocks.0.hook_resid_post", vector, scale=3.0, positions=[-1]),
             hooks.ZeroAblate("blocks.1.attn.hook_z", heads=[1], positions=[0, -2]),
             hooks.Scale("blocks.0.mlp.hook_post", 0.5, neurons=[3, 4])]
    for prompt, trace in zip(PROMPTS, llama.run_batch(PROMPTS, interventions=edits)):
        assert_close_logits(trace.logits, llama.forward(prompt, interventions=edits))
        assert [e["type"] for e in trace.interventions] == ["steer", "zero_ablate", "scale"]


def test_per_prompt_interventions_as_rows_of_one_batch(llama):
    """A scale sweep of one steering vector as the rows of a batch equals one run per scale."""
    vector = torch.randn(llama.config.d_model, generator=torch.Generator().manual_seed(1))
    scales = [0.0, 2.0, -4.0, 8.0]
    rows = [[hooks.Steer("blocks.1.hook_resid_pre", vector, scale=s)] for s in scales]
    traces = llama.run_batch([PROMPTS[0]] * len(scales), per_prompt_interventions=rows)
    for row, trace in zip(rows, traces):
        assert_close_logits(trace.logits, llama.forward(PROMPTS[0], interventions=row))
    assert not torch.equal(traces[0].logits, traces[3].logits)


def test_a_shared_elementwise_edit_takes_one_call_for_all_rows(llama, monkeypatch):
    """An intervention every prompt shares, of an edit computed value by value (steer, scale, zero and mean ablation),
    edits all the rows of a forward in one call, with the bits the row-by-row calls give: per-prompt copies of the same
    edits (other objects, so row by row) give equal logits, generations and recorded edits."""
    import workbench.hooks.batching as batching

    d = llama.config.d_model
    vector = torch.randn(d, generator=torch.Generator().manual_seed(5))
    edits = [hooks.Steer("blocks.0.hook_resid_post", vector, scale=3.0),
             hooks.Scale("blocks.0.mlp.hook_post", 0.5, neurons=[3, 4], positions=[0, 1]),
             hooks.ZeroAblate("blocks.1.attn.hook_z", heads=[1]),
             hooks.MeanAblate("ln_final.hook_normalized", torch.ones(d), positions="generated"),
             hooks.Steer("blocks.1.hook_resid_mid", vector, scale=-2.0, positions="generated")]
    copies = [[hooks.from_spec(e.to_spec()) for e in edits] for _ in PROMPTS]
    calls = []
    edit_rows = batching._edit_rows
    monkeypatch.setattr(batching, "_edit_rows", lambda *a: calls.append(a[0].shape) or edit_rows(*a))
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"]
    shared = llama.run_batch(PROMPTS, interventions=edits, record=names)
    assert len(calls) == len(edits) and (sum(map(len, PROMPTS)), d) in calls  # one call per point, every row
    calls.clear()
    rowwise = llama.run_batch(PROMPTS, per_prompt_interventions=copies, record=names)
    assert not calls
    for a, b in zip(shared, rowwise):
        assert torch.equal(a.logits, b.logits)
        assert all(torch.equal(a.activations[n], b.activations[n]) for n in names)
    streamed = list(llama.stream_batch(PROMPTS, 5, interventions=edits))
    assert calls  # the decode steps' last-rows final norm and "generated" positions take the one call too
    assert streamed == list(llama.stream_batch(PROMPTS, 5, per_prompt_interventions=copies))
    assert streamed != list(llama.stream_batch(PROMPTS, 5))


def test_patch_with_a_donor_of_another_length(llama):
    patch = hooks.Patch("blocks.0.hook_resid_post", donor=PROMPTS[2], positions=[0, 1])
    for prompt, trace in zip(PROMPTS, llama.run_batch(PROMPTS, interventions=[patch])):
        assert_close_logits(trace.logits, llama.forward(prompt, interventions=[patch]))


def test_plain_function_hooks_see_one_prompt_at_a_time(llama):
    seen = []

    def look(x, ctx):
        seen.append((ctx.prompt, tuple(x.shape), tuple(ctx.positions.tolist())))

    llama.run_batch(PROMPTS, interventions=[("blocks.0.hook_resid_pre", look), ("blocks.1.attn.hook_pattern", look)])
    heads = llama.config.n_heads
    expected = {(i, (len(p), llama.config.d_model), tuple(range(len(p)))) for i, p in enumerate(PROMPTS)}
    expected |= {(i, (heads, len(p), len(p)), tuple(range(len(p)))) for i, p in enumerate(PROMPTS)}
    assert set(seen) == expected


def test_a_function_hook_edits_only_its_prompt(llama):
    def zero_second_prompt(x, ctx):
        return torch.zeros_like(x) if ctx.prompt == 1 else None

    traces = llama.run_batch(PROMPTS, interventions=[("blocks.1.hook_mlp_out", zero_second_prompt)])
    plain = llama.run_batch(PROMPTS)
    ablated = llama.forward(PROMPTS[1], interventions=[("blocks.1.hook_mlp_out", lambda x, ctx: torch.zeros_like(x))])
    for i, (a, b) in enumerate(zip(traces, plain)):
        if i == 1:
            assert_close_logits(a.logits, ablated)
        else:
            assert torch.equal(a.logits, b.logits)


def test_batch_hooks_see_each_forward_whole(llama):
    seen = {}

    def look(x, ctx):
        seen.setdefault(ctx.name, []).append((x.clone(), ctx.layout))

    last = llama.run_with_batch_hooks(PROMPTS, {"blocks.1.hook_resid_post": look, "blocks.0.attn.hook_pattern": [look]})
    traces = llama.run_batch(PROMPTS, record=["blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern"], logits="last")
    assert torch.equal(last, torch.cat([t.logits for t in traces]))
    [(resid, layout)] = seen["blocks.1.hook_resid_post"]
    [(pattern, _)] = seen["blocks.0.attn.hook_pattern"]
    assert resid.shape == (sum(map(len, PROMPTS)), llama.config.d_model)  # every prompt's tokens, none padded
    assert pattern.shape == (len(PROMPTS), llama.config.n_heads, max(map(len, PROMPTS)), max(map(len, PROMPTS)))
    for b, prompt in enumerate(layout.prompts):  # longest first: the layout says whose rows are which
        trace = traces[prompt]
        assert torch.equal(resid[layout.rows(b)], trace.activations["blocks.1.hook_resid_post"])
        n = len(PROMPTS[prompt])
        assert torch.equal(pattern[b, :, :n, :n], trace.activations["blocks.0.attn.hook_pattern"])


def test_batch_hooks_without_logits_stop_after_the_last_block(llama, monkeypatch):
    """``logits=False``: the hooks see what they see with logits, and the unembedding never runs."""
    name = f"blocks.{llama.config.n_layers - 1}.hook_resid_post"
    seen = []
    with_logits = llama.run_with_batch_hooks(PROMPTS, {name: lambda x, ctx: seen.append(x.clone())})
    unembedded = []
    monkeypatch.setattr(llama.runner, "_logits", lambda *a, **k: unembedded.append(1))
    assert llama.run_with_batch_hooks(PROMPTS, {name: lambda x, ctx: seen.append(x.clone())}, logits=False) is None
    assert with_logits.shape == (len(PROMPTS), llama.config.vocab_size) and not unembedded
    assert torch.equal(seen[0], seen[1])
    with pytest.raises(WorkbenchError, match="hook_logits lies after the last block"):
        llama.run_with_batch_hooks(PROMPTS, {"hook_logits": print}, logits=False)


def test_a_batch_hook_edits_the_whole_forward(llama):
    zero = lambda x, ctx: torch.zeros_like(x)  # noqa: E731
    last = llama.run_with_batch_hooks(PROMPTS, {"blocks.*.hook_resid_post": zero})
    assert last.shape == (len(PROMPTS), llama.config.vocab_size) and last.abs().max() == 0  # norm of 0 is 0
    seen = []
    ablate = hooks.ZeroAblate("blocks.0.hook_attn_out")
    with llama.hooks([ablate]):  # an enclosing block's hooks run first, per prompt
        look = lambda x, ctx: seen.append(x.abs().max())  # noqa: E731
        last = llama.run_with_batch_hooks(PROMPTS, {"blocks.0.hook_attn_out": look})
    assert seen == [0]
    for prompt, row in zip(PROMPTS, last):
        assert_close_logits(row[None], llama.forward(prompt, interventions=[ablate])[-1:])


def test_bad_batch_hooks(llama):
    with pytest.raises(WorkbenchError, match="map hook names"):
        llama.run_with_batch_hooks(PROMPTS, [("blocks.0.hook_resid_post", print)])
    with pytest.raises(WorkbenchError, match="must be a function"):
        llama.run_with_batch_hooks(PROMPTS, {"blocks.0.hook_resid_post": 3})
    with pytest.raises(HookError, match="unknown hook point"):
        llama.run_with_batch_hooks(PROMPTS, {"blocks.0.hook_resid_psot": print})
    with pytest.raises(WorkbenchError, match="prompt 1"):
        llama.run_with_batch_hooks([[1, 2], []], {})


def test_hooks_blocks_apply_to_batches(llama):
    with llama.hooks([hooks.ZeroAblate("blocks.0.hook_attn_out")], record=["blocks.0.hook_attn_out"]) as rec:
        traces = llama.run_batch(PROMPTS[:2])
    recorded = rec.activations()["blocks.0.hook_attn_out"]
    assert recorded.shape[0] == sum(len(p) for p in PROMPTS[:2]) and recorded.abs().max() == 0
    for prompt, trace in zip(PROMPTS, traces):
        assert_close_logits(trace.logits, llama.forward(prompt, interventions=[hooks.ZeroAblate("blocks.0.hook_attn_out")]))



def test_a_hooks_block_records_a_batch_in_list_order_and_never_crops(llama):
    """A block's recorder joins a batch's prompts in the order of the list (the batch runs them longest first), then
    the next call's; each prompt's pattern rows keep all their slots, padded to the widest with zeros."""
    names = ["blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern", "blocks.1.attn.hook_attn_scores"]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0]]  # 2, 13 and 7 tokens
    with llama.hooks(record=names) as rec:
        llama.run_batch(prompts)
        llama.run(PROMPTS[3])
    alone = [llama.run(p, record=names).activations for p in prompts + [PROMPTS[3]]]
    got = rec.activations()
    widest = max(len(p) for p in prompts)
    rows = torch.cat([a[names[0]] for a in alone])
    assert got[names[0]].shape == rows.shape and (got[names[0]] - rows).abs().max() <= 1e-4
    start = 0
    for a in alone:
        n = a[names[1]].shape[1]
        pattern, scores = got[names[1]][:, start:start + n], got[names[2]][:, start:start + n]
        assert pattern.shape[-1] == widest
        assert (pattern[..., :n] - a[names[1]]).abs().max() <= 1e-5 and (pattern[..., n:] == 0).all()
        assert torch.allclose(pattern.sum(-1), torch.ones(pattern.shape[:2]), atol=1e-5)
        assert torch.isneginf(scores[..., n:]).all()
        start += n

# ---------------------------------------------------------------------------------------- generation


def test_greedy_generation_equals_each_prompt_alone(model):
    assert model.generate_batch(TEXTS, 10) == [model.generate(t, 10) for t in TEXTS]


def test_sampled_generation_equals_each_prompt_alone(llama):
    batched = llama.generate_batch(PROMPTS, 8, temperature=0.9, top_k=20, seed=5)
    assert batched == [llama.generate(p, 8, temperature=0.9, top_k=20, seed=5) for p in PROMPTS]


def test_each_sequence_stops_on_its_own(llama, monkeypatch):
    """A prompt whose next token is a stop token leaves the batch; the others go on as they would alone."""
    first = [int(llama.forward(p)[-1].argmax()) for p in PROMPTS]
    monkeypatch.setattr(llama.tokenizer, "stop_ids", llama.tokenizer.stop_ids | {first[1]})
    events = list(llama.stream_batch(PROMPTS, 6))
    per_prompt = {i: [t for j, t, _ in events if j == i] for i in range(len(PROMPTS))}
    assert per_prompt[1] == [first[1]]
    for i in (0, 2, 3):
        alone = [t for t, _ in llama.stream(PROMPTS[i], 6)]
        assert per_prompt[i] == alone


def test_steered_generation_with_generated_positions(llama):
    vector = torch.randn(llama.config.d_model, generator=torch.Generator().manual_seed(2))
    steer = hooks.Steer("blocks.0.hook_resid_post", vector, scale=6.0, positions="generated")
    batched = llama.generate_batch(PROMPTS, 6, interventions=[steer])
    assert batched == [llama.generate(p, 6, interventions=[steer]) for p in PROMPTS]
    assert batched != llama.generate_batch(PROMPTS, 6)


# -------------------------------------------------------------------------------------- batch caches


def test_batch_cache_continues_each_row(llama):
    runner = llama.runner
    cache = runner.new_batch_cache(len(PROMPTS))
    heads = [p[:-1] for p in PROMPTS]
    runner.forward(torch.tensor(sum(heads, [])), cache=cache, layout=BatchLayout([len(h) for h in heads], "cpu"))
    assert cache.lengths == [len(h) for h in heads]
    layout = BatchLayout([1] * len(PROMPTS), "cpu", cached=cache.lengths)
    last = runner.forward(torch.tensor([p[-1] for p in PROMPTS]), cache=cache, layout=layout)
    for b, prompt in enumerate(PROMPTS):
        assert_close_logits(last[b : b + 1], runner.forward(torch.tensor(prompt))[-1:])
        assert cache.tokens(b) == prompt


def test_surgery_on_one_row_equals_surgery_on_its_own_cache(llama):
    runner = llama.runner
    cache = runner.new_batch_cache(2)
    rows = [PROMPTS[0], PROMPTS[2]]
    runner.forward(torch.tensor(sum(rows, [])), cache=cache, layout=BatchLayout([len(r) for r in rows], "cpu"))
    edited = cache.row(1)
    edited.delete_positions([2, 3])
    cache.set_row(1, edited)
    layout = BatchLayout([1, 1], "cpu", cached=cache.lengths)
    out = runner.forward(torch.tensor([4, 4]), cache=cache, layout=layout)
    single = runner.new_cache()
    runner.forward(torch.tensor(rows[1]), cache=single)
    single.delete_positions([2, 3])
    expected = runner.forward(torch.tensor([4]), cache=single)
    assert_close_logits(out[1:2], expected)
    assert cache.row(1).positions.tolist() == single.positions.tolist()


def test_keep_rows_drops_rows(llama):
    cache = llama.runner.new_batch_cache(3)
    llama.runner.forward(torch.tensor(sum(PROMPTS[:3], [])), cache=cache,
                         layout=BatchLayout([len(p) for p in PROMPTS[:3]], "cpu"))
    before = [[cache.row(b).get(layer) for layer in range(cache.n_layers)] for b in range(3)]
    cache.keep_rows([2, 0])
    assert cache.lengths == [len(PROMPTS[2]), len(PROMPTS[0])] and cache.tokens(1) == PROMPTS[0]
    for b, kept in enumerate([2, 0]):  # each kept row's keys and values, moved in place
        for layer in range(cache.n_layers):
            assert all(torch.equal(a, e) for a, e in zip(cache.row(b).get(layer), before[kept][layer]))
    cache.keep_rows([1])
    assert cache.n_rows == 1 and torch.equal(cache.row(0).get(0)[0], before[0][0][0])
    with pytest.raises(WorkbenchError, match=r"keeps each row once, got \[0, 0\]"):
        cache.keep_rows([0, 0])


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("prompts, message", [
    ([], "the list of prompts is empty"),
    ("a string", "must be a list of prompts"),
    ([[1, 2], []], "prompt 1: the prompt is empty"),
    ([[1], [10**9]], "prompt 1: token ids out of range"),
])
def test_bad_prompt_lists(llama, prompts, message):
    with pytest.raises(WorkbenchError, match=message):
        llama.run_batch(prompts)


def test_a_prompt_past_the_context_is_named(llama):
    with pytest.raises(WorkbenchError, match="prompt 1: the prompt has"):
        llama.run_batch([[1, 2], [3] * (llama.config.n_ctx + 1)])
    with pytest.raises(WorkbenchError, match="prompt 0: .* exceed the context"):
        llama.generate_batch([[3] * (llama.config.n_ctx - 2)], 8)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_batch_sizes(llama, size):
    with pytest.raises(WorkbenchError, match="batch_size must be a positive integer"):
        llama.run_batch(PROMPTS, batch_size=size)


def test_a_position_that_fits_one_prompt_but_not_another_is_refused_before_compute(llama, monkeypatch):
    ran = []
    monkeypatch.setattr(llama.runner, "forward", lambda *a, **k: ran.append(1))
    with pytest.raises(HookError, match="prompt 1: position 5 is out of range"):
        llama.run_batch(PROMPTS, interventions=[hooks.ZeroAblate("blocks.0.hook_resid_post", positions=[5])])
    with pytest.raises(HookError, match="prompt 1 has 2 tokens; reduce=-3"):
        llama.run_batch(PROMPTS, record=["blocks.0.hook_resid_post"], reduce=-3)
    with pytest.raises(WorkbenchError, match="one list per prompt"):
        llama.run_batch(PROMPTS, per_prompt_interventions=[[]])
    assert not ran


@pytest.fixture()
def no_forward(llama, monkeypatch):
    """Runner forwards started during the test (a refusal must come before any)."""
    ran = []
    monkeypatch.setattr(llama.runner, "forward", lambda *a, **k: ran.append(1))
    return ran


@pytest.mark.parametrize("prompt", [b"abc", bytearray(b"abc"), [504.9, 3575.2], [1.0, 2.0], [True, 2],
                                    torch.tensor([1.5, 2.0]), None, 5])
def test_a_prompt_of_neither_text_nor_integer_ids_is_named(llama, no_forward, prompt):
    neither = "a prompt is a text, a list of integer token ids or a list of messages"
    with pytest.raises(WorkbenchError, match=f"prompt 1: {neither}"):
        llama.run_batch([[1, 2], prompt])
    if prompt is not None:
        with pytest.raises(WorkbenchError, match=f"^{neither}"):
            llama.run(prompt)
    assert not no_forward


def test_integer_ids_of_any_integer_type_are_prompts(llama):
    ids = [5, 17, 42]
    expected = llama.run(ids).logits
    for prompt in (torch.tensor(ids), tuple(ids), [torch.tensor(i) for i in ids]):
        assert torch.equal(llama.run(prompt).logits, expected)


def test_record_dtype_and_device(llama, no_forward):
    point = "blocks.0.hook_resid_post"
    for bad in (torch.int8, torch.int64, torch.bool, "int8", "half precision", None, 16):
        with pytest.raises(WorkbenchError, match="record_dtype must be a floating torch dtype"):
            llama.run_batch(PROMPTS, record=[point], record_dtype=bad)
    for bad in ("cuda:99", "gpu", None):
        with pytest.raises(WorkbenchError, match="record_device: "):
            llama.run_batch(PROMPTS, record=[point], record_device=bad)
    assert not no_forward


def test_record_dtype_by_name(llama):
    point = "blocks.0.hook_resid_post"
    full = llama.run_batch(PROMPTS, record=[point])
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        for a, b in zip(full, llama.run_batch(PROMPTS, record=[point], record_dtype=name)):
            assert b.activations[point].dtype == dtype
            assert torch.equal(b.activations[point], a.activations[point].to(dtype))


def test_one_intervention_or_hook_name_where_a_list_belongs(llama, no_forward):
    steer = hooks.Steer("blocks.1.hook_resid_post", torch.zeros(llama.config.d_model))
    pair = ("blocks.1.hook_resid_post", lambda x, ctx: None)
    for single in (steer, steer.to_spec(), pair):
        for call in (lambda: llama.run(PROMPTS[0], interventions=single),
                     lambda: llama.run_batch(PROMPTS, interventions=single),
                     lambda: llama.generate(PROMPTS[0], 2, interventions=single),
                     lambda: llama.generate_batch(PROMPTS, 2, interventions=single),
                     lambda: llama.stream_batch(PROMPTS, 2, interventions=single)):
            with pytest.raises(HookError, match=r"interventions must be a list of interventions, got .*; pass \[it\]"):
                call()
    for rows, message in ((5, "one list per prompt"), ("steer", "one list per prompt"),
                          ([None, [steer], None, []], "prompt 0: its per_prompt_interventions must be a list"),
                          ([[], steer, [], []], r"prompt 1: .* got one Steer; pass \[it\]"),
                          ([[], [], "steer", []], "prompt 2: .* must be a list of interventions, got 'steer'")):
        with pytest.raises(WorkbenchError, match=message):
            llama.run_batch(PROMPTS, per_prompt_interventions=rows)
        with pytest.raises(WorkbenchError, match=message):
            llama.generate_batch(PROMPTS, 2, per_prompt_interventions=rows)
    for record, message in (("blocks.1.hook_resid_post", r"record must be a list .*; pass \[it\]"),
                            (5, "record must be a list of hook point names or globs, got 5")):
        with pytest.raises(HookError, match=message):
            llama.run_batch(PROMPTS, record=record)
        with pytest.raises(HookError, match=message):
            llama.run(PROMPTS[0], record=record)
    assert not no_forward


@pytest.mark.parametrize("count", [1.5, "3", None, True, -1])
def test_max_new_tokens_must_be_a_count(llama, no_forward, count):
    for call in (lambda: llama.generate_batch(PROMPTS, count), lambda: llama.stream_batch(PROMPTS, count),
                 lambda: llama.generate(PROMPTS[0], count), lambda: llama.stream(PROMPTS[0], count)):
        with pytest.raises(WorkbenchError, match="max_new_tokens must be an integer >= 0"):
            call()
    assert not no_forward


def test_a_bad_reduce_is_refused_with_nothing_recorded(llama, no_forward):
    for reduce in ("bogus", 2.0, True):
        with pytest.raises(HookError, match="reduce must be None, 'last', 'mean' or a position"):
            llama.run_batch(PROMPTS, reduce=reduce)
    assert not no_forward


def test_iterators_check_batch_size_and_progress_when_called(llama, no_forward):
    with pytest.raises(WorkbenchError, match="batch_size must be a positive integer"):
        llama.iter_batch(PROMPTS, batch_size=0)
    with pytest.raises(WorkbenchError, match="batch_size must be a positive integer"):
        llama.stream_batch(PROMPTS, 2, batch_size=0)
    with pytest.raises(WorkbenchError, match="progress must be None, True or a callable"):
        llama.iter_batch(PROMPTS, progress="yes")
    assert not no_forward


def test_a_function_hook_of_the_wrong_shape_names_its_prompt(llama):
    crop = ("blocks.0.hook_resid_post", lambda x, ctx: x[:1])
    with pytest.raises(HookError, match=r"^prompt 2: hook on blocks.0.hook_resid_post returned shape \(1, 64\)"):
        llama.run_batch(PROMPTS, per_prompt_interventions=[[], [], [crop], []])


def test_reduce_needs_token_major_points(llama):
    with pytest.raises(HookError, match="token-major"):
        llama.run_batch(PROMPTS, record=["blocks.0.attn.hook_pattern"], reduce="last")


# ------------------------------------------------------------------------------------ batched probes


def test_logit_lens_batch_equals_each_prompt(model):
    from workbench import probes

    lenses = probes.logit_lens_batch(model, TEXTS[:3], k=3)
    for text, lens in zip(TEXTS, lenses):
        alone = probes.logit_lens(model, text, k=3)
        assert lens.tokens == alone.tokens
        top = lens.top_ids["resid_post"][:, :, 0]
        assert (top == alone.top_ids["resid_post"][:, :, 0]).float().mean() > 0.99


def test_logit_lens_batch_of_a_prompt_in_chunks_and_with_a_tuned_lens(llama, monkeypatch):
    from workbench import probes

    long = list(range(1, 40))
    whole = probes.logit_lens_batch(llama, [long, PROMPTS[0]], points=("resid_mid", "resid_post"), k=4)
    monkeypatch.setattr(llama, "max_batch_tokens", lambda: 16)
    chunked = probes.logit_lens_batch(llama, [long, PROMPTS[0]], points=("resid_mid", "resid_post"), k=4)
    for a, b in zip(whole, chunked):
        for point in ("resid_mid", "resid_post"):
            assert a.top_ids[point].shape == b.top_ids[point].shape == (llama.config.n_layers, len(a.ids), 4)
            assert (a.top_ids[point] == b.top_ids[point]).float().mean() > 0.99
            torch.testing.assert_close(a.top_probs[point], b.top_probs[point], atol=1e-4, rtol=1e-3)
    tuned = probes.train_tuned_lens(llama, TEXTS)
    batched = probes.logit_lens_batch(llama, PROMPTS, k=4, tuned=tuned)
    for prompt, lens in zip(PROMPTS, batched):
        alone = probes.logit_lens(llama, prompt, k=4, tuned=tuned)
        assert (lens.top_ids["resid_post"] == alone.top_ids["resid_post"]).float().mean() > 0.99
        torch.testing.assert_close(lens.top_probs["resid_post"], alone.top_probs["resid_post"], atol=1e-4, rtol=1e-3)


def test_the_lens_unembeds_the_positions_prompts_share_once(llama, monkeypatch):
    from workbench.probes import lens as lens_module

    prompts = [PROMPTS[0], PROMPTS[0][:4] + [90, 91], PROMPTS[1], PROMPTS[0]]
    rows = []
    top_k = lens_module.top_k_probs
    monkeypatch.setattr(lens_module, "top_k_probs", lambda x, *a: rows.append(x.shape[0]) or top_k(x, *a))
    shared = lens_module.logit_lens_batch(llama, prompts, k=4)
    # 7 positions of the first prompt, 2 of the pair's own, 2 of [8, 3]; the repeat adds none
    assert rows == [llama.config.n_layers * (7 + 2 + 2)]
    monkeypatch.setattr(lens_module, "distinct_prefixes", lambda *a: None)
    every = lens_module.logit_lens_batch(llama, prompts, k=4)
    for a, b in zip(shared, every):  # a forward's rows of one prefix are the same bits: so are their lenses
        assert torch.equal(a.top_ids["resid_post"], b.top_ids["resid_post"])
        assert torch.equal(a.top_probs["resid_post"], b.top_probs["resid_post"])


def test_dla_batch_equals_each_prompt(llama):
    from workbench import probes

    attributions = probes.direct_logit_attribution_batch(llama, PROMPTS, targets=[10, 11, 12, 13], baselines=20)
    for prompt, target, attribution in zip(PROMPTS, [10, 11, 12, 13], attributions):
        alone = probes.direct_logit_attribution(llama, prompt, target, 20)
        assert attribution.labels == alone.labels
        torch.testing.assert_close(attribution.contributions, alone.contributions, atol=1e-3, rtol=1e-3)
        assert attribution.total == pytest.approx(attribution.logit, abs=1e-3)
    with pytest.raises(WorkbenchError, match="prompt 1: position -3 is out of range"):
        probes.direct_logit_attribution_batch(llama, PROMPTS, targets=10, position=-3)
    with pytest.raises(WorkbenchError, match="one token per prompt"):
        probes.direct_logit_attribution_batch(llama, PROMPTS, targets=[10, 11])


# ---------------------------------------------------------------------------------------- shared prefix

TEMPLATE = list(range(30, 60))  # 30 tokens every prompt starts with


def test_a_shared_prefix_is_computed_once_with_the_same_results(llama, monkeypatch):
    prompts = [TEMPLATE + p for p in PROMPTS]
    names = ["blocks.*.hook_resid_post", "blocks.1.attn.hook_pattern", "blocks.0.attn.hook_attn_scores"]
    separate = llama.run_batch(prompts, record=names, share_prefix=False)
    widths = []
    forward = llama.runner.forward
    monkeypatch.setattr(llama.runner, "forward", lambda ids, *a, **k: widths.append(len(ids)) or forward(ids, *a, **k))
    shared = llama.run_batch(prompts, record=names)
    assert widths == [len(TEMPLATE), sum(len(p) for p in PROMPTS)]  # the template once, then each prompt's own tokens
    for a, b in zip(shared, separate):
        assert_close_logits(a.logits, b.logits)
        for name, value in b.activations.items():
            assert a.activations[name].shape == value.shape
            torch.testing.assert_close(a.activations[name], value, atol=1e-3, rtol=1e-3)
    last = llama.run_batch(prompts, record=["blocks.1.hook_resid_post"], reduce="last", logits="last")
    for a, b in zip(last, separate):
        assert_close_logits(a.logits, b.logits[-1:])
        torch.testing.assert_close(a.activations["blocks.1.hook_resid_post"], b.activations["blocks.1.hook_resid_post"][-1],
                                   atol=1e-3, rtol=1e-3)


def test_generation_shares_the_prefix(llama):
    prompts = [TEMPLATE + p for p in PROMPTS]
    assert llama.generate_batch(prompts, 6) == [llama.generate(p, 6) for p in prompts]


def test_edits_of_every_token_share_the_prefix(llama, monkeypatch):
    """An intervention that every prompt shares at every token (a Steer at positions None, or "generated") edits the
    shared prefix's tokens as it edits each prompt's own: the template runs once, with the same results as without
    sharing, and greedy generation equals generate's."""
    prompts = [TEMPLATE + p for p in PROMPTS]
    vector = torch.randn(llama.config.d_model, generator=torch.Generator().manual_seed(4))
    widths = []
    forward = llama.runner.forward
    monkeypatch.setattr(llama.runner, "forward", lambda ids, *a, **k: widths.append(len(ids)) or forward(ids, *a, **k))
    plain = llama.run_batch(prompts, share_prefix=False)
    for positions in (None, "generated"):
        steer = hooks.Steer("blocks.0.hook_resid_post", vector, scale=4.0, positions=positions)
        separate = llama.run_batch(prompts, interventions=[steer], share_prefix=False)
        widths.clear()
        shared = llama.run_batch(prompts, interventions=[steer])
        assert widths == [len(TEMPLATE), sum(map(len, PROMPTS))]
        for a, b, c in zip(shared, separate, plain):
            assert_close_logits(a.logits, b.logits)
            assert (positions is None) != torch.equal(b.logits, c.logits)  # the template's tokens steered or not
        widths.clear()
        batched = llama.generate_batch(prompts, 6, interventions=[steer])
        assert widths[0] == len(TEMPLATE)
        assert batched == [llama.generate(p, 6, interventions=[steer]) for p in prompts]


def test_no_sharing_with_interventions_or_short_prefixes(llama, monkeypatch):
    widths = []
    forward = llama.runner.forward
    monkeypatch.setattr(llama.runner, "forward", lambda ids, *a, **k: widths.append(len(ids)) or forward(ids, *a, **k))
    prompts = [TEMPLATE + p for p in PROMPTS]
    llama.run_batch(prompts, interventions=[hooks.ZeroAblate("blocks.0.hook_mlp_out", positions=[3])])
    llama.run_batch([TEMPLATE[:5] + p for p in PROMPTS])  # would save 5 x 3 tokens, under MIN_SHARED_TOKENS
    assert widths == [sum(map(len, prompts)), 5 * len(PROMPTS) + sum(map(len, PROMPTS))]


def test_a_repeated_prompt_is_computed_once(llama, monkeypatch):
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], list(PROMPTS[0]), PROMPTS[1]]
    steer = [[], [], [hooks.Steer("blocks.0.hook_resid_post", torch.ones(llama.config.d_model), 2.0)], [], []]
    separate = llama.run_batch(prompts, record=["blocks.1.hook_resid_post"], share_prefix=False,
                               per_prompt_interventions=steer)
    widths = []
    forward = llama.runner.forward
    monkeypatch.setattr(llama.runner, "forward", lambda ids, *a, **k: widths.append(len(ids)) or forward(ids, *a, **k))
    done = []
    traces = dict(llama.iter_batch(prompts, record=["blocks.1.hook_resid_post"], per_prompt_interventions=steer,
                                   progress=lambda n, total: done.append((n, total))))
    # prompt 2 has an intervention of its own; 3 and 4 repeat 0 and 1 and take their results
    assert widths == [2 * len(PROMPTS[0]) + len(PROMPTS[1])] and done[-1] == (5, 5)
    assert sorted(traces) == list(range(5))
    for i, trace in traces.items():
        assert trace.ids == separate[i].ids and trace.interventions == separate[i].interventions
        assert torch.equal(trace.logits, separate[i].logits)
        torch.testing.assert_close(trace.activations["blocks.1.hook_resid_post"],
                                   separate[i].activations["blocks.1.hook_resid_post"], rtol=0, atol=0)
    assert not torch.equal(traces[2].logits, traces[0].logits)
    # iter_batch's traces own their buffers: editing one leaves its repeat's alone
    traces[3].activations["blocks.1.hook_resid_post"].zero_()
    assert traces[0].activations["blocks.1.hook_resid_post"].abs().sum() > 0


def test_prefix_groups_pick_the_runs_that_save_the_most():
    pair = TEMPLATE[:20]
    rows = [pair + [1, 2], [9, 9, 9], pair + [3], TEMPLATE + [4], TEMPLATE + [4], [9, 9, 8], TEMPLATE + [4]]
    assert prefix_groups(rows) == [PrefixGroup(20, (0, 2)), PrefixGroup(30, (3, 4, 6))]
    # a repeated prompt keeps its last token; one template under two long starts saves more as one group
    assert prefix_groups([[7] * 17, [7] * 17]) == [PrefixGroup(16, (0, 1))]
    assert prefix_groups([[7] * 16, [7] * 16]) == []
    starts = [TEMPLATE + [k] * 8 + [j] for k in (1, 2) for j in (3, 4)]
    assert prefix_groups(starts) == [PrefixGroup(30, (0, 1, 2, 3))]
    assert prefix_groups([]) == prefix_groups([[1]]) == []


def test_groups_of_shared_prefixes_are_computed_once_with_the_same_results(llama, monkeypatch):
    """A contrastive pair and three prompts that differ in their last token, beside a prompt that shares nothing: each
    group's prefix runs once (the prefixes together in one forward), then every row's own tokens over its cache row."""
    pairs = [TEMPLATE[:18] + [70, 71], TEMPLATE[:18] + [80, 81, 82], PROMPTS[1]] + [PROMPTS[2] + [k] for k in (1, 2, 3)]
    names = ["blocks.*.hook_resid_post", "blocks.1.attn.hook_pattern"]
    separate = llama.run_batch(pairs, record=names, share_prefix=False)
    widths = []
    forward = llama.runner.forward
    monkeypatch.setattr(llama.runner, "forward", lambda ids, *a, **k: widths.append(len(ids)) or forward(ids, *a, **k))
    shared = llama.run_batch(pairs, record=names)
    # the prefixes (13 of the three, 18 of the pair), then 1 + 1 + 1 tokens of the three's, 2 + 3 of the pair's and
    # the 2 of the prompt alone
    assert widths == [13 + 18, 3 + 5 + 2]
    for a, b in zip(shared, separate):
        assert a.ids == b.ids
        assert_close_logits(a.logits, b.logits)
        for name, value in b.activations.items():
            assert a.activations[name].shape == value.shape
            torch.testing.assert_close(a.activations[name], value, atol=1e-3, rtol=1e-3)
    assert all(torch.equal(shared[3].logits[:13], t.logits[:13]) for t in shared[4:])  # one prefix's logits
    last = llama.run_batch(pairs, logits="last", record=["blocks.1.hook_resid_post"], reduce="last")
    for a, b in zip(last, separate):
        assert_close_logits(a.logits, b.logits[-1:])
        name = "blocks.1.hook_resid_post"
        torch.testing.assert_close(a.activations[name], b.activations[name][-1], atol=1e-3, rtol=1e-3)
    widths.clear()
    assert llama.generate_batch(pairs, 5) == [llama.generate(p, 5) for p in pairs]
    assert widths[0] == 13 + 18  # the prefill of the generation shares them too


# ------------------------------------------------------------------------------------- packed attention


@pytest.fixture
def packed_on_cpu(monkeypatch):
    """A batch's attention without a cache as CUDA runs it, one packed Triton launch a layer (here through Triton's
    interpreter, on CPU tensors, the CPU's one C++ call for attention or whole blocks declined): the windows of the
    calls it took."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1, which tests/conftest.py sets where no CUDA device is present")
    triton_ops = pytest.importorskip("workbench.kernels.triton")
    monkeypatch.setattr(layer_ops, "rope_attention", lambda *args, **kwargs: None)
    monkeypatch.setattr(layer_ops, "blocks_exact", lambda *args, **kwargs: None)
    windows = []

    def packed(q, k, v, starts, width, divisor, window=0, rotation=None):
        windows.append(window)
        return triton_ops.packed_attention(q, k, v, starts, width, divisor, window, rotation)

    monkeypatch.setattr(layer_ops, "packed_attention", packed)
    return windows


@pytest.mark.parametrize("family", [dict(arch="llama"), dict(arch="qwen3"), dict(arch="llama", sliding_window=4)],
                         ids=["llama", "qwen3", "sliding-window"])
def test_packed_attention_equals_each_prompt_alone(tiny_model, packed_on_cpu, family):
    model = tiny_model(**family, seed=3, device="cpu")
    traces = model.run_batch(PROMPTS)
    assert len(packed_on_cpu) == model.config.n_layers
    assert (4 in packed_on_cpu) == ("sliding_window" in family)  # the sliding layers pass their window
    for prompt, trace in zip(PROMPTS, traces):
        assert_close_logits(trace.logits, model.forward(prompt))


def test_recording_scores_and_patterns_keeps_the_packed_attention(llama, packed_on_cpu):
    """Hooks on the scores or the pattern see the padded products; the forward keeps the packed attention's z unless
    they change one (in place too), so that recording everything keeps the batch's bits."""
    plain = llama.run_batch(PROMPTS)
    recorded = llama.run_batch(PROMPTS, record=["*"])
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(plain, recorded))
    for trace, prompt in zip(recorded, PROMPTS):
        alone = llama.run(prompt, record=["blocks.1.attn.hook_pattern"]).activations["blocks.1.attn.hook_pattern"]
        torch.testing.assert_close(trace.activations["blocks.1.attn.hook_pattern"], alone, rtol=1e-5, atol=1e-6)

    def halve_in_place(x, ctx):
        x.mul_(0.5)

    name = "blocks.1.attn.hook_pattern"
    for edit in (hooks.ZeroAblate(name, heads=[0]), halve_in_place):
        edited = llama.run_batch(PROMPTS, interventions=[(name, edit)] if callable(edit) else [edit])
        padded = [llama.run(p, interventions=[(name, edit)] if callable(edit) else [edit]) for p in PROMPTS]
        for a, b, p in zip(edited, plain, padded):
            assert not torch.equal(a.logits, b.logits)
            assert_close_logits(a.logits, p.logits)


# ---------------------------------------------------------------------------------------------- CUDA

# bfloat16 activations round each matmul's output to 8 bits of mantissa, so a matmul of more rows (another kernel or
# tiling) can move a logit by a few of its units in the last place: the bound is relative to the logits' range.
CUDA_BOUNDS = {"float32": 1e-4, "bfloat16": 3e-2}
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=[pytest.param(d, marks=needs_cuda) for d in CUDA_BOUNDS])
def cuda_model(request, tiny_model):
    model = tiny_model("llama", "Q4_K", seed=3, device="cuda", dtype=request.param, d_model=256, n_heads=4, d_mlp=512)
    return model, CUDA_BOUNDS[request.param]


def test_cuda_batches_equal_each_prompt(cuda_model):
    model, bound = cuda_model
    long = list(range(1, 100))
    prompts = PROMPTS + [long]
    traces = model.run_batch(prompts, record=["blocks.*.hook_resid_post"])
    for prompt, trace in zip(prompts, traces):
        alone = model.forward(prompt).cpu()
        scale = alone.abs().max().item()
        assert (trace.logits - alone).abs().max().item() <= bound * scale
        assert (trace.logits.argmax(-1) == alone.argmax(-1)).float().mean() >= 0.95
    recorded_everything = model.run_batch(prompts, record=["*"])
    plain = model.run_batch(prompts)
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(recorded_everything, plain))


def test_cuda_batched_generation_equals_each_prompt(cuda_model):
    model, _ = cuda_model
    steer = hooks.Steer("blocks.0.hook_resid_post", torch.ones(256), scale=2.0, positions="generated")
    for interventions in ([], [steer]):
        batched = model.generate_batch(PROMPTS, 8, interventions=interventions)
        alone = [model.generate(p, 8, interventions=interventions, compiled=False) for p in PROMPTS]
        assert sum(a == b for a, b in zip(batched, alone)) >= len(PROMPTS) - 1  # a near-tie may flip in bfloat16


def test_a_prompt_longer_than_a_forward_runs_in_chunks(llama, monkeypatch):
    names = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern"]
    long = list(range(1, 40))
    whole = llama.run_batch([long], record=names)[0]
    steer = hooks.Steer("blocks.0.hook_resid_post", torch.ones(llama.config.d_model), positions=[-1, 3])
    steered = llama.run_batch([long], interventions=[steer])[0]
    monkeypatch.setattr(llama, "max_batch_tokens", lambda: 16)
    widths = []
    forward = llama.runner.forward
    monkeypatch.setattr(llama.runner, "forward", lambda ids, *a, **k: widths.append(len(ids)) or forward(ids, *a, **k))
    chunked = llama.run_batch([long], record=names)[0]
    assert widths == [16, 16, 7]
    assert_close_logits(chunked.logits, whole.logits)
    for name in names:
        assert chunked.activations[name].shape == whole.activations[name].shape
        torch.testing.assert_close(chunked.activations[name], whole.activations[name], atol=1e-3, rtol=1e-3)
    assert_close_logits(llama.run_batch([long], interventions=[steer])[0].logits, steered.logits)
    for reduce in ("mean", -3):
        reduced = llama.run_batch([long], record=names[:1], reduce=reduce)[0].activations[names[0]]
        expected = whole.activations[names[0]].mean(0) if reduce == "mean" else whole.activations[names[0]][-3]
        torch.testing.assert_close(reduced, expected, atol=1e-3, rtol=1e-3)


def test_batches_compute_in_the_numerics_of_the_call(llama):
    from workbench.kernels import numerics

    with numerics("llamacpp"):
        emulated = llama.forward_batch(PROMPTS)
        generated = llama.generate_batch(PROMPTS, 4)
        alone = [llama.forward(p) for p in PROMPTS]
        alone_generated = [llama.generate(p, 4) for p in PROMPTS]
    exact = llama.forward_batch(PROMPTS)
    for a, b, c in zip(emulated, alone, exact):
        assert_close_logits(a, b)
        assert not torch.equal(a, c)
    assert generated == alone_generated


def test_streamed_traces_own_their_activations_and_run_batch_views_them(llama):
    prompts = ["one two three", "four five", "six seven eight nine"]
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    streamed = dict(llama.iter_batch(prompts, record=names, batch_size=3))
    kept = llama.run_batch(prompts, record=names, batch_size=3)

    def storages(trace):
        return {trace.activations[n].untyped_storage().data_ptr() for n in names}

    for i, trace in enumerate(kept):
        for name in names:
            assert torch.equal(trace.activations[name], streamed[i].activations[name])
    # a streamed trace's points share one buffer of that prompt alone; run_batch's view the forward's buffers
    assert all(len(storages(t)) == 1 for t in streamed.values())
    assert len(set.union(*(storages(t) for t in streamed.values()))) == len(prompts)
    assert storages(kept[0]) == storages(kept[1]) == storages(kept[2])
