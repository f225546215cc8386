"""Every model family against transformers on tiny random checkpoints, and the hook invariants on each.

The checkpoints switch each family's features on where a short prompt shows them: a sliding window of 4 on
alternating layers, soft caps, a local rope base, linear rope scaling, partial rotary, a query scale other than
sqrt(d_head).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import workbench
from workbench import hooks
from workbench.errors import ModelLoadError
from workbench.loading import load_checkpoint
from workbench.synthetic import random_hf_checkpoint, write_gguf

from test_loading import write_hf_tokenizer

FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"]
IDS = [5, 77, 120, 3, 250, 9, 14, 200, 31, 64, 8, 199]


@pytest.mark.parametrize("family", ["mistral", "llama3", "gemma2", "gemma3", "phi3", "olmo2"])
def test_hf_checkpoint_matches_transformers(family, tmp_path):
    reference = random_hf_checkpoint(family, tmp_path)
    write_hf_tokenizer(tmp_path)
    ours = workbench.load(tmp_path, device="cpu")
    assert ours.config.architecture == ("llama" if family in ("mistral", "llama3") else family)
    if family in ("mistral", "gemma2", "gemma3"):
        assert ours.config.sliding_window == 4
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0].float()
    got = ours.forward(IDS)
    assert (got - expected).abs().max().item() < 1e-4
    # decoding through the cache, one token at a time past the window, gives the same logits
    cache = ours.new_cache()
    stepped = torch.cat([ours.forward(IDS[:3], cache=cache)] + [ours.forward([t], cache=cache) for t in IDS[3:]])
    assert (stepped - expected).abs().max().item() < 1e-4



def transformers_reference(path: Path):
    """The float32 transformers model of a checkpoint folder, read back from its config.json as transformers reads
    it (eager attention: the one that takes soft caps)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("family, settings, expected", [
    ("gemma2", {}, (True, False, True, False)),
    ("gemma3", {"sliding_window_pattern": 3}, (True, True, False, True)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, (False, True, True, True)),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 4}, ()),
])
def test_sliding_layers_without_layer_types(family, settings, expected, tmp_path):
    """A config.json that names no ``layer_types`` (Gemma 2's and Gemma 3's on the Hub, Qwen's) slides the layers
    transformers' config class makes slide: Gemma's every n-th layer global, Qwen's only with ``use_sliding_window``
    and from ``max_window_layers`` on."""
    random_hf_checkpoint(family, tmp_path, **settings)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps({**config, **settings}))
    write_hf_tokenizer(tmp_path)
    ours = workbench.load(tmp_path, device="cpu")
    assert ours.config.sliding_layers == expected
    with torch.no_grad():
        reference = transformers_reference(tmp_path)(torch.tensor([IDS])).logits[0].float()
    assert (ours.forward(IDS) - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("family, settings, message", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for llama"),
    ("qwen2", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported for qwen2"),
    ("phi3", {"hidden_act": "gelu_new"}, "hidden_act 'gelu_new' is not supported for phi3"),
    # exact GELU, not the tanh approximation Gemma computes
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for gemma2"),
    ("gemma3", {"use_bidirectional_attention": True}, "bidirectional attention is not supported"),
])
def test_settings_that_change_transformers_forward_are_refused(family, settings, message, tmp_path):
    """A setting under which transformers computes another model than the family's (another MLP activation, attention
    without the causal mask) is refused in one line naming it, not run as the family's usual model."""
    random_hf_checkpoint(family, tmp_path, **settings)
    write_hf_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match=f"^{tmp_path}/config.json: {message}"):
        workbench.load(tmp_path, device="cpu")



