"""SAEs and transcoders: SAELens' math (fixtures written by SAELens itself), attaching to runs, batches and
generation, feature edits, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from workbench import hooks
from workbench.errors import HookError, WorkbenchError
from workbench.probes.sae import SAE, FeatureAblate, FeatureClamp, FeatureSteer, load_sae, register_sae

FIXTURES = Path(__file__).parent / "fixtures" / "sae"
CASES = sorted(json.loads((FIXTURES / "manifest.json").read_text())["cases"])
HOOK = "blocks.1.hook_resid_post"


@pytest.mark.parametrize("case", CASES)
def test_encode_decode_equal_saelens(case):
    sae = load_sae(FIXTURES / case)
    expected = load_file(str(FIXTURES / case / "expected.safetensors"))
    x = expected["input"]
    acts, output = sae.forward(x)
    assert (acts != 0).any() and (acts == 0).any()  # a real mix of active and silent features
    torch.testing.assert_close(acts, expected["acts"], rtol=0, atol=1e-6)
    torch.testing.assert_close(sae.decode(expected["acts"], x), expected["decoded"], rtol=0, atol=1e-6)
    torch.testing.assert_close(output, expected["output"], rtol=0, atol=1e-6)


def test_gemma_scope_npz_loads_as_saelens_does():
    folder = FIXTURES / "gemma_scope" / "layer_1" / "width_64" / "average_l0_30"
    expected = load_file(str(FIXTURES / "gemma_scope" / "expected.safetensors"))
    for path in (folder, folder / "params.npz"):
        sae = load_sae(path)
        assert (sae.architecture, sae.hook, sae.apply_b_dec_to_input) == ("jumprelu", HOOK, False)
        acts, output = sae.forward(expected["input"])
        torch.testing.assert_close(acts, expected["acts"], rtol=0, atol=1e-6)
        torch.testing.assert_close(output, expected["output"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("edit, match", [
    ({"metadata": [1]}, "metadata must be of type dict"), ({"metadata": {"sae_lens_version": "abc"}}, "not a version"),
    ({"architecture": ["standard"]}, "architecture must be of type str"),
    ({"sae_lens_version": "5.0", "activation_fn": "topk", "activation_fn_kwargs": [1]}, "activation_fn_kwargs must"),
    ({"architecture": "topk", "k": True}, "needs k in"), (None, "nests too deeply")])
def test_a_saelens_config_of_the_wrong_shape_is_refused_in_one_line(tmp_path, edit, match):
    import shutil

    folder = tmp_path / "sae"
    shutil.copytree(FIXTURES / "topk", folder)
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text("[" * 100000 + "]" * 100000 if edit is None else json.dumps({**cfg, **edit}))
    with pytest.raises(WorkbenchError, match=match):
        load_sae(folder)


def lying_npy(shape: tuple[int, ...], data: bytes) -> bytes:
    """A .npy whose header claims ``shape`` of float32 over ``data``."""
    header = repr({"descr": "<f4", "fortran_order": False, "shape": shape}).encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


@pytest.mark.parametrize("case, match", [
    ("pickled objects", "not a float array"), ("strings", "not a float array"), ("complex", "not a float array"),
    ("structured", "not a float array"), ("a lying header", r"claims shape \(100000, 100000\)"),
    ("a zip bomb", "more than 8 times the file's size"), ("truncated", "cannot read"), ("a bare .npy", "cannot read")])
def test_an_npz_is_checked_before_anything_is_read(tmp_path, case, match):
    """Never unpickled, and never an allocation a header or a compressed member claims beyond the file's size."""
    import zipfile

    path = tmp_path / "params.npz"
    if case == "pickled objects":
        np.savez(path, W_enc=np.array([{"a": 1}], dtype=object))
    elif case in ("strings", "complex", "structured"):
        np.savez(path, W_enc={"strings": np.array(["a"]), "complex": np.ones(4, np.complex64),
                              "structured": np.zeros(2, [("a", "f4"), ("b", "f4")])}[case])
    elif case == "a lying header":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("W_enc.npy", lying_npy((100000, 100000), bytes(64)))
    elif case == "a zip bomb":
        np.savez_compressed(path, W_enc=np.zeros((2048, 2048), np.float32))  # 16 MiB in some 16 KiB
    elif case == "truncated":
        np.savez(path, W_enc=np.ones((8, 8), np.float32))
        path.write_bytes(path.read_bytes()[:200])
    else:
        np.save(tmp_path / "params.npy", np.ones(4, np.float32))
        (tmp_path / "params.npy").rename(path)
    with pytest.raises(WorkbenchError, match=match):
        load_sae(path, hook=HOOK)


