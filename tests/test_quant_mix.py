"""llama.cpp's mixes (Q4_K_M, Q3_K_L, ...) on load: the format of each matrix, and the models they make."""
from __future__ import annotations

import collections

import pytest
import torch

import workbench
from workbench.cli import main
from workbench.errors import QuantizeError
from workbench.quant_mix import check_quantize, matrix_format, use_more_bits
from workbench.synthetic import random_checkpoint, random_config, write_gguf

from test_loading import hf_model

# Shapes only: no weights are drawn for these.
LLAMA3_8B = random_config("llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_mlp=14336,
                          tied_embeddings=False)
LLAMA3_70B = random_config("llama", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_mlp=28672,
                           tied_embeddings=False)
LLAMA_65B = random_config("llama", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=64, d_mlp=22016,
                          tied_embeddings=False)
MATRICES = {"attn_q": 0, "attn_k": 0, "attn_v": 0, "attn_output": 0, "ffn_gate": 0, "ffn_up": 0, "ffn_down": 1}


def formats(mix: str, config) -> dict[str, str]:
    """The format of every matrix of ``config`` under ``mix``, by llama.cpp tensor name."""
    cols = {0: config.d_model, 1: config.d_mlp}
    names = {f"blk.{i}.{matrix}.weight": cols[kind] for i in range(config.n_layers) for matrix, kind in MATRICES.items()}
    names["token_embd.weight"] = config.d_model
    if not config.tied_embeddings:
        names["output.weight"] = config.d_model
    return {name: matrix_format(mix, name, config, n).name for name, n in names.items()}


def test_use_more_bits_layers():
    # llama.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, in integer division
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(2) if use_more_bits(i, 2)] == [1]


