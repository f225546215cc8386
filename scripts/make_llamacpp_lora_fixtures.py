"""Produce the llama.cpp LoRA reference fixtures in tests/fixtures/ (needs the optional `reference` extra and llama.cpp's
source tree, for its converter).

    python scripts/make_llamacpp_lora_fixtures.py --llama-cpp PATH/TO/llama.cpp [--model PATH]

A random PEFT LoRA adapter (seeded; every projection of a few layers, B nonzero) for the embedded SmolLM2 is converted
by llama.cpp's own ``convert_lora_to_gguf.py`` (which permutes B's q/k rows for llama's rope itself), then llama.cpp
runs the base GGUF with it (llama-cpp-python's ``lora_path``). Writes:
- llamacpp_lora_adapter.gguf: the converted adapter (F16, as ``--outtype f16`` writes it);
- llamacpp_lora_logits.safetensors + .json: llama.cpp's top log-probabilities at every position of a few prompts
  with the adapter, as make_llamacpp_fixtures.py writes them for the base.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_llamacpp_fixtures import FIXTURES, PROMPTS, top_logprobs  # noqa: E402
from workbench.parity import without_extra_buffer_types  # noqa: E402

TOP = 256
RANK, ALPHA, STD, SEED = 4, 8.0, 0.1, 0
LAYERS = (0, 14, 29)
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_base_config(path: Path, config) -> None:
    """The Hugging Face config.json of the GGUF base: all the converter reads of the base model."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.d_model,
        "intermediate_size": config.d_mlp, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads, "head_dim": config.d_head,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.n_ctx, "rope_theta": config.rope_base,
        "rms_norm_eps": config.rms_eps, "tie_word_embeddings": config.tied_embeddings, "torch_dtype": "float32"}))


def write_peft_adapter(path: Path, config) -> None:
    q, kv, d, m = config.n_heads * config.d_head, config.n_kv_heads * config.d_head, config.d_model, config.d_mlp
    shapes = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q), "gate_proj": (m, d),
              "up_proj": (m, d), "down_proj": (d, m)}
    g = torch.Generator().manual_seed(SEED)
    tensors = {}
    for layer in LAYERS:
        for module, kind in MODULES.items():
            out_dim, in_dim = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_dim, generator=g) * STD
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, RANK, generator=g) * STD
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(MODULES),
        "layers_to_transform": list(LAYERS), "base_model_name_or_path": "base"}))




def main() -> None:
    import llama_cpp

    from workbench.loading import default_model_path, load_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (its converter)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model_path = args.model or default_model_path()
    config = load_checkpoint(model_path).config
    adapter = FIXTURES / "llamacpp_lora_adapter.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        base, peft = Path(tmp) / "base", Path(tmp) / "adapter"
        write_base_config(base, config)
        write_peft_adapter(peft, config)
        env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
        subprocess.run([sys.executable, str(args.llama_cpp / "convert_lora_to_gguf.py"), "--base", str(base),
                        "--outtype", "f16", "--outfile", str(adapter), str(peft)], check=True, env=env)
    without_extra_buffer_types()
    llm = llama_cpp.Llama(str(model_path), n_ctx=512, logits_all=True, verbose=False, n_threads=args.threads, seed=0,
                          lora_path=str(adapter))
    tensors, prompts = top_logprobs(llm, PROMPTS[:4], TOP)
    save_file(tensors, FIXTURES / "llamacpp_lora_logits.safetensors")
    source = {"model": model_path.name, "adapter": adapter.name, "llama_cpp_python": llama_cpp.__version__,
              "machine": platform.machine(), "threads": args.threads, "top": TOP, "rank": RANK, "alpha": ALPHA,
              "layers": list(LAYERS)}
    (FIXTURES / "llamacpp_lora_logits.json").write_text(json.dumps({**source, "prompts": prompts}, indent=1) + "\n")
    print(f"wrote the adapter and its logits for {len(prompts)} prompts to {FIXTURES}")


if __name__ == "__main__":
    main()