@pytest.mark.parametrize("family, settings, dropped", [
    ("mixtral", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rms_norm_eps": 1e-5},
     ("rope_parameters", "rms_norm_eps")),
    ("gemma2", {}, ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")),
    ("gpt-oss", {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}, ("rope_parameters",)),
])
def test_settings_a_config_json_leaves_out_take_transformers_defaults(family, settings, dropped, tmp_path):
    """A config.json without a setting its transformers class has a default for (Mixtral's rope base of 1e6, Gemma 2's
    soft caps and query scale of 256, GPT-OSS's YaRN rope) loads as transformers builds it from the same file."""
    random_hf_checkpoint(family, tmp_path, **settings)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in dropped}))
    write_hf_tokenizer(tmp_path)
    ours = workbench.load(tmp_path, device="cpu")
    with torch.no_grad():
        reference = transformers_reference(tmp_path)(torch.tensor([IDS])).logits[0].float()
    assert (ours.forward(IDS) - reference).abs().max().item() < 1e-4


def test_gemma3_attention_soft_cap_setting_is_ignored_as_transformers_does(tmp_path):
    """Gemma 3's config class keeps attn_logit_softcapping, but neither transformers' Gemma 3 nor llama.cpp's caps
    attention scores (Gemma 2 does): a config that sets it loads to transformers' logits, uncapped."""
    reference = random_hf_checkpoint("gemma3", tmp_path, attn_logit_softcapping=4.0)
    write_hf_tokenizer(tmp_path)
    ours = workbench.load(tmp_path, device="cpu")
    assert ours.config.attn_softcap is None
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0].float()
    assert (ours.forward(IDS) - expected).abs().max().item() < 1e-4


def test_stored_lm_head_is_read_whatever_tie_word_embeddings_says(tmp_path):
    """A folder whose config.json says tie_word_embeddings but which stores lm_head.weight: transformers reads that
    unembedding, and so does the loader (instead of refusing the folder)."""
    random_hf_checkpoint("llama", tmp_path, tie=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    write_hf_tokenizer(tmp_path)
    ours = workbench.load(tmp_path, device="cpu")
    assert not ours.config.tied_embeddings
    with torch.no_grad():
        reference = transformers_reference(tmp_path)(torch.tensor([IDS])).logits[0].float()
    assert (ours.forward(IDS) - reference).abs().max().item() < 1e-4


def test_olmo3_matches_transformers_and_its_llama_cpp_conversion(tmp_path):
    """OLMo 3 (OLMo 2 with three sliding layers to each global one) from its transformers folder: the global layers'
    rope YaRN-scaled, the sliding layers' not, transformers' logits. llama.cpp's converter writes it as olmo2, whose
    graph rotates the sliding layers unscaled too: the GGUF loads to the same model, but for the YaRN attention factor,
    which llama.cpp computes as 0.1 ln(factor) + 1 whatever the file says."""
    from moe_reference import LLAMA_CPP_SOURCE, convert_with_llama_cpp

    reference = random_hf_checkpoint("olmo3", tmp_path / "hf")
    write_hf_tokenizer(tmp_path / "hf")
    ours = workbench.load(tmp_path / "hf", device="cpu")
    c = ours.config
    assert (c.architecture, c.sliding_layers, c.rope_base_local) == ("olmo2", (True, True, True, False), 10000.0)
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0].float()
    assert (ours.forward(IDS) - expected).abs().max().item() < 1e-4
    if not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp's source tree (WORKBENCH_LLAMA_CPP_SOURCE) is not here")
    from_gguf = workbench.load(convert_with_llama_cpp(tmp_path / "hf", tmp_path / "olmo3.gguf"), device="cpu")
    llama_cpp_yarn = dataclasses.replace(c.rope_yarn, attn_factor=0.1 * math.log(8.0) + 1)
    assert from_gguf.config.rope_yarn == llama_cpp_yarn and from_gguf.config.rope_base_local == 10000.0
    checkpoint = load_checkpoint(tmp_path / "hf")
    as_llama_cpp = workbench.Model(dataclasses.replace(checkpoint, config=dataclasses.replace(
        c, rope_yarn=llama_cpp_yarn)), "cpu")
    assert (from_gguf.forward(IDS) - as_llama_cpp.forward(IDS)).abs().max().item() < 1e-5

