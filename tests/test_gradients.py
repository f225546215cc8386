"""Gradients of a metric with respect to any hook point (``Model.run_with_gradients``): against TransformerLens'
bridge at every point of every family, against transformers on a quantized GGUF (the matmuls' input gradients with
the weights the kernels multiply), and the forward of a gradient run bit-identical to the production forward."""
from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

import workbench
from workbench.errors import HookError, WorkbenchError
from workbench.kernels import QuantTensor, linear, numerics
from workbench.synthetic import random_checkpoint, random_config, random_hf_checkpoint, write_gguf

from test_loading import write_hf_tokenizer
from test_transformerlens_hooks import IDS, NOT_IN_BRIDGE, NOT_IN_BRIDGE_OF, as_ours, pair  # noqa: F401 (fixture)

# an op without a backward that autograd passes through drops its inputs' gradients: torch only warns
pytestmark = pytest.mark.filterwarnings("error:.*an autograd kernel was not registered:UserWarning")


def next_token_log_likelihood(ids):
    """Every position's log-probability of the next prompt token: a metric that reads all positions."""
    targets = torch.tensor(ids[1:])

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:-1].log_softmax(-1).gather(1, targets[:, None]).sum()

    return metric


def bridge_gradients(bridge, names: list[str], metric) -> tuple[float, dict[str, torch.Tensor]]:
    """The bridge's gradients at ``names``, found the same way in its own forward: a zero autograd tracks added at
    each hook."""
    zeros = {}

    def tap(name):
        def add_zero(x, hook):
            zeros[name] = torch.zeros_like(x, requires_grad=True)
            return x + zeros[name]

        return add_zero

    with torch.enable_grad():
        logits = bridge.run_with_hooks(torch.tensor([IDS]), fwd_hooks=[(name, tap(name)) for name in names])[0]
        value = metric(logits)
        found = torch.autograd.grad(value, [zeros[n] for n in names], allow_unused=True)
    return value.item(), {n: torch.zeros_like(zeros[n]) if g is None else g for n, g in zip(names, found)}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"])
