"""Attribution patching against activation patching on the same sweeps: seconds of each (taking turns, median of
``--repeats``) and how well the first-order estimates track the patched runs (Pearson correlation over the cells, and
the cell where they differ most). The README's prompts by default.

    python bench/attribution.py                        # embedded model, CPU, 2 threads
    python bench/attribution.py --device cuda --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import workbench
from decode import synchronize
from workbench import hooks

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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = workbench.load(args.model, device=args.device)
    print(f"torch {torch.__version__}, {model.device}, threads {args.threads}")
    print(f"{'sweep':10} {'cells':>6} {'patching s':>11} {'attribution s':>14} {'speed-up':>9} {'correlation':>12}  "
          "largest difference (cell: patched / estimated)")
    for name, (hook, over) in SWEEPS.items():
        times: dict[str, list[float]] = {"patching": [], "attribution": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            for method, sweep in (("patching", hooks.patching_sweep), ("attribution", hooks.attribution_patching)):
                extra = {"progress": False} if method == "patching" else {}
                synchronize(model.device)
                start = time.perf_counter()
                result = sweep(model, args.clean, args.corrupt, hook=hook, over=over, **extra)
                synchronize(model.device)
                times[method].append(time.perf_counter() - start)
                if method == "patching":
                    patched = result
                else:
                    estimated = result
        a, b = patched.grid.flatten(), estimated.grid.flatten()
        worst = int((a - b).abs().argmax())
        cell = [labels[i] for labels, i in zip(patched.labels.values(), torch.unravel_index(
            torch.tensor(worst), patched.grid.shape))]
        seconds = {method: statistics.median(t[1:]) for method, t in times.items()}
        correlation = torch.corrcoef(torch.stack([a, b]))[0, 1]
        print(f"{name:10} {a.numel():>6} {seconds['patching']:>11.3f} {seconds['attribution']:>14.3f} "
              f"{seconds['patching'] / seconds['attribution']:>8.2f}x {correlation:>12.2f}"
              f"  {' '.join(cell)}: {a[worst]:.2f} / {b[worst]:.2f}")


if __name__ == "__main__":
    main()
