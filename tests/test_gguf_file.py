"""workbench.gguf_file reads a GGUF header as gguf-py's GGUFReader does, and refuses a broken one."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from workbench.gguf_file import GGUFFile
from workbench.synthetic import random_config, random_checkpoint, write_gguf


def _reader_view(path):
    reader = gguf.GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, reader.tensors


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K_M"])
def test_same_metadata_and_tensor_bytes_as_gguf_reader(tmp_path, fmt):
    checkpoint = random_checkpoint(random_config("qwen2"), fmt)
    path = write_gguf(tmp_path / "m.gguf", checkpoint.config, checkpoint.weights)
    metadata, tensors = _reader_view(path)
    ours = GGUFFile(path)
    assert ours.metadata == metadata
    assert set(ours.tensors) == {t.name for t in tensors}
    for t in tensors:
        info = ours.tensors[t.name]
        expected = np.ascontiguousarray(t.data).view(np.uint8).ravel()
        assert info.shape == tuple(int(n) for n in t.shape) and info.ggml_type == int(t.tensor_type)
        np.testing.assert_array_equal(ours.data(info, expected.size), expected)


def test_the_embedded_models_header(model_path):
    metadata, tensors = _reader_view(model_path)
    ours = GGUFFile(model_path)
    assert ours.metadata == metadata
    assert {t.name: int(t.data_offset) for t in tensors} == {n: i.offset for n, i in ours.tensors.items()}


@pytest.mark.parametrize("cut", [3, 30, 2000, 50_000])
def test_a_cut_header_is_a_value_error(tmp_path, model_path, cut):
    path = tmp_path / "cut.gguf"
    with open(model_path, "rb") as f:
        path.write_bytes(f.read(cut))
    with pytest.raises(ValueError):
        GGUFFile(path)


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _header(kvs: list[tuple[str | bytes, bytes]], tensors: list[tuple[str, tuple[int, ...], int]]) -> bytes:
    """A GGUF v3 file of raw key/value entries (each value's type and bytes) and F32 tensor infos (name, shape,
    offset), then zeros for their data."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    out += b"".join(_string(key) + value for key, value in kvs)
    for name, shape, offset in tensors:
        out += _string(name) + struct.pack(f"<I{len(shape)}Q", len(shape), *shape) + struct.pack("<IQ", 0, offset)
    return out + bytes(4096)


U32, ARRAY = 4, 9


@pytest.mark.parametrize("kvs, tensors, match", [
    ([("general.alignment", struct.pack("<II", U32, 0))], [], "alignment 0 is not a power of two"),
    ([("general.alignment", struct.pack("<II", U32, 3))], [], "alignment 3 is not a power of two"),
    ([("general.alignment", struct.pack("<IIQI", ARRAY, U32, 1, 32))], [], r"alignment \[32\] is not a power of two"),
    ([("k", struct.pack("<II", U32, 1)), ("k", struct.pack("<II", U32, 2))], [], "key 'k' appears twice"),
    ([("k", struct.pack("<IIQ", ARRAY, ARRAY, 1) + struct.pack("<IQ", U32, 0))], [], "an array of arrays"),
    ([(b"\xff", struct.pack("<II", U32, 1))], [], "utf-8"),
    ([], [("t", (), 0)], "tensor 't' has 0 dimensions"),
    ([], [("t", (1, 1, 1, 1, 1), 0)], "tensor 't' has 5 dimensions"),
    ([], [("t", (4,), 3)], "offset 3, not a multiple of the alignment 32"),
    ([], [("t", (4,), 0), ("t", (4,), 32)], "tensor 't' appears twice")])
def test_a_header_llamacpp_refuses_is_a_value_error(tmp_path, kvs, tensors, match):
    path = tmp_path / "lie.gguf"
    path.write_bytes(_header(kvs, tensors))
    with pytest.raises(ValueError, match=match):
        GGUFFile(path)
