"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): loading, the forward against transformers and against
a per-token reference on the packed experts, llama.cpp's converter, the hook points and the expert interventions."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import workbench
from workbench.errors import HookError, ModelLoadError
from workbench.hooks import from_spec
from workbench.kernels import layer_ops
from workbench.synthetic import write_gguf

from moe_reference import FAMILIES, LLAMA_CPP_SOURCE, convert_with_llama_cpp, hf_moe_model, quantize_with_llama_cpp

IDS = [5, 77, 120, 3, 250, 9, 14, 200, 31, 64]
# Mixtral is "llama" with experts; (architecture, random_config keywords)
SYNTHETIC = {
    "mixtral": ("llama", dict(n_experts=4, n_experts_used=2)),
    "qwen3moe": ("qwen3moe", dict(n_experts=8, n_experts_used=3, d_expert=64)),
    "qwen2moe": ("qwen2moe", dict(n_experts=4, n_experts_used=2, d_expert=64, d_shared_expert=96)),
}


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """``hf_moe(family)``: (transformers model, its checkpoint folder), built once per family."""
    built = {}

    def make(family: str):
        if family not in built:
            path = tmp_path_factory.mktemp(family)
            built[family] = (hf_moe_model(family, path), path)
        return built[family]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_checkpoint_matches_transformers(family, hf_moe):
    reference, path = hf_moe(family)
    ours = workbench.load(path, device="cpu")
    assert ours.config.moe is not None
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0].float()
    trace = ours.run(IDS, record=["blocks.*.mlp.hook_expert_indices"])
    assert (trace.logits - expected).abs().max().item() < 1e-4
    # the test means something only if tokens go to different experts
    assert len(trace.activations["blocks.0.mlp.hook_expert_indices"].unique()) > ours.config.moe.n_experts_used


@pytest.mark.skipif(not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").is_file(),
                    reason="llama.cpp's source tree (WORKBENCH_LLAMA_CPP_SOURCE) is not here")
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_converted_gguf_matches(family, hf_moe, tmp_path):
    _, path = hf_moe(family)
    gguf_path = convert_with_llama_cpp(path, tmp_path / f"{family}.gguf")
    from_gguf, from_hf = workbench.load(gguf_path, device="cpu"), workbench.load(path, device="cpu")
    assert from_gguf.config.moe == from_hf.config.moe
    assert from_gguf.config.architecture == {"mixtral": "llama"}.get(family, family)
    assert (from_gguf.forward(IDS) - from_hf.forward(IDS)).abs().max().item() < 1e-5


@pytest.mark.skipif(not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").is_file(),
                    reason="llama.cpp's source tree (WORKBENCH_LLAMA_CPP_SOURCE) is not here")
def test_llama_cpp_q4_k_m_gguf_loads(tmp_path):
    """Qwen3-MoE converted and quantized to Q4_K_M by llama.cpp (rows of 256, so its K-quant mix applies: Q4_K and
    Q6_K experts, the router left F32) loads, and stays as close to the float checkpoint as our own Q4_K_M of it."""
    pytest.importorskip("llama_cpp")
    reference = hf_moe_model("qwen3moe", tmp_path / "hf", n_layers=1, hidden_size=256, moe_intermediate_size=256,
                             head_dim=64)
    f32 = convert_with_llama_cpp(tmp_path / "hf", tmp_path / "f32.gguf")
    model = workbench.load(quantize_with_llama_cpp(f32, tmp_path / "q4km.gguf", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
                           device="cpu")
    formats = model.tensor_formats()
    assert formats["blocks.0.moe.router"] == "F32" and {formats["blocks.0.moe.gate"], formats["blocks.0.moe.down"]} <= {
        "Q4_K", "Q5_K", "Q6_K"}
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0].float()
    ours = workbench.load(tmp_path / "hf", device="cpu", quantize="Q4_K_M")  # our quantizer, the same mix

    def error(m) -> float:  # relative to the float logits
        return ((m.forward(IDS) - expected).norm() / expected.norm()).item()

    # a misread layout would be far off; llama.cpp's quantization is as close as ours (0.125 and 0.136 when written)
    assert 0 < error(model) < 1.5 * error(ours) and error(model) < 0.2


FIXTURES = Path(__file__).parent / "fixtures" / "moe"
LLAMACPP = json.loads((FIXTURES / "llamacpp_logits.json").read_text())


@pytest.mark.parametrize("name", [f for f in LLAMACPP["files"] if not f.startswith("gpt-oss")])  # its own: test_gpt_oss
def test_logits_agree_with_llamacpp(name):
    """Each family converted and quantized by llama.cpp (Q8_0, Q4_K_M; scripts/make_moe_fixtures.py) against
    llama.cpp's own log-probabilities over the whole vocabulary. Measured when written (22 positions a file): KL at
    most 3.5e-5 in exact numerics with at most one near-tie flipping the top token, at most 9e-6 in llama.cpp's
    numerics with every top token agreeing and a lower mean KL in every file."""
    from safetensors.torch import load_file

    reference = load_file(str(FIXTURES / "llamacpp_logits.safetensors"))
    model = workbench.load(FIXTURES / name, device="cpu")
    results = {}
    for mode in ("exact", "llamacpp"):
        kl, agree = [], []
        # the fixtures ran llama.cpp without flash attention (llama-cpp-python's Llama() default), whose float32
        # attention the exact glue computes; llama.cpp numerics emulate its flash-attention default otherwise
        with workbench.kernels.numerics(mode), layer_ops.exact_glue():
            for i, ids in enumerate(LLAMACPP["sequences"]):
                ours = model.forward(ids).double().log_softmax(-1)
                theirs = reference[f"{name.removesuffix('.gguf')}.{i}"].double()
                kl.append((theirs.exp() * (theirs - ours)).sum(-1))
                agree.append(ours.argmax(-1) == theirs.argmax(-1))
        results[mode] = torch.cat(kl), torch.cat(agree)
    (kl_exact, agree_exact), (kl_llamacpp, agree_llamacpp) = results["exact"], results["llamacpp"]
    assert kl_exact.max() < 1e-4 and agree_exact.sum() >= len(agree_exact) - 1
    assert kl_llamacpp.max() < 2e-5 and agree_llamacpp.all()
    assert kl_llamacpp.mean() < kl_exact.mean()


