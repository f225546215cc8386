"""Attacks on the artifacts folder, trace manifests, model files, control vectors, chat templates and argv: each is
refused with a one-line WorkbenchError, and nothing is written or read outside the folder it belongs to."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import workbench
from workbench import hooks, probes
from workbench.cli import main
from workbench.errors import HookError, ModelLoadError, WorkbenchError
from workbench.hooks.trace import MANIFEST_FILE, TENSORS_FILE, TraceError, manifest_sha256
from workbench.synthetic import CHATML_TEMPLATE, tokenizer_metadata, write_gguf
from workbench.tokenizer import ChatTemplateError, Tokenizer

IDS = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama", seed=3)
    path = write_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", checkpoint.config, checkpoint.weights)
    return workbench.load(path, device="cpu", dtype="float32")


@pytest.fixture()
def saved(gguf_model, tmp_path):
    trace = gguf_model.run(IDS, record=["blocks.0.hook_resid_post"],
                           interventions=[{"type": "scale", "hook": "blocks.1.hook_resid_pre", "factor": 0.5}])
    return trace.save(tmp_path / "artifacts" / "trace")


def forge(path, edit) -> None:
    """Edit a manifest as a careful forger would: the manifest hash recomputed to match."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    edit(manifest)
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


# ------------------------------------------------------------------------------------ writes and reads


def test_save_never_writes_through_a_planted_link(gguf_model, tmp_path):
    trace = gguf_model.run(IDS)
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "artifacts" / "t"
    folder.mkdir(parents=True)
    (folder / "manifest.tmp").symlink_to(outside / "created")  # the temporary name an older save wrote through
    (folder / ".manifest.json.tmp").symlink_to(outside / "created")
    trace.save(folder)
    assert not (outside / "created").exists() and workbench.load_trace(folder).ids == IDS
    victim = outside / "victim.json"
    victim.write_text("keep")
    (folder / MANIFEST_FILE).unlink()
    (folder / MANIFEST_FILE).symlink_to(victim)
    before = (folder / TENSORS_FILE).read_bytes()
    with pytest.raises(TraceError, match="symbolic link"):
        trace.save(folder)
    assert victim.read_text() == "keep" and (folder / TENSORS_FILE).read_bytes() == before  # nothing half-written
    linked = tmp_path / "artifacts" / "linked"
    linked.symlink_to(outside, target_is_directory=True)
    with pytest.raises(TraceError, match="symbolic link"):
        trace.save(linked)
    assert sorted(os.listdir(outside)) == ["victim.json"]


def test_load_never_reads_a_member_through_a_link_or_a_fifo(saved, tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((saved / TENSORS_FILE).read_bytes())
    (saved / TENSORS_FILE).unlink()
    (saved / TENSORS_FILE).symlink_to(outside)
    with pytest.raises(TraceError, match="symbolic link"):
        workbench.load_trace(saved)
    (saved / TENSORS_FILE).unlink()
    os.mkfifo(saved / TENSORS_FILE)
    with pytest.raises(TraceError, match="not a regular file"):
        workbench.load_trace(saved)


# ------------------------------------------------------------------------------------ manifests


def test_an_edited_manifest_is_refused_by_its_hash(saved):
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    manifest["prompt"] = "The capital of Italy is"
    (saved / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="manifest_sha256"):
        workbench.load_trace(saved)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(ids=5), "'ids' has the wrong type"),
    (lambda m: m.pop("tokens"), "lacks the field 'tokens'"),
    (lambda m: m.update(prompt=IDS[:2], ids=IDS[:2], tokens=["a", "b"]), r"logits have shape \(5, \d+\); a trace of 2 tokens"),
    (lambda m: m.update(tokens=["a"] * 4), "one per id"),
    (lambda m: m.update(prompt=[1, 2, 3, 4, 5]), "must equal 'ids'"),
    (lambda m: m.update(interventions=[5]), "list of intervention specs"),
    (lambda m: m.update(seed="x"), "'seed' has the wrong type"),
    (lambda m: m.update(schema_version=1), "schema version 1"),
    (lambda m: m["tensors_file"].update(bytes="many"), "malformed tensor entries"),
])
def test_a_forged_manifest_that_disagrees_with_itself_is_refused(saved, edit, message):
    forge(saved, edit)
    with pytest.raises(TraceError, match=message):
        workbench.load_trace(saved)


