"""Building blocks of the forward, checked against their definitions."""
from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from workbench import hooks
from workbench.kernels import layer_ops, tracing


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # adjacent pairs / the two halves of each head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_each_pair_by_its_angle(device, architecture, dtype, tiny_model):
    runner = tiny_model(architecture, "F32", n_layers=1, n_ctx=64, device=device, dtype=dtype).runner
    d_head, half = runner.config.d_head, runner.config.d_head // 2
    positions = torch.tensor([0, 5, 63], device=device)
    x = torch.randn(3, 4, d_head, generator=torch.Generator().manual_seed(0)).to(device, dtype)

    # (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) in float32, rounded once: the bits the forward promises
    xf = x.float()
    first, second = (slice(0, None, 2), slice(1, None, 2)) if runner.config.rope_interleaved else (
        slice(0, half), slice(half, None))
    x0, x1 = xf[..., first], xf[..., second]
    cos, sin = runner.rope_cos[positions][:, None, :], runner.rope_sin[positions][:, None, :]
    expected = torch.empty_like(xf)
    expected[..., first], expected[..., second] = x0 * cos - x1 * sin, x0 * sin + x1 * cos

    rotated = runner.rope(x, runner.rotation(positions))
    assert rotated.dtype == dtype
    assert torch.equal(rotated, expected.to(dtype))
    assert not torch.equal(rotated[1:], x[1:])  # positions past 0 do rotate


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 4096), (2, 3, 96)])  # a decode row, prefill rows, a stack of them
def test_rms_norm_matches_its_definition(device, dtype, shape):
    """The scale is 1 / sqrt(mean(x^2) + eps) to float32 rounding (then rounded to the dtype), and the output is
    (x * scale) * weight rounded product by product, as the hooked forward recomputes it from the scale."""
    generator = torch.Generator().manual_seed(len(shape))
    x = (3 * torch.randn(shape, generator=generator)).to(device, dtype)
    weight = torch.randn(shape[-1], generator=generator).to(device, dtype)
    eps = 1e-5
    scale, out = layer_ops.rms_norm(x, weight, eps)
    assert scale.shape == (*shape[:-1], 1) and scale.dtype == dtype and out.shape == shape and out.dtype == dtype

    expected = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    tolerance = 2.0**-21 if dtype == torch.float32 else 2.0**-8  # a few float32 roundings; one bfloat16 rounding
    assert ((scale.double() - expected).abs() / expected).max() <= tolerance
    assert torch.equal(out, x * scale * weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_sum_then_the_norm(device, dtype):
    """The residual sum and the norm after it in one call give what ``x + delta`` then ``rms_norm`` give, bit for bit
    (the forward takes either, depending on the hooks between them), on the Triton kernel and the torch formulas."""
    generator = torch.Generator().manual_seed(11)
    for rows, d in [(1, 576), (7, 4096), (3, 40)]:
        x, delta = ((3 * torch.randn(rows, d, generator=generator)).to(device, dtype) for _ in range(2))
        weight = torch.randn(d, generator=generator).to(device, dtype)
        for formulas in (False, True):
            with layer_ops.torch_formulas() if formulas else contextlib.nullcontext():
                total, scale, out = layer_ops.add_rms_norm(x, delta, weight, 1e-5)
                expected_scale, expected = layer_ops.rms_norm(x + delta, weight, 1e-5)
            assert torch.equal(total, x + delta) and total.dtype == dtype, (rows, d, formulas)
            assert torch.equal(scale, expected_scale) and torch.equal(out, expected), (rows, d, formulas)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_is_silu_times_up(device, dtype):
    """SwiGLU on the two halves of a fused gate/up output (rows strided past their width; a width of whole vectors and
    one with a tail), against the torch formula: the same bits, but float32 on CUDA to an ulp of its exp."""
    for width in (1536, 1000):
        gate_up = (4 * torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(12))).to(device, dtype)
        gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # silu's ends and zeros
        gate, up = gate_up.split(width, dim=-1)
        out = layer_ops.swiglu(gate, up)
        expected = torch.nn.functional.silu(gate) * up
        assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
        if dtype == torch.float32 and device == "cuda":
            torch.testing.assert_close(out, expected, rtol=2**-22, atol=0)
        else:
            assert torch.equal(out, expected), width


