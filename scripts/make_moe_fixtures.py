"""Produce the llama.cpp reference fixtures of the mixture-of-experts families in tests/fixtures/moe/ (needs the
optional `reference` extra and llama.cpp's source tree for its converter, see tests/moe_reference.py).

    python scripts/make_moe_fixtures.py [--only gpt-oss ...]

For each family (Mixtral, Qwen3-MoE, Qwen2-MoE): a tiny random transformers checkpoint, converted by llama.cpp's own
convert_hf_to_gguf.py (float32) and quantized by llama.cpp (``llama_model_quantize``) into Q8_0 (d_model 64) and
Q4_K_M (d_model 256, so that its rows fit K-quant blocks; one layer and 4 experts, to keep the committed files
small). GPT-OSS (2 layers, one sliding, YaRN rope, attention sinks, biases) goes into MXFP4_MOE, llama.cpp's file type
for it: MXFP4 experts, Q8_0 attention; its log-probabilities are also taken with llama.cpp's KV cache in F32 and
without flash attention (``{name}.{i}.f32kv``, through ``workbench.parity.capture_llamacpp``), where our llama.cpp
numerics should match it to rounding. ``--only`` remakes the named families and keeps the others' entries. Writes
``{family}-{quant}.gguf`` and, in llamacpp_logits.safetensors / .json, llama.cpp's log-probabilities over the whole
vocabulary at every position of the token sequences in SEQUENCES.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from moe_reference import FAMILIES, convert_with_llama_cpp, hf_moe_model, quantize_with_llama_cpp  # noqa: E402

from workbench.parity import capture_llamacpp  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from make_llamacpp_fixtures import log_softmax  # noqa: E402
from workbench.parity import without_extra_buffer_types  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "moe"
SEQUENCES = [[5, 77, 120, 3, 250, 9, 14, 200, 31, 64], [40, 41, 42, 100, 101, 7, 7, 7, 263, 80, 90, 12]]
# quantization -> (llama.cpp file type, the checkpoint's size)
QUANTS = {"Q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", dict(n_layers=2)),
          "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", dict(n_layers=1, hidden_size=256, intermediate_size=256,
                                                       moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                                       head_dim=64, num_experts=4))}
# families with quantizations of their own
# families with quantizations of their own; GPT-OSS's weights at 15x transformers' default spread (as
# make_family_fixtures.py's), for next-token distributions as peaked as a real model's
FAMILY_QUANTS = {"gpt-oss": {"MXFP4_MOE": ("LLAMA_FTYPE_MOSTLY_MXFP4_MOE", dict(n_layers=2, initializer_range=0.3))}}




def main() -> None:
    import llama_cpp

    every = {**{family: QUANTS for family in FAMILIES}, **FAMILY_QUANTS}
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(every), help="remake these families' fixtures only")
    args = parser.parse_args()
    without_extra_buffer_types()

    FIXTURES.mkdir(parents=True, exist_ok=True)
    tensors, files = {}, []
    if args.only:  # keep the other families' files and log-probabilities
        kept = [f for f in json.loads((FIXTURES / "llamacpp_logits.json").read_text())["files"]
                if f.rsplit("-", 1)[0] not in args.only]
        files = kept
        tensors = {name: t for name, t in load_file(str(FIXTURES / "llamacpp_logits.safetensors")).items()
                   if f"{name.split('.')[0]}.gguf" in kept}
    with tempfile.TemporaryDirectory() as tmp:
        for family, quants in every.items():
            if args.only and family not in args.only:
                continue
            for quant, (ftype, size) in quants.items():
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
                del llm
                if family in FAMILY_QUANTS:
                    for i, ids in enumerate(SEQUENCES):
                        run = capture_llamacpp(out, ids, names=lambda name: False, kv_type="f32", flash_attention="off")
                        logits = np.asarray(run.tensors["result_output"], dtype=np.float32).reshape(len(ids), -1)
                        tensors[f"{family}-{quant}.{i}.f32kv"] = torch.from_numpy(log_softmax(logits))
                files.append(out.name)
    save_file(tensors, FIXTURES / "llamacpp_logits.safetensors")
    source = {"llama_cpp_python": llama_cpp.__version__, "machine": platform.machine(), "threads": 2,
              "extra_buffer_types": False,
              "files": files, "sequences": SEQUENCES}
    (FIXTURES / "llamacpp_logits.json").write_text(json.dumps(source, indent=1) + "\n")
    print(f"wrote {len(files)} models and their llama.cpp log-probabilities to {FIXTURES}")


if __name__ == "__main__":
    main()