@pytest.mark.parametrize("key", ["activations.blocks.0.hook_resid_post", "stray"])
def test_a_forged_artifact_without_logits_loads_as_such_and_replays_as_different(saved, gguf_model, key):
    """A consistent artifact holding no logits is a trace that kept none (a batch run's ``logits=None``): it loads
    saying so, and its forged activation replays as different; a tensor that is neither logits nor an activation is
    refused."""
    tensors = {key: torch.zeros(5, gguf_model.config.d_model)}
    save_file(tensors, str(saved / TENSORS_FILE))
    data = (saved / TENSORS_FILE).read_bytes()

    def edit(m):
        m["tensors"] = {k: {"dtype": "float32", "shape": list(t.shape), "sha256": hooks.trace.tensor_sha256(t)}
                        for k, t in tensors.items()}
        m["tensors_file"] = {"name": TENSORS_FILE, "bytes": len(data),
                             "sha256": __import__("hashlib").sha256(data).hexdigest()}
    forge(saved, edit)
    if key == "stray":
        with pytest.raises(TraceError, match="'stray', neither logits nor an activation"):
            workbench.load_trace(saved)
        return
    trace = workbench.load_trace(saved)
    assert trace.logits is None
    with pytest.raises(TraceError, match="kept no logits"):
        trace.next_token()
    report = workbench.replay(trace, gguf_model)
    assert report.verdict == "different" and report.tensors_compared == 1


def test_sizes_are_checked_before_anything_is_hashed(saved, monkeypatch):
    with open(saved / TENSORS_FILE, "ab") as f:
        f.write(b"\0" * 1000)
    with pytest.raises(TraceError, match="bytes, its manifest says"):
        workbench.load_trace(saved)
    with pytest.raises(TraceError, match="the limit is 100"):
        workbench.load_trace(saved, max_bytes=100)


def test_a_deeply_nested_manifest_is_a_trace_error(saved):
    (saved / MANIFEST_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TraceError, match="nests too deeply"):
        workbench.load_trace(saved)


def test_replay_opens_only_the_model_the_fingerprint_names(saved, gguf_model, tiny_checkpoint, tmp_path):
    other = tiny_checkpoint("llama", seed=4)
    impostor = write_gguf(tmp_path / "impostor.gguf", other.config, other.weights)
    forge(saved, lambda m: m["fingerprint"].update(path=str(impostor)))
    with pytest.raises(WorkbenchError, match="not the model it was recorded on"):
        workbench.replay(saved)
    os.mkfifo(tmp_path / "fifo.gguf")
    forge(saved, lambda m: m["fingerprint"].update(path=str(tmp_path / "fifo.gguf")))
    with pytest.raises(WorkbenchError, match="not a model file"):
        workbench.replay(saved)
    assert workbench.replay(saved, gguf_model).verdict == "identical"  # the caller's model: fingerprint verified


# ------------------------------------------------------------------------------------ model files


def write_metadata_gguf(path, **overrides):
    """A llama GGUF holding only metadata (no tensors): enough to reach the config checks."""
    writer = gguf.GGUFWriter(str(path), "llama")
    values = dict(block_count=2, context_length=64, embedding_length=64, feed_forward_length=128, head_count=4,
                  head_count_kv=2, layer_norm_rms_eps=1e-5, vocab_size=300)
    values.update(overrides)
    for key, value in values.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("overrides, message", [
    (dict(head_count=0), "n_heads must be a positive integer"),
    (dict(head_count=4, head_count_kv=3), "do not split"),
    (dict(layer_norm_rms_eps=float("nan")), "rms_eps must be a positive finite number"),
    (dict(block_count=0), "0 layers; a model has between 1 and"),
])
def test_gguf_hyperparameters_no_forward_can_use_are_refused(tmp_path, overrides, message, capsys):
    path = write_metadata_gguf(tmp_path / "bad.gguf", **overrides)
    with pytest.raises(ModelLoadError, match=message) as error:
        workbench.load(path)
    assert str(error.value).startswith(f"{path}: ")  # the file is named, whichever check refused it
    assert main(["info", "--model", str(path)]) == 2
    assert message.split()[0] in capsys.readouterr().err