def test_every_hook_points_gradient_matches_transformerlens(family, pair):
    ours, bridge = pair(family)
    metric = next_token_log_likelihood(IDS)
    skipped = NOT_IN_BRIDGE + NOT_IN_BRIDGE_OF.get(family, ())
    names = [n for n in ours.hook_points() if not n.endswith(skipped)]
    got = ours.run_with_gradients(IDS, metric, names)
    expected_value, expected = bridge_gradients(bridge, names, metric)
    assert got.metric == pytest.approx(expected_value, rel=1e-5)
    bad = []
    for name in names:
        theirs = as_ours(name, expected[name], family)
        if name.endswith("hook_resid_mid"):
            # the bridge's resid_mid feeds the second norm alone (the block's residual sum reads HF's own tensor);
            # TransformerLens' HookedTransformer, as ours, sums the hooked value: the gradient of that meaning adds
            # the one the sum passes on, resid_post's
            post = name.replace("resid_mid", "resid_post")
            theirs = theirs + as_ours(post, expected[post], family)
        ours_grad = got.gradients[name]
        if ours_grad.shape != theirs.shape:  # OLMo 2's q/k norms: heads apart in ours
            theirs = theirs.reshape(ours_grad.shape)
        if name.endswith("hook_attn_scores"):  # masked scores: no gradient in either
            ours_grad, theirs = ours_grad.nan_to_num(), theirs.nan_to_num()
        scale = theirs.abs().max().item()
        assert scale > 0, name  # every point's value reaches the metric
        error = (ours_grad - theirs).abs().max().item() / scale
        if error >= 1e-4:
            bad.append((name, error))
    assert not bad


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama in Q4_K (Q6_K and Q8_0 where llama.cpp's mix puts them) as a GGUF."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4km.gguf"
    config = random_config("llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_mlp=512)
    checkpoint = random_checkpoint(config, "Q4_K_M")
    return write_gguf(path, config, checkpoint.weights, checkpoint.metadata)


@pytest.fixture(scope="module")
def quantized(tiny_gguf):
    """Our model of the tiny GGUF, with transformers' model of the same file (gguf-py dequantizes it)."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                                  dtype=torch.float32).eval()
    return workbench.load(tiny_gguf, device="cpu"), reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-3), (torch.bfloat16, 0.1)])
def test_cuda_gradients_match_the_cpus(tiny_gguf, dtype, bound):
    """The Triton kernels' forward, bit for bit as without gradients, and their gradients those of the CPU's within the
    dtype's rounding (float32 products on the tensor cores round their inputs to TF32)."""
    metric = next_token_log_likelihood(IDS)
    names = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_z", "blocks.1.hook_mlp_out"]
    cpu = workbench.load(tiny_gguf, device="cpu").run_with_gradients(IDS, metric, names)
    model = workbench.load(tiny_gguf, device="cuda", dtype=dtype)
    got = model.run_with_gradients(IDS, metric, names)
    assert torch.equal(got.logits, model.forward(IDS).cpu())
    for name in names:
        error = (got.gradients[name] - cpu.gradients[name]).abs().max() / cpu.gradients[name].abs().max()
        assert error.item() < bound, name
    # batched: the padded attention and the packed rows' kernels (every row's gradients its run's alone)
    prompts = [IDS, IDS[:5], [9, 8, 7] + IDS]
    metrics = [next_token_log_likelihood(p) for p in prompts]
    batch = model.run_with_gradients_batch(prompts, metrics, names)
    for prompt, metric, row in zip(prompts, metrics, batch):
        alone = model.run_with_gradients(prompt, metric, names)
        for name in names:
            error = (row.gradients[name] - alone.gradients[name]).abs().max() / alone.gradients[name].abs().max()
            assert error.item() < bound, name


def layer_input_gradients(reference, metric) -> tuple[float, list[torch.Tensor]]:
    """transformers' gradients of ``metric`` at each decoder layer's input (a zero added by a pre-hook)."""
    zeros = []

    def tap(module, args, kwargs):
        zeros.append(torch.zeros_like(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                                      requires_grad=True))
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = kwargs["hidden_states"] + zeros[-1]
            return args, kwargs
        return (args[0] + zeros[-1], *args[1:]), kwargs

    handles = [layer.register_forward_pre_hook(tap, with_kwargs=True) for layer in reference.model.layers]
    try:
        value = metric(reference(torch.tensor([IDS])).logits[0])
        return value.item(), [grad[0] for grad in torch.autograd.grad(value, zeros)]
    finally:
        for handle in handles:
            handle.remove()


def assert_layer_input_gradients_match(ours, reference):
    metric = next_token_log_likelihood(IDS)
    value, expected = layer_input_gradients(reference, metric)
    names = [f"blocks.{i}.hook_resid_pre" for i in range(len(expected))]
    got = ours.run_with_gradients(IDS, metric, names)
    assert got.metric == pytest.approx(value, rel=1e-5)
    for name, theirs in zip(names, expected):
        error = (got.gradients[name] - theirs).abs().max() / theirs.abs().max()
        assert error.item() < 1e-4, name


def test_quantized_gradients_match_transformers_on_the_same_gguf(quantized):
    assert_layer_input_gradients_match(*quantized)


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe", "gpt-oss", "gemma4", "gemma4moe"])
def test_gradients_of_families_beyond_transformerlens_match_transformers(family, tmp_path):
    """Routers, experts, attention sinks, Gemma 4's scaled blocks: the gradient at every layer's input as transformers
    computes it on the same checkpoint."""
    pytest.importorskip("transformers")
    reference = random_hf_checkpoint(family, tmp_path, n_layers=2).float().eval()
    write_hf_tokenizer(tmp_path)
    assert_layer_input_gradients_match(workbench.load(tmp_path, device="cpu"), reference)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_K", "Q6_K", "Q8_0", "F16"])
def test_linear_input_gradient_multiplies_the_dequantized_weight(fmt):
    torch.manual_seed(0)
    w = QuantTensor.quantize(torch.randn(96, 256), fmt)
    x = torch.randn(5, 256, requires_grad=True)
    grad = torch.randn(5, 96)
    linear(x, w).backward(grad)
    blocks = w.data.numpy().view(np.uint8)
    dense = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[fmt])))
    expected = grad.double() @ dense.double().reshape(96, 256)
    assert (x.grad.double() - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
def test_a_gradient_runs_forward_is_the_production_forward(model, mode):
    """The C++ glue (llama.cpp's own in its numerics) computes a gradient run's forward as it computes a run's."""
    prompt = "The Eiffel Tower is in the city of"
    with numerics(mode):
        logits = model.forward(prompt)
        a, b = logits[-1].topk(2).indices.tolist()
        got = model.run_with_gradients(prompt, lambda x: x[-1, a] - x[-1, b],
                                       ["blocks.*.hook_resid_post", "blocks.*.ln2.hook_scale"])
        trace = model.run(prompt, record=["blocks.*.hook_resid_post", "blocks.*.ln2.hook_scale"])
    assert torch.equal(got.logits, logits)
    assert got.metric == float(logits[-1, a] - logits[-1, b])
    for name, value in trace.activations.items():
        assert torch.equal(got.activations[name], value), name
    assert all(g.abs().max() > 0 for g in got.gradients.values())


def test_gradients_follow_the_calls_interventions(model):
    """With a steer at layer 3, the gradient at layer 5 is the steered run's: the metric's change under a small
    push along it matches the gradient's prediction, and differs from the unsteered run's gradient."""
    ids = model.to_ids("The capital of France is")
    name = "blocks.5.hook_resid_post"
    torch.manual_seed(0)
    steer = {"type": "steer", "hook": "blocks.3.hook_resid_post", "vector": (8 * torch.randn(576)).tolist()}
    metric = lambda logits: logits[-1].log_softmax(-1)[ids[-1]]  # noqa: E731
    steered = model.run_with_gradients(ids, metric, [name], interventions=[steer])
    plain = model.run_with_gradients(ids, metric, [name])
    assert (steered.gradients[name] - plain.gradients[name]).abs().max() > 1e-3
    last = steered.gradients[name][-1]
    push = {"type": "steer", "hook": name, "vector": (last / last.norm()).tolist(), "scale": 0.05, "positions": [-1]}
    pushed = float(metric(model.forward(ids, interventions=[steer, push])))
    assert pushed - steered.metric == pytest.approx(0.05 * last.norm().item(), rel=0.05)


def test_bad_gradient_requests_are_refused(model):
    with pytest.raises(HookError, match="a Python number has no gradient"):
        model.run_with_gradients("Hello", lambda logits: float(logits[-1, 0]), ["blocks.0.hook_resid_pre"])
    with pytest.raises(HookError, match="metric's value is nan, not a finite number"):
        model.run_with_gradients("Hello", lambda logits: logits[-1, 0] * float("nan"), ["blocks.0.hook_resid_pre"])
    with pytest.raises(HookError, match="does not depend on the logits"):
        model.run_with_gradients("Hello", lambda logits: torch.tensor(1.0), ["blocks.0.hook_resid_pre"])
    with pytest.raises(WorkbenchError, match="out of range"):
        model.run_with_gradients("Hello", lambda logits: logits[-1, 0], ["blocks.99.hook_resid_pre"])
    with pytest.raises(WorkbenchError, match="metric must be a function"):
        model.run_with_gradients("Hello", 3, ["blocks.0.hook_resid_pre"])


CLEAN, CORRUPT = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"


@pytest.mark.parametrize("hook, over", [(None, ("layers", "positions")),
                                        ("blocks.{layer}.hook_mlp_out", ("layers", "positions")),
                                        (None, ("layers", "heads")), (None, ("layers", "positions", "heads"))])
def test_attribution_cells_are_the_first_order_terms_of_patched_runs(model, hook, over):
    """A cell's estimate minus the corrupt metric is the derivative of the metric along the patch: patching a hundredth
    of the way from the corrupt activation to the clean one moves the metric by a hundredth of it."""
    result = workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, hook=hook, over=over, layers=[0, 7, 20])
    patched = workbench.hooks.patching_sweep(model, CLEAN, CORRUPT, hook=hook, over=over, layers=[0, 7, 20],
                                             progress=False)
    assert result.corrupt_metric == patched.corrupt_metric and result.clean_metric == patched.clean_metric
    assert result.method == "attribution patching" and result.labels == patched.labels
    assert result.grid.shape == patched.grid.shape
    clean, corrupt = model.to_ids(CLEAN), model.to_ids(CORRUPT)
    answers = (int(model.forward(clean)[-1].argmax()), int(model.forward(corrupt)[-1].argmax()))
    name_of = (hook or ("blocks.{layer}.attn.hook_z" if "heads" in over else "blocks.{layer}.hook_resid_pre")).format
    torch.manual_seed(0)
    for index in torch.randint(0, result.grid.numel(), (4,)).tolist():
        cell = np.unravel_index(index, tuple(result.grid.shape))
        layer = [0, 7, 20][cell[0]]
        position = cell[1] if "positions" in over else None
        head = cell[-1] if "heads" in over else None
        name = name_of(layer=layer)
        donor = model.run(clean, record=[name]).activations[name]
        base = model.run(corrupt, record=[name]).activations[name]
        region = (slice(None) if position is None else position, *(() if head is None else (head,)))

        def nudge(x, ctx):
            x = x.clone()
            x[region] = base[region] + 0.01 * (donor[region] - base[region])
            return x

        logits = model.forward(corrupt, interventions=[(name, nudge)])
        moved = float(logits[-1, answers[0]] - logits[-1, answers[1]]) - result.corrupt_metric
        expected = 0.01 * (result.grid[cell].item() - result.corrupt_metric)
        assert moved == pytest.approx(expected, rel=0.05, abs=2e-4), (name, cell)


