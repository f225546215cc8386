"""Cost of recording activations, relative to the no-hook run (the production forward), on the embedded model.

    python bench/hooks_overhead.py [--tokens 64] [--repeats 15] [--device cpu] [--threads 2]
    python bench/hooks_overhead.py --stop-layers 7,15,29 [--prompts 64] [--repeats 5]

The runs are interleaved in every round, so a busy machine slows them alike; the ratio printed is the median over
rounds of (recorded time / no-hook time) in that round. With ``--stop-layers``, it times instead collecting one layer's
last-token residual for a dataset's prompts in batches (``run_batch(..., reduce="last")``), through the unembedding
(``logits="last"``) against stopping after that layer (``logits=None``).
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


def timed(model, fn) -> float:
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def stop_layers(model, layers: list[int], n_prompts: int, repeats: int) -> None:
    from workbench.probes import load_dataset

    prompts = load_dataset("sentiment").prompts[:n_prompts]
    runs = {(layer, logits): lambda layer=layer, logits=logits: model.run_batch(
        prompts, record=[f"blocks.{layer}.hook_resid_post"], reduce="last", logits=logits, share_prefix=False)
        for layer in layers for logits in ("last", None)}
    for run in runs.values():  # warm-up
        run()
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(timed(model, run))
    print(f"{model.config.name}: {len(prompts)} prompts, {model.device.type}, {torch.get_num_threads()} threads, "
          f"{repeats} interleaved rounds, one layer's last-token residual")
    for layer in layers:
        whole, stopped = (statistics.median(times[layer, logits]) for logits in ("last", None))
        print(f"  layer {layer:3}  through the unembedding {whole * 1e3:8.1f} ms  stopped after it "
              f"{stopped * 1e3:8.1f} ms  ({whole / stopped:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="prompt length")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    parser.add_argument("--stop-layers", help="comma-separated layers: time batched collection stopping after each")
    parser.add_argument("--prompts", type=int, default=64, help="prompts of datasets/sentiment.jsonl (--stop-layers)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = workbench.load(device=args.device)
    if args.stop_layers:
        return stop_layers(model, [int(x) for x in args.stop_layers.split(",")], args.prompts, args.repeats)
    ids = (model.to_ids(TEXT) * (args.tokens // 10 + 1))[: args.tokens]
    # hook_result is the one point that costs compute of its own (each head through W_O separately)
    all_but_result = [name for name in model.hook_points() if not name.endswith("attn.hook_result")]
    conditions = {"no hooks": None, "residual streams": RESIDUAL_STREAMS, "all but hook_result": all_but_result,
                  "everything (*)": ["*"]}
    for record in conditions.values():  # warm-up: kernel selection, allocator
        timed(model, lambda: model.run(ids, record=record))
    times: dict[str, list[float]] = {name: [] for name in conditions}
    for _ in range(args.repeats):
        for name, record in conditions.items():
            times[name].append(timed(model, lambda: model.run(ids, record=record)))

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
