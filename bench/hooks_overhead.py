"""Cost of recording activations, relative to the no-hook run (the production forward), on the embedded model.

    python bench/hooks_overhead.py [--tokens 64] [--repeats 15] [--device cpu] [--threads 2]

The three runs are interleaved in every round, so a busy machine slows them alike; the ratio printed is
the median over rounds of (recorded time / no-hook time) in that round.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import workbench

RESIDUAL_STREAMS = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_mid", "blocks.*.hook_resid_post"]
TEXT = ("The Eiffel Tower is in Paris, the Colosseum is in Rome, and the Brandenburg Gate stands in Berlin. "
        "Each of them draws millions of visitors every year, who come to see the monuments up close. ")


def timed_run(model, ids: list[int], record: list[str] | None) -> float:
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.run(ids, record=record)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="prompt length")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = workbench.load(device=args.device)
    ids = (model.to_ids(TEXT) * (args.tokens // 10 + 1))[: args.tokens]
    # hook_result is the one point that costs compute of its own (each head through W_O separately)
    all_but_result = [name for name in model.hook_points() if not name.endswith("attn.hook_result")]
    conditions = {"no hooks": None, "residual streams": RESIDUAL_STREAMS, "all but hook_result": all_but_result,
                  "everything (*)": ["*"]}
    for record in conditions.values():  # warm-up: kernel selection, allocator
        timed_run(model, ids, record)
    times: dict[str, list[float]] = {name: [] for name in conditions}
    for _ in range(args.repeats):
        for name, record in conditions.items():
            times[name].append(timed_run(model, ids, record))

    n_points = {name: len(model.run(ids[:2], record=record).activations) for name, record in conditions.items()}
    print(f"{model.config.name}: {len(ids)} tokens, {args.device}, {torch.get_num_threads()} threads, "
          f"{args.repeats} interleaved rounds")
    base = times["no hooks"]
    for name, values in times.items():
        ratio = statistics.median(t / b for t, b in zip(values, base))
        print(f"  {name:20} {n_points[name]:4} points  median {statistics.median(values) * 1e3:8.1f} ms  "
              f"ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
