"""Steering vectors: mean differences, Steer interventions, sweeps, llama.cpp control-vector GGUF files."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import workbench
from workbench import probes

POSITIVE = ["the sun is hot", "a hot tea", "hot sun on the mat"]
NEGATIVE = ["the cat is in", "an old cat", "cat on the mat in"]


@pytest.fixture(scope="module")
def small(tiny_model):
    return tiny_model("llama", n_layers=4, device="cpu")


def test_vector_is_the_mean_difference_and_steers_by_scale(small):
    vector = probes.steering_vector(small, (POSITIVE, NEGATIVE), layers=[1, 2], pooling="last")
    assert vector.layers == [1, 2] and vector.model_hint == "llama"
    hook = "blocks.2.hook_resid_post"
    last = {p: small.run(p, record=[hook]).activations[hook][-1] for p in POSITIVE + NEGATIVE}
    expected = torch.stack([last[p] for p in POSITIVE]).mean(0) - torch.stack([last[p] for p in NEGATIVE]).mean(0)
    torch.testing.assert_close(vector.directions[2], expected)

    steers = vector.interventions(3.0, positions=[-1])
    assert [s.hook for s in steers] == ["blocks.1.hook_resid_post", "blocks.2.hook_resid_post"]
    # only layer 1 steered: its recorded output moves by exactly scale * direction at the last position
    plain = small.run("the mat", record=["blocks.1.hook_resid_post"]).activations["blocks.1.hook_resid_post"]
    steered = small.run("the mat", record=["blocks.1.hook_resid_post"], interventions=steers[:1])
    moved = steered.activations["blocks.1.hook_resid_post"] - plain
    torch.testing.assert_close(moved[-1], 3.0 * vector.directions[1], rtol=1e-5, atol=1e-5)
    assert moved[0].abs().max() == 0


def test_sweep_reports_shift_per_scale(small):
    vector = probes.steering_vector(small, (POSITIVE, NEGATIVE), layers=[2])
    sweep = probes.steering_sweep(small, vector, "the", [40, 50], scales=[0, 2], max_new_tokens=3)
    assert sweep.shift.shape == (2, 2) and torch.equal(sweep.shift[0], torch.zeros(2))
    steered = small.forward("the", interventions=vector.interventions(2.0))[-1].log_softmax(-1)
    torch.testing.assert_close(sweep.logprobs[1], steered[[40, 50]])
    assert len(sweep.generations) == 2
    figure = sweep.figure()
    assert [type(t).__name__ for t in figure.data] == ["Scatter", "Scatter", "Table"]


def test_control_vector_round_trip(small, tmp_path):
    vector = probes.steering_vector(small, (POSITIVE, NEGATIVE), layers=[1, 3])
    path = vector.export_control_vector(tmp_path / "cv.gguf", scale=2.0)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "controlvector"
    assert reader.fields["controlvector.model_hint"].contents() == "llama"
    assert reader.fields["controlvector.layer_count"].contents() == 2
    loaded = probes.SteeringVector.from_control_vector(path, small)
    assert loaded.layers == [1, 3]
    for layer in (1, 3):
        torch.testing.assert_close(loaded.directions[layer], 2.0 * vector.directions[layer])
    with pytest.raises(workbench.WorkbenchError, match="block 0"):
        probes.SteeringVector({0: torch.ones(64)}).export_control_vector(tmp_path / "zero.gguf")


def write_llamacpp_vector(path, directions: dict[int, np.ndarray], hint: str = "llama"):
    """A control vector laid out as llama.cpp's cvector-generator writes it."""
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", hint)
    writer.add_int32("controlvector.layer_count", len(directions))
    for index, values in directions.items():
        writer.add_tensor(f"direction.{index}", values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llamacpp_layout_loads_on_the_right_layers(small, tmp_path):
    # the generator writes direction.1 .. direction.{n_layers - 1}; direction.k is added to block k's output
    directions = {k: np.full(64, float(k)) for k in range(1, 4)}
    vector = probes.SteeringVector.from_control_vector(write_llamacpp_vector(tmp_path / "cv.gguf", directions), small)
    assert vector.layers == [1, 2, 3]
    assert [s.hook for s in vector.interventions()] == [f"blocks.{k}.hook_resid_post" for k in (1, 2, 3)]
    assert all(float(vector.directions[k][0]) == k for k in (1, 2, 3))

    bad_files = {
        "direction.0": {0: np.ones(64)},
        "outside llama.cpp's range": {4: np.ones(64)},
        "64 values": {1: np.ones(32)},
    }
    for message, content in bad_files.items():
        with pytest.raises(workbench.WorkbenchError, match=message):
            probes.SteeringVector.from_control_vector(write_llamacpp_vector(tmp_path / "bad.gguf", content), small)
    with pytest.raises(workbench.WorkbenchError, match="made for a 'qwen2' model"):
        probes.SteeringVector.from_control_vector(
            write_llamacpp_vector(tmp_path / "qwen.gguf", {1: np.ones(64)}, hint="qwen2"), small)
    qwen = tmp_path / "qwen.gguf"
    qwen.write_bytes(qwen.read_bytes().replace(b"qwen2", b"qwe\xff2"))  # the hint's text no longer UTF-8
    with pytest.raises(workbench.WorkbenchError, match="not a GGUF file.*utf-8"):
        probes.SteeringVector.from_control_vector(qwen, small)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(workbench.WorkbenchError, match="not a GGUF file"):
        probes.SteeringVector.from_control_vector(tmp_path / "junk.gguf", small)


def test_bad_steering_requests(small):
    with pytest.raises(workbench.WorkbenchError, match="mismatched pair counts"):
        probes.steering_vector(small, (POSITIVE, NEGATIVE[:2]))
    with pytest.raises(workbench.WorkbenchError, match="out of range"):
        probes.steering_vector(small, (POSITIVE, NEGATIVE), layers=[7])
    with pytest.raises(workbench.WorkbenchError, match="cannot be split"):
        probes.steering_vector(small, "capitals")
    with pytest.raises(workbench.WorkbenchError, match="list of integers"):
        probes.steering_vector(small, (POSITIVE, NEGATIVE), layers=2)


def test_bad_sweeps_are_refused_before_any_forward(small, monkeypatch):
    vector = probes.SteeringVector({1: torch.ones(small.config.d_model)})
    calls = []
    monkeypatch.setattr(small, "forward_batch", lambda *a, **k: calls.append(1))
    with pytest.raises(workbench.WorkbenchError, match="target_tokens must be a list"):
        probes.steering_sweep(small, vector, "the cat", "ab")  # not one target per character
    with pytest.raises(workbench.WorkbenchError, match="scales must be a list of numbers"):
        probes.steering_sweep(small, vector, "the cat", [10], scales="12")
    with pytest.raises(workbench.WorkbenchError, match="max_new_tokens must be an integer >= 0, got -1"):
        probes.steering_sweep(small, vector, "the cat", [10], max_new_tokens=-1)
    assert calls == []


def test_export_writes_only_what_import_reads(small, tmp_path):
    d = small.config.d_model
    cases = [({1: torch.ones(d), 2: torch.ones(d - 1)}, "different lengths"),
             ({1: torch.full((d,), float("nan"))}, "layer 1 holds NaN"),
             ({small.config.n_layers: torch.ones(d)}, "past this model's depth")]
    for directions, message in cases:
        with pytest.raises(workbench.WorkbenchError, match=message):
            probes.SteeringVector(directions).export_control_vector(tmp_path / "v.gguf", model=small)
        assert not (tmp_path / "v.gguf").exists()


def test_happy_vector_raises_happy_on_the_embedded_model(model):
    pairs = probes.load_dataset("happy_sad").sample(12, seed=0)
    vector = probes.steering_vector(model, pairs, layers=[8, 9, 10])
    sweep = probes.steering_sweep(model, vector, "Today I feel", [" happy", " sad"], scales=[-2, 0, 2, 4],
                                  max_new_tokens=0)
    happy, sad = sweep.shift[:, 0], sweep.shift[:, 1]
    margin = happy - sad  # how much more likely " happy" became than " sad"
    assert bool((margin[1:] > margin[:-1]).all())  # grows with scale
    assert float(happy[2]) > 0.5 and float(sad[2]) < -1.0 and float(happy[0]) < -1.0
