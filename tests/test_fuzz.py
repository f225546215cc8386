"""Fuzzing the parsers of untrusted input with hypothesis: GGUF headers and metadata, safetensors headers, trace
manifests and intervention specs. Each example must end in a WorkbenchError-family error or a correct result, never
another exception or a hang. Seeded (derandomize) and small, so the default run stays fast and repeatable."""
from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from pathlib import Path

import gguf
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workbench
from workbench import hooks
from workbench.errors import WorkbenchError
from workbench.hooks.trace import MANIFEST_FILE, TENSORS_FILE, Trace, manifest_sha256
from workbench.loading import load_checkpoint
from workbench.synthetic import tokenizer_metadata, write_gguf

FUZZ = settings(max_examples=25, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)


# ------------------------------------------------------------------------------------------------ GGUF


def _write_metadata(path: Path, values: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_int64(key, value)
        elif isinstance(value, float):
            writer.add_float64(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


hyperparameter = (st.integers(-3, 2**62) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4)
                  | st.booleans() | st.lists(st.integers(0, 9), max_size=3))
CONFIG_KEYS = ["llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
               "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
               "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.vocab_size"]
VALID = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": 64,
         "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
         "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 300}


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), hyperparameter, max_size=6))
def test_gguf_hyperparameters(changes):
    """Any value at any config key: a ModelLoadError (the file has no tensors, so nothing may load)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        _write_metadata(path, {**VALID, **changes})
        with pytest.raises(WorkbenchError):
            load_checkpoint(path)


TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
tokenizer_value = (hyperparameter | st.lists(st.text(max_size=3), max_size=6)
                   | st.lists(st.integers(-2, 6), max_size=6) | st.sampled_from(["gpt2", "llama", "bert", ""]))


@pytest.mark.filterwarnings("ignore:tokenizer.ggml.pre")  # an unknown pre-tokenizer name only warns
@FUZZ
@given(st.dictionaries(st.sampled_from(TOKENIZER_KEYS), tokenizer_value, min_size=1, max_size=4))
def test_gguf_tokenizer_metadata(changes):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        _write_metadata(path, {**VALID, **tokenizer_metadata(), **changes})
        with pytest.raises(WorkbenchError):
            load_checkpoint(path)


class ModelFile:
    """A tiny model's GGUF bytes and where its tensor data starts (the header ends); shown by size in reports."""

    def __init__(self, data: bytes, header: int):
        self.data, self.header = data, header

    def __repr__(self) -> str:
        return f"ModelFile({len(self.data)} bytes, header {self.header})"


@pytest.fixture(scope="module")
def gguf_bytes(tiny_checkpoint, tmp_path_factory) -> ModelFile:
    checkpoint = tiny_checkpoint("llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_mlp=32)
    path = write_gguf(tmp_path_factory.mktemp("fuzz") / "m.gguf", checkpoint.config, checkpoint.weights)
    return ModelFile(path.read_bytes(), int(gguf.GGUFReader(str(path)).data_offset))


@pytest.mark.filterwarnings("ignore:tokenizer.ggml.pre")
@FUZZ
@given(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6),
       st.none() | st.floats(0, 1))
def test_gguf_header_bytes(gguf_bytes, flips, cut):
    """Bytes of the header changed (counts, lengths, types, names) and the file maybe truncated: a ModelLoadError,
    or a model that loads and runs."""
    data, header = gguf_bytes.data, gguf_bytes.header
    mutated = bytearray(data)
    for where, value in flips:
        mutated[int(where * header)] = value
    if cut is not None:
        mutated = mutated[:int(cut * len(mutated))]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        path.write_bytes(bytes(mutated))
        try:
            model = workbench.load(path, device="cpu")
        except WorkbenchError:
            return
        assert model.forward([1, 2]).shape == (2, model.config.vocab_size)


# ------------------------------------------------------------------------------------------ safetensors


HF_CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                 num_hidden_layers=1, intermediate_size=32, vocab_size=300, rms_norm_eps=1e-5)
tensor_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X9", ""]),
    "shape": st.lists(st.integers(-2, 2**40), max_size=3),
    "data_offsets": st.lists(st.integers(-1, 2**40), min_size=0, max_size=3),
})


@FUZZ
@given(st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "model.norm.weight", "__metadata__", "x"]),
                       tensor_entry | json_values, max_size=3),
       st.integers(-8, 8), st.binary(max_size=64))
def test_safetensors_headers(header, length_error, payload):
    """A checkpoint whose safetensors header says anything (and whose length prefix may lie): a ModelLoadError."""
    body = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        (path / "config.json").write_text(json.dumps(HF_CONFIG))
        (path / "model.safetensors").write_bytes(struct.pack("<Q", max(0, len(body) + length_error)) + body + payload)
        with pytest.raises(WorkbenchError):
            load_checkpoint(path)


