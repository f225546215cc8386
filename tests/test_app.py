"""The Streamlit dashboard, page by page, driven with AppTest on the embedded model.

Each test starts a fresh session on the default page, sets widgets like a user would and checks the
numbers the page shows against the public Python API.
"""
from __future__ import annotations

import base64
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

streamlit_testing = pytest.importorskip("streamlit.testing.v1")
from workbench import hooks, probes  # noqa: E402
from workbench.app import common  # noqa: E402

MAIN = str(Path(common.__file__).with_name("main.py"))
PROMPT = common.DEFAULT_PROMPT
TIMEOUT = 240  # seconds per script run: generous for a busy 2-core CI machine


def start(page: str | None = None, **state) -> streamlit_testing.AppTest:
    at = streamlit_testing.AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    for key, value in state.items():
        at.session_state[key] = value
    at.run()
    if page:
        at.switch_page(page).run()
    assert_clean(at)
    return at


def assert_clean(at, errors: int = 0) -> None:
    """No exception reached Streamlit, and exactly ``errors`` inline error messages are shown."""
    assert not at.exception, [e.message for e in at.exception]
    assert len(at.error) == errors, [e.value for e in at.error]


def chart(at, key: str) -> dict:
    matches = [c for c in at.get("plotly_chart") if c.key == key]
    assert matches, f"no chart {key!r}; charts: {[c.key for c in at.get('plotly_chart')]}"
    return json.loads(matches[0].proto.spec)


def values(data) -> torch.Tensor:
    """A plotly data array as a tensor: nested lists, or plotly's base64 typed-array form."""
    if isinstance(data, dict):
        array = np.frombuffer(base64.b64decode(data["bdata"]), dtype=np.dtype(data["dtype"]))
        shape = [int(n) for n in str(data.get("shape", len(array))).split(",")]
        return torch.from_numpy(array.reshape(shape).copy())
    return torch.tensor(data)


def button(at, label: str):
    return next(b for b in at.button if b.label == label)


def metric(at, label_start: str) -> str:
    return next(m.value for m in at.metric if m.label.startswith(label_start))


def test_run_lens_matches_forward_and_handles_bad_prompts(model):
    at = start()
    heat = chart(at, "lens_heatmap")["data"][0]
    probs = model.forward(PROMPT)[-1].softmax(-1)
    top = int(probs.argmax())
    # The lens at the last layer is the model's own output.
    assert heat["text"][-1][-1] == model.tokenizer.token_text(top)
    assert heat["z"][-1][-1] == pytest.approx(float(probs[top]), abs=1e-4)
    assert len(heat["z"]) == model.config.n_layers and len(heat["z"][0]) == len(model.to_ids(PROMPT))
    bars = chart(at, "lens_next_token")["data"][0]
    assert bars["x"][0] == pytest.approx(float(probs[top]), abs=1e-4)
    race = chart(at, "track_figure")["data"]
    assert len(race) == 2 and race[0]["y"][-1] == pytest.approx(float(probs[top]), abs=1e-4)
    assert len(chart(at, "resid_norms")["data"]) == len(model.to_ids(PROMPT))

    at.toggle(key="dla_on").set_value(True).run()
    assert_clean(at)
    heads = values(chart(at, "dla_heads")["data"][0]["z"])
    assert heads.shape == (model.config.n_layers, model.config.n_heads)
    assert "Direct logit attribution" in chart(at, "dla_bars")["layout"]["title"]["text"]

    at.text_input(key="track_text").set_value("London Paris").run()  # two tokens: refused inline
    assert_clean(at, errors=1)
    assert "not one" in at.error[0].value
    at.text_input(key="track_text").set_value("").run()

    for bad, message in (("   ", "empty"), ("word " * 300, "at most")):
        at.sidebar.text_area(key="prompt").set_value(bad).run()
        assert_clean(at, errors=1)
        assert message in at.error[0].value
    at.sidebar.text_area(key="prompt").set_value(PROMPT).run()
    assert_clean(at)
    assert chart(at, "lens_heatmap")["data"][0]["text"][-1][-1] == model.tokenizer.token_text(top)