def test_cpu_layer_ops_refuse_bad_shapes():
    """The C++ ops check what they are given; the forward never hands them these."""
    from workbench.kernels import cpu
    ext = cpu.extension()
    if ext is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    with pytest.raises(RuntimeError, match="rms_norm weight has 5 values for rows of 4"):
        ext.rms_norm(torch.randn(2, 4), torch.randn(5), 1e-5)
    with pytest.raises(RuntimeError, match="rope needs x"):
        ext.rope(torch.randn(1, 2, 8), torch.randn(1, 1, 6), torch.randn(1, 1, 6), False)
    with pytest.raises(RuntimeError, match="contiguous 3-D float32"):
        ext.rope(torch.randn(1, 2, 8).double(), torch.randn(1, 1, 8), torch.randn(1, 1, 8), False)
    with pytest.raises(RuntimeError, match="add_rms_norm adds"):
        ext.add_rms_norm(torch.randn(2, 4), torch.randn(1, 4), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="swiglu needs"):
        ext.swiglu(torch.randn(2, 4), torch.randn(2, 5))
    cos = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="KV dividing H"):  # 4 query heads, 3 key heads
        ext.rope_attention(torch.randn(1, 32), torch.randn(1, 24), torch.randn(1, 24), cos, cos, False, None, None, [0],
                           1.0, None)
    with pytest.raises(RuntimeError, match="have no slots 4 to 5"):  # a cache of 4 slots, full
        ext.rope_attention(torch.randn(1, 32), torch.randn(1, 16), torch.randn(1, 16), cos, cos, False,
                           torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), [4], 1.0, None)
    with pytest.raises(RuntimeError, match="takes q and k's norms together"):
        ext.rope_attention(torch.randn(1, 32), torch.randn(1, 16), torch.randn(1, 16), cos, cos, False, None, None, [0],
                           1.0, None, torch.ones(8), None, 1e-5)
    x, norm = torch.randn(1, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="blocks_exact takes wq, wk, wv, wo, w_gate, w_up and w_down for each of 1"):
        ext.blocks_exact(x, x, [], [], [], [], [], [], [norm], 1e-5, [cos], [cos], False, [], [], [0], 1.0, [None], [],
                         24)
    with pytest.raises(RuntimeError, match="and the first norms of all but the first"):  # two blocks, one cos
        ext.blocks_exact(x, x, [torch.zeros(1, 1, dtype=torch.uint8)] * 14, [8] * 14, [8] * 14, [], [], [norm],
                         [norm, norm], 1e-5, [cos], [cos], False, [], [], [0], 1.0, [None, None], [], 24)
    with pytest.raises(RuntimeError, match="takes one start without a batch"):
        ext.rope_attention(torch.randn(1, 32), torch.randn(1, 16), torch.randn(1, 16), cos, cos, False, None, None,
                           [0, 0], 1.0, None)
    # a batch of two sequences of 1 and 17 tokens (and three with decreasing bounds)
    q, kv, cos18 = torch.randn(18, 32), torch.randn(18, 16), torch.randn(18, 1, 8)
    buffers, mask = torch.zeros(2, 2, 24, 8), torch.zeros(2, 1, 17, 17, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="bounds must not decrease"):
        ext.rope_attention(q, kv, kv, cos18, cos18, False, buffers, buffers, [0, 0, 0], 1.0, mask,
                           bounds=[0, 17, 1, 18])
    with pytest.raises(RuntimeError, match="batch needs a mask"):
        ext.rope_attention(q, kv, kv, cos18, cos18, False, buffers, buffers, [0, 0], 1.0, None, bounds=[0, 1, 18])
    with pytest.raises(RuntimeError, match="sequence 1 has no slots 20 to 22 of 21"):  # a cache row's start too late
        ext.rope_attention(q[:3], kv[:3], kv[:3], cos18[:3], cos18[:3], False, buffers, buffers, [0, 20], 1.0,
                           torch.zeros(2, 1, 2, 21, dtype=torch.bool), bounds=[0, 1, 3])


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("tokens, cached", [(1, 0), (1, 5), (3, 0), (3, 5)])  # decode / prefill, with a cache or not
def test_rope_attention_is_the_rope_the_cache_write_and_attention(interleaved, tokens, cached, monkeypatch):
    """The one C++ call an eager CPU forward takes where no hook lies inside attention gives the bits of the separate
    ops (their torch formulas here): the rope of q and k, the cache's write and attention's scores, softmax and sum."""
    from workbench.kernels import cpu
    from workbench.kv_cache import causal_mask
    if cpu.extension() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    generator = torch.Generator().manual_seed(10 * tokens + cached)
    heads, kv_heads, d, capacity = 4, 2, 16, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=generator)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # rows strided, as the projections give them
    cos, sin = (torch.randn(tokens, 1, d, generator=generator) for _ in range(2))
    key_buffer, value_buffer = (torch.randn(kv_heads, capacity, d, generator=generator) for _ in range(2))
    blocked = causal_mask(tokens, cached + tokens, "cpu")
    with layer_ops.torch_formulas():
        q_rot = layer_ops.rope(q.view(tokens, heads, d), cos, sin, interleaved)
        k_rot = layer_ops.rope(k.view(tokens, kv_heads, d), cos, sin, interleaved)
        keys, values = k_rot.transpose(0, 1), v.view(tokens, kv_heads, d).transpose(0, 1)
        if cached:  # KVCache.write
            expected_keys, expected_values = key_buffer.clone(), value_buffer.clone()
            expected_keys[:, cached:cached + tokens], expected_values[:, cached:cached + tokens] = keys, values
            keys, values = expected_keys[:, :cached + tokens], expected_values[:, :cached + tokens]
        expected = layer_ops.attend(layer_ops.attention_scores(q_rot, keys, 4.0, blocked).softmax(-1), values)
    slots = (key_buffer, value_buffer, cached) if cached else None
    z = layer_ops.rope_attention(q, k, v, heads, cos, sin, interleaved, slots, 4.0, blocked)
    assert z.shape == (tokens, heads, d) and torch.equal(z, expected)
    if cached:
        assert torch.equal(key_buffer, expected_keys) and torch.equal(value_buffer, expected_values)
    # partial rotary, or scores past the budget: the separate ops' turn
    assert layer_ops.rope_attention(q, k, v, heads, cos[..., :8], sin[..., :8], interleaved, None, 4.0, blocked) is None
    monkeypatch.setattr(layer_ops, "SCORES_BUDGET", 4 * heads * tokens * (cached + tokens) - 1)
    assert layer_ops.rope_attention(q, k, v, heads, cos, sin, interleaved, slots, 4.0, blocked) is None