def test_phi3_long_rope_matches_transformers(tmp_path):
    """Phi-3.5's LongRoPE: the short factors below the original context (8 positions here), as transformers computes a
    forward there; from it on the long ones, each position as transformers' cached decoding rotates it when it is new.
    Written as llama.cpp's converter stores it (the factors as tensors), it loads back to the same logits."""
    reference = random_hf_checkpoint("phi3.5", tmp_path / "hf")
    write_hf_tokenizer(tmp_path / "hf")
    ours = workbench.load(tmp_path / "hf", device="cpu")
    original = ours.config.rope_long.original_context
    assert original == 8 and ours.config.rope_long.attn_factor == pytest.approx(math.sqrt(1 + math.log(16) / math.log(8)))
    steps = []
    with torch.no_grad():
        out = reference(torch.tensor([IDS[:original]]), use_cache=True)
        for token in IDS[original:]:
            steps.append(out.logits[0])  # positional: the cache's keyword and field are renamed across versions
            out = reference(torch.tensor([[token]]), None, None, out.get("cache", out.get("past_key_values")),
                            use_cache=True)
        expected = torch.cat(steps + [out.logits[0]]).float()
        whole = reference(torch.tensor([IDS])).logits[0].float()  # the long factors at every position
    got = ours.forward(IDS)
    assert (got - expected).abs().max().item() < 1e-4
    assert (got[original:] - whole[original:]).abs().max().item() > 1e-3  # the long factors matter here
    checkpoint = load_checkpoint(tmp_path / "hf")
    path = write_gguf(tmp_path / "phi35.gguf", checkpoint.config, checkpoint.weights)
    loaded = workbench.load(path, device="cpu")
    assert loaded.config.rope_long.attn_factor == pytest.approx(ours.config.rope_long.attn_factor)  # stored float32
    assert (loaded.forward(IDS) - got).abs().max().item() < 1e-5


def test_llama3_rope_scaling_as_llama_cpp_stores_it(tmp_path):
    """Llama 3.1's rope scaling from a folder becomes the per-pair divisors llama.cpp's converter writes (1 for short
    wavelengths, the factor for long ones, smooth between), kept through a GGUF round trip; without them the logits
    differ."""
    random_hf_checkpoint("llama3", tmp_path / "hf")
    write_hf_tokenizer(tmp_path / "hf")
    ours = workbench.load(tmp_path / "hf", device="cpu")
    checkpoint = load_checkpoint(tmp_path / "hf")
    divisors = checkpoint.weights.rope_freq_factors
    assert divisors[0].item() == 1.0 and 1.0 < divisors[1].item() < 8.0 and torch.all(divisors[2:] == 8.0)
    path = write_gguf(tmp_path / "llama3.gguf", checkpoint.config, checkpoint.weights)
    assert torch.equal(workbench.load(path, device="cpu").forward(IDS), ours.forward(IDS))
    unscaled = load_checkpoint(tmp_path / "hf")
    unscaled.weights.rope_freq_factors = None
    plain = write_gguf(tmp_path / "plain.gguf", unscaled.config, unscaled.weights)
    assert (workbench.load(plain, device="cpu").forward(IDS) - ours.forward(IDS)).abs().max().item() > 1e-3


def test_rope_scaling_errors_name_the_config_once(tmp_path):
    random_hf_checkpoint("llama3", tmp_path)
    write_hf_tokenizer(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.get("rope_parameters") or config["rope_scaling"]
    del rope["low_freq_factor"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"^{tmp_path}/config.json: its rope scaling lacks 'low_freq_factor'$"):
        workbench.load(tmp_path, device="cpu")
    rope["rope_type"] = "dynamic"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"^{tmp_path}/config.json: rope scaling 'dynamic' is not supported "):
        workbench.load(tmp_path, device="cpu")


