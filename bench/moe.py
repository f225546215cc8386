"""Decode tokens/s of random-weight mixture-of-experts models, ours vs llama.cpp's ``llama-bench`` on the same GGUF.

    python bench/moe.py --device cuda --shape mixtral-8x7b --llama-bench ~/llama.cpp/build/bin/llama-bench
    python bench/moe.py --device cuda --shape qwen3-30b-a3b --llama-bench ...
    python bench/moe.py --threads 2 --shape mixtral-8x7b --layers 6 --llama-bench ...   # CPU: fewer layers fit 24 GB
    python bench/moe.py --threads 2 --shape qwen3-30b-a3b --layers 8 --llama-cpp-python  # CPU, no llama-bench build
    python bench/moe.py --threads 2 --layers 6 --llama-cpp-python --kernels-from REV      # + REV's CPU kernels

Each model is built by ``workbench.synthetic`` (256 distinct rows per matrix, tiled: quantizing is slow), written as
a GGUF (``--gguf-dir``; an existing file of the same name is reused), loaded from that file by both, and timed in
one run, so the ratio is side by side. ``--layers`` keeps the shape of every layer and cuts their number (decode time
is proportional to it), for machines where the whole model does not fit. llama-bench runs ``-p 0 -n DECODE``
(``-ngl 99`` on CUDA) and reports its mean tokens/s. Ours is the production decode: on CUDA the built step (compiled,
captured as a CUDA graph; the experts by ``linear_by_expert``, no host sync), waited for before the timing; on the
CPU the eager forward. On the CPU the decodes take turns run by run in this process, so that a machine shared with
other work does not skew one side: ours, llama.cpp's through llama-cpp-python (``--llama-cpp-python``), and with
``--kernels-from REV`` the same decode with the C++ kernels built from git revision REV's source (a before/after of a
kernel change; REV's source must define every op the current Python calls).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

import workbench
from common import kernels_from, using_kernels
from decode import llama_bench, ours, print_table, synthetic_gguf
from workbench.parity import load_llamacpp_model, require_llama_cpp

SHAPES = {
    # Mixtral-8x7B: llama with 8 experts of 14336, 2 per token
    "mixtral-8x7b": ("llama", dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_mlp=14336, vocab_size=32000,
                                   n_experts=8, n_experts_used=2, tied_embeddings=False)),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token, 128-wide heads with q/k norms
    "qwen3-30b-a3b": ("qwen3moe", dict(n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, d_head=128, d_mlp=6144,
                                       d_expert=768, vocab_size=151936, n_experts=128, n_experts_used=8,
                                       tied_embeddings=False)),
    # a few MB, to check the script end to end
    "smoke": ("qwen3moe", dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_mlp=512, d_expert=256,
                               n_experts=8, n_experts_used=2, tied_embeddings=False)),
}


def build_gguf(shape: str, fmt: str, layers: int | None, folder: Path) -> Path:
    arch, dims = SHAPES[shape]
    dims = {**dims, "n_layers": layers or dims["n_layers"]}
    return synthetic_gguf(arch, dims, fmt, folder / f"{shape}-{dims['n_layers']}l-{fmt}.gguf")


def active_bytes(model: workbench.Model) -> int:
    """Bytes one decode step reads: every matrix but the embedding, and of each block's experts only the chosen."""
    total = 0
    moe = model.config.moe
    for name, w in model.runner.weights.named_matrices():
        if name == "embed":
            continue
        share = moe.n_experts_used / moe.n_experts if name.split(".")[-1] in ("gate", "up", "down") else 1
        total += int(w.nbytes * share)
    return total