def reference_moe_logits(model, ids: list[int]) -> torch.Tensor:
    """The MoE model's logits with its MLPs computed token by token on dequantized experts (the attention and norms
    from our own runner's hooks): an independent check of grouping, gathering and the weighted sum."""
    c, m = model.config, model.config.moe

    def mlp(x: torch.Tensor, ctx) -> torch.Tensor:
        w = model.runner.weights.layers[ctx.layer].moe
        x = x.double()
        gate_all = w.gate.dequantize().double().view(m.n_experts, m.d_expert, c.d_model)
        up_all = w.up.dequantize().double().view(m.n_experts, m.d_expert, c.d_model)
        down_all = w.down.dequantize().double().view(m.n_experts, c.d_model, m.d_expert)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            logits = w.router.dequantize().double() @ x[t]
            probs = logits.softmax(-1) if m.gating == "softmax" else logits.sigmoid()
            top = probs.topk(m.n_experts_used).indices
            weights = probs[top] / (probs[top].sum() if m.normalize_weights else 1)
            for e, weight in zip(top.tolist(), weights):
                hidden = torch.nn.functional.silu(gate_all[e] @ x[t]) * (up_all[e] @ x[t])
                out[t] += weight * (down_all[e] @ hidden)
            if w.shared_router is not None:
                hidden = torch.nn.functional.silu(w.shared_gate.dequantize().double() @ x[t]) * (
                    w.shared_up.dequantize().double() @ x[t])
                out[t] += torch.sigmoid(w.shared_router.dequantize().double()[0] @ x[t]) * (
                    w.shared_down.dequantize().double() @ hidden)
        return out.float()

    normalized = {}
    hooks = {f"blocks.{i}.ln2.hook_normalized": [lambda x, ctx: normalized.__setitem__(ctx.layer, x)]
             for i in range(c.n_layers)}
    weights = {i: model.runner.weights.layers[i].mlp_norm for i in range(c.n_layers)}
    hooks.update({f"blocks.{i}.hook_mlp_out": [lambda x, ctx: mlp(normalized[ctx.layer] * weights[ctx.layer], ctx)]
                  for i in range(c.n_layers)})
    return model.runner.forward(torch.tensor(ids), hooks=hooks)


# K-quant blocks are 256 values: rows of 256 for every matrix
K_SHAPE = dict(d_model=256, n_heads=4, n_kv_heads=2, d_mlp=256, n_experts=8, n_experts_used=3, d_expert=256)


@pytest.mark.parametrize("family, fmt", [(f, "Q8_0") for f in SYNTHETIC] + [("qwen3moe", "Q4_K")])
def test_packed_experts_match_per_token_reference(family, fmt, tiny_model):
    arch, shape = SYNTHETIC[family]
    model = tiny_model(arch, fmt, device="cpu", **(K_SHAPE if fmt == "Q4_K" else shape))
    experts = model.runner.weights.layers[0].moe
    # each expert's matrices are row ranges of the stacked tensor as stored, not copies
    gate, _, down = experts.experts[1]
    assert gate.data.data_ptr() == experts.gate.data.data_ptr() + gate.data.shape[0] * gate.data.shape[1]
    assert down.data.untyped_storage().data_ptr() == experts.down.data.untyped_storage().data_ptr()
    assert experts.gate.fmt.name == fmt
    ours, reference = model.forward(IDS), reference_moe_logits(model, IDS)
    assert (ours - reference).abs().max().item() < 1e-3 * reference.abs().max().item()


