"""Produce the llama.cpp fixtures of every model family in tests/fixtures/families/ (needs the `reference` extra and
llama.cpp's source tree for its converter).

    pip install --no-deps llama-cpp-python
    python scripts/make_family_fixtures.py --llama-cpp path/to/llama.cpp   # the tree with convert_hf_to_gguf.py

For each family: a tiny random transformers checkpoint (``workbench.synthetic.random_hf_checkpoint``, fixed seed),
converted to an F32 GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` and quantized by llama.cpp
(``llama_model_quantize``) to Q8_0 and Q4_K_M. Writes, per family and format, the quantized GGUF (tens of KB:
d_model 64, whose rows are too short for K-quant blocks, so Q4_K_M falls back to Q5_0/Q5_1/Q8_0 as llama.cpp's
quantizer does) and llama.cpp's top log-probabilities at every position of a few prompts (and the tail's mass), its token
ids for the fixture strings, and, as a check of the converter's layout, our forward on the F32 GGUF against
transformers (the script fails above 1e-4).

The random tokenizers are a tiny SentencePiece model trained here (llama, Gemma, Phi-3; for Gemma 4, whose converter
reads tokenizer.json, as that file) and the byte-level BPE of ``workbench.synthetic`` (OLMo 2, whose converter reads
tokenizer.json); the converter knows neither BPE pre-tokenizer hash, so it is told "default".

``--families gemma4 gemma4moe`` remakes only those families' files (the others' entries stay in the JSON summary).
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

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_llamacpp_fixtures import top_logprobs  # noqa: E402
from workbench.parity import without_extra_buffer_types  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "families"
FORMATS = {"Q8_0": 7, "Q4_K_M": 15}  # llama_ftype values
# family -> n_layers: Gemma 3 needs six for llama.cpp's default layout to reach a global layer; Gemma 4's files name
# their layout (sliding and global layers alternating here); "gemma4moe" is Gemma 4 with the 26B-A4B's experts,
# "gemma4e" with the E2B's per-layer embeddings and layers reusing keys and values
FAMILIES = {"llama": 2, "gemma2": 2, "gemma3": 6, "phi3": 2, "phi3.5": 2, "olmo2": 2, "gemma4": 4, "gemma4moe": 4,
            "gemma4e": 4}
SPM_VOCAB = 320
# weights 15x transformers' default spread: next-token distributions as peaked as a real model's (top-1 probability
# ~0.1-0.5 instead of ~1/vocab), so that a wrong computation shows in KL and top-1
INIT = 0.3
TOP = 48  # log-probabilities kept per position (of 273-320), the rest lumped into one tail bucket
CORPUS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "Water boils at 100 degrees Celsius, which is 212 degrees Fahrenheit.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Les chats sont des animaux tres independants et curieux.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89 are Fibonacci numbers.",
    "Interpretability researchers record, ablate, steer and patch activations.",
] * 20
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n",
]
TOKENIZER_STRINGS = PROMPTS + ["Hello world", "  two  spaces", "ünïcödé and emoji 🙂", "tab\tand\nnewline"]


def train_sentencepiece(out: Path) -> None:
    import sentencepiece as spm

    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=SPM_VOCAB, model_type="bpe",
        byte_fallback=True, num_threads=1, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        add_dummy_prefix=False, minloglevel=2)


def sentencepiece_tokenizer_json(spm_dir: Path, folder: Path) -> None:
    """The SentencePiece model as a tokenizer.json (BPE with its merges, byte fallback, "▁" for spaces), as Gemma 4's
    converter reads a vocabulary (gguf's LlamaHfVocab, through transformers)."""
    import sentencepiece as spm

    from workbench.tokenizer import Tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    ids = range(sp.get_piece_size())
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in ids],
                "tokenizer.ggml.scores": [sp.get_score(i) for i in ids], "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.unk_token_id": 0, "tokenizer.ggml.add_space_prefix": False}
    document = json.loads(Tokenizer.from_gguf_metadata(metadata).to_hf_json())
    document["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    (folder / "tokenizer.json").write_text(json.dumps(document))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def make_checkpoint(family: str, folder: Path, spm_dir: Path):
    from workbench.synthetic import random_hf_checkpoint, tokenizer_metadata
    from workbench.tokenizer import Tokenizer

    if family == "olmo2":
        model = random_hf_checkpoint(family, folder, n_layers=FAMILIES[family], tie=False,  # as llama.cpp needs it
                                     initializer_range=INIT)
        (folder / "tokenizer.json").write_text(Tokenizer.from_gguf_metadata(tokenizer_metadata()).to_hf_json())
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
        return model
    # llama.cpp uses sqrt(d_head) as Gemma 2/3's query scale whatever the config says
    settings = {"query_pre_attn_scalar": 16} if family in ("gemma2", "gemma3") else {}
    if family == "gemma2":
        settings["final_logit_softcapping"] = 15.0
    if family == "gemma3":  # llama.cpp's default layout (every sixth layer global), which its converter assumes
        settings["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    if family.startswith("gemma4"):
        settings["final_logit_softcapping"] = 15.0
    if family == "phi3.5":  # llama.cpp takes the short factors in a context no longer than the original (its 128 is
        # padded to 256)
        settings.update(max_position_embeddings=1024, original_max_position_embeddings=256,
                        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                             original_max_position_embeddings=256,
                                             short_factor=[1.0, 1.25, 1.5, 2.0], long_factor=[2.0, 3.0, 5.0, 8.0]))
    model = random_hf_checkpoint(family, folder, vocab_size=SPM_VOCAB, n_layers=FAMILIES[family],
                                 initializer_range=INIT, **settings)
    if family.startswith("gemma4"):
        sentencepiece_tokenizer_json(spm_dir, folder)
        return model
    (folder / "tokenizer.model").write_bytes((spm_dir / "tokenizer.model").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return model


def convert(llama_cpp: Path, folder: Path, out: Path) -> None:
    """llama.cpp's converter in a process of its own (its gguf-py, not the installed gguf)."""
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
        "import convert_hf_to_gguf\n"
        "sys.argv = ['convert_hf_to_gguf.py', sys.argv[2], '--outfile', sys.argv[3], '--outtype', 'f32']\n"
        "convert_hf_to_gguf.main()\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([sys.executable, "-c", code, str(llama_cpp), str(folder), str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def quantize(source: Path, out: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source}")


def main() -> None:
    import llama_cpp

    import workbench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args()
    without_extra_buffer_types()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    source = {"llama_cpp_python": llama_cpp.__version__, "machine": platform.machine(), "threads": args.threads}
    summary_path = FIXTURES / "llamacpp_families.json"
    kept = json.loads(summary_path.read_text())["families"] if summary_path.is_file() else {}
    summary = {**source, "families": {f: kept[f] for f in FAMILIES if f in kept and f not in args.families}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_sentencepiece(tmp)
        for family in args.families:
            # a folder name without the family's: llama.cpp gives a model named "phi3" Phi-3's special tokens
            folder = tmp / family / "model"
            reference = make_checkpoint(family, folder, tmp)
            f32 = tmp / f"{family}-f32.gguf"
            convert(args.llama_cpp, folder, f32)
            ours = workbench.load(f32, device="cpu")
            ids = list(range(3, 40))
            with torch.no_grad():
                expected = reference(torch.tensor([ids])).logits[0].float()
            float_diff = (ours.forward(ids) - expected).abs().max().item()
            if float_diff > 1e-4:
                raise SystemExit(f"{family}: our forward on the converted F32 GGUF is {float_diff:.2e} from transformers")
            entry = {"architecture": ours.config.architecture, "converted_f32_vs_transformers_max_abs_diff": float_diff}
            for fmt, ftype in FORMATS.items():
                path = FIXTURES / f"{family}-{fmt}.gguf"
                quantize(f32, path, ftype)
                llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=args.threads,
                                      seed=0)
                tensors, prompts = top_logprobs(llm, PROMPTS, TOP)
                save_file(tensors, FIXTURES / f"{family}-{fmt}.logprobs.safetensors")
                max_tail = max(float(np.exp(t).max()) for k, t in tensors.items() if k.endswith("tail_logprob"))
                tokens = [{"text": t, "ids": [int(x) for x in llm.tokenize(t.encode(), add_bos=True, special=True)]}
                          for t in TOKENIZER_STRINGS]
                entry[fmt] = {"gguf_bytes": path.stat().st_size, "max_tail_mass": max_tail, "prompts": prompts,
                              "tokens": tokens}
                del llm
            summary["families"][family] = entry
            print(f"{family}: F32 conversion within {float_diff:.1e} of transformers")
    summary["families"] = {f: summary["families"][f] for f in FAMILIES if f in summary["families"]}
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote fixtures for {len(args.families)} families to {FIXTURES}")


if __name__ == "__main__":
    main()