def write_hf_dir(path, **overrides):
    """A llama checkpoint folder: config.json, random safetensors weights of its shapes, a tokenizer."""
    path.mkdir()
    config = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, intermediate_size=96, vocab_size=300, rms_norm_eps=1e-5,
                  tie_word_embeddings=True)
    config.update(overrides)
    (path / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (300, 64), "model.norm.weight": (64,)}
    for name, shape in {"input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
                        "self_attn.q_proj.weight": (64, 64), "self_attn.k_proj.weight": (32, 64),
                        "self_attn.v_proj.weight": (32, 64), "self_attn.o_proj.weight": (64, 64),
                        "mlp.gate_proj.weight": (96, 64), "mlp.up_proj.weight": (96, 64),
                        "mlp.down_proj.weight": (64, 96)}.items():
        shapes[f"model.layers.0.{name}"] = shape
    save_file({name: torch.randn(shape) for name, shape in shapes.items()}, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text(Tokenizer.from_gguf_metadata(tokenizer_metadata()).to_hf_json())
    return path


def test_a_valid_hf_folder_loads(tmp_path):
    assert workbench.load(write_hf_dir(tmp_path / "ok"), device="cpu").config.n_layers == 1


def test_ids_past_the_tokenizers_last_token_decode_to_nothing(tmp_path):
    """An embedding of more rows than the tokenizer has tokens (Qwen's checkpoints): those ids rank, are sampled and
    decode to nothing, as llama.cpp's converter pads them."""
    model = workbench.load(write_hf_dir(tmp_path / "ok"), device="cpu")
    assert model.tokenizer.vocab_size == model.config.vocab_size == 300  # the fixture's tokenizer has 273 tokens
    assert model.tokenizer.decode([5, 280, 299, 6]) == model.tokenizer.decode([5, 6])
    assert model.tokenizer.token_text(299) == ""
    top = model.run("hi").top_tokens(k=300)
    assert sorted(i for i, _ in top) == list(range(300))
    assert model.token_texts(range(273, 300)) == [""] * 27
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.tokenizer.decode([300])
    pieces = list(model.stream("hi", 40, temperature=5.0, seed=1))  # this seed samples padded ids
    assert any(i >= 273 for i, _ in pieces) and all(text == "" for i, text in pieces if i >= 273)


@pytest.mark.parametrize("overrides", [dict(hidden_size="sixty-four"), dict(num_attention_heads=None),
                                       dict(num_hidden_layers=-1), dict(intermediate_size=[96]),
                                       dict(rms_norm_eps="tiny"), dict(architectures=5),
                                       dict(vocab_size=1e400), dict(hidden_size=64.9), dict(hidden_size="64"),
                                       dict(num_hidden_layers=True), dict(rms_norm_eps="1e-5"),
                                       dict(max_position_embeddings=2**32 - 1),
                                       *(dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 512, **bad})
                                         for bad in ({"factor": float("nan")}, {"beta_fast": -1},
                                                     {"attention_factor": float("nan")}, {"beta_slow": "1"},
                                                     {"original_max_position_embeddings": -64}))])
def test_hf_config_of_the_wrong_types_is_a_load_error(tmp_path, overrides):
    with pytest.raises(ModelLoadError):
        workbench.load(write_hf_dir(tmp_path / "bad", **overrides), device="cpu")


@pytest.mark.parametrize("content", ['{"model": 5}', '{"model": {"type": "BPE", "vocab": [1, 2]}}', "[1, 2",
                                     '{"added_tokens": 3, "model": {"vocab": {}}}', "\xff\xfe"])
def test_a_corrupt_tokenizer_json_is_a_load_error(tmp_path, content):
    path = write_hf_dir(tmp_path / "bad")
    (path / "tokenizer.json").write_text(content, encoding="latin-1")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        workbench.load(path, device="cpu")


def test_a_fifo_as_the_model_is_refused_without_opening_it(tmp_path, capsys):
    os.mkfifo(tmp_path / "model.gguf")
    assert main(["run", "Hello", "--model", str(tmp_path / "model.gguf")]) == 2  # would block reading a FIFO
    assert "not a regular file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ control vectors


def write_control_vector(path, tensors: dict[str, np.ndarray]):
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tensors, message", [
    ({"direction.1": np.full(64, np.nan, np.float32)}, "NaN or Inf"),
    ({"direction.1": np.full(64, np.inf, np.float32)}, "NaN or Inf"),
    ({"direction.1": np.ones(64, np.float32), "direction.01": np.zeros(64, np.float32)}, "unexpected tensor"),
    ({"direction.1": np.ones((2, 32), np.float32)}, "1-D F32 vector"),
    ({"direction.1": np.ones((1, 64), np.float32)}, "1-D F32 vector"),
])
def test_bad_control_vectors_are_refused_at_import(tmp_path, gguf_model, tensors, message):
    path = write_control_vector(tmp_path / "cv.gguf", tensors)
    with pytest.raises(WorkbenchError, match=message):
        probes.SteeringVector.from_control_vector(path, gguf_model)


