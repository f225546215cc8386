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
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import workbench
from workbench import distributed
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
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
