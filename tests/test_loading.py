"""Loading GGUF files and Hugging Face checkpoints of every supported architecture, and bad input."""
from __future__ import annotations

import dataclasses
import json
import os

import gguf
import pytest
import torch

import workbench
from workbench import loading
from workbench.errors import ModelLoadError, WorkbenchError
from workbench.loading import files_sha256, hash_files, load_checkpoint
from workbench.synthetic import (random_checkpoint, random_config, random_hf_checkpoint, tokenizer_metadata,
                                 write_gguf)
from workbench.tokenizer import Tokenizer

ARCHS = ["llama", "qwen2", "qwen3"]


def write_hf_tokenizer(path, eos_token: str = "<|im_end|>") -> None:
    tokenizer = Tokenizer.from_gguf_metadata(tokenizer_metadata())
    (path / "tokenizer.json").write_text(tokenizer.to_hf_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": eos_token,
                                                            "add_bos_token": False}))


def hf_model(arch: str, tmp_path, tie: bool):
    """A tiny random transformers model of ``arch``, saved as a safetensors checkpoint with a tokenizer."""
    model = random_hf_checkpoint(arch, tmp_path, n_layers=2, tie=tie)
    write_hf_tokenizer(tmp_path)
    return model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [True, False])
def test_hf_checkpoint_matches_transformers(arch, tie, tmp_path):
    reference = hf_model(arch, tmp_path, tie)
    ours = workbench.load(tmp_path, device="cpu")
    assert ours.config.architecture == arch and ours.config.tied_embeddings == tie
    ids = [5, 77, 120, 3, 250, 9, 14, 200]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float()
    got = ours.forward(ids)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("fmt, stored", [("Q8_0", "Q8_0"), ("Q4_K", "Q5_0")])