def llama_cpp_python(path: Path, decode: int, threads: int) -> tuple[Callable[[], float], Callable[[], None]]:
    """llama.cpp's CPU decode through llama-cpp-python (the ``reference`` extra), as ``llama-bench -p 0 -n DECODE``
    measures it: one token a ``llama_decode`` from an empty cache. Returns a function that runs it once and gives its
    tokens/s, and one that frees the model. Without ggml's extra CPU buffer types (their AMX layout crashes
    llama-cpp-python 0.3.36 on the development machine; ``workbench.parity`` loads the same way), so its repacked weight
    layouts are not used."""
    llama_cpp = require_llama_cpp()
    model = load_llamacpp_model(path)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = decode + 16
    params.n_threads = params.n_threads_batch = threads
    context = llama_cpp.llama_init_from_model(model, params)
    token = (llama_cpp.llama_token * 1)(1)

    def run() -> float:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)
        start = time.perf_counter()
        for _ in range(decode):
            if llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(token, 1)) != 0:
                raise RuntimeError("llama_decode failed")
        return decode / (time.perf_counter() - start)

    def close() -> None:
        llama_cpp.llama_free(context)
        llama_cpp.llama_model_free(model)

    return run, close


def alternating(runs: dict[str, Callable[[], float]], decode: int, repeats: int) -> dict[str, dict[str, float]]:
    """Decode tokens/s of each run (column name: a function that decodes once and gives its tokens/s), the runs taking
    turns round by round, so that a shared machine's changing load falls on all of them alike; the median of
    ``repeats`` rounds after a warm-up round."""
    rates = {name: [] for name in runs}
    for _ in range(repeats + 1):
        for name, run in runs.items():
            rates[name].append(run())
    return {name: {f"decode {decode}": statistics.median(values[1:])} for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["mixtral-8x7b", "qwen3-30b-a3b"])
    parser.add_argument("--format", default="Q4_K", help="a format or a mix (Q4_K_M, ...)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the same shape (CPU: memory)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (built with CUDA on GPU)")
    parser.add_argument("--numerics", choices=workbench.kernels.NUMERICS, default="exact",
                        help="what our quantized matmuls compute (llamacpp: Q8 activations, integer dots, as llama.cpp)")
    parser.add_argument("--llama-cpp-python", action="store_true",
                        help="on the CPU, time llama.cpp through llama-cpp-python instead of llama-bench")
    parser.add_argument("--kernels-from", metavar="REV", default=None,
                        help="on the CPU, also decode with the C++ kernels of git revision REV, alternating")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    workbench.kernels.set_numerics(args.numerics)
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, numerics {args.numerics}")
    for shape in args.shape:
        path = build_gguf(shape, args.format, args.layers, args.gguf_dir)
        model = workbench.load(path, device=args.device, dtype=args.dtype)
        step = active_bytes(model)
        print(f"{path.name}: resident weights {model.runner.weights.nbytes / 2**30:.2f} GiB, "
              f"{step / 2**30:.2f} GiB read per decoded token")
        built = model.runner.device.type == "cuda"  # the production decode step, built before it is timed
        load = os.getloadavg()[0]  # other work on the machine skews the CPU figures: printed with them
        if built:
            columns = {"workbench": ours(model, [], args.decode, args.repeats, compiled=True)}
        else:  # on the CPU every decode takes its turn, round by round
            runs = {"workbench": lambda: list(ours(model, [], args.decode, 1).values())[0]}
            if args.kernels_from:
                ops, ours_now = kernels_from(args.kernels_from), runs["workbench"]

                def ours_with_old_kernels() -> float:
                    with using_kernels(ops):
                        return ours_now()
                runs[f"kernels of {args.kernels_from}"] = ours_with_old_kernels
            close = lambda: None
            if args.llama_cpp_python and not args.llama_bench:  # llama-bench, where given, runs after
                runs["llama.cpp"], close = llama_cpp_python(path, args.decode, args.threads)
            try:
                columns = alternating(runs, args.decode, args.repeats)
            finally:
                close()
        del model
        if args.llama_bench:
            columns["llama.cpp"] = llama_bench(args.llama_bench, path, [], args.decode, args.threads, args.device,
                                               args.repeats)
        reference = "llama.cpp" if "llama.cpp" in columns else None
        print_table(f"{path.name} on {args.device}, load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} "
                    f"at the end", columns, reference)


if __name__ == "__main__":
    main()