def test_attribution_normalizes_and_refuses_as_patching_does(model):
    plain = workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[3])
    normalized = workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[3], normalize=True)
    span = plain.clean_metric - plain.corrupt_metric
    assert torch.allclose(normalized.grid, (plain.grid - plain.corrupt_metric) / span)
    assert normalized.to_dict()["method"] == "attribution patching"
    with pytest.raises(HookError, match="same number of tokens"):
        workbench.hooks.attribution_patching(model, CLEAN, "Paris")
    with pytest.raises(HookError, match="a Python number has no gradient"):
        workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, metric=lambda logits: float(logits[-1, 0]))


@pytest.mark.parametrize("point, stream", [("hook_attn_out", "hook_resid_mid"), ("hook_mlp_out", "hook_resid_post")])
def test_a_block_outputs_gradient_is_the_stream_it_is_added_to(model, point, stream):
    """attn_out is added to the stream as resid_mid, mlp_out as resid_post: each alone takes its sum's gradient (the
    residual sum and its norm, one C++ call without gradients, must pass it on, with no autograd fallback warning)."""
    ids = model.to_ids("The Eiffel Tower is in the city of")
    metric = next_token_log_likelihood(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alone = model.run_with_gradients(ids, metric, [f"blocks.5.{point}"]).gradients[f"blocks.5.{point}"]
        summed = model.run_with_gradients(ids, metric, [f"blocks.5.{stream}"]).gradients[f"blocks.5.{stream}"]
    assert alone.abs().max() > 0.01
    assert (alone - summed).abs().max() <= 1e-5 * summed.abs().max()


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
def test_a_point_alone_takes_the_gradient_it_takes_beside_the_embeddings(tiny_model, mode):
    """A point whose tensor alone is tracked (the first norm's output, the keys, the values, the MLP's up projection)
    must not pass through a C++ call without a backward (the blocks in one call, llama.cpp's flash attention and
    SwiGLU), which would drop its gradient: alone it takes the gradient it takes when the embeddings' is asked too,
    where every op after them is tracked."""
    model = tiny_model(device="cpu")
    metric = next_token_log_likelihood(IDS)
    points = ["blocks.1.ln1.hook_scale", "blocks.1.ln1.hook_normalized", "blocks.1.attn.hook_k",
              "blocks.1.attn.hook_v", "blocks.1.attn.hook_rot_k", "blocks.1.mlp.hook_pre_linear"]
    with numerics(mode):
        for name in points:
            alone = model.run_with_gradients(IDS, metric, [name]).gradients[name]
            beside = model.run_with_gradients(IDS, metric, [name, "hook_embed"]).gradients[name]
            assert beside.abs().max() > 0.01, name
            assert (alone - beside).abs().max() <= 1e-5 * beside.abs().max(), name


def directional_derivative(model, ids, metric, name, direction, eps=1e-3, **call) -> float:
    """The metric's central difference along ``direction`` added at ``name`` (``call``: the run's interventions,
    saes and adapter, kept in the pushed forwards)."""
    def pushed(step: float) -> float:
        push = [(name, lambda x, ctx: x + step * direction)]
        logits = model.forward(ids, interventions=[*call.get("interventions", ()), *push], saes=call.get("saes", ()),
                               adapter=call.get("adapter"))
        return float(metric(logits))

    return (pushed(eps) - pushed(-eps)) / (2 * eps)


@pytest.mark.parametrize("case", ["sae", "feature steer", "transcoder"])
def test_gradients_through_an_attached_sae_are_the_forwards_derivative(tiny_model, case):
    """With its error term an SAE passes its input on plus its features' edits: the gradient before it is that of the
    forward (a central difference along it), not the reconstruction's Jacobian added to it, whichever of its points
    are asked too."""
    from workbench.probes.sae import FeatureSteer
    from workbench.probes.sae_train import init_sae

    model = tiny_model(device="cpu")
    d = model.config.d_model
    sae = init_sae("topk", d, 4 * d, "blocks.0.hook_resid_post", k=8, seed=1)
    call = {"sae": {"saes": [sae]}, "feature steer": {"interventions": [FeatureSteer(sae, 3, 5.0)]},
            "transcoder": {"saes": [init_sae("skip_transcoder", d, 3 * d, "blocks.1.ln2.hook_normalized",
                                             hook_out="blocks.1.hook_mlp_out", seed=2)]}}[case]
    sae_point = ("blocks.1.ln2.hook_normalized" if case == "transcoder" else sae.hook) + ".hook_sae_acts_post"
    metric = next_token_log_likelihood(IDS)
    names = ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post"]
    got = model.run_with_gradients(IDS, metric, [*names, sae_point], **call)
    for name in names:
        grad = got.gradients[name]
        expected = directional_derivative(model, IDS, metric, name, grad / grad.norm(), **call)
        assert grad.norm().item() == pytest.approx(expected, rel=0.01), name


@pytest.fixture(scope="module")
def adapted(tiny_model, tmp_path_factory):
    """A tiny llama with a PEFT adapter of q, v and down loaded as "a"."""
    from test_adapters import write_peft

    model = tiny_model(device="cpu", cached=False)
    model.load_adapter(write_peft(tmp_path_factory.mktemp("peft"), model.config,
                                  modules=["q_proj", "v_proj", "down_proj"]), name="a")
    return model


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
def test_a_gradient_run_with_an_adapter_keeps_the_forwards_bits(adapted, mode):
    """The adapter's terms (one fused call for a short prompt) add in a gradient run as in the production forward, and
    the gradient through them is the forward's derivative."""
    metric = next_token_log_likelihood(IDS)
    names = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_q_lora"]
    with numerics(mode):
        got = adapted.run_with_gradients(IDS, metric, names[:1], adapter="a")
        assert torch.equal(got.logits, adapted.forward(IDS, adapter="a"))
    grads = adapted.run_with_gradients(IDS, metric, names, adapter="a").gradients
    for name in names:
        expected = directional_derivative(adapted, IDS, metric, name, grads[name] / grads[name].norm(), adapter="a")
        assert grads[name].norm().item() == pytest.approx(expected, rel=0.01), name


def test_points_that_do_not_run_are_named(adapted):
    metric = next_token_log_likelihood(IDS)
    with pytest.raises(HookError, match=r"blocks.0.attn.hook_k_lora'\] did not run in this forward"):
        adapted.run_with_gradients(IDS, metric, ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_k_lora"], adapter="a")
    with pytest.raises(HookError, match="did not run in this forward"):
        adapted.run_with_gradients(IDS, metric, ["blocks.0.attn.hook_q_lora"])


def test_a_glob_passes_over_the_chosen_experts_a_name_of_them_is_refused(tiny_model):
    model = tiny_model("qwen3moe", device="cpu")
    metric = next_token_log_likelihood(IDS)
    got = model.run_with_gradients(IDS, metric, ["*"])
    assert list(got.gradients) == [n for n in model.hook_points() if not n.endswith("hook_expert_indices")]
    assert got.gradients["blocks.0.mlp.hook_router_logits"].abs().max() > 0
    with pytest.raises(HookError, match="integer expert ids"):
        model.run_with_gradients(IDS, metric, ["blocks.0.mlp.hook_expert_indices"])
    with pytest.raises(HookError, match="no hook point with a gradient"):
        model.run_with_gradients(IDS, metric, ["blocks.*.mlp.hook_expert_indices"])
    with pytest.raises(HookError, match=r"^points must be a list .*; pass \[it\]$"):
        model.run_with_gradients(IDS, metric, "blocks.0.hook_resid_pre")


def test_a_hook_that_edits_in_place_works_in_a_gradient_run(tiny_model):
    """An in-place edit of the pattern (softmax's output, which autograd keeps for the backward) edits the run as in
    the forward, and the gradient before it is the edited forward's derivative."""
    model = tiny_model(device="cpu")
    metric = next_token_log_likelihood(IDS)

    def halve_first_key(x, ctx):
        x[..., 0] *= 0.5

    edit = [("blocks.1.attn.hook_pattern", halve_first_key)]
    name = "blocks.0.hook_resid_post"
    got = model.run_with_gradients(IDS, metric, [name], interventions=edit)
    assert torch.equal(got.logits, model.forward(IDS, interventions=edit))
    grad = got.gradients[name]
    expected = directional_derivative(model, IDS, metric, name, grad / grad.norm(), interventions=edit)
    assert grad.norm().item() == pytest.approx(expected, rel=0.01)


def test_a_metric_that_edits_the_logits_in_place_leaves_the_returned_ones(tiny_model):
    model = tiny_model(device="cpu")

    def metric(logits):
        logits[:, 5] = 0.0
        return logits[-1].log_softmax(-1)[3]

    got = model.run_with_gradients(IDS, metric, ["blocks.1.hook_resid_pre"])
    assert torch.equal(got.logits, model.forward(IDS))
    assert got.metric == pytest.approx(float(metric(model.forward(IDS))))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_gradient_run_inside_a_callers_no_gradient_block(tiny_model, mode):
    model = tiny_model(device="cpu")
    metric = next_token_log_likelihood(IDS)
    name = "blocks.1.hook_resid_pre"
    expected = model.run_with_gradients(IDS, metric, [name]).gradients[name]
    with mode():
        got = model.run_with_gradients(IDS, metric, [name]).gradients[name]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("point", ["attn.hook_pattern", "attn.hook_attn_scores"])
def test_attribution_over_positions_of_scores_and_patterns_reads_the_query_axis(model, point):
    """Scores and patterns are [heads, T, S]: a position's cell is its query row (every head), as patching it is,
    and the masked scores (-inf in both runs) add nothing, not NaN. Each cell is the first-order term of a patch a
    hundredth of the way from the corrupt row to the clean one."""
    hook = "blocks.{layer}." + point
    result = workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, hook=hook, layers=[10])
    assert result.grid.isfinite().all()
    clean, corrupt = model.to_ids(CLEAN), model.to_ids(CORRUPT)
    answers = (int(model.forward(clean)[-1].argmax()), int(model.forward(corrupt)[-1].argmax()))
    name = hook.format(layer=10)
    donor, base = model.run(clean, record=[name]).activations[name], model.run(corrupt, record=[name]).activations[name]
    for position in (3, 5, 8):
        def nudge(x, ctx):
            x = x.clone()
            x[:, position] = torch.where(donor[:, position] == base[:, position], base[:, position],
                                         base[:, position] + 0.01 * (donor[:, position] - base[:, position]))
            return x

        logits = model.forward(corrupt, interventions=[(name, nudge)])
        moved = float(logits[-1, answers[0]] - logits[-1, answers[1]]) - result.corrupt_metric
        expected = 0.01 * (result.grid[0, position].item() - result.corrupt_metric)
        assert moved == pytest.approx(expected, rel=0.05, abs=2e-4), position


def test_integrated_gradients_add_up_to_the_change_of_the_metric(model):
    """The first block's input is the embeddings alone, so integrated gradients there are complete: the cells sum to
    the clean metric minus the corrupt one, to the midpoint rule's error. The corrupt run's gradient alone (steps=1)
    gets even the sign wrong on these prompts."""
    def summed(steps: int) -> tuple[float, workbench.hooks.PatchingResult]:
        result = workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[0], steps=steps)
        return float((result.grid - result.corrupt_metric).sum()), result

    one, plain = summed(1)
    sixteen, integrated = summed(16)
    change = integrated.clean_metric - integrated.corrupt_metric
    assert (integrated.clean_metric, integrated.corrupt_metric) == (plain.clean_metric, plain.corrupt_metric)
    assert integrated.method == "attribution patching, integrated gradients (16 steps)"
    assert abs(sixteen - change) < 0.02 * abs(change)
    assert abs(one - change) > abs(change)