def test_quantize_on_load(fmt, stored, tmp_path):
    """Rows of 64 or 96 values are too short for K-quants: they fall back as llama.cpp's quantizer does."""
    hf_model("llama", tmp_path, tie=False)
    float_model = workbench.load(tmp_path, device="cpu")
    quantized = workbench.load(tmp_path, device="cpu", quantize=fmt)
    formats = quantized.tensor_formats()
    assert set(formats.values()) == {stored}
    assert quantized.runner.weights.nbytes < float_model.runner.weights.nbytes / 3
    ids = list(range(3, 40))
    drift = (quantized.forward(ids) - float_model.forward(ids)).abs().max().item()
    assert 0 < drift < (0.05 if fmt == "Q8_0" else 0.5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_round_trip(arch, fmt, tmp_path, tiny_checkpoint, tiny_model):
    """A model written as llama.cpp stores it loads back to the same tensors and the same logits."""
    shape = dict(d_model=256, n_heads=4, n_kv_heads=2, d_mlp=256, tied_embeddings=arch != "qwen2")
    checkpoint = tiny_checkpoint(arch, fmt, seed=1, **shape)
    config = checkpoint.config
    path = write_gguf(tmp_path / f"{arch}-{fmt}.gguf", config, checkpoint.weights, checkpoint.metadata)
    loaded = workbench.load(path, device="cpu")
    assert loaded.config == config
    assert set(loaded.tensor_formats().values()) == {fmt}
    reference = tiny_model(arch, fmt, seed=1, device="cpu", **shape)
    for (name, a), (_, b) in zip(reference.runner.weights.named_matrices(), loaded.runner.weights.named_matrices()):
        assert torch.equal(a.data, b.data), name
    ids = [4, 8, 15, 16, 23, 42]
    assert torch.equal(reference.forward(ids), loaded.forward(ids))


def test_embedded_model_config(model):
    c = model.config
    assert (c.architecture, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_head, c.d_mlp, c.vocab_size) == (
        "llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.tied_embeddings and c.rope_base == 100000.0
    formats = model.tensor_formats()
    assert formats["embed"] == "Q8_0" and formats["blocks.0.wq"] == "Q4_1"
    # packed in memory: resident weights are the GGUF tensor bytes, not a float copy
    assert model.runner.weights.nbytes <= 1.01 * model.path.stat().st_size


# ------------------------------------------------------------------------------------------ bad input


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no model at"):
        workbench.load(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(b"\x00\x01garbage" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        workbench.load(path)


def test_truncated_gguf(tmp_path, model_path):
    path = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as src:
        path.write_bytes(src.read(20_000_000))
    with pytest.raises(ModelLoadError, match="corrupt or truncated|truncated"):
        workbench.load(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'"):
        workbench.load(path)


def test_missing_tensor_names_the_tensor(tmp_path, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama", cached=False)  # edited
    config = checkpoint.config
    checkpoint.weights.layers.pop()  # one block fewer than block_count says
    path = write_gguf(tmp_path / "short.gguf", config, checkpoint.weights, checkpoint.metadata)
    with pytest.raises(ModelLoadError, match="blk.1.attn_norm.weight is missing"):
        workbench.load(path)


def test_metadata_with_fewer_layers_than_the_tensors_is_refused(tmp_path, tiny_checkpoint):
    """A file whose metadata describes less than its tensors hold would run another model: refused, as llama.cpp
    refuses it."""
    checkpoint = tiny_checkpoint("llama")
    config = dataclasses.replace(checkpoint.config, n_layers=1)
    path = write_gguf(tmp_path / "lying.gguf", config, checkpoint.weights, checkpoint.metadata)
    with pytest.raises(ModelLoadError, match=r"tensor\(s\) that a llama model of 1 layers does not use, such as "
                                             r"blk\.1\."):
        workbench.load(path)


@pytest.mark.parametrize("edit", ["fewer layers", "another family"])
def test_hf_folders_whose_config_does_not_describe_the_tensors_are_refused(tmp_path, edit):
    random_hf_checkpoint("gemma2", tmp_path, n_layers=2)
    write_hf_tokenizer(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    if edit == "fewer layers":
        config["num_hidden_layers"], config["layer_types"] = 1, config["layer_types"][:1]
    else:  # Gemma 2's norms after attention and the MLP have no place in a llama block
        config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="does not use, such as"):
        workbench.load(tmp_path, device="cpu")


def test_hf_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(tmp_path)


def test_prompt_errors(model, tiny_model):
    with pytest.raises(WorkbenchError, match="empty"):
        model.forward("")
    small = tiny_model("llama", n_ctx=16)
    with pytest.raises(WorkbenchError, match="context holds 16"):
        small.forward("a long prompt that is certainly more than sixteen byte tokens long")
    with pytest.raises(WorkbenchError, match="out of range"):
        small.forward([1, 2, 10**6])


def test_unsupported_tensor_type_names_the_tensor(tmp_path, tiny_checkpoint):
    """A tensor in a format we have no kernel for (IQ4_NL here) is refused by name, before anything loads."""
    checkpoint = tiny_checkpoint("llama")
    config = checkpoint.config
    path = write_gguf(tmp_path / "iq4nl.gguf", config, checkpoint.weights, checkpoint.metadata)
    reader = gguf.GGUFReader(str(path), "r+")  # edit the tensor's type field in the file's header in place
    info = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").field
    info.parts[-2][0] = gguf.GGMLQuantizationType.IQ4_NL  # parts: name length, name, n_dims, dims, type, offset
    reader.data.flush()
    del reader
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight has unsupported type IQ4_NL"):
        workbench.load(path)


def test_file_hash_is_noted_once_and_never_outlives_the_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"a" * 4096)
    assert files_sha256([model]) == hash_files([model])
    assert not any((tmp_path / "cache" / "sha256").iterdir())  # just written: hashed, not noted
    monkeypatch.setattr(loading, "SETTLED_NS", -(1 << 40))  # as if the file had been written long ago
    first = files_sha256([model])
    assert first == hash_files([model])
    notes = list((tmp_path / "cache" / "sha256").iterdir())
    assert len(notes) == 1 and notes[0].read_text() == first
    notes[0].write_text("0" * 64)  # the note is what a second call returns, unread bytes and all
    assert files_sha256([model]) == "0" * 64
    # the same size and modification time, other bytes: the change time moves, so the note is not used
    stat = model.stat()
    while model.stat().st_ctime_ns == stat.st_ctime_ns:  # file times tick in milliseconds
        model.write_bytes(b"b" * 4096)
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert files_sha256([model]) == hash_files([model]) != first
    # a note that is not a digest is ignored and written again
    for garbage in (b"not a digest", b"\xff" * 64):
        for note in (tmp_path / "cache" / "sha256").iterdir():
            note.write_bytes(garbage)
        assert files_sha256([model]) == hash_files([model])
        notes = [n.read_bytes() for n in (tmp_path / "cache" / "sha256").iterdir()]
        assert notes.count(hash_files([model]).encode()) == 1


def test_file_hash_note_never_follows_a_link(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "SETTLED_NS", -(1 << 40))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    files_sha256([model])
    note = next((tmp_path / "cache" / "sha256").iterdir())
    outside = tmp_path / "outside.txt"
    outside.write_text("f" * 64)
    note.unlink()
    note.symlink_to(outside)
    assert files_sha256([model]) == hash_files([model])  # the link's target is not read as the note
    assert outside.read_text() == "f" * 64 and not note.is_symlink()  # nor written through: the link is replaced
    note.unlink()
    os.mkfifo(note)  # nor does a FIFO there block the read
    assert files_sha256([model]) == hash_files([model])


def test_file_hash_without_a_writable_cache(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(blocked / "cache"))  # a folder under a file cannot be made
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    assert files_sha256([model]) == hash_files([model])


def test_models_built_in_memory_hash_their_weights():
    config = random_config("llama", n_layers=2)
    first, again, other = (workbench.Model(random_checkpoint(config, "Q8_0", seed=s), "cpu") for s in (0, 0, 1))
    assert first.file_sha256 == again.file_sha256 != other.file_sha256
    assert len(first.file_sha256) == 64


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's float32 logits of every position of ``ids`` (llama-cpp-python)."""
    import numpy as np

    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), logits_all=True, verbose=False, n_ctx=64)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)]))
    finally:
        llm.close()


