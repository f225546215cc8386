"""llama.cpp numerics' glue (``workbench.kernels.llamacpp_ops``) against direct, value-by-value transcriptions of
ggml-cpu's loops (``ggml/src/ggml-cpu/ops.cpp``: ``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` and
``..._tiled``; ``vec.h``: ``ggml_v_expf``) on small random inputs: every output bit for bit. The transcriptions run in
numpy scalars, one query row and one key at a time, each float32 fused multiply-add as its float64 sum rounded once.
That the emulation is llama.cpp's own arithmetic is checked against llama.cpp itself in tests/test_llamacpp_reference.py
(the embedded model's logits) and tests/test_parity.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from workbench.kernels import cpu, layer_ops, llamacpp_ops, numerics
from workbench.runner import gguf_head_order

f32, f16 = np.float32, np.float16


def fma(a, b, c) -> np.float32:
    return f32(float(a) * float(b) + float(c))


def expf(x) -> np.float32:
    return f32(math.exp(float(x))) if x != -np.inf else f32(0.0)


def v_expf(x) -> np.float32:
    """ggml_v_expf (AVX-512) of one value."""
    r = f32(float.fromhex("0x1.8p23"))
    z = fma(x, f32(float.fromhex("0x1.715476p+0")), r)
    n = f32(z - r)
    b = fma(-n, f32(float.fromhex("0x1.7f7d1cp-20")), fma(-n, f32(float.fromhex("0x1.62e4p-1")), x))
    u = f32(b * b)
    j = fma(fma(fma(f32(float.fromhex("0x1.0e4020p-7")), b, f32(float.fromhex("0x1.573e2ep-5"))), u,
                fma(f32(float.fromhex("0x1.555e66p-3")), b, f32(float.fromhex("0x1.fffdb6p-2")))),
            u, fma(f32(float.fromhex("0x1.ffffecp-1")), b, f32(1.0)))
    if abs(n) > 192:
        return f32(0.0) if n <= 0 else f32(np.inf)
    with np.errstate(over="ignore"):
        return f32(math.ldexp(float(j), int(n)))  # exact but for subnormal results (rounded once)


def vec_dot_f16(x: np.ndarray, y: np.ndarray) -> np.float32:
    """ggml_vec_dot_f16 with AVX-512 FP16: 4 float32 registers of 16 lanes over steps of 64, reduced, leftovers in
    double."""
    n = len(x)
    full = n - n % 64
    acc = np.zeros((4, 16), dtype=f32)
    for i in range(0, full, 64):
        for j in range(4):
            for lane in range(16):
                k = i + 16 * j + lane
                acc[j, lane] = fma(f32(x[k]), f32(y[k]), acc[j, lane])
    acc[0] = acc[0] + acc[2]
    acc[1] = acc[1] + acc[3]
    v = acc[0] + acc[1]
    while len(v) > 1:
        v = v[: len(v) // 2] + v[len(v) // 2:]
    total = float(v[0])
    for k in range(full, n):
        total += float(f32(f32(x[k]) * f32(y[k])))
    return f32(total)


def ggml_one_chunk(q, k, v, mask, scale) -> np.ndarray:
    """``..._f16_one_chunk``: q [H, T, D] float32, k, v [KV, S, D] float16, mask [T, S] (0 or -inf)."""
    heads, tokens, d = q.shape
    out = np.zeros((heads, tokens, v.shape[-1]), dtype=f32)
    for h in range(heads):
        kv = h // (heads // k.shape[0])
        for t in range(tokens):
            S, M = f32(0.0), f32(-np.inf)
            acc = np.zeros(v.shape[-1], dtype=f16)
            q16 = q[h, t].astype(f16)
            for ic in range(k.shape[1]):
                if mask[t, ic] == -np.inf:
                    continue
                s = f32(vec_dot_f16(k[kv, ic], q16) * scale)
                s = f32(s + mask[t, ic])
                ms, vs = f32(1.0), f32(1.0)
                if s > M:
                    m_old, M = M, s
                    ms = expf(f32(m_old - M))
                    for i in range(len(acc)):  # ggml_vec_scale_f16: native F16 over steps of 128, F32 past them
                        full = len(acc) - len(acc) % 128
                        factor = f32(f16(ms)) if i < full else ms
                        acc[i] = f16(f32(acc[i]) * factor)
                else:
                    vs = expf(f32(s - M))
                for i in range(len(acc)):  # ggml_vec_mad_f16
                    full = len(acc) - len(acc) % 128
                    weight = f32(f16(vs)) if i < full else vs
                    acc[i] = f16(float(acc[i]) + float(v[kv, ic, i]) * float(weight))
                S = fma(S, ms, vs)
            inverse = f32(0.0) if S == 0 else f32(1.0) / S
            out[h, t] = acc.astype(f32) * inverse
    return out


def ggml_tiled(q, k, v, mask, scale, tile=64) -> np.ndarray:
    """``..._tiled`` (shapes as ``ggml_one_chunk``'s)."""
    heads, tokens, d = q.shape
    out = np.zeros((heads, tokens, v.shape[-1]), dtype=f32)
    keys, values = k.astype(f32), v.astype(f32)
    for h in range(heads):
        kv = h // (heads // k.shape[0])
        for t in range(tokens):
            S, M = f32(0.0), f32(-np.inf)
            acc = np.zeros(v.shape[-1], dtype=f32)
            for start in range(0, k.shape[1], tile):
                n = min(tile, k.shape[1] - start)
                kq = np.full(tile, -np.inf, dtype=f32)
                for j in range(n):
                    dot = f32(0.0)
                    for i in range(d):
                        dot = fma(q[h, t, i], keys[kv, start + j, i], dot)
                    kq[j] = f32(f32(dot * scale) + mask[t, start + j])
                tile_max = kq.max()
                if tile_max == -np.inf:
                    continue
                m_new = max(M, tile_max)
                if m_new > M:
                    ms = expf(f32(M - m_new))
                    acc = (acc * ms).astype(f32)
                    S = f32(S * ms)
                M = m_new
                weights = np.array([v_expf(f32(x - M)) for x in kq], dtype=f32)
                total = 0.0
                for group in range(tile // 16):
                    lanes = weights[16 * group:16 * group + 16]
                    while len(lanes) > 1:
                        lanes = (lanes[: len(lanes) // 2] + lanes[len(lanes) // 2:]).astype(f32)
                    total += float(lanes[0])
                S = f32(float(S) + total)
                for j in range(n):
                    for i in range(len(acc)):
                        acc[i] = fma(weights[j], values[kv, start + j, i], acc[i])
            inverse = f32(0.0) if S == 0 else f32(1.0) / S
            out[h, t] = acc * inverse
    return out


def random_attention(tokens: int, cached: int, heads: int, kv_heads: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, d, generator=g) * 2
    keys = torch.randn(kv_heads, cached + tokens, d, generator=g) * 2
    values = torch.randn(kv_heads, cached + tokens, d, generator=g)
    slots = torch.arange(cached + tokens)
    blocked = slots[None, :] > (cached + torch.arange(tokens))[:, None]  # causal over the cache and the new tokens
    return q, keys, values, blocked


@pytest.mark.parametrize("kernels", ["c++", "torch"])
@pytest.mark.parametrize("tokens,cached,heads,kv_heads,d",
                         [(4, 3, 4, 2, 64), (3, 2, 2, 1, 144), (5, 0, 2, 2, 20), (1, 150, 4, 2, 128)])
def test_one_chunk_attention_is_ggml_loop(tokens, cached, heads, kv_heads, d, kernels, monkeypatch):
    """Fewer than 64 queries: the F16-accumulating kernel, in C++ and as its torch loop; d = 144 takes both the native
    F16 and the scalar F32 paths of the F16 vector ops and the dot's leftovers, d = 20 only leftovers. A decode step
    over 150 keys with heads of 128 meets sums of the native F16 multiply-add that lie just off an F16 tie, which one
    rounding keeps off it (rounding to float32 first, as torch's float64-to-F16 conversion does, gave 4 values off)."""
    if kernels == "torch":
        monkeypatch.setattr(cpu, "extension", lambda: None)
    elif cpu.extension() is None:
        pytest.skip("the C++ CPU kernels are not available")
    q, keys, values, blocked = random_attention(tokens, cached, heads, kv_heads, d, seed=d)
    z = llamacpp_ops.attention(q, keys, values, math.sqrt(d), blocked)
    mask = np.where(blocked.numpy(), -np.inf, 0.0).astype(f32)
    expected = ggml_one_chunk(q.transpose(0, 1).numpy(), keys.half().numpy(), values.half().numpy(), mask,
                              f32(1.0) / f32(math.sqrt(d)))
    assert torch.equal(z.transpose(0, 1), torch.from_numpy(expected))


@pytest.mark.parametrize("kernels", ["c++", "torch"])
def test_tiled_attention_is_ggml_loop(kernels, monkeypatch):
    """From 64 queries on: the tiled kernel, over two key tiles (the second partial), with a cache before the prompt;
    its FMA chains and exp through the C++ kernels, and through their torch fallbacks."""
    if kernels == "torch":
        monkeypatch.setattr(cpu, "extension", lambda: None)
    elif cpu.extension() is None:
        pytest.skip("the C++ CPU kernels are not available")
    q, keys, values, blocked = random_attention(66, 4, 2, 1, 16, seed=1)
    z = llamacpp_ops.attention(q, keys, values, 4.0, blocked)
    mask = np.where(blocked.numpy(), -np.inf, 0.0).astype(f32)
    expected = ggml_tiled(q.transpose(0, 1).numpy(), keys.half().numpy(), values.half().numpy(), mask, f32(0.25))
    assert torch.equal(z.transpose(0, 1), torch.from_numpy(expected))


def test_one_chunk_differs_from_float32_attention():
    """The emulation is not float32 attention by another name: the F16 accumulator moves outputs by ~1e-3."""
    q, keys, values, blocked = random_attention(6, 0, 2, 1, 64, seed=3)
    z = llamacpp_ops.attention(q, keys, values, 8.0, blocked)
    plain = layer_ops.attention(q, keys, values, 8.0, blocked)
    assert 1e-5 < (z - plain).abs().max() < 1e-2


def test_v_expf_is_the_transcription():
    x = torch.cat((torch.randn(2000) * 30 - 10, torch.tensor([-np.inf, 0.0, -90.0, -103.9, -150.0, 88.0, 200.0])))
    expected = torch.tensor([v_expf(f32(v)) for v in x.tolist()])
    assert torch.equal(llamacpp_ops._v_expf_formula(x), expected)
    if cpu.extension() is not None:
        assert torch.equal(llamacpp_ops.v_expf(x), expected)


def test_runner_takes_the_emulation_in_llamacpp_numerics_only(tiny_model):
    """A forward in llama.cpp numerics runs the emulated attention (its hook_z equals the emulation of its own q, k,
    v); exact numerics keep the float32 attention."""
    model = tiny_model("llama", "Q8_0", seed=3, device="cpu")
    ids = list(range(1, 9))
    for mode in ("llamacpp", "exact"):
        with numerics(mode):
            trace = model.run(ids, record=["blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k",
                                           "blocks.0.attn.hook_v", "blocks.0.attn.hook_z"])
        acts = {k.split(".")[-1]: v for k, v in trace.activations.items()}
        q, k, v = (acts[n] for n in ("hook_rot_q", "hook_rot_k", "hook_v"))
        if model.config.rope_interleaved:  # the hooks show Hugging Face's head order; the kernel sums in the file's
            q, k = gguf_head_order(q), gguf_head_order(k)
        blocked = torch.ones(len(ids), len(ids), dtype=torch.bool).triu(1)
        emulated = llamacpp_ops.attention(q, k.transpose(0, 1), v.transpose(0, 1), model.runner.attn_scale, blocked)
        assert torch.equal(acts["hook_z"], emulated) == (mode == "llamacpp")


def test_glue_kernels_give_the_formulas_bits(monkeypatch):
    """RMSNorm, SwiGLU (strided rows, and a tail past the last group of sixteen) and the rope (both pair layouts) in
    C++ give the torch formulas' bits, over activations from 1e-2 to 1e2."""
    if cpu.extension() is None:
        pytest.skip("the C++ CPU kernels are not available")
    g = torch.Generator().manual_seed(0)
    cases = []
    for scale in (1e-2, 1.0, 1e2):
        x, weight = torch.randn(7, 576, generator=g) * scale, torch.randn(576, generator=g)
        gate = torch.randn(7, 2 * 1552, generator=g)[:, :1552] * scale  # rows strided, as a fused output's half
        gate_tail, up_tail = torch.randn(7, 1550, generator=g) * scale, torch.randn(7, 1550, generator=g)
        q, cos, sin = (torch.randn(7, 9, 64, generator=g) * scale, torch.randn(7, 1, 64, generator=g),
                       torch.randn(7, 1, 64, generator=g))
        up = torch.randn(gate.shape, generator=g)
        cases += [(llamacpp_ops.rms_norm, (x, weight, 1e-5)), (llamacpp_ops.swiglu, (gate, up)),
                  (llamacpp_ops.swiglu, (gate_tail, up_tail)), (llamacpp_ops.rope, (q, cos, sin, False)),
                  (llamacpp_ops.rope, (q, cos, sin, True))]
    fused = [fn(*args) for fn, args in cases]
    monkeypatch.setattr(llamacpp_ops, "_glue_kernels", lambda *tensors: None)
    for (fn, args), out in zip(cases, fused):
        expected = fn(*args)
        pairs = zip(out, expected) if isinstance(out, tuple) else [(out, expected)]
        assert all(torch.equal(a, b) for a, b in pairs), fn.__name__