@pytest.mark.parametrize("case", ["topk", "gated", "skip_transcoder", "standard_constant_norm"])
def test_save_writes_what_saelens_writes(case, tmp_path):
    sae = load_sae(FIXTURES / case)
    sae.save(tmp_path / "copy")
    ours = json.loads((tmp_path / "copy" / "cfg.json").read_text())
    theirs = json.loads((FIXTURES / case / "cfg.json").read_text())
    assert ours == theirs
    saved, original = load_file(str(tmp_path / "copy" / "sae_weights.safetensors")), load_file(
        str(FIXTURES / case / "sae_weights.safetensors"))
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)


# ------------------------------------------------------------------------------------------- attached to a model

PROMPTS = [[3, 9, 4, 17, 8, 22, 5, 11, 30], [7, 2, 40, 13], [5, 6, 19, 21, 33, 8]]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(device="cpu")  # float32: the comparisons below are to float32 rounding


@pytest.fixture(scope="module")
def sae(model):
    from workbench.probes.sae_train import init_sae

    return init_sae("topk", model.config.d_model, 4 * model.config.d_model, HOOK, k=8, seed=1)


@pytest.fixture(scope="module")
def transcoder(model):
    from workbench.probes.sae_train import init_sae

    d = model.config.d_model
    return init_sae("skip_transcoder", d, 3 * d, "blocks.1.ln2.hook_normalized", hook_out="blocks.1.hook_mlp_out",
                    seed=2)


def test_a_glob_over_the_sae_points_records_them(model, sae):
    """``<hook>.hook_sae_*`` names every point of the SAE at the hook, as the exact names do; ``*`` still matches only
    the model's own points."""
    exact = model.run(PROMPTS[0], saes=[sae], record=[f"{HOOK}.{p}" for p in hooks.SAE_POINTS])
    globbed = model.run(PROMPTS[0], saes=[sae], record=[f"{HOOK}.hook_sae_*"])
    assert globbed.activations.keys() == exact.activations.keys() and len(exact.activations) == len(hooks.SAE_POINTS)
    assert all(torch.equal(globbed.activations[k], exact.activations[k]) for k in exact.activations)
    acts = model.run(PROMPTS[0], saes=[sae], record=[f"{HOOK}.hook_sae_acts_?ost"]).activations
    assert list(acts) == [f"{HOOK}.hook_sae_acts_post"]
    assert not any("sae" in name for name in model.run(PROMPTS[0], saes=[sae], record=["*"]).activations)
    with pytest.raises(HookError, match="needs an SAE"):
        model.run(PROMPTS[0], record=[f"{HOOK}.hook_sae_*"])


def test_attaching_changes_no_bit_and_records_the_sae_points(model, sae):
    points = [f"{HOOK}.{p}" for p in hooks.SAE_POINTS]
    plain = model.run(PROMPTS[0], record=[HOOK])
    attached = model.run(PROMPTS[0], saes=[sae], record=points + [HOOK])
    assert torch.equal(attached.logits, plain.logits)
    x = plain.activations[HOOK]
    acts, out = sae.forward(x)
    rec = attached.activations
    assert torch.equal(rec[f"{HOOK}.hook_sae_input"], x)
    torch.testing.assert_close(rec[f"{HOOK}.hook_sae_acts_post"], acts, rtol=0, atol=0)
    assert int((acts != 0).sum(-1).max()) == 8
    torch.testing.assert_close(rec[f"{HOOK}.hook_sae_error"], x - out)
    assert torch.equal(rec[f"{HOOK}.hook_sae_output"], x)  # the error term added back: the forward's own value
    # batches and generation alike
    plain_batch = model.run_batch(PROMPTS)
    traces = model.run_batch(PROMPTS, saes=[sae], record=[f"{HOOK}.hook_sae_acts_post"])
    for trace, plain_trace, alone in zip(traces, plain_batch, PROMPTS):
        assert torch.equal(trace.logits, plain_trace.logits)
        torch.testing.assert_close(trace.activations[f"{HOOK}.hook_sae_acts_post"],
                                   sae.encode(model.run(alone, record=[HOOK]).activations[HOOK]))
    assert model.generate(PROMPTS[1], 6, saes=[sae]) == model.generate(PROMPTS[1], 6)
    assert model.generate_batch(PROMPTS, 5, saes=[sae]) == model.generate_batch(PROMPTS, 5)


