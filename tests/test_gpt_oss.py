"""GPT-OSS: its block (attention sinks, alternating sliding and global layers, q/k/v/o biases, YaRN rope, top-k-then-
softmax routing with a router bias, the clamped SwiGLU with expert biases) against transformers, against llama.cpp's
converter, and against llama.cpp on MXFP4 experts (the committed fixture of scripts/make_moe_fixtures.py); its hook
points and expert interventions; the KV cache past the window; bad input."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import workbench
from workbench import hooks
from workbench.errors import ModelLoadError
from workbench.loading import LoadedCheckpoint, load_checkpoint
from workbench.synthetic import write_gguf

from moe_reference import LLAMA_CPP_SOURCE, convert_with_llama_cpp, hf_moe_model

IDS = [5, 77, 120, 3, 250, 9, 14, 200, 31, 64, 8, 199]
FIXTURES = Path(__file__).parent / "fixtures" / "moe"
FIXTURE = FIXTURES / "gpt-oss-MXFP4_MOE.gguf"
LLAMACPP = json.loads((FIXTURES / "llamacpp_logits.json").read_text())


@pytest.fixture(scope="module")
def hf_gpt_oss(tmp_path_factory):
    """A tiny random GptOssForCausalLM (4 layers, window 4, transformers' default YaRN with an unrounded ramp), saved
    with our byte-level tokenizer, and its folder."""
    path = tmp_path_factory.mktemp("gpt-oss")
    return hf_moe_model("gpt-oss", path, n_layers=4), path


@pytest.fixture(scope="module")
def mxfp4():
    return workbench.load(FIXTURE, device="cpu")


def test_hf_checkpoint_matches_transformers(hf_gpt_oss):
    reference, path = hf_gpt_oss
    ours = workbench.load(path, device="cpu")
    c = ours.config
    assert c.architecture == "gpt-oss" and c.sliding_window == 4 and c.sliding_layers == (True, False, True, False)
    assert c.rope_yarn.factor == 32 and not c.rope_yarn.truncate
    assert (c.moe.gating, c.moe.swiglu_limit, c.moe.swiglu_alpha) == ("softmax_weight", 7.0, 1.702)
    with torch.no_grad():
        out = reference(torch.tensor([IDS]), output_router_logits=True, output_attentions=True,
                        output_hidden_states=True)
    expected = out.logits[0].float()
    trace = ours.run(IDS, record=["blocks.*.mlp.hook_router_logits", "blocks.*.mlp.hook_expert_indices",
                                  "blocks.*.attn.hook_pattern", "blocks.*.hook_resid_post"])
    assert (trace.logits - expected).abs().max().item() < 1e-4  # measured 1.2e-6 on logits up to 0.6
    for i in range(c.n_layers):  # hook points as transformers records the same values
        # the router's logits, its bias included
        assert (trace.activations[f"blocks.{i}.mlp.hook_router_logits"] - out.router_logits[i]).abs().max() < 1e-5
        # the attention weights of the real keys (the sink's share dropped, as transformers drops it)
        assert (trace.activations[f"blocks.{i}.attn.hook_pattern"] - out.attentions[i][0]).abs().max() < 1e-5
        # the test means something only if tokens go to different experts
        assert len(trace.activations[f"blocks.{i}.mlp.hook_expert_indices"].unique()) > c.moe.n_experts_used
    for i in range(c.n_layers - 1):  # (transformers' last hidden state is after the final norm)
        assert (trace.activations[f"blocks.{i}.hook_resid_post"] - out.hidden_states[i + 1][0]).abs().max() < 1e-4
    # token by token through the KV cache, past the window
    cache = ours.new_cache()
    stepped = torch.cat([ours.forward(IDS[:3], cache=cache)] + [ours.forward([t], cache=cache) for t in IDS[3:]])
    assert (stepped - expected).abs().max().item() < 1e-4


def test_each_feature_changes_the_logits(hf_gpt_oss, monkeypatch):
    """Sinks, the SwiGLU clamp, YaRN's magnitude and the expert biases each move the tiny model's logits (so the
    agreement above checks them)."""
    from workbench import moe

    _, path = hf_gpt_oss
    ours = workbench.load(path, device="cpu")
    plain = ours.forward(IDS)

    def moved() -> float:
        return (ours.forward(IDS) - plain).abs().max().item()

    unclamped = moe.clamped_swiglu
    with monkeypatch.context() as m:
        m.setattr(moe, "clamped_swiglu", lambda gate, up, alpha, limit: unclamped(gate, up, alpha, float("inf")))
        assert moved() > 0.05
    layers = ours.runner.weights.layers
    for field in ("sinks", "bo"):
        with monkeypatch.context() as m:
            for layer in layers:
                m.setattr(layer, field, getattr(layer, field) * 0 - (1e4 if field == "sinks" else 0))
            assert moved() > 0.05, field
    with monkeypatch.context() as m:
        for layer in layers:
            m.setattr(layer.moe, "gate_bias", layer.moe.gate_bias * 0)
        assert moved() > 0.05


@pytest.mark.skipif(not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").is_file(),
                    reason="llama.cpp's source tree (WORKBENCH_LLAMA_CPP_SOURCE) is not here")
def test_llama_cpp_converted_gguf_matches(hf_gpt_oss, tmp_path):
    """llama.cpp's converter on a float checkpoint writes float experts (it repacks MXFP4 only from a checkpoint that
    stores MXFP4 blocks and scales); the GGUF loads to the folder's config except the YaRN ramp, which llama.cpp always
    rounds to whole dimensions (transformers here does not): with the folder's ramp rounded too, the same logits."""
    _, path = hf_gpt_oss
    from_gguf = workbench.load(convert_with_llama_cpp(path, tmp_path / "gpt-oss.gguf"), device="cpu")
    assert from_gguf.tensor_formats()["blocks.0.moe.gate"] == "F32"
    assert_folder_with_a_rounded_ramp(path, from_gguf)


