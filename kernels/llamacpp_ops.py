"""llama.cpp's CPU glue between the matmuls, operation by operation, for ``numerics("llamacpp")``: RMSNorm, the
rope, SwiGLU and attention as ggml-cpu computes them (``ggml/src/ggml-cpu/ops.cpp``, ``vec.h``, ``vec.cpp``), so that
with the integer dot products of the llama.cpp-numerics matmuls a forward gives llama.cpp's activations bit for bit.

* **RMSNorm** (``ggml_compute_forward_rms_norm_f32``): the squares (float32) summed in double, the mean rounded to
  float32, ``1.0f / sqrtf(mean + eps)``, then ``(x * scale) * weight``.
* **Rope** (``ggml_rope_cache_init``, ``rotate_pairs``): each position's angle starts at the position and is multiplied
  by ``powf(base, -2 / n_dims)`` pair by pair in float32; ``cosf``/``sinf`` of it; the pair rotated with the first
  product of each output fused into the subtraction/addition (the compiler's contraction).
* **SwiGLU** (``ggml_vec_swiglu_f32``): ``x / (1 + ggml_v_expf(-x)) * g``, with ggml's polynomial exp.
* **Attention**: llama.cpp runs it on the CPU as ``ggml_flash_attn_ext`` (flash attention "auto" is on for the CPU),
  computed by ``ggml_compute_forward_flash_attn_ext_f16`` over the F16 KV cache. Two kernels share it, chosen by the
  number of query tokens of the batch:

  - fewer than ``Q_TILE`` (64): ``..._f16_one_chunk``, one key at a time per query row. The query is rounded to F16,
    each score is ``ggml_vec_dot_f16`` (F32 products summed in sixteen lanes, reduced as a tree), scaled, then an
    online softmax whose weighted values accumulate **in an F16 buffer**: at each new maximum the buffer is scaled by
    ``expf(M_old - M)``, then every key adds ``v * expf(s - M)``, each step rounded to F16. At the end the buffer is
    widened to F32 and multiplied by ``1 / S``.
  - from ``Q_TILE`` on: ``..._tiled``, over tiles of ``KV_TILE`` keys. The query stays F32, keys and values are
    widened from F16; each score and each output value is a chain of F32 fused multiply-adds, in key (or dimension)
    order (``simd_gemm``); each tile's weights are ``ggml_v_expf(s - M)`` and their sum is added in double precision,
    lane group by lane group.

This reproduces the AVX-512 build of llama-cpp-python 0.3.36 (AVX-512 FP16 included: attention values of 128 dims and
more accumulate in native F16 arithmetic, shorter ones through the scalar F32 path), vectorised over batch, heads and
queries, with a loop over keys (one-chunk) or tiles (tiled). A float32 fused multiply-add is computed in float64 and
rounded once to float32: the product of two float32 values is exact in float64, so only a sum that lands on a float32
tie after float64 rounding can differ (rare). ``libm``'s ``expf``, ``cosf``, ``sinf`` and ``powf`` are taken as the
float64 function rounded to float32 (they are correctly rounded but for rare arguments). Not covered: the decode path
that splits 512 or more cached keys over threads (a single query token), which runs here as the one-chunk kernel over
every key, and other instruction sets' builds (AVX2 has another exp and other lane counts).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Callable

import numpy as np
import torch

from . import cpu

Q_TILE = 64  # GGML_FA_TILE_Q: from this many query tokens on, the tiled kernel runs
KV_TILE = 64  # GGML_FA_TILE_KV
F32_LANES = 16  # GGML_F32_EPR with AVX-512
DOT_STEP = 64  # GGML_F16_DOT_STEP (= GGML_F32_STEP with AVX-512 FP16): four registers of sixteen lanes
F16_STEP = 128  # GGML_F16_STEP with AVX-512 FP16: values past the last full step take the scalar F32 path


def _glue_kernels(*tensors: torch.Tensor) -> Any:
    """The C++ kernels' ops where the glue's float32 CPU tensors can take them, else None; None as well under
    ``layer_ops.torch_formulas()``, as for the exact glue (``bench/eager_forward.py`` times what they save)."""
    from . import layer_ops  # which imports this module

    if not layer_ops._FORCE_TORCH["on"] and all(t.is_cpu and t.dtype == torch.float32 for t in tensors):
        return cpu.extension()
    return None


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a * b + c`` rounded once."""
    return (a.double() * b.double() + c.double()).float()


