"""LoRA adapters: PEFT folders and llama.cpp GGUF adapters on the packed base, against transformers + PEFT."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_loading import hf_model

import workbench
from workbench.config import ModelConfig
from workbench.synthetic import write_gguf
from workbench.adapters import AdapterError
from workbench.loading import hash_files
from workbench.errors import HookError, WorkbenchError
from workbench.generation import _BUILT, _forward_and_pick, generate_batch_tokens, generate_tokens, step_key
from workbench.kernels import lora as lora_ops, numerics
from workbench.runner import LoraRows

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = [5, 77, 120, 3, 250, 9, 14, 200]
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_DIR", "/work/cache/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each HF projection, from our config (independently of workbench.adapters)."""
    q, kv, d, m = config.n_heads * config.d_head, config.n_kv_heads * config.d_head, config.d_model, config.d_mlp
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q), "gate_proj": (m, d),
            "up_proj": (m, d), "down_proj": (d, m), "qkv_proj": (q + 2 * kv, d), "gate_up_proj": (2 * m, d)}


def modules_of(arch: str) -> list[str]:
    """The projections a PEFT adapter of ``arch`` targets: Phi-3 fuses q/k/v and gate/up into one matrix each."""
    return ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if arch == "phi3" else MODULES


def write_peft(path: Path, config, r: int = 4, alpha: float = 8.0, modules=MODULES, layers=None, seed: int = 0,
               std: float = 0.2, extra_config: dict | None = None) -> Path:
    """A PEFT LoRA folder with random A and B (B nonzero, unlike a fresh PEFT adapter), written as PEFT saves it."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for i in range(config.n_layers) if layers is None else layers:
        for module in modules:
            out_dim, in_dim = shapes[module]
            kind = "self_attn" if module in (*MODULES[:4], "qkv_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{i}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, in_dim, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, r, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules), "use_rslora": False,
           **(extra_config or {})}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def write_gguf_adapter(path: Path, peft_dir: Path, config, arch: str | None = None,
                       tensor_type=gguf.GGMLQuantizationType.F32) -> Path:
    """A PEFT folder as llama.cpp's convert_lora_to_gguf.py writes it: ``blk.N.<proj>.weight.lora_a/b``, B's q/k rows
    of a llama model permuted for its adjacent-pair rope (written here from the converter's formula)."""
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}  # Phi-3's fused ones, as gguf-py's tensor map names them
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch or config.architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    for name, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        parts = name.split(".")
        layer, module, half = parts[4], parts[6], parts[7][-1].lower()
        if half == "b" and config.rope_interleaved and module in ("q_proj", "k_proj"):
            heads = config.n_heads if module == "q_proj" else config.n_kv_heads
            tensor = tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        data = tensor.float().numpy()
        if tensor_type != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, tensor_type)
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{half}", data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    hf_model("llama", path, tie=False)
    model = workbench.load(path, device="cpu")
    write_peft(path / "a", model.config, seed=1)
    write_peft(path / "b", model.config, r=2, modules=["q_proj", "v_proj"], seed=2)
    model.load_adapter(path / "a")
    model.load_adapter(path / "b")
    return model


# ------------------------------------------------------------------------------------ against PEFT


def test_peft_adapter_on_a_layer_reusing_keys_and_values_matches_transformers_peft(tmp_path):
    """Gemma 4 E2B's last layers project queries but reuse earlier layers' keys and values: an adapter on their
    queries, output and MLP runs as transformers + PEFT computes it (it failed at every call)."""
    peft = pytest.importorskip("peft")
    from test_loading import write_hf_tokenizer
    from workbench.synthetic import random_hf_checkpoint

    reference = random_hf_checkpoint("gemma4e", tmp_path, initializer_range=0.2)
    write_hf_tokenizer(tmp_path)
    last = reference.config.num_hidden_layers - 1
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"],
                             layers_to_transform=[last - 1, last])
    wrapped = peft.get_peft_model(reference, config).eval()
    for name, param in wrapped.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param, std=0.2)
    wrapped.save_pretrained(tmp_path / "adapter")
    ours = workbench.load(tmp_path, device="cpu", adapters={"ft": tmp_path / "adapter"})
    assert ours.adapters["ft"].adapted_layers == [last - 1, last]
    assert [ours.config.kv_source(i) != i for i in (last - 1, last)] == [True, True]
    with torch.no_grad():
        expected = wrapped(torch.tensor([IDS])).logits[0].float()
        with wrapped.disable_adapter():
            base = wrapped(torch.tensor([IDS])).logits[0].float()
    assert (expected - base).abs().max() > 0.1
    assert (ours.forward(IDS, adapter="ft") - expected).abs().max().item() <= 1e-4
    trace = ours.run(IDS, adapter="ft", record=[f"blocks.{last}.attn.hook_q_lora"])
    assert trace.activations[f"blocks.{last}.attn.hook_q_lora"].abs().max() > 0