# ------------------------------------------------------------------------------------------ trace manifests


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    trace = Trace(prompt="a b c", ids=[1, 2, 3], tokens=["a", " b", " c"], logits=torch.randn(3, 7),
                  activations={"blocks.0.hook_resid_post": torch.randn(3, 4)},
                  interventions=[{"type": "scale", "hook": "blocks.0.hook_resid_pre", "factor": 2.0}],
                  fingerprint={"sha256": "0" * 64}, seed=1)
    return trace.save(tmp_path_factory.mktemp("fuzz") / "artifact")


MANIFEST_KEYS = ["schema", "schema_version", "prompt", "chat", "ids", "tokens", "fingerprint", "backend", "versions",
                 "seed", "interventions", "metrics", "tensors", "tensors_file", "manifest_sha256"]


@FUZZ
@given(st.dictionaries(st.sampled_from(MANIFEST_KEYS), json_values, min_size=1, max_size=3),
       st.lists(st.sampled_from(MANIFEST_KEYS), max_size=2), st.booleans())
def test_trace_manifests(artifact, changes, removed, rehash):
    """Fields replaced by any JSON or removed, the manifest hash recomputed or not: a TraceError, or a trace whose
    parts agree with each other."""
    manifest = json.loads((artifact / MANIFEST_FILE).read_text())
    manifest.update(changes)
    for key in removed:
        manifest.pop(key, None)
    if rehash:
        manifest["manifest_sha256"] = manifest_sha256(manifest)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        (path / MANIFEST_FILE).write_text(json.dumps(manifest))
        (path / TENSORS_FILE).write_bytes((artifact / TENSORS_FILE).read_bytes())
        try:
            trace = workbench.load_trace(path)
        except WorkbenchError:
            return
    assert len(trace.ids) == len(trace.tokens) == trace.logits.shape[0]
    assert all(isinstance(i, int) for i in trace.ids) and all(isinstance(s, dict) for s in trace.interventions)


@FUZZ
@given(st.binary(min_size=1, max_size=6), st.integers(0, 200))
def test_trace_tensor_files(artifact, junk, where):
    """A tensors file changed and consistently re-hashed in its manifest (a forger's artifact): a TraceError or a
    trace whose tensors agree with the manifest."""
    data = bytearray((artifact / TENSORS_FILE).read_bytes())
    data[where % len(data):where % len(data) + len(junk)] = junk
    manifest = json.loads((artifact / MANIFEST_FILE).read_text())
    manifest["tensors_file"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        (path / MANIFEST_FILE).write_text(json.dumps(manifest))
        (path / TENSORS_FILE).write_bytes(bytes(data))
        try:
            trace = workbench.load_trace(path)
        except WorkbenchError:
            return
    assert trace.logits.shape == (3, 7)


# ------------------------------------------------------------------------------------------ intervention specs


HOOKS = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.0.attn.hook_pattern", "hook_embed",
         "blocks.*.hook_resid_pre", "blocks.9.hook_resid_post", "nope", ""]
KINDS = sorted(hooks.Intervention.registry) + ["explode"]
small_ints = st.lists(st.integers(-8, 70), max_size=4)
field_values = {
    "hook": st.sampled_from(HOOKS) | json_values,
    "positions": small_ints | st.sampled_from(["generated", "all"]) | json_values,
    "heads": small_ints | json_values,
    "neurons": small_ints | json_values,
    "factor": st.floats(allow_nan=True, allow_infinity=True) | json_values,
    "scale": st.floats(-4, 4) | json_values,
    "vector": st.lists(st.floats(-2, 2), min_size=64, max_size=64) | st.lists(st.floats(), max_size=3) | json_values,
    "mean": st.lists(st.floats(-2, 2), min_size=64, max_size=64) | json_values,
    "donor": st.sampled_from(["the cat", "", " "]) | small_ints | json_values,
    "donors": st.lists(st.sampled_from(["the cat", "a dog sat"]), max_size=3) | json_values,
    "seed": st.integers(-2, 2**70) | json_values,
    "function": json_values,
}
leaf_specs = st.builds(lambda kind, fields: {"type": kind, **fields}, st.sampled_from(KINDS),
                       st.fixed_dictionaries({}, optional=field_values))
specs = st.recursive(leaf_specs, lambda children: st.builds(
    lambda parts: {"type": "composite", "parts": parts}, st.lists(children, max_size=3)), max_leaves=6)


@FUZZ
@given(st.lists(specs | json_values, max_size=3))
def test_intervention_specs(tiny_model, interventions):
    """Any spec, nested or not, run on a model: a WorkbenchError, or a trace of the right shape."""
    model = tiny_model("llama", seed=7)
    try:
        trace = model.run([1, 2, 3, 4], interventions=interventions)
    except WorkbenchError:
        return
    assert trace.logits.shape == (4, model.config.vocab_size)
    assert torch.isfinite(trace.logits).all() or any("factor" in json.dumps(s, default=str) for s in interventions)
