"""Quantized matmul benchmark: ``workbench.kernels.linear`` vs dequantize-then-matmul vs a dense matmul.

    python bench/kernels.py --device cuda [--formats Q4_K,Q6_K] [--shapes small|8b|8b-decode|all] [--batches 1,8]
                            [--quick] [--sweep] [--numerics exact|llamacpp] [--in-l2]

For each format, weight shape N x K and batch M it prints the time of ``linear`` (and the kernel that
``select_kernel`` picked), of dequantizing the weight and multiplying, and of a dense matmul on an
unquantized weight (bfloat16 on CUDA, float32 on CPU), with the two ratios. On CUDA it also prints the
bandwidth ``linear`` achieves (packed weight bytes + activation bytes read, over its time) as a share
of a device-to-device copy measured in the same run, and the *read floor*: the time of a kernel that only
reads as many bytes as the packed weight (``read_floor.py``), with ``linear``'s speed as a share of it.
A 1 GiB copy hides the launch, first-load latency and tail that a 10 MB read cannot, so on small weights
the floor, not the copy, is the ceiling a GEMV can reach.

``--in-l2`` (CUDA) also times ``linear`` and the read floor with the weight already in L2 (one weight called 20
times in the graph). A kernel cannot read its weight from DRAM faster than from L2, so ``linear``'s time in L2
bounds from below what any overlap of its loads and arithmetic could give it.

CUDA times are medians over replays of a CUDA graph that runs the call once on each of enough
weight copies to overflow L2, so launch gaps and cache-resident weights do not flatter the numbers.
``--sweep`` also times the Triton kernels under a few tile configurations. ``--numerics llamacpp`` runs
``linear`` in llama.cpp numerics (its time then includes quantizing the activations; formats without such a
kernel warn and run exactly).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import workbench.kernels as wk
from common import copy_bandwidth, cuda_seconds
from workbench.kernels import QuantTensor
from workbench.synthetic import random_matrix

SHAPES = {
    "small": [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)],  # the embedded model, N x K
    "8b": [(4096, 4096), (14336, 4096), (4096, 14336)],  # Llama-3-8B
}
# what an 8B decode step multiplies: fused q/k/v, o, fused gate/up, down, the unembedding
SHAPES["8b-decode"] = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
SHAPES["all"] = SHAPES["small"] + SHAPES["8b"]
BATCHES = (1, 8, 128, 512)
# every quantized GGUF format (each has kernels of its own on both devices); FP8_ROW and FP8_BLOCK on request
FORMATS = tuple(name for name, fmt in wk.FORMATS.items() if fmt.block_size > 1 and fmt.ggml_type is not None)


def cpu_seconds(call: Callable[[], object], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Timer:
    """Times a call on weight copies (CUDA: enough to overflow L2) or directly (CPU)."""

    def __init__(self, device: str, quick: bool):
        self.device = device
        self.repeats = 5 if quick else 15
        self.l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0

    def copies(self, weight_bytes: int) -> int:
        return 1 if self.device == "cpu" else min(512, max(2, -(-3 * self.l2_bytes // weight_bytes)))

    def seconds(self, make_weight_copy: Callable[[], object], weight_bytes: int, run: Callable[[object], object],
                max_copies: int = 512) -> float:
        weights = [make_weight_copy() for _ in range(min(max_copies, self.copies(weight_bytes)))]
        if self.device == "cpu":
            return cpu_seconds(lambda: run(weights[0]), self.repeats)
        return cuda_seconds([lambda w=w: run(w) for w in weights], self.repeats)

    def seconds_in_l2(self, weight: object, run: Callable[[object], object]) -> float:
        """CUDA: the time of ``run(weight)`` with ``weight`` in L2 (called 20 times; all but the first find it there)."""
        return cuda_seconds([lambda: run(weight)] * 20, self.repeats)


def sweep(w: QuantTensor, x: torch.Tensor, timer: Timer) -> None:
    """Time the Triton kernels under other tile configurations and print them, best first."""
    from workbench.kernels.triton import (
        GEMV_MAX_ROWS, GemmConfig, GemvConfig, Int8GemmConfig, MmaConfig, dequant_matmul, gemm, gemm_llamacpp, gemv,
        gemv_llamacpp, mma_gemm,
    )
    from workbench.kernels.triton.matmul import gemv_units

    m = x.shape[0]
    name = wk.select_kernel(x, w).name
    llamacpp = "llamacpp" in name
    if llamacpp and "gemm" in name:
        configs = [
            Int8GemmConfig(block_m, block_n, warps, stages)
            for block_m, block_n, warps, stages in [
                (16, 32, 4, 2), (16, 64, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
                (128, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3),
            ]
            if block_m <= max(16, 2 * m)
        ]
        kernel = gemm_llamacpp
    elif "mma" in name:  # warps per 16 weight rows, each over its share of K: super-blocks, or 1-4 pairs of blocks
        pairs = (1,) if w.fmt.block_size == 256 else (1, 2, 4)
        configs = [MmaConfig(warps, pair) for warps in (1, 2, 4, 8, 16) for pair in pairs
                   if warps <= w.shape[1] // MmaConfig(warps, pair).step_values(w.fmt.name)]
        kernel = mma_gemm
    elif "gemv" in name:
        units = gemv_units(w.shape[1], w.fmt.name, llamacpp)
        # block_u units of block_n rows per step: at least one (row, unit) pair per thread, at most 16; exact
        # numerics also take block_m rows of activations per program (up to 4, and no more than M rounds up to)
        configs = [
            GemvConfig(block_n, warps, block_u, block_m)
            for block_m in ((1,) if llamacpp else (1, 2, 4)) if block_m < 2 * m
            for block_n in (1, 2, 4, 8, 16) for warps in (1, 2, 4, 8) for block_u in (16, 32, 64, 128, 256)
            if block_u <= max(32, units) and 32 * warps <= block_n * block_u <= 16 * 32 * warps
            and block_m * block_n <= 16
        ]
        kernel = gemv_llamacpp if llamacpp else gemv
    elif m <= 16:  # batched decode: K split over programs
        configs = [
            GemmConfig(8 if m <= 8 else 16, block_n, block_u, warps, stages, split_k=split_k)
            for block_n, block_u, warps, stages in [(64, 4, 4, 1), (64, 8, 4, 1), (128, 4, 8, 1), (64, 4, 4, 2)]
            for split_k in (1, 2, 4, 8, 16)
        ]
        kernel = gemm
    else:  # up to 64 rows the default tiles split K too (gemm_config)
        configs = [
            GemmConfig(block_m, block_n, block_u, warps, stages, split_k=split_k)
            for block_m, block_n, block_u, warps, stages in [
                (32, 64, 8, 4, 3), (64, 32, 8, 4, 3), (64, 64, 4, 4, 3), (64, 128, 4, 8, 3), (128, 32, 8, 8, 2),
                (128, 64, 8, 8, 2), (128, 64, 4, 8, 3), (128, 128, 4, 8, 2), (256, 64, 4, 8, 2),
            ]
            if block_m <= 2 * m
            for split_k in ((1, 2, 4, 8) if m <= 64 else (1,))
        ]
        kernel = gemm
    results = []
    for config in configs:
        try:
            seconds = timer.seconds(lambda: QuantTensor(w.data.clone(), w.fmt, w.shape), w.nbytes,
                                    lambda ww, c=config: kernel(x, ww, c))
        except Exception as err:  # a config the compiler rejects (too many registers, shared memory)
            print(f"      sweep {config}: failed ({type(err).__name__})")
            continue
        results.append((seconds, config))
    if m > 1:  # the other many-row paths, in their default tilings
        if not llamacpp:
            others = [(dequant_matmul, "dequantize (triton) + cuBLAS")]
            if kernel is not gemm:
                others.append((gemm, "the fused GEMM"))
            if kernel is not gemv and m <= GEMV_MAX_ROWS:
                others.append((gemv, "the GEMV"))
        elif kernel is gemm_llamacpp:
            others = [(gemv_llamacpp, "a llama.cpp-numerics GEMV pass per row")]
        else:
            others = [(gemm_llamacpp, "the llama.cpp-numerics int8 GEMM")]
        for other, label in others:
            seconds = timer.seconds(lambda: QuantTensor(w.data.clone(), w.fmt, w.shape), w.nbytes,
                                    lambda ww, other=other: other(x, ww))
            results.append((seconds, label))
    for seconds, config in sorted(results, key=lambda r: r[0])[:8]:
        print(f"      sweep {seconds * 1e6:9.1f} us  {config}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--formats", default=None,
                        help="comma-separated, e.g. Q4_K,Q6_K (default: every quantized format)")
    parser.add_argument("--shapes", choices=tuple(SHAPES), default=None, help="default: all on CUDA, small on CPU")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, M = 1 and 128 only")
    parser.add_argument("--batches", default=None, help="comma-separated M values (default 1,8,128,512)")
    parser.add_argument("--sweep", action="store_true", help="also time other Triton tile configurations")
    parser.add_argument("--numerics", choices=wk.NUMERICS, default="exact", help="what linear computes")
    parser.add_argument("--in-l2", action="store_true",
                        help="CUDA: also time linear and the read floor with the weight already in L2")
    args = parser.parse_args(argv)
    wk.set_numerics(args.numerics)

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if args.in_l2 and device != "cuda":
        parser.error("--in-l2 times CUDA kernels")

    formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()] if args.formats else FORMATS
    shapes = SHAPES[args.shapes or ("all" if device == "cuda" else "small")]
    batches = [int(m) for m in args.batches.split(",")] if args.batches else (1, 128) if args.quick else BATCHES
    timer = Timer(device, args.quick)
    act_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dense_name = "bf16" if device == "cuda" else "fp32"
    torch.manual_seed(0)

    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"activations {act_dtype}; dense baseline {dense_name}; numerics {args.numerics}")
    copy_bw = None
    if device == "cuda":
        copy_bw = copy_bandwidth()
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write); L2 {timer.l2_bytes >> 20} MiB")
    header = (f"{'format':6} {'N x K':>12} {'M':>4}  {'kernel':28} {'linear us':>10} {'deq+mm us':>10} "
              f"{'dense us':>10} {'deq+mm/lin':>10} {'dense/lin':>10}")
    if device == "cuda":
        header += f" {'lin GB/s':>9} {'% copy':>7} {'floor us':>9} {'% floor':>8}"
    if args.in_l2:
        header += f" {'L2 lin us':>9} {'L2 floor':>9}"
    print(header)

    for fmt in formats:
        for n, k in shapes:
            if k % wk.get_format(fmt).block_size:
                print(f"{fmt:6} {f'{n}x{k}':>12}    -  skipped: K is not a multiple of the {fmt} block")
                continue
            bench_shape(fmt, n, k, batches, timer, act_dtype, copy_bw, args.sweep, args.in_l2)
            if device == "cuda":
                torch.cuda.empty_cache()
    return 0


def read_floor_seconds(nbytes: int, timer: Timer, in_l2: bool = False) -> float:
    """Time of reading ``nbytes`` and nothing else, on as many buffer copies as a weight of that size gets (or, with
    ``in_l2``, on one buffer that stays in L2)."""
    from read_floor import BLOCK, read_all

    words = -(-nbytes // 4)
    partials = torch.empty(-(-words // BLOCK), dtype=torch.int32, device="cuda")

    def buffer() -> torch.Tensor:
        return torch.zeros(words, dtype=torch.int32, device="cuda")

    def read(words_buffer: torch.Tensor) -> None:
        read_all(words_buffer, partials)

    return timer.seconds_in_l2(buffer(), read) if in_l2 else timer.seconds(buffer, nbytes, read)


def bench_shape(fmt: str, n: int, k: int, batches, timer: Timer, act_dtype: torch.dtype, copy_bw: float | None,
                with_sweep: bool, in_l2: bool = False) -> None:
    """Print one line per batch size for an N x K weight in ``fmt``."""
    device = timer.device
    w = random_matrix(n, k, fmt, device=device, distinct_rows=256)  # quantizing is slow on CPU: tile 256 rows
    dense = torch.randn(n, k, device=device).to(act_dtype)
    floor_s = read_floor_seconds(w.nbytes, timer) if device == "cuda" else None
    floor_l2_s = read_floor_seconds(w.nbytes, timer, in_l2=True) if in_l2 else None
    for m in batches:
        x = torch.randn(m, k, device=device).to(act_dtype)
        kernel = wk.select_kernel(x, w)
        linear_s = timer.seconds(lambda: QuantTensor(w.data.clone(), w.fmt, w.shape), w.nbytes,
                                 lambda ww: wk.linear(x, ww))
        dequant_s = timer.seconds(lambda: w, w.nbytes, lambda ww: x @ ww.dequantize(x.dtype).T, max_copies=2)
        dense_s = timer.seconds(lambda: dense.clone(), dense.numel() * dense.element_size(), lambda dd: F.linear(x, dd))
        line = (f"{fmt:6} {f'{n}x{k}':>12} {m:>4}  {kernel.name:28} {linear_s * 1e6:10.1f} {dequant_s * 1e6:10.1f} "
                f"{dense_s * 1e6:10.1f} {dequant_s / linear_s:10.2f} {dense_s / linear_s:10.2f}")
        if copy_bw is not None:
            read_bw = (w.nbytes + x.numel() * x.element_size()) / linear_s
            line += f" {read_bw / 1e9:9.0f} {100 * read_bw / copy_bw:6.0f}%"
            line += f" {floor_s * 1e6:9.1f} {100 * floor_s / linear_s:7.0f}%"
        if in_l2:
            line += f" {timer.seconds_in_l2(w, lambda ww: wk.linear(x, ww)) * 1e6:9.1f} {floor_l2_s * 1e6:9.1f}"
        print(line, flush=True)
        if with_sweep and device == "cuda" and kernel.name.startswith("triton"):
            sweep(w, x, timer)


if __name__ == "__main__":
    sys.exit(main())
