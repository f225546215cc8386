"""Every MCP limit on every path into a forward: direct calls, nested composite specs, donors, batches and replays of
saved traces (whose manifests may say anything), plus the artifacts folder against planted links and bad files.
The tools are called as the server calls them (a session and a cancel flag), on a tiny model with small limits."""
from __future__ import annotations

import json
import os
import sys
import threading

import anyio
import pytest

from workbench import probes
from workbench.errors import WorkbenchError
from workbench.hooks.trace import MANIFEST_FILE, TENSORS_FILE, manifest_sha256
from workbench.mcp_server import Limits, Workbench, schemas
from workbench.mcp_server.server import call_in_thread
from workbench.mcp_server.tools import Call
from mcp.server.mcpserver.exceptions import ToolError

LIMITS = Limits(max_prompt_tokens=12, max_batch=3, max_new_tokens=4, max_interventions=4,
                max_record_values=4000)
PROMPT = "the cat is on"
ZERO = {"type": "zero_ablate", "hook": "blocks.0.hook_resid_post"}


def composite(n_leaves: int, depth: int = 1) -> dict:
    spec: dict = {"type": "composite", "parts": [dict(ZERO) for _ in range(n_leaves)]}
    for _ in range(depth - 1):
        spec = {"type": "composite", "parts": [spec]}
    return spec


@pytest.fixture()
def bench(tiny_model, tmp_path):
    return Workbench(tiny_model("llama", seed=5), tmp_path / "artifacts", LIMITS, model_name="tiny")


@pytest.fixture()
def call(bench):
    with bench.sessions.using("test") as session:
        yield Call(session, threading.Event())


def refused(fn, *args, match: str, **kwargs) -> str:
    with pytest.raises(WorkbenchError, match=match) as err:
        fn(*args, **kwargs)
    return str(err.value)


LONG = "the cat " * 20  # more than 12 tokens


def forward_tools(bench, call, specs, prompt=PROMPT):
    """Each tool that runs a forward with interventions, as (name, thunk)."""
    return [
        ("run_with_interventions", lambda: bench.run_with_interventions(call, prompt=prompt, interventions=specs)),
        ("run_batch", lambda: bench.run_batch(call, prompts=[prompt, prompt], interventions=specs)),
        ("generate", lambda: bench.generate(call, prompt=prompt, max_new_tokens=2, interventions=specs)),
        ("generate_batch", lambda: bench.generate_batch(call, prompts=[prompt], max_new_tokens=2,
                                                        interventions=specs)),
        ("kv_generate", lambda: bench.kv_generate(call, bench.kv_create(call, prompt="the").cache_id, prompt=prompt,
                                                  max_new_tokens=2, interventions=specs)),
    ]


def test_composite_leaves_count_against_the_cap_on_every_tool(bench, call):
    for name, run in forward_tools(bench, call, [composite(5)]):
        assert "5 interventions (composite parts counted); the limit is 4" in refused(run, match="limit"), name
    for name, run in forward_tools(bench, call, [composite(2), composite(2, depth=3), ZERO]):
        assert "5 interventions" in refused(run, match="limit"), name
    for name, run in forward_tools(bench, call, [composite(2), composite(1, depth=3)]):
        run()  # 3 leaves: within the cap, nested or not


def test_nesting_depth_is_bounded_on_every_tool(bench, call):
    for name, run in forward_tools(bench, call, [composite(1, depth=10)]):
        assert refused(run, match="nest more than 8 deep"), name
    deep = {"type": "zero_ablate", "hook": "hook_embed"}
    for _ in range(3000):  # deeper than Python's recursion limit: refused, not a RecursionError
        deep = {"type": "composite", "parts": [deep]}
    for name, run in forward_tools(bench, call, [deep]):
        assert refused(run, match="nest more than"), name