@pytest.mark.parametrize("family", FAMILIES + ["gemma4", "gpt-oss"])
def test_gguf_round_trip(family, tmp_path, tiny_checkpoint, tiny_model):
    """Written as llama.cpp's converter stores the family (fused tensors, norm names, metadata keys), a model loads
    back to the same config and the same logits: the random model is what its file is (Gemma 4's attention scale of 1
    and value norm; GPT-OSS's sinks, output bias, routing and expert biases)."""
    checkpoint = tiny_checkpoint(family, "Q8_0", seed=2)
    path = write_gguf(tmp_path / f"{family}.gguf", checkpoint.config, checkpoint.weights, checkpoint.metadata)
    loaded = workbench.load(path, device="cpu")
    assert loaded.config == checkpoint.config
    assert torch.equal(loaded.forward(IDS), tiny_model(family, "Q8_0", seed=2, device="cpu").forward(IDS))


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """Tiny random Gemma 4 models loaded from their transformers folders, dense and MoE (with the reference)."""
    models = {}

    def load(family: str):
        if family not in models:
            path = tmp_path_factory.mktemp(family)
            reference = random_hf_checkpoint(family, path, initializer_range=0.2)
            write_hf_tokenizer(path)
            models[family] = workbench.load(path, device="cpu"), reference
            load.paths[family] = path
        return models[family]
    load.paths = {}
    return load


@pytest.mark.parametrize("family, refused", [
    ("gemma4", "global layers with their own head shape"),
    ("gemma4moe", "global layers with their own head shape, experts beside the dense MLP"),
    ("gemma4e", "global layers with their own head shape, per-layer embeddings, layers reusing keys and values, "
                "per-layer MLP widths")])
def test_write_gguf_refuses_gemma4_layouts_it_cannot_write(family, refused, gemma4, tmp_path):
    """``synthetic.write_gguf`` wrote these as if every layer had one shape, a file that did not load: it names them."""
    gemma4(family)
    checkpoint = load_checkpoint(gemma4.paths[family])
    with pytest.raises(ValueError, match=f"write_gguf cannot write {refused}; convert the folder with llama.cpp's"):
        write_gguf(tmp_path / "gemma4.gguf", checkpoint.config, checkpoint.weights)
    assert not (tmp_path / "gemma4.gguf").exists()


@pytest.mark.parametrize("family", ["gemma4", "gemma4moe", "gemma4e"])
def test_gemma4_matches_transformers(family, gemma4):
    """Gemma 4 (the 31B's layout, the 26B-A4B's experts beside the dense MLP, the E2B's per-layer embeddings and layers
    reusing earlier layers' keys and values) from its transformers folder: float32 logits within 1e-4 of
    transformers', on the whole prompt, token by token through the KV cache (whose global layers hold other head
    shapes than its sliding ones), and after cache surgery; greedy generation past the window takes the tokens a full
    forward picks."""
    ours, reference = gemma4(family)
    c, layers = ours.config, ours.runner.weights.layers
    global_kv_heads = None if family == "gemma4e" else 1
    assert (c.d_head, c.n_kv_heads, c.d_head_global, c.n_kv_heads_global, c.sliding_window) == (
        16, 2, 32, global_kv_heads, 4)
    assert c.attn_scale == 1.0 and (c.moe is not None and c.moe.dense_mlp) == (family == "gemma4moe")
    if family == "gemma4e":
        assert (c.d_per_layer, c.kv_shared_layers, c.d_mlp_layers) == (8, 2, (96, 96, 192, 192))
        assert [c.kv_source(i) for i in range(4)] == [0, 1, 0, 1] and layers[2].wk is None
    else:  # attention_k_eq_v: the global layers' values are the key projection
        assert layers[1].wv.data.data_ptr() == layers[1].wk.data.data_ptr()
    # the proportional rope: a quarter of the 16 pairs of a global head turn
    assert torch.equal(ours.runner.weights.rope_freq_factors, torch.tensor([1.0] * 4 + [1e30] * 12))
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0].float()
    assert expected.abs().max() > 1.0  # a real spread of logits (under the soft cap of 3)
    assert (ours.forward(IDS) - expected).abs().max().item() < 1e-4
    cache = ours.new_cache()
    stepped = torch.cat([ours.forward(IDS[:3], cache=cache)] + [ours.forward([t], cache=cache) for t in IDS[3:]])
    assert (stepped - expected).abs().max().item() < 1e-4
    assert [tuple(cache.get(i)[0].shape) for i in range(2)] == [(2, len(IDS), 16), (global_kv_heads or 2, len(IDS), 32)]
    cache.truncate(7)  # continuing from the first 7 slots is a run on the first 7 tokens
    assert (ours.forward(IDS[7:], cache=cache) - expected[7:]).abs().max().item() < 1e-4
    generated = [token for token, _ in ours.stream(IDS, 8, temperature=0.0)]
    prompt = list(IDS)
    for token in generated:
        assert token == int(ours.forward(prompt)[-1].argmax())
        prompt.append(token)


