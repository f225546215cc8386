"""Tiny random transformers MoE checkpoints and llama.cpp's converter, shared by tests/test_moe.py and
scripts/make_moe_fixtures.py (which writes the llama.cpp reference fixtures)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from test_loading import write_hf_tokenizer
from workbench.synthetic import tokenizer_metadata

FAMILIES = ("mixtral", "qwen3moe", "qwen2moe")
LLAMA_CPP_SOURCE = Path(os.environ.get("WORKBENCH_LLAMA_CPP_SOURCE",
                                       "/work/cache/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def hf_moe_model(family: str, path: Path, d_model: int = 64, d_expert: int = 48, n_layers: int = 2):
    """A tiny random transformers MoE model saved as a safetensors checkpoint with our byte-level tokenizer (weights
    large enough that routing differs from token to token)."""
    import transformers

    vocab = len(tokenizer_metadata()["tokenizer.ggml.tokens"])
    common = dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.08,
                  tie_word_embeddings=False)
    config = {
        "mixtral": lambda: transformers.MixtralConfig(intermediate_size=2 * d_expert, num_local_experts=4,
                                                      num_experts_per_tok=2, **common),
        "qwen3moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=d_expert,
                                                        num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                                                        head_dim=d_model // 4, **common),
        "qwen2moe": lambda: transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=d_expert,
                                                        shared_expert_intermediate_size=2 * d_expert, num_experts=8,
                                                        num_experts_per_tok=2, **common),
    }[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    write_hf_tokenizer(path)
    return model


# convert_hf_to_gguf.py, told to use the default pre-tokenizer: our tiny byte-level tokenizer is not one of those it
# knows by hash
_CONVERT = """import runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_with_llama_cpp(hf_dir: Path, out: Path) -> Path:
    """llama.cpp's own converter (float32), run from its source tree with its own gguf-py, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LLAMA_CPP_SOURCE), str(LLAMA_CPP_SOURCE / "gguf-py")])}
    subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py"), str(hf_dir),
                    "--outfile", str(out), "--outtype", "f32"], env=env, check=True, capture_output=True)
    return out