def test_q4_k_m_on_llama3_8b():
    got = formats("Q4_K_M", LLAMA3_8B)
    more_bits = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert got["output.weight"] == "Q6_K" and got["token_embd.weight"] == "Q4_K"
    for i in range(32):
        expected = "Q6_K" if i in more_bits else "Q4_K"
        assert got[f"blk.{i}.attn_v.weight"] == got[f"blk.{i}.ffn_down.weight"] == expected, i
        assert {got[f"blk.{i}.{m}.weight"] for m in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert collections.Counter(got.values()) == {"Q4_K": 32 * 7 + 1 - 32, "Q6_K": 1 + 32}


def test_q4_k_s_q5_k_s_q5_k_m_on_llama3_8b():
    s4, s5, m5 = formats("Q4_K_S", LLAMA3_8B), formats("Q5_K_S", LLAMA3_8B), formats("Q5_K_M", LLAMA3_8B)
    assert [s4[f"blk.{i}.attn_v.weight"] for i in (0, 3, 4)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert [s4[f"blk.{i}.ffn_down.weight"] for i in (0, 3, 4)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert s4["output.weight"] == s5["output.weight"] == m5["output.weight"] == "Q6_K"
    assert set(s5.values()) == {"Q5_K", "Q6_K"} and collections.Counter(s5.values())["Q6_K"] == 1
    assert [m5[f"blk.{i}.ffn_down.weight"] for i in (5, 6)] == ["Q5_K", "Q6_K"]


def test_q3_k_mixes_on_llama3_8b():
    s3, m3, l3 = formats("Q3_K_S", LLAMA3_8B), formats("Q3_K_M", LLAMA3_8B), formats("Q3_K_L", LLAMA3_8B)
    assert collections.Counter(s3.values()) == {"Q3_K": 225, "Q6_K": 1}
    assert [m3[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2, 31)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert [m3[f"blk.{i}.ffn_down.weight"] for i in (0, 1, 2, 31)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]  # 32 // 16 = 2
    assert {m3[f"blk.{i}.attn_output.weight"] for i in range(32)} == {"Q4_K"}
    assert m3["blk.7.attn_q.weight"] == m3["blk.7.ffn_up.weight"] == m3["token_embd.weight"] == "Q3_K"
    assert {l3[f"blk.{i}.{m}.weight"] for i in range(32) for m in ("attn_v", "attn_output", "ffn_down")} == {"Q5_K"}
    assert collections.Counter(l3.values()) == {"Q3_K": 129, "Q5_K": 96, "Q6_K": 1}


def test_70b_value_projections():
    """80 layers with grouped-query attention: value projections left in Q4_K take Q5_K; the 65B (one key-value head
    per query head) keeps them."""
    assert not use_more_bits(10, 80) and use_more_bits(9, 80)
    assert matrix_format("Q4_K_M", "blk.10.attn_v.weight", LLAMA3_70B, 8192).name == "Q5_K"
    assert matrix_format("Q4_K_M", "blk.9.attn_v.weight", LLAMA3_70B, 8192).name == "Q6_K"
    assert matrix_format("Q4_K_M", "blk.10.ffn_down.weight", LLAMA3_70B, 28672).name == "Q4_K"
    assert matrix_format("Q4_K_M", "blk.10.attn_v.weight", LLAMA_65B, 8192).name == "Q4_K"
    assert matrix_format("Q3_K_S", "blk.10.attn_v.weight", LLAMA3_70B, 8192).name == "Q5_K"
    assert matrix_format("Q3_K_S", "blk.10.attn_q.weight", LLAMA3_70B, 8192).name == "Q3_K"


def test_output_rule_matches_llama_cpp_on_the_embedded_model(model):
    """llama.cpp quantized the embedded SmolLM2 (tied embeddings, rows of 576) and gave its embedding Q8_0: the output
    rule's Q6_K, whose 256-value blocks do not fit 576 values, falls back to Q8_0. The mixes apply the same rule."""
    config = model.config
    assert model.tensor_formats()["embed"] == "Q8_0"
    for mix in ("Q4_K_M", "Q5_K_S"):
        assert matrix_format(mix, "token_embd.weight", config, config.d_model).name == "Q8_0"
    # the other matrices: Q4_K falls back to Q5_0 on rows of 576, Q6_K fits the down projection's rows of 1536
    assert matrix_format("Q4_K_M", "blk.0.attn_q.weight", config, 576).name == "Q5_0"
    assert matrix_format("Q4_K_M", "blk.0.ffn_down.weight", config, 1536).name == "Q6_K"
    assert matrix_format("Q4_K_M", "blk.4.ffn_down.weight", config, 1536).name == "Q4_K"


def test_random_q4_k_m_model_runs_and_round_trips(tmp_path, tiny_checkpoint, tiny_model):
    shape = dict(n_layers=8, d_model=256, n_heads=4, n_kv_heads=2, d_mlp=512, tied_embeddings=False)
    checkpoint = tiny_checkpoint("llama", "Q4_K_M", seed=3, **shape)
    config = checkpoint.config
    model = tiny_model("llama", "Q4_K_M", seed=3, device="cpu", **shape)
    got = model.tensor_formats()
    assert [got[f"blocks.{i}.wv"] for i in range(8)] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [got[f"blocks.{i}.w_down"] for i in range(8)] == [got[f"blocks.{i}.wv"] for i in range(8)]
    assert got["unembed"] == "Q6_K" and got["embed"] == got["blocks.0.wq"] == "Q4_K"
    ids = [4, 8, 15, 16, 23, 42]
    logits = model.forward(ids)
    assert torch.isfinite(logits).all()
    # as a GGUF file, each matrix keeps its format and the model its logits
    loaded = workbench.load(write_gguf(tmp_path / "q4_k_m.gguf", config, checkpoint.weights, checkpoint.metadata),
                            device="cpu")
    assert loaded.tensor_formats() == got
    assert torch.equal(loaded.forward(ids), logits)


def test_quantize_mix_on_load(tmp_path):
    """A Hugging Face checkpoint with rows of 64 and 96 values: the mix's Q4_K falls back to Q5_0 and its Q6_K to
    Q8_0, as in llama.cpp's quantizer."""
    hf_model("llama", tmp_path, tie=False)
    float_model = workbench.load(tmp_path, device="cpu")
    mixed = workbench.load(tmp_path, device="cpu", quantize="q4_k_m")
    got = mixed.tensor_formats()
    assert got["unembed"] == "Q8_0" and got["embed"] == "Q5_0"
    assert (got["blocks.0.wv"], got["blocks.1.wv"], got["blocks.1.w_down"]) == ("Q5_0", "Q8_0", "Q8_0")
    ids = list(range(3, 40))
    drift = (mixed.forward(ids) - float_model.forward(ids)).abs().max().item()
    assert 0 < drift < 0.5


def test_unknown_quantization_is_refused(tmp_path, capsys):
    with pytest.raises(QuantizeError, match="unknown quantization 'Q4_K_X'.*Q4_K_M"):
        check_quantize("Q4_K_X")
    hf_model("llama", tmp_path, tie=False)
    with pytest.raises(QuantizeError, match="unknown quantization"):
        workbench.load(tmp_path, device="cpu", quantize="Q7_K_M")
    with pytest.raises(QuantizeError, match="unknown quantization"):
        random_checkpoint(random_config("llama"), "Q4_K_X")
    # the command line prints the message, with no traceback
    assert main(["run", "hello", "--model", str(tmp_path), "--quantize", "Q7_K_M"]) == 2
    assert "workbench: error: unknown quantization 'Q7_K_M'" in capsys.readouterr().err
