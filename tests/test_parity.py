"""workbench.parity: llama.cpp's named tensors against our hook points. The default tests read a fixture llama.cpp
wrote (scripts/make_llamacpp_fixtures.py) for a tiny random model; the live ones run llama.cpp and skip without it."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import workbench
from workbench import parity
from workbench.cli import main
from workbench.synthetic import random_checkpoint, random_config, write_gguf

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def fixture_model(tmp_path_factory):
    meta = json.loads((FIXTURES / "llamacpp_parity.json").read_text())
    arch, fmt = meta["model"]
    checkpoint = random_checkpoint(random_config(arch), fmt, seed=0)
    path = write_gguf(tmp_path_factory.mktemp("parity") / "tiny.gguf", checkpoint.config, checkpoint.weights)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"]  # the model llama.cpp ran
    captured = load_file(str(FIXTURES / "llamacpp_parity.safetensors"))
    return workbench.load(path, device="cpu"), meta, {key: captured[key] for key in meta["order"]}


def test_names_map_to_hook_points():
    assert parity.split_name("ffn_out-12") == ("ffn_out", 12) and parity.split_name("result_norm") == ("result_norm", None)
    assert parity.hook_point("l_out-3").point == "blocks.3.hook_resid_post"
    assert parity.hook_point("attn_norm-0").weight == "attn_norm"
    keys = ["Qcur-1", "Qcur-1#1", "Qcur-1#2", "Vcur-1", "ffn_out-1", "ffn_out-1#1", "l_out-1", "kq-1"]
    mapped = {key: m.point for key, m in parity.mapped_tensors(keys)}
    # only a layer's last "Qcur" is the rotated queries; a second "ffn_out" (a control vector's) has no point
    assert mapped == {"Qcur-1#2": "blocks.1.attn.hook_rot_q", "Vcur-1": "blocks.1.attn.hook_v",
                      "ffn_out-1": "blocks.1.hook_mlp_out", "l_out-1": "blocks.1.hook_resid_post"}


def test_every_point_agrees_with_llamacpp_and_a_change_is_found_where_made(fixture_model):
    model, meta, captured = fixture_model
    recorded = parity.record_points(model, meta["ids"], list(captured))
    weights = parity.norm_weights(model)
    report = parity.compare(captured, recorded, weights)
    layers = model.config.n_layers
    assert {p.ggml for p in report.points} >= {f"{n}-{i}" for i in range(layers) for n in (
        "attn_norm", "kqv_out", "attn_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out",
        "l_out")} | {"result_norm", "result_output"}
    # llama.cpp quantizes activations to Q8_0 and keeps an f16 KV cache: differences of a few parts in a thousand
    assert report.first_parting is None and max(p.max_rel for p in report.points) < 0.03
    assert report.top1_agreement == 1.0 and report.mean_kl < 1e-3
    assert max(p.max_rel for p in report.points) > 1e-4  # two engines, not one compared with itself

    edited = dict(captured)
    edited["ffn_up-1"] = captured["ffn_up-1"] * 1.2
    assert parity.compare(edited, recorded, weights).first_parting == "ffn_up-1"
    # our norm outputs are before the weight: forgetting it would part at the first norm
    unweighted = {name: [np.ones_like(w) for w in ws] if isinstance(ws, list) else np.ones_like(ws)
                  for name, ws in weights.items()}
    assert parity.compare(captured, recorded, unweighted).first_parting == "attn_norm-0"
    assert "first point past 0.05 relative: none" in parity.format_report(report)


def test_parity_without_llama_cpp_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert main(["parity", "Hello", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'workbench[reference]'" in err




def _needs_llama_cpp():
    return pytest.importorskip("llama_cpp")


@pytest.mark.parametrize("arch,fmt", [("llama", "Q4_0"), ("qwen2", "Q4_K_M"), ("qwen3", "Q6_K")])
def test_live_parity_on_random_models(arch, fmt, tmp_path):
    _needs_llama_cpp()
    checkpoint = random_checkpoint(random_config(arch), fmt, seed=1)
    model = workbench.load(write_gguf(tmp_path / "m.gguf", checkpoint.config, checkpoint.weights), device="cpu")
    report = parity.parity(model, list(range(1, 30)))
    assert report.first_parting is None and report.top1_agreement >= 0.9 and report.mean_kl < 1e-2
    found = parity.control_vector_point(model, list(range(1, 12)), layer=1)
    assert found == {"layer": 1, "first_changed": "l_out-1", "hook_point": "blocks.1.hook_resid_post",
                     "delta_is_direction": True}


def test_live_parity_refuses_a_file_llama_cpp_cannot_load(tmp_path):
    _needs_llama_cpp()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(workbench.WorkbenchError, match="llama.cpp cannot load"):
        parity.capture_llamacpp(bad, [1, 2, 3])
