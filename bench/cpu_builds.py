"""The exact CPU kernels of other builds against the current one, one quantized matmul, by turns in one process.

    python bench/cpu_builds.py --builds main,variant.cpp [--formats Q4_K,Q4_0] [--shape 2048x2048] [--batch 1]
                               [--threads 1] [--repeats 21]
    python bench/cpu_builds.py --paths [...]    # the current build's panels against its fused dot products

With ``--paths`` it times the current build's two exact paths on the same call instead, the dequantized panels (the
"current" row) against the fused dot products: what ``cpu.panel_min_batch`` chooses between.

Each build is a git revision (its ``kernels/csrc/cpu_kernels.cpp``) or a path to a ``.cpp``, compiled beside the
current kernels (as ``bench/moe.py --kernels-from``). For each format it prints the median time of ``linear_exact`` on
a random ``rows x cols`` weight for each build (the builds alternating call by call, so that a shared machine's load
falls on all of them alike), the speed against the current build, multiply-adds a second, the largest error against
a float64 product with the dequantized weight, and whether a build's results are bit-identical to the current ones.
``--numerics llamacpp`` times ``linear_llamacpp`` (llama.cpp's integer dot products) the same way.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from common import kernels_from
from workbench.kernels import cpu
from workbench.synthetic import random_matrix


def build(spec: str):
    """The op namespace of a build: a revision's source, or a .cpp file's."""
    path = Path(spec)
    if path.suffix == ".cpp" and path.is_file():
        tag = "".join(c if c.isalnum() else "_" for c in path.stem)
        return cpu._build_extension(cpu._native_isa(), path.resolve(), f"workbench_cpu_kernels_file_{tag}")
    return kernels_from(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builds", default="", help="comma-separated git revisions or .cpp paths")
    parser.add_argument("--paths", action="store_true", help="the current build's panels against its fused dots")
    parser.add_argument("--formats", default="Q4_K")
    parser.add_argument("--shape", default="2048x2048", help="rows x cols of the weight")
    parser.add_argument("--batch", type=int, default=1, help="rows of x")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--numerics", choices=("exact", "llamacpp"), default="exact",
                        help="llamacpp: time linear_llamacpp (activations quantized, integer dot products) instead")
    args = parser.parse_args()
    if args.numerics == "llamacpp" and args.paths:
        parser.error("--paths compares the exact kernels' two paths")
    torch.set_num_threads(args.threads)
    rows, cols = map(int, args.shape.split("x"))
    # name: (ops, the rows of x from which linear_exact takes panels)
    builds = {"current": (cpu.extension(), 1 if args.paths else cpu.PANEL_MIN_BATCH)}
    if args.paths:
        builds["fused dot products"] = (cpu.extension(), args.batch + 1)
    builds.update({spec: (build(spec), cpu.PANEL_MIN_BATCH) for spec in args.builds.split(",") if spec})
    generator = torch.Generator().manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.1f}, {args.threads} thread(s), {rows}x{cols}, batch {args.batch}")
    for fmt in args.formats.split(","):
        w = random_matrix(rows, cols, fmt, distinct_rows=256, generator=generator)
        x = torch.randn(args.batch, cols, generator=generator)
        ref = x.double() @ w.dequantize().double().T

        def call(ops, panel_min_batch):
            if args.numerics == "llamacpp":
                return ops.linear_llamacpp(x, [w.data], w.fmt.ggml_type, [rows], cols)
            return ops.linear_exact(x, [w.data], [w.fmt.ggml_type], [rows], cols, panel_min_batch)

        outs = {name: call(*entry) for name, entry in builds.items()}
        times = {name: [] for name in builds}
        for _ in range(args.repeats):
            for name, entry in builds.items():
                start = time.perf_counter()
                for _ in range(5):
                    call(*entry)
                times[name].append((time.perf_counter() - start) / 5)
        current = statistics.median(times["current"])
        for name in builds:
            seconds = statistics.median(times[name])
            error = (outs[name].double() - ref).abs().max().item()
            print(f"{fmt} {name:>24}: {seconds * 1e3:8.3f} ms  {current / seconds:5.2f}x  "
                  f"{rows * cols * args.batch / seconds / 1e9:5.1f} GMAC/s  max error {error:.2e}  "
                  f"bit-identical {torch.equal(outs[name], outs['current'])}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