def test_donor_prompts_are_counted_and_measured_on_every_tool(bench, call):
    many = {"type": "resample_ablate", "hook": "blocks.0.hook_resid_post", "donors": [PROMPT] * 4}
    for name, run in forward_tools(bench, call, [many]):
        assert refused(run, match="4 donor prompts; the limit is 3"), name
    hidden = composite(0)
    hidden["parts"] = [{"type": "resample_ablate", "hook": "blocks.0.hook_resid_post", "donors": [PROMPT] * 2},
                       {"type": "resample_ablate", "hook": "blocks.1.hook_resid_post", "donors": [PROMPT] * 2}]
    for name, run in forward_tools(bench, call, [hidden]):
        assert refused(run, match="4 donor prompts"), name
    long_donor = {"type": "patch", "hook": "blocks.0.hook_resid_post", "donor": LONG}
    for name, run in forward_tools(bench, call, [{"type": "composite", "parts": [long_donor]}]):
        assert refused(run, match="takes at most 12"), name
    assert refused(bench.ablate, call, prompt=PROMPT, hook="blocks.0.hook_resid_post", method="mean",
                   reference_prompts=[LONG], match="takes at most 12")


def test_prompt_and_generation_limits_on_every_tool(bench, call):
    for name, run in forward_tools(bench, call, [], prompt=LONG):
        assert refused(run, match="at most 12|between 1 and 12"), name
    huge = "x" * 10_000_000  # refused by its length before it is tokenized
    assert "characters" in refused(bench.run, call, prompt=huge, match="at most 12")
    assert refused(bench.tokenize, call, text=huge, match="characters")
    for name, run in [
        ("generate", lambda: bench.generate(call, prompt=PROMPT, max_new_tokens=5)),
        ("generate_batch", lambda: bench.generate_batch(call, prompts=[PROMPT], max_new_tokens=5)),
        ("kv_generate", lambda: bench.kv_generate(call, bench.kv_create(call, prompt="the").cache_id, prompt="cat",
                                                  max_new_tokens=5)),
    ]:
        assert refused(run, match="max_new_tokens must be between 1 and 4"), name
    assert refused(bench.run_batch, call, prompts=[PROMPT] * 4, match="prompts must be between 1 and 3")
    assert refused(bench.generate_batch, call, prompts=[PROMPT] * 4, match="prompts must be between 1 and 3")
    assert refused(bench.probe_apply, call, probe_id="probe-x", prompts=[PROMPT], match="unknown probe id")
    assert refused(bench.logit_lens, call, prompt=LONG, match="at most 12")
    assert refused(bench.track_token, call, prompt=LONG, tokens=["a"], match="at most 12")
    assert refused(bench.attention_pattern, call, prompt=LONG, layer=0, match="at most 12")
    assert refused(bench.patching_sweep, call, clean=LONG, corrupt=LONG, match="at most 12")
    assert refused(bench.dataset_patching, call, pairs=[schemas.PatchingPair(clean=LONG, corrupt=LONG)],
                   match="at most 12")


def saved_trace(bench, call, name="saved", specs=(), prompt=PROMPT, record=()):
    out = bench.run_with_interventions(call, prompt=prompt, interventions=list(specs), record=list(record)) \
        if specs else bench.run(call, prompt=prompt, record=list(record))
    bench.save_trace(call, trace_id=out.trace_id, path=name)
    return bench.artifacts.root / name


def forge(path, edit) -> None:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    edit(manifest)
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_replayed_trace_is_held_to_the_limits_of_a_direct_call(bench, call):
    path = saved_trace(bench, call, specs=[ZERO], record=["blocks.0.hook_resid_post"])
    loaded = bench.load_trace(call, path="saved")
    assert bench.replay_trace(call, trace_id=loaded.trace_id).verdict == "identical"
    forge(path, lambda m: m.update(prompt=LONG))
    long_prompt = bench.load_trace(call, path="saved").trace_id
    assert refused(bench.replay_trace, call, trace_id=long_prompt, match="takes at most 12")
    forge(path, lambda m: m.update(prompt=PROMPT, interventions=[ZERO] * 5))
    assert refused(bench.replay_trace, call, trace_id=bench.load_trace(call, path="saved").trace_id,
                   match="5 interventions")
    forge(path, lambda m: m.update(interventions=[composite(100)]))
    assert refused(bench.replay_trace, call, trace_id=bench.load_trace(call, path="saved").trace_id,
                   match="100 interventions")
    forge(path, lambda m: m.update(interventions=[composite(1, depth=12)]))
    assert refused(bench.replay_trace, call, trace_id=bench.load_trace(call, path="saved").trace_id,
                   match="nest more than")
    forge(path, lambda m: m.update(interventions=[{"type": "resample_ablate", "hook": "blocks.0.hook_resid_post",
                                                   "donors": [LONG]}]))
    assert refused(bench.replay_trace, call, trace_id=bench.load_trace(call, path="saved").trace_id,
                   match="takes at most 12")


