"""The sweeps tests/test_distributed.py runs under ``torchrun`` (and in one process, without it).

``torchrun ... distributed_job.py MODEL OUT [--fail]``: a tiny model's activations harvested to files and in memory,
collected for a probe, and swept by patching, over prompts sharded three to a shard. With ``--fail``, the forward of the
one prompt of 12 tokens fails the first time any rank runs it in each harvest (a marker file in OUT says it has): in
the harvest to files it kills its process (the job fails; run again, it keeps the shard files already written), in
the harvest in memory it raises (the shard is retried on the other rank). Rank 0 writes OUT/results.safetensors.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

import workbench
from workbench import distributed

# prompt 4 alone has 12 tokens: the injected failure knows it by its length
PROMPTS = [[5 + i, 9, 11 + i, 13, 2 * i + 20, 7] + [30 + i] * (i % 3) for i in range(11)]
PROMPTS[4] = list(range(40, 52))
PAIRS = [([5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 12, 10]), ([20, 21, 22, 23, 24], [20, 40, 22, 23, 24])]


def run(model_path: str, out: Path, fail: bool = False) -> dict[str, torch.Tensor]:
    """Every sweep of this job on this rank, into a dict that rank 0 saves. With ``fail``, the file harvest's forward
    of prompt 4 crashes the process once, and the in-memory harvest's raises once."""
    rank = distributed.init(timeout_s=600)  # generous: a loaded CI machine runs the ranks slowly
    model = workbench.load(model_path, device="cpu")

    def fail_once(marker: Path, crash: bool):
        def hook(x, ctx):
            if fail and x.shape[0] == len(PROMPTS[4]) and not marker.exists():
                marker.write_text(f"rank {rank.rank}")
                if crash:
                    os._exit(3)
                raise RuntimeError("injected failure")
        return [("hook_embed", hook)]

    with model.hooks(fail_once(out / "crashed-once", crash=True)):
        manifest = distributed.harvest(model, PROMPTS, ["blocks.1.hook_resid_post"], reduce=None, shard_size=3,
                                       out=out / "harvest")
    results = {f"tokens/{name}": value for name, value in distributed.read_harvest(manifest.parent).items()}
    with model.hooks(fail_once(out / "raised-once", crash=False)):
        harvested = distributed.harvest(model, PROMPTS, ["blocks.0.hook_resid_post", "blocks.1.hook_mlp_out"],
                                        reduce="mean", shard_size=3)
    results.update({f"mean/{name}": value for name, value in harvested.items()})
    probe = distributed.collect_activations(model, ["a cat", "the dog", "a bird sings", "one"],
                                            ["blocks.1.hook_resid_post"], shard_size=1)
    results["probe"] = probe["blocks.1.hook_resid_post"]
    for i, sweep in enumerate(distributed.patching_sweeps(model, PAIRS, shard_size=1, answers=(3, 4))):
        results[f"patching/{i}"] = sweep.grid
    results["squares"] = torch.tensor(distributed.sweep(list(range(7)), lambda n: n * n, shard_size=2))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    results = run(args.model, Path(args.out), args.fail)
    if distributed.this_rank().rank == 0:
        save_file({k: v.contiguous() for k, v in results.items()}, str(Path(args.out) / "results.safetensors"))


if __name__ == "__main__":
    main()