# the families whose blocks the C++ calls take whole: llama's (with a sliding window too), Qwen2's biases, Qwen3's norms
PLAIN_FAMILIES = pytest.mark.parametrize(
    "family", [dict(arch="llama"), dict(arch="llama", sliding_window=4), dict(arch="qwen2"), dict(arch="qwen3")],
    ids=["llama", "sliding-window", "qwen2", "qwen3"])


def fused_calls_keep_every_bit(monkeypatch, runner, inside: str, run) -> list[tuple[list[int], int]]:
    """``run(hooks)``, which gives its logits and its cache's tensors, without hooks, with a hook inside every layer's
    MLP and with one at ``attn.<inside>`` of every layer: asserts the three give the same bits, and returns for each
    the blocks of every call of ``layer_ops.blocks_exact`` that ran and how many calls of ``rope_attention`` ran."""
    blocks, attentions = [], []

    def counted(calls, op, size):
        def call(*args):
            out = op(*args)
            if out is not None:
                calls.append(size(args))
            return out
        return call
    monkeypatch.setattr(layer_ops, "blocks_exact", counted(blocks, layer_ops.blocks_exact, lambda a: len(a[2])))
    monkeypatch.setattr(layer_ops, "rope_attention", counted(attentions, layer_ops.rope_attention, lambda a: 1))
    layers = range(runner.config.n_layers)
    in_mlp = {f"blocks.{i}.mlp.hook_post": [lambda x, ctx: None] for i in layers}
    in_attention = {f"blocks.{i}.attn.{inside}": [lambda x, ctx: None] for i in layers}
    results, calls = [], []
    for hooked in (None, in_mlp, in_attention):
        blocks.clear(), attentions.clear()
        results.append(run(hooked))
        calls.append((list(blocks), len(attentions)))
    (plain, plain_cache), *others = results
    for logits, cache in others:
        assert all(torch.equal(a, b) for a, b in zip(plain, logits))
        assert all(torch.equal(a, b) for layer, other in zip(plain_cache, cache) for a, b in zip(layer, other))
    return calls