def assert_folder_with_a_rounded_ramp(path: Path, from_gguf: workbench.Model) -> None:
    """``from_gguf`` has the config of the folder at ``path`` but for the rounded YaRN ramp, and with the folder's ramp
    rounded too, the same logits."""
    checkpoint = load_checkpoint(path)
    hf_config = checkpoint.config
    rounded = dataclasses.replace(hf_config, rope_yarn=dataclasses.replace(hf_config.rope_yarn, truncate=True),
                                  name=from_gguf.config.name, rms_eps=from_gguf.config.rms_eps)  # GGUF's float32
    assert from_gguf.config == rounded
    rounded_hf = workbench.Model(LoadedCheckpoint(rounded, checkpoint.weights, checkpoint.tokenizer, checkpoint.path,
                                                  checkpoint.metadata), "cpu")
    assert (from_gguf.forward(IDS) - rounded_hf.forward(IDS)).abs().max().item() < 1e-5


def test_written_gguf_loads_back(hf_gpt_oss, tmp_path):
    """``synthetic.write_gguf`` stores the experts' biases ``[n_experts, rows]``, as llama.cpp's converter does (they
    were written flat, and the file did not load): the folder's model loads back from it."""
    _, path = hf_gpt_oss
    checkpoint = load_checkpoint(path)
    written = write_gguf(tmp_path / "gpt-oss.gguf", checkpoint.config, checkpoint.weights)
    assert_folder_with_a_rounded_ramp(path, workbench.load(written, device="cpu"))


