"""Batched runs against one prompt at a time: how far the logits move, and how much faster a batch is.

    python bench/batch_parity.py [--model PATH] [--device cpu|cuda] [--dtype float32|bfloat16] [--prompts 64]
                                 [--threads 2] [--skip-timing]

Parity: the prompts (the shipped datasets' prompts, one of them made ~10x longer so batches mix lengths) run once
through ``model.run_batch`` and once each through ``model.run``; printed are the largest |logit difference| over every
position of every prompt, the share of positions whose top-1 token agrees, and whether greedy ``generate_batch`` of
16 tokens equals ``generate`` per prompt; in half precision, how far each is from the float32 forward. Timing: recording every ``hook_resid_post`` for the prompts, batched and one
at a time (median of 3 after a warm-up each).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import workbench

DATASETS = Path(__file__).resolve().parent.parent / "datasets"


def prompts(n: int) -> list[str]:
    # read the shipped JSONL directly: the device machine need not have the probes' dependencies (scikit-learn)
    pool = [json.loads(line)["text"] for name in ("sentiment", "facts", "capitals")
            for line in (DATASETS / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    chosen = [pool[i % len(pool)] for i in range(n)]
    chosen[n // 2] = " ".join(chosen[:10])  # one much longer prompt
    return chosen


def seconds(fn, device: torch.device, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = workbench.load(args.model, device=args.device, dtype=args.dtype)
    texts = prompts(args.prompts)
    batched = model.forward_batch(texts)
    single = [model.forward(t).cpu() for t in texts]
    diff = max(float((b - s).abs().max()) for b, s in zip(batched, single))
    agree = sum(int((b.argmax(-1) == s.argmax(-1)).sum()) for b, s in zip(batched, single))
    positions = sum(s.shape[0] for s in single)
    generated = model.generate_batch(texts[:16], 16)
    same = sum(g == model.generate(t, 16) for g, t in zip(generated, texts[:16]))
    name = torch.cuda.get_device_name() if model.device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{model.config.name} on {name}, {args.dtype}, {len(texts)} prompts, {positions} positions")
    print(f"max |logit diff| batched vs one at a time: {diff:.3g}; top-1 agrees at {agree}/{positions} positions; "
          f"greedy generate_batch equals generate for {same}/16 prompts")
    if model.dtype != torch.float32:  # how far each is from the float32 forward: the dtype's own rounding
        reference = workbench.load(args.model, device=args.device, dtype="float32")
        exact = [reference.forward(t).cpu() for t in texts]
        for label, runs in (("one at a time", single), ("batched", batched)):
            err = max(float((r - e).abs().max()) for r, e in zip(runs, exact))
            top = sum(int((r.argmax(-1) == e.argmax(-1)).sum()) for r, e in zip(runs, exact))
            print(f"{args.dtype} {label} vs float32: max |logit diff| {err:.3g}, top-1 agrees at {top} positions")
        del reference
    if args.skip_timing:
        return
    record = ["blocks.*.hook_resid_post"]
    one = seconds(lambda: [model.run(t, record=record) for t in texts], model.device)
    many = seconds(lambda: model.run_batch(texts, record=record), model.device)
    print(f"record every resid_post: one at a time {one:.3f} s, batched {many:.3f} s ({one / many:.2f}x)")


if __name__ == "__main__":
    main()