def test_integrated_gradients_average_the_gradients_along_the_inputs_way(model):
    """steps=2: each head's cell is (clean z - corrupt z) . the mean of the gradients of the runs whose embeddings lie
    a quarter and three quarters of the way from the corrupt run's to the clean run's."""
    result = workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, over=("layers", "heads"), layers=[4], steps=2)
    name = "blocks.4.attn.hook_z"
    clean = model.run(CLEAN, record=[name, "hook_embed"]).activations
    corrupt = model.run(CORRUPT, record=[name, "hook_embed"])
    answers = (int(model.forward(CLEAN)[-1].argmax()), int(corrupt.logits[-1].argmax()))

    def metric(logits):
        return logits[-1, answers[0]] - logits[-1, answers[1]]

    def at(fraction):
        embed = corrupt.activations["hook_embed"] + fraction * (clean["hook_embed"] - corrupt.activations["hook_embed"])
        return model.run_with_gradients(CORRUPT, metric, [name], interventions=[
            ("hook_embed", lambda x, ctx: embed.to(x.dtype))]).gradients[name]

    gradient = (at(0.25) + at(0.75)) / 2
    expected = float(metric(corrupt.logits)) + ((clean[name] - corrupt.activations[name]) * gradient).sum((0, 2))
    assert result.corrupt_metric == pytest.approx(float(metric(corrupt.logits)))
    torch.testing.assert_close(result.grid[0], expected, rtol=1e-4, atol=1e-4)


