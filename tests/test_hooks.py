"""Hook points and interventions: the invariants of issue 4, on small random models and the embedded one."""
from __future__ import annotations

import json
import threading

import pytest
import torch

import workbench
from workbench import hooks

IDS = [5, 17, 42, 99, 7, 23, 61]
ARCHS = ["llama", "qwen2", "qwen3"]
PROMPT = "The Eiffel Tower is in the city of"


# On the CPU in float32 wherever the machine has a GPU too: the bounds below are float32's (a GPU's default bfloat16
# rounds past them); the CUDA forward's hooks have tests of their own (tests/test_runner.py).
@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_model):
    return tiny_model(request.param, n_layers=2, seed=3, device="cpu")


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama", n_layers=2, seed=3, device="cpu")


def ablate_head_by_hand(model, ids, layer: int, head: int) -> torch.Tensor:
    """Logits with one head's W_O contribution subtracted from attn_out, W_O dequantized from its blocks."""
    c = model.config
    w_o = model.runner.weights.layers[layer].wo.dequantize(torch.float32)  # [d_model, n_heads * d_head]
    w_head = w_o[:, head * c.d_head:(head + 1) * c.d_head]
    seen = {}

    def keep_z(z, ctx):
        seen["z"] = z

    def remove_head(attn_out, ctx):
        return attn_out - seen["z"][:, head] @ w_head.T

    return model.forward(ids, interventions=[(f"blocks.{layer}.attn.hook_z", keep_z),
                                             (f"blocks.{layer}.hook_attn_out", remove_head)])


# ----------------------------------------------------------------------------- invariants, random models


def test_recording_everything_leaves_logits_bit_identical(tiny):
    plain = tiny.run(IDS)
    recorded = tiny.run(IDS, record=["*"])
    assert torch.equal(recorded.logits, plain.logits)
    assert set(recorded.activations) == set(tiny.hook_points())


def test_edits_of_either_norm_point_reach_the_output(tiny):
    """A norm's hook_scale is TransformerLens' divisor: halving it is doubling the normalized input (up to the
    rounding of the divisor's reciprocal), and either differs from the plain run, whichever norm it is."""
    def double(x, ctx):
        return 2 * x

    def halve(x, ctx):
        return x / 2

    plain = tiny.forward(IDS)
    for norm in ("blocks.0.ln1", "blocks.1.ln2", "ln_final"):
        by_scale = tiny.forward(IDS, interventions=[(f"{norm}.hook_scale", halve)])
        by_normalized = tiny.forward(IDS, interventions=[(f"{norm}.hook_normalized", double)])
        assert (by_scale - plain).abs().max() > 1e-2, norm
        if tiny.dtype == torch.float32:
            torch.testing.assert_close(by_scale, by_normalized, rtol=1e-5, atol=1e-5, msg=norm)
        else:  # half precision rounds the two edits apart: they must still be far closer to each other than to plain
            assert (by_scale - by_normalized).abs().max() < 0.1 * (by_scale - plain).abs().max(), norm


def test_recorded_shapes_match_hook_points(tiny):
    trace = tiny.run(IDS, record=["*"])
    T = len(IDS)
    for name, shape in tiny.hook_points().items():
        expected = [T if d in ("T", "S") else int(d) for d in shape.strip("[]").split(", ")]
        assert list(trace.activations[name].shape) == expected, name


def test_patching_a_run_with_its_own_activations_is_the_identity(tiny):
    own = tiny.run(IDS, record=["*"])
    patched = tiny.run(IDS, interventions=[hooks.Patch("*", donor=own)])
    assert torch.equal(patched.logits, own.logits)


def test_zero_steer_is_the_identity(tiny):
    c = tiny.config
    zero_steers = [hooks.Steer("blocks.*.hook_resid_post", torch.zeros(c.d_model)),
                   hooks.Steer("blocks.*.mlp.hook_post", torch.zeros(c.d_mlp)),
                   hooks.Steer("blocks.*.attn.hook_z", torch.zeros(c.d_head), heads=[1])]
    assert torch.equal(tiny.forward(IDS, interventions=zero_steers), tiny.forward(IDS))