def test_splicing_puts_the_reconstruction_in_place_of_the_activation(model, sae, transcoder):
    spliced = model.run(PROMPTS[0], saes=[sae], use_error_term=False)
    by_hand = model.run(PROMPTS[0], interventions=[(HOOK, lambda x, ctx: sae(x))])
    torch.testing.assert_close(spliced.logits, by_hand.logits, rtol=0, atol=1e-5)
    assert not torch.allclose(spliced.logits, model.run(PROMPTS[0]).logits, atol=1e-2)

    plain = model.run(PROMPTS[0], record=[transcoder.hook])
    assert torch.equal(model.run(PROMPTS[0], saes=[transcoder],
                                 record=[f"{transcoder.hook}.hook_sae_acts_post"]).logits, plain.logits)
    replaced = model.run(PROMPTS[0], interventions=[(transcoder.hook_out, lambda x, ctx: transcoder(
        plain.activations[transcoder.hook]))])
    spliced = model.run(PROMPTS[0], saes=[transcoder], use_error_term=False)
    torch.testing.assert_close(spliced.logits, replaced.logits, rtol=0, atol=1e-5)


def test_feature_ablation_equals_the_hand_computed_edit(model, sae):
    x = model.run(PROMPTS[0], record=[HOOK]).activations[HOOK]
    acts = sae.encode(x)
    feature = int(acts[-2].argmax())
    assert acts[-2, feature] > 0

    def by_hand(value, ctx):
        edited = value.clone()
        edited[-2] -= acts[-2, feature] * sae.W_dec[feature]
        return edited

    ablated = model.run(PROMPTS[0], interventions=[FeatureAblate(sae, feature, positions=[-2])])
    expected = model.run(PROMPTS[0], interventions=[(HOOK, by_hand)])
    torch.testing.assert_close(ablated.logits, expected.logits, rtol=0, atol=1e-5)
    assert not torch.allclose(ablated.logits, model.run(PROMPTS[0]).logits, atol=1e-3)
    # clamping to the feature's own value changes nothing; steering adds its decoder direction
    same = model.run(PROMPTS[0], interventions=[FeatureClamp(sae, feature, float(acts[-2, feature]), positions=[-2])])
    torch.testing.assert_close(same.logits, model.run(PROMPTS[0]).logits, rtol=0, atol=1e-5)
    steered = model.run(PROMPTS[0], interventions=[FeatureSteer(sae, feature, 3.0, positions=[1])])
    added = model.run(PROMPTS[0], interventions=[hooks.Steer(HOOK, sae.W_dec[feature], 3.0, positions=[1])])
    torch.testing.assert_close(steered.logits, added.logits, rtol=0, atol=1e-5)


def test_feature_edits_are_specs_that_name_the_sae(model, sae, tmp_path):
    saved = sae.to()
    saved.save(tmp_path / "sae")
    edit = FeatureSteer(str(tmp_path / "sae"), 5, 4.0, positions="generated")
    spec = edit.to_spec()
    assert spec == {"type": "feature_steer", "sae": str((tmp_path / "sae").resolve()), "feature": 5,
                    "positions": "generated", "scale": 4.0}
    assert json.loads(json.dumps(spec)) == spec and "W_enc" not in json.dumps(spec)
    rebuilt = hooks.from_spec(spec)
    assert torch.equal(rebuilt.sae.W_dec, sae.W_dec)
    # during generation: the decoder direction added at every generated token, and at no prompt token
    steered = model.generate(PROMPTS[0], 6, interventions=[spec])
    assert steered == model.generate(PROMPTS[0], 6, interventions=[
        hooks.Steer(HOOK, sae.W_dec[5], 4.0, positions="generated")])
    assert torch.equal(model.run(PROMPTS[0], interventions=[spec]).logits, model.run(PROMPTS[0]).logits)
    register_sae("tiny-topk", sae)
    named = hooks.from_spec({"type": "feature_ablate", "sae": "tiny-topk", "feature": 3})
    assert named.sae is sae and named.to_spec()["sae"] == "tiny-topk"
    # per-prompt edits in a batch mean what they mean alone
    active = int(sae.encode(model.run(PROMPTS[2], record=[HOOK]).activations[HOOK])[0].argmax())
    edits = [[], [FeatureSteer(sae, 7, 5.0)], [FeatureAblate(sae, active, positions=[0])]]
    for trace, prompt, own in zip(model.run_batch(PROMPTS, per_prompt_interventions=edits), PROMPTS, edits):
        alone = model.run(prompt, interventions=own).logits
        torch.testing.assert_close(trace.logits, alone, rtol=1e-5, atol=1e-4)
        assert torch.allclose(alone, model.run(prompt).logits, atol=1e-3) == (not own)