@pytest.mark.parametrize("arch, rslora", [("llama", False), ("qwen2", False), ("qwen3", True), ("phi3", False)])
def test_peft_adapter_matches_transformers_peft(arch, rslora, tmp_path):
    """Phi-3's adapters are of its fused qkv_proj and gate_up_proj: their B splits by rows as the weights do."""
    peft = pytest.importorskip("peft")
    reference = hf_model(arch, tmp_path, tie=False)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules_of(arch), use_rslora=rslora)
    wrapped = peft.get_peft_model(reference, config).eval()
    for name, param in wrapped.named_parameters():
        if "lora_" in name:  # PEFT starts B at zero: make the adapter act
            torch.nn.init.normal_(param, std=0.2)
    wrapped.save_pretrained(tmp_path / "adapter")
    ours = workbench.load(tmp_path, device="cpu", adapters={"ft": tmp_path / "adapter"})
    with torch.no_grad():
        expected = wrapped(torch.tensor([IDS])).logits[0].float()
        with wrapped.disable_adapter():
            base = wrapped(torch.tensor([IDS])).logits[0].float()
    assert (expected - base).abs().max() > 0.3  # the adapter changes the logits a lot
    assert (ours.forward(IDS, adapter="ft") - expected).abs().max().item() <= 1e-4
    assert (ours.forward(IDS) - base).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_gguf_adapter_equals_peft_folder(arch, tmp_path, tiny_model):
    """The same adapter as a PEFT folder and as llama.cpp's GGUF (q/k rows permuted for llama; Phi-3's fused attn_qkv
    and ffn_up) on a Q8_0 base."""
    model = tiny_model(arch, "Q8_0", cached=False, device="cpu")  # float32: the bounds below are its rounding
    peft_dir = write_peft(tmp_path / "peft", model.config, r=32, alpha=16, std=0.05, seed=3,  # Q8_0 rows hold 32
                          modules=modules_of(arch))
    model.load_adapter(peft_dir, name="peft")
    model.load_adapter(write_gguf_adapter(tmp_path / "a.gguf", peft_dir, model.config), name="gguf")
    model.load_adapter(write_gguf_adapter(tmp_path / "q8.gguf", peft_dir, model.config,
                                          tensor_type=gguf.GGMLQuantizationType.Q8_0), name="q8")
    base, from_peft = model.forward(IDS), model.forward(IDS, adapter="peft")
    assert (from_peft - base).abs().max() > 0.3
    assert (model.forward(IDS, adapter="gguf") - from_peft).abs().max().item() < 1e-5
    assert 0 < (model.forward(IDS, adapter="q8") - from_peft).abs().max().item() < 0.05  # Q8_0's rounding of A, B
    assert model.adapters["gguf"].format == "gguf" and model.adapters["gguf"].alpha == 16.0


@pytest.mark.skipif(not (LLAMA_CPP / "convert_lora_to_gguf.py").is_file(), reason="llama.cpp's source is not here")
def test_llamacpp_converter_output_equals_peft_folder(tmp_path):
    """llama.cpp's own convert_lora_to_gguf.py on a PEFT folder: the GGUF adapter it writes runs as the folder does."""
    hf_model("llama", tmp_path, tie=False)
    model = workbench.load(tmp_path, device="cpu")
    model.load_adapter(write_peft(tmp_path / "adapter", model.config), name="peft")
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_lora_to_gguf.py"), "--base", str(tmp_path), "--outtype",
                    "f32", "--outfile", str(tmp_path / "adapter.gguf"), str(tmp_path / "adapter")], check=True,
                   env=env, capture_output=True)
    model.load_adapter(tmp_path / "adapter.gguf", name="gguf")
    assert torch.equal(model.forward(IDS, adapter="gguf"), model.forward(IDS, adapter="peft"))


# ------------------------------------------------------------------------------------ choosing per call


def test_scale_zero_is_the_base_bit_for_bit(hf_llama):
    base = hf_llama.forward(IDS)
    assert torch.equal(hf_llama.forward(IDS, adapter={"a": 0.0}), base)
    assert torch.equal(hf_llama.forward(IDS, adapter={"a": 0, "b": 0.0}), base)
    assert not torch.equal(hf_llama.forward(IDS, adapter="a"), base)


def test_switching_adapters_leaves_no_trace(hf_llama):
    base, a, b = (hf_llama.forward(IDS, adapter=x) for x in (None, "a", "b"))
    assert not torch.equal(a, b)
    for choice, expected in [("b", b), (None, base), ("a", a), ("b", b), (None, base)]:
        assert torch.equal(hf_llama.forward(IDS, adapter=choice), expected)


def test_scale_and_mix_are_linear_in_the_lora_terms(hf_llama):
    point = "blocks.0.attn.hook_q_lora"  # layer 0's input is the same in every run: its terms add exactly
    terms = {}
    for choice in ("a", "b", {"a": 0.5, "b": 1.0}, {"a": 2.0}):
        trace = hf_llama.run(IDS, record=[point], adapter=choice)
        terms[json.dumps(choice)] = trace.activations[point]
    assert terms['"b"'].shape == (len(IDS), hf_llama.config.n_heads * hf_llama.config.d_head)
    torch.testing.assert_close(terms['{"a": 0.5, "b": 1.0}'], 0.5 * terms['"a"'] + terms['"b"'], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms['{"a": 2.0}'], 2 * terms['"a"'], rtol=1e-5, atol=1e-6)
    # b adapts q and v only: its run fires no other LoRA point
    trace = hf_llama.run(IDS, record=["blocks.*.*_lora"], adapter="b")
    assert sorted({name.split(".", 2)[2] for name in trace.activations}) == ["attn.hook_q_lora", "attn.hook_v_lora"]


def test_batches_and_generation_take_the_adapter(hf_llama):
    prompts = [IDS, IDS[:5], [9, 8, 7]]
    traces = hf_llama.run_batch(prompts, adapter="a")
    for prompt, trace in zip(prompts, traces):
        torch.testing.assert_close(trace.logits, hf_llama.forward(prompt, adapter="a"), rtol=1e-5, atol=1e-5)
        assert trace.adapters[0]["name"] == "a" and trace.adapters[0]["sha256"] == hf_llama.adapters["a"].sha256
    alone = [hf_llama.generate(p, 6, adapter="a") for p in prompts]
    assert hf_llama.generate_batch(prompts, 6, adapter="a") == alone
    assert alone != [hf_llama.generate(p, 6) for p in prompts]