def test_zero_ablating_a_head_equals_removing_its_w_o_contribution(tiny):
    plain = tiny.forward(IDS)
    ablated = tiny.forward(IDS, interventions=[hooks.ZeroAblate("blocks.1.attn.hook_z", heads=[2])])
    by_hand = ablate_head_by_hand(tiny, IDS, layer=1, head=2)
    assert (ablated - plain).abs().max() > 1e-2  # the head matters, so the comparison means something
    torch.testing.assert_close(ablated, by_hand, rtol=1e-4, atol=1e-4)


def test_editing_hook_result_matches_editing_hook_z(tiny):
    via_z = tiny.forward(IDS, interventions=[hooks.ZeroAblate("blocks.0.attn.hook_z", heads=[3])])
    via_result = tiny.forward(IDS, interventions=[hooks.ZeroAblate("blocks.0.attn.hook_result", heads=[3])])
    torch.testing.assert_close(via_result, via_z, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ embedded model


def test_embedded_invariants(model):
    ids = model.to_ids(PROMPT)
    everything = model.run(ids, record=["*"])
    assert torch.equal(everything.logits, model.run(ids).logits)
    assert torch.equal(model.forward(ids, interventions=[hooks.Patch("*", donor=everything)]), everything.logits)
    zero = hooks.Steer("blocks.*.hook_resid_post", torch.zeros(model.config.d_model))
    assert torch.equal(model.forward(ids, interventions=[zero]), everything.logits)
    ablated = model.forward(ids, interventions=[hooks.ZeroAblate("blocks.3.attn.hook_z", heads=[4])])
    assert (ablated - everything.logits).abs().max() > 1e-2
    torch.testing.assert_close(ablated, ablate_head_by_hand(model, ids, layer=3, head=4), rtol=1e-4, atol=2e-4)


# ------------------------------------------------------------------------------------ region selection


def test_an_edit_touches_only_its_region(llama):
    name = "blocks.0.mlp.hook_post"
    plain = llama.run(IDS, record=[name]).activations[name]
    edit = hooks.ZeroAblate(name, positions=[1, -1], neurons=[3, 5])
    edited = llama.run(IDS, record=[name], interventions=[edit]).activations[name]
    region = torch.zeros_like(plain, dtype=torch.bool)
    region[[1, 1, 6, 6], [3, 5, 3, 5]] = True
    assert torch.equal(edited[region], torch.zeros(4))
    assert torch.equal(edited[~region], plain[~region])


def test_head_selection_on_z_and_scale(llama):
    name = "blocks.1.attn.hook_z"
    plain = llama.run(IDS, record=[name]).activations[name]
    scaled = llama.run(IDS, record=[name], interventions=[hooks.Scale(name, heads=[0, 2], factor=-2.0)]).activations[name]
    assert torch.equal(scaled[:, [0, 2]], -2.0 * plain[:, [0, 2]])
    assert torch.equal(scaled[:, [1, 3]], plain[:, [1, 3]])
    zero_by_scale = llama.forward(IDS, interventions=[hooks.Scale(name, heads=[1], factor=0.0)])
    assert torch.equal(zero_by_scale, llama.forward(IDS, interventions=[hooks.ZeroAblate(name, heads=[1])]))


def test_mean_and_resample_ablation(llama):
    name = "blocks.0.hook_resid_mid"
    references = [llama.run(ids, record=[name]) for ids in ([1, 2, 3, 4], [9, 8, 7])]
    mean_ablate = hooks.MeanAblate.from_traces(name, references, positions=[2])
    mean = torch.cat([t.activations[name] for t in references]).mean(0)
    edited = llama.run(IDS, record=[name], interventions=[mean_ablate]).activations[name]
    torch.testing.assert_close(edited[2], mean, rtol=0, atol=1e-6)
    last_rows = llama.run_batch([[1, 2, 3, 4], [9, 8, 7]], record=[name], reduce="last", logits=None)
    from_last = hooks.MeanAblate.from_traces(name, last_rows).mean  # one row a trace
    last_mean = torch.stack([t.activations[name][-1] for t in references]).mean(0)
    torch.testing.assert_close(from_last, last_mean, rtol=0, atol=1e-5)

    donors = [[11, 12, 13], [14, 15]]
    pool = torch.cat([llama.run(d, record=[name]).activations[name] for d in donors])
    resample = hooks.ResampleAblate(name, positions=[0, 4], donors=donors, seed=7)
    first = llama.run(IDS, record=[name], interventions=[resample]).activations[name]
    again = llama.run(IDS, record=[name], interventions=[resample]).activations[name]
    assert torch.equal(first, again)  # seeded
    for p in (0, 4):
        assert any(torch.equal(first[p], row) for row in pool)


def test_specs_round_trip_through_json_with_the_same_effect(llama):
    c = llama.config
    donor_trace = llama.run([3, 1, 4, 1, 5, 9, 2], record=["blocks.1.hook_resid_pre"])
    interventions = [
        hooks.Steer("blocks.0.hook_resid_post", torch.linspace(-1, 1, c.d_model), scale=2.5, positions=[1, 2]),
        hooks.MeanAblate("blocks.1.attn.hook_z", torch.ones(c.n_heads, c.d_head), heads=[1]),
        hooks.Patch("blocks.1.hook_resid_pre", positions=[3], donor=donor_trace),
        hooks.Patch("blocks.0.hook_mlp_out", positions=[-1], donor="the hat sat on the mat"),
        hooks.ResampleAblate("blocks.0.hook_resid_pre", positions=[0], donors=["on the mat"], seed=1),
        hooks.Composite([hooks.Scale("blocks.*.hook_attn_out", factor=0.5, neurons=[0, 1]),
                         hooks.ZeroAblate("blocks.0.mlp.hook_pre", neurons=[7])]),
    ]
    specs = json.loads(json.dumps([i.to_spec() for i in interventions]))
    rebuilt = [hooks.from_spec(s) for s in specs]
    assert [r.to_spec() for r in rebuilt] == specs
    direct = llama.forward(IDS, interventions=interventions)
    assert not torch.equal(direct, llama.forward(IDS))
    assert torch.equal(llama.forward(IDS, interventions=specs), direct)


def test_function_hooks_and_pairs(llama):
    seen = []

    def double(x, ctx):
        seen.append((ctx.name, ctx.layer, ctx.positions.tolist(), ctx.step))
        return x * 2

    doubled = llama.forward(IDS, interventions=[hooks.FunctionHook("blocks.1.hook_mlp_out", double)])
    assert seen == [("blocks.1.hook_mlp_out", 1, list(range(len(IDS))), 0)]
    assert torch.equal(llama.forward(IDS, interventions=[("blocks.1.hook_mlp_out", double)]), doubled)
    assert torch.equal(doubled, llama.forward(IDS, interventions=[hooks.Scale("blocks.1.hook_mlp_out", factor=2)]))
    with pytest.raises(workbench.HookError, match="cannot be rebuilt"):
        hooks.from_spec(hooks.FunctionHook("hook_embed", double).to_spec())


# --------------------------------------------------------------------------------- scoping and threads


def test_hooks_context_applies_inside_only_and_records(llama):
    steer = hooks.Steer("blocks.0.hook_resid_post", torch.ones(llama.config.d_model))
    plain, steered = llama.forward(IDS), llama.forward(IDS, interventions=[steer])
    with llama.hooks([steer.to_spec()], record=["blocks.1.hook_resid_pre"]) as recorder:
        assert torch.equal(llama.forward(IDS), steered)
    assert torch.equal(llama.forward(IDS), plain)
    assert recorder.activations()["blocks.1.hook_resid_pre"].shape == (len(IDS), llama.config.d_model)


def test_a_patch_in_a_hooks_context_runs_its_donor_clean(llama):
    patch = hooks.Patch("blocks.1.hook_resid_pre", positions=[2], donor=[9, 9, 9])
    expected = llama.forward(IDS, interventions=[patch])
    with llama.hooks([patch]):  # the donor run must not apply (and recurse into) the block's own patch
        assert torch.equal(llama.forward(IDS), expected)


def test_two_threads_never_see_each_others_hooks(llama):
    steer = hooks.Steer("blocks.0.hook_resid_post", 3 * torch.ones(llama.config.d_model))
    ablate = hooks.ZeroAblate("blocks.1.attn.hook_z", heads=[0])
    expected = {"context": llama.forward(IDS, interventions=[steer]), "call": llama.forward(IDS, interventions=[ablate]),
                "plain": llama.forward(IDS)}
    barrier = threading.Barrier(3)
    results = {key: [] for key in expected}
    errors = []

    def worker(key):
        try:
            if key == "context":
                with llama.hooks([steer]):
                    barrier.wait()
                    results[key] += [llama.forward(IDS) for _ in range(30)]
            else:
                barrier.wait()
                interventions = [ablate] if key == "call" else []
                results[key] += [llama.forward(IDS, interventions=interventions) for _ in range(30)]
        except Exception as err:  # surfaced below: an assertion in a thread would be lost
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(key,)) for key in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for key, logits in results.items():
        assert len(logits) == 30 and all(torch.equal(x, expected[key]) for x in logits), key


