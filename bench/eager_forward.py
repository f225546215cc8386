"""The eager forward (every hooked run, every prompt's prefill) with the glue's own implementations against its torch
formulas: ``workbench.kernels.layer_ops`` (RMSNorm, the residual sum with its norm, rope, attention's products,
SwiGLU) as C++ calls (CPU) or Triton kernels (CUDA), or under ``layer_ops.torch_formulas()``; on the CPU also with each
plain block as its separate calls, or whole in a call of its own, instead of a run of blocks in one
``layer_ops.blocks_exact``; on CUDA also with every Triton kernel (the matmuls' too) launched through Triton's own
launcher instead of ``workbench.kernels.triton.launch``'s kept kernels.
All run in one process, taking turns forward by forward, so a noisy host slows them alike; each figure is the median
(and min) of ``--repeats`` forwards after 3 warm-ups, and the ratio the median of the paired forwards' ratios.

    python bench/eager_forward.py                                              # embedded model, CPU, 2 threads
    python bench/eager_forward.py --device cuda --synthetic llama3-8b --format Q4_K
    python bench/eager_forward.py --numerics llamacpp --tokens 1 16   # llama.cpp numerics' glue, C++ or formulas

``--decode-steps`` instead times eager decode steps of a tiny random model (30 layers of width 64), whose arithmetic is
negligible, so that a step's time is the host's (Python, op dispatch, launches): one prompt without hooks, one prompt
steered, and a batch of 32 prompts steered (``stream_batch``, as bench/vs_transformerlens.py's task (c)); ms a step,
the median (and min) over ``--repeats`` generations, and the op calls of one step.

    python bench/eager_forward.py --decode-steps [--device cuda]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time

import torch

import workbench
from decode import SHAPES, one_block_a_call, synchronize, synthetic_model
from workbench import hooks
from workbench.kernels import layer_ops
from workbench.synthetic import random_checkpoint, random_config


@contextlib.contextmanager
def separate_blocks():
    """Each plain block as its separate calls: ``layer_ops.blocks_exact`` declines, as it does where a hook lies inside."""
    whole = layer_ops.blocks_exact
    layer_ops.blocks_exact = lambda *args: None
    try:
        yield
    finally:
        layer_ops.blocks_exact = whole


def forward_ms(runner, ids: torch.Tensor) -> float:
    synchronize(runner.device)
    start = time.perf_counter()
    runner.forward(ids, last_logits_only=True)
    synchronize(runner.device)
    return (time.perf_counter() - start) * 1e3


def paired_times(runner, ids: torch.Tensor, modes: dict, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of ``repeats`` forwards in each mode, the modes taking turns forward by forward, so that a host
    that slows down for a while slows them alike."""
    times: dict[str, list[float]] = {label: [] for label in modes}
    for repeat in range(3 + repeats):
        for label, mode in modes.items():
            with mode():
                elapsed = forward_ms(runner, ids)
            if repeat >= 3:  # warm-ups
                times[label].append(elapsed)
    return times