def test_integrated_gradients_move_gemma4s_per_layer_inputs_too(tmp_path):
    """Gemma 4 E2B's blocks each read per-layer inputs made from the token ids: the way from the corrupt inputs to the
    clean ones moves them too, so the first block's input and every per-layer input together add up to the change
    (this random model's metric turns sharply on the way: 24 steps miss by more than the change, 48 are within 1%)."""
    pytest.importorskip("transformers")
    random_hf_checkpoint("gemma4e", tmp_path, initializer_range=0.2)
    write_hf_tokenizer(tmp_path)
    model = workbench.load(tmp_path, device="cpu")
    clean, corrupt = IDS, [IDS[0], 31, 42, IDS[3], 7, IDS[5], 99, IDS[7]]

    def metric(logits):
        return logits[-1, 11] - logits[-1, 12]

    def summed(hook: str, layers: list[int]) -> tuple[float, float]:
        result = workbench.hooks.attribution_patching(model, clean, corrupt, metric, hook=hook, layers=layers,
                                                      steps=64)
        return float((result.grid - result.corrupt_metric).sum()), result.clean_metric - result.corrupt_metric

    embeddings, change = summed("blocks.{layer}.hook_resid_pre", [0])
    per_layer, _ = summed("blocks.{layer}.per_layer.hook_input", list(range(model.config.n_layers)))
    assert abs(per_layer) > 0.05 * abs(change)
    assert abs(embeddings + per_layer - change) < 0.02 * abs(change)


