"""Prefill of one long prompt: time and peak memory, with attention holding the whole ``[heads, T, S]`` scores
(``--whole``, the path a hook on scores or patterns takes) or fused past ``layer_ops.SCORES_BUDGET`` (the default).

    python bench/long_prompt.py [--tokens 8000] [--threads 2] [--device cpu] [--whole] [--model PATH]
        [--synthetic llama3-8b --format Q4_K]   # random weights of a real model's shape, random token ids
        [--llama-cpp-python]                    # llama.cpp's CPU prefill of the same ids, after ours

Each run is a fresh subprocess, so its peak RSS (or CUDA peak allocation) is its own; the prompt is a text repeated
to ``--tokens`` tokens, and the prefill computes the last position's logits only, as llama.cpp's does. llama.cpp
(llama-cpp-python, the ``reference`` extra) takes the same ids in batches of 512 on the same threads, its default
attention (flash attention where its CPU backend has it).
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
                  "top": int(logits[-1].argmax()), "ids": ids}))
"""

LLAMA_CPP_CHILD = r"""
import json, resource, sys, time
import llama_cpp
import numpy as np
from workbench.parity import without_extra_buffer_types
args = json.loads(sys.argv[1])
without_extra_buffer_types()
llm = llama_cpp.Llama(args["path"], n_ctx=len(args["ids"]) + 64, n_batch=512, n_threads=args["threads"],
                      n_threads_batch=args["threads"], verbose=False)
llm.eval(args["ids"][:64])  # a warm-up, as ours loads its kernels first
llm.reset()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
llm.eval(args["ids"])
seconds = time.perf_counter() - start
print(json.dumps({"tokens": len(args["ids"]), "seconds": seconds, "before_bytes": before,
                  "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "top": int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())}))
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
    parser.add_argument("--llama-cpp-python", action="store_true", help="llama.cpp's prefill of the same ids too")
    args = parser.parse_args()
    args.bench_dir = str(Path(__file__).resolve().parent)
    ours = child(CHILD, vars(args))
    where = "CUDA peak allocated" if args.device == "cuda" else "peak RSS"
    report("whole scores" if args.whole else "fused attention", ours, where)
    if args.llama_cpp_python:
        if args.synthetic or args.device != "cpu":
            sys.exit("--llama-cpp-python compares the CPU prefill of a GGUF file (--model, or the embedded model)")
        from workbench.loading import default_model_path

        path = args.model or str(default_model_path())
        theirs = child(LLAMA_CPP_CHILD, {"path": path, "ids": ours["ids"], "threads": args.threads})
        report("llama.cpp", theirs, where)
        print(f"workbench / llama.cpp: {theirs['seconds'] / ours['seconds']:.2f}x the speed")


def child(code: str, args: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(label: str, r: dict, where: str) -> None:
    print(f"{label}: {r['tokens']} tokens in {r['seconds']:.1f} s ({r['tokens'] / r['seconds']:.1f} tok/s); "
          f"{where} {r['peak_bytes'] / 2**30:.2f} GiB (before the prefill {r['before_bytes'] / 2**30:.2f} GiB); "
          f"next token {r['top']}", flush=True)


if __name__ == "__main__":
    main()