@pytest.mark.parametrize("keys", [{"llama.rope.scaling.factor": 4.0}, {"llama.rope.scale_linear": 4.0}])
def test_gguf_rope_factor_without_a_scaling_type_is_linear(keys, tmp_path, tiny_checkpoint):
    """llama.cpp takes a rope scaling factor that names no scaling type, or sits under the older key rope.scale_linear,
    for linear scaling: so does the loader, to llama.cpp's logits."""
    ids = [5, 77, 120, 3, 250, 9, 14, 200, 31, 64, 8, 199]
    checkpoint = tiny_checkpoint("llama", "F32")
    plain = write_gguf(tmp_path / "plain.gguf", checkpoint.config, checkpoint.weights, checkpoint.metadata)
    scaled = write_gguf(tmp_path / "scaled.gguf", checkpoint.config, checkpoint.weights, {**checkpoint.metadata, **keys})
    model = workbench.load(scaled, device="cpu")
    assert model.config.rope_scale == 4.0
    expected = llama_cpp_logits(scaled, ids)
    assert (expected - llama_cpp_logits(plain, ids)).abs().max() > 1.0  # the factor matters
    assert (model.forward(ids) - expected).abs().max() < 0.05  # llama.cpp's float32 kernels


def test_gguf_non_causal_attention_is_refused(tmp_path, tiny_checkpoint):
    """An embedding model's GGUF marks its attention bidirectional (attention.causal false), which llama.cpp honours:
    refused in one line, not run causally."""
    checkpoint = tiny_checkpoint("llama", "Q8_0")
    path = write_gguf(tmp_path / "bidirectional.gguf", checkpoint.config, checkpoint.weights,
                      {**checkpoint.metadata, "llama.attention.causal": False})
    with pytest.raises(ModelLoadError, match=r"non-causal attention \('llama.attention.causal' false\) is not "):
        workbench.load(path, device="cpu")


def test_gguf_without_soft_cap_keys_takes_llama_cpp_defaults(tmp_path, tiny_checkpoint):
    """Where a Gemma 2 GGUF names no soft caps (files converted before the keys existed), llama.cpp caps attention
    scores at 50 and logits at 30: so does the loader, to llama.cpp's logits."""
    ids = [5, 77, 120, 3, 250, 9, 14, 200, 31, 64, 8, 199]
    checkpoint = tiny_checkpoint("gemma2", "F32")
    uncapped = dataclasses.replace(checkpoint.config, attn_softcap=None, final_softcap=None)
    path = write_gguf(tmp_path / "uncapped.gguf", uncapped, checkpoint.weights, checkpoint.metadata)
    model = workbench.load(path, device="cpu")
    assert (model.config.attn_softcap, model.config.final_softcap) == (50.0, 30.0)
    expected = llama_cpp_logits(path, ids)
    assert (model.forward(ids) - expected).abs().max() < 1e-3 * expected.abs().max()


def test_gguf_expert_routing_keys_change_nothing_as_in_llama_cpp(tmp_path, tiny_checkpoint):
    """llama.cpp's graph fixes a Qwen3-MoE's routing (softmax, normalized, unscaled) and reads no expert_gating_func,
    expert_weights_norm or expert_weights_scale for it: a file that sets them loads to llama.cpp's logits."""
    ids = [5, 77, 120, 3, 250, 9, 14, 200, 31, 64, 8, 199]
    checkpoint = tiny_checkpoint("qwen3moe", "F32", n_experts=8, n_experts_used=3)
    keys = {"qwen3moe.expert_gating_func": 2, "qwen3moe.expert_weights_norm": False,
            "qwen3moe.expert_weights_scale": 2.5}
    path = write_gguf(tmp_path / "keyed.gguf", checkpoint.config, checkpoint.weights, {**checkpoint.metadata, **keys})
    model = workbench.load(path, device="cpu")
    moe = model.config.moe
    assert (moe.gating, moe.normalize_weights, moe.weights_scale) == ("softmax", True, 1.0)
    expected = llama_cpp_logits(path, ids)
    assert (model.forward(ids) - expected).abs().max() < 1e-3 * expected.abs().max()