def op_counts(runner, ids: torch.Tensor) -> tuple[int, int, float]:
    """Top-level host op calls, GPU kernels and their milliseconds for one forward."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        runner.forward(ids, last_logits_only=True)
        synchronize(runner.device)
    host = collections.Counter(e.name for e in prof.events()
                               if e.device_type != torch.autograd.DeviceType.CUDA and e.cpu_parent is None)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(host.values()), len(kernels), sum(e.device_time for e in kernels) / 1e3


def decode_step_ms(stream, rows: int) -> list[float]:
    """Milliseconds between the first yields of consecutive decode steps of ``stream`` (``rows`` yields a step),
    the prefill and the first step left out."""
    stamps = [time.perf_counter() for k, _ in enumerate(stream) if k % rows == 0]
    return [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]


def step_op_calls(stream, rows: int) -> int:
    """Top-level host op calls of one decode step of ``stream`` (after two)."""
    for _ in zip(range(3 * rows), stream):
        pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in zip(range(rows), stream):
            pass
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def decode_steps(device: str, repeats: int) -> None:
    config = random_config("llama", n_layers=30, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=128, n_ctx=512)
    model = workbench.Model(random_checkpoint(config, "Q8_0", seed=0, device=device), device)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=generator).tolist()
               for n in torch.randint(8, 20, (32,), generator=generator)]
    vector = torch.randn(config.d_model, generator=generator)
    steer = hooks.Steer("blocks.15.hook_resid_post", vector / vector.norm(), scale=4.0)
    cases = {
        "one prompt, no hooks": (lambda n: model.stream(prompts[0], n, compiled=False), 1),
        "one prompt, steered": (lambda n: model.stream(prompts[0], n, compiled=False, interventions=[steer]), 1),
        "32 prompts, steered": (lambda n: model.stream_batch(prompts, n, interventions=[steer]), 32),
    }
    print(f"torch {torch.__version__}, tiny random llama (30 layers, d_model 64, Q8_0) on {model.device}")
    for label, (stream, rows) in cases.items():
        decode_step_ms(stream(8), rows)  # warm-up
        times = [t for _ in range(repeats) for t in decode_step_ms(stream(32), rows)]
        print(f"{label:<22} {statistics.median(times):6.2f} / {min(times):6.2f} ms a decode step (median / min), "
              f"{step_op_calls(stream(8), rows)} host op calls a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--synthetic", choices=sorted(SHAPES), help="random weights of a real model's shape")
    parser.add_argument("--format", default="Q4_K", help="weight format for --synthetic")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-steps", action="store_true", help="host time of eager decode steps, tiny model")
    parser.add_argument("--numerics", choices=workbench.kernels.NUMERICS, default="exact",
                        help="llamacpp: the glue as llama.cpp computes it (C++ ops against llamacpp_ops' formulas)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode_steps:
        return decode_steps(args.device, min(args.repeats, 5))
    with workbench.kernels.numerics(args.numerics):
        time_forwards(args)


def time_forwards(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = (synthetic_model(args.synthetic, args.format, args.device, None) if args.synthetic
             else workbench.load(device=args.device))
    runner = model.runner
    print(f"torch {torch.__version__}, {model.config.name} on {runner.device}, {runner.dtype}; "
          f"the glue: {layer_ops.implementations(runner.device, runner.dtype)}")
    inputs = {n: torch.randint(0, model.config.vocab_size, (n,)) for n in args.tokens}
    modes = {"torch formulas": layer_ops.torch_formulas, "layer_ops": contextlib.nullcontext}
    if runner.device.type == "cpu":
        modes = {"separate calls": separate_blocks, "one block a call": one_block_a_call, **modes}
    if runner.device.type == "cuda":
        from workbench.kernels.triton.launch import through_triton

        modes = {"Triton launcher": through_triton, **modes}
    for round_ in range(1, args.rounds + 1):
        for n in args.tokens:
            times = paired_times(runner, inputs[n], modes, args.repeats)
            ratios = {label: statistics.median(a / b for a, b in zip(t, times["layer_ops"]))
                      for label, t in times.items() if label != "layer_ops"}
            print(f"round {round_}  {n:4} tokens" + "".join(
                f"  {label} {statistics.median(t):6.2f} / {min(t):6.2f} ms" for label, t in times.items())
                  + "  over layer_ops (paired):" + "".join(f" {label} {r:.2f}x" for label, r in ratios.items()))
    n = args.tokens[min(1, len(args.tokens) - 1)]
    for label, mode in modes.items():
        with mode():
            host, kernels, gpu_ms = op_counts(runner, inputs[n])
        gpu = f", {kernels} GPU kernels taking {gpu_ms:.2f} ms" if runner.device.type == "cuda" else ""
        print(f"{label:<15} {n} tokens: {host} host op calls{gpu}")


if __name__ == "__main__":
    main()
