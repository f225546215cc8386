"""Trace artifacts: save/load with verified hashes, replay verdicts, the CLI, and TransformerLens caches."""
from __future__ import annotations

import json
import sys

import pytest
import torch

import workbench
from workbench import hooks
from workbench.cli import main
from workbench.hooks.trace import MANIFEST_FILE, TENSORS_FILE, TraceError, manifest_sha256
from workbench.synthetic import write_gguf

IDS = [5, 17, 42, 99, 7, 23]
RECORD = ["blocks.*.hook_resid_post", "blocks.1.attn.hook_pattern", "ln_final.hook_scale"]


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory, tiny_checkpoint):
    """A small random model loaded from a GGUF file, so a replay can find it by the path in the trace."""
    checkpoint = tiny_checkpoint("qwen2", seed=2, n_layers=2)
    path = write_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", checkpoint.config, checkpoint.weights)
    return workbench.load(path, device="cpu", dtype="float32")


@pytest.fixture()
def trace(gguf_model):
    steer = hooks.Steer("blocks.0.hook_resid_post", torch.ones(gguf_model.config.d_model), positions=[2, 3])
    out = gguf_model.run(IDS, record=RECORD, interventions=[steer])
    out.metrics["answer_logit"] = float(out.logits[-1, 3])
    return out


def test_save_and_load_round_trip(trace, tmp_path):
    path = trace.save(tmp_path / "artifact")
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST_FILE, TENSORS_FILE]
    loaded = workbench.load_trace(path)
    assert torch.equal(loaded.logits, trace.logits)
    assert loaded.activations.keys() == trace.activations.keys()
    assert all(torch.equal(loaded.activations[k], v) for k, v in trace.activations.items())
    for field in ("prompt", "ids", "tokens", "interventions", "fingerprint", "backend", "versions", "seed", "chat",
                  "metrics"):
        assert getattr(loaded, field) == json.loads(json.dumps(getattr(trace, field))), field
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["schema_version"] == 2 and manifest["fingerprint"]["sha256"] == trace.fingerprint["sha256"]
    assert set(manifest["tensors"]) == {"logits"} | {f"activations.{k}" for k in trace.activations}
    assert workbench.load_trace(path / MANIFEST_FILE).ids == IDS  # the manifest path works too