def test_bad_saes_and_features_fail_before_any_compute(model, sae, monkeypatch):
    from workbench.probes.sae_train import init_sae

    register_sae("tiny-topk", sae)
    calls = []
    monkeypatch.setattr(model.runner, "forward", lambda *a, **k: calls.append(1))
    wide = init_sae("topk", model.config.d_model + 1, 32, HOOK, k=4)
    with pytest.raises(HookError, match="d_in is 65 but blocks.1.hook_resid_post has 64"):
        model.run(PROMPTS[0], saes=[wide])
    with pytest.raises(HookError, match="cannot attach to 'blocks.9.hook_resid_post'"):
        model.run(PROMPTS[0], saes=[init_sae("topk", 64, 32, "blocks.9.hook_resid_post", k=4)])
    with pytest.raises(HookError, match="one vector per token"):
        model.run(PROMPTS[0], saes=[init_sae("topk", 64, 32, "blocks.0.attn.hook_pattern", k=4)])
    with pytest.raises(HookError, match="out of range 0..255"):
        FeatureSteer(sae, 256, 1.0)
    with pytest.raises(HookError, match="needs an SAE at blocks.1.hook_resid_post"):
        model.run(PROMPTS[0], record=[f"{HOOK}.hook_sae_acts_post"])
    with pytest.raises(HookError, match="needs an SAE"):
        model.run_batch(PROMPTS, record=[f"{HOOK}.hook_sae_acts_post"])
    with pytest.raises(HookError, match="input must come first"):
        model.run(PROMPTS[0], saes=[init_sae("transcoder", 64, 32, "blocks.1.hook_mlp_out",
                                             hook_out="blocks.1.ln2.hook_normalized")])
    with pytest.raises(WorkbenchError, match="saes must be a list"):
        model.run(PROMPTS[0], saes=sae)
    with pytest.raises(HookError, match="prompt 1: .*out of range"):
        model.run_batch(PROMPTS, per_prompt_interventions=[[], [{"type": "feature_ablate", "sae": "tiny-topk",
                                                                  "feature": 999}], []])
    assert not calls
    params = dict(sae.params, W_dec=sae.W_dec.clone())
    params["W_dec"][3, 1] = float("nan")
    with pytest.raises(WorkbenchError, match="W_dec contains NaN"):
        SAE("topk", params, HOOK, k=8)


def test_sae_file_errors(tmp_path):
    with pytest.raises(WorkbenchError, match="no SAE at"):
        load_sae(tmp_path / "missing")
    (tmp_path / "cfg.json").write_text("{not json")
    (tmp_path / "sae_weights.safetensors").write_bytes(b"")
    with pytest.raises(WorkbenchError, match="cfg.json: not valid JSON"):
        load_sae(tmp_path)


def test_a_saelens_folder_whose_cfg_or_weights_lie_is_refused(tmp_path):
    from safetensors.torch import save_file
    cfg = {"d_in": 12, "d_sae": 8, "dtype": "float32", "architecture": "standard", "apply_b_dec_to_input": True,
           "normalize_activations": "none", "metadata": {"sae_lens_version": "6.0.0", "hook_name": HOOK}}
    params = {"W_enc": torch.randn(12, 8), "b_enc": torch.zeros(8), "W_dec": torch.randn(8, 12), "b_dec": torch.zeros(12)}

    def write(name, cfg, params):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cfg.json").write_text(json.dumps(cfg))
        save_file(params, str(tmp_path / name / "sae_weights.safetensors"))
        return tmp_path / name

    assert load_sae(write("good", cfg, params)).d_sae == 8
    with pytest.raises(WorkbenchError, match="cfg.json says d_in 999, but the weights have 12"):
        load_sae(write("lying", dict(cfg, d_in=999, d_sae=7), params))
    with pytest.raises(WorkbenchError, match="cfg.json says d_sae 7, but the weights have 8"):
        load_sae(write("lying_sae", dict(cfg, d_sae=7), params))
    # integer weights are refused as stored, not silently cast to the cfg's float dtype
    with pytest.raises(WorkbenchError, match="W_enc must be a floating-point tensor.*torch.int64"):
        load_sae(write("int", cfg, dict(params, W_enc=torch.randint(-3, 3, (12, 8)))))