def _expf(x: torch.Tensor) -> torch.Tensor:
    """libm's ``expf`` (correctly rounded but for rare cases): the float64 exp rounded to float32. On the CPU through
    numpy: torch's float64 exp wakes its thread pool even for a few values (milliseconds a call on a busy machine)."""
    if x.is_cpu:
        with np.errstate(over="ignore"):
            return torch.from_numpy(np.exp(x.double().numpy()).astype(np.float32))
    return x.double().exp().float()


def _divide(a: torch.Tensor | float, b: torch.Tensor) -> torch.Tensor:
    """float32 ``a / b`` correctly rounded (computed in float64, which rounds it once more harmlessly; torch's float32
    ``sqrt`` on the CPU is not always correctly rounded, so square roots are taken the same way)."""
    return ((a.double() if isinstance(a, torch.Tensor) else a) / b.double()).float()


def _reduce_lanes(x: torch.Tensor) -> torch.Tensor:
    """``_mm512_reduce_add_ps`` of ``[..., 16]`` float32: halves added three times, then the last two lanes."""
    while x.shape[-1] > 2:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0] + x[..., 1]


def vec_dot_f16(q16: torch.Tensor, k16: torch.Tensor) -> torch.Tensor:
    """``ggml_vec_dot_f16`` of each query row ``[..., T, D]`` with each key row ``[..., S, D]`` (both float16):
    float32 ``[..., T, S]``. Products of F16 values are exact in F32; they are summed in four registers of sixteen
    lanes over the full steps of 64, the registers added pairwise (0+2, 1+3, then 0+1) and the lanes as a tree, and the
    products past the last full step added one by one in double precision."""
    d = q16.shape[-1]
    full = d - d % DOT_STEP
    q, k = q16.float(), k16.float()
    total = q.new_zeros(*q.shape[:-1], k.shape[-2], dtype=torch.float64)
    if full:
        products = q[..., :, None, :full] * k[..., None, :, :full]  # [..., T, S, full]
        steps = products.unflatten(-1, (full // DOT_STEP, 4, F32_LANES))
        registers = steps[..., 0, :, :]
        for i in range(1, steps.shape[-3]):
            registers = registers + steps[..., i, :, :]
        registers = registers[..., :2, :] + registers[..., 2:, :]
        total = _reduce_lanes(registers[..., 0, :] + registers[..., 1, :]).double()
    for i in range(full, d):
        total = total + (q[..., :, None, i] * k[..., None, :, i]).double()
    return total.float()


def _scale_f16(acc: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``ggml_vec_scale_f16``: ``acc`` (float16 ``[..., D]``) times the float32 ``factor`` ``[...]``; native F16
    products over the full steps of 128 (the factor rounded to F16), F32 products rounded to F16 past them."""
    full = acc.shape[-1] - acc.shape[-1] % F16_STEP
    tail = (acc[..., full:].float() * factor[..., None]).half()
    if not full:
        return tail
    head = (acc[..., :full].float() * factor.half().float()[..., None]).half()  # exact in F32, one rounding to F16
    return torch.cat((head, tail), dim=-1)


def _mad_f16(acc: torch.Tensor, v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``ggml_vec_mad_f16``: ``acc + v * weight`` (float16 ``[..., D]``, the float32 ``weight`` ``[...]``); a native F16
    fused multiply-add over the full steps of 128 (the weight rounded to F16), an F32 one rounded to F16 past them."""
    full = acc.shape[-1] - acc.shape[-1] % F16_STEP
    tail = _fma(v[..., full:].float(), weight[..., None], acc[..., full:].float()).half()
    if not full:
        return tail
    head = _half_once(acc[..., :full].double() + v[..., :full].double() * weight.half().double()[..., None])
    return torch.cat((head, tail), dim=-1)


def _half_once(e: torch.Tensor) -> torch.Tensor:
    """float64 ``e`` rounded once to float16, as a native F16 fused multiply-add rounds its exact result (torch's
    ``.half()`` of a float64 rounds to float32 first, which can move a value that lies just off a tie onto it): through
    float32 rounded to odd, which float16's round-to-nearest then rounds as it would round ``e``."""
    f = e.float()
    toward_zero = torch.where(f.double().abs() > e.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where(f.double() != e, odd, f).half()


def v_expf(x: torch.Tensor) -> torch.Tensor:
    """ggml's AVX-512 ``ggml_v_expf`` (``ggml-cpu/vec.h``) of float32 ``x``: exp by range reduction and a degree-5
    polynomial, each step a float32 operation or fused multiply-add (the C++ kernel's ``ggml_expf`` where it runs)."""
    ext = _glue_kernels(x)
    if ext is not None:
        return ext.ggml_expf(x.contiguous())
    return _v_expf_formula(x)


def _v_expf_formula(x: torch.Tensor) -> torch.Tensor:
    """``v_expf`` in torch operations (float32 fused multiply-adds through float64)."""
    f32 = torch.float32

    def c(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=f32, device=x.device)

    r = c(float.fromhex("0x1.8p23"))
    z = _fma(x, c(float.fromhex("0x1.715476p+0")), r)
    n = z - r
    b = _fma(-n, c(float.fromhex("0x1.7f7d1cp-20")), _fma(-n, c(float.fromhex("0x1.62e4p-1")), x))
    u = b * b
    j = _fma(_fma(_fma(c(float.fromhex("0x1.0e4020p-7")), b, c(float.fromhex("0x1.573e2ep-5"))), u,
                  _fma(c(float.fromhex("0x1.555e66p-3")), b, c(float.fromhex("0x1.fffdb6p-2")))),
             u, _fma(c(float.fromhex("0x1.ffffecp-1")), b, c(1.0)))
    # _mm512_scalef_ps: j * 2**n, exact but for subnormal results; 2**n built from its float64 exponent bits
    powers = ((n.clamp(-1022, 1023).to(torch.int64) + 1023) << 52).view(torch.float64)
    res = (j.double() * powers).float()
    big = n.abs() > 192
    if bool(big.any()):
        res = torch.where(big, torch.where(n <= 0, 0.0, float("inf")).to(f32), res)
    return res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_ops.rms_norm`` as ``ggml_compute_forward_rms_norm_f32`` computes it (float32 ``x``); the C++ kernel's
    ``llamacpp_rms_norm`` where it runs (rows ``[T, d]`` on the CPU), the same steps below elsewhere."""
    ext = _glue_kernels(x, weight)
    if ext is not None and x.dim() == 2:
        return ext.llamacpp_rms_norm(x.contiguous(), weight.contiguous(), eps)
    squares = (x * x).double().sum(-1, keepdim=True)
    mean = (squares / x.shape[-1]).float()
    scale = _divide(1.0, (mean + float(np.float32(eps))).double().sqrt().float())
    return scale, x * scale * weight


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``ggml_vec_swiglu_f32``: ``silu(gate) * up`` with ggml's AVX-512 silu, ``x / (1 + ggml_v_expf(-x))``, over
    groups of sixteen values; the values past the last group take libm's ``expf``. The C++ kernel's
    ``llamacpp_swiglu`` where it runs."""
    ext = _glue_kernels(gate, up)
    if ext is not None and gate.dim() == 2 and gate.shape == up.shape and gate.stride(-1) == up.stride(-1) == 1:
        return ext.llamacpp_swiglu(gate, up)
    full = gate.shape[-1] - gate.shape[-1] % F32_LANES
    silu = torch.cat((_divide(gate[..., :full], 1.0 + v_expf(0.0 - gate[..., :full])),
                      _divide(gate[..., full:], 1.0 + _expf(-gate[..., full:]))), dim=-1)
    return silu * up


def _libm_f32(name: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """The C library's float32 function ``name`` (``cosf``...) applied to each value of an array, or None where there is
    no C math library to load."""
    path = ctypes.util.find_library("m")
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(path), name)
    fn.argtypes, fn.restype = [ctypes.c_float], ctypes.c_float
    return np.frompyfunc(fn, 1, 1)


def rope_table(n_ctx: int, n_dims: int, base: float, scale: float, freq_factors: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[n_ctx, n_dims / 2]`` of ggml's rope angles (``ggml_rope_cache_init``): the angle of pair ``i`` at
    position ``p`` is ``p * theta_scale**i`` multiplied out pair by pair in float32, ``theta_scale = powf(base, -2.0f /
    n_dims)``, divided by the pair's frequency factor and multiplied by ``freq_scale = 1 / scale``. Their cos and sin
    come from the C library's ``cosf`` and ``sinf``, which llama.cpp calls: glibc's are not correctly rounded (about
    one value in twenty differs from the float64 cos rounded to float32)."""
    theta_scale = float(np.float32(np.float64(np.float32(base)) ** np.float64(np.float32(-2.0) / np.float32(n_dims))))
    theta = torch.arange(n_ctx, dtype=torch.float32)
    angles = []
    for i in range(n_dims // 2):
        factor = 1.0 if freq_factors is None else float(freq_factors[i])
        angles.append((theta / factor) * float(np.float32(1.0) / np.float32(scale)))
        theta = theta * theta_scale
    angles = torch.stack(angles, dim=-1)
    cosf, sinf = _libm_f32("cosf"), _libm_f32("sinf")
    if cosf is None:
        return angles.double().cos().float(), angles.double().sin().float()
    values = angles.numpy()
    return (torch.from_numpy(cosf(values).astype(np.float32)), torch.from_numpy(sinf(values).astype(np.float32)))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``layer_ops.rope``'s rotation (same arguments) as ``rotate_pairs`` computes it: ``x0 * cos - x1 * sin`` and
    ``x0 * sin + x1 * cos``, each the second product rounded and the first fused into the sum. The C++ kernel's
    ``llamacpp_rope`` where it runs (``x`` ``[T, heads, d]`` on the CPU)."""
    ext = _glue_kernels(x, cos, sin)
    if ext is not None and x.dim() == 3 and cos.dim() == 3:
        return ext.llamacpp_rope(x.contiguous(), cos.contiguous(), sin.contiguous(), interleaved)
    half = x.shape[-1] // 2
    shape, member_axis = ((half, 2), -1) if interleaved else ((2, half), -2)
    x0, x1 = x.float().unflatten(-1, shape).unbind(member_axis)
    c = cos.unflatten(-1, shape).select(member_axis, 0)
    s = sin.unflatten(-1, shape).select(member_axis, 1)
    first = _fma(x0, c, -(x1 * s))
    second = _fma(x0, s, x1 * c)
    return torch.stack((first, second), dim=member_axis).flatten(-2).to(x.dtype)


def _reach(allowed: torch.Tensor) -> int:
    """One past the last key any query may see (0: none)."""
    seen = allowed.reshape(-1, allowed.shape[-1]).any(dim=0).nonzero()
    return int(seen[-1]) + 1 if seen.numel() else 0


def _one_chunk(q: torch.Tensor, k16: torch.Tensor, v16: torch.Tensor, scale: float,
               allowed: torch.Tensor) -> torch.Tensor:
    """``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` for every row: ``q`` ``[..., H, T, D]`` float32,
    ``k16``/``v16`` ``[..., H_kv, S, D]`` float16 (each serving ``H / H_kv`` query heads), ``allowed`` ``[..., H|1, T,
    S]``; float32 ``[..., H, T, D]``.

    On the CPU the C++ kernel's ``flash_attn_one_chunk``, the same loop with the same bits, a query row a thread at a
    time, reading each key-value head where its query heads share it (the loop below takes ~15 small tensor ops a key,
    most of a decode step); elsewhere the loop below."""
    ext = _glue_kernels(q)
    if ext is not None:
        rows, kv_rows = q.shape[:-2], (*q.shape[:-3], k16.shape[-3])
        flat = [t.reshape(-1, *t.shape[-2:]).contiguous()
                for t in (q, k16.expand(*kv_rows, *k16.shape[-2:]), v16.expand(*kv_rows, *v16.shape[-2:]),
                          allowed.expand(*rows, *allowed.shape[-2:]))]
        return ext.flash_attn_one_chunk(*flat, scale).view(*rows, q.shape[-2], v16.shape[-1])
    k16, v16 = _query_heads(k16, q), _query_heads(v16, q)
    scores = vec_dot_f16(q.half(), k16) * scale
    M = scores.new_full(scores.shape[:-1], float("-inf"))
    S = scores.new_zeros(scores.shape[:-1])
    acc = v16.new_zeros(*scores.shape[:-1], v16.shape[-1])
    for ic in range(_reach(allowed)):
        seen = allowed[..., ic].expand_as(M)
        s = scores[..., ic]
        higher = seen & (s > M)  # a new maximum: scale what was accumulated, weigh this key by exp(0) = 1
        ms = torch.where(higher, _expf(M - s), 1.0)
        vs = torch.where(higher | ~seen, 1.0, _expf(s - M))
        M = torch.where(higher, s, M)
        acc = torch.where(higher[..., None], _scale_f16(acc, ms), acc)
        acc = torch.where(seen[..., None], _mad_f16(acc, v16[..., ic:ic + 1, :], vs), acc)
        S = torch.where(seen, _fma(S, ms, vs), S)
    inverse = torch.where(S == 0, 0.0, _divide(1.0, S))
    return acc.float() * inverse[..., None]


def _query_heads(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Keys or values ``[..., H_kv, S, D]`` repeated for the query heads that share each: ``[..., H, S, D]``."""
    return kv.repeat_interleave(q.shape[-3] // kv.shape[-3], dim=-3)


def _fma_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``c + a @ b`` of float32 ``[..., R, K] x [..., K, J]``, each output a chain of fused multiply-adds in ``k``
    order from ``c`` (ggml's ``simd_gemm``): the C++ kernel's ``fma_chain`` where it runs, else in float64 here."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
    ext = _glue_kernels(a, b, c)
    if ext is not None:
        a, b, c = (t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:]).contiguous() for t in (a, b, c))
        return ext.fma_chain(a, b, c).view(*batch, *c.shape[-2:])
    acc = c.expand(*batch, *c.shape[-2:])
    a64, b64 = a.double(), b.double()
    for k in range(a.shape[-1]):
        acc = (acc.double() + a64[..., :, k:k + 1] * b64[..., k:k + 1, :]).float()
    return acc


def _tiled(q: torch.Tensor, k16: torch.Tensor, v16: torch.Tensor, scale: float,
           allowed: torch.Tensor) -> torch.Tensor:
    """``ggml_compute_forward_flash_attn_ext_tiled`` for every row (shapes as ``_one_chunk``'s). Each tile is computed
    for the query rows that see any of its keys (the others skip it, as ggml's do)."""
    keys, values = _query_heads(k16, q).float(), _query_heads(v16, q).float()
    M = q.new_full(q.shape[:-1], float("-inf"))
    S = q.new_zeros(q.shape[:-1])
    acc = q.new_zeros(*q.shape[:-1], values.shape[-1])
    for start in range(0, _reach(allowed), KV_TILE):
        stop = min(start + KV_TILE, keys.shape[-2])
        sees = allowed[..., start:stop].reshape(-1, allowed.shape[-2], stop - start).any(-1).any(0).nonzero()
        if not sees.numel():
            continue
        rows = slice(int(sees[0]), int(sees[-1]) + 1)
        # KQ: a chain of float32 fused multiply-adds over the head dimension, from zero; scaled; masked
        tile_keys = keys[..., start:stop, :]
        dots = _fma_matmul(q[..., rows, :], tile_keys.transpose(-1, -2),
                           q.new_zeros(*q.shape[:-2], rows.stop - rows.start, stop - start))
        kq = (dots * scale).masked_fill(~allowed[..., rows, start:stop], float("-inf"))
        if stop - start < KV_TILE:  # the last tile is padded with -inf: the exp's lanes see 64 keys
            kq = torch.cat((kq, kq.new_full((*kq.shape[:-1], KV_TILE - (stop - start)), float("-inf"))), dim=-1)
        m_old, s_old = M[..., rows], S[..., rows]
        tile_max = kq.amax(dim=-1)
        live = tile_max > float("-inf")
        m_new = torch.maximum(m_old, tile_max)
        grow = live & (m_new > m_old)
        ms = torch.where(grow, _expf(torch.where(grow, m_old - m_new, 0.0)), 1.0)
        part = torch.where(grow[..., None], acc[..., rows, :] * ms[..., None], acc[..., rows, :])
        s_new = torch.where(grow, s_old * ms, s_old)
        m_new = torch.where(live, m_new, m_old)
        weights = v_expf(kq - torch.where(live, m_new, 0.0)[..., None])
        weights = torch.where(live[..., None], weights, 0.0)[..., :stop - start]
        lanes = _reduce_lanes(torch.nn.functional.pad(weights, (0, KV_TILE - (stop - start))).unflatten(
            -1, (KV_TILE // F32_LANES, F32_LANES))).double()
        total = lanes[..., 0]
        for group in range(1, lanes.shape[-1]):  # summed in double, group by group
            total = total + lanes[..., group]
        S[..., rows] = torch.where(live, (s_new.double() + total).float(), s_new)
        M[..., rows] = m_new
        # VKQ += KQ V: a chain of fused multiply-adds over the tile's keys
        acc[..., rows, :] = _fma_matmul(weights, values[..., start:stop, :], part)
    inverse = torch.where(S == 0, 0.0, _divide(1.0, S))
    return acc * inverse[..., None]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, divisor: float,
              blocked: torch.Tensor | None) -> torch.Tensor:
    """``z`` as llama.cpp's CPU flash attention computes it, for ``layer_ops.attention``'s shapes: queries ``[..., T,
    heads, d]``, keys and values ``[..., kv_heads, S, d]`` (rounded to F16 here, as llama.cpp's cache holds them),
    ``blocked`` ``[T, S]`` or ``[B, 1, T, S]`` (None: nothing masked); ``[..., T, heads, d]`` in the queries' dtype.
    The scores are scaled by the float32 ``1 / divisor`` (llama.cpp's ``kq_scale``)."""
    dtype = q.dtype
    qh = q.float().transpose(-3, -2)  # [..., H, T, d]
    k16, v16 = keys.half(), values.half()
    scale = float(np.float32(1.0) / np.float32(divisor))  # a float32 value: the float32 product rounds once
    allowed = (torch.ones(qh.shape[-2], keys.shape[-2], dtype=torch.bool, device=q.device) if blocked is None
               else ~blocked)
    kernel = _tiled if qh.shape[-2] >= Q_TILE else _one_chunk
    z = kernel(qh, k16, v16, scale, allowed)
    return z.transpose(-3, -2).to(dtype)
