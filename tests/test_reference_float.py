"""Our forward on the packed Q4_1/Q8_0 weights vs an independent float64 forward on gguf's dequantization.

The reference is written the Hugging Face way (un-permuted Q/K rows, rotate-half rope, repeated KV heads),
so it also checks the loader's handling of llama.cpp's rope permutation.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

PROMPTS = ["The capital of France is", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]


def reference_logits(path, ids: list[int]) -> torch.Tensor:
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}

    def w(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).double()

    n_layers, n_heads = meta["llama.block_count"], meta["llama.attention.head_count"]
    n_kv, eps, base = meta["llama.attention.head_count_kv"], meta["llama.attention.layer_norm_rms_epsilon"], meta["llama.rope.freq_base"]
    d_model = meta["llama.embedding_length"]
    d_head = d_model // n_heads

    def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
        return weight.reshape(heads, d_head // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)

    def norm(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotate(x, pos):  # x [heads, T, d_head], HF rotate_half convention
        inv = 1.0 / base ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        ang = pos[:, None].double() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        half = torch.cat([-x[..., d_head // 2:], x[..., : d_head // 2]], -1)
        return x * cos + half * sin

    T = len(ids)
    pos = torch.arange(T)
    emb = w("token_embd.weight")
    x = emb[ids]
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    for i in range(n_layers):
        p = f"blk.{i}."
        h = norm(x, w(p + "attn_norm.weight"))
        q = (h @ unpermute(w(p + "attn_q.weight"), n_heads).T).view(T, n_heads, d_head).transpose(0, 1)
        k = (h @ unpermute(w(p + "attn_k.weight"), n_kv).T).view(T, n_kv, d_head).transpose(0, 1)
        v = (h @ w(p + "attn_v.weight").T).view(T, n_kv, d_head).transpose(0, 1)
        q, k = rotate(q, pos), rotate(k, pos)
        k = k.repeat_interleave(n_heads // n_kv, 0)
        v = v.repeat_interleave(n_heads // n_kv, 0)
        att = (q @ k.transpose(1, 2) / d_head**0.5).masked_fill(mask, float("-inf")).softmax(-1)
        z = (att @ v).transpose(0, 1).reshape(T, d_model)
        x = x + z @ w(p + "attn_output.weight").T
        h = norm(x, w(p + "ffn_norm.weight"))
        gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ w(p + "ffn_down.weight").T
    x = norm(x, w("output_norm.weight"))
    return x @ emb.T


def test_embedded_model_matches_float64_reference(model, model_path):
    for prompt in PROMPTS:
        ids = model.tokenize(prompt)
        ours = model.forward(ids).double()
        ref = reference_logits(model_path, ids)
        assert ours.shape == ref.shape == (len(ids), model.config.vocab_size)
        # float32 activations over 30 layers: logits of magnitude ~20 agree to a few 1e-3
        assert (ours - ref).abs().max().item() < 2e-2, prompt
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