def test_gemma4_multimodal_folder_loads_its_text_decoder(tmp_path):
    """A Gemma4ForConditionalGeneration folder (text settings under text_config, tensors under
    model.language_model) loads as its text decoder, with transformers' logits."""
    import transformers

    from workbench.synthetic import _GEMMA4

    text = transformers.Gemma4TextConfig(vocab_size=273, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.2,
                                         **_GEMMA4)
    config = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None, initializer_range=0.2)
    torch.manual_seed(0)
    reference = transformers.Gemma4ForConditionalGeneration(config).eval()
    reference.save_pretrained(tmp_path)
    write_hf_tokenizer(tmp_path)
    ours = workbench.load(tmp_path, device="cpu")
    assert (ours.config.architecture, ours.config.d_head_global) == ("gemma4", 32)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([IDS])).logits[0]
    assert expected.abs().max() > 1.0 and (ours.forward(IDS) - expected).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("family", ["gemma4", "gemma4moe", "gemma4e"])
def test_gemma4_cuda_matches_cpu(family, gemma4):
    """On CUDA (fused projections, per-layer cache shapes in the static cache of the compiled decode step, experts
    beside the dense MLP, reused keys and values) Gemma 4 computes what it computes on the CPU."""
    cpu = gemma4(family)[0]
    cuda = workbench.load(gemma4.paths[family], device="cuda", dtype=torch.float32)
    assert (cuda.forward(IDS).cpu() - cpu.forward(IDS)).abs().max().item() < 1e-4
    expected = cpu.generate(IDS, 12, temperature=0.0)
    assert cuda.generate(IDS, 12, temperature=0.0, compiled=False) == expected
    assert cuda.generate(IDS, 12, temperature=0.0, compiled=True) == expected


def test_gemma4_hook_points_mean_what_transformers_computes(gemma4):
    """TransformerLens has no Gemma 4: its hook points are checked against transformers' own intermediate outputs on
    the same checkpoint (the embedding, every block's output but the last, which transformers gives normed, every
    attention pattern, the router's probabilities)."""
    ours, reference = gemma4("gemma4moe")
    with torch.no_grad():
        out = reference(torch.tensor([IDS]), output_hidden_states=True, output_attentions=True,
                        output_router_logits=True)
    if getattr(out, "router_logits", None) is None:
        pytest.skip("this transformers' Gemma 4 does not return router logits (5.24 does)")
    acts = ours.run(IDS, record=["*"]).activations
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(acts["hook_embed"], out.hidden_states[0][0], **close)
    for i in range(ours.config.n_layers):
        if i + 1 < ours.config.n_layers:
            torch.testing.assert_close(acts[f"blocks.{i}.hook_resid_post"], out.hidden_states[i + 1][0], **close)
        torch.testing.assert_close(acts[f"blocks.{i}.attn.hook_pattern"], out.attentions[i][0], **close)
        torch.testing.assert_close(acts[f"blocks.{i}.mlp.hook_router_logits"].softmax(-1), out.router_logits[i],
                                   **close)


