"""Produce the llama.cpp reference fixtures in tests/fixtures/ (needs the optional `reference` extra).

    pip install --no-deps llama-cpp-python   # source build; see docs/faithfulness.md, "Regenerating the fixtures"
    python scripts/make_llamacpp_fixtures.py [--model PATH]

Writes:
- llamacpp_logits.safetensors + llamacpp_logits.json: for each of 30 prompts (5 to 512 tokens, every third marked
  ``held_out``: kept out of any tuning of llama.cpp numerics), llama.cpp's token ids and, at every position, its top-32
  log-probabilities (ids and values) plus the log of the remaining tail mass, so
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

from workbench.parity import without_extra_buffer_types

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
TOP = 32  # log-probabilities kept per position (the rest is one tail bucket): keeps the fixture ~1.5 MB

SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 5, 8, 13, 21,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Water boils at 100 degrees Celsius, which is",
    "<|im_start|>user\nWhat is the largest planet in our solar system?<|im_end|>\n<|im_start|>assistant\n",
    "Les chats sont des animaux très",
    "SELECT name, age FROM users WHERE",
    "In 1969, Neil Armstrong became",
]
# Paragraphs that longer prompts are made of (each about 60-110 tokens), so that their lengths spread from ~60 to 512
PARAGRAPHS = [
    "The river runs through the old town, past the market where traders sell bread, fish and cloth. Children play by "
    "the water while their parents talk about the harvest, the weather and the price of grain. In the evening the "
    "bells of the church ring, and the lamps along the bridge are lit one by one.",
    "import numpy as np\n\n\ndef softmax(x, axis=-1):\n    shifted = x - x.max(axis=axis, keepdims=True)\n"
    "    e = np.exp(shifted)\n    return e / e.sum(axis=axis, keepdims=True)\n\n\nclass Layer:\n"
    "    def __init__(self, n_in, n_out):\n        self.w = np.random.randn(n_in, n_out) * 0.02\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods "
    "from carbon dioxide and water. It generally involves the green pigment chlorophyll and generates oxygen as a "
    "byproduct. The light reactions take place in the thylakoid membranes of the chloroplast.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nCan you explain how a hash map "
    "works, and why lookups are fast on average?<|im_end|>\n<|im_start|>assistant\nA hash map stores key-value pairs "
    "in an array of buckets. A hash function turns each key into an index,",
    "Dear Sir or Madam,\n\nI am writing to inquire about the apartment advertised on your website. I would like to "
    "know whether it is still available, whether pets are allowed, and when it would be possible to visit. I am "
    "currently working as an engineer and can provide references from my previous landlord.",
    "The French Revolution began in 1789 and ended in the late 1790s with the ascent of Napoleon Bonaparte. During "
    "this period, French citizens razed and redesigned their country's political landscape, uprooting centuries-old "
    "institutions such as absolute monarchy and the feudal system.",
]


def long_prompt(i: int) -> str:
    """The ``i``-th longer prompt: ``1 + i // 3`` paragraphs (at most 6) (cycling from paragraph ``i``), then a short prompt's
    opening."""
    parts = [PARAGRAPHS[(i + j) % len(PARAGRAPHS)] for j in range(1 + min(i // 3, 5))]
    return "\n\n".join(parts) + "\n\n" + SHORT_PROMPTS[i % len(SHORT_PROMPTS)]


# 30 prompts of 5 to at most 512 tokens; every third (index % 3 == 2) is held out of any tuning (HELD_OUT)
PROMPTS = SHORT_PROMPTS + [long_prompt(i) for i in range(20)]
HELD_OUT = [i for i in range(len(PROMPTS)) if i % 3 == 2]
MAX_TOKENS = 512
GREEDY_PROMPTS = [SHORT_PROMPTS[0], SHORT_PROMPTS[6]]
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
    if args.parity_only:
        write_parity_fixture(args.threads)
        return
    model_path = args.model or default_model_path()
    without_extra_buffer_types()
    # flash attention on: llama.cpp's default ("auto") picks it on the CPU; llama-cpp-python's Llama() turns it off
    llm = llama_cpp.Llama(str(model_path), n_ctx=2 * MAX_TOKENS, n_batch=MAX_TOKENS, n_ubatch=MAX_TOKENS,
                          logits_all=True, verbose=False, n_threads=args.threads, seed=0, flash_attn=True)
    source = {"model": model_path.name, "llama_cpp_python": llama_cpp.__version__,
              "machine": platform.machine(), "threads": args.threads, "flash_attention": True, "top": TOP}

    tensors, prompts = top_logprobs(llm, PROMPTS, TOP)
    for i, prompt in enumerate(prompts):
        assert len(prompt["ids"]) <= MAX_TOKENS, (i, len(prompt["ids"]))
        prompt["held_out"] = i in HELD_OUT
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
    # last: after a run of the low-level API (parity's capture), creating a Llama() in the same process has crashed
    write_parity_fixture(args.threads)


if __name__ == "__main__":
    main()