def test_a_system_prompt_makes_the_sidebar_prompt_a_conversation(model):
    at = start()
    assert not [t for t in at.sidebar.text_area if t.key == "system"]  # offered with the chat template only
    at.sidebar.toggle(key="chat").set_value(True).run()
    at.sidebar.text_area(key="system").set_value("Answer in one word.").run()
    assert_clean(at)
    conversation = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}]
    probs = model.forward(conversation)[-1].softmax(-1)
    heat = chart(at, "lens_heatmap")["data"][0]
    assert len(heat["z"][0]) == len(model.to_ids(conversation))
    assert heat["z"][-1][-1] == pytest.approx(float(probs.max()), abs=1e-4)


def test_attention_pattern_and_head_scores(model):
    at = start("page_attention.py")
    at.slider(key="attn_layer").set_value(3).run()
    at.selectbox(key="attn_head").set_value(5).run()
    shown = values(chart(at, "attn_pattern")["data"][0]["z"])
    expected = model.run(PROMPT, record=["blocks.3.attn.hook_pattern"]).activations["blocks.3.attn.hook_pattern"][5]
    torch.testing.assert_close(shown, expected, atol=1e-6, rtol=0)
    previous = values(chart(at, "attn_Previous-token score")["data"][0]["z"])
    assert previous.shape == (model.config.n_layers, model.config.n_heads)
    assert float(previous[3, 5]) == pytest.approx(float(expected.diagonal(-1).mean()), abs=1e-6)


def test_interventions_agree_with_the_api_and_refuse_bad_settings(model):
    at = start("page_interventions.py")
    assert float(metric(at, "KL").split()[0]) > 0  # the default love/hate steer moves the distribution
    at.radio(key="iv_kind").set_value("Zero-ablate").run()
    at.selectbox(key="iv_site").set_value("Attention heads (attn.hook_z)").run()
    at.slider(key="iv_layers").set_value((2, 4)).run()
    at.multiselect(key="iv_heads").select(1).select(4).run()
    at.text_input(key="iv_positions").set_value("-1").run()
    assert_clean(at)
    specs = json.loads(at.code[0].value)
    assert [s["hook"] for s in specs] == [f"blocks.{i}.attn.hook_z" for i in (2, 3, 4)]
    assert all(s["heads"] == [1, 4] and s["positions"] == [-1] for s in specs)
    edited = model.forward(PROMPT, interventions=specs)[-1].softmax(-1)
    bars = chart(at, "iv_next_b")["data"][0]
    assert bars["x"][0] == pytest.approx(float(edited.max()), abs=1e-4)
    effect = values(chart(at, "iv_effect")["data"][0]["z"])
    assert effect[:2].abs().max() == 0  # nothing changes before the first edited layer
    assert effect[2, -1] > 0 and effect[2, :-1].abs().max() == 0  # only the edited position at layer 2

    for widget, bad, message in (("iv_positions", "abc", "positions must be"), ("iv_positions", "99", "out of range")):
        at.text_input(key=widget).set_value(bad).run()
        assert_clean(at, errors=1)
        assert message in at.error[0].value
    at.text_input(key="iv_positions").set_value("-1").run()
    assert_clean(at)

    at.slider(key="iv_new_tokens").set_value(3).run()
    button(at, "Generate both").click().run()
    assert_clean(at)
    _, baseline, edited_text = at.session_state.iv_generations  # the code blocks show them, trailing newlines cut
    assert at.code[-2].value == baseline.rstrip("\n") and at.code[-1].value == edited_text.rstrip("\n")
    assert baseline == model.generate(PROMPT, 3)
    assert edited_text == model.generate(PROMPT, 3, interventions=specs)


def test_interventions_name_the_box_of_a_bad_entry(model):
    at = start("page_interventions.py")
    at.text_input(key="iv_positive").set_value("  ").run()  # the default steer: a trace difference
    assert_clean(at, errors=1)
    assert at.error[0].value.startswith("Towards is empty")
    at.text_input(key="iv_positive").set_value("I love this").run()
    at.text_input(key="iv_negative").set_value("").run()
    assert_clean(at, errors=1)
    assert at.error[0].value.startswith("Away from is empty")
    at.radio(key="iv_kind").set_value("Zero-ablate").run()
    at.selectbox(key="iv_site").set_value("MLP neurons (mlp.hook_post)").run()
    for bad in ("3-5", "generated"):
        at.text_input(key="iv_neurons").set_value(bad).run()
        assert_clean(at, errors=1)
        assert at.error[0].value.startswith("neurons must be 'all' or integers"), at.error[0].value
    at.text_input(key="iv_neurons").set_value("3, 5").run()
    assert_clean(at)
    assert all(s["neurons"] == [3, 5] for s in json.loads(at.code[0].value))