def test_gemma4_expert_ablation_equals_hand_computation(gemma4):
    """Gemma 4's experts run beside the dense MLP: dropping an expert leaves the dense branch as it was, and the
    experts' branch is the norm of the remaining experts' weighted outputs (the weights include each expert's scale)."""
    ours, _ = gemma4("gemma4moe")
    points = ["mlp.hook_expert_indices", "mlp.hook_expert_weights", "mlp.hook_expert_out", "mlp.hook_dense_out",
              "mlp.hook_experts_out"]
    record = [f"blocks.1.{p}" for p in points]
    clean = ours.run(IDS, record=record).activations
    indices = clean["blocks.1.mlp.hook_expert_indices"]
    expert = int(indices[0, 0])
    spec = {"type": "ablate_expert", "experts": [expert], "layer": 1}
    ablated = ours.run(IDS, record=record, interventions=[spec]).activations
    assert torch.equal(ablated["blocks.1.mlp.hook_dense_out"], clean["blocks.1.mlp.hook_dense_out"])
    hit = indices == expert
    assert hit.any() and (~hit).any()
    kept = clean["blocks.1.mlp.hook_expert_weights"].masked_fill(hit, 0.0)
    experts = (clean["blocks.1.mlp.hook_expert_out"] * kept[..., None]).sum(1)
    post_norm = ours.runner.weights.layers[1].experts_post_norm
    expected = experts * torch.rsqrt(experts.pow(2).mean(-1, keepdim=True) + ours.config.rms_eps) * post_norm
    torch.testing.assert_close(ablated["blocks.1.mlp.hook_experts_out"], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ablated["blocks.1.mlp.hook_experts_out"], clean["blocks.1.mlp.hook_experts_out"])


@pytest.mark.parametrize("family", FAMILIES + ["gemma4", "gemma4moe", "gemma4e"])
def test_hook_invariants(family, tiny_model, gemma4):
    """On every family: recording every hook point changes no bit; a zero steer on every point and a self-patch of
    every point are identities; every point the forward reaches is listed with its shape."""
    model = gemma4(family)[0] if family.startswith("gemma4") else tiny_model(family, "Q8_0", seed=1, device="cpu")
    plain = model.forward(IDS)
    trace = model.run(IDS, record=["*"])
    assert torch.equal(trace.logits, plain)
    shapes = model.hook_points()
    assert set(trace.activations) == set(shapes) - {n for n in shapes if n.endswith("attn.hook_result")} | {
        n for n in trace.activations if n.endswith("attn.hook_result")}
    for name, activation in trace.activations.items():
        expected = shapes[name].strip("[]").split(", ")
        assert len(expected) == activation.dim(), name
    steers = [hooks.Steer(name, torch.zeros(activation.shape[-1]), scale=1.0)
              for name, activation in trace.activations.items()
              if hooks.points.feature_size(name, model.config) == activation.shape[-1]]
    assert torch.equal(model.forward(IDS, interventions=steers), plain)
    patch = hooks.Patch("*", donor=trace)
    assert torch.equal(model.forward(IDS, interventions=[patch]), plain)


@pytest.mark.parametrize("family", FAMILIES + ["gemma4", "gemma4e"])
def test_activation_cache_reads_the_logits_and_splits_a_summed_stream(family, tiny_model, gemma4):
    """TransformerLens' cache of a trace: the last normalized residual through W_U is the logits before the final soft
    cap; the stream decomposes into the embedding and the blocks' outputs where it is their sum, and Gemma 4, whose
    blocks scale their output (and whose E2B layout adds per-layer inputs), is refused, with the model or without."""
    from workbench.errors import WorkbenchError

    model = gemma4(family)[0] if family.startswith("gemma4") else tiny_model(family, "Q8_0", seed=1, device="cpu")
    trace = model.run(IDS, record=["hook_embed", "blocks.*.hook_resid_*", "blocks.*.hook_*_out", "*.hook_scale"])
    cache = trace.to_activation_cache(model)
    raw = cache.accumulated_resid(apply_ln=True)[-1, 0] @ cache.model.W_U
    cap = model.config.final_softcap
    torch.testing.assert_close(torch.tanh(raw / cap) * cap if cap else raw, trace.logits, rtol=1e-4, atol=1e-4)
    if family.startswith("gemma4"):
        for view in (model, None):
            with pytest.raises(WorkbenchError, match="gemma4 scales each block's output"):
                trace.to_activation_cache(view).decompose_resid()
    else:
        last = trace.activations[f"blocks.{model.config.n_layers - 1}.hook_resid_post"]
        torch.testing.assert_close(cache.decompose_resid().sum(0)[0], last, rtol=1e-5, atol=1e-5)