def test_one_adapter_per_prompt_in_a_batch(hf_llama):
    """Prompts of different adapter choices in one batched forward: each equals the prompt run alone with its own."""
    prompts = [IDS, IDS[:5], [9, 8, 7], IDS[2:], [30, 31, 32, 33]]
    choices = ["a", None, {"a": 0.5, "b": 1.0}, "b", "a"]
    point = "blocks.1.attn.hook_k_lora"  # adapted by a alone
    traces = hf_llama.run_batch(prompts, adapter=choices, batch_size=5, record=[point])
    for prompt, choice, trace in zip(prompts, choices, traces):
        alone = hf_llama.run(prompt, adapter=choice, record=[point])
        torch.testing.assert_close(trace.logits, alone.logits, rtol=1e-5, atol=1e-5)
        assert trace.adapters == hf_llama.adapter_record(choice)
        # a prompt whose choice leaves the projection alone records a zero term there
        expected = alone.activations.get(point, torch.zeros_like(traces[0].activations[point][:len(prompt)]))
        # alone, the layers before the point take the fused terms (kernels.lora): the same sums in another order
        torch.testing.assert_close(trace.activations[point], expected, rtol=1e-5, atol=1e-5)
    # decoding together, the prompts leave the batch at their own stop tokens, each with its own adapter's tokens
    runner = hf_llama.runner
    alone = [list(generate_tokens(runner, p, 6, lora=hf_llama.lora_terms(c))) for p, c in zip(prompts, choices)]
    assert len({tuple(t) for t in alone}) == len(prompts)
    stop = alone[1][2]
    expected = [t[:t.index(stop) + 1] if stop in t else t for t in alone]
    got = [[] for _ in prompts]
    rows = LoraRows(tuple(hf_llama.lora_terms(c) for c in choices))
    for i, token in generate_batch_tokens(runner, dict(enumerate(prompts)), 6, stop_ids={stop}, lora=rows):
        got[i].append(token)
    assert got == expected and any(len(t) < 6 for t in got)
    texts = hf_llama.generate_batch(prompts, 6, adapter=choices)
    assert texts == [hf_llama.generate(p, 6, adapter=c) for p, c in zip(prompts, choices)]
    with pytest.raises(WorkbenchError, match=r"one per prompt \(5\), got a list of 2"):
        hf_llama.run_batch(prompts, adapter=["a", "b"])
    with pytest.raises(WorkbenchError, match="prompt 1: unknown adapter 'nope'"):
        hf_llama.generate_batch(prompts[:2], 2, adapter=["a", "nope"])