def tamper_byte(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_manifest(path, edit, rehash: bool = True) -> None:
    """Edit the manifest, and (as a careful forger would) make its own hash agree, so the deeper checks are tried."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    edit(manifest)
    if rehash:
        manifest["manifest_sha256"] = manifest_sha256(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, message", [
    (lambda p: tamper_byte(p / TENSORS_FILE), "modified or is corrupt"),
    (lambda p: (p / TENSORS_FILE).write_bytes((p / TENSORS_FILE).read_bytes()[:-10]), "modified or is corrupt"),
    (lambda p: (p / TENSORS_FILE).unlink(), "missing"),
    (lambda p: (p / MANIFEST_FILE).unlink(), "not a trace artifact"),
    (lambda p: (p / MANIFEST_FILE).write_text("{not json"), "not valid JSON"),
    (lambda p: edit_manifest(p, lambda m: m.update(schema_version=99)), "schema version 99"),
    (lambda p: edit_manifest(p, lambda m: m["tensors"]["logits"].update(sha256="0" * 64)), "does not match its manifest"),
    (lambda p: edit_manifest(p, lambda m: m["tensors"].pop("logits")), "does not hold the tensors"),
])
def test_a_damaged_artifact_is_refused(trace, tmp_path, damage, message):
    path = trace.save(tmp_path / "artifact")
    damage(path)
    with pytest.raises(TraceError, match=message):
        workbench.load_trace(path)


def test_replay_is_identical_on_the_same_model(trace, gguf_model, tmp_path):
    path = trace.save(tmp_path / "artifact")
    report = workbench.replay(path, gguf_model)
    assert report.verdict == "identical" and report.max_abs_deviation == 0
    assert report.tensors_compared == 1 + len(trace.activations)
    # without a model, the replay loads it from the path recorded in the trace
    assert workbench.replay(path).verdict == "identical"


def resaved_with(trace, tmp_path, key: str, delta: float):
    """The artifact re-saved, consistently hashed, with one value of one tensor moved by ``delta``."""
    tensor = trace.logits if key == "logits" else trace.activations[key]
    tensor[1, 2] += delta
    return trace.save(tmp_path / f"changed-{delta}")


def test_replay_reports_within_tolerance_and_different_with_the_largest_deviation(trace, gguf_model, tmp_path):
    name = "blocks.1.hook_resid_post"
    scale = trace.activations[name].abs().max().item()
    slightly = workbench.replay(resaved_with(trace, tmp_path, name, 1e-5 * scale), gguf_model)
    assert slightly.verdict == "within tolerance" and slightly.worst_tensor == name
    clearly = workbench.replay(resaved_with(trace, tmp_path, "logits", 0.5), gguf_model)
    assert clearly.verdict == "different" and clearly.worst_tensor == "logits"
    assert clearly.max_abs_deviation == pytest.approx(0.5, rel=1e-3)
    assert "logits" in str(clearly)


def test_replay_refuses_another_model_unless_forced(trace, tmp_path, tiny_model):
    other = tiny_model("qwen2", n_layers=2, seed=9)
    path = trace.save(tmp_path / "artifact")
    with pytest.raises(workbench.WorkbenchError, match="another model"):
        workbench.replay(path, other)
    forced = workbench.replay(path, other, force=True)
    assert forced.model_forced and forced.verdict == "different"


def test_replay_refuses_a_function_hook_trace(gguf_model, tmp_path):
    trace = gguf_model.run(IDS, interventions=[("blocks.0.hook_resid_pre", lambda x, ctx: None)])
    with pytest.raises(workbench.HookError, match="cannot be rebuilt"):
        workbench.replay(trace.save(tmp_path / "artifact"), gguf_model)


def test_cli_replay(trace, tmp_path, capsys):
    path = trace.save(tmp_path / "artifact")
    assert main(["replay", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "identical"
    changed = resaved_with(trace, tmp_path, "logits", 1.0)
    assert main(["replay", str(changed)]) == 1
    assert capsys.readouterr().out.startswith("different")
    tamper_byte(changed / TENSORS_FILE)
    assert main(["replay", str(changed)]) == 2
    assert "modified or is corrupt" in capsys.readouterr().err


def test_replay_loads_the_recorded_model_on_the_device_and_dtype_asked_for(trace, gguf_model, tmp_path, capsys):
    """``workbench replay ARTIFACT --dtype ...`` (or ``--device``, ``--devices``) without ``--model`` loads the trace's
    own model that way, rather than ignoring the flag; ``--quantize`` needs ``--model``."""
    path = trace.save(tmp_path / "artifact")
    assert main(["replay", str(path), "--dtype", "bfloat16", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "different" and report["max_abs_deviation"] > 1e-3
    split = workbench.replay(path, devices=["cpu", "cpu"])
    assert split.verdict == "identical"
    assert main(["replay", str(path), "--quantize", "Q8_0"]) == 2
    assert "--quantize needs --model" in capsys.readouterr().err
    with pytest.raises(workbench.WorkbenchError, match="a given model keeps its own"):
        workbench.replay(path, gguf_model, dtype="bfloat16")


def test_activation_cache_utilities(gguf_model):
    # no hook_result recorded: stack_head_results must compute it from hook_z and W_O
    full = gguf_model.run(IDS, record=["hook_embed", "blocks.*.hook_resid_*", "blocks.*.hook_*_out",
                                       "blocks.*.attn.hook_z", "*.hook_scale"])
    cache = full.to_activation_cache(gguf_model)
    L, T, d = gguf_model.config.n_layers, len(IDS), gguf_model.config.d_model
    assert cache["resid_pre", 1].shape == (1, T, d)
    assert torch.equal(cache["resid_pre", 1][0], full.activations["blocks.1.hook_resid_pre"])
    assert cache.stack_activation("resid_post").shape == (L, 1, T, d)
    # logit lens: the last accumulated residual, normalized, through the (folded) unembedding is the logits
    accumulated, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"]
    torch.testing.assert_close(accumulated[-1, 0] @ cache.model.W_U, full.logits, rtol=1e-4, atol=1e-4)
    # the residual stream decomposes into embed + attention and MLP outputs...
    components = cache.decompose_resid()
    final_resid = full.activations[f"blocks.{L - 1}.hook_resid_post"]
    torch.testing.assert_close(components.sum(0)[0], final_resid, rtol=1e-5, atol=1e-5)
    # ...whose direct logit attributions (cached final-norm scale) add up to a real logit
    attributions = cache.logit_attrs(components, tokens=3)
    torch.testing.assert_close(attributions.sum(0)[0], full.logits[:, 3], rtol=1e-4, atol=1e-4)
    # per-head results from hook_z and W_O add up to attn_out
    heads = cache.stack_head_results(layer=1)
    torch.testing.assert_close(heads.sum(0)[0], full.activations["blocks.0.hook_attn_out"], rtol=1e-4, atol=1e-4)


def test_activation_cache_without_the_model(trace):
    cache = trace.to_activation_cache()
    assert cache.stack_activation("resid_post").shape[0] == 2
    with pytest.raises(workbench.WorkbenchError, match="model's weights"):
        cache.model.W_U


def test_embedded_trace_replays_identically(model, tmp_path):
    steer = hooks.Steer("blocks.10.hook_resid_post", torch.ones(model.config.d_model), scale=4.0, positions=[-1])
    trace = model.run("The Eiffel Tower is in the city of", record=["blocks.*.hook_resid_post"], interventions=[steer])
    path = trace.save(tmp_path / "embedded")
    assert workbench.load_trace(path).fingerprint["sha256"] == model.file_sha256
    report = workbench.replay(path, model)
    assert report.verdict == "identical" and report.tensors_compared == 1 + model.config.n_layers


def test_replay_computes_in_the_recorded_numerics(model, tmp_path):
    """A trace recorded under llama.cpp numerics replays bit-identically under them, whatever the caller's mode."""
    with workbench.kernels.numerics("llamacpp"):
        trace = model.run("The Eiffel Tower is in the city of", record=["blocks.3.hook_resid_post"])
    assert trace.backend["numerics"] == "llamacpp" and "cpu-gguf-llamacpp" in trace.backend["kernels"]
    exact = model.run("The Eiffel Tower is in the city of")
    assert not torch.equal(exact.logits, trace.logits)
    report = workbench.replay(trace.save(tmp_path / "llamacpp"), model)
    assert report.verdict == "identical"
    assert workbench.kernels.get_numerics() == "exact"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensor_sha256_on_the_gpu_hashes_the_same_bytes_chunk_by_chunk(monkeypatch):
    import hashlib
    from workbench.hooks import trace
    monkeypatch.setattr(trace, "_DEVICE_CHUNK", 1000)  # several chunks and a short last one
    t = torch.randn(3, 1234, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    assert trace.tensor_sha256(t) == expected
    assert trace.tensor_sha256(t.cuda()) == expected
    assert trace.tensor_sha256(t.cuda().t()) == trace.tensor_sha256(t.t())  # a view: its bytes in memory order


@pytest.mark.parametrize("name, tensor, message", [
    ("blocks.1.hook_resid_post", lambda t: t > 0, "holds bool"),
    ("blocks.1.hook_resid_post", lambda t: torch.complex(t, t), "holds complex64"),
    ("blocks.*.hook_resid_post", lambda t: t, "not named by one hook point"),
    ("blocks.1.", lambda t: t, "not named by one hook point"),
])
def test_a_consistent_artifact_with_impossible_activations_is_refused(trace, tmp_path, capsys, name, tensor, message):
    """Hashes that agree prove nothing about what a tensor is: an activation that no run records is refused on load,
    and the command line says so in one line."""
    trace.activations[name] = tensor(trace.activations.pop("blocks.1.hook_resid_post"))
    path = trace.save(tmp_path / "forged")
    with pytest.raises(TraceError, match=message):
        workbench.load_trace(path)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench: error: ") and message in err and err.count("\n") == 1


def test_the_command_line_reports_an_unexpected_failure_in_one_line(trace, tmp_path, capsys, monkeypatch):
    path = trace.save(tmp_path / "artifact")
    monkeypatch.setattr(sys.modules["workbench.replay"], "replay", lambda *a, **k: {}["missing"])
    assert main(["replay", str(path)]) == 3
    err = capsys.readouterr().err
    assert err.startswith("workbench: internal error (KeyError): 'missing'") and err.count("\n") == 1
    monkeypatch.setenv("WORKBENCH_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["replay", str(path)])


def test_replay_never_hashes_a_fifo_in_the_recorded_model_folder(trace, tmp_path):
    import os
    import threading

    folder = tmp_path / "model"
    folder.mkdir()
    os.mkfifo(folder / "model.safetensors")  # hashing it would block for good
    trace.fingerprint = {**trace.fingerprint, "path": str(folder)}
    ended = []

    def replay() -> None:
        with pytest.raises(workbench.WorkbenchError, match="not a regular file"):
            workbench.replay(trace)
        ended.append(True)

    thread = threading.Thread(target=replay, daemon=True)
    thread.start()
    thread.join(20)
    assert ended


def test_batch_traces_that_keep_less_save_load_and_replay_as_kept(gguf_model, tmp_path):
    """A batch run's trace keeps what it was asked for (the last position's logits, none, one row per point): it
    saves, loads and replays as kept, and what it did not keep is refused by name."""
    name = "blocks.1.hook_resid_post"
    full = gguf_model.run_batch([IDS, IDS[:3]], record=[name])[0]
    for logits, reduce in (("last", None), ("last", "mean"), (None, -2), (None, None)):
        trace = gguf_model.run_batch([IDS, IDS[:3]], record=[name], logits=logits, reduce=reduce)[0]
        path = trace.save(tmp_path / f"{logits}-{reduce}")
        loaded = workbench.load_trace(path)
        assert loaded.reduce == reduce and (loaded.logits is None) == (logits is None)
        assert torch.equal(loaded.activations[name], trace.activations[name])
        report = workbench.replay(loaded, gguf_model)
        assert report.ok and report.tensors_compared == 1 + (logits is not None), report
        loaded.activations[name][0] += 1.0
        assert workbench.replay(loaded, gguf_model).verdict == "different"
        if logits == "last":
            torch.testing.assert_close(loaded.logits_at(-1), full.logits[-1], atol=2e-4, rtol=0)
            with pytest.raises(TraceError, match="last position's logits alone"):
                loaded.top_tokens(position=0)
            comparison = full.compare(loaded)
            assert comparison.kl_per_position is None and comparison.max_abs_logit_diff < 2e-4
        else:
            with pytest.raises(TraceError, match="kept no logits"):
                loaded.next_token()
        if reduce is not None:
            with pytest.raises(workbench.WorkbenchError, match="one row per point"):
                loaded.to_activation_cache()
    with pytest.raises(TraceError, match="outside the trace's 6 tokens"):
        full.logits_at(6)


def test_a_batch_trace_replays_its_forward_bit_for_bit(gguf_model, tmp_path):
    """A batch run's trace records its forward's rows, and the replay recomputes that forward: in bfloat16, where a
    forward of other rows rounds otherwise, it is identical whole, reduced, stopped early, steered (every row, or rows
    of their own) and past shared prefixes. Without the rows it runs the prompt alone, and rounds otherwise."""
    model = workbench.load(gguf_model.path, device="cpu", dtype="bfloat16")
    prompts = [IDS + IDS, IDS, IDS[:4] + [1, 2], [9], list(range(1, 30))]  # 54 rows: panels, not the fused dot
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"]
    steer = hooks.Steer("blocks.0.hook_resid_post", torch.ones(model.config.d_model), positions=[-1])
    for i, kwargs in enumerate([{}, {"logits": "last", "reduce": "mean"}, {"logits": None, "reduce": 0},
                                {"interventions": [steer]}, {"share_prefix": False}]):
        traces = model.run_batch(prompts, record=names, **kwargs)
        for b in (1, 3):
            path = traces[b].save(tmp_path / f"{i}-{b}")
            batch = workbench.load_trace(path).batch
            assert batch == traces[b].batch and sorted(batch["rows"]) == sorted(prompts)  # longest first
            report = workbench.replay(path, model)
            assert report.verdict == "identical", (kwargs, b, report)
    alone = model.run_batch(prompts, record=names)[1]
    alone.batch = None
    assert workbench.replay(alone, model).verdict == "different"  # bfloat16 rounds this prompt otherwise alone
    own = model.run_batch(prompts, record=names, per_prompt_interventions=[[steer], [], [], [], [steer]])
    assert own[1].batch["interventions"] == [t.interventions for t in sorted(own, key=lambda t: -len(t.ids))]
    assert all(workbench.replay(own[b].save(tmp_path / f"own{b}"), model).verdict == "identical" for b in (0, 1))
    own[1].batch = None
    assert workbench.replay(own[1], model).verdict == "different"
    assert own[0].batch["rows"][own[0].batch["row"]] is not own[0].ids  # a copy: editing the ids leaves it as it ran
    halve = ("blocks.0.hook_resid_post", lambda x, ctx: x * 0.5)  # a function no spec rebuilds, in another row
    clean = model.run_batch(prompts, record=names, per_prompt_interventions=[[halve], [], [], [], []])[1]
    assert clean.batch is None and workbench.replay(clean, model).verdict == "different"  # replayed alone


def test_a_forged_batch_is_refused_or_named_in_the_replays_error(gguf_model, tmp_path):
    one_token = gguf_model.run_batch([[9], IDS], record=["blocks.0.hook_resid_post"])[0]
    path = one_token.save(tmp_path / "one")
    edit_manifest(path, lambda m: m["batch"].update(logits=None))  # [1, vocab] logits kept: "all" or "last"
    with pytest.raises(TraceError, match="must say which logits the trace kept"):
        workbench.load_trace(path)
    edit_manifest(path, lambda m: m["batch"].update(logits="last"))
    assert workbench.replay(path, gguf_model).ok
    edit_manifest(path, lambda m: m["batch"]["rows"].append([gguf_model.config.vocab_size]))
    with pytest.raises(workbench.WorkbenchError, match="the trace's batched forward .*token ids out of range"):
        workbench.replay(path, gguf_model)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(reduce=None), "not one row per token"),
    (lambda m: m.update(reduce="median"), "'reduce'"),
    (lambda m: m.update(reduce=99), "lies outside them"),
    (lambda m: m.update(batch=[1]), "'batch' must be null or hold exactly"),
    (lambda m: m["batch"].update(extra=1), "'batch' must be null or hold exactly"),
    (lambda m: m["batch"].update(rows=[[5, True]]), "non-empty list of non-empty lists of token ids"),
    (lambda m: m["batch"].update(rows=[[]]), "non-empty list of non-empty lists of token ids"),
    (lambda m: m["batch"].update(row=1), "'row' must index the row that holds the trace's ids"),
    (lambda m: m["batch"]["rows"][0].append(7), "'row' must index the row that holds the trace's ids"),
    (lambda m: m["batch"].update(logits=None), "must say which logits the trace kept"),
    (lambda m: m["batch"].update(share_prefix="yes"), "'share_prefix' must be true or false"),
    (lambda m: m["batch"].update(interventions={}), "'interventions' must be null or a list of each row's specs"),
    (lambda m: m["batch"].update(interventions=[[{"type": "zero_ablate", "hook": "hook_embed"}]]),
     "'interventions' must be null or a list of each row's specs"),
    (lambda m: m["batch"].update(interventions=[[1]]), "'interventions' must be null or a list of each row's specs"),
])
def test_a_forged_reduction_is_refused(gguf_model, tmp_path, edit, message):
    trace = gguf_model.run_batch([IDS], record=["blocks.0.hook_resid_post"], reduce="last")[0]
    path = trace.save(tmp_path / "reduced")
    edit_manifest(path, edit)
    with pytest.raises(TraceError, match=message):
        workbench.load_trace(path)


