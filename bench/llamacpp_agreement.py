"""Top-1 agreement and KL of workbench's logits against llama.cpp's on 30 prompts of varied length (a third held out
of any tuning: every third prompt), in exact and in llama.cpp numerics. Needs the ``reference`` extra.

    python bench/llamacpp_agreement.py [--model PATH] [--threads 2] [--max-tokens 512]
"""
from __future__ import annotations

import argparse
import json

import torch

BASE = [
    "The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived", "1, 2, 3, 5, 8, 13, 21,",
    "Water boils at 100 degrees Celsius, which is", "Les chats sont des animaux très",
    "<|im_start|>user\nWhat is the largest planet in our solar system?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef softmax(x):\n", "The mitochondria is the powerhouse of the cell because",
    "In 1969, Neil Armstrong became", "SELECT name, age FROM users WHERE", "Dear Sir or Madam,\n\nI am writing to",
]
PARAGRAPH = ("The river runs through the old town, past the market where traders sell bread, fish and cloth. "
             "Children play by the water while their parents talk about the harvest, the weather and the price of "
             "grain. In the evening the bells of the church ring, and the lamps along the bridge are lit one by one. ")


def prompts(max_tokens: int, tokenize) -> list[list[int]]:
    out = []
    for i in range(30):
        text = BASE[i % len(BASE)]
        if i >= len(BASE):  # longer prompts: a paragraph repeated before the opening, 40 to ~max_tokens tokens
            text = PARAGRAPH * (1 + (i - len(BASE)) // 2) + text
        ids = tokenize(text)[:max_tokens]
        out.append(ids)
    return out


def main() -> None:
    import workbench
    from workbench import parity
    from workbench.kernels import numerics

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = workbench.load(args.model, device="cpu")
    sets = prompts(args.max_tokens, model.tokenize)
    reference = [torch.from_numpy(parity.capture_llamacpp(model.path, ids, names=lambda n: False,
                                                          threads=args.threads).tensors["result_output"])
                 for ids in sets]
    results = {}
    for mode in ("exact", "llamacpp"):
        with numerics(mode), torch.inference_mode():
            ours = [model.forward(ids) for ids in sets]
        for part, keep in (("tuning", lambda i: i % 3 != 2), ("held out", lambda i: i % 3 == 2)):
            idx = [i for i in range(len(sets)) if keep(i)]
            kl = torch.cat([parity.kl_per_position(reference[i], ours[i]) for i in idx])
            agree = torch.cat([reference[i].argmax(-1) == ours[i].argmax(-1) for i in idx]).double()
            results[f"{mode}, {part}"] = {"prompts": len(idx), "positions": int(agree.numel()),
                                          "top1": round(agree.mean().item(), 4), "mean_kl": kl.mean().item(),
                                          "max_kl": kl.max().item()}
    lengths = [len(s) for s in sets]
    print(json.dumps({"lengths": [min(lengths), max(lengths)], **results}, indent=1))


if __name__ == "__main__":
    main()
