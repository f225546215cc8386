"""Produce the llama.cpp reference fixtures in tests/fixtures/ (needs the optional `reference` extra).

    pip install --no-deps llama-cpp-python   # source build; see docs/faithfulness.md, "Regenerating the fixtures"
    python scripts/make_llamacpp_fixtures.py [--model PATH]

Writes:
- llamacpp_logits.safetensors + llamacpp_logits.json: for each prompt, llama.cpp's token ids and, at every
  position, its top-256 log-probabilities (ids and values) plus the log of the remaining tail mass, so
  KL(llama.cpp || ours) can be computed with the tail lumped into one bucket (a lower bound that is tight
  when the tail is small, which the json records).
- llamacpp_tokens.json: llama.cpp's token ids for the strings of tokenizer_cases.json.
- llamacpp_greedy.json: greedy continuations for a few prompts.
- llamacpp_parity.safetensors + llamacpp_parity.json: llama.cpp's named intermediate tensors (workbench.parity) for a
  tiny random model (``PARITY_MODEL``) on ``PARITY_IDS``, and the sha256 of that model's GGUF file.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
TOP = 2048

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 5, 8, 13, 21,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Water boils at 100 degrees Celsius, which is",
    "<|im_start|>user\nWhat is the largest planet in our solar system?<|im_end|>\n<|im_start|>assistant\n",
    "Les chats sont des animaux très",
]
GREEDY_PROMPTS = [PROMPTS[0], PROMPTS[6]]
# workbench.synthetic.random_checkpoint(random_config(arch), fmt, seed=0), and the token ids it runs
PARITY_MODEL = ("llama", "Q8_0")
PARITY_IDS = list(range(1, 20))


def write_parity_fixture(threads: int) -> None:
    import hashlib
    import tempfile

    from workbench import parity
    from workbench.synthetic import random_checkpoint, random_config, write_gguf

    arch, fmt = PARITY_MODEL
    checkpoint = random_checkpoint(random_config(arch), fmt, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "parity.gguf", checkpoint.config, checkpoint.weights)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        run = parity.capture_llamacpp(path, PARITY_IDS, threads=threads)
    save_file({k: torch.from_numpy(v) for k, v in run.tensors.items()}, FIXTURES / "llamacpp_parity.safetensors")
    meta = {"model": list(PARITY_MODEL), "sha256": digest, "ids": PARITY_IDS, "order": list(run.tensors),
            **run.settings}
    (FIXTURES / "llamacpp_parity.json").write_text(json.dumps(meta, indent=1) + "\n")


def without_extra_buffer_types() -> None:
    """Make ``llama_cpp.Llama`` load models without ggml's extra CPU buffer types (its repacked / AMX weight layouts):
    with them, llama-cpp-python 0.3.36's first ``llama_decode`` crashed (SIGSEGV) on the machine these fixtures were
    made on, the embedded model too. ``Llama()`` takes no such option, so its default model parameters are changed; the
    plain CPU kernels compute the same products."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def top_logprobs(llm, texts: list[str], top: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """llama.cpp's top ``top`` log-probabilities (ids, values) and the log of the tail mass at every position of each
    prompt (``prompt{i}.top_ids`` ...), and each prompt's text and token ids."""
    tensors, prompts = {}, []
    for i, prompt in enumerate(texts):
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        logprobs = log_softmax(np.array(llm.scores[: len(ids)], dtype=np.float32))
        top_ids = np.argsort(-logprobs, axis=-1)[:, :top]
        top_lp = np.take_along_axis(logprobs, top_ids, axis=-1)
        tail = np.log1p(-np.minimum(np.exp(top_lp).sum(-1), 1 - 1e-12))
        tensors[f"prompt{i}.top_ids"] = torch.from_numpy(top_ids.astype(np.int32))
        tensors[f"prompt{i}.top_logprobs"] = torch.from_numpy(top_lp.astype(np.float32))
        tensors[f"prompt{i}.tail_logprob"] = torch.from_numpy(tail.astype(np.float32))
        prompts.append({"text": prompt, "ids": [int(t) for t in ids], "max_tail_mass": float(np.exp(tail).max())})
    return tensors, prompts


def main() -> None:
    import llama_cpp

    from workbench.loading import default_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parity-only", action="store_true", help="write the parity fixture alone")
    args = parser.parse_args()
    write_parity_fixture(args.threads)
    if args.parity_only:
        return
    model_path = args.model or default_model_path()
    without_extra_buffer_types()
    llm = llama_cpp.Llama(str(model_path), n_ctx=512, logits_all=True, verbose=False, n_threads=args.threads,
                          seed=0)
    source = {"model": model_path.name, "llama_cpp_python": llama_cpp.__version__,
              "machine": platform.machine(), "threads": args.threads, "top": TOP}

    tensors, prompts = top_logprobs(llm, PROMPTS, TOP)
    save_file(tensors, FIXTURES / "llamacpp_logits.safetensors")
    (FIXTURES / "llamacpp_logits.json").write_text(json.dumps({**source, "prompts": prompts}, indent=1) + "\n")

    cases_file = FIXTURES / "tokenizer_cases.json"
    if cases_file.exists():
        cases = [{"text": t, "ids": [int(x) for x in llm.tokenize(t.encode(), add_bos=True, special=True)]}
                 for t in json.loads(cases_file.read_text())]
        (FIXTURES / "llamacpp_tokens.json").write_text(json.dumps({**source, "cases": cases}, indent=1) + "\n")

    greedy = []
    for prompt in GREEDY_PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        out = []
        for token in llm.generate(ids, temp=0.0, top_k=1):
            if token == llm.token_eos() or len(out) >= 24:
                break
            out.append(int(token))
        greedy.append({"text": prompt, "ids": [int(t) for t in ids], "generated": out})
    (FIXTURES / "llamacpp_greedy.json").write_text(json.dumps({**source, "cases": greedy}, indent=1) + "\n")
    print(f"wrote fixtures for {len(PROMPTS)} prompts to {FIXTURES}")


if __name__ == "__main__":
    main()
