"""Decode tokens/s with a LoRA adapter beside the packed base against the base alone, side by side (target >= 0.8x).

    python bench/adapters.py [--model PATH] [--rank 16] [--modules all|attn] [--threads 2] [--decode 64] [--device cpu]
                             [--compiled | --eager] [--mixed-batch]
    python bench/adapters.py --device cuda --synthetic llama3-8b [--format Q4_K_M] [--layers 32]
    python bench/adapters.py --device cuda --kernels [--synthetic llama3-8b]

--synthetic takes random weights of a real model's shape (bench/decode.py's, in --format, the first --layers layers)
instead of the embedded SmolLM2-135M: multi-LoRA servers put adapters on 7-8B models, whose steps read far more
weights per launch, so the ratio there is the one a deployment sees.

The adapter is random (B nonzero), on every projection of every layer with --modules all (the most a LoRA adds),
or on q/k/v/o alone with --modules attn. Base and adapter runs alternate, each figure the median of --repeats, so the
ratio comes from one run under the same machine load. Decode takes the built step (a CUDA graph of the compiled
forward on CUDA, the compiled forward on the CPU) where the device's default does (CUDA), or as --compiled / --eager
say; the adapter's step holds its terms as inputs (docs/adapters.md). Eager decode also times the adapter with its
terms as the torch formula's two matmuls per group (``kernels.lora``'s fused call switched off), in the same rounds.

--mixed-batch times instead the LoRA terms of one batched forward whose 8 prompts choose among 4 adapters (2 each):
grouped by adapter (what the runner does: each adapter's tokens gathered, two matmuls, scattered back) against every
token multiplying its own gathered A and B^T (batched matmuls over [tokens, in, rank] and [tokens, rank, out]), for a
decode step (1 token a prompt) and a prefill (32 tokens a prompt), next to one adapter for the whole batch.

--kernels (CUDA) times instead the adapter's calls of one decode step alone (every group of every layer, one token,
replayed as one CUDA graph): microseconds a call for the fused kernel and for the two matmuls, next to a one-element add
(what a launch costs in a graph at least), so that the adapter's share of a step splits into launches and work; then
each group's base matmuls alone, followed by the fused kernel, and with the terms in the GEMV's epilogue (what the
runner runs), a step's worth and each kind of group apart.

On CUDA the decode runs also time the adapter with the fused kernel after the base's GEMV ("kernel after": the GEMV's
epilogue switched off, a step built of its own), in the same rounds; --no-kernel-after leaves it out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import workbench
from workbench.adapters import PROJECTIONS, projection_shape
from workbench import generation
from workbench.generation import Sampling, generate_tokens
from common import cuda_seconds
from decode import SHAPES, synthetic_model
from workbench.kernels import lora as lora_ops

FUSED_ROWS = lora_ops.MAX_ROWS
# CUDA: the adapter's terms by the fused kernel after the base's GEMV (``kernels.lora``'s GEMV epilogue switched off)
AFTER_GEMV = "adapter, kernel after"
ADDED = {"base + fused kernel": "the fused kernel after", "base with the GEMV's epilogue": "the GEMV's epilogue"}


def write_random_adapter(path: Path, config, rank: int, projections: list[str], seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.n_layers):
        for proj in projections:
            module = PROJECTIONS[proj][1]
            kind = "self_attn" if proj in ("wq", "wk", "wv", "wo") else "mlp"
            out_dim, in_dim = projection_shape(config, proj)
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dim, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [PROJECTIONS[p][1] for p in projections]}))
    return path


def decode_seconds(model: workbench.Model, prompt: list[int], n_new: int, adapter: str | None,
                   compiled: bool) -> float:
    """Seconds from the first new token (the prefill done) to the last: n_new - 1 decode steps."""
    tokens = generate_tokens(model.runner, prompt, n_new, Sampling(), stop_ids=set(), compiled=compiled,
                             lora=model.lora_terms(adapter))
    next(tokens)
    start = time.perf_counter()
    for _ in tokens:
        pass
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def gathered_terms(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Each token's LoRA term with its own adapter's A and B^T, gathered from stacks ``[adapters, ...]``."""
    return torch.bmm(torch.bmm(x[:, None, :], a[choice].transpose(1, 2)), b_t[choice])[:, 0]


