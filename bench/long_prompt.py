"""Prefill of one long prompt: time and peak memory, with attention holding the whole ``[heads, T, S]`` scores
(``--whole``, the path a hook on scores or patterns takes) or chunked under ``layer_ops.SCORES_BUDGET`` (the default).

    python bench/long_prompt.py [--tokens 8000] [--threads 2] [--device cpu] [--whole] [--model PATH]
        [--synthetic llama3-8b --format Q4_K]   # random weights of a real model's shape, random token ids

Each mode runs in a fresh subprocess, so its peak RSS (or CUDA peak allocation) is its own; the prompt is a text
repeated to ``--tokens`` tokens, and the prefill computes the last position's logits only, as llama.cpp's does.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
import workbench
from workbench.kernels import layer_ops
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
if args["whole"]:
    layer_ops.SCORES_BUDGET = 1 << 62
if args["synthetic"]:
    sys.path.insert(0, args["bench_dir"])
    from decode import SHAPES  # noqa: E402 (bench/decode.py's real model shapes)
    from workbench.synthetic import random_checkpoint, random_config
    config = random_config("llama", n_ctx=args["tokens"] + 64, **SHAPES[args["synthetic"]])
    model = workbench.Model(random_checkpoint(config, args["format"], device=args["device"], distinct_rows=256),
                            device=args["device"])
    ids = torch.randint(0, config.vocab_size, (args["tokens"],), generator=torch.Generator().manual_seed(0)).tolist()
else:
    model = workbench.load(args["model"] or None, device=args["device"])
    text = "The history of the region is long and varied, and its people tell many stories about it. "
    ids = model.tokenize(text * (args["tokens"] // 10))[: args["tokens"]]
with torch.inference_mode():
    model.runner.forward(torch.tensor(ids[:64]), last_logits_only=True)  # loads the kernels
    if args["device"] == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    logits = model.runner.forward(torch.tensor(ids), last_logits_only=True)
    if args["device"] == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
peak = torch.cuda.max_memory_allocated() if args["device"] == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"tokens": len(ids), "seconds": seconds, "peak_bytes": peak, "before_bytes": before,
                  "top": int(logits[-1].argmax())}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="")
    parser.add_argument("--whole", action="store_true", help="hold the whole scores (as before chunking)")
    parser.add_argument("--synthetic", default="", help="a shape of bench/decode.py (llama3-8b, ...) with random weights")
    parser.add_argument("--format", default="Q4_K", help="the format of --synthetic's weights")
    args = parser.parse_args()
    args.bench_dir = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(vars(args))], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-2000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    where = "CUDA peak allocated" if args.device == "cuda" else "peak RSS"
    print(f"{'whole scores' if args.whole else 'chunked'}: {r['tokens']} tokens in {r['seconds']:.1f} s "
          f"({r['tokens'] / r['seconds']:.1f} tok/s); {where} {r['peak_bytes'] / 2**30:.2f} GiB "
          f"(before the prefill {r['before_bytes'] / 2**30:.2f} GiB); next token {r['top']}")


if __name__ == "__main__":
    main()