def test_a_batch_traces_forward_is_held_to_the_limits(bench, call):
    """A batch run's trace replays by recomputing its forward's rows: they count as prompts, each held to the token
    limit and its interventions to a direct call's, and its recorded values count over all of their tokens."""
    model = bench.model(call)
    names = ["blocks.0.hook_resid_post", "blocks.0.mlp.hook_post"]  # 192 values a token
    trace = model.run_batch([PROMPT, "the dog", "a cat sat"], record=names)[1]
    path = trace.save(bench.artifacts.root / "batch")
    loaded = bench.load_trace(call, path="batch").trace_id
    assert bench.replay_trace(call, trace_id=loaded).verdict == "identical"
    ids, row = trace.batch["rows"], trace.batch["row"]
    for rows, match in (([ids[row]] * 4, "rows of the trace's batched forward must be between 1 and 3"),
                        ([ids[row], list(range(1, 20))], "takes at most 12"),
                        ([ids[row], list(range(1, 12)), list(range(1, 12))], "record fewer points")):
        forge(path, lambda m: m["batch"].update(rows=rows, row=0))
        assert refused(bench.replay_trace, call, trace_id=bench.load_trace(call, path="batch").trace_id, match=match)
    forge(path, lambda m: m["batch"].update(rows=[ids[row]] * 2, interventions=[[], [ZERO] * 5]))  # another row's
    assert refused(bench.replay_trace, call, trace_id=bench.load_trace(call, path="batch").trace_id,
                   match="5 interventions")