def mxfp4_folder(float_dir: Path, out: Path) -> Path:
    """``float_dir`` as a released GPT-OSS folder stores its experts: MXFP4 ``*_blocks`` (value 2j of a block in the
    low nibble of byte j, 2j + 1 in the high one) and ``*_scales`` of each matrix, rows as outputs, quantized by our
    MXFP4 quantizer (gguf-py's rule)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from workbench.kernels import QuantTensor

    shutil.copytree(float_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(-1, -2).contiguous()  # [n_experts, rows (outputs), cols]
        n, rows, cols = w.shape
        ggml = QuantTensor.quantize(w.reshape(n * rows, cols), "MXFP4").data.view(n, rows, cols // 32, 17)
        codes = torch.stack((ggml[..., 1:] & 15, ggml[..., 1:] >> 4), dim=-2).flatten(-2)  # values in order
        tensors[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        tensors[name + "_scales"] = ggml[..., 0].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    return out


def test_mxfp4_folder_stays_packed(hf_gpt_oss, tmp_path):
    """A folder with MXFP4 experts (as the released checkpoints) loads them packed, the bytes our quantizer gives the
    float experts; where llama.cpp's source tree is here, its converter writes the same bytes."""
    from workbench.kernels import QuantTensor

    _, path = hf_gpt_oss
    packed = workbench.load(mxfp4_folder(path, tmp_path / "mxfp4"), device="cpu")
    floats = workbench.load(path, device="cpu")
    for name in ("gate", "up", "down"):
        ours = getattr(packed.runner.weights.layers[1].moe, name)
        assert ours.fmt.name == "MXFP4"
        expected = QuantTensor.quantize(getattr(floats.runner.weights.layers[1].moe, name).dequantize(), "MXFP4")
        assert torch.equal(ours.data, expected.data), name
    if not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").is_file():
        return
    from workbench.gguf_file import GGUFFile

    gguf = GGUFFile(convert_with_llama_cpp(tmp_path / "mxfp4", tmp_path / "mxfp4.gguf"))
    for name, stacked in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
        ours = getattr(packed.runner.weights.layers[1].moe, name).data
        info = gguf.tensors[f"blk.1.{stacked}.weight"]
        assert info.ggml_type == 39
        assert torch.equal(torch.from_numpy(gguf.data(info, ours.numel()).copy()).view(ours.shape), ours), name