def test_training_reports_figures_the_saved_file_gives(model, tmp_path):
    from workbench.probes.sae_train import evaluate_sae, train_sae

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (12,), generator=g).tolist() for _ in range(48)]
    train, heldout = prompts[:40], prompts[40:]
    ticks = []
    result = train_sae(model, train, HOOK, d_sae=128, k=4, tokens=896, batch_tokens=64, buffer_prompts=16,
                       heldout=heldout, checkpoint_dir=tmp_path / "run", checkpoint_every=5, dead_tokens=200,
                       progress=lambda done, total: ticks.append(done), lr=1e-2)
    # buffers of 16, 16 and 8 prompts (176, 176, 88 tokens) make 2, 2 and 1 steps of 64 a pass over the prompts
    assert result.steps == 14 and result.tokens == 896 and ticks[-1] == 896
    assert (tmp_path / "run" / "step_10" / "sae_weights.safetensors").is_file()
    assert result.history[0]["fvu"] > result.history[-1]["fvu"]  # it learns
    figures = result.evaluation
    assert 0 < figures["fvu"] < 1 and figures["l0"] <= 4 and figures["tokens"] == 8 * 11
    assert figures["ce_recovered"] == pytest.approx((figures["ce_loss_ablated"] - figures["ce_loss_spliced"])
                                                    / (figures["ce_loss_ablated"] - figures["ce_loss_clean"]))
    loaded = load_sae(tmp_path / "run" / "final")
    assert evaluate_sae(model, loaded, heldout) == figures
    # FVU and the clean loss by hand, from plain runs
    xs = torch.cat([model.run(p, record=[HOOK]).activations[HOOK][1:] for p in heldout])
    fvu = float((xs - loaded(xs)).pow(2).sum() / (xs - xs.mean(0)).pow(2).sum())
    assert figures["fvu"] == pytest.approx(fvu, rel=1e-4)
    clean = torch.cat([torch.nn.functional.cross_entropy(model.run(p).logits[1:-1], torch.tensor(p[2:]),
                                                         reduction="none") for p in heldout])
    assert figures["ce_loss_clean"] == pytest.approx(float(clean.mean()), rel=1e-5)


def test_a_skip_transcoders_attribution_sums_to_the_direct_effect_of_what_it_writes(model, transcoder):
    """Features, error, b_dec and the skip connection together: the output point's direct effect on the logit
    difference, through the final norm at the run's scale and the unembedding (computed here from a plain run)."""
    from workbench import probes

    attribution = probes.feature_attribution(model, transcoder, PROMPTS[0], target=5, baseline=7, position=-2)
    run = model.run(PROMPTS[0], record=["blocks.1.hook_mlp_out", "ln_final.hook_scale"])
    rows = model.runner.weights.unembed.dequantize_rows(torch.tensor([5, 7])).double()
    direction = (rows[0] - rows[1]) * model.runner.weights.final_norm.double()
    direct = float(run.activations["blocks.1.hook_mlp_out"][-2].double() @ direction) / float(
        run.activations["ln_final.hook_scale"][-2, 0])
    assert attribution.skip != 0 and attribution.total == pytest.approx(direct, abs=1e-4)