def test_a_valid_control_vector_still_imports(tmp_path, gguf_model):
    path = write_control_vector(tmp_path / "cv.gguf", {"direction.1": np.arange(64, dtype=np.float32)})
    vector = probes.SteeringVector.from_control_vector(path, gguf_model)
    assert vector.layers == [1] and torch.equal(vector.directions[1], torch.arange(64.0))


# ------------------------------------------------------------------------------------ specs and messages


def test_spec_types_and_nesting_are_hook_errors():
    with pytest.raises(HookError, match="unknown intervention type"):
        hooks.from_spec({"type": ["steer"]})
    deep = {"type": "zero_ablate", "hook": "hook_embed"}
    for _ in range(5000):
        deep = {"type": "composite", "parts": [deep]}
    with pytest.raises(HookError, match="nest more than 8 deep"):
        hooks.from_spec(deep)
    shallow = {"type": "composite", "parts": [{"type": "composite", "parts": [{"type": "zero_ablate",
                                                                                 "hook": "hook_embed"}]}]}
    assert len(hooks.spec_leaves(shallow)) == 1 and isinstance(hooks.from_spec(shallow), hooks.Composite)
    # built in Python, a composite nests no deeper than its spec may: what runs also saves, loads and replays
    built = hooks.Scale("hook_embed", 0.5)
    for depth in range(1, 10):
        if depth <= 8:
            built = hooks.Composite([built])
            assert isinstance(hooks.from_spec(built.to_spec()), hooks.Composite)
        else:
            with pytest.raises(HookError, match="nest more than 8 deep"):
                hooks.Composite([built])


def test_error_messages_do_not_copy_huge_inputs_back(gguf_model):
    name = "blocks." + "x" * 1_000_000
    for bad in ({"type": "zero_ablate", "hook": name}, {"type": "s" * 1_000_000}, {"type": "scale",
                                                                                   "hook": "hook_embed",
                                                                                   "factor": "9" * 100_000}):
        with pytest.raises(HookError) as err:
            gguf_model.run(IDS, interventions=[bad])
        assert len(str(err.value)) < 400
    with pytest.raises(HookError) as err:
        gguf_model.run(IDS, record=["blocks." + "1" * 5000 + ".hook_resid_post"])
    assert len(str(err.value)) < 400


# ------------------------------------------------------------------------------------ chat templates


def tokenizer_with(template: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata({**tokenizer_metadata(), "tokenizer.chat_template": template})


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{% set l = [1,2,3,4,5,6,7,8,9,10] %}" + "{% for a in l %}" * 12 + "{% endfor %}" * 12, "longer than"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "builds a string"),
    ("{{ 'a' * 1000000000 }}", "builds a value"),
    ("{{ 'a'|center(1000000000) }}", "beyond its limit"),
    ("{{ 'a'.ljust(1000000000) }}", "beyond its size limit"),
    ("{{ '{:>1000000000}'.format(1) }}", "width of millions"),
    ("{{ '%1000000000d' % 1 }}", "width of millions"),
    ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "renders more"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% for %}", "does not compile"),
])
def test_a_hostile_chat_template_is_refused_within_limits(template, message, monkeypatch):
    monkeypatch.setattr(workbench.tokenizer, "TEMPLATE_SECONDS", 0.5)
    with pytest.raises(ChatTemplateError, match=message):
        tokenizer_with(template).apply_chat_template(MESSAGES)


def test_a_real_chat_template_renders_under_the_limits(gguf_model):
    assert tokenizer_with(CHATML_TEMPLATE).apply_chat_template(MESSAGES) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(WorkbenchError):  # through a model, a bad template is a WorkbenchError like any bad input
        gguf_model.tokenizer.__class__.apply_chat_template(tokenizer_with("{{ 'a' * 10**9 }}"), MESSAGES)


# ------------------------------------------------------------------------------------ the command line


def test_cli_bad_arguments_are_one_line_errors(gguf_model, capsys):
    model = str(gguf_model.path)
    assert main(["run", "abc\udcff", "--model", model]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err
    for top_k in ("-1", "0"):
        assert main(["run", "Hello", "--top-k", top_k, "--model", model]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--top-k must be at least 1" in err
