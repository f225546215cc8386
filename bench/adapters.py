"""Decode tokens/s with a LoRA adapter beside the packed base against the base alone, side by side (target >= 0.8x).

    python bench/adapters.py [--model PATH] [--rank 16] [--modules all|attn] [--threads 2] [--decode 64] [--device cpu]

The adapter is random (B nonzero), on every projection of every layer with --modules all (the most a LoRA adds),
or on q/k/v/o alone with --modules attn. Base and adapter runs alternate, each figure the median of --repeats, so the
ratio comes from one run under the same machine load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import workbench
from workbench.adapters import PROJECTIONS, projection_shape
from workbench.generation import Sampling, generate_tokens


def write_random_adapter(path: Path, config, rank: int, projections: list[str]) -> Path:
    g = torch.Generator().manual_seed(0)
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


def decode_seconds(model: workbench.Model, prompt: list[int], n_new: int, adapter: str | None) -> float:
    """Seconds from the first new token (the prefill done) to the last: n_new - 1 decode steps."""
    tokens = generate_tokens(model.runner, prompt, n_new, Sampling(), stop_ids=set(), compiled=False,
                             lora=model.lora_terms(adapter))
    next(tokens)
    start = time.perf_counter()
    for _ in tokens:
        pass
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded model)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--modules", choices=["all", "attn"], default="all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = workbench.load(args.model, device=args.device)
    projections = list(PROJECTIONS) if args.modules == "all" else ["wq", "wk", "wv", "wo"]
    with tempfile.TemporaryDirectory() as tmp:
        model.load_adapter(write_random_adapter(Path(tmp) / "adapter", model.config, args.rank, projections), "bench")
    prompt = torch.randint(0, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[str | None, list[float]] = {None: [], "bench": []}
    for choice in times:  # warm-up
        decode_seconds(model, prompt, args.decode, choice)
    for _ in range(args.repeats):
        for choice in times:
            times[choice].append(decode_seconds(model, prompt, args.decode, choice))
    rate = {choice: (args.decode - 1) / statistics.median(t) for choice, t in times.items()}
    adapter = model.adapters["bench"]
    print(f"{model.config.name} on {args.device}, {args.threads} threads; adapter rank {args.rank} on "
          f"{', '.join(projections)} of {len(adapter.adapted_layers)} layers ({adapter.n_params:,} parameters)")
    print(f"decode base    {rate[None]:8.1f} tokens/s")
    print(f"decode adapter {rate['bench']:8.1f} tokens/s   ({rate['bench'] / rate[None]:.2f}x the base)")


if __name__ == "__main__":
    main()