def test_sliding_window_masks_by_position(tiny_model):
    """On a sliding layer a token attends to the last ``window`` positions only (its pattern is zero before), also
    after cache surgery, where the kept slots keep their positions."""
    model = tiny_model("gemma2", "Q8_0", device="cpu")
    window = model.config.sliding_window
    sliding = [i for i in range(model.config.n_layers) if model.config.is_sliding(i)]
    pattern = model.run(IDS, record=[f"blocks.{sliding[0]}.attn.hook_pattern"]).activations[
        f"blocks.{sliding[0]}.attn.hook_pattern"]
    for t in range(len(IDS)):
        first = max(0, t - window + 1)
        assert (pattern[:, t, :first] == 0).all() and (pattern[:, t, first: t + 1] > 0).all()
    # surgery: with slots 6 and 7 deleted, the next token (position len(IDS)) sees the kept slots within the window
    cache = model.new_cache()
    model.forward(IDS, cache=cache)
    cache.delete_positions([6, 7])
    seen = []
    model.forward([42], cache=cache, interventions=[(f"blocks.{sliding[0]}.attn.hook_pattern",
                                                     lambda x, ctx: seen.append(x[:, 0]))])
    kept_positions = [p for p in range(len(IDS)) if p not in (6, 7)] + [len(IDS)]
    visible = torch.tensor([len(IDS) - p < window for p in kept_positions])
    assert (seen[0][:, ~visible] == 0).all() and (seen[0][:, visible] > 0).all()


def test_unsupported_family_names_the_supported_ones(tmp_path, tiny_checkpoint):
    import gguf

    path = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(str(path), "bloom")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'bloom'; supported: .*gemma2.*olmo2"):
        workbench.load(path, device="cpu")


@pytest.mark.parametrize("family, missing", [("gemma2", "blk.1.post_ffw_norm.weight"),
                                             ("phi3", "blk.0.attn_qkv.weight"),
                                             ("olmo2", "blk.0.attn_k_norm.weight")])
def test_missing_family_tensor_names_it(family, missing, tmp_path, tiny_checkpoint, monkeypatch):
    from workbench import loading

    checkpoint = tiny_checkpoint(family, "Q8_0")
    path = write_gguf(tmp_path / "model.gguf", checkpoint.config, checkpoint.weights, checkpoint.metadata)
    read = loading._read_gguf

    def without_tensor(path):
        file = read(path)
        assert missing in file.tensors
        del file.tensors[missing]
        return file

    monkeypatch.setattr(loading, "_read_gguf", without_tensor)
    with pytest.raises(ModelLoadError, match=f"tensor {missing} is missing"):
        workbench.load(path, device="cpu")


def test_info_names_the_family_features(tiny_model):
    info = tiny_model("gemma2", "Q8_0", device="cpu").info()
    assert {"attention-logit soft-capping", "final-logit soft-capping"} <= set(info["family"]["features"])
    assert info["family"]["sliding_window"] == 4


GEMMA4_FEATURES = ["norms after attention and MLP", "embeddings x sqrt(d_model)", "GeGLU (tanh GELU)",
                   "per-head q/k RMSNorm and value RMSNorm, attention scale 1", "sliding-window and global layers",
                   "global layers with their own head size or key/value heads", "local and global rope bases",
                   "proportional (partial) rope on global layers"]