def test_malformed_mxfp4_folder_is_one_line(hf_gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = hf_gpt_oss
    folder = mxfp4_folder(path, tmp_path / "mxfp4")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    save_file({**tensors, name: tensors[name][..., :15].contiguous()}, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"down_proj_blocks \(4, 64, 3, 15\) torch.uint8 and _scales .* are not "
                                             r"MXFP4"):
        workbench.load(folder, device="cpu")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.experts.down_proj_scales is missing"):
        workbench.load(folder, device="cpu")


def _kl_and_agreement(model, key: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    reference = load_file(str(FIXTURES / "llamacpp_logits.safetensors"))
    kl, agree = [], []
    with workbench.kernels.numerics(mode):
        for i, ids in enumerate(LLAMACPP["sequences"]):
            ours = model.forward(ids).double().log_softmax(-1)
            theirs = reference[key.format(i=i)].double()
            kl.append((theirs.exp() * (theirs - ours)).sum(-1))
            agree.append(ours.argmax(-1) == theirs.argmax(-1))
    return torch.cat(kl), torch.cat(agree)


def test_mxfp4_logits_agree_with_llamacpp(mxfp4):
    """The fixture: converted by llama.cpp and quantized to its MXFP4_MOE file type (MXFP4 experts, Q8_0 attention),
    weights at 15x transformers' default spread. With llama.cpp's KV cache in F32 and no flash attention, our llama.cpp
    numerics give its logits to rounding (KL measured 0 to 2e-13). With llama.cpp's defaults (F16 K and V, flash
    attention), attention departs by ~1e-3 relative (``workbench parity``: the queries agree to 1e-7, the attention
    output by 1.3e-3), which the large experts amplify: KL measured at most 1.4e-2 (mean 2.0e-3) in llama.cpp numerics
    with every top token agreeing, 2.4e-2 (mean 7.4e-3) exact with one flip of 22."""
    assert {mxfp4.tensor_formats()[f"blocks.{i}.moe.{m}"] for i in range(2) for m in ("gate", "up", "down")} == {
        "MXFP4"}
    kl, agree = _kl_and_agreement(mxfp4, "gpt-oss-MXFP4_MOE.{i}.f32kv", "llamacpp")
    assert kl.max() < 1e-9 and agree.all()
    kl_llamacpp, agree_llamacpp = _kl_and_agreement(mxfp4, "gpt-oss-MXFP4_MOE.{i}", "llamacpp")
    kl_exact, agree_exact = _kl_and_agreement(mxfp4, "gpt-oss-MXFP4_MOE.{i}", "exact")
    assert kl_llamacpp.max() < 3e-2 and agree_llamacpp.sum() >= len(agree_llamacpp) - 1
    assert kl_exact.max() < 5e-2 and agree_exact.sum() >= len(agree_exact) - 2
    assert kl_llamacpp.mean() < kl_exact.mean()


def test_only_the_chosen_experts_are_read(mxfp4):
    """The MXFP4 experts stay the GGUF's stacked bytes, each expert a view of its rows; garbage written into the rows
    of the experts no token chose (exponent bytes of 255: inf and nan if read) leaves the logits bit for bit
    unchanged, and the same garbage in a chosen expert does not."""
    ids = [42]
    trace = mxfp4.run(ids, record=["blocks.*.mlp.hook_expert_indices"])
    views, chosen_views = [], []
    for i, layer in enumerate(mxfp4.runner.weights.layers):
        experts = layer.moe
        chosen = set(trace.activations[f"blocks.{i}.mlp.hook_expert_indices"].flatten().tolist())
        for e, matrices in enumerate(experts.experts):
            for view, stacked in zip(matrices, (experts.gate, experts.up, experts.down)):
                assert view.fmt.name == "MXFP4"
                assert view.data.untyped_storage().data_ptr() == stacked.data.untyped_storage().data_ptr()
                (chosen_views if e in chosen else views).append(view.data)
    assert views
    saved = [v.clone() for v in views + chosen_views]
    try:
        for v in views:
            v.fill_(0xFF)
        assert torch.equal(mxfp4.forward(ids), trace.logits)
        chosen_views[0].fill_(0xFF)
        assert not torch.isfinite(mxfp4.forward(ids)).all()
    finally:
        for v, original in zip(views + chosen_views, saved):
            v.copy_(original)
    assert torch.equal(mxfp4.forward(ids), trace.logits)


# ------------------------------------------------------------------------------------------- hook points


def test_hook_invariants(mxfp4):
    """Recording every point changes no bit; a zero steer on every point and a self-patch are identities; the
    recorded parts add up to the MLP's output."""
    plain = mxfp4.forward(IDS)
    trace = mxfp4.run(IDS, record=["*"])
    assert torch.equal(trace.logits, plain)
    shapes = mxfp4.hook_points()
    assert shapes["blocks.0.mlp.hook_router_logits"] == "[T, 4]" and "blocks.0.mlp.hook_post" not in shapes
    steers = [hooks.Steer(name, torch.zeros(activation.shape[-1]), scale=1.0)
              for name, activation in trace.activations.items()
              if hooks.points.feature_size(name, mxfp4.config) == activation.shape[-1]]
    assert torch.equal(mxfp4.forward(IDS, interventions=steers), plain)
    assert torch.equal(mxfp4.forward(IDS, interventions=[hooks.Patch("*", donor=trace)]), plain)
    a = trace.activations
    weighted = (a["blocks.1.mlp.hook_expert_out"] * a["blocks.1.mlp.hook_expert_weights"][..., None]).sum(1)
    assert torch.allclose(weighted, a["blocks.1.hook_mlp_out"], atol=1e-5)
    # GPT-OSS's routing: the top logits (bias included) choose, a softmax over them weighs
    top = a["blocks.1.mlp.hook_router_logits"].topk(2)
    assert torch.equal(top.indices, a["blocks.1.mlp.hook_expert_indices"])
    assert torch.allclose(top.values.softmax(-1), a["blocks.1.mlp.hook_expert_weights"], atol=1e-7)
    # the sinks take part of each row's attention: the pattern sums to less than one
    assert (a["blocks.0.attn.hook_pattern"].sum(-1) < 1 - 1e-3).any()


def _mlp_parts(model, layer: int, interventions=()) -> dict[str, torch.Tensor]:
    points = ["router_logits", "expert_indices", "expert_weights", "expert_out"]
    trace = model.run(IDS, record=[f"blocks.{layer}.mlp.hook_{p}" for p in points] + [f"blocks.{layer}.hook_mlp_out"],
                      interventions=interventions)
    return {name.rsplit("hook_", 1)[1]: value for name, value in trace.activations.items()}


def test_expert_interventions_equal_hand_computation(mxfp4):
    clean = _mlp_parts(mxfp4, 1)
    expert = int(clean["expert_indices"][0, 0])
    dropped = _mlp_parts(mxfp4, 1, [{"type": "ablate_expert", "experts": [expert], "layer": 1}])
    kept = clean["expert_weights"].masked_fill(clean["expert_indices"] == expert, 0.0)
    assert torch.allclose(dropped["mlp_out"], (clean["expert_out"] * kept[..., None]).sum(1), atol=1e-5)
    rerouted = _mlp_parts(mxfp4, 0, [{"type": "ablate_expert", "experts": [expert], "layer": 0, "mode": "reroute"}])
    logits = _mlp_parts(mxfp4, 0)["router_logits"].clone()
    logits[:, expert] = float("-inf")
    top = logits.topk(2)
    assert torch.equal(rerouted["expert_indices"], top.indices)
    assert torch.allclose(rerouted["expert_weights"], top.values.softmax(-1), atol=1e-7)
    forced = _mlp_parts(mxfp4, 1, [{"type": "force_routing", "experts": [3, 0], "layer": 1}])
    assert (forced["expert_indices"] == torch.tensor([3, 0])).all()
    assert torch.allclose(forced["expert_weights"], clean["router_logits"][:, [3, 0]].softmax(-1), atol=1e-7)


def test_generation_past_the_window_matches_full_forwards(mxfp4):
    """Greedy decoding through the KV cache (sliding layers masking by position) gives the full forward's tokens, and
    a batch of prompts of different lengths decodes as each alone."""
    prompt = IDS[:6]
    new = [token for token, _ in mxfp4.stream(prompt, max_new_tokens=8, compiled=False)]
    ids = prompt + new
    assert len(new) == 8 and mxfp4.forward(ids[:-1]).argmax(-1)[5:].tolist() == ids[6:]
    prompts = [IDS, IDS[:3], [9] * 7 + IDS[:2]]
    assert mxfp4.generate_batch(prompts, 5, temperature=0.0) == [mxfp4.generate(p, 5, temperature=0.0)
                                                                  for p in prompts]


def test_compiled_cpu_decode_decodes_eagerly(hf_gpt_oss):
    """On the CPU an MoE's experts run by a routing read back into Python between graphs, whose values a compiled step
    keeps without guards: it kept the experts of the token it was built on, and greedy decoding went wrong from the
    first step. So ``compiled=True`` decodes an MoE model eagerly there, building no step."""
    from workbench.generation import _BUILT, generate_tokens

    runner = workbench.load(hf_gpt_oss[1], device="cpu").runner
    eager = list(generate_tokens(runner, IDS[:3], 8))
    assert list(generate_tokens(runner, IDS[:3], 8, compiled=True)) == eager
    assert runner not in _BUILT


def test_info_names_the_features(mxfp4):
    family = mxfp4.info()["family"]
    assert {"attention sinks", "YaRN rope", "q/k/v and output biases"} <= set(family["features"])
    assert any("clamped at 7" in f and "top-k logits then softmax" in f for f in family["features"])
    assert family["rope_yarn"]["factor"] == 32.0 and family["sliding_window"] == 4


def test_every_dashboard_page_runs(monkeypatch, mxfp4):
    """Each page of the dashboard on the GPT-OSS fixture (2 layers: the patching page's layer step fits), and the
    experts page's routing is the API's."""
    streamlit_testing = pytest.importorskip("streamlit.testing.v1")
    from workbench.app import common
    from workbench.moe import routing_matrix

    monkeypatch.setattr("sys.argv", ["main.py", "--model", str(FIXTURE)])
    main = Path(common.__file__).with_name("main.py")
    at = streamlit_testing.AppTest.from_file(str(main), default_timeout=240)
    at.run()
    for page in sorted(p.name for p in main.parent.glob("page_*.py")):
        at.switch_page(page).run()
        assert not at.exception and not at.error, (page, [e.message for e in at.exception], [e.value for e in at.error])
    at.switch_page("page_experts.py").run()
    at.selectbox(key="ex_layer").set_value(1).run()
    trace = mxfp4.run(common.DEFAULT_PROMPT, record=["blocks.1.mlp.hook_expert_indices",
                                                     "blocks.1.mlp.hook_expert_weights"])
    expected = routing_matrix(trace.activations["blocks.1.mlp.hook_expert_indices"],
                              trace.activations["blocks.1.mlp.hook_expert_weights"], 4)
    charts = {c.key: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    assert torch.allclose(torch.tensor(charts["ex_routing"]["data"][0]["z"]), expected, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("rows", [1, 3, 40, 200])  # the GEMV, the GEMM, dequantize + cuBLAS
def test_cuda_mxfp4_kernels_match_gguf(rows, mxfp4):
    """The Triton kernels that read MXFP4 on CUDA, against gguf-py's dequantization of the fixture's experts."""
    import gguf

    from workbench.kernels import linear, select_kernel

    w = mxfp4.runner.weights.layers[0].moe.gate
    reference = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType.MXFP4)).reshape(
        w.shape).double()
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    on_cuda = w.to("cuda")
    assert select_kernel(x.cuda(), on_cuda).name.startswith("triton-")
    out = linear(x.cuda(), on_cuda).cpu().double()
    expected = x.double() @ reference.T
    assert ((out - expected).norm() / expected.norm()).item() < 2e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_matches_cpu(mxfp4):
    """The fixture on CUDA (its experts through the Triton MXFP4 kernels) computes what it computes on the CPU: float32
    logits within 1e-4, and the same greedy tokens."""
    cuda = workbench.load(FIXTURE, device="cuda", dtype=torch.float32)
    assert (cuda.forward(IDS).cpu() - mxfp4.forward(IDS)).abs().max().item() < 1e-4
    assert cuda.generate(IDS, 12, temperature=0.0) == mxfp4.generate(IDS, 12, temperature=0.0)


# ------------------------------------------------------------------------------------------------ bad input


def test_malformed_mxfp4_tensor_is_one_line(monkeypatch):
    from workbench import loading

    read = loading._read_gguf

    def with_bad_shape(path):
        file = read(path)
        info = file.tensors["blk.0.ffn_gate_exps.weight"]
        file.tensors[info.name] = dataclasses.replace(info, shape=(48, *info.shape[1:]))
        return file

    monkeypatch.setattr(loading, "_read_gguf", with_bad_shape)
    with pytest.raises(ModelLoadError, match=r"tensor blk.0.ffn_gate_exps.weight: MXFP4 needs rows that are a "
                                             r"multiple of 32 values, got 48$"):
        workbench.load(FIXTURE, device="cpu")


def test_missing_sinks_are_named(monkeypatch):
    from workbench import loading

    read = loading._read_gguf

    def without_sinks(path):
        file = read(path)
        del file.tensors["blk.1.attn_sinks.weight"]
        return file

    monkeypatch.setattr(loading, "_read_gguf", without_sinks)
    with pytest.raises(ModelLoadError, match="tensor blk.1.attn_sinks.weight is missing"):
        workbench.load(FIXTURE, device="cpu")