def test_bad_steps_are_refused(model):
    for steps, message in ((0, "steps must be at least 1"), (1.5, "steps must be an integer"),
                           (True, "steps must be an integer")):
        with pytest.raises(HookError, match=message):
            workbench.hooks.attribution_patching(model, CLEAN, CORRUPT, layers=[0], steps=steps)


def test_a_batchs_gradients_are_each_prompts_own(tiny_model):
    """Prompts of different lengths, each with its own metric and interventions, in one forward and backward: each
    prompt's logits, metric, activations and gradients (packed points, and attention's padded patterns) are those
    of its run alone, to the batched kernels' rounding."""
    model = tiny_model(device="cpu")
    prompts = [IDS, IDS[:5], [9, 8, 7] + IDS, IDS[2:4]]
    metrics = [next_token_log_likelihood(p) for p in prompts]
    points = ["hook_embed", "blocks.*.hook_resid_pre", "blocks.1.attn.hook_pattern", "blocks.0.attn.hook_z"]
    own = [[], [workbench.hooks.Steer("blocks.0.hook_resid_post", torch.ones(model.config.d_model), positions=[-1])],
           [], [workbench.hooks.ZeroAblate("blocks.0.attn.hook_z", heads=[1])]]
    batch = model.run_with_gradients_batch(prompts, metrics, points, per_prompt_interventions=own)
    for prompt, metric, interventions, got in zip(prompts, metrics, own, batch):
        alone = model.run_with_gradients(prompt, metric, points, interventions=interventions)
        assert got.ids == alone.ids and got.metric == pytest.approx(alone.metric, rel=1e-5)
        torch.testing.assert_close(got.logits, alone.logits, rtol=0, atol=1e-4)
        for name in alone.gradients:
            for mine, theirs in ((got.gradients[name], alone.gradients[name]),
                                 (got.activations[name], alone.activations[name])):
                assert mine.shape == theirs.shape, name
                assert (mine - theirs).abs().max() <= 1e-4 * theirs.abs().max(), name
    assert batch[1].gradients["hook_embed"].abs().max() > 0


