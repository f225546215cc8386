"""The figures of docs/scaling.md, computed from the models' shapes: ``python scripts/scaling_plan.py``.

Weights at Q4_K_M's average of 4.85 bits a weight; activations and KV cache in bfloat16; decode at batch 1 reads every
weight a token touches once (the HBM roofline), at the bandwidths NVIDIA gives (H100 SXM 3.35 TB/s, H200 4.8 TB/s).
"""
from __future__ import annotations

BITS = 4.85
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
GB = 1e9


def llama_405b() -> dict:
    d, layers, heads, kv, d_head, d_mlp, vocab = 16384, 126, 128, 8, 128, 53248, 128256
    attn = 2 * d * heads * d_head + 2 * d * kv * d_head
    layer = attn + 3 * d * d_mlp
    return {"name": "Llama-3.1-405B", "layers": layers, "d_model": d, "layer_params": [layer] * layers,
            "embed": vocab * d, "unembed": vocab * d, "active": layers * layer + vocab * d,
            "kv_bytes_per_token": layers * 2 * kv * d_head * 2}


def deepseek_v3() -> dict:
    d, layers, dense, vocab = 7168, 61, 3, 129280
    heads, q_rank, kv_rank, rope, nope, v_head = 128, 1536, 512, 64, 128, 128
    attn = d * q_rank + q_rank * heads * (nope + rope) + d * (kv_rank + rope) + kv_rank * heads * (nope + v_head) \
        + heads * v_head * d
    dense_mlp = 3 * d * 18432
    expert = 3 * d * 2048
    moe = 256 * expert + expert + 256 * d  # routed experts, the shared one, the router
    params = [attn + dense_mlp] * dense + [attn + moe] * (layers - dense)
    active = dense * (attn + dense_mlp) + (layers - dense) * (attn + 9 * expert + 256 * d) + vocab * d
    return {"name": "DeepSeek-V3 (671B MoE)", "layers": layers, "d_model": d, "layer_params": params,
            "embed": vocab * d, "unembed": vocab * d, "active": active,
            "kv_bytes_per_token": layers * (kv_rank + rope) * 2}  # MLA caches the latent and the rope key


def split(sizes: list[int], parts: int) -> list[list[int]]:
    """Contiguous ranges of about equal size (as workbench.devices.split_layers does for equal devices)."""
    total, out, current, bound = sum(sizes), [[] for _ in range(parts)], 0, 0.0
    k = 0
    for size in sizes:
        while k < parts - 1 and current + size / 2 > total * (k + 1) / parts:
            k += 1
        out[k].append(size)
        current += size
    return out


def report(model: dict) -> None:
    to_bytes = BITS / 8
    total = (sum(model["layer_params"]) + model["embed"] + model["unembed"])
    print(f"## {model['name']}: {total / 1e9:.1f}B parameters, {total * to_bytes / GB:.1f} GB in Q4_K_M; "
          f"active per token {model['active'] / 1e9:.1f}B = {model['active'] * to_bytes / GB:.1f} GB read")
    for gpus in (8, 16):
        ranges = split(model["layer_params"], gpus)
        per = [sum(r) * to_bytes / GB for r in ranges]
        per[0] += model["embed"] * to_bytes / GB
        per[-1] += model["unembed"] * to_bytes / GB
        print(f"  layer split over {gpus}: layers {[len(r) for r in ranges]}, weights {min(per):.1f}-{max(per):.1f} GB "
              f"a GPU; KV cache {model['kv_bytes_per_token'] / 1024:.0f} KiB a token in all")
    boundary = model["d_model"] * 2
    print(f"  per token: {boundary / 1024:.0f} KiB over each range boundary (7 for 8 GPUs: "
          f"{7 * boundary / 1024:.0f} KiB); tensor parallel over 8: 2 all-reduces a layer of {boundary / 1024:.0f} "
          f"KiB, {2 * model['layers'] * 2 * 7 / 8 * boundary / 1e6:.1f} MB sent per GPU per token (ring)")
    for gpu, bandwidth in BANDWIDTH.items():
        seconds = model["active"] * to_bytes / bandwidth
        print(f"  {gpu}: batch-1 decode roofline, layer split (one GPU reads at a time): {seconds * 1e3:.1f} ms, "
              f"{1 / seconds:.1f} tok/s; at 60 % of it {0.6 / seconds:.1f} tok/s; tensor parallel over 8: "
              f"{seconds / 8 * 1e3:.2f} ms of reads, {8 / seconds:.0f} tok/s before all-reduce latency")


if __name__ == "__main__":
    report(llama_405b())
    report(deepseek_v3())