def test_nothing_stays_attached_after_an_exception_in_a_hook(llama):
    plain = llama.forward(IDS)

    def boom(x, ctx):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        llama.forward(IDS, interventions=[("blocks.1.hook_resid_pre", boom)])
    with pytest.raises(RuntimeError, match="boom"):
        with llama.hooks([hooks.Steer("blocks.0.hook_resid_post", torch.ones(llama.config.d_model))]):
            llama.run(IDS, interventions=[("blocks.0.mlp.hook_post", boom)])
    assert torch.equal(llama.forward(IDS), plain)

    cache = llama.new_cache()
    llama.forward(IDS[:4], cache=cache)
    with pytest.raises(RuntimeError, match="boom"):
        llama.forward(IDS[4:], cache=cache, interventions=[("blocks.1.hook_resid_post", boom)])
    assert cache.length == 4  # the failed forward left nothing in the cache
    continued = llama.forward(IDS[4:], cache=cache)
    fresh = llama.new_cache()
    llama.forward(IDS[:4], cache=fresh)
    assert torch.equal(continued, llama.forward(IDS[4:], cache=fresh))


def test_in_place_edit_of_hook_result_counts(llama):
    """TransformerLens-style in-place edits (``x[:, h] = 0``) on the per-head results are not lost."""
    ids = [3, 14, 15, 92, 65]

    def zero_head_in_place(x, ctx):
        x[:, 1] = 0

    in_place = llama.run(ids, interventions=[("blocks.1.attn.hook_result", zero_head_in_place)]).logits
    ablated = llama.run(ids, interventions=[hooks.ZeroAblate("blocks.1.attn.hook_z", heads=[1])]).logits
    assert not torch.equal(in_place, llama.run(ids).logits)
    assert torch.allclose(in_place, ablated, atol=1e-4)