def assert_built_step_takes_adapters(model, tmp_path) -> None:
    """The built step (a CUDA graph of the compiled forward, or the compiled CPU forward), built with the adapter terms
    as inputs of its own, decodes what the eager forward does for an adapter, a second adapter of the same shape (which
    reuses the first's step, loading its terms), a mix and the base; switching back leaves nothing of the other."""
    runner = model.runner
    for name, options in (("x", {"seed": 1}), ("x2", {"seed": 4}), ("y", {"seed": 2, "r": 2, "modules": MODULES[:3]})):
        model.load_adapter(write_peft(tmp_path / name, model.config, **options), name=name)
    try:
        choices = ["x", "x2", {"x": 0.5, "y": 1.0}, None]
        loras = [model.lora_terms(c) for c in choices]
        eager = [list(generate_tokens(runner, IDS, 10, compiled=False, lora=lora)) for lora in loras]
        assert len({tuple(t) for t in eager}) == len(choices)  # every choice decodes its own tokens
        _BUILT.pop(runner, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager decoding fails the test
            for lora, tokens in [*zip(loras, eager), (loras[0], eager[0])]:  # x again after x2
                assert list(generate_tokens(runner, IDS, 10, compiled=True, lora=lora)) == tokens
        steps = _BUILT[runner]
        assert set(steps) == {step_key("exact", lora) for lora in loras} and len(steps) == 3  # x and x2 share one
        shared = steps[step_key("exact", loras[0])]
        assert shared.lora is not loras[0] and not shared.busy
        torch.testing.assert_close(shared.lora[0][("wq", "wk", "wv")][1], loras[0][0][("wq", "wk", "wv")][1])
    finally:
        for name in ("x", "x2", "y"):
            model.unload_adapter(name)
        _BUILT.pop(runner, None)


def test_decode_step_with_adapters_compiles_without_graph_breaks(hf_llama):
    # a break would make the CUDA step guard on (and recompile for) its temporaries at every replay
    runner = hf_llama.runner
    cache = runner.new_static_cache(16)
    lora = hf_llama.lora_terms({"a": 0.5, "b": 1.0})
    runner.forward(torch.tensor(IDS[:3]), cache=cache, lora=lora)
    explained = torch._dynamo.explain(_forward_and_pick)(runner, torch.tensor([4]), cache, lora)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_built_decode_step_takes_the_adapter(hf_llama, tmp_path):
    assert_built_step_takes_adapters(hf_llama, tmp_path)  # three CPU compiles, ~1 min on 2 cores without torch's cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_takes_the_adapter(tiny_model, tmp_path):
    model = tiny_model("llama", "Q4_K", n_layers=2, d_model=256, d_mlp=512, device="cuda", dtype="float32",
                       cached=False)
    assert_built_step_takes_adapters(model, tmp_path)


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
def test_a_hooked_lora_point_keeps_the_forwards_bits(hf_llama, monkeypatch, mode):
    """A plain run adds each group's terms in one fused call (kernels.lora.add_terms), holding no term apart; a hook on
    a LoRA point holds its group's terms apart, computed by the same call on zero outputs, so that recording any term
    leaves the logits' bits as they are."""
    fused = []
    add_terms = lora_ops.add_terms
    monkeypatch.setattr(lora_ops, "add_terms", lambda x, a, b_t, outs, ranks: fused.append(
        sum(out.abs().max().item() > 0 for out in outs)) or add_terms(x, a, b_t, outs, ranks))
    n_layers = hf_llama.config.n_layers
    with numerics(mode):
        plain = hf_llama.run(IDS, adapter="a")
        assert fused == [3, 1, 2, 1] * n_layers  # every group's terms added to its outputs
        fused.clear()
        hooked = hf_llama.run(IDS, adapter="a", record=["blocks.1.attn.hook_v_lora", "blocks.0.mlp.*_lora"])
        assert fused == [3, 1, 0, 0] + [0, 1, 2, 1] + [3, 1, 2, 1] * (n_layers - 2)  # layer 0's MLP, 1's q/k/v apart
        assert torch.equal(hooked.logits, plain.logits)
        assert set(hooked.activations) == {"blocks.1.attn.hook_v_lora", "blocks.0.mlp.hook_gate_lora",
                                           "blocks.0.mlp.hook_up_lora", "blocks.0.mlp.hook_down_lora"}
        for point in [p for p in hf_llama.hook_points() if p.endswith("_lora")]:
            assert torch.equal(hf_llama.run(IDS, adapter="a", record=[point]).logits, plain.logits), point


def test_scale_adapter_intervention(hf_llama):
    adapted, base = hf_llama.forward(IDS, adapter="a"), hf_llama.forward(IDS)
    removed = hf_llama.forward(IDS, adapter="a", interventions=[{"type": "scale_adapter", "factor": 0}])
    assert torch.equal(removed, base)
    doubled = hf_llama.forward(IDS, adapter="a", interventions=[{"type": "scale_adapter", "factor": 2.0}])
    torch.testing.assert_close(doubled, hf_llama.forward(IDS, adapter={"a": 2.0}), rtol=1e-4, atol=1e-4)
    # only the MLP of layer 1 keeps the adapter: neither the base nor the full adapter
    spec = {"type": "scale_adapter", "factor": 0.0, "layers": [0], "projections": ["q", "k", "v", "o"]}
    partial = hf_llama.run(IDS, adapter="a", interventions=[spec])
    assert partial.interventions == [{**spec, "factor": 0.0}]
    assert not torch.equal(partial.logits, base) and not torch.equal(partial.logits, adapted)
    with pytest.raises(HookError, match="unknown projections"):
        hf_llama.forward(IDS, adapter="a", interventions=[{"type": "scale_adapter", "projections": ["qq"]}])
    with pytest.raises(HookError, match="out of range"):
        hf_llama.forward(IDS, adapter="a", interventions=[{"type": "scale_adapter", "layers": [7]}])


def test_lora_points_match_only_patterns_that_name_them(hf_llama):
    assert not any("lora" in name for name in hf_llama.run(IDS, record=["blocks.0.*"], adapter="a").activations)
    assert "blocks.1.mlp.hook_down_lora" in hf_llama.hook_points()


# ------------------------------------------------------------------------------------ merging


@pytest.mark.parametrize("fmt", [None, "Q8_0", "Q4_1"])
def test_merged_adapter_is_within_one_rounding_of_the_unmerged(fmt, tmp_path):
    """W' = dequantize(W) + s B A re-quantized into W's format: exact in F32; in a quantized format the merged logits
    are nearer the unmerged ones than quantizing the float model once moves them (the adapter's delta is 19 % of W
    here, more than a fine-tune's: the rounding grows with the merged matrix's range)."""
    hf_model("llama", tmp_path, tie=False)
    ids = list(range(3, 40))
    peft_dir = write_peft(tmp_path / "ft", workbench.load(tmp_path, device="cpu").config, seed=1, std=0.03)
    model = workbench.load(tmp_path, device="cpu", quantize=fmt, adapters={"ft": peft_dir})
    base, unmerged = model.forward(ids), model.forward(ids, adapter="ft")
    quantize_drift = (base - workbench.load(tmp_path, device="cpu").forward(ids)).abs().max().item()
    record = model.merge_adapter("ft")
    error = (model.forward(ids) - unmerged).abs().max().item()
    assert (unmerged - base).abs().max() > 0.1  # the adapter moves the logits
    if fmt is None:
        assert error < 1e-5 and record["merged"] == "re-quantized to F32"
    else:
        assert 0 < error < quantize_drift and record["merged"] == f"re-quantized to {fmt}"
        assert set(model.tensor_formats().values()) == {fmt}  # the same formats, the same size
    assert "ft" not in model.adapters and model.list_adapters() == [record]
    assert model.info()["merged_adapters"] == [record] and record["sha256"] == hash_files(
        [peft_dir / "adapter_config.json", peft_dir / "adapter_model.safetensors"])
    with pytest.raises(WorkbenchError, match="unknown adapter 'ft'"):
        model.forward(ids, adapter="ft")
    with pytest.raises(WorkbenchError, match="unknown adapter 'ft'"):
        model.merge_adapter("ft")
    with pytest.raises(WorkbenchError, match="merge must be True or False"):
        workbench.load(tmp_path, device="cpu", adapters={"ft": peft_dir}, merge="ft")


def test_an_adapter_on_a_model_without_pre_norms_equals_its_merge(tmp_path):
    """OLMo 2 normalizes after attention and the MLP, not before: the adapter's terms go to each layer's own device
    all the same, and equal the adapter merged into float32 weights."""
    hf_model("olmo2", tmp_path, tie=False)
    peft_dir = write_peft(tmp_path / "ft", workbench.load(tmp_path, device="cpu").config, seed=1, std=0.05)
    unmerged = workbench.load(tmp_path, device="cpu", adapters={"ft": peft_dir})
    merged = workbench.load(tmp_path, device="cpu", adapters={"ft": peft_dir}, merge=True)
    adapted = unmerged.forward(IDS, adapter="ft")
    assert (adapted - unmerged.forward(IDS)).abs().max() > 0.1
    torch.testing.assert_close(adapted, merged.forward(IDS), rtol=0, atol=1e-4)
    torch.testing.assert_close(unmerged.run_batch([IDS, IDS[:4]], adapter="ft")[0].logits, adapted, rtol=0, atol=1e-4)


def test_a_merge_that_fails_on_a_later_layer_changes_nothing(tmp_path):
    """A delta past the format's range on the last layer is refused before any matrix is replaced."""
    hf_model("llama", tmp_path, tie=False)
    config = workbench.load(tmp_path, device="cpu").config
    peft_dir = write_peft(tmp_path / "ft", config, seed=1, std=0.03)
    huge = write_peft(tmp_path / "huge", config, seed=1, layers=[config.n_layers - 1])
    tensors = {name: t * 1e4 for name, t in load_file(huge / "adapter_model.safetensors").items()}
    save_file({**load_file(peft_dir / "adapter_model.safetensors"), **tensors}, str(huge / "adapter_model.safetensors"))
    model = workbench.load(tmp_path, device="cpu", quantize="Q8_0", adapters={"huge": huge})
    before = model.forward(IDS)
    last = config.n_layers - 1
    with pytest.raises(AdapterError, match=rf"adapter 'huge' cannot merge into layer {last} w_\w+: .* overflows"):
        model.merge_adapter("huge", scale=10.0)
    assert torch.equal(model.forward(IDS), before) and model.merged == [] and "huge" in model.adapters


def test_merge_restacks_fused_projections_and_replays(tmp_path, tiny_checkpoint):
    """A layer whose q/k/v and gate/up are stacked (as on CUDA) serves the merged matrices; a trace of a merged model
    records the merge, a replay on a fresh load merges the same file again, and an unmerged model is refused."""
    checkpoint = tiny_checkpoint("llama", "Q8_0")
    path = write_gguf(tmp_path / "base.gguf", checkpoint.config, checkpoint.weights, checkpoint.metadata)
    peft_dir = write_peft(tmp_path / "ft", checkpoint.config, seed=1, std=0.1)
    plain = workbench.load(path, device="cpu", adapters={"ft": peft_dir}, merge=True)
    fused = workbench.load(path, device="cpu", adapters={"ft": peft_dir})
    for layer in fused.runner.weights.layers:
        layer.fuse_projections()
    fused.merge_adapter("ft")
    assert fused.runner.weights.layers[0].wqkv is not None
    assert torch.equal(fused.forward(IDS), plain.forward(IDS))
    assert not torch.equal(plain.forward(IDS), workbench.load(path, device="cpu").forward(IDS))
    trace = plain.run(IDS, record=["blocks.1.hook_resid_post"])
    assert trace.fingerprint["merged_adapters"] == plain.merged
    trace.save(tmp_path / "trace")
    assert workbench.replay(tmp_path / "trace").verdict == "identical"  # loads the base and merges "ft" again
    with pytest.raises(WorkbenchError, match="merged into the weights differ"):
        workbench.replay(trace, workbench.load(path, device="cpu"))
    os.mkfifo(tmp_path / "fifo")
    for bad, match in ((tmp_path / "fifo", "not a regular file"), (path, "sha256 differs.*nothing was loaded")):
        trace.fingerprint["merged_adapters"] = [{**plain.merged[0], "path": str(bad)}]  # merged from another file
        with pytest.raises(WorkbenchError, match=match):
            workbench.replay(trace)


# ------------------------------------------------------------------------------------ traces


def test_trace_records_and_replay_reapplies_the_adapter(hf_llama, tmp_path):
    trace = hf_llama.run(IDS, record=["blocks.1.hook_resid_post"], adapter={"a": 0.7})
    assert trace.adapters == [{"name": "a", "scale": 0.7, "format": "peft", "path": str(hf_llama.adapters["a"].path),
                               "sha256": hf_llama.adapters["a"].sha256}]
    trace.save(tmp_path / "trace")
    loaded = workbench.load_trace(tmp_path / "trace")
    assert loaded.adapters == trace.adapters
    assert workbench.replay(loaded, hf_llama).verdict == "identical"
    fresh = workbench.load(hf_llama.path, device="cpu")  # no adapter loaded: replay loads the recorded file
    assert workbench.replay(loaded, fresh).verdict == "identical" and "a" in fresh.adapters
    other = workbench.load(hf_llama.path, device="cpu", adapters={"a": hf_llama.adapters["b"].path})
    with pytest.raises(WorkbenchError, match="sha256"):
        workbench.replay(loaded, other)


def test_replay_loads_a_recorded_adapter_only_once_its_files_hash_to_the_record(hf_llama, tmp_path):
    """The recorded path is opened only as regular files (no FIFO, no link), hashed before anything is attached, and a
    refused replay leaves no adapter loaded, whichever of the trace's adapters was refused."""
    import shutil
    import threading

    trace = hf_llama.run(IDS, adapter={"a": 0.7, "b": 0.5})
    fresh = workbench.load(hf_llama.path, device="cpu")
    good, (a, b) = [dict(entry) for entry in trace.adapters], trace.adapters
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    linked = tmp_path / "linked"
    linked.mkdir()
    shutil.copy(Path(b["path"]) / "adapter_config.json", linked)
    (linked / "adapter_model.safetensors").symlink_to(Path(b["path"]) / "adapter_model.safetensors")
    (tmp_path / "link").symlink_to(b["path"])
    for path, match in ((a["path"], "sha256 differs.*nothing was loaded"), (str(fifo), "not a regular file"),
                        (str(linked), "symbolic link"), (str(tmp_path / "link"), "symbolic link"),
                        ("/etc/passwd", "sha256 differs")):
        trace.adapters = [good[0], {**good[1], "path": path}]
        done = []

        def refused() -> None:
            with pytest.raises(WorkbenchError, match=match):
                workbench.replay(trace, fresh)
            done.append(path)

        thread = threading.Thread(target=refused, daemon=True)  # a FIFO opened would block it for good
        thread.start()
        thread.join(20)
        assert done and not thread.is_alive(), f"a replay of an adapter at {path} did not end"
        assert fresh.adapters == {}, path  # "a" was loaded, then "b" refused: neither is left
    trace.adapters = good
    assert workbench.replay(trace, fresh).verdict == "identical" and set(fresh.adapters) == {"a", "b"}


# ------------------------------------------------------------------------------------ bad input


def test_bad_adapters_are_refused_before_compute(hf_llama, tmp_path, tiny_model):
    config = hf_llama.config
    with pytest.raises(WorkbenchError, match="unknown adapter 'nope'"):
        hf_llama.run(IDS, adapter="nope")
    with pytest.raises(WorkbenchError, match="unknown adapter"):
        hf_llama.run_batch([IDS], adapter={"a": 1.0, "nope": 1.0})
    with pytest.raises(WorkbenchError, match="finite"):
        hf_llama.forward(IDS, adapter={"a": float("nan")})
    with pytest.raises(WorkbenchError, match="already loaded"):
        hf_llama.load_adapter(hf_llama.adapters["b"].path, name="a")
    qwen = tiny_model("qwen2")
    peft_dir = write_peft(tmp_path / "p", config)
    narrow = ModelConfig(**{**config.to_dict(), "d_model": 32, "d_head": 8})
    with pytest.raises(AdapterError, match="do not fit"):  # an adapter of a model of other dimensions
        hf_llama.load_adapter(write_peft(tmp_path / "narrow", narrow), name="narrow")
    with pytest.raises(AdapterError, match="adapter for a 'llama' model"):
        qwen.load_adapter(write_gguf_adapter(tmp_path / "llama.gguf", peft_dir, config))
    with pytest.raises(AdapterError, match="rank 4; adapter_config.json says r = 8"):
        hf_llama.load_adapter(write_peft(tmp_path / "r", config, extra_config={"r": 8}), name="r")
    broken = write_peft(tmp_path / "mismatch", config, modules=["q_proj"])
    tensors = load_file(str(broken / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[key] = tensors[key][:, :3].contiguous()
    save_file(tensors, str(broken / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="rank mismatch"):
        hf_llama.load_adapter(broken, name="mismatch")
    tensors[key] = torch.full((tensors[key].shape[0], 4), float("nan"))
    save_file(tensors, str(broken / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="NaN"):
        hf_llama.load_adapter(broken, name="nan")
    with pytest.raises(AdapterError, match="not supported"):
        hf_llama.load_adapter(write_peft(tmp_path / "dora", config, extra_config={"use_dora": True}), name="dora")
    with pytest.raises(AdapterError, match="target modules"):
        hf_llama.load_adapter(write_peft(tmp_path / "head", config, extra_config={"target_modules": ["lm_head"]}),
                              name="head")
    with pytest.raises(AdapterError, match="not a LoRA adapter"):
        hf_llama.load_adapter(write_gguf(tmp_path / "base.gguf", qwen.config, qwen.runner.weights), name="base")
    with pytest.raises(AdapterError, match="no adapter"):
        hf_llama.load_adapter(tmp_path / "missing", name="missing")
    for extra, message in (({"lora_alpha": "8"}, "lora_alpha must be a number"),
                           ({"use_rslora": "no"}, "use_rslora must be true or false"),
                           ({"target_modules": 5}, "target_modules must be a list of names or a pattern")):
        with pytest.raises(AdapterError, match=message):
            hf_llama.load_adapter(write_peft(tmp_path / message[:9], config, extra_config=extra), name="typed")
    with pytest.raises(AdapterError, match="target_modules must be names"):
        hf_llama.load_adapter(write_peft(tmp_path / "dicts", config, extra_config={"target_modules": [{"a": 1}]}),
                              name="dicts")
    deep = write_peft(tmp_path / "deep", config)
    (deep / "adapter_config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(AdapterError, match="nests too deeply"):
        hf_llama.load_adapter(deep, name="deep")
    tensors = {name: t.to(torch.float8_e4m3fn) for name, t in load_file(str(peft_dir / "adapter_model.safetensors"))
               .items()}
    save_file(tensors, str(peft_dir / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="must be float16, bfloat16, float32 or float64"):
        hf_llama.load_adapter(peft_dir, name="fp8")
    assert sorted(hf_llama.adapters) == ["a", "b"]  # nothing half-loaded


def write_lora_gguf(path: Path, arch: str, tensors: dict[str, torch.Tensor], alpha: float = 8.0) -> Path:
    """A GGUF LoRA adapter of exactly ``tensors`` (F32), for files no converter would write."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 1e39])
def test_an_alpha_that_is_not_a_finite_float32_is_refused(hf_llama, tmp_path, alpha):
    folder = write_peft(tmp_path / "p", hf_llama.config, extra_config={"lora_alpha": alpha})
    with pytest.raises(AdapterError, match="lora_alpha (must be finite|1e\\+39 is past float32's range)"):
        hf_llama.load_adapter(folder, name="alpha")
    if alpha != 1e39:  # a float32 GGUF field cannot hold 1e39
        with pytest.raises(AdapterError, match="adapter.lora.alpha must be finite"):
            hf_llama.load_adapter(write_gguf_adapter(tmp_path / "a.gguf", folder, hf_llama.config), name="alpha")
    assert sorted(hf_llama.adapters) == ["a", "b"]


def test_b_that_overflows_once_alpha_is_folded_in_is_refused(hf_llama, tmp_path):
    # every raw weight is finite (|B| < 1e37), but alpha / rank = 2000 takes B past float32's range
    folder = write_peft(tmp_path / "p", hf_llama.config, alpha=8000.0, std=1e36)
    with pytest.raises(AdapterError, match=r"lora B times alpha / rank \(2000\) overflows float32"):
        hf_llama.load_adapter(folder, name="big")
    assert sorted(hf_llama.adapters) == ["a", "b"]
    # finite halves whose product passes float32's range (every logit NaN)
    with pytest.raises(AdapterError,
                       match=r"the delta B A \(B times alpha / rank \(\d+\)\) can reach .*e\+4\d, past float32's"):
        hf_llama.load_adapter(write_peft(tmp_path / "huge", hf_llama.config, std=1e20), name="huge")
    assert sorted(hf_llama.adapters) == ["a", "b"]
    hf_llama.load_adapter(write_peft(tmp_path / "ok", hf_llama.config, alpha=8000.0, std=1e-3), name="ok")
    try:
        assert torch.isfinite(hf_llama.forward(IDS, adapter="ok")).all()
    finally:
        hf_llama.unload_adapter("ok")


def test_terms_past_the_models_range_at_a_calls_scale_are_refused(tmp_path):
    """A call's scale, or a float16 model, can take terms that fit float32 at load past the range they are kept in
    (every logit NaN): refused, naming the layer, the projection and the adapter, and the next call is unharmed."""
    hf_model("llama", tmp_path, tie=True)
    write_peft(tmp_path / "small", workbench.load(tmp_path, device="cpu").config, modules=["q_proj"], layers=[0])
    write_peft(tmp_path / "big", workbench.load(tmp_path, device="cpu").config, modules=["q_proj"], layers=[0],
               std=400.0)  # B A reaches ~1e7: fine in float32, past float16's 65504
    for dtype, why in [("float32", r"the delta B A \(B times .*\) can reach .*e\+38, past float32's"),
                       ("float16", "lora B times alpha / rank and the call's scale overflows float16")]:
        model = workbench.load(tmp_path, device="cpu", dtype=dtype, adapters={"small": tmp_path / "small",
                                                                               "big": tmp_path / "big"})
        # float32: B stays within range, its product with A does not; float16: B itself overflows
        b_max = model.adapters["small"].layers[0]["wq"][1].abs().max().item()
        scale = 0.9 * torch.finfo(torch.float32).max / b_max if dtype == "float32" else 1e6
        with pytest.raises(AdapterError, match=f"layer 0 wq of 'small': {why}"):
            model.forward(IDS, adapter={"small": scale})
        assert torch.isfinite(model.forward(IDS, adapter={"small": 2.0})).all()
    with pytest.raises(AdapterError, match=r"layer 0 wq of 'small', 'big': the delta B A .* past float16's range"):
        model.forward(IDS, adapter={"small": 1.0, "big": 1.0})
    assert torch.isfinite(model.forward(IDS, adapter="small")).all()


@pytest.mark.parametrize("r", [0, 4.7, -4, "4", True])
def test_a_rank_that_is_not_a_positive_integer_is_refused(hf_llama, tmp_path, r):
    folder = write_peft(tmp_path / "p", hf_llama.config, extra_config={"r": r})
    with pytest.raises(AdapterError, match=r"adapter_config.json: r must be a positive integer"):
        hf_llama.load_adapter(folder, name="r")
    assert sorted(hf_llama.adapters) == ["a", "b"]


def test_a_gguf_adapter_of_rank_zero_is_refused(hf_llama, tmp_path):
    d, q = hf_llama.config.d_model, hf_llama.config.n_heads * hf_llama.config.d_head
    path = write_lora_gguf(tmp_path / "r0.gguf", "llama", {"blk.0.attn_q.weight.lora_a": torch.zeros(0, d),
                                                          "blk.0.attn_q.weight.lora_b": torch.zeros(q, 0)})
    with pytest.raises(AdapterError, match=r"blk.0.attn_q.weight.lora_a has shape \(0, 64\); a LoRA needs a rank"):
        hf_llama.load_adapter(path, name="r0")
    assert sorted(hf_llama.adapters) == ["a", "b"]


@pytest.mark.parametrize("proj", ["ffn_gate", "ffn_up", "ffn_down"])
def test_a_lora_on_the_dense_mlp_of_an_experts_only_base_is_refused(proj, tmp_path):
    model = workbench.load(Path(__file__).parent / "fixtures" / "moe" / "qwen3moe-Q8_0.gguf", device="cpu")
    c = model.config
    g = torch.Generator().manual_seed(0)
    out_dim, in_dim = (c.d_model, c.d_mlp) if proj == "ffn_down" else (c.d_mlp, c.d_model)
    path = write_lora_gguf(tmp_path / "mlp.gguf", c.architecture, {
        f"blk.0.{proj}.weight.lora_a": torch.randn(4, in_dim, generator=g),
        f"blk.0.{proj}.weight.lora_b": torch.randn(out_dim, 4, generator=g)})
    with pytest.raises(AdapterError, match=rf"blk.0.{proj}.weight\): the base has no such projection \(its "
                                           "feed-forward is a mixture of experts only"):
        model.load_adapter(path, name="mlp")
    assert not model.adapters
    q = c.n_heads * c.d_head  # attention projections it has take an adapter
    model.load_adapter(write_lora_gguf(tmp_path / "q.gguf", c.architecture, {
        "blk.0.attn_q.weight.lora_a": torch.randn(4, c.d_model, generator=g),
        "blk.0.attn_q.weight.lora_b": torch.randn(q, 4, generator=g)}), name="q")
    assert not torch.equal(model.forward(IDS[:4], adapter="q"), model.forward(IDS[:4]))


def test_a_lora_on_keys_or_values_a_layer_reuses_is_refused(hf_llama, tmp_path):
    from workbench.adapters import load_adapter

    # the last layer reuses the one before's keys and values (as Gemma 4 E2B's last layers do): it has no wk / wv
    shared = ModelConfig(**{**hf_llama.config.to_dict(), "kv_shared_layers": 1})
    last = shared.n_layers - 1
    for module in ("k_proj", "v_proj"):
        folder = write_peft(tmp_path / module, shared, modules=[module], layers=[last])
        with pytest.raises(AdapterError, match=rf"layer {last} {module} \(base_model.model.model.layers.{last}"
                                               rf".self_attn.{module}\): the base has no such projection \(the "
                                               rf"layer reuses layer {last - 1}'s keys and values\)"):
            load_adapter(folder, shared, "kv")
    assert load_adapter(write_peft(tmp_path / "early", shared, modules=["k_proj"], layers=[0]), shared,
                        "kv").adapted_layers == [0]


# ------------------------------------------------------------------------------------ diffing


def test_compare_models_against_plain_runs(hf_llama):
    from workbench.probes import compare_models

    prompts = [IDS, IDS[:4], [30, 31, 32, 33, 34]]
    diff = compare_models(hf_llama, prompts, "a", k=3, batch_size=2)
    n_layers = hf_llama.config.n_layers
    points = [f"blocks.{l}.hook_resid_post" for l in range(n_layers)]
    runs = [(hf_llama.run(p, record=points, adapter="a"), hf_llama.run(p, record=points)) for p in prompts]
    deltas = [torch.stack([a.activations[n] - b.activations[n] for n in points]) for a, b in runs]  # [L, T, d]
    rows = torch.cat([d.norm(dim=-1) for d in deltas], dim=1)  # [L, all positions]
    torch.testing.assert_close(diff.resid_norms, rows.mean(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(diff.steering.directions[1], torch.cat([d[1] for d in deltas]).mean(0),
                               rtol=1e-4, atol=1e-5)
    for kl, (a, b) in zip(diff.kl, runs):
        expected = torch.nn.functional.kl_div(b.logits.log_softmax(-1), a.logits.log_softmax(-1), log_target=True,
                                              reduction="none").sum(-1)
        torch.testing.assert_close(kl, expected, rtol=1e-4, atol=1e-6)
    # the last layer's lens is the model's output: its change is the mean change of the last position's logits
    change = sum(a.logits[-1] - b.logits[-1] for a, b in runs) / len(runs)
    assert [t for t, _ in diff.lens_promoted[-1]] == hf_llama.token_texts(change.topk(3).indices.tolist())
    assert [t for t, _ in diff.lens_suppressed[-1]] == hf_llama.token_texts((-change).topk(3).indices.tolist())
    # the attribution of the change sums to the change of the target's logit, and the target is the most raised
    assert hf_llama.token_texts([int(change.argmax())])[0] in diff.attribution.target
    assert abs(diff.attribution.total - diff.attribution.logit) < 1e-3
    assert abs(diff.attribution.logit - float(change.max())) < 1e-3
    same = compare_models(hf_llama, prompts[:1], "a", "a")
    assert same.mean_kl == 0 and float(same.resid_norms.abs().max()) == 0
    assert diff.summary()["a"] == "adapter 'a'" and diff.summary()["b"] == "base"
    with pytest.raises(WorkbenchError, match="unknown adapter"):
        compare_models(hf_llama, prompts, "missing")


def test_forward_through_the_gemv_epilogue(tiny_model, tmp_path, monkeypatch):
    """The runner's groups through the GEMV's LoRA epilogue (the Triton GEMV: on CUDA, or run by Triton's interpreter on
    CPU tensors) give the logits of the base's kernels with the fused call after them, for stacked q/k/v and gate/up
    (layer 0) and one weight per projection (layer 1), an adapter on every projection and one on q and v alone. Two
    tokens: the most the GEMV takes of Q8_0 on CUDA (``gemv_rows``), two rows of activations a program."""
    pytest.importorskip("triton")
    from workbench.kernels.triton.launch import INTERPRETING

    if not INTERPRETING and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    model = tiny_model("llama", "Q8_0", device="cpu" if INTERPRETING else "cuda", dtype="float32", cached=False)
    layers = model.runner.weights.layers
    layers[0].fuse_projections()
    layers[1].wqkv = layers[1].w_gate_up = None
    if INTERPRETING:  # the CPU's kernels would take the matmuls
        monkeypatch.setattr(lora_ops, "GEMV_ON_CPU", True)
        monkeypatch.setattr(lora_ops, "_takes_gemv", lambda x, w: True)
    served = []
    triton_terms = lora_ops._triton_linear_with_terms
    monkeypatch.setattr(lora_ops, "_triton_linear_with_terms",
                        lambda x, weights, *args: served.append(len(weights)) or triton_terms(x, weights, *args))
    model.load_adapter(write_peft(tmp_path / "all", model.config, seed=1), name="all")
    model.load_adapter(write_peft(tmp_path / "qv", model.config, seed=2, modules=["q_proj", "v_proj"]), name="qv")
    base = model.forward(IDS[:2])
    for name, groups in (("all", [1, 1, 1, 1, 3, 1, 2, 1]), ("qv", [1, 3])):
        served.clear()
        epilogue = model.forward(IDS[:2], adapter=name)
        assert served == groups  # weights per call: layer 0's stacks, then layer 1's projections
        monkeypatch.setattr(lora_ops, "GEMV_EPILOGUE", False)
        after = model.forward(IDS[:2], adapter=name)
        monkeypatch.setattr(lora_ops, "GEMV_EPILOGUE", True)
        assert not torch.allclose(after, base, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(epilogue, after, rtol=1e-4, atol=1e-4)
