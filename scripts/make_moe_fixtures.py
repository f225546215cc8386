"""Produce the llama.cpp reference fixtures of the mixture-of-experts families in tests/fixtures/moe/ (needs the
optional `reference` extra and llama.cpp's source tree for its converter, see tests/moe_reference.py).

    python scripts/make_moe_fixtures.py

For each family (Mixtral, Qwen3-MoE, Qwen2-MoE): a tiny random transformers checkpoint, converted by llama.cpp's own
convert_hf_to_gguf.py (float32) and quantized by llama.cpp (``llama_model_quantize``) into Q8_0 (d_model 64) and
Q4_K_M (d_model 256, so that its rows fit K-quant blocks; one layer and 4 experts, to keep the committed files
small). Writes
``{family}-{quant}.gguf`` and, in llamacpp_logits.safetensors / .json, llama.cpp's log-probabilities over the whole
vocabulary at every position of the token sequences in SEQUENCES.
"""
from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from moe_reference import FAMILIES, convert_with_llama_cpp, hf_moe_model, quantize_with_llama_cpp  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from make_llamacpp_fixtures import log_softmax, without_extra_buffer_types  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "moe"
SEQUENCES = [[5, 77, 120, 3, 250, 9, 14, 200, 31, 64], [40, 41, 42, 100, 101, 7, 7, 7, 263, 80, 90, 12]]
# quantization -> (llama.cpp file type, the checkpoint's size)
QUANTS = {"Q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", dict(n_layers=2)),
          "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", dict(n_layers=1, hidden_size=256, intermediate_size=256,
                                                       moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                                       head_dim=64, num_experts=4))}




def main() -> None:
    import llama_cpp

    without_extra_buffer_types()

    FIXTURES.mkdir(parents=True, exist_ok=True)
    tensors, files = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            for quant, (ftype, size) in QUANTS.items():
                hf_dir = Path(tmp) / f"{family}-{quant}"
                hf_moe_model(family, hf_dir, **size)
                f32 = convert_with_llama_cpp(hf_dir, Path(tmp) / f"{family}-{quant}-f32.gguf")
                out = FIXTURES / f"{family}-{quant}.gguf"
                quantize_with_llama_cpp(f32, out, ftype)
                llm = llama_cpp.Llama(str(out), n_ctx=64, logits_all=True, n_threads=2, verbose=False, seed=0)
                for i, ids in enumerate(SEQUENCES):
                    llm.reset()
                    llm.eval(ids)
                    logprobs = log_softmax(np.array(llm.scores[: len(ids)], dtype=np.float32))
                    tensors[f"{family}-{quant}.{i}"] = torch.from_numpy(logprobs.astype(np.float32))
                files.append(out.name)
                del llm
    save_file(tensors, FIXTURES / "llamacpp_logits.safetensors")
    source = {"llama_cpp_python": llama_cpp.__version__, "machine": platform.machine(), "threads": 2,
              "extra_buffer_types": False,
              "files": files, "sequences": SEQUENCES}
    (FIXTURES / "llamacpp_logits.json").write_text(json.dumps(source, indent=1) + "\n")
    print(f"wrote {len(files)} models and their llama.cpp log-probabilities to {FIXTURES}")


if __name__ == "__main__":
    main()
