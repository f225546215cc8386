"""The logit lens's top-k: the fused kernel (``workbench.kernels.lens``) against the unfused paths, on the rows of
``bench/vs_transformerlens.py`` task (d) (every layer's final-normed ``resid_post`` at every position of 64 prompts).

    python bench/lens_kernel.py [--device cuda|cpu] [--model PATH] [--dtype float32] [--k 10] [--sweep]
    python bench/lens_kernel.py --groups 1,3,5,10,30    # logit_lens_batch whole, per LENS_GROUP

Times, side by side in one run (on CUDA CUDA-graph replays, ``common.cuda_seconds``; on the CPU the median of 2 runs
on 2 threads), the top-k probabilities and ids of all rows through the embedded model's unembedding:
- ``softmax+topk``: what the lens did before the fused kernel: ``linear`` on 1,024 rows at a time, softmax, topk;
- ``chunked``: ``top_k_probs``'s path off CUDA (the weight dequantized once, a dense matmul per 1,024 rows, topk,
  softmax);
- ``fused`` (CUDA): ``top_k_probs`` (the weight dequantized and split once, the fused kernel, the merge of its
  vocabulary slices);
- with ``--sweep``, the fused kernel alone (the weight split once) at each of ``LAUNCH_CHOICES`` and precision.
With ``--groups`` it times ``probes.logit_lens_batch`` on those prompts instead (median and min of 7 calls), the lens
launched every ``probes.lens.LENS_GROUP`` layers as the forward passes them, for each group size given (CUDA; on
the CPU the lens is one call after the forward whatever the size).
and the accuracy of each fused variant on 512 rows against softmax in float64: the most relative error of the top-k
probabilities, and the rows whose ids differ where the float64 probabilities do not tie.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from common import cuda_seconds
import workbench
from workbench import probes
from workbench.kernels import lens as lens_ops
from workbench.kernels import linear
from workbench.probes import load_dataset


# (rows, columns, depth) of a tile, warps, stages, lanes a tile folds onto: the launch choices ``--sweep`` times at
# each precision
LAUNCH_CHOICES = [(128, 128, 32, 8, 3, 32), (128, 128, 32, 8, 3, 16), (128, 128, 32, 8, 3, 128),
                  (128, 128, 64, 8, 3, 32), (128, 128, 64, 8, 2, 32), (128, 256, 32, 8, 2, 32),
                  (128, 64, 32, 4, 4, 32), (64, 128, 32, 4, 3, 32), (64, 256, 32, 8, 3, 32), (128, 128, 32, 4, 3, 32)]


def before(rows: torch.Tensor, w, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = zip(*(linear(chunk, w).float().softmax(-1).topk(k) for chunk in rows.split(lens_ops.ROWS_PER_CHUNK)))
    return torch.cat(values), torch.cat(ids)


def chunked(rows: torch.Tensor, w, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    fuses, lens_ops.fuses = lens_ops.fuses, lambda x, k: False
    try:
        return lens_ops.top_k_probs(rows, w, k)
    finally:
        lens_ops.fuses = fuses


def cpu_seconds(run, rows: torch.Tensor) -> float:
    times = []
    for _ in range(2):
        start = time.perf_counter()
        run(rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def accuracy(probs: torch.Tensor, ids: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Most relative error of the probabilities, and rows whose ids differ from float64's where it has no tie."""
    k = ids.shape[1]
    top = expected.topk(k + 1)
    chosen = expected.gather(1, ids.long())
    error = float(((probs.double() - chosen) / chosen).abs().max())
    gaps = (top.values[:, :-1] - top.values[:, 1:]) > 1e-12 * top.values[:, :1]
    untied = torch.nn.functional.pad(gaps, (1, 0), value=True)[:, :k] & gaps[:, :k]
    wrong = int(((ids.long() != top.indices[:, :k]) & untied).any(1).sum())
    return error, wrong


def time_groups(model: workbench.Model, ids: list[list[int]], groups: list[int], k: int) -> None:
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for group in groups:
        probes.lens.LENS_GROUP = group
        seconds = []
        for i in range(9):
            sync()
            started = time.perf_counter()
            probes.logit_lens_batch(model, ids, k=k)
            sync()
            seconds.append(time.perf_counter() - started)
        seconds = seconds[2:]  # two warm-ups
        median, least = statistics.median(seconds) * 1e3, min(seconds) * 1e3
        print(f"LENS_GROUP={group:3d}: {median:7.1f} ms median, {least:7.1f} min")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--sweep", action="store_true", help="also time the fused kernel's launch choices")
    parser.add_argument("--groups", default=None, help="time logit_lens_batch with these LENS_GROUP sizes (1,5,...)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    model = workbench.load(args.model, device=args.device, dtype=args.dtype)
    texts = load_dataset("sentiment").prompts
    texts = [texts[i % len(texts)] for i in range(args.prompts)]
    if args.groups:
        return time_groups(model, [model.to_ids(t) for t in texts], [int(g) for g in args.groups.split(",")], args.k)
    lenses = probes.logit_lens_batch(model, texts, k=args.k)
    rows = torch.cat([lens.normed["resid_post"] for lens in lenses], dim=1)
    rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    w = model.runner.unembed
    dense = lens_ops.dense_weight(w, rows.dtype)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{device_name}, torch {torch.__version__}, {w.fmt.name} unembedding {tuple(w.shape)}, "
          f"{rows.shape[0]} rows of {rows.dtype}, k={args.k}")
    sample = rows[:512]
    expected = (sample.double() @ dense.double().T).to(rows.dtype).double().softmax(-1)

    variants = {"softmax+topk (before)": lambda x: before(x, w, args.k), "chunked": lambda x: chunked(x, w, args.k)}
    if args.device == "cuda":
        variants["fused (default)"] = lambda x: lens_ops.top_k_probs(x, w, args.k)
    if args.sweep and args.device == "cuda":
        from workbench.kernels.triton.lens import split, top_k_probs as fused_top_k_probs

        halves = {"fp16x3": split(dense), "tf32": None}
        for precision, (bm, bn, bk, warps, stages, fold) in itertools.product(halves, LAUNCH_CHOICES):
            options = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, fold=fold,
                           precision=precision, w_split=halves[precision])
            variants[f"fused {bm}x{bn}x{bk} w{warps} s{stages} fold {fold} {precision}"] = (
                lambda x, options=options: fused_top_k_probs(x, dense, args.k, **options))
    print(f"{'variant':58} {'ms':>8} {'max rel err':>12} {'rows off':>9}")
    for name, run in variants.items():
        try:
            seconds = cuda_seconds([lambda: run(rows)], repeats=5) if args.device == "cuda" else cpu_seconds(run, rows)
        except Exception as err:  # a launch choice past the device's resources
            print(f"{name:58} failed: {str(err).splitlines()[0][:60]}")
            continue
        error, wrong = accuracy(*run(sample), expected)
        print(f"{name:58} {seconds * 1e3:8.2f} {error:12.2e} {wrong:9d}")

if __name__ == "__main__":
    main()