def test_feature_reading_tools(model, sae):
    from workbench import probes

    # on the last block's output the direct contributions sum to the model's own logit difference
    attribution = probes.feature_attribution(model, sae, PROMPTS[0], target=5, baseline=7, position=-1)
    logits = model.run(PROMPTS[0]).logits[-1]
    assert attribution.total == pytest.approx(float(logits[5] - logits[7]), abs=1e-3)
    acts = sae.encode(model.run(PROMPTS[0], record=[HOOK]).activations[HOOK])
    assert {f for f, _ in attribution.top(50)} <= set(torch.nonzero(acts[-1]).flatten().tolist())

    stats = probes.feature_stats(model, sae, PROMPTS, n=3)
    all_acts = torch.cat([sae.encode(model.run(p, record=[HOOK]).activations[HOOK]) for p in PROMPTS])
    torch.testing.assert_close(stats.density, (all_acts > 0).float().mean(0))
    torch.testing.assert_close(stats.top_values, all_acts.topk(3, dim=0).values.T, rtol=1e-5, atol=1e-5)
    feature = int(all_acts.max(0).values.argmax())
    best = stats.examples(model, feature, context=2)[0]
    prompt, position = best["prompt"], best["position"]
    assert float(acts_at := sae.encode(model.run(PROMPTS[prompt], record=[HOOK]).activations[HOOK])[
        position, feature]) == pytest.approx(best["activation"]) and acts_at == all_acts[:, feature].max()
    assert best["tokens"][best["at"]] == model.token_texts([PROMPTS[prompt][position]])[0]

    rows = probes.top_features(model, sae, PROMPTS[1], k=2)
    assert [[f for f, _ in r["features"]] for r in rows] == sae.encode(
        model.run(PROMPTS[1], record=[HOOK]).activations[HOOK]).topk(2).indices.tolist()
    for k in (0, model.config.vocab_size + 1):
        with pytest.raises(WorkbenchError, match="k must be in 1.."):
            probes.promoted_tokens(model, sae, feature, k=k)
    with pytest.raises(WorkbenchError, match=f"feature {sae.d_sae} is out of range"):
        stats.examples(model, sae.d_sae)
    promoted = probes.promoted_tokens(model, sae, feature, k=3)["promoted"]
    direction_logits = model.runner.weights.unembed.dequantize_rows(torch.arange(model.config.vocab_size)).float() @ (
        sae.W_dec[feature] * model.runner.weights.final_norm)
    assert [v for _, v in promoted] == pytest.approx(direction_logits.topk(3).values.tolist(), rel=1e-5)


def test_training_a_transcoder(model, tmp_path):
    from workbench.probes.sae_train import evaluate_sae, train_sae

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (10,), generator=g).tolist() for _ in range(20)]
    result = train_sae(model, prompts[:16], "blocks.1.ln2.hook_normalized", hook_out="blocks.1.hook_mlp_out",
                       d_sae=96, k=6, tokens=6 * 64, batch_tokens=64, buffer_prompts=8, heldout=prompts[16:], lr=1e-2)
    assert result.sae.architecture == "topk_transcoder" and result.sae.hook_out == "blocks.1.hook_mlp_out"
    assert result.history[0]["fvu"] > result.history[-1]["fvu"]
    result.sae.save(tmp_path / "tc")
    loaded = load_sae(tmp_path / "tc")
    assert (loaded.architecture, loaded.hook, loaded.hook_out, loaded.k) == (
        "topk_transcoder", "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out", 6)
    assert evaluate_sae(model, loaded, prompts[16:]) == result.evaluation
    # attached with its error term it changes nothing; its features are recordable under its input hook
    plain = model.run(prompts[0])
    traced = model.run(prompts[0], saes=[loaded], record=["blocks.1.ln2.hook_normalized.hook_sae_acts_post"])
    assert torch.equal(traced.logits, plain.logits)
    assert traced.activations["blocks.1.ln2.hook_normalized.hook_sae_acts_post"].shape == (10, 96)


def test_generated_corpus_is_cached_per_model(model, tmp_path, monkeypatch):
    from workbench.probes.sae_train import SEED_PROMPTS, generated_corpus

    texts = generated_corpus(model, 5, tmp_path / "corpus.jsonl", max_new_tokens=3, batch_size=2)
    assert [t[: len(s)] for t, s in zip(texts, SEED_PROMPTS)] == list(SEED_PROMPTS[:5])
    assert all(len(t) > len(s) for t, s in zip(texts, SEED_PROMPTS))
    monkeypatch.setattr(model, "generate_batch", lambda *a, **k: pytest.fail("the cache should answer"))
    assert generated_corpus(model, 4, tmp_path / "corpus.jsonl", max_new_tokens=3) == texts[:4]