def test_stream_validates_when_called_not_when_iterated(llama):
    with pytest.raises(workbench.HookError, match="unknown hook point"):
        llama.stream([1, 2, 3], 4, interventions=[hooks.ZeroAblate("blocks.1.hook_nothing")])


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])  # causal; soft-capped with a window; a window
def test_score_edits_leave_blocked_entries_blocked(tiny_model, arch):
    model = tiny_model(arch, n_layers=2, seed=3, device="cpu")
    ids = IDS + [8, 3]  # longer than the window (4) of the sliding layers
    scores = "blocks.*.attn.hook_attn_scores"

    def uniform(x, ctx):  # every entry a token may attend to set to 0, blocked ones left -inf
        return x.masked_fill(x != float("-inf"), 0.0)

    expected = model.run(ids, interventions=[(scores, uniform)]).logits
    for edit in (hooks.Scale(scores, 0.0), hooks.ZeroAblate(scores)):
        logits = model.run(ids, interventions=[edit]).logits
        assert torch.equal(logits, expected)  # finite, and no token reads a later one
        # a shorter prompt's tokens get what they get as the start of the longer one, alone and in a padded batch
        shorter = model.run(ids[:3], interventions=[edit]).logits
        torch.testing.assert_close(shorter, logits[:3], rtol=0, atol=1e-5)
        for row, alone in zip(model.run_batch([ids, ids[:3]], interventions=[edit]), (logits, shorter)):
            torch.testing.assert_close(row.logits, alone, rtol=0, atol=2e-4)
        assert model.generate(ids, 4, interventions=[edit]) == model.generate(ids, 4, interventions=[(scores, uniform)])
    # an edit of some heads and positions keeps its selection and the mask
    some = model.run(ids, interventions=[hooks.Scale(scores, 0.0, heads=[1], positions=[0, -1])],
                     record=["blocks.0.attn.hook_attn_scores"]).activations["blocks.0.attn.hook_attn_scores"]
    clean = model.run(ids, record=["blocks.0.attn.hook_attn_scores"]).activations["blocks.0.attn.hook_attn_scores"]
    blocked = clean == float("-inf")
    assert torch.equal(some == float("-inf"), blocked)
    changed = (some != clean) & ~blocked
    assert changed[1, [0, -1]].equal(~blocked[1, [0, -1]])
    assert not changed[[0, 2, 3]].any() and not changed[1, 1:-1].any()