def test_interventions_steer_with_an_uploaded_control_vector(model, tmp_path):
    at = start("page_interventions.py")
    at.radio(key="iv_source").set_value("Control vector file").run()
    assert_clean(at)
    assert any("Upload a llama.cpp control vector" in i.value for i in at.info)
    upload = at.file_uploader(key="iv_control_file")
    upload.set_value(("junk.gguf", b"GGUF but not really", "application/octet-stream")).run()
    assert_clean(at, errors=1)
    assert at.error[0].value.startswith("junk.gguf is not a GGUF file")  # the upload's name, not a temporary path

    generator = torch.Generator().manual_seed(0)
    vector = probes.SteeringVector({3: torch.randn(model.config.d_model, generator=generator),
                                    4: torch.randn(model.config.d_model, generator=generator)})
    path = vector.export_control_vector(tmp_path / "random.gguf")
    upload = at.file_uploader(key="iv_control_file")
    upload.set_value(("random.gguf", path.read_bytes(), "application/octet-stream")).run()
    at.number_input(key="iv_scale").set_value(2.0).run()
    assert_clean(at)
    specs = json.loads(at.code[0].value)
    assert [s["hook"] for s in specs] == ["blocks.3.hook_resid_post", "blocks.4.hook_resid_post"]
    expected = model.forward(PROMPT, interventions=vector.interventions(2.0))[-1].softmax(-1)
    assert chart(at, "iv_next_b")["data"][0]["x"][0] == pytest.approx(float(expected.max()), abs=1e-4)


