"""Attribution patching against activation patching on the same sweeps: seconds of each (taking turns, median of
``--repeats``) and how well the estimates track the patched runs (Pearson correlation over the cells, and the cell
where they differ most), for each ``--steps`` (1: the gradient in the corrupt run; more: integrated gradients). The
README's prompts by default. Then the gradients of ``--prompts`` copies of the clean prompt, batched against one at a
time; and attribution patching over the first ``--pairs`` pairs of the shipped ``ioi`` dataset (``dataset_patching``,
the pairs batched) against a loop of one pair at a time, each against activation patching over the same pairs, and its
``verify=10`` against patching's own top 10 cells.

    python bench/attribution.py                        # embedded model, CPU, 2 threads
    python bench/attribution.py --steps 1 5 --device cuda --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import workbench
from decode import synchronize
from workbench import hooks, probes

SWEEPS = {  # name -> (hook template, axes)
    "resid_pre": (None, ("layers", "positions")),
    "attn_out": ("blocks.{layer}.hook_attn_out", ("layers", "positions")),
    "mlp_out": ("blocks.{layer}.hook_mlp_out", ("layers", "positions")),
    "heads": (None, ("layers", "heads")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF or checkpoint folder (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clean", default="The Eiffel Tower is in the city of")
    parser.add_argument("--corrupt", default="The Colosseum is in the city of")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 5], help="attribution_patching's steps")
    parser.add_argument("--prompts", type=int, default=8, help="prompts in the batched gradient run")
    parser.add_argument("--pairs", type=int, default=16, help="ioi pairs of the dataset sweeps (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = workbench.load(args.model, device=args.device)
    print(f"torch {torch.__version__}, {model.device}, threads {args.threads}")
    print(f"{'sweep':10} {'cells':>6} {'method':>10} {'seconds':>8} {'speed-up':>9} {'correlation':>12}  "
          "largest difference (cell: patched / estimated)")
    for name, (hook, over) in SWEEPS.items():
        sweep = dict(model=model, clean=args.clean, corrupt=args.corrupt, hook=hook, over=over)
        runs = {"patching": lambda: hooks.patching_sweep(**sweep, progress=False)}
        for steps in args.steps:
            runs[f"steps {steps}"] = lambda steps=steps: hooks.attribution_patching(**sweep, steps=steps)
        seconds, results = timed(runs, args.repeats, model.device)
        patched = results["patching"]
        print(f"{name:10} {patched.grid.numel():>6} {'patching':>10} {seconds['patching']:>8.3f}")
        for method in runs:
            if method == "patching":
                continue
            a, b = patched.grid.flatten(), results[method].grid.flatten()
            worst = int((a - b).abs().argmax())
            cell = [labels[i] for labels, i in zip(patched.labels.values(), torch.unravel_index(
                torch.tensor(worst), patched.grid.shape))]
            correlation = torch.corrcoef(torch.stack([a, b]))[0, 1]
            speed_up = seconds["patching"] / seconds[method]
            print(f"{'':10} {'':>6} {method:>10} {seconds[method]:>8.3f} {speed_up:>8.2f}x "
                  f"{correlation:>12.2f}  {' '.join(cell)}: {a[worst]:.2f} / {b[worst]:.2f}")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[-1].log_softmax(-1).max()

    prompts, points = [args.clean] * args.prompts, ["blocks.*.hook_resid_pre"]
    seconds, _ = timed({"batched": lambda: model.run_with_gradients_batch(prompts, metric, points),
                        "one at a time": lambda: [model.run_with_gradients(p, metric, points) for p in prompts]},
                       args.repeats, model.device)
    print(f"gradients at every resid_pre of {args.prompts} prompts: batched {seconds['batched']:.3f} s, one at a "
          f"time {seconds['one at a time']:.3f} s ({seconds['one at a time'] / seconds['batched']:.2f}x)")
    if args.pairs:
        dataset_sweeps(model, args.pairs, args.steps, args.repeats)


def dataset_sweeps(model: workbench.Model, n_pairs: int, steps_list: list[int], repeats: int) -> None:
    """Attribution patching over ioi pairs, batched and one pair at a time, against activation patching (timed once:
    each pair's cells are batched already, and it is the reference)."""
    pairs, answers = probes.load_dataset("ioi").patching()
    pairs, answers = pairs[:n_pairs], answers[:n_pairs]
    print(f"\nioi, {len(pairs)} pairs: seconds, and correlation with activation patching over the same pairs")
    for name in ("resid_pre", "heads"):
        hook, over = SWEEPS[name]
        sweep = dict(hook=hook, over=over, answers=answers, progress=False)
        start = time.perf_counter()
        patched = hooks.dataset_patching(model, pairs, **sweep)
        synchronize(model.device)
        print(f"{name:10} {patched.grid.numel():>6} cells, activation patching {time.perf_counter() - start:.3f} s")
        for steps in steps_list:
            def one_at_a_time(steps: int = steps) -> torch.Tensor:
                return torch.stack([hooks.attribution_patching(model, clean, corrupt, hook=hook, over=over,
                                                               answers=pair_answers, steps=steps).grid
                                    for (clean, corrupt), pair_answers in zip(pairs, answers)]).mean(0)

            seconds, results = timed({"batched": lambda steps=steps: hooks.dataset_patching(
                model, pairs, method="attribution", steps=steps, **sweep), "one at a time": one_at_a_time},
                repeats, model.device)
            batched = results["batched"].grid
            gap = float((batched - results["one at a time"]).abs().max())
            correlation = torch.corrcoef(torch.stack([patched.grid.flatten(), batched.flatten()]))[0, 1]
            print(f"{'':10} steps {steps}: batched {seconds['batched']:.3f} s, one pair at a time "
                  f"{seconds['one at a time']:.3f} s ({seconds['one at a time'] / seconds['batched']:.2f}x, largest "
                  f"difference {gap:.1e}), correlation {correlation:.2f}")
        # verify: the 10 cells of the largest estimate, patched; their effects against patching's own top 10 (cells
        # of equal effect, the last position of many layers, make the top 10's members arbitrary: their sizes count)
        start = time.perf_counter()
        verified = hooks.dataset_patching(model, pairs, method="attribution", verify=10, **sweep)
        seconds = time.perf_counter() - start
        ran = ~verified.patched.isnan()
        found = (verified.patched[ran] - patched.corrupt_metric).abs().sum()
        best = (patched.grid - patched.corrupt_metric).abs().flatten().sort(descending=True).values[:10].sum()
        print(f"{'':10} verify 10: {seconds:.3f} s, their patched effects {float(found / best):.0%} of patching's top "
              f"10, the estimates off by up to {float((verified.grid - verified.patched)[ran].abs().max()):.2f}, the "
              f"patched values within {float((verified.patched - patched.grid)[ran].abs().max()):.1e} of the sweep's")


def timed(runs: dict[str, Callable[[], Any]], repeats: int, device: torch.device
          ) -> tuple[dict[str, float], dict[str, Any]]:
    """Each run's median seconds over ``repeats`` rounds, taking turns after a warm-up round, and its last result."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, Any] = {}
    for _ in range(repeats + 1):
        for name, run in runs.items():
            synchronize(device)
            start = time.perf_counter()
            results[name] = run()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}, results

if __name__ == "__main__":
    main()