@PLAIN_FAMILIES
def test_decode_steps_without_hooks_inside_attention_keep_every_bit(family, tiny_model, monkeypatch):
    """A prompt and decode steps on a cache without hooks (the blocks in one C++ call, Qwen2's biases and Qwen3's q/k
    norms included), with a hook inside every layer's MLP only (attention in one C++ call, q/k norms included) and
    with a hook inside every layer's attention (the separate ops): the same logits and the same cache, bit for bit."""
    model = tiny_model(**family, fmt="Q8_0", n_layers=2, device="cpu")
    runner, ids = model.runner, [3, 14, 15, 92, 65, 35]
    n_layers = runner.config.n_layers

    def run(hooks):
        cache = runner.new_cache(4)  # grown on the way
        logits = [runner.forward(torch.tensor(ids), cache=cache, hooks=hooks)]
        logits += [runner.forward(torch.tensor([t]), cache=cache, hooks=hooks, step=s) for s, t in enumerate(ids, 1)]
        return logits, [cache.get(i) for i in range(n_layers)]
    calls = fused_calls_keep_every_bit(monkeypatch, runner, "hook_rot_k", run)
    # without hooks each forward's blocks whole in one call; with a hook in each MLP each attention in one call
    assert calls == [([n_layers] * 7, 0), ([], 7 * n_layers), ([], 0)]


@PLAIN_FAMILIES
@pytest.mark.parametrize("longest", [8, 17])
def test_batch_decode_steps_without_hooks_inside_attention_keep_every_bit(family, longest, tiny_model, monkeypatch):
    """A batch of prompts of three lengths without a cache, and on a batch cache followed by decode steps, each row at
    its own length: without hooks (each forward's blocks in one C++ call), with a hook inside every MLP (each attention
    in one C++ call) and with a hook inside every attention (the separate ops over the padded sequences): the same
    logits and the same cache rows, bit for bit."""
    from workbench.runner import BatchLayout
    model = tiny_model(**family, fmt="Q8_0", n_layers=2, device="cpu")
    runner = model.runner
    n_layers = runner.config.n_layers
    prompts = [[3, 14, 15, 92, 65], [35, 89], [(7 * j) % 90 + 3 for j in range(longest)]]

    def run(hooks):
        cache = runner.new_batch_cache(len(prompts), 4)  # grown on the way
        layout, packed = BatchLayout([len(p) for p in prompts], "cpu"), torch.tensor([t for p in prompts for t in p])
        logits = [runner.forward(packed, hooks=hooks, layout=layout)]
        logits.append(runner.forward(packed, cache=cache, hooks=hooks, layout=layout))
        for step in range(1, 4):
            layout = BatchLayout([1] * len(prompts), "cpu", cached=cache.lengths)
            tokens = torch.tensor([p[step % len(p)] for p in prompts])
            logits.append(runner.forward(tokens, cache=cache, hooks=hooks, step=step, layout=layout))
        return logits, [cache.row(b).get(i) for b in range(len(prompts)) for i in range(n_layers)]
    calls = fused_calls_keep_every_bit(monkeypatch, runner, "hook_pattern", run)
    assert calls == [([n_layers] * 5, 0), ([], 5 * n_layers), ([], 0)]