def test_app_command_refuses_a_missing_model(tmp_path, capsys):
    from workbench.cli import main

    assert main(["app", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "model not found" in capsys.readouterr().err
    options = common.cli_options(["--model", "some", "--quantize", "Q4_K_M", "--numerics", "llamacpp"])
    assert (options.model, options.quantize, options.numerics) == ("some", "Q4_K_M", "llamacpp")
    assert common.cli_options([]).model is None and common.cli_options([]).numerics == "exact"
    assert main(["app", "--quantize", "Q9_K"]) == 2
    assert "unknown quantization 'Q9_K'" in capsys.readouterr().err


def test_the_server_computes_in_its_numerics(monkeypatch, model):
    """``workbench app --numerics llamacpp``: every run of the server's script computes in them (in its own thread: the
    process default stays), and the sidebar says it."""
    import workbench

    monkeypatch.setattr("sys.argv", ["main.py", "--numerics", "llamacpp"])
    at = start()
    assert "llamacpp numerics" in at.sidebar.caption[0].value
    assert workbench.kernels.get_numerics() == "exact"
    # the lens's softmax is within a few float32 roundings of float64's (torch's float32 softmax can be 1e-5 off)
    with workbench.kernels.numerics("llamacpp"):
        expected = float(model.forward(PROMPT)[-1].double().softmax(-1).max())
    exact = float(model.forward(PROMPT)[-1].double().softmax(-1).max())
    shown = chart(at, "lens_next_token")["data"][0]["x"][0]
    assert shown == pytest.approx(expected, abs=1e-6) and shown != pytest.approx(exact, abs=1e-5)


def test_the_server_loads_on_the_device_and_dtype_given(monkeypatch):
    """``workbench app --device cpu --dtype bfloat16`` hands both to the server's script, which loads the model so
    (every command takes --device and --dtype)."""
    import subprocess

    from workbench.cli import main

    commands = []
    monkeypatch.setattr(subprocess, "call", lambda command: commands.append(command) or 0)
    assert main(["app", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    given = commands[0][commands[0].index("--") + 1:]
    assert (common.cli_options(given).device, common.cli_options(given).dtype) == ("cpu", "bfloat16")
    monkeypatch.setattr("sys.argv", ["main.py", *given])
    at = start()
    assert "cpu bfloat16" in at.sidebar.caption[0].value


def test_patching_grid_restores_the_clean_answer_at_the_last_position(model):
    at = start("page_patching.py")
    at.selectbox(key="pt_point").set_value("hook_resid_post").run()
    last = model.config.n_layers - 1
    at.slider(key="pt_layers").set_value((last, last)).run()
    button(at, "Run sweep").click().run()
    assert_clean(at)
    n_tokens = len(model.to_ids(at.text_input(key="pt_clean").value))
    assert metric(at, "Grid") == f"1 × {n_tokens}"
    grid = values(chart(at, "pt_figure")["data"][0]["z"])
    # After the last block only the last position reaches the logits: patching it restores the clean run.
    assert grid.shape == (1, n_tokens)
    # (cells run batched, the baselines alone: equal within the batched kernels' rounding, tests/test_batch.py)
    assert float(grid[0, -1]) == pytest.approx(1.0, abs=2e-4)
    assert grid[0, :-1].abs().max() <= 2e-4

    at.text_input(key="pt_corrupt").set_value("The Colosseum in Rome is in the city of").run()
    button(at, "Run sweep").click().run()
    assert_clean(at, errors=1)
    assert "same number of tokens" in at.error[0].value


def test_patching_page_estimates_cells_by_attribution(model):
    at = start("page_patching.py")
    at.radio(key="pt_method").set_value("Attribution patching").run()
    at.radio(key="pt_metric").set_value("Probability of the clean answer").run()
    at.slider(key="pt_layers").set_value((3, 9)).run()
    button(at, "Run sweep").click().run()
    assert_clean(at)
    clean, corrupt = at.text_input(key="pt_clean").value, at.text_input(key="pt_corrupt").value
    answer = int(model.forward(clean)[-1].argmax())

    def probability_of_clean_answer(logits):
        return logits[-1].double().softmax(-1)[answer]

    expected = hooks.attribution_patching(model, clean, corrupt, probability_of_clean_answer,
                                          layers=[3, 8], normalize=True)
    assert values(chart(at, "pt_figure")["data"][0]["z"]).numpy() == pytest.approx(expected.grid.numpy(), abs=1e-5)
    assert any(c.value.startswith("attribution patching · ") for c in at.caption)
    at.number_input(key="pt_steps").set_value(3).run()
    button(at, "Run sweep").click().run()
    assert_clean(at)
    expected = hooks.attribution_patching(model, clean, corrupt, probability_of_clean_answer,
                                          layers=[3, 8], normalize=True, steps=3)
    assert values(chart(at, "pt_figure")["data"][0]["z"]).numpy() == pytest.approx(expected.grid.numpy(), abs=1e-5)
    assert any(c.value.startswith("attribution patching, integrated gradients (3 steps) · ") for c in at.caption)
    at.number_input(key="pt_verify").set_value(2).run()
    button(at, "Run sweep").click().run()
    assert_clean(at)
    expected = hooks.attribution_patching(model, clean, corrupt, probability_of_clean_answer,
                                          layers=[3, 8], normalize=True, steps=3, verify=2)
    table = at.dataframe[0].value
    assert list(table["cell"]) == [" ".join(cell["labels"]) for cell in expected.verified()]
    assert list(table["patched"]) == pytest.approx([cell["patched"] for cell in expected.verified()], abs=1e-4)


def test_patching_page_sweeps_a_dataset_of_pairs(model):
    """The shipped ioi pairs: the mean grid over a sample, each pair with its answers, by attribution (and the
    probability of each pair's clean answer) and by patching."""
    at = start("page_patching.py")
    at.radio(key="pt_source").set_value("A dataset").run()
    at.number_input(key="pt_pairs").set_value(3).run()
    at.radio(key="pt_method").set_value("Attribution patching").run()
    at.slider(key="pt_layers").set_value((3, 9)).run()
    button(at, "Run sweep").click().run()
    assert_clean(at)
    pairs, answers = probes.load_dataset("ioi").sample(3).patching()
    expected = hooks.dataset_patching(model, pairs, method="attribution", layers=[3, 8], answers=answers,
                                      normalize=True, progress=False)
    assert values(chart(at, "pt_figure")["data"][0]["z"]).numpy() == pytest.approx(expected.grid.numpy(), abs=1e-5)
    assert any(c.value.endswith(" · mean of 3 pairs") for c in at.caption)
    at.radio(key="pt_metric").set_value("Probability of the clean answer").run()
    button(at, "Run sweep").click().run()
    assert_clean(at)
    ids = [model.tokenize(clean_answer, add_bos=False)[0] for clean_answer, _ in answers]
    metrics = [lambda logits, i=i: logits[-1].double().softmax(-1)[i] for i in ids]
    expected = hooks.dataset_patching(model, pairs, metrics, method="attribution", layers=[3, 8], normalize=True,
                                      progress=False)
    assert values(chart(at, "pt_figure")["data"][0]["z"]).numpy() == pytest.approx(expected.grid.numpy(), abs=1e-5)
    at.radio(key="pt_method").set_value("Activation patching").run()
    at.radio(key="pt_metric").set_value("Logit difference").run()
    at.selectbox(key="pt_point").set_value("hook_resid_post").run()
    last = model.config.n_layers - 1
    at.slider(key="pt_layers").set_value((last, last)).run()
    button(at, "Run sweep").click().run()
    assert_clean(at)
    grid = values(chart(at, "pt_figure")["data"][0]["z"])
    # after the last block only the last position reaches the logits, for every pair
    assert float(grid[0, -1]) == pytest.approx(1.0, abs=2e-4) and grid[0, :-1].abs().max() <= 2e-4


@pytest.mark.parametrize("given, missing", [("pt_clean_answer", "Corrupt"), ("pt_corrupt_answer", "Clean")])
def test_patching_refuses_one_answer_without_the_other(model, given, missing):
    at = start("page_patching.py")
    last = model.config.n_layers - 1
    at.slider(key="pt_layers").set_value((last, last)).run()
    at.text_input(key=given).set_value(" Paris").run()
    button(at, "Run sweep").click().run()
    assert_clean(at, errors=1)
    assert at.error[0].value.startswith(f"{missing} answer is empty: the logit difference needs both answers")
    assert "pt_result" not in at.session_state


def test_batch_page_shows_each_prompts_next_token(model):
    at = start("page_batch.py")
    prompts = ["The capital of France is", "Hello", "Water boils at"]
    at.text_area(key="ba_prompts").set_value("\n".join(prompts) + "\n\n").run()
    button(at, "Run batch").click().run()
    assert_clean(at)
    table = at.dataframe[0].value
    assert list(table["prompt"]) == prompts
    for prompt, token, p in zip(prompts, table["next token"], table["p"]):
        logprobs = model.forward(prompt)[-1].double().log_softmax(-1)
        assert token == common.visible(model.tokenizer.token_text(int(logprobs.argmax())))
        assert p == pytest.approx(float(logprobs.max().exp()), abs=1e-3)
    assert len(chart(at, "ba_norms")["data"]) == 3


def test_adapters_page_compares_an_adapter_with_the_base(model):
    adapter = Path(__file__).parent / "fixtures" / "llamacpp_lora_adapter.gguf"
    at = start("page_adapters.py")
    at.text_input(key="ad_path").set_value(str(adapter)).run()
    at.text_input(key="ad_name").set_value("page-lora").run()
    button(at, "Load adapter").click().run()
    assert_clean(at)
    prompts = ["The capital of France is", "Hello"]
    at.text_area(key="ad_prompts").set_value("\n".join(prompts)).run()
    button(at, "Compare").click().run()
    assert_clean(at)
    model.load_adapter(adapter, name="page-lora")
    try:
        expected = probes.compare_models(model, prompts, "page-lora")
    finally:
        model.unload_adapter("page-lora")
    assert at.metric[0].value == f"{expected.mean_kl:.4f} nats"
    resid = chart(at, "ad_resid")["data"][0]
    torch.testing.assert_close(values(resid["y"]).float(), expected.resid_norms, rtol=1e-4, atol=1e-5)
    assert len(chart(at, "ad_kl")["data"]) == 2
    button(at, "Load adapter").click().run()  # the same name again
    assert_clean(at, errors=1)
    assert "already loaded" in at.error[0].value


def test_probe_depth_sweep_and_pca(model):
    at = start("page_probes.py")
    at.selectbox(key="pr_dataset").set_value("sentiment").run()
    at.slider(key="pr_examples").set_value(10).run()
    at.number_input(key="pr_step").set_value(15).run()
    button(at, "Run depth sweep").click().run()
    assert_clean(at)
    curve = chart(at, "pr_curve")["data"][1]
    assert curve["x"] == [0, 15]
    assert all(0 <= y <= 1 for y in curve["y"])
    assert float(metric(at, "Peak accuracy")) == pytest.approx(max(curve["y"]), abs=5e-3)
    scatter = chart(at, "pr_pca")["data"]
    assert sorted(trace["name"] for trace in scatter) == ["negative", "positive"]
    assert sum(values(trace["x"]).numel() for trace in scatter) == 10
    at.selectbox(key="pr_dataset").set_value("happy_sad").run()  # pairs: two examples each
    button(at, "Run depth sweep").click().run()
    assert sum(values(trace["x"]).numel() for trace in chart(at, "pr_pca")["data"]) == 10
    at.slider(key="pr_examples").set_value(80).run()
    at.selectbox(key="pr_dataset").set_value("ioi").run()  # 32 pairs: the slider stops at 64
    assert at.slider(key="pr_examples").value == 64
    assert_clean(at)


def test_kv_cache_surgery_and_continuation(model):
    at = start("page_kv_cache.py")
    ids = model.to_ids(PROMPT)
    cache = model.new_cache()
    model.forward(ids[:-1], cache=cache)
    norms = values(chart(at, "kv_heatmap")["data"][0]["z"])
    assert norms.shape == (model.config.n_layers, len(ids) - 1)
    torch.testing.assert_close(norms[7], cache.get(7)[0].norm(dim=-1).mean(0), atol=1e-4, rtol=1e-5)

    at.multiselect(key="kv_slots").select(1).select(2).run()
    button(at, "Delete slots").click().run()
    assert_clean(at)
    assert at.code[0].value == "cache.delete_positions([1, 2])"
    assert values(chart(at, "kv_heatmap")["data"][0]["z"]).shape == (model.config.n_layers, len(ids) - 3)

    at.slider(key="kv_new_tokens").set_value(3).run()
    button(at, "Continue").click().run()
    assert_clean(at)
    _, untouched, edited = at.session_state.kv_result
    assert at.code[-1].value == edited.rstrip("\n")
    assert untouched == model.generate(PROMPT, 3)
    cache.delete_positions([1, 2])
    assert edited == model.generate(ids[-1:], 3, cache=cache)


def test_artifacts_replay_compare_and_corrupt_uploads(model):
    at = start("page_artifacts.py")
    button(at, "Keep for replay and comparison").click().run()
    button(at, "Replay").click().run()
    assert_clean(at)
    assert at.success and "identical" in at.success[0].value

    # A trace with an edit, saved the way the download button saves it, then uploaded.
    edit = hooks.ZeroAblate("blocks.5.hook_mlp_out", positions=[-1])
    edited = model.run(PROMPT, record=["blocks.*.hook_resid_post"], interventions=[edit])
    archive = common.artifact_zip(edited)
    at.file_uploader(key="ar_upload").set_value(("edited.zip", archive, "application/zip")).run()
    assert_clean(at)
    at.selectbox(key="ar_compare_b").set_value("uploaded: edited.zip").run()
    assert_clean(at)
    change = values(chart(at, "ar_change")["data"][0]["z"])
    assert change[:5].abs().max() == 0 and change[5, -1] > 0
    edited_probs = edited.logits[-1].softmax(-1)
    assert chart(at, "ar_next_b")["data"][0]["x"][0] == pytest.approx(float(edited_probs.max()), abs=1e-4)

    tampered = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as source, zipfile.ZipFile(tampered, "w") as target:
        for info in source.infolist():
            data = bytearray(source.read(info))
            if info.filename == "tensors.safetensors":
                data[-1] ^= 0xFF
            target.writestr(info.filename, bytes(data))
    for name, data, message in (("junk.zip", b"not a zip at all", "not a readable zip"),
                                ("tampered.zip", tampered.getvalue(), "sha256")):
        at.file_uploader(key="ar_upload").set_value((name, data, "application/zip")).run()
        assert_clean(at, errors=1)
        assert message in at.error[0].value and at.error[0].value.startswith(name) and "/tmp" not in at.error[0].value
    button(at, "Replay").click().run()  # the page still works after a bad upload
    assert not at.exception and at.success


def test_artifacts_keep_each_trace_and_refuse_comparing_vocabularies(model, tiny_model):
    at = start("page_artifacts.py")
    button(at, "Keep for replay and comparison").click().run()
    button(at, "Keep for replay and comparison").click().run()  # the same trace again: still one entry
    at.sidebar.toggle(key="chat").set_value(True).run()
    button(at, "Keep for replay and comparison").click().run()  # the same prompt through the chat template
    assert_clean(at)
    kept = at.session_state["traces"]
    assert [len(t.ids) for t in kept.values()] == [len(model.to_ids(PROMPT)), len(model.to_ids(PROMPT, chat=True))]
    other = tiny_model("llama", seed=5).run("the cat", record=["blocks.*.hook_resid_post"])
    at.file_uploader(key="ar_upload").set_value(("tiny.zip", common.artifact_zip(other), "application/zip")).run()
    at.run()  # an upload is kept once, however often the page reruns
    assert len(at.session_state["traces"]) == 3 and at.selectbox(key="ar_compare_b").value == "uploaded: tiny.zip"
    assert_clean(at, errors=1)
    assert "vocabularies differ" in at.error[0].value


def test_sae_page_shows_a_features_contexts_density_and_steers(model, tmp_path):
    from workbench.probes.sae_train import init_sae

    sae = init_sae("topk", model.config.d_model, 256, "blocks.3.hook_resid_post", k=8, seed=3)
    sae.save(tmp_path / "sae")
    at = start("page_sae.py")
    at.text_input(key="sae_path").set_value(str(tmp_path / "sae")).run()
    at.selectbox(key="sae_dataset").set_value("capitals").run()
    at.slider(key="sae_prompts").set_value(4).run()
    assert_clean(at)
    feature = at.selectbox(key="sae_active").value
    prompts = probes.load_dataset("capitals").prompts[:4]
    stats = probes.feature_stats(model, sae, prompts)
    assert metric(at, "Density") == f"{float(stats.density[feature]):.4%}"
    assert float(metric(at, "Max activation")) == pytest.approx(float(stats.max_act[feature]), abs=1e-3)
    promoted = probes.promoted_tokens(model, sae, feature, 10)["promoted"]
    bars = chart(at, "sae_promoted")["data"][0]
    assert values(bars["x"]).tolist() == pytest.approx([v for _, v in promoted], abs=1e-4)
    button(at, "Generate").click().run()
    assert_clean(at)
    plain = at.text_area(key="sae_plain_text").value
    assert plain == model.generate(PROMPT, 16)
    at.slider(key="sae_new").set_value(8).run()
    button(at, "Generate").click().run()  # the boxes show the latest generation
    assert at.text_area(key="sae_plain_text").value == model.generate(PROMPT, 8)
    at.text_input(key="sae_path").set_value("   ").run()  # blank: the hint, not "no SAE at"
    assert_clean(at)
    assert at.info
    at.text_input(key="sae_path").set_value(str(tmp_path / "missing")).run()
    assert_clean(at, errors=1)
    (tmp_path / "notes.txt").write_text("not an SAE")
    at.text_input(key="sae_path").set_value(str(tmp_path / "notes.txt")).run()
    assert_clean(at, errors=1)
    assert at.error[0].value.startswith(f"{tmp_path / 'notes.txt'} is a file, not an SAE folder")


def test_settings_survive_other_pages_and_hidden_inputs(model):
    """A page's settings, and the system prompt while the chat template is off, are kept while not drawn."""
    at = start("page_patching.py")
    at.text_input(key="pt_clean").set_value("The Louvre is in the city of").run()
    at.text_input(key="pt_clean_answer").set_value(" Paris").run()
    at.switch_page("page_attention.py").run()
    at.switch_page("page_patching.py").run()
    assert at.text_input(key="pt_clean").value == "The Louvre is in the city of"
    assert at.text_input(key="pt_clean_answer").value == " Paris"
    at.radio(key="pt_source").set_value("A dataset").run()
    at.radio(key="pt_source").set_value("One pair").run()
    assert at.text_input(key="pt_clean").value == "The Louvre is in the city of"
    at.sidebar.toggle(key="chat").set_value(True).run()
    at.sidebar.text_area(key="system").set_value("Answer in one word.").run()
    at.sidebar.toggle(key="chat").set_value(False).run()
    at.sidebar.toggle(key="chat").set_value(True).run()
    assert at.sidebar.text_area(key="system").value == "Answer in one word."
    assert_clean(at)


def test_keys_the_dashboard_may_not_set_are_never_kept():
    """Streamlit refuses a script's value for a button, download or upload: every such keyed widget is left out of
    ``keep_widget_values``."""
    import ast

    keyed = set()
    for source in Path(common.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("button", "download_button", "file_uploader", "form_submit_button",
                                           "chat_input", "data_editor")):
                keyed |= {k.value.value for k in node.keywords if k.arg == "key" and isinstance(k.value, ast.Constant)}
    assert keyed == common.UNSETTABLE_KEYS
