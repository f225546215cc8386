"""Sweep throughput on 1 GPU against 2 (target: 2 GPUs >= 1.8x), and a model split over 2 GPUs against 1.

    python bench/multi_gpu.py [--model PATH] [--prompts 8192] [--tokens 128] [--gpus 2] [--skip-split]

Sweep: ``workbench.distributed.harvest`` of the last position's ``blocks.8.hook_resid_post`` over ``--prompts``
random prompts of ``--tokens`` tokens, launched with ``torchrun --nproc-per-node 1`` and then ``--gpus``; each rank
loads the model on its own GPU, warms up on a shard, and the sweep is timed from a barrier to the gathered result
(model loading excluded; the gather of every rank's rows included). Printed: prompts/s of each and the ratio. The
default 8,192 prompts take about 3 s on two H100s; a sweep of under a second (2,048) weighs its fixed cost per
sweep (checking every prompt, the gather, the last shard's wait) more.
Split: greedy decode of 64 tokens and a 512-token prefill on ``--gpus`` devices (``cuda:0``, ``cuda:1``, ...) against ``cuda:0`` alone
(same logits; the split pays one hand-over per token at the range boundary, and no more GPUs read in parallel).
Without ``--model``, a random llama of 16 layers, d_model 2048, Q4_K (``workbench.synthetic``, 64 distinct rows a
matrix), built in each process with the same seed.

    python bench/multi_gpu.py --big llama3-405b --gpus 4 [--format Q4_K_M]

``--big`` instead splits a random model of a real shape (bench/decode.py's) that no one GPU holds over ``--gpus``
GPUs: build and load seconds, each GPU's layers and memory, a 128- and a 512-token prefill, eager decode against the
roofline of one GPU reading at its copy bandwidth (a layer split reads its ranges one after another), the
residual stream handed over per token, the first trace's hash of every weight, and hooks across the split: recording
every ``hook_resid_post`` leaves the logits' bits unchanged, and a ``Steer`` on the first layer of the second GPU's
range adds its vector there. Every layer holds one random layer's weights, each layer its own copy on its GPU: drawing
126 layers of a 405B would take minutes for the same timings. ``--devices`` runs the same on a list such as
``cpu,cpu`` (with a small shape).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from typing import Iterator

import torch

import workbench
from common import copy_bandwidth
from decode import SHAPES, synchronize, timed
from workbench import distributed, hooks
from workbench.devices import layer_bytes
from workbench.synthetic import random_checkpoint, random_config

HOOK = "blocks.8.hook_resid_post"


def load(model_path: str | None, **kwargs) -> workbench.Model:
    if model_path:
        return workbench.load(model_path, **kwargs)
    config = random_config("llama", n_layers=16, d_model=2048, n_heads=16, n_kv_heads=8, d_mlp=5632, n_ctx=1024)
    # 64 distinct rows a matrix, tiled: quantizing every row of a model this size takes minutes
    return workbench.Model(random_checkpoint(config, "Q4_K", seed=0, distinct_rows=64), **kwargs)


def random_prompts(n: int, tokens: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (n, tokens), generator=generator).tolist()


def worker(args: argparse.Namespace) -> None:
    """One rank of the timed sweep."""
    rank = distributed.init()
    model = load(args.model, device=distributed.local_devices()[0])
    prompts = random_prompts(args.prompts, args.tokens, model.config.vocab_size)
    distributed.harvest(model, prompts[: args.shard_size * rank.world], [HOOK], shard_size=args.shard_size)  # warm-up
    torch.cuda.synchronize()
    if rank.world > 1:
        torch.distributed.barrier()
    started = time.perf_counter()
    rows = distributed.harvest(model, prompts, [HOOK], shard_size=args.shard_size)
    seconds = time.perf_counter() - started
    if rank.rank == 0:
        assert all(value.shape[0] == len(prompts) for value in rows.values())
        print(json.dumps({"gpus": rank.world, "seconds": seconds, "prompts_per_s": len(prompts) / seconds}))


def sweep(args: argparse.Namespace, gpus: int) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), __file__,
               "--worker", "--prompts", str(args.prompts), "--tokens", str(args.tokens),
               "--shard-size", str(args.shard_size)] + (["--model", args.model] if args.model else [])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"torchrun with {gpus} GPUs failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def split(args: argparse.Namespace) -> dict:
    one = load(args.model, device="cuda:0")
    two = load(args.model, devices=[f"cuda:{i}" for i in range(args.gpus)])
    prompt = random_prompts(1, 512, one.config.vocab_size)[0]
    out = {"same_logits": bool(torch.equal(one.forward(prompt).cpu(), two.forward(prompt).cpu())),
           "layers": [[d, r.start, r.stop - 1] for d, r in two.devices]}
    for name, model in (("one_gpu", one), ("two_gpus", two)):
        model.generate(prompt[:16], 8, compiled=False)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(prompt[:16], 64, compiled=False)
        torch.cuda.synchronize()
        decode = 64 / (time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(5):
            model.forward(prompt)
        torch.cuda.synchronize()
        out[name] = {"eager_decode_tokens_per_s": decode, "prefill_512_ms": (time.perf_counter() - started) / 5 * 1e3}
    return out


def big_split(shape: str, fmt: str, devices: list[str]) -> Iterator[tuple[str, object]]:
    """``(figure, value)`` as each is measured, so that a run cut short still reports what it measured."""
    dims, gib = SHAPES[shape], 1 << 30
    yield "shape", {"shape": shape, "format": fmt, "devices": devices}
    started = time.perf_counter()
    one = random_checkpoint(random_config("llama", n_ctx=2048, **{**dims, "n_layers": 1}), fmt, distinct_rows=64)
    weights = dataclasses.replace(one.weights, layers=one.weights.layers * dims["n_layers"])
    checkpoint = dataclasses.replace(one, config=random_config("llama", n_ctx=2048, **dims), weights=weights)
    yield "build_s", time.perf_counter() - started
    started = time.perf_counter()
    model = workbench.Model(checkpoint, devices=devices)
    for device, _ in model.devices:
        synchronize(torch.device(device))
    yield "load_s", time.perf_counter() - started
    del one, weights, checkpoint
    placed = model.runner.weights
    sizes, ranges = layer_bytes(placed), [(str(d), r) for d, r in model.devices]
    yield "weights_gib", (sum(sizes) + placed.embed.nbytes + placed.unembed.nbytes) / gib
    yield "per_device", [{"device": d, "layers": [r.start, r.stop - 1],
                          "layer_weights_gib": sum(sizes[r.start:r.stop]) / gib,
                          "allocated_gib": torch.cuda.memory_allocated(d) / gib if d.startswith("cuda") else None}
                         for d, r in ranges]
    yield "handover_bytes_per_token", model.config.d_model * model.runner.dtype.itemsize * (len(ranges) - 1)
    prompt = random_prompts(1, 512, model.config.vocab_size)[0]
    last = torch.device(devices[-1])  # the logits come from the last range, after every other
    for n in (128, 512):
        yield f"prefill_{n}_tokens_per_s", n / timed(lambda n=n: model.forward(prompt[:n]), last, 3)
    decode = 32 / timed(lambda: model.generate(prompt[:16], 32, compiled=False), last, 1)
    read = sum(sizes) + placed.unembed.nbytes  # a token reads every layer and the output head (one embedding row)
    bandwidth = copy_bandwidth() if last.type == "cuda" else None  # one GPU reads at a time
    yield "eager_decode", {"tokens_per_s": decode, "read_per_token_gib": read / gib,
                           "copy_gb_per_s": bandwidth / 1e9 if bandwidth else None,
                           "roofline_tokens_per_s": bandwidth / read if bandwidth else None,
                           "share_of_roofline": decode * read / bandwidth if bandwidth else None}
    yield "peak_allocated_gib", [torch.cuda.max_memory_allocated(d) / gib if d.startswith("cuda") else None
                                 for d, _ in ranges]
    started = time.perf_counter()
    model.file_sha256  # a trace's fingerprint: every weight hashed once, here timed apart from the runs below
    yield "weights_hash_s", time.perf_counter() - started
    # hooks across the split: recording leaves the bits alone; a steer on the second range's first layer adds its vector
    text = prompt[:32]
    plain = model.forward(text).cpu()  # a trace keeps its logits on the CPU
    recorded = model.run(text, record=["blocks.*.hook_resid_post"])
    yield "recording", {"points": len(recorded.activations),
                        "logits_bits_kept": bool(torch.equal(plain, recorded.logits))}
    name = f"blocks.{ranges[1][1].start}.hook_resid_post"
    vector = torch.randn(model.config.d_model, generator=torch.Generator().manual_seed(0))
    steered = model.run(text, record=[name], interventions=[hooks.Steer(name, vector, scale=4.0)])
    added = steered.activations[name] - recorded.activations[name]
    largest = recorded.activations[name].abs().max().item()
    yield "steer", {"at": name, "max_error": (added - 4.0 * vector).abs().max().item(),
                    "bound": 2 * largest * torch.finfo(model.runner.dtype).eps,  # the stream rounded twice
                    "changes_the_logits": bool((steered.logits - plain).abs().max() > 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--big", choices=sorted(SHAPES), help="split a random model of this shape, nothing else")
    parser.add_argument("--format", default="Q4_K_M", help="--big's format or mix")
    parser.add_argument("--devices", default=None, help="--big's devices (default: cuda:0 ... cuda:GPUS-1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.big:
        devices = args.devices.split(",") if args.devices else [f"cuda:{i}" for i in range(args.gpus)]
        for figure, value in big_split(args.big, args.format, devices):
            print(figure, json.dumps(value), flush=True)
        return
    if torch.cuda.device_count() < args.gpus:
        sys.exit(f"needs {args.gpus} CUDA devices; this machine has {torch.cuda.device_count()}")
    one, many = sweep(args, 1), sweep(args, args.gpus)
    report = {"sweep": {"one_gpu": one, f"{args.gpus}_gpus": many,
                        "speedup": many["prompts_per_s"] / one["prompts_per_s"], "target": 1.8},
              "device": torch.cuda.get_device_name(0)}
    if not args.skip_split:
        report["split"] = split(args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