def test_prompts_that_cannot_be_evaluated_are_refused_before_compute(model, sae):
    """A string is not a list of prompts; prompts too short for a cross-entropy, or an activation that never varies,
    give no figures rather than made-up ones (0.0 losses, a recovery of 1.0) or a ZeroDivisionError."""
    from workbench import probes
    from workbench.probes.sae_train import evaluate_sae, train_sae

    for call in (lambda: evaluate_sae(model, sae, "ab cd ef"), lambda: probes.feature_stats(model, sae, "hello"),
                 lambda: train_sae(model, "ab cd ef", HOOK, d_sae=16, k=2)):
        with pytest.raises(WorkbenchError, match="list of prompts"):
            call()
    with pytest.raises(WorkbenchError, match="at least three tokens"):
        evaluate_sae(model, sae, [[3, 9], [7, 2]])
    with pytest.raises(WorkbenchError, match="at least three tokens"):  # before any training
        train_sae(model, PROMPTS, HOOK, d_sae=16, k=2, heldout=[[3, 9]])
    with pytest.raises(WorkbenchError, match="does not vary over these 2 tokens"):
        evaluate_sae(model, sae, [[3, 3, 3]])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda(tiny_model, sae, tmp_path):
    from workbench.probes.sae_train import evaluate_sae, train_sae

    gpu = tiny_model(device="cuda")  # bfloat16: the SAE computes in its own float32 and moves to the GPU once
    plain = gpu.run(PROMPTS[0])
    traced = gpu.run(PROMPTS[0], saes=[sae], record=[f"{HOOK}.hook_sae_acts_post"])
    assert torch.equal(traced.logits, plain.logits) and sae.device.type == "cpu"
    assert torch.equal(gpu.run_batch(PROMPTS, saes=[sae])[1].logits, gpu.run_batch(PROMPTS)[1].logits)
    steered = gpu.run(PROMPTS[0], interventions=[FeatureSteer(sae, 3, 2.0)]).logits
    torch.testing.assert_close(steered, gpu.run(PROMPTS[0], interventions=[hooks.Steer(HOOK, sae.W_dec[3], 2.0)]
                                                ).logits, rtol=0.02, atol=0.25)
    assert not torch.equal(steered, plain.logits)
    assert len(gpu.generate(PROMPTS[0], 5, interventions=[FeatureSteer(sae, 3, 2.0)])) > 0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, gpu.config.vocab_size, (12,), generator=g).tolist() for _ in range(24)]
    result = train_sae(gpu, prompts[:20], HOOK, d_sae=128, k=4, tokens=256, batch_tokens=64, heldout=prompts[20:])
    assert result.steps == 4 and result.sae.device.type == "cpu"
    result.sae.save(tmp_path / "gpu")
    assert evaluate_sae(gpu, load_sae(tmp_path / "gpu"), prompts[20:]) == result.evaluation


def test_spec_paths_stay_inside_the_allowed_folder(sae, tmp_path):
    from workbench.probes.sae import sae_paths_within

    sae.to().save(tmp_path / "inside" / "sae")
    sae.to().save(tmp_path / "outside")
    spec = {"type": "feature_ablate", "sae": str(tmp_path / "outside"), "feature": 1}
    with sae_paths_within(tmp_path / "inside"):
        assert hooks.from_spec(dict(spec, sae=str(tmp_path / "inside" / "sae"))).feature == 1
        with pytest.raises(HookError, match="outside the folder SAEs may be read from"):
            hooks.from_spec(spec)
    assert hooks.from_spec(spec).sae.hook == HOOK  # the Python API reads what it is given


def test_gradients_reach_the_sae_features(model, sae):
    """The gradient at an attached SAE's feature activations is the metric's derivative along each feature: steering a
    feature by a small amount moves the metric by that amount times its gradient."""
    x = model.run(PROMPTS[0], record=[HOOK]).activations[HOOK]
    feature = int(sae.encode(x)[-1].argmax())
    ids = model.to_ids(PROMPTS[0])

    def metric(logits):  # the last position: HOOK follows the last block, where positions no longer mix
        return logits[-1, 10] - logits[-1, 11]

    point = f"{HOOK}.hook_sae_acts_post"
    got = model.run_with_gradients(ids, metric, [point], saes=[sae])
    assert got.gradients[point].shape == (len(ids), sae.d_sae)
    assert got.gradients[point][-1, feature].abs() > 1e-3
    steered = model.forward(ids, interventions=[FeatureSteer(sae, feature, 1e-2, positions=[-1])])
    moved = float(metric(steered)) - got.metric
    assert moved == pytest.approx(1e-2 * got.gradients[point][-1, feature].item(), rel=0.02)
