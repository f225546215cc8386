"""End-to-end prefill and decode tokens/s, ours vs llama.cpp (CPU) or quantized vs bf16 dense (CUDA).

    python bench/decode.py                                  # embedded model, 2 CPU threads, eager and compiled
                                                            # decode, vs llama.cpp if installed
    python bench/decode.py --device cuda --synthetic llama3-8b --formats Q4_K BF16 [--profile]
    python bench/decode.py --device cuda --synthetic llama3-8b --formats Q4_K_M --llama-bench PATH/llama-bench
                                                            # the same GGUF file through llama.cpp's llama-bench
    [--numerics llamacpp]                                   # llama.cpp numerics (Q8 activations, integer dots)
    python bench/decode.py --by-turns 6 --prefill 16 512 --decode 64 [--kernels-from REV]
                                                            # CPU eager decode and llama.cpp's by turns (and with
                                                            # the C++ kernels of git revision REV)
    python bench/decode.py --by-turns 4 --synthetic llama3-8b --layers 6 --formats Q3_K_M Q5_K_M --prefill 16
                                                            # the same on a GGUF file of random weights

Every figure in one table comes from the same run, so ratios are side by side.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

import workbench
from common import copy_bandwidth, kernels_from, using_kernels
from workbench import hooks
from workbench.generation import Sampling, build_decode_step, generate_tokens
from workbench.model import Model
from workbench.parity import INSTALL_HINT
from workbench.runner import Transformer
from workbench.synthetic import random_checkpoint, random_config, write_gguf

SHAPES = {
    # the embedded model's shape (in Q4_1, its timings without its file)
    "smollm2-135m": dict(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_mlp=1536, vocab_size=49152,
                         tied_embeddings=True),
    "llama3-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_mlp=14336, vocab_size=128256,
                      tied_embeddings=False),
    # for a model split over several GPUs (bench/multi_gpu.py --big)
    "llama3-405b": dict(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_mlp=53248, vocab_size=128256,
                        tied_embeddings=False),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_of(run: Callable[[], float], repeats: int) -> float:
    """Median of the seconds ``run`` reports over ``repeats`` runs after one warm-up."""
    run()
    return statistics.median(run() for _ in range(repeats))


def ours(model: Model, prefill: list[int], decode: int, repeats: int, compiled: bool | None = None) -> dict[str, float]:
    runner, vocab = model.runner, model.config.vocab_size
    if compiled is None and runner.device.type == "cuda":
        compiled = True  # production decode: the built step (the default answers with an eager graph until it is in)
    out = {}
    for n in prefill:
        ids = torch.randint(0, vocab, (n,))
        out[f"prefill {n}"] = n / timed(lambda: runner.forward(ids, last_logits_only=True), runner.device, repeats)
    prompt = torch.randint(0, vocab, (8,)).tolist()

    def run_decode() -> float:
        return decode_seconds(runner, prompt, decode, compiled)

    if compiled:  # the first call builds the decode step
        start = time.perf_counter()
        run_decode()
        print(f"first generate_tokens call (compiles the decode step): {time.perf_counter() - start:.1f} s")
    out[f"decode {decode}"] = (decode - 1) / median_of(run_decode, repeats)
    return out


def decode_seconds(runner, prompt: list[int], decode: int, compiled: bool | None, hooks=None) -> float:
    """Seconds from the first new token (the prompt's prefill is done then) to the last: decode - 1 steps."""
    tokens = generate_tokens(runner, prompt, decode, Sampling(), stop_ids=set(), hooks=hooks, compiled=compiled)
    next(tokens)
    start = time.perf_counter()
    for _ in tokens:
        pass
    synchronize(runner.device)
    return time.perf_counter() - start


def llama_cpp_decode_seconds(llm, prompt: list[int], decode: int) -> float:
    """Seconds from the prompt's logits to the last token: decode - 1 steps, as ``decode_seconds`` times them."""
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(decode - 1):
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
    return time.perf_counter() - start


@contextlib.contextmanager
def one_block_a_call():
    """The eager CPU forward with each plain block whole but in a call of its own (as where hooks lie between every two
    blocks) instead of the blocks between two hooks in one ``layer_ops.blocks_exact`` call."""
    runs = Transformer._whole_run
    Transformer._whole_run = lambda *args: min(1, runs(*args))
    try:
        yield
    finally:
        Transformer._whole_run = runs


def decode_by_turns(model: Model, threads: int, prefill: list[int], decode: int, rounds: int,
                    kernels_of: str | None = None) -> None:
    """Eager decode after a prompt of each ``prefill`` length: the workbench's (runs of blocks, one block a call, and
    steered: a ``Steer`` on the middle block's output, which ends a run there; with ``kernels_of``, also with the C++
    kernels of that git revision) and llama.cpp's taking turns round by round, so that a shared machine's slow spells
    fall on all of them alike."""
    llm = load_llama_cpp(str(model.path), threads, max(prefill) + decode + 32)
    if llm is None:
        raise SystemExit(f"--by-turns times llama.cpp's decode too: {INSTALL_HINT}")
    old_kernels = kernels_from(kernels_of) if kernels_of else None
    direction = torch.randn(model.config.d_model)
    steer = hooks.Steer(f"blocks.{model.config.n_layers // 2}.hook_resid_post", direction / direction.norm(), scale=4.0)
    for n in prefill:
        prompt = torch.randint(0, model.config.vocab_size, (n,)).tolist()
        steering, _, _ = model._call_hooks([steer], None, n, n + decode, (), True)
        sides = {"workbench": (contextlib.nullcontext, None), "one block a call": (one_block_a_call, None),
                 "steered": (contextlib.nullcontext, steering)}
        if kernels_of:
            sides[f"kernels of {kernels_of}"] = (lambda: using_kernels(old_kernels), None)
        rates: dict[str, list[float]] = {label: [] for label in (*sides, "llama.cpp")}
        for round_ in range(rounds + 1):  # the first a warm-up
            for label, (mode, hooks_) in sides.items():
                with mode():
                    seconds = decode_seconds(model.runner, prompt, decode, compiled=False, hooks=hooks_)
                rates[label].append((decode - 1) / seconds)
            rates["llama.cpp"].append((decode - 1) / llama_cpp_decode_seconds(llm, prompt, decode))
        medians = {label: statistics.median(r[1:]) for label, r in rates.items()}
        print(f"prompt {n}, decode {decode}, {rounds} rounds by turns, tokens/s (median): " + ", ".join(
            f"{label} {m:.1f}" for label, m in medians.items())
            + f"; workbench / llama.cpp {medians['workbench'] / medians['llama.cpp']:.2f}x, steered / llama.cpp "
            f"{medians['steered'] / medians['llama.cpp']:.2f}x, workbench / one block a call "
            f"{medians['workbench'] / medians['one block a call']:.2f}x"
            + (f", workbench / kernels of {kernels_of} {medians['workbench'] / medians[f'kernels of {kernels_of}']:.2f}x"
               if kernels_of else ""))


def profile_decode_step(model: Model, top: int = 12) -> None:
    """GPU time of one captured decode step (replays back to back, no host in between) and its top kernels."""
    runner = model.runner
    cache = runner.new_static_cache(256)
    runner.forward(torch.randint(0, model.config.vocab_size, (8,)), cache=cache, last_logits_only=True)
    step = build_decode_step(runner, cache)
    replays = 64
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        step.run()
    end.record()
    end.synchronize()
    print(f"decode step on the GPU alone: {start.elapsed_time(end) / replays:.3f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step.run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60))


def load_llama_cpp(path: str, threads: int, n_ctx: int):
    """llama-cpp-python's model of the GGUF file at ``path`` (None where it is not installed)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from workbench.parity import without_extra_buffer_types

    without_extra_buffer_types()  # ggml's AMX buffer type crashes llama-cpp-python 0.3.36 on the development machine
    # a batch as long as the context: llama-cpp-python keeps the logits of n_batch positions, which the decode reads
    return llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)


def llama_cpp(path: str, threads: int, prefill: list[int], decode: int, repeats: int) -> dict[str, float] | None:
    llm = load_llama_cpp(path, threads, max(prefill + [decode + 16]) + 16)
    if llm is None:
        return None
    vocab = llm.n_vocab()
    out = {}
    for n in prefill:
        ids = torch.randint(0, vocab, (n,)).tolist()

        def run_prefill():
            llm.reset()
            llm.eval(ids)

        out[f"prefill {n}"] = n / timed(run_prefill, torch.device("cpu"), repeats)
    prompt = torch.randint(0, vocab, (8,)).tolist()
    out[f"decode {decode}"] = (decode - 1) / median_of(lambda: llama_cpp_decode_seconds(llm, prompt, decode), repeats)
    return out


def synthetic_model(shape: str, fmt: str, device: str, dtype: str | None, n_layers: int | None = None) -> Model:
    """A random-weight model of a real model's shape (256 distinct rows per matrix, tiled: quantizing is slow), with
    its first ``n_layers`` layers where given."""
    dims = SHAPES[shape] if n_layers is None else {**SHAPES[shape], "n_layers": n_layers}
    config = random_config("llama", n_ctx=4096, **dims)
    return Model(random_checkpoint(config, fmt, device=device, distinct_rows=256), device=device, dtype=dtype)


def synthetic_gguf(architecture: str, dims: dict, fmt: str, path: Path) -> Path:
    """``synthetic_model``'s weights written as a GGUF file at ``path`` (reused where it exists), for a run of
    llama.cpp and ours on the same file."""
    if not path.exists():
        config = random_config(architecture, n_ctx=4096, **dims)
        checkpoint = random_checkpoint(config, fmt, distinct_rows=256)
        print(f"writing {path} ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(path, config, checkpoint.weights, checkpoint.metadata)
    return path


def llama_bench(binary: str, path: Path, prefill: list[int], decode: int, threads: int, device: str,
                repeats: int) -> dict[str, float]:
    """llama.cpp's ``llama-bench`` on ``path``: mean tokens/s of each prefill (``-p``) and of ``decode`` tokens from an
    empty cache (``-n``), every layer on the GPU on CUDA (``-ngl 99``)."""
    command = [binary, "-m", str(path), "-p", ",".join(map(str, prefill)) or "0", "-n", str(decode),
               "-r", str(repeats), "-o", "json", "-t", str(threads), "-ngl", "99" if device == "cuda" else "0"]
    print(" ".join(command), flush=True)
    runs = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return {f"prefill {r['n_prompt']}" if r["n_prompt"] else f"decode {r['n_gen']}": float(r["avg_ts"])
            for r in runs if r["n_prompt"] or r["n_gen"]}


def print_table(title: str, columns: dict[str, dict[str, float]], reference: str | None = None) -> None:
    """One row per measurement, one column per system; with ``reference``, each other column's ratio to it."""
    names = list(columns)
    rows = list(dict.fromkeys(row for column in columns.values() for row in column))
    ratios = [n for n in names if reference is not None and n != reference]
    print(f"\n{title}")
    print(f"{'tokens/s':<14}" + "".join(f"{n:>22}" for n in names) + "".join(f"{'ratio ' + str(i + 1):>10}" for i in range(len(ratios))))
    for row in rows:
        values = [columns[n].get(row, float("nan")) for n in names]
        line = f"{row:<14}" + "".join(f"{v:>22.1f}" for v in values)
        line += "".join(f"{columns[n].get(row, float('nan')) / columns[reference].get(row, float('nan')):>10.2f}" for n in ratios)
        print(line)
    for i, n in enumerate(ratios):
        print(f"ratio {i + 1}: {n} / {reference}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    parser.add_argument("--synthetic", choices=sorted(SHAPES), help="random weights of a real model's shape")
    parser.add_argument("--layers", type=int, default=None, help="--synthetic: the first LAYERS layers of the shape")
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "BF16"], help="formats or mixes (Q4_K_M, ...) for --synthetic")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="CUDA: also time one decode step alone, by kernel")
    parser.add_argument("--by-turns", type=int, metavar="ROUNDS",
                        help="CPU: eager decode only, ours (runs of blocks, one block a call, and steered) and "
                             "llama.cpp's taking turns for ROUNDS rounds, after a prompt of each --prefill length")
    parser.add_argument("--kernels-from", metavar="REV", default=None,
                        help="with --by-turns: also decode with the C++ kernels of git revision REV")
    parser.add_argument("--numerics", choices=workbench.kernels.NUMERICS, default="exact",
                        help="what the quantized matmuls compute (workbench.kernels.set_numerics)")
    parser.add_argument("--llama-bench", default=None,
                        help="llama.cpp's llama-bench binary: --synthetic models go through a GGUF file both read")
    parser.add_argument("--gguf-dir", type=Path, default=Path("/tmp"),
                        help="where the GGUF files of --synthetic models go (for --llama-bench and --by-turns)")
    args = parser.parse_args()
    if args.by_turns and args.device != "cpu":
        parser.error("--by-turns times the eager CPU decode of a GGUF file against llama.cpp's: no --device")
    if args.layers is not None and not args.synthetic:
        parser.error("--layers cuts a --synthetic model")
    if args.kernels_from and not args.by_turns:
        parser.error("--kernels-from takes its turns in --by-turns")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    workbench.kernels.set_numerics(args.numerics)
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, numerics {args.numerics}")

    def synthetic_file(fmt: str) -> Path:  # the --synthetic model as a GGUF file, which llama.cpp reads too
        dims = SHAPES[args.synthetic] if args.layers is None else {**SHAPES[args.synthetic], "n_layers": args.layers}
        cut = "" if args.layers is None else f"-{args.layers}l"
        return synthetic_gguf("llama", dims, fmt, args.gguf_dir / f"{args.synthetic}{cut}-{fmt}.gguf")

    if args.synthetic and args.by_turns:
        for fmt in args.formats:
            path = synthetic_file(fmt)
            print(path.name)
            decode_by_turns(workbench.load(path), args.threads, args.prefill, args.decode, args.by_turns,
                            args.kernels_from)
        return
    if args.synthetic:
        columns = {}
        # the ceiling for streaming weights: bytes a device-to-device copy moves (read + written) per second
        bandwidth = copy_bandwidth() if args.device == "cuda" else None
        if bandwidth:
            print(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s read + written")
        for fmt in args.formats:
            if args.llama_bench:
                path = synthetic_file(fmt)
                columns[f"llama.cpp {fmt}"] = llama_bench(args.llama_bench, path, args.prefill, args.decode,
                                                          args.threads, args.device, args.repeats)
                model = workbench.load(path, device=args.device, dtype=args.dtype)
            else:
                model = synthetic_model(args.synthetic, fmt, args.device, args.dtype, args.layers)
            print(f"{fmt}: resident weights {model.runner.weights.nbytes / 2**30:.2f} GiB, "
                  f"kernels {sorted(set(model.kernel_report(1).values()))}")
            columns[f"{args.synthetic} {fmt}"] = result = ours(model, args.prefill, args.decode, args.repeats)
            if bandwidth:
                # a decode step reads every matrix once, except the embedding (one row)
                step_bytes = sum(w.nbytes for name, w in model.runner.weights.named_matrices() if name != "embed")
                roofline = bandwidth / step_bytes
                print(f"{fmt}: decode {result[f'decode {args.decode}']:.1f} tok/s = "
                      f"{result[f'decode {args.decode}'] / roofline:.0%} of the weight-bandwidth roofline "
                      f"({roofline:.1f} tok/s at {step_bytes / 2**30:.2f} GiB per token)")
            if args.profile and args.device == "cuda":
                profile_decode_step(model)
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
        reference = next((name for name in columns if name.startswith("llama.cpp")), None)
        print_table(f"{args.synthetic}, random weights", columns,
                    reference or (list(columns)[-1] if len(columns) > 1 else None))
        return

    model = workbench.load(args.model, device=args.device, dtype=args.dtype)
    if args.by_turns:
        return decode_by_turns(model, args.threads, args.prefill, args.decode, args.by_turns, args.kernels_from)
    print(f"kernels: {sorted(set(model.kernel_report(1).values()) | set(model.kernel_report(128).values()))}")
    columns = {"workbench": ours(model, args.prefill, args.decode, args.repeats)}
    if args.device == "cpu":  # prefill is the same eager forward either way
        columns["workbench compiled"] = ours(model, [], args.decode, args.repeats, compiled=True)
    reference = llama_cpp(str(model.path), args.threads, args.prefill, args.decode, args.repeats) if args.device == "cpu" else None
    if reference is not None:
        columns["llama.cpp"] = reference
    print_table(f"{model.config.name}", columns, "llama.cpp" if reference is not None else None)


if __name__ == "__main__":
    main()