def per_expert_experts(x, indices, w, moe, activation="silu"):
    """The experts as the forward ran them before ``linear_segments``: one expert at a time on its tokens, gate and up
    in one ``linear_parts`` call, the activation, then down."""
    from workbench.kernels import linear, linear_parts
    from workbench.moe import clamped_swiglu

    n_tokens, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    out = x.new_empty(n_tokens * k, x.shape[1])
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=len(w.experts)).tolist()):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        gate_w, up_w, down_w = w.experts[expert]
        gate, up = linear_parts(x.index_select(0, pairs // k), (gate_w, up_w))
        if w.gate_bias is not None:
            gate, up = gate + w.gate_bias[expert], up + w.up_bias[expert]
        if moe.swiglu_limit is not None:
            hidden = clamped_swiglu(gate, up, moe.swiglu_alpha, moe.swiglu_limit)
        elif activation == "gelu_tanh":
            hidden = torch.nn.functional.gelu(gate, approximate="tanh") * up
        else:
            hidden = layer_ops.swiglu(gate, up)
        expert_out = linear(hidden, down_w)
        out[pairs] = expert_out if w.down_bias is None else expert_out + w.down_bias[expert]
    return out.view(n_tokens, k, x.shape[1])


@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
@pytest.mark.parametrize("fmt", ["Q4_K", "MXFP4"])
def test_experts_in_one_call_equal_one_expert_at_a_time(fmt, numerics, tiny_model, monkeypatch):
    """run_experts (each projection kind of all chosen experts in one kernel call) gives the former per-expert loop's
    bits: one token (decode, slot order; an expert a hook chose twice), a few tokens grouped by expert, and enough
    tokens that some expert's group takes the kernel's panel path; Q4_K experts, and GPT-OSS's MXFP4 experts with
    their biases and clamped SwiGLU."""
    from workbench.kernels import cpu, numerics as using
    from workbench.kernels.cpu import PANEL_MIN_BATCH
    from workbench.moe import run_experts

    if fmt == "MXFP4":
        model = workbench.load(Path(__file__).parent / "fixtures" / "moe" / "gpt-oss-MXFP4_MOE.gguf", device="cpu")
    else:
        model = tiny_model("qwen3moe", fmt, device="cpu", **K_SHAPE)
    moe = model.config.moe
    w = model.runner.weights.layers[1].moe
    assert w.down.fmt.name == fmt and (w.gate_bias is not None) == (fmt == "MXFP4")
    generator = torch.Generator().manual_seed(0)
    cases = {"one token": 1, "one token, an expert chosen twice": 1, "a few tokens": 5, "panels": 8 * PANEL_MIN_BATCH}
    for case, n_tokens in cases.items():
        x = torch.randn(n_tokens, model.config.d_model, generator=generator)
        indices = torch.rand(n_tokens, moe.n_experts, generator=generator).topk(moe.n_experts_used).indices
        if case == "one token, an expert chosen twice":
            indices[:, 1] = indices[:, 0]
        if case == "panels":
            assert torch.bincount(indices.reshape(-1)).max() >= PANEL_MIN_BATCH
        with using(numerics):
            ours, reference = run_experts(x, indices, w, moe), per_expert_experts(x, indices, w, moe)
        assert ours.shape == (n_tokens, moe.n_experts_used, model.config.d_model)
        assert torch.equal(ours, reference), (case, (ours - reference).abs().max())
    # a token's experts: one kernel call for gate and up, one for down
    x, indices, op = x[:1], indices[:1], f"linear_{numerics}_segments"
    ops, calls = cpu.extension(), []

    class Counted:  # the extension, counting the calls of op
        def __getattr__(self, name):
            return (lambda *args: calls.append(args) or getattr(ops, op)(*args)) if name == op else getattr(ops, name)

    with using(numerics):
        reference = per_expert_experts(x, indices, w, moe)
        monkeypatch.setattr(cpu, "extension", Counted)
        assert torch.equal(run_experts(x, indices, w, moe), reference)
    assert len(calls) == 2


@pytest.mark.parametrize("family, fmt", [("mixtral", "Q8_0"), ("qwen2moe", "Q8_0"), ("qwen3moe", "Q4_K")])
def test_gguf_round_trip(family, fmt, tiny_checkpoint, tmp_path):
    arch, shape = SYNTHETIC[family]
    checkpoint = tiny_checkpoint(arch, fmt, **(K_SHAPE if fmt == "Q4_K" else shape))
    path = write_gguf(tmp_path / f"{family}.gguf", checkpoint.config, checkpoint.weights, checkpoint.metadata)
    loaded = workbench.load(path, device="cpu")
    assert loaded.config == checkpoint.config
    assert torch.equal(loaded.forward(IDS), workbench.Model(checkpoint, "cpu").forward(IDS))
    assert loaded.tensor_formats()["blocks.1.moe.down"] == fmt


def test_gguf_missing_expert_tensor_is_named(tiny_checkpoint, tmp_path, monkeypatch):
    from workbench import moe

    every = moe.gguf_tensors
    monkeypatch.setattr(moe, "gguf_tensors", lambda prefix, w: [t for t in every(prefix, w)
                                                                 if t[0] != "blk.1.ffn_up_exps.weight"])
    checkpoint = tiny_checkpoint("qwen3moe")
    path = write_gguf(tmp_path / "cut.gguf", checkpoint.config, checkpoint.weights, checkpoint.metadata)
    with pytest.raises(ModelLoadError, match="blk.1.ffn_up_exps.weight is missing"):
        workbench.load(path)


def test_sigmoid_routing_matches_per_token_reference(tiny_checkpoint):
    """Sigmoid gating (llama.cpp's expert_gating_func 2), on a Qwen3-MoE-shaped model."""
    from dataclasses import replace

    from workbench.loading import LoadedCheckpoint

    checkpoint = tiny_checkpoint("qwen3moe", n_experts=8, n_experts_used=3)
    config = replace(checkpoint.config, moe=replace(checkpoint.config.moe, gating="sigmoid"))
    model = workbench.Model(LoadedCheckpoint(config, checkpoint.weights, checkpoint.tokenizer, checkpoint.path,
                                             checkpoint.metadata), "cpu")
    ours, reference = model.forward(IDS), reference_moe_logits(model, IDS)
    assert (ours - reference).abs().max().item() < 1e-3 * reference.abs().max().item()
    assert not torch.allclose(ours, workbench.Model(checkpoint, "cpu").forward(IDS), atol=1e-3)


def test_quantize_on_load_keeps_the_router_float(hf_moe):
    _, path = hf_moe("qwen2moe")
    exact, quantized = workbench.load(path, device="cpu"), workbench.load(path, device="cpu", quantize="Q8_0")
    formats = quantized.tensor_formats()
    assert formats["blocks.0.moe.router"] == "F32"  # as llama.cpp's quantizer leaves ffn_gate_inp
    assert formats["blocks.0.moe.gate"] == formats["blocks.1.moe.shared_gate"] == "Q8_0"
    # Q8_0's rounding, on logits of magnitude ~1 (a close routing choice may flip)
    assert 0 < (quantized.forward(IDS) - exact.forward(IDS)).abs().max().item() < 0.1


# ------------------------------------------------------------------------------------------- hook points


@pytest.fixture(scope="module")
def qwen2moe(tiny_model):
    return tiny_model("qwen2moe", "Q8_0", device="cpu", n_experts=4, n_experts_used=2, d_shared_expert=64)


def test_hook_points_and_shapes(qwen2moe):
    shapes = qwen2moe.hook_points()
    assert shapes["blocks.0.mlp.hook_router_logits"] == "[T, 4]"
    assert shapes["blocks.0.mlp.hook_expert_indices"] == "[T, 2]"
    assert shapes["blocks.1.mlp.hook_expert_out"] == "[T, 2, 64]"
    assert shapes["blocks.1.mlp.hook_shared_expert_out"] == "[T, 64]"
    assert "blocks.0.mlp.hook_post" not in shapes
    names = list(shapes)
    assert names.index("blocks.0.mlp.hook_router_logits") < names.index("blocks.0.mlp.hook_expert_out") < names.index(
        "blocks.0.hook_mlp_out")


def test_recording_everything_is_bit_identical(qwen2moe):
    clean = qwen2moe.run(IDS)
    recorded = qwen2moe.run(IDS, record=["*"])
    assert torch.equal(clean.logits, recorded.logits)
    a = recorded.activations
    assert a["blocks.0.mlp.hook_expert_indices"].dtype == torch.int64
    # the recorded parts add up to the MLP's output
    weighted = (a["blocks.1.mlp.hook_expert_out"] * a["blocks.1.mlp.hook_expert_weights"][..., None]).sum(1)
    total = weighted + a["blocks.1.mlp.hook_shared_expert_out"]
    assert torch.allclose(total, a["blocks.1.hook_mlp_out"], atol=1e-6)
    probs = a["blocks.1.mlp.hook_router_logits"].softmax(-1)
    assert torch.equal(probs.topk(2).indices, a["blocks.1.mlp.hook_expert_indices"])


def test_zero_steers_are_identities(qwen2moe):
    clean = qwen2moe.run(IDS).logits
    for spec in [{"type": "steer_expert", "experts": [0, 1, 2, 3], "scale": 1.0, "vector": [0.0] * 64},
                 {"type": "steer", "hook": "blocks.*.mlp.hook_expert_out", "vector": [0.0] * 64},
                 {"type": "steer", "hook": "blocks.*.mlp.hook_shared_expert_out", "vector": [0.0] * 64}]:
        edited = qwen2moe.run(IDS, interventions=[spec]).logits
        assert torch.equal(edited, clean), spec


def _mlp_parts(model, layer: int, interventions=()) -> dict[str, torch.Tensor]:
    points = ["router_logits", "expert_indices", "expert_weights", "expert_out", "shared_expert_out"]
    names = [f"blocks.{layer}.mlp.hook_{p}" for p in points] + [f"blocks.{layer}.hook_mlp_out"]
    trace = model.run(IDS, record=[n for n in names if n in model.hook_points()], interventions=interventions)
    return {name.rsplit("hook_", 1)[1]: value for name, value in trace.activations.items()}


@pytest.mark.parametrize("renormalize", [False, True])
def test_drop_ablation_equals_hand_computation(qwen2moe, renormalize):
    clean = _mlp_parts(qwen2moe, 1)
    expert = int(clean["expert_indices"][0, 0])  # one that token 0 uses
    spec = {"type": "ablate_expert", "experts": [expert], "layer": 1, "mode": "drop", "renormalize": renormalize}
    ablated = _mlp_parts(qwen2moe, 1, [spec])
    assert torch.equal(ablated["expert_indices"], clean["expert_indices"])  # the choice stays; the weight goes
    weights = clean["expert_weights"].clone()
    hit = clean["expert_indices"] == expert
    kept = weights.masked_fill(hit, 0.0)
    if renormalize:
        kept = kept * weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True)
    expected = (clean["expert_out"] * kept[..., None]).sum(1) + clean["shared_expert_out"]
    assert hit.any() and (~hit).any()
    assert torch.allclose(ablated["mlp_out"], expected, atol=1e-6)
    assert not torch.allclose(ablated["mlp_out"], clean["mlp_out"], atol=1e-3)


ROUTERS = {  # a model of each router: softmax then top-k, normalized or not; top-k then softmax; sigmoid
    "mixtral": "moe/mixtral-Q8_0.gguf", "qwen2moe": "moe/qwen2moe-Q8_0.gguf", "qwen3moe": "moe/qwen3moe-Q8_0.gguf",
    "gpt-oss": "moe/gpt-oss-MXFP4_MOE.gguf", "gemma4moe": "families/gemma4moe-Q8_0.gguf", "sigmoid": None,
}


def _router_model(name: str, tiny_checkpoint) -> workbench.Model:
    if ROUTERS[name] is not None:
        return workbench.load(Path(__file__).parent / "fixtures" / ROUTERS[name], device="cpu")
    from dataclasses import replace

    from workbench.loading import LoadedCheckpoint

    checkpoint = tiny_checkpoint("qwen3moe", n_experts=8, n_experts_used=3)
    config = replace(checkpoint.config, moe=replace(checkpoint.config.moe, gating="sigmoid"))
    return workbench.Model(LoadedCheckpoint(config, checkpoint.weights, checkpoint.tokenizer, checkpoint.path,
                                            checkpoint.metadata), "cpu")


def _routing_weights(model, layer: int, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The weights the model gives each token's chosen ``indices``, computed by hand from its router logits."""
    m = model.config.moe
    if m.gating == "softmax_weight":
        weights = logits.gather(-1, indices).softmax(-1)
    else:
        weights = (logits.softmax(-1) if m.gating == "softmax" else logits.sigmoid()).gather(-1, indices)
    if m.normalize_weights:
        weights = weights / weights.sum(-1, keepdim=True)
    scale = model.runner.weights.layers[layer].moe.expert_scale
    return weights * m.weights_scale * (1.0 if scale is None else scale[indices])


@pytest.mark.parametrize("router", list(ROUTERS))
def test_reroute_ablation_equals_hand_computation(router, tiny_checkpoint):
    """A token that chose an ablated expert takes the top k of the others, weighted as the model weights that choice
    (its probabilities over all experts); every other token keeps its experts and weights, bit for bit."""
    model = _router_model(router, tiny_checkpoint)
    k, n = model.config.moe.n_experts_used, model.config.moe.n_experts
    clean = _mlp_parts(model, 0)
    clean_logits = model.run(IDS).logits
    # each token's unchosen experts, ablated at that token alone: nothing changes
    for t in (0, 3, len(IDS) - 1):
        unchosen = sorted(set(range(n)) - set(clean["expert_indices"][t].tolist()))
        spec = {"type": "ablate_expert", "experts": unchosen, "layer": 0, "positions": [t], "mode": "reroute"}
        trace = model.run(IDS, interventions=[spec])
        assert torch.equal(trace.logits, clean_logits), (router, t)
    # an expert some tokens chose and others not, ablated everywhere: the tokens that chose it move, the others stay
    chose = torch.stack([(clean["expert_indices"] == e).any(-1) for e in range(n)])
    expert = int(next(e for e in range(n) if 0 < chose[e].sum() < len(IDS)))
    ablated = _mlp_parts(model, 0, [{"type": "ablate_expert", "experts": [expert], "layer": 0, "mode": "reroute"}])
    moved = (clean["expert_indices"] == expert).any(-1)
    indices = torch.where(moved[:, None], clean["router_logits"].index_fill(-1, torch.tensor([expert]),
                                                                            float("-inf")).topk(k).indices,
                          clean["expert_indices"])
    assert moved.any() and (~moved).any()
    assert torch.equal(ablated["router_logits"], clean["router_logits"])
    assert torch.equal(ablated["expert_indices"], indices) and not (indices == expert).any()
    assert torch.allclose(ablated["expert_weights"], _routing_weights(model, 0, clean["router_logits"], indices),
                          atol=1e-6)
    assert torch.equal(ablated["expert_weights"][~moved], clean["expert_weights"][~moved])
    # layer 0's input is unchanged, so each expert's output is the clean one where the clean run chose it (up to
    # the rounding of matmuls over other groups of tokens)
    same = clean["expert_indices"] == ablated["expert_indices"]
    assert torch.allclose(ablated["expert_out"][same], clean["expert_out"][same], atol=1e-6)


def test_reroutes_listed_one_after_another_compose(tiny_checkpoint):
    """Two reroute ablations of a block keep tokens off both's experts, as one ablating both does; an ablation
    whose experts no token in its positions chose changes nothing, even listed after another."""
    model = _router_model("qwen2moe", tiny_checkpoint)
    clean = _mlp_parts(model, 0)
    first, second = (int(e) for e in clean["expert_indices"][0])
    spec = {"type": "ablate_expert", "layer": 0, "mode": "reroute"}
    both = _mlp_parts(model, 0, [{**spec, "experts": [first, second]}])
    one_by_one = _mlp_parts(model, 0, [{**spec, "experts": [first]}, {**spec, "experts": [second]}])
    assert torch.equal(one_by_one["expert_indices"], both["expert_indices"])
    assert torch.equal(one_by_one["expert_weights"], both["expert_weights"])
    assert not torch.isin(both["expert_indices"], torch.tensor([first, second])).any()
    with pytest.raises(HookError, match=r"rerouting around 7 of 8 experts \[0, 1, 2, 3, 4, 5, 6\] leaves fewer"):
        model.run(IDS, interventions=[{**spec, "experts": [0, 1, 2, 3]}, {**spec, "experts": [4, 5, 6]}])


def test_force_routing(qwen2moe):
    clean = _mlp_parts(qwen2moe, 0)
    spec = {"type": "force_routing", "experts": [3, 1], "layer": 0, "positions": [2, -1]}
    forced = _mlp_parts(qwen2moe, 0, [spec])
    rows = [2, len(IDS) - 1]
    assert forced["expert_indices"][rows].tolist() == [[3, 1], [3, 1]]
    others = [t for t in range(len(IDS)) if t not in rows]
    assert torch.equal(forced["expert_indices"][others], clean["expert_indices"][others])
    # the router's own probabilities weight the forced experts
    probs = clean["router_logits"].softmax(-1)
    assert torch.allclose(forced["expert_weights"][rows], probs[rows][:, [3, 1]], atol=1e-7)
    with_weights = _mlp_parts(qwen2moe, 0, [{**spec, "weights": [0.25, 0.75]}])
    assert with_weights["expert_weights"][rows].tolist() == [[0.25, 0.75], [0.25, 0.75]]


def test_steer_expert_scales_its_output(qwen2moe):
    clean = _mlp_parts(qwen2moe, 1)
    expert = int(clean["expert_indices"][0, 1])
    scaled = _mlp_parts(qwen2moe, 1, [{"type": "steer_expert", "experts": [expert], "layer": 1, "scale": 0.0}])
    hit = clean["expert_indices"] == expert
    weights = clean["expert_weights"].masked_fill(hit, 0.0)
    expected = (clean["expert_out"] * weights[..., None]).sum(1) + clean["shared_expert_out"]
    assert torch.allclose(scaled["mlp_out"], expected, atol=1e-6)


def test_specs_round_trip_and_bad_input(qwen2moe, tiny_model):
    spec = {"type": "ablate_expert", "experts": [2], "layer": 1, "positions": [0, 1], "mode": "reroute",
            "renormalize": False}
    assert from_spec(spec).to_spec() == spec
    steer = {"type": "steer_expert", "experts": [0], "layer": None, "scale": 2.0, "vector": [1.0] * 64}
    assert from_spec(steer).to_spec() == steer
    cases = [
        ({"type": "ablate_expert", "experts": [4]}, "out of range 0..3"),
        ({"type": "ablate_expert", "experts": [0], "layer": 7}, "out of range"),
        ({"type": "ablate_expert", "experts": [0, 1, 2], "mode": "reroute"}, "fewer than the 2"),
        ({"type": "ablate_expert", "experts": [0], "mode": "skip"}, "mode must be one of"),
        ({"type": "force_routing", "experts": [1]}, "needs 2 distinct experts"),
        ({"type": "steer_expert", "experts": [0], "vector": [1.0] * 3}, r"shape \(64,\)"),
    ]
    for bad, message in cases:
        with pytest.raises(HookError, match=message):
            qwen2moe.run(IDS, interventions=[bad])
    with pytest.raises(HookError, match="mixture-of-experts"):
        tiny_model("llama").run(IDS, interventions=[{"type": "ablate_expert", "experts": [0]}])


def test_expert_ids_take_only_edits_that_copy_them(qwen2moe):
    """The chosen experts are ids: zeroing, scaling, steering or averaging them would route every token to expert 0
    or to truncated means, so those are refused; patching them from a donor run routes this run as the donor's."""
    point = "blocks.1.mlp.hook_expert_indices"
    for bad in [{"type": "zero_ablate"}, {"type": "scale", "factor": 0.5}, {"type": "mean_ablate", "mean": [1.0, 2.0]},
                {"type": "steer", "vector": [1.0, 1.0]}]:
        with pytest.raises(HookError, match=f"{bad['type']} on {point}: its values are expert ids"):
            qwen2moe.run(IDS, interventions=[{**bad, "hook": point}])
    donor = IDS[::-1]
    routed = qwen2moe.run(donor, record=[point]).activations[point]
    patched = qwen2moe.run(IDS, record=[point, "blocks.1.mlp.hook_expert_out"],
                           interventions=[{"type": "patch", "hook": point, "donor": donor}])
    assert torch.equal(patched.activations[point], routed)
    assert not torch.equal(routed, qwen2moe.run(IDS, record=[point]).activations[point])


def test_batch_matches_single_runs(qwen2moe):
    prompts = [IDS, IDS[:4], IDS[3:9]]
    spec = {"type": "ablate_expert", "experts": [1], "mode": "drop", "renormalize": True}
    batched = qwen2moe.run_batch(prompts, record=["blocks.0.mlp.hook_expert_indices"], interventions=[spec])
    for prompt, trace in zip(prompts, batched):
        single = qwen2moe.run(prompt, record=["blocks.0.mlp.hook_expert_indices"], interventions=[spec])
        assert torch.allclose(trace.logits, single.logits, atol=1e-5)
        assert torch.equal(trace.activations["blocks.0.mlp.hook_expert_indices"],
                           single.activations["blocks.0.mlp.hook_expert_indices"])


def test_batches_record_the_chosen_experts_as_integers(qwen2moe):
    """Batched recording keeps the chosen experts int64, as ``run`` records them, whatever ``record_dtype`` the float
    activations take (a bfloat16 expert id is rounded from 257 experts on) and in a trace owning its buffers."""
    prompts = [IDS, IDS[:4]]
    names = ["blocks.0.mlp.hook_expert_indices", "blocks.0.mlp.hook_expert_weights"]
    single = [qwen2moe.run(p, record=names).activations for p in prompts]
    for kwargs in [{}, {"record_dtype": torch.bfloat16}, {"reduce": "last"}]:
        for i, trace in qwen2moe.iter_batch(prompts, record=names, **kwargs):
            chosen, weights = (trace.activations[n] for n in names)
            expected = single[i][names[0]]
            assert chosen.dtype == torch.int64, kwargs
            assert torch.equal(chosen, expected[-1] if "reduce" in kwargs else expected)
            assert weights.dtype == kwargs.get("record_dtype", torch.float32)


def test_generation_with_kv_cache_matches_full_forward(qwen2moe):
    new = [token for token, _ in qwen2moe.stream(IDS[:5], max_new_tokens=4, compiled=False)]
    ids = IDS[:5] + new
    assert len(new) == 4
    full = qwen2moe.forward(ids[:-1]).argmax(-1)[4:]
    assert full.tolist() == ids[5:]


# ------------------------------------------------------------------------------------------------ surfaces


def test_dashboard_experts_page(monkeypatch, tiny_checkpoint, tmp_path):
    streamlit_testing = pytest.importorskip("streamlit.testing.v1")
    from workbench.app import common
    from workbench.moe import routing_matrix

    checkpoint = tiny_checkpoint("qwen3moe", n_experts=8, n_experts_used=3)
    path = write_gguf(tmp_path / "moe.gguf", checkpoint.config, checkpoint.weights, checkpoint.metadata)
    monkeypatch.setattr("sys.argv", ["main.py", "--model", str(path)])
    at = streamlit_testing.AppTest.from_file(str(Path(common.__file__).with_name("main.py")), default_timeout=240)
    at.run()
    at.switch_page("page_experts.py").run()
    assert not at.exception, [e.message for e in at.exception]
    model = workbench.load(path, device="cpu")
    trace = model.run(common.DEFAULT_PROMPT, record=["blocks.1.mlp.hook_expert_indices",
                                                      "blocks.1.mlp.hook_expert_weights"])
    expected = routing_matrix(trace.activations["blocks.1.mlp.hook_expert_indices"],
                              trace.activations["blocks.1.mlp.hook_expert_weights"], 8)
    at.selectbox(key="ex_layer").set_value(1).run()
    charts = {c.key: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    assert torch.allclose(torch.tensor(charts["ex_routing"]["data"][0]["z"]), expected, atol=1e-6)
    assert {"ex_load", "ex_residual", "ex_next_a"} <= set(charts)
    at.radio(key="ex_mode").set_value("reroute").run()
    assert not at.exception and "ex_rerouted" in {c.key for c in at.get("plotly_chart")}
    at.switch_page("page_interventions.py").run()  # the MLP-neuron site is not offered on an MoE model
    assert not at.exception, [e.message for e in at.exception]


def test_mcp_tools_on_an_moe_model(qwen2moe, tmp_path):
    import anyio
    from mcp.client import Client as InProcessClient

    from workbench.mcp_server import Workbench, build_server

    bench = Workbench(qwen2moe, tmp_path)
    ablate = {"type": "ablate_expert", "experts": [0], "layer": 1, "mode": "reroute"}

    async def scenario() -> dict:
        async with InProcessClient(build_server(bench), mode="legacy") as client:
            async def call(name: str, **arguments) -> dict:
                result = await client.call_tool(name, arguments)
                assert not result.is_error, result.content[0].text
                return result.structured_content

            info = await call("model_info")
            run = await call("run", prompt="the cat sat", record=["blocks.*.mlp.*"])
            routing = await call("moe_routing", prompt="the cat sat", layers=[1])
            ablated = await call("moe_routing", prompt="the cat sat", layers=[1], interventions=[ablate])
            edit = await call("run_batch", prompts=["the cat", "a dog"], interventions=[ablate])
            rerouted = await call("run_with_interventions", prompt="the cat sat", interventions=[ablate],
                                  record=["blocks.*.mlp.*"])
            compared = await call("compare_traces", a=rerouted["baseline_trace_id"], b=rerouted["trace_id"])
            return dict(info=info, run=run, routing=routing, ablated=ablated, edit=edit, compared=compared)

    out = anyio.run(scenario)
    assert out["info"]["moe"]["n_experts"] == 4 and out["info"]["moe"]["d_shared_expert"] == 64
    assert {"blocks.0.mlp.hook_expert_indices", "blocks.1.mlp.hook_shared_expert_out"} <= {
        r["hook"] for r in out["run"]["recorded"]}
    trace = qwen2moe.run("the cat sat", record=["blocks.1.mlp.hook_expert_indices", "blocks.1.mlp.hook_expert_weights"])
    layer = out["routing"]["layers"][0]
    assert layer["experts"] == trace.activations["blocks.1.mlp.hook_expert_indices"].tolist()
    assert torch.allclose(torch.tensor(layer["weights"]), trace.activations["blocks.1.mlp.hook_expert_weights"])
    assert sum(layer["load"]) == pytest.approx(2.0)  # two experts per token
    assert out["ablated"]["layers"][0]["load"][0] == 0.0
    assert len(out["edit"]["results"]) == 2
    # the chosen experts (integers) compare as numbers beside the float activations
    diffs = {d["hook"]: d for d in out["compared"]["activations"]}
    assert {"blocks.1.mlp.hook_expert_indices", "blocks.1.mlp.hook_expert_out"} <= set(diffs)


def test_bad_moe_configs_are_named(hf_moe, tmp_path):
    import shutil

    from workbench.config import MoEConfig

    with pytest.raises(ModelLoadError, match="1 to 4 experts per token"):
        MoEConfig(n_experts=4, n_experts_used=5, d_expert=64)
    _, path = hf_moe("mixtral")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(ModelLoadError, match="experts per token"):
        workbench.load(broken)
    (broken / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_experts_per_tok"}))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        workbench.load(broken)
    (broken / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(broken / "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if ".experts.1." not in n}, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="expert 1 of blk.0.ffn_.*_exps.weight is missing"):
        workbench.load(broken)


# ------------------------------------------------------------------------------------------------ decode by pair

# Where ``run_experts_by_pair`` runs its Triton kernels: a GPU, else the interpreter on CPU tensors (tests/conftest.py
# sets TRITON_INTERPRET=1 where no GPU is present).
BY_PAIR_DEVICE = ("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                  else "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None)
needs_by_pair_device = pytest.mark.skipif(BY_PAIR_DEVICE is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def _grouped(monkeypatch, *args) -> torch.Tensor:
    """``run_experts`` on the path that groups the pairs by expert (the prefill path)."""
    from workbench import moe

    with monkeypatch.context() as patch:
        patch.setattr(moe, "decodes_by_pair", lambda x, indices, w: False)
        return moe.run_experts(*args)


def _random_experts(layout: str, fmt: str, n: int, d: int, f: int):
    from workbench.config import MoEConfig
    from workbench.kernels import QuantTensor
    from workbench.moe import MoEWeights

    def matrix(rows: int, cols: int) -> QuantTensor:
        return QuantTensor.quantize(torch.randn(rows, cols) * 0.3, fmt).to(BY_PAIR_DEVICE)

    router = QuantTensor.quantize(torch.randn(n, d), "F32")
    if layout == "gate_up":  # Gemma 4's fused stack: each expert's gate rows, then its up rows
        w = MoEWeights(router=router, down=matrix(n * d, f), gate_up=matrix(n * 2 * f, d))
    else:
        w = MoEWeights(router=router, down=matrix(n * d, f), gate=matrix(n * f, d), up=matrix(n * f, d))
    config = MoEConfig(n, 2, f)
    if layout == "gpt-oss":  # biases and the clamped SwiGLU
        w.gate_bias, w.up_bias, w.down_bias = (torch.randn(n, m, device=BY_PAIR_DEVICE) for m in (f, f, d))
        config = MoEConfig(n, 2, f, swiglu_limit=0.5, swiglu_alpha=1.702)
    return w, config


@needs_by_pair_device
@pytest.mark.parametrize("layout, fmt, activation", [("split", "Q8_0", "silu"), ("gate_up", "Q8_0", "gelu_tanh"),
                                                     ("gpt-oss", "MXFP4", "silu"), ("split", "F32", "silu")])
def test_experts_by_pair_equal_grouped(layout, fmt, activation, monkeypatch):
    """Decode's experts (one launch per stacked matrix over all (token, slot) pairs, the routing left on the device)
    against the grouped path, for each expert layout: split gate and up, Gemma 4's fused gate_up with GeGLU, GPT-OSS's
    biases and clamped SwiGLU (MXFP4), float experts. One token (decode) and three, experts repeated. (Every format's
    kernel: tests/test_triton_kernels.py.)"""
    from workbench.moe import run_experts, run_experts_by_pair

    torch.manual_seed(0)
    n, d, f = 4, 64, 32
    w, config = _random_experts(layout, fmt, n, d, f)
    for indices in ([[3, 1]], [[0, 2], [2, 0], [3, 2]]):
        indices = torch.tensor(indices, device=BY_PAIR_DEVICE)
        x = torch.randn(len(indices), d, device=BY_PAIR_DEVICE)
        grouped = _grouped(monkeypatch, x, indices, w, config, activation)
        by_pair = run_experts_by_pair(x, indices, w, config, activation)
        assert by_pair.shape == grouped.shape == (len(indices), 2, d)
        assert (by_pair - grouped).abs().max() <= 1e-5 * grouped.abs().max(), (layout, indices)
        if BY_PAIR_DEVICE == "cuda" and fmt != "F32" and len(indices) == 1:  # the same GEMV on one row
            assert torch.equal(by_pair, grouped)
            assert torch.equal(run_experts(x, indices, w, config, activation), by_pair)  # decode takes it


@needs_by_pair_device
def test_decode_by_pair_equals_grouped(tiny_model, monkeypatch):
    """A Qwen3-MoE model's decode through the KV cache, experts by pair, against the grouped path: the same logits at
    every step (the 5-token prompt has more pairs than experts, so its prefill groups them either way)."""
    from workbench import moe

    model = tiny_model("qwen3moe", "Q8_0", device=BY_PAIR_DEVICE, dtype=torch.float32, n_experts=8, n_experts_used=3,
                       d_expert=64)
    by_pair_rule = moe.decodes_by_pair
    if BY_PAIR_DEVICE == "cpu":  # the rule but for the device: the interpreter runs the kernels on CPU tensors
        by_pair_rule = lambda x, indices, w: indices.numel() <= len(w.experts)  # noqa: E731
    taken = []

    def decode(rule) -> list[torch.Tensor]:
        def recorded(x, indices, w) -> bool:
            taken.append(rule(x, indices, w))
            return taken[-1]

        monkeypatch.setattr(moe, "decodes_by_pair", recorded)
        cache = model.runner.new_cache(16)
        logits = [model.runner.forward(torch.tensor(IDS[:5]), cache=cache, last_logits_only=True)]
        for token in IDS[5:8]:
            logits.append(model.runner.forward(torch.tensor([token]), cache=cache, last_logits_only=True))
        return logits

    by_pair = decode(by_pair_rule)
    assert taken == [False] * 2 + [True] * 6  # 2 layers: the prefill grouped, each of 3 decode steps by pair
    grouped = decode(lambda x, indices, w: False)
    for step, (a, b) in enumerate(zip(by_pair, grouped)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), step


@pytest.mark.skipif(BY_PAIR_DEVICE != "cuda", reason="needs a CUDA GPU")
def test_moe_decode_step_is_built_on_cuda(tiny_model, monkeypatch):
    """On CUDA an MoE model decodes in the built step (compiled, captured as a CUDA graph: no host sync in the
    experts; a graph of the eager forward too), greedily choosing the tokens the eager grouped path chooses."""
    import warnings

    from workbench import generation, moe

    model = tiny_model("qwen3moe", "Q4_K", device="cuda", dtype=torch.float32, **K_SHAPE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = model.runner.new_static_cache(32)
        model.runner.forward(torch.tensor(IDS[:5]), cache=cache, last_logits_only=True)
        assert generation.build_decode_step(model.runner, cache, compiled=False) is not None
        built = list(generation.generate_tokens(model.runner, IDS[:5], 8, compiled=True))
    assert not [str(w.message) for w in caught if "failed" in str(w.message)]  # neither build fell back
    monkeypatch.setattr(moe, "decodes_by_pair", lambda x, indices, w: False)
    eager = list(generation.generate_tokens(model.runner, IDS[:5], 8, compiled=False))
    assert built == eager and len(built) == 8
