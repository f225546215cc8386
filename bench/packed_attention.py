"""A batch's attention over the packed rows against the padded path, by turns in one process (CUDA).

    python bench/packed_attention.py [--model PATH] [--dtype float32|bfloat16] [--rounds 7]

Without a cache, a batched forward on CUDA runs each prompt's attention in one Triton launch a layer over the packed
rows (``layer_ops.packed_attention``), with the rope of q and k inside it where no hook asks for them rotated; the
padded path (queries, keys and values gathered into ``[B, T_max]``, the scores, mask, softmax and pattern product,
then unpadded) is what it takes where that launch does not run. This times three paths on the same calls, alternating
round by round (median ms of ``--rounds`` after a warm-up): ``padded``, ``rope apart`` (the packed launch after the
rope's own two launches) and ``packed``:

- ``forward``: ``run_batch`` of 64 prompts of ``datasets/sentiment.jsonl`` with last-position logits only;
- ``record``: ``run_batch`` of 256 prompts recording every ``hook_resid_post`` (task (a) of vs_transformerlens.py);
- ``lens``: ``probes.logit_lens_batch`` of 64 prompts (task (d)).

It also prints how far the two paths' last-position logits are apart and from each prompt run alone, and whether the
lens's top-1 ids agree.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import workbench
from workbench import probes
from workbench.kernels import layer_ops
from workbench.probes import load_dataset


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("packed attention runs on CUDA; the CPU keeps the padded path")
    model = workbench.load(args.model, device="cuda", dtype=args.dtype)
    texts = load_dataset("sentiment").prompts
    ids = [model.to_ids(texts[i % len(texts)]) for i in range(256)]
    resid = [f"blocks.{i}.hook_resid_post" for i in range(model.config.n_layers)]
    jobs: dict[str, Callable[[], Any]] = {
        "forward": lambda: model.run_batch(ids[:64], logits="last"),
        "record": lambda: model.run_batch(ids, record=resid, logits="last"),
        "lens": lambda: probes.logit_lens_batch(model, ids[:64], k=10),
    }
    packed = layer_ops.packed_attention

    def rope_apart(*args: Any, **kwargs: Any) -> torch.Tensor | None:  # refused with a rotation: the runner ropes first
        return None if len(args) > 7 or kwargs.get("rotation") is not None else packed(*args, **kwargs)

    # None from packed_attention: the runner takes the next path (the rope apart, then the padded one)
    paths = {"padded": lambda *args, **kwargs: None, "rope apart": rope_apart, "packed": packed}
    seconds: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], Any] = {}
    try:
        for round_ in range(args.rounds):
            for path in (list(paths)[::-1] if round_ % 2 else list(paths)):
                layer_ops.packed_attention = paths[path]
                for name, job in jobs.items():
                    if round_ == 0:
                        job()
                    dt, outputs[name, path] = timed(job)
                    seconds.setdefault((name, path), []).append(dt)
    finally:
        layer_ops.packed_attention = packed
    print(f"{model.config.name} on {torch.cuda.get_device_name()}, {args.dtype}, torch {torch.__version__}")
    for name in jobs:
        padded, apart, fused = (statistics.median(seconds[name, p]) * 1e3 for p in paths)
        print(f"{name:8s} padded {padded:7.1f} ms   rope apart {apart:7.1f} ms   packed {fused:7.1f} ms   "
              f"{padded / fused:.2f}x the padded, {apart / fused:.2f}x the rope apart")
    last = {p: torch.cat([t.logits for t in outputs["forward", p]]) for p in paths}
    alone = torch.cat([model.forward(p)[-1:].cpu() for p in ids[:64]])
    print(f"last logits: packed vs padded max |diff| {(last['packed'] - last['padded']).abs().max().item():.3g}; "
          f"vs each prompt alone: packed {(last['packed'] - alone).abs().max().item():.3g}, "
          f"padded {(last['padded'] - alone).abs().max().item():.3g}")
    top = {p: torch.cat([lens.top_ids["resid_post"][..., 0].flatten() for lens in outputs["lens", p]]) for p in paths}
    print(f"lens top-1 equal at {int((top['packed'] == top['padded']).sum())} of {top['packed'].numel()} cells; "
          f"the rope inside the launch keeps the bits of the rope apart: "
          f"{torch.equal(last['packed'], torch.cat([t.logits for t in outputs['forward', 'rope apart']]))}")


if __name__ == "__main__":
    main()