def mixed_batch(model: workbench.Model, names: list[str], repeats: int) -> None:
    from workbench.runner import LORA_GROUPS, BatchLayout, LoraRows, _Points, add_lora, lora_segments

    c, n_layers, device, dtype = model.config, model.config.n_layers, model.device, model.dtype
    width = {("wq", "wk", "wv"): c.d_model, ("wo",): c.n_heads * c.d_head, ("w_gate", "w_up"): c.d_model,
             ("w_down",): c.d_mlp}
    for tokens in (1, 32):
        layout = BatchLayout([tokens] * 2 * len(names), device)
        n = layout.n_tokens
        choices = [names[b % len(names)] for b in range(layout.size)]
        mixed = lora_segments(LoraRows(tuple(model.lora_terms(name) for name in choices)), layout)
        alone = lora_segments(model.lora_terms(names[0]), layout)
        choice = torch.tensor([names.index(name) for name in choices], device=device).repeat_interleave(tokens)
        stacks = {g: [[torch.stack([model.lora_terms(name)[i][g][k] for name in names]) for k in (0, 1)]
                      for i in range(n_layers)] for g in LORA_GROUPS}
        x = {g: torch.randn(n, width[g], device=device, dtype=dtype) for g in LORA_GROUPS}
        outs = {g: [torch.zeros(n, projection_shape(c, p)[0], device=device, dtype=dtype) for p in g]
                for g in LORA_GROUPS}
        point, names_of = _Points(None, torch.arange(n), 0), model.runner._block_names(0, False)["lora"]

        def grouped(segments=mixed) -> None:
            for i in range(n_layers):
                for g in LORA_GROUPS:
                    add_lora(x[g], outs[g], g, [(terms[i], rows) for terms, rows in segments], point, names_of, i)

        def gathered() -> None:
            for i in range(n_layers):
                for g in LORA_GROUPS:
                    gathered_terms(x[g], *stacks[g][i], choice)

        runs = {"grouped by adapter": grouped, "gathered per token": gathered,
                "one adapter for all": lambda: grouped(alone)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first round warms up
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times[name].append(time.perf_counter() - start)
        print(f"{layout.size} prompts x {tokens} tokens, {len(names)} adapters: " + ", ".join(
            f"{name} {statistics.median(t[1:]) * 1e3:.1f} ms" for name, t in times.items()))


def kernel_times(model: workbench.Model, name: str, repeats: int) -> None:
    from workbench.runner import project
    from workbench.weights import STACKS

    lora, c = model.lora_terms(name), model.config
    stacks = {parts: stack for stack, parts in STACKS.items()}
    groups = []  # each call's projections
    calls: dict[str, list] = {run: [] for run in ("fused kernel", "two matmuls", "one-element add", "base matmuls",
                                                  "base + fused kernel", "base with the GEMV's epilogue")}
    for i, layer in enumerate(model.runner.weights.layers[:c.n_layers]):
        for parts, (a, b_t, adapted, ranks) in lora[i].items():
            groups.append(parts)
            x = torch.randn(1, a.shape[1], device=model.device, dtype=model.dtype)
            outs = [torch.randn(1, projection_shape(c, p)[0], device=model.device, dtype=model.dtype) for p in adapted]
            terms = lambda x=x, a=a, b_t=b_t, outs=outs, ranks=ranks: lora_ops.add_terms(x, a, b_t, outs, ranks)
            calls["fused kernel"].append(terms)
            calls["two matmuls"].append(terms)
            one = torch.zeros(1, device=model.device, dtype=model.dtype)
            calls["one-element add"].append(lambda one=one: one.add_(1))
            # the group's base matmuls, then its terms as the runner adds them
            stacked = getattr(layer, stacks[parts]) if parts in stacks else None
            weights = [getattr(layer, p) for p in parts]
            calls["base matmuls"].append(lambda x=x, s=stacked, w=weights: project(x, s, w))
            calls["base + fused kernel"].append(
                lambda x=x, s=stacked, w=weights, a=a, b_t=b_t, ranks=ranks, parts=parts, adapted=adapted:
                lora_ops.add_terms(x, a, b_t, [o for o, p in zip(project(x, s, w), parts) if p in adapted], ranks))
            part_ranks = [ranks[adapted.index(p)] if p in adapted else 0 for p in parts]
            calls["base with the GEMV's epilogue"].append(
                lambda x=x, s=stacked, w=weights, a=a, b_t=b_t, r=part_ranks:
                lora_ops.linear_with_terms(x, s, w, a, b_t, r))
    n_calls = len(groups)
    with_base = ("base matmuls", "base + fused kernel", "base with the GEMV's epilogue")
    seconds = {}
    for run, run_calls in calls.items():
        lora_ops.MAX_ROWS = 0 if run == "two matmuls" else FUSED_ROWS  # the formula while the graph is captured
        seconds[run] = cuda_seconds(run_calls, repeats)
    lora_ops.MAX_ROWS = FUSED_ROWS
    print(f"the adapter's {n_calls} calls of a decode step alone, one CUDA graph: " + ", ".join(
        f"{run} {seconds[run] * 1e6:.2f} us a call" for run in ("fused kernel", "two matmuls", "one-element add")))
    print(f"fused: {seconds['fused kernel'] * n_calls * 1e3:.3f} ms a step")
    base = seconds["base matmuls"]
    print(f"with the base's matmuls, one CUDA graph a step: base {base * n_calls * 1e3:.3f} ms; the adapter adds "
          + ", ".join(f"{ADDED[run]} {(seconds[run] - base) * n_calls * 1e3:.3f} ms" for run in with_base[1:]))
    for parts in dict.fromkeys(groups):  # each kind of group alone, one graph each
        group = {run: cuda_seconds([call for call, kind in zip(calls[run], groups) if kind == parts], repeats) * 1e6
                 for run in with_base}
        print(f"  {'/'.join(parts)}: base {group[with_base[0]]:.2f} us a call; the adapter adds "
              + ", ".join(f"{ADDED[run]} {group[run] - group[with_base[0]]:.2f} us" for run in with_base[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded model)")
    parser.add_argument("--synthetic", choices=sorted(SHAPES), help="random weights of a real model's shape")
    parser.add_argument("--format", default="Q4_K_M", help="--synthetic's format or mix")
    parser.add_argument("--layers", type=int, default=None, help="--synthetic's first layers only (default: all)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--modules", choices=["all", "attn"], default="all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    built = parser.add_mutually_exclusive_group()
    built.add_argument("--compiled", dest="compiled", action="store_true", default=None,
                       help="decode through the built step (default on CUDA)")
    built.add_argument("--eager", dest="compiled", action="store_false", help="decode eagerly (default on the CPU)")
    parser.add_argument("--mixed-batch", action="store_true", help="time a batch of prompts of different adapters")
    parser.add_argument("--kernels", action="store_true", help="CUDA: time the adapter's calls of a step alone")
    parser.add_argument("--kernel-after", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA decode: also time the fused kernel after the GEMV (a step built of its own)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.synthetic and args.model:
        parser.error("give --model or --synthetic, not both")
    if args.synthetic:
        model = synthetic_model(args.synthetic, args.format, args.device, None, args.layers)
        label = f"{args.synthetic} {args.format} (random weights, {model.config.n_layers} layers)"
    else:
        model = workbench.load(args.model, device=args.device)
        label = model.config.name
    projections = list(PROJECTIONS) if args.modules == "all" else ["wq", "wk", "wv", "wo"]
    names = [f"bench{k}" for k in range(4 if args.mixed_batch else 1)]
    with tempfile.TemporaryDirectory() as tmp:
        for seed, name in enumerate(names):
            model.load_adapter(write_random_adapter(Path(tmp) / name, model.config, args.rank, projections, seed), name)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    if args.kernels:
        if model.device.type != "cuda":
            parser.error("--kernels times CUDA graphs: give --device cuda")
        print(f"{label}; adapter rank {args.rank} on {', '.join(projections)}")
        kernel_times(model, names[0], args.repeats)
        return
    if args.mixed_batch:
        print(f"{label} on {args.device}, {args.threads} threads, load average {load}; adapters rank "
              f"{args.rank} on {', '.join(projections)}")
        mixed_batch(model, names, args.repeats)
        return
    prompt = torch.randint(0, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    # True, not the CUDA default "background": each run waits for its step's build, so none times a provisional graph
    compiled = args.compiled if args.compiled is not None else model.device.type == "cuda"
    runs = ({"base": None, "adapter": "bench0"} | ({} if compiled else {"adapter, two matmuls": "bench0"})
            | ({AFTER_GEMV: "bench0"} if model.device.type == "cuda" and args.kernel_after else {}))
    times: dict[str, list[float]] = {run: [] for run in runs}
    built: dict[str, dict] = {}  # each run's built steps: the terms' path is fixed when a step is built

    def decode(run: str) -> float:
        lora_ops.MAX_ROWS = 0 if run == "adapter, two matmuls" else FUSED_ROWS
        lora_ops.GEMV_EPILOGUE = run != AFTER_GEMV
        generation._BUILT[model.runner] = built.setdefault(run, {})
        return decode_seconds(model, prompt, args.decode, runs[run], compiled)

    for run in runs:  # warm-up (and the builds of the compiled steps)
        decode(run)
    for _ in range(args.repeats):
        for run in runs:
            times[run].append(decode(run))
    lora_ops.MAX_ROWS, lora_ops.GEMV_EPILOGUE = FUSED_ROWS, True
    rate = {run: (args.decode - 1) / statistics.median(t) for run, t in times.items()}
    adapter = model.adapters["bench0"]
    print(f"{label} on {args.device}, {args.threads} threads, load average {load} (at the start), "
          f"{'built step' if compiled else 'eager'} decode; adapter rank {args.rank} on "
          f"{', '.join(projections)} of {len(adapter.adapted_layers)} layers ({adapter.n_params:,} parameters)")
    for run, value in rate.items():
        ratio = "" if run == "base" else f"   ({value / rate['base']:.2f}x the base)"
        print(f"decode {run:<21} {value:8.1f} tokens/s{ratio}")
    print("load average at the end " + " ".join(f"{x:.1f}" for x in os.getloadavg()))

if __name__ == "__main__":
    main()