def test_bad_batch_gradient_requests_name_the_prompt(tiny_model):
    model = tiny_model(device="cpu")
    prompts = [IDS, IDS[:5]]
    with pytest.raises(WorkbenchError, match=r"or a list of one per prompt \(2\)"):
        model.run_with_gradients_batch(prompts, [next_token_log_likelihood(IDS)], ["hook_embed"])

    def constant(logits):
        return torch.tensor(1.0)

    with pytest.raises(HookError, match="prompt 1: metric's value does not depend on the logits"):
        model.run_with_gradients_batch(prompts, [next_token_log_likelihood(IDS), constant], ["hook_embed"])


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
def test_a_batchs_gradients_with_an_adapter_per_prompt(adapted, mode):
    """Prompts with and without the adapter in one forward and backward: each as its run alone."""
    prompts, choices = [IDS, IDS[:6], IDS[1:]], ["a", None, "a"]
    metrics = [next_token_log_likelihood(p) for p in prompts]
    names = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_v"]
    with numerics(mode):
        batch = adapted.run_with_gradients_batch(prompts, metrics, names, adapter=choices)
        for prompt, metric, choice, got in zip(prompts, metrics, choices, batch):
            alone = adapted.run_with_gradients(prompt, metric, names, adapter=choice)
            assert got.metric == pytest.approx(alone.metric, rel=1e-5)
            for name in names:
                assert (got.gradients[name] - alone.gradients[name]).abs().max() <= (
                    1e-4 * alone.gradients[name].abs().max()), name
    unadapted = adapted.run_with_gradients(IDS, metrics[0], names)
    assert (batch[0].gradients[names[0]] - unadapted.gradients[names[0]]).abs().max() > 1e-3
