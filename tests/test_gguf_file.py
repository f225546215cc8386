"""workbench.gguf_file reads a GGUF header as gguf-py's GGUFReader does, and refuses a broken one."""
from __future__ import annotations

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