def test_replay_compares_bits_nan_included_and_never_casts_across_kinds(gguf_model, tmp_path):
    """A trace whose values overflowed to NaN replays identical (NaN where NaN was recorded); integers forged into a
    float point are refused on load; tolerances are checked; an empty path and an empty trace are refused."""
    name = "blocks.1.hook_resid_post"
    blown = gguf_model.run(IDS, record=[name], interventions=[hooks.Scale("blocks.0.hook_resid_post", factor=1e38)])
    assert blown.activations[name].isnan().any() or blown.activations[name].isinf().any()
    report = workbench.replay(blown.save(tmp_path / "nan"), gguf_model)
    assert report.verdict == "identical" and report.max_abs_deviation == 0
    forged = gguf_model.run(IDS, record=[name])
    forged.activations[name] = forged.activations[name].to(torch.int8)
    with pytest.raises(TraceError, match="holds int8; this point is recorded as float16"):
        workbench.load_trace(forged.save(tmp_path / "int8"))
    for rtol, atol in ((float("nan"), 1e-5), (1e-3, -1.0), (float("inf"), 1e-5)):
        with pytest.raises(workbench.WorkbenchError, match="rtol|atol"):
            workbench.replay(tmp_path / "nan", gguf_model, rtol=rtol, atol=atol)
    with pytest.raises(TraceError, match="path is empty"):
        forged.save("")
    with pytest.raises(TraceError, match="path is empty"):
        workbench.load_trace(" ")
    empty = gguf_model.run(IDS, record=[name])
    empty.logits, empty.activations = None, {}
    with pytest.raises(TraceError, match="neither logits nor activations"):
        workbench.load_trace(empty.save(tmp_path / "empty"))