@pytest.mark.parametrize("fixture, expected", [
    # its global layers store no attn_v
    ("gemma4-Q8_0", GEMMA4_FEATURES + ["values from the key projection", "per-layer output scale",
                                       "final-logit soft-capping"]),
    # every layer with keys stores attn_v; per-layer embeddings, and the last two layers reuse keys and values
    ("gemma4e-Q8_0", GEMMA4_FEATURES + ["per-layer output scale", "per-layer embeddings",
                                        "layers reusing an earlier layer's keys and values",
                                        "final-logit soft-capping"]),
    # no rope_freqs tensor; a quarter of each head rotates
    ("phi3-Q8_0", ["fused qkv and gate/up matrices", "partial rotary"]),
    ("gemma4moe-Q4_K_M", GEMMA4_FEATURES + [
        "values from the key projection", "per-layer output scale", "final-logit soft-capping",
        "mixture of experts: 4 experts of 32, 2 per token by softmax routing, weights normalized, "
        "beside the dense MLP"]),
])
def test_info_lists_the_features_the_loaded_model_has(fixture, expected):
    import gguf

    path = Path(__file__).parent / "fixtures" / "families" / f"{fixture}.gguf"
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    model = workbench.load(path, device="cpu")
    assert model.info()["family"]["features"] == expected
    # what the lists above say of the files
    with_keys = [i for i in range(model.config.n_layers) if f"blk.{i}.attn_k.weight" in names]
    without_values = [i for i in with_keys if f"blk.{i}.attn_v.weight" not in names]
    assert bool(without_values) == ("values from the key projection" in expected)
    assert ("rope_freqs.weight" in names) == ("proportional (partial) rope on global layers" in expected)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma4", "gemma4moe", "gemma4e"])
def test_batches_slide_as_single_prompts(family, tiny_model, gemma4):
    """Batched runs (padded to the longest prompt, a shared prefix computed once) and batched greedy decoding through
    a BatchKVCache mask each sliding layer's window by position as one prompt at a time does (Gemma 4: with layers of
    two head shapes in the caches)."""
    model = gemma4(family)[0] if family.startswith("gemma4") else tiny_model(family, "Q8_0", device="cpu")
    prompts = [IDS, IDS[:5], IDS[:3] + [7, 8, 9, 10, 11, 12, 13, 14, 15], [9] * 20 + IDS, [9] * 20 + [1, 2, 3]]
    # an MoE's experts multiply a batch's tokens in groups of other sizes than one prompt's: other rounding
    tolerance = 1e-4 if model.config.moe else 1e-5
    for prompt, trace in zip(prompts, model.run_batch(prompts)):
        torch.testing.assert_close(trace.logits, model.forward(prompt), rtol=tolerance, atol=tolerance)
    batched = model.generate_batch(prompts, 6, temperature=0.0)
    assert batched == [model.generate(p, 6, temperature=0.0) for p in prompts]


def test_direct_logit_attribution_refuses_post_norm_families(tiny_model):
    from workbench import probes
    from workbench.errors import WorkbenchError

    with pytest.raises(WorkbenchError, match="gemma2 norms that output first"):
        probes.direct_logit_attribution(tiny_model("gemma2", "Q8_0", device="cpu"), IDS, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "olmo2"])
def test_cuda_matches_cpu(family, tiny_model):
    """On CUDA (Triton glue, fused projections, the compiled decode step) each family computes what it computes on the
    CPU: float32 logits within 1e-4, and greedy decoding past the window gives the same tokens, compiled or not."""
    cpu = tiny_model(family, "Q8_0", device="cpu")
    cuda = tiny_model(family, "Q8_0", device="cuda", dtype=torch.float32)
    assert (cuda.forward(IDS).cpu() - cpu.forward(IDS)).abs().max().item() < 1e-4
    expected = cpu.generate(IDS, 12, temperature=0.0)
    assert cuda.generate(IDS, 12, temperature=0.0, compiled=False) == expected
    assert cuda.generate(IDS, 12, temperature=0.0, compiled=True) == expected
