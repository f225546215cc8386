"""Time to the first 32 generated tokens, in a fresh process (cold: nothing built in it; torch's on-disk compile cache
as it is) and again in the same process (warm), for each way of decoding.

    python bench/first_call.py [--device cuda] [--model PATH | --synthetic llama3-8b] [--tokens 32] [--threads 2]
        [--modes eager background compiled]

eager: ``compiled=False``; background: ``compiled="background"`` (the CUDA default: eager tokens until the compiled
step is ready); compiled: ``compiled=True`` (waits for the build). The load is timed apart. Each mode runs in its own
subprocess, so each cold figure pays for its own build.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
import workbench
started = time.perf_counter()
if args["synthetic"]:
    sys.path.insert(0, args["bench_dir"])
    from decode import synthetic_model  # noqa: E402 (bench/decode.py's random models of real shapes)
    model = synthetic_model(args["synthetic"], args["format"], args["device"], None)
else:
    model = workbench.load(args["model"] or None, device=args["device"])
load_s = time.perf_counter() - started
compiled = {"eager": False, "background": "background", "compiled": True}[args["mode"]]
prompt = "The history of the city begins with a small settlement by the river, where"

def first_tokens():
    start = time.perf_counter()
    n = 0
    for _ in model.stream(prompt, args["tokens"], compiled=compiled):
        n += 1
    if args["device"] == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, n

cold, n = first_tokens()
warm, _ = first_tokens()
print(json.dumps({"load_s": load_s, "cold_s": cold, "warm_s": warm, "tokens": n}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="")
    parser.add_argument("--synthetic", default="", help="a named random model (workbench.synthetic), e.g. llama3-8b")
    parser.add_argument("--format", default="Q4_K", help="the synthetic model's format")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["eager", "background", "compiled"])
    args = parser.parse_args()
    print(f"{'mode':<12}{'load s':>8}{'cold s':>9}{'warm s':>9}  (first {args.tokens} tokens, {args.device})")
    for mode in args.modes:
        child = {**vars(args), "mode": mode, "bench_dir": str(Path(__file__).parent)}
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(child)], capture_output=True, text=True)
        if out.returncode:
            print(f"{mode:<12} failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{mode:<12}{r['load_s']:8.2f}{r['cold_s']:9.2f}{r['warm_s']:9.2f}")


if __name__ == "__main__":
    main()