def test_a_replayed_trace_cannot_record_past_the_limit(bench, call):
    path = saved_trace(bench, call, record=["blocks.0.hook_resid_post"])
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    # a consistent artifact that claims every point: its replay would record far more than a run may
    from safetensors.torch import load_file, save_file
    import hashlib
    import torch
    from workbench.hooks.trace import tensor_sha256

    tensors = load_file(str(path / TENSORS_FILE))
    for layer in range(bench.model(call).config.n_layers):
        for point in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "mlp.hook_post", "mlp.hook_pre"):
            name = f"activations.blocks.{layer}.{point}"
            width = bench.model(call).config.d_mlp if "mlp" in point else bench.model(call).config.d_model
            tensors[name] = torch.zeros(len(manifest["ids"]), width)
    save_file(tensors, str(path / TENSORS_FILE))
    data = (path / TENSORS_FILE).read_bytes()
    forge(path, lambda m: m.update(
        tensors={k: {"dtype": "float32", "shape": list(t.shape), "sha256": tensor_sha256(t)} for k, t in tensors.items()},
        tensors_file={"name": TENSORS_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    trace_id = bench.load_trace(call, path="saved").trace_id
    assert refused(bench.replay_trace, call, trace_id=trace_id, match="record fewer points")


def test_replay_never_loads_a_model_named_by_the_manifest(bench, call, tmp_path, monkeypatch):
    path = saved_trace(bench, call)
    forge(path, lambda m: m["fingerprint"].update(path=str(tmp_path / "elsewhere.gguf")))
    monkeypatch.setattr(sys.modules["workbench.replay"], "load", lambda *a, **k: pytest.fail("a model was loaded"))
    out = bench.replay_trace(call, trace_id=bench.load_trace(call, path="saved").trace_id)
    assert out.verdict == "identical"  # on the session's model, whatever path the manifest names


def test_artifact_writes_and_reads_stay_in_the_folder(bench, call, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.json"
    victim.write_text("keep")
    trace_id = bench.run(call, prompt=PROMPT).trace_id
    folder = bench.artifacts.root / "planted"
    folder.mkdir(parents=True)
    (folder / MANIFEST_FILE).symlink_to(victim)
    assert refused(bench.save_trace, call, trace_id=trace_id, path="planted", match="symbolic link")
    assert victim.read_text() == "keep"
    saved_trace(bench, call, name="good")
    (bench.artifacts.root / "good" / TENSORS_FILE).rename(outside / TENSORS_FILE)
    (bench.artifacts.root / "good" / TENSORS_FILE).symlink_to(outside / TENSORS_FILE)
    assert refused(bench.load_trace, call, path="good", match="symbolic link")


def test_list_datasets_skips_a_malformed_file_and_says_so(bench, call):
    root = bench.artifacts.root
    root.mkdir(parents=True, exist_ok=True)
    (root / "good.jsonl").write_text("\n".join(json.dumps({"text": f"t{i}", "label": "ab"[i % 2]}) for i in range(4)))
    (root / "bad.jsonl").write_text("{not json\n")
    listing = bench.list_datasets(call)
    assert "good.jsonl" in [d.name for d in listing.datasets]
    assert "bad.jsonl" not in [d.name for d in listing.datasets]
    assert len(listing.skipped) == 1 and listing.skipped[0].startswith("bad.jsonl: ") and "line 1" in \
        listing.skipped[0]


def test_bad_control_vectors_through_mcp_are_tool_errors_and_the_schema_holds(bench, call):
    import gguf
    import numpy as np

    d_model = bench.model(call).config.d_model
    root = bench.artifacts.root
    root.mkdir(parents=True, exist_ok=True)
    for name, data in (("nan.gguf", np.full(d_model, np.nan, np.float32)), ("ok.gguf", np.ones(d_model, np.float32))):
        writer = gguf.GGUFWriter(str(root / name), "controlvector")
        writer.add_tensor("direction.1", data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    assert refused(bench.import_control_vector, call, path="nan.gguf", match="NaN or Inf")
    info = bench.import_control_vector(call, path="ok.gguf")
    assert info.norms == [pytest.approx(d_model ** 0.5)]
    json.dumps(info.model_dump(), allow_nan=False)  # valid JSON for the output schema


def test_an_unexpected_failure_reaches_the_client_as_one_line_with_a_reason(bench):
    def broken(call):
        return {}[("a" * 5000,)]

    with pytest.raises(ToolError) as err:
        anyio.run(call_in_thread, bench, "test", broken, {})
    message = str(err.value)
    assert message.startswith("internal error (KeyError): ") and len(message) < 300 and "\n" not in message

    def recursing(call):
        return recursing(call)

    with pytest.raises(ToolError, match=r"internal error \(RecursionError\)"):
        anyio.run(call_in_thread, bench, "test", recursing, {})
    with pytest.raises(ToolError, match="unknown intervention type") as err:
        anyio.run(call_in_thread, bench, "test", Workbench.run_with_interventions.__get__(bench),
                  {"prompt": PROMPT, "interventions": [{"type": ["steer"]}]})


def test_replay_never_loads_an_adapter_named_by_the_manifest(tiny_model, tmp_path, monkeypatch):
    """An adapter a trace ran with must be resident on the server's model (matched by sha256); the path a manifest
    names is never opened: not outside the folder, not a FIFO, not to say whether a file exists."""
    from test_adapters import write_peft

    from workbench.loading import hash_files

    model = tiny_model("llama", seed=5, cached=False)  # adapters are loaded on it
    bench = Workbench(model, tmp_path / "artifacts", LIMITS, model_name="tiny")
    with bench.sessions.using("test") as session:
        call = Call(session, threading.Event())
        peft = write_peft(bench.artifacts.root / "lora", model.config, seed=1)
        sha = hash_files([peft / "adapter_config.json", peft / "adapter_model.safetensors"])
        bench.load_adapter(call, path="lora", name="mine")
        trace = model.run(PROMPT, adapter="mine")
        trace.save(bench.artifacts.root / "saved")
        assert bench.replay_trace(call, trace_id=bench.load_trace(call, path="saved").trace_id).verdict == "identical"
        model.unload_adapter("mine")
        outside = write_peft(tmp_path / "outside", model.config, seed=1)  # the very same adapter, outside the folder
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        monkeypatch.setattr(sys.modules["workbench.model"], "load_adapter",
                            lambda *a, **k: pytest.fail("an adapter was loaded"))
        for path in (str(outside), str(fifo), "/nonexistent", "lora"):
            forge(bench.artifacts.root / "saved", lambda m: m.update(adapters=[
                {"name": "mine", "path": path, "sha256": sha, "scale": 1.0}]))
            trace_id = bench.load_trace(call, path="saved").trace_id
            message = refused(bench.replay_trace, call, trace_id=trace_id, match="not resident")
            assert "'mine'" in message and sha[:12] in message and path not in message
            assert model.adapters == {}
        monkeypatch.undo()
        bench.load_adapter(call, path="lora", name="other name")  # the same file, resident under another name
        assert bench.replay_trace(call, trace_id=trace_id).verdict == "identical"


def test_sae_train_checks_its_arguments_first_and_always_ends(bench, call, monkeypatch):
    from workbench import probes

    hook = "blocks.0.hook_resid_post"
    (bench.artifacts.root / "a file").parent.mkdir(parents=True, exist_ok=True)
    (bench.artifacts.root / "a file").write_text("keep")
    with monkeypatch.context() as patched:
        for name in ("python_docs_corpus", "train_sae"):
            patched.setattr(probes, name, lambda *a, **k: pytest.fail("computed before the arguments were checked"))
        for arguments, match in (
                (dict(k=0), "k must be between 1 and 64"), (dict(k=65), "k must be between 1 and 64"),
                (dict(batch_tokens=10 ** 9), "batch_tokens must be between 1 and 4096"),
                (dict(hook="blocks.*.hook_resid_post"), "one hook point"), (dict(hook="blocks.0.nope"), "nope"),
                (dict(hook_out="blocks.*.hook_mlp_out"), "one hook point"), (dict(path="../out"), "outside"),
                (dict(path="a file"), "not a folder")):
            refused(bench.sae_train, call, **{"hook": hook, "path": "sae", "d_sae": 64, **arguments}, match=match)
    assert (bench.artifacts.root / "a file").read_text() == "keep"
    ended = []

    def train() -> None:  # two short prompts never fill a step of 1024 tokens: refused, not a loop without end
        with pytest.raises(WorkbenchError, match="batch_tokens"):
            bench.sae_train(call, hook=hook, path="sae", d_sae=64, k=4, prompts=["the cat", "on the mat"],
                            max_seconds=2)
        ended.append(True)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    thread.join(60)
    assert ended, "sae_train did not end"
    out = bench.sae_train(call, hook=hook, path="sae", d_sae=64, k=4, prompts=[PROMPT, PROMPT, "the cat"],
                          batch_tokens=4, max_seconds=2)
    assert out.summary["steps"] > 0


def test_links_inside_sae_adapter_and_checkpoint_folders_are_refused(bench, call, tmp_path):
    """A folder in the artifacts folder whose files are links (out of it, or anywhere) is refused by sae_load,
    load_adapter and load_model, as a trace's members are; a FIFO member is refused without blocking, by the Python
    API too, which otherwise follows links (a Hugging Face cache holds them)."""
    from test_adapters import write_peft
    from test_loading import hf_model

    from workbench.probes.sae_train import init_sae

    root, outside = bench.artifacts.root, tmp_path / "outside"
    model = bench.model(call)
    init_sae("topk", model.config.d_model, 16, "blocks.0.hook_resid_post", k=2).save(root / "sae")
    write_peft(root / "lora", model.config)
    hf_model("llama", root / "hf", tie=False)
    cases = [("sae", "sae_weights.safetensors", "sae_load"), ("lora", "adapter_model.safetensors", "load_adapter"),
             ("hf", "config.json", "load_model")]
    for folder, member, tool in cases:
        (outside / folder).mkdir(parents=True)
        (root / folder / member).rename(outside / folder / member)
        (root / folder / member).symlink_to(outside / folder / member)
        with pytest.raises(ToolError, match="symbolic link; refused"):  # as the server calls it
            anyio.run(call_in_thread, bench, "test", getattr(bench, tool), {"path": folder})
    assert bench.model(call).adapters == {} and call.session.of_kind("sae") == {}
    assert call.session.model_name == "tiny"
    workbench_load_adapter = model.load_adapter  # the Python API follows the link
    assert workbench_load_adapter(root / "lora", name="api").sha256
    model.unload_adapter("api")
    (root / "lora" / "adapter_model.safetensors").unlink()
    os.mkfifo(root / "lora" / "adapter_model.safetensors")
    with pytest.raises(WorkbenchError, match="not a regular file"):
        model.load_adapter(root / "lora", name="fifo")
    (root / "hf" / "config.json").unlink()
    os.mkfifo(root / "hf" / "config.json")
    import workbench

    with pytest.raises(WorkbenchError, match="not a regular file"):
        workbench.load(root / "hf", device="cpu")


def test_a_trace_of_another_vocabulary_loads_and_lists_and_a_failed_load_keeps_nothing(bench, call, monkeypatch):
    import hashlib

    import torch
    from safetensors.torch import load_file, save

    from workbench.hooks.trace import tensor_sha256

    kept = bench.run(call, prompt=PROMPT).trace_id
    path = saved_trace(bench, call)
    tensors = load_file(str(path / TENSORS_FILE))
    tensors["logits"] = torch.randn(tensors["logits"].shape[0], 3)  # a model of three tokens
    data = save(tensors)
    (path / TENSORS_FILE).write_bytes(data)
    forge(path, lambda m: m.update(
        tensors={k: {"dtype": "float32", "shape": list(t.shape), "sha256": tensor_sha256(t)}
                 for k, t in tensors.items()},
        tensors_file={"name": TENSORS_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    loaded = bench.load_trace(call, path="saved")
    assert len(loaded.next_token.top) == 3 and {t.token for t in loaded.next_token.top} == {""}
    assert {kept, loaded.trace_id} <= {t.trace_id for t in bench.list_traces(call).traces}
    held = dict(call.session.entries)
    monkeypatch.setattr(Workbench, "_summarize", lambda *a: (_ for _ in ()).throw(WorkbenchError("no summary")))
    refused(bench.load_trace, call, path="saved", match="no summary")
    assert call.session.entries == held  # nothing kept of the failed load


def test_export_control_vector_writes_only_a_file_import_reads(bench, call):
    import gguf
    import numpy as np

    root = bench.artifacts.root
    root.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(root / "ok.gguf"), "controlvector")
    writer.add_tensor("direction.1", np.ones(bench.model(call).config.d_model, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    vector_id = bench.import_control_vector(call, path="ok.gguf").vector_id
    assert refused(bench.export_control_vector, call, vector_id=vector_id, path="big.gguf", scale=1e39,
                   match="past float32's range")
    (root / "folder.gguf").mkdir()
    message = refused(bench.export_control_vector, call, vector_id=vector_id, path="folder.gguf",
                      match="not a regular file")
    assert "\n" not in message
    assert not (root / "big.gguf").exists() and list((root / "folder.gguf").iterdir()) == []
    bench.export_control_vector(call, vector_id=vector_id, path="big.gguf", scale=1e15)
    assert bench.import_control_vector(call, path="big.gguf").norms[0] == pytest.approx(
        1e15 * bench.model(call).config.d_model ** 0.5, rel=1e-6)


def test_a_batch_trace_that_kept_less_loads_replays_and_is_compared_by_what_it_kept(bench, call):
    """A trace saved from a batch run with no logits and one row per point: its summary has no next token, its
    activation is one position, it replays, and comparing it is refused by name (no tool crashes on it)."""
    model = bench.model(call)
    name = "blocks.0.hook_resid_post"
    trace = model.run_batch([PROMPT, "the dog"], record=[name], logits=None, reduce="last")[0]
    trace.save(bench.artifacts.root / "reduced")
    loaded = bench.load_trace(call, path="reduced")
    assert loaded.next_token is None and loaded.recorded == {name: [model.config.d_model]}
    sliced = bench.get_activation(call, trace_id=loaded.trace_id, hook=name, positions=[-1])
    assert sliced.shape == [1, model.config.d_model]
    assert bench.replay_trace(call, trace_id=loaded.trace_id).verdict != "different"
    other = bench.run(call, prompt=PROMPT, record=[name]).trace_id
    refused(bench.compare_traces, call, a=other, b=loaded.trace_id, match="kept no logits")


def test_growth_records_and_grids_stay_within_the_limits(tiny_model, tmp_path):
    """The paths that grew past a limit: a cache generating in place (session memory), mean ablation's reference runs
    (recorded values) and attribution grids (returned numbers)."""
    small = Limits(max_prompt_tokens=64, max_batch=3, max_new_tokens=64, max_record_values=4000, max_values=50,
                   max_session_bytes=40_000)
    bench = Workbench(tiny_model("llama", seed=5), tmp_path / "artifacts", small, model_name="tiny")
    with bench.sessions.using("test") as session:
        call = Call(session, threading.Event())
        cache_id = bench.kv_create(call, prompt="one two three").cache_id  # 64 slots of 512 bytes
        cache = session.entries[cache_id].value
        held, length = cache.nbytes, cache.length
        refused(bench.kv_generate, call, cache_id=cache_id, prompt=" six", max_new_tokens=64,
                match="the limits are .* MiB")  # past 64 slots the cache would double, past the 40 KB
        assert (cache.nbytes, cache.length) == (held, length)
        bench.release(call, ids=[cache_id])
        mean = dict(prompt=PROMPT, method="mean", reference_prompts=[LONG[:40]] * 3)
        refused(bench.ablate, call, hook="blocks.0.mlp.hook_post", **mean, match="keeps .* values; the limit is 4,000")
        refused(bench.ablate, call, hook="blocks.*.hook_resid_post", **mean, match="one hook point")
        bench.ablate(call, hook="blocks.0.hook_resid_post", **mean)  # 3 x 10 tokens x 64: within it
        refused(bench.patching_sweep, call, clean=PROMPT, corrupt=PROMPT, method="attribution",
                over=["layers", "positions", "heads"], match="grid has 64 cells; at most 50 numbers")


def test_a_refused_call_changes_nothing_in_the_session(bench, call):
    model = bench.model(call)
    before = dict(call.session.entries)
    refused(bench.steer, call, prompt=PROMPT, hook="blocks.0.hook_resid_post", vector=[1.0, 2.0], match="shape")
    refused(bench.ablate, call, prompt=PROMPT, hook="blocks.0.hook_resid_post", positions=[40], match="out of range")
    assert call.session.entries == before  # no baseline trace left behind
    trace_id = bench.run(call, prompt=PROMPT, record=["blocks.0.attn.hook_z"]).trace_id
    refused(bench.get_activation, call, trace_id=trace_id, hook="blocks.0.attn.hook_z", heads=[], match="empty")
    assert bench.release(call, ids=[trace_id, trace_id]).released == [trace_id]
    cache_id = bench.kv_create(call, prompt=PROMPT).cache_id
    call.session.model_name = "another"  # as after load_model: the cache is not this model's
    for tool, kwargs in (("kv_truncate", dict(length=1)), ("kv_clone", {}), ("kv_clear_layer", dict(layer=0)),
                         ("kv_delete_positions", dict(slots=[0]))):
        refused(getattr(bench, tool), call, cache_id=cache_id, **kwargs, match="made on model 'tiny'")
    call.session.model_name = "tiny"
    assert bench.kv_truncate(call, cache_id=cache_id, length=2).length == 2
    vector_id = call.session.put("vector", probes.steering_vector(model, (["the cat"], ["the dog"]), layers=[0, 1]))
    refused(bench.run_with_interventions, call, prompt=PROMPT, interventions=[
        {"type": "zero_ablate", "vector": {"id": vector_id}}], match="stands in a steer spec")
    refused(bench.run_with_interventions, call, prompt=PROMPT, interventions=[
        {"type": "steer", "vector": {"id": vector_id}, "bogus": 1}], match="bogus")
    refused(bench.load_model, call, path="embedded", quantize="Q8_0", match="float checkpoints")


def test_an_edit_s_two_traces_keep_notes_of_their_own(bench, call):
    """Saving the edited trace of a steer names its path in its own entry, not the baseline's."""
    out = bench.steer(call, prompt=PROMPT, hook="blocks.0.hook_resid_post",
                      vector=[1.0] * bench.model(call).config.d_model)
    bench.save_trace(call, trace_id=out.trace_id, path="edited")
    assert bench.trace_summary(call, out.trace_id).path == "edited"
    assert bench.trace_summary(call, out.baseline_trace_id).path is None
