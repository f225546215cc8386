"""FP8 weights on CUDA: the FP8 GEMMs against bf16 on Llama-3-8B's layer shapes.

    cd bench && python fp8.py [--shapes 8b|8b-decode] [--batches 1,16,128,512,2048] [--quick]

For each weight shape N x K, batch M and FP8 format it prints the time of ``torch._scaled_mm`` (``fp8-scaled-mm``),
of the Triton GEMM (``fp8-triton-gemm``) and of exact numerics (``fp8-dequant-matmul``: dequantize, then cuBLAS), each
with its activation quantization, beside a bf16 ``F.linear`` on a dense weight of the same shape, and the ratios
bf16 / FP8 (above 1: FP8 is faster). Times are medians over replays of a CUDA graph that runs the call on enough
weight copies to overflow L2 (``kernels.Timer``), so each call reads its weight from memory, as a decode step does.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kernels import SHAPES, Timer
from workbench.kernels import QuantTensor, fp8
from workbench.synthetic import random_matrix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=("8b", "8b-decode"), default="8b")
    parser.add_argument("--batches", default="1,16,128,512,2048", help="comma-separated M values")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    timer = Timer("cuda", args.quick)
    batches = [int(m) for m in args.batches.split(",")]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16 activations; "
          f"capability {torch.cuda.get_device_capability()}")
    paths = {"scaled_mm": fp8.SCALED_MM, "triton": fp8.TRITON_GEMM, "exact": fp8.DEQUANT_MATMUL}
    print(f"{'format':9} {'N x K':>11} {'M':>5} {'bf16 us':>9}" + "".join(f" {name + ' us':>13} {'bf16/' + name:>14}"
                                                                     for name in paths))
    torch.manual_seed(0)
    for n, k in SHAPES[args.shapes]:
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for fmt in ("FP8_ROW", "FP8_BLOCK"):
            w = random_matrix(n, k, fmt, device="cuda", distinct_rows=256)
            for m in batches:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bf16_s = timer.seconds(lambda: dense.clone(), dense.numel() * 2, lambda d: F.linear(x, d))
                line = f"{fmt:9} {f'{n}x{k}':>11} {m:>5} {bf16_s * 1e6:9.1f}"
                for name, kernel in paths.items():
                    if kernel is None or not kernel.supports(x, w):
                        line += f" {'-':>13} {'-':>14}"
                        continue
                    seconds = timer.seconds(lambda: QuantTensor(w.data.clone(), w.fmt, w.shape), w.nbytes,
                                            lambda ww, kernel=kernel: kernel.run(x, ww))
                    line += f" {seconds * 1e6:13.1f} {bf16_s / seconds:14.2f}"
                print(line, flush=True)
            del w
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