def test_whole_blocks_run_where_no_hook_lies_inside_them(tiny_model, monkeypatch):
    """Consecutive blocks with no hook inside them nor between them run as one call; hooks on the edges of a block (its
    input stream, first norm and output stream) keep it whole but end the run there; a hook inside a block runs that
    block alone step by step; either way the logits keep every bit, and an edit inside reaches them. The glue as torch
    formulas runs no C++ block."""
    model = tiny_model("llama", "Q8_0", n_layers=3, device="cpu")
    ids = [3, 14, 15, 92, 65]
    runs = []  # per call of layer_ops.blocks_exact: its number of blocks, or 0 where it did not run
    blocks_exact = layer_ops.blocks_exact

    def counted(*args):
        out = blocks_exact(*args)
        runs.append(len(args[2]) if out is not None else 0)
        return out

    monkeypatch.setattr(layer_ops, "blocks_exact", counted)

    def whole_runs(run) -> list[int]:
        runs.clear()
        run()
        return list(runs)

    plain = model.forward(ids)
    edges = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", "blocks.*.ln1.hook_normalized"]
    assert whole_runs(lambda: model.forward(ids)) == [3]
    recorded = []
    assert whole_runs(lambda: recorded.append(model.run(ids, record=edges).logits)) == [1, 1, 1]
    assert whole_runs(lambda: recorded.append(model.run(ids, record=["blocks.0.hook_resid_post"]).logits)) == [1, 2]
    assert whole_runs(lambda: recorded.append(model.run(ids, record=["blocks.1.ln1.hook_scale"]).logits)) == [1, 2]
    assert whole_runs(lambda: recorded.append(model.run(ids, record=["blocks.1.hook_mlp_out"]).logits)) == [1, 1]
    assert whole_runs(lambda: recorded.append(model.run(ids, record=["blocks.2.hook_resid_post"]).logits)) == [3]
    assert all(torch.equal(logits, plain) for logits in recorded)
    edited = []
    assert whole_runs(lambda: edited.append(model.forward(ids, interventions=[
        hooks.ZeroAblate("blocks.1.mlp.hook_post")]))) == [1, 1]
    assert not torch.equal(edited[0], plain)
    with layer_ops.torch_formulas():  # not even tried
        assert whole_runs(lambda: model.forward(ids)) == []
    # a rope over part of each head (Phi-3) takes the separate calls, and the forward tries no other run
    partial = tiny_model("llama", "Q8_0", n_layers=2, device="cpu", partial_rotary=0.5)
    assert whole_runs(lambda: partial.forward(ids)) == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_norm_hooks_change_no_bit_and_edits_reach_the_output(dtype, tiny_model):
    """On CUDA the norms run as one Triton kernel and the hooked path multiplies in torch: recording every point
    leaves the logits as they are, and halving a scale (the divisor) equals doubling its normalized input, up to the
    rounding of the divisor's reciprocal in the model's dtype."""
    model = tiny_model("llama", "Q8_0", seed=3, n_layers=2, device="cuda", dtype=dtype)
    ids = [5, 17, 42, 99, 7]
    plain = model.run(ids).logits
    assert torch.equal(model.run(ids, record=["*"]).logits, plain)

    def double(x, ctx):
        return 2 * x

    def halve(x, ctx):
        return x / 2

    by_scale = model.forward(ids, interventions=[("blocks.1.ln1.hook_scale", halve)])  # the divisor
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(by_scale, model.forward(ids, interventions=[("blocks.1.ln1.hook_normalized", double)]),
                               rtol=tolerance, atol=tolerance)
    assert not torch.equal(by_scale, model.forward(ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_info_names_the_triton_glue(tiny_model):
    model = tiny_model("llama", "Q8_0", n_layers=1, device="cuda", dtype=torch.bfloat16)
    assert model.info()["layer_ops"] == {
        **{op: "triton" for op in ("rms_norm", "add_rms_norm", "rope", "attention_scores", "attend", "swiglu")},
        "rope_attention": "separate ops", "blocks_exact": "separate ops", "packed_attention": "triton"}


def test_torch_formulas_switch_the_glue_and_agree_with_it(tiny_model):
    """``layer_ops.torch_formulas()`` runs the glue as its torch formulas (for comparisons and bench/eager_forward.py),
    which agree with the C++ ops to float32 rounding, and the switch is undone on leaving."""
    from workbench.kernels import cpu
    model = tiny_model("llama", "Q8_0", seed=3, n_layers=2, device="cpu")
    ids = [5, 17, 42, 99]
    own = model.forward(ids)
    with layer_ops.torch_formulas():
        assert layer_ops.implementations(model.device, model.dtype) == {
            "rms_norm": "torch", "add_rms_norm": "torch add + torch", "rope": "torch", "attention_scores": "torch-bmm",
            "attend": "torch-bmm", "swiglu": "torch", "rope_attention": "separate ops", "blocks_exact": "separate ops",
            "packed_attention": "padded ops"}
        formulas = model.forward(ids)
    expected_norm = "cpu-cxx" if cpu.extension() is not None else "torch"
    assert layer_ops.implementations(model.device, model.dtype)["rms_norm"] == expected_norm
    torch.testing.assert_close(formulas, own, rtol=1e-5, atol=1e-5)


def _attention_rows(monkeypatch) -> list[int]:
    """The query rows of every ``attention_scores`` call from here on."""
    rows, scores = [], layer_ops.attention_scores
    monkeypatch.setattr(layer_ops, "attention_scores", lambda q, *a: rows.append(q.shape[-3]) or scores(q, *a))
    return rows


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # grouped-query heads / as many kv heads as heads
def test_long_prompts_take_fused_attention_within_rounding_on_the_cpu(architecture, tiny_model, monkeypatch):
    model = tiny_model(architecture, "Q8_0", n_ctx=256, device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = model.forward(ids)
    cache = model.new_cache()
    model.forward(ids[:50], cache=cache)
    continued_whole = model.forward(ids[50:], cache=cache)
    batch_whole = model.forward_batch([ids, ids[:120]], batch_size=2)
    rows = _attention_rows(monkeypatch)
    calls = _sdpa_calls(monkeypatch)
    monkeypatch.setattr(layer_ops, "SCORES_BUDGET", 4 * model.config.n_heads * 150 * 40)  # 40 query rows of scores
    fused = model.forward(ids)
    assert not rows and calls and all(causal for causal, _ in calls)  # one SDPA call a layer, the causal kernel
    _within_float32_rounding(fused, whole)
    # a hook on the pattern sees the whole matrix (its layer materializes it, the others stay fused)
    trace = model.run(ids, record=["blocks.0.attn.hook_pattern"])
    assert trace.activations["blocks.0.attn.hook_pattern"].shape[-2:] == (150, 150)
    _within_float32_rounding(trace.logits, whole)
    # continuing a cache (a mask below the diagonal's corner) and a batch of prompts of different lengths
    calls.clear()
    cache = model.new_cache()
    model.forward(ids[:50], cache=cache)
    _within_float32_rounding(model.forward(ids[50:], cache=cache), continued_whole)
    assert any(masked for _, masked in calls)
    for fused_row, whole_row in zip(model.forward_batch([ids, ids[:120]], batch_size=2), batch_whole):
        _within_float32_rounding(fused_row, whole_row)


def _within_float32_rounding(fused: torch.Tensor, whole: torch.Tensor) -> None:
    assert (fused - whole).abs().max().item() < 1e-5 * whole.abs().max().item()
    assert torch.equal(fused.argmax(-1), whole.argmax(-1))


def _sdpa_calls(monkeypatch) -> list[tuple[bool, bool]]:
    """(is_causal, with a mask) of every SDPA call from here on."""
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, is_causal=False, attn_mask=None, **kw: (
        calls.append((is_causal, attn_mask is not None)) or sdpa(*a, is_causal=is_causal, attn_mask=attn_mask, **kw)))
    return calls


def test_the_causal_mask_is_recognized_and_nothing_else():
    torch.manual_seed(0)
    q, keys, values = torch.randn(40, 4, 16), torch.randn(2, 40, 16), torch.randn(2, 40, 16)
    causal = torch.ones(40, 40, dtype=torch.bool).triu(1)
    almost = causal.clone()
    almost[30, 5] = True
    assert layer_ops._causal(causal) and layer_ops._causal(causal)  # the second answer from the memo
    assert not layer_ops._causal(almost) and not layer_ops._causal(causal[:, :39])
    for mask in (causal, almost):
        expected = layer_ops.attend(layer_ops.attention_scores(q, keys, 4.0, mask).softmax(-1), values)
        assert (layer_ops._sdpa(q, keys, values, 4.0, mask) - expected).abs().max().item() < 1e-5


def test_fused_attention_expands_grouped_keys_under_a_mask(monkeypatch):
    """SDPA gets a batch axis and grouped keys expanded (its fused kernels take no 3-D inputs, and the memory-efficient
    one no key groups: the fallback would hold every score); query head h still reads key head h // group."""
    torch.manual_seed(0)
    q, keys, values = torch.randn(37, 8, 16), torch.randn(2, 37, 16), torch.randn(2, 37, 16)
    blocked = torch.ones(37, 37, dtype=torch.bool).triu(1)
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, *a, **kw: seen.append(k.shape) or sdpa(q, k, *a, **kw))
    z = layer_ops._sdpa(q, keys, values, 4.0, blocked)
    assert seen == [torch.Size([1, 8, 37, 16])]  # batched and expanded: both are what the fused kernels take
    expected = layer_ops.attend(layer_ops.attention_scores(q, keys, 4.0, blocked).softmax(-1), values)
    assert (z - expected).abs().max().item() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_attention_takes_a_fused_kernel(masked):
    """With SDPA's math kernel switched off, a grouped one-prompt attention still runs: it never holds the scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, keys, values = torch.randn(300, 8, 64, device="cuda"), torch.randn(2, 300, 64, device="cuda"), torch.randn(2, 300, 64, device="cuda")
    blocked = torch.ones(300, 300, dtype=torch.bool, device="cuda").triu(1) if masked else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        z = layer_ops._sdpa(q, keys, values, 8.0, blocked)
    expected = layer_ops.attend(layer_ops.attention_scores(q, keys, 8.0, blocked).softmax(-1), values)
    assert (z - expected).abs().max().item() < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_long_prompts_take_fused_attention_within_rounding(dtype, tiny_model, monkeypatch):
    model = tiny_model("llama", "Q8_0", n_ctx=256, device="cuda", dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = model.forward(ids)
    rows = _attention_rows(monkeypatch)
    monkeypatch.setattr(layer_ops, "SCORES_BUDGET", 4 * model.config.n_heads * 150 * 40)
    fused = model.forward(ids)
    assert not rows  # one SDPA call a layer
    bound = 1e-4 if dtype == torch.float32 else 0.1
    assert (fused - whole).abs().max().item() < bound * whole.abs().max().item()
    assert torch.equal(fused.argmax(-1), whole.argmax(-1)) or dtype == torch.bfloat16


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_forward_started_at_a_block_from_its_residual_stream_is_the_rest_of_the_whole_forward(architecture,
                                                                                                 tiny_model):
    import workbench

    runner = tiny_model(architecture, n_layers=3, seed=2).runner
    ids = torch.tensor([5, 17, 42, 99, 7])
    resid = {}
    keep = [lambda x, ctx: resid.setdefault(ctx.layer, x.clone())]
    whole = runner.forward(ids, hooks={f"blocks.{i}.hook_resid_pre": keep for i in range(3)})
    assert torch.equal(whole, runner.forward(ids))  # the recording changed no bit
    for layer in range(3):
        embedded = []
        hooks = {"hook_embed": [lambda x, ctx: embedded.append(1)]}
        assert torch.equal(runner.forward(ids, hooks=hooks, start_at_layer=layer, resid=resid[layer]), whole)
        assert embedded == []  # nothing before the block ran
    # stopped before a block: the stream entering it, from which a later forward goes on
    for start, stop in [(0, 1), (0, 2), (1, 2)]:
        stream = runner.forward(ids, start_at_layer=start, resid=resid[start] if start else None, stop_at_layer=stop)
        assert torch.equal(stream, resid[stop])
    assert torch.equal(runner.forward(ids, start_at_layer=2, resid=runner.forward(ids, stop_at_layer=2)), whole)
    # stopped after the last block: the stream the final norm would take, as TransformerLens' stop_at_layer gives it
    last = {}
    runner.forward(ids, hooks={"blocks.2.hook_resid_post": [lambda x, ctx: last.setdefault(0, x.clone())]})
    assert torch.equal(runner.forward(ids, stop_at_layer=3), last[0])
    # the logits of a few vocabulary ids alone: those columns of the whole unembedding
    chosen = torch.tensor([7, 3, 40])
    torch.testing.assert_close(runner.forward(ids, logit_ids=chosen), whole[:, chosen], atol=1e-5, rtol=0)
    for kwargs, message in [(dict(start_at_layer=3, resid=resid[1]), "cannot start at layer 3"),
                            (dict(start_at_layer=1), "takes the residual stream"),
                            (dict(start_at_layer=1, resid=resid[1][1:]), r"\[5, 64\] entering it, got \(4, 64\)"),
                            (dict(start_at_layer=1, resid=resid[1], stop_at_layer=1), "stops at a layer after"),
                            (dict(stop_at_layer=4), "at most 3, not 4")]:
        with pytest.raises(workbench.WorkbenchError, match=message):
            runner.forward(ids, **kwargs)


def test_the_constant_result_mark_is_torch_compilers():
    def probe() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked) == {tracing.CONSTANT_RESULT_MARK: True}
    assert getattr(tracing._tracing_in_this_thread, tracing.CONSTANT_RESULT_MARK) is True


def test_imports_leave_the_slow_modules_for_first_use():
    # torch._dynamo and scikit-learn take about a second each to import: a command that compiles nothing and fits no
    # probe should not pay for them (the CLI, an MCP server's start, ``from workbench import probes``)
    code = "import sys, workbench, workbench.probes; print([m in sys.modules for m in ('torch._dynamo', 'sklearn')])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[False, False]"
