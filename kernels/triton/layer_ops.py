"""The forward's glue on CUDA, for ``workbench.kernels.layer_ops``: RMSNorm (with the residual sum before it), the
rope, attention's query-key and pattern-value products, and the MLP's SwiGLU, one Triton launch each where the torch
formulas launch two to eight kernels (layout changes and conversions included): an eager CUDA forward spends its time
launching kernels, not running them.

The norm, the rope and SwiGLU are compiled without fused multiply-adds and round as the torch formulas do, product by
product: the rope and the residual sum give the same bits, SwiGLU too where its exp (libdevice's, as CUDA's ``expf``)
rounds as torch's does; the norm's scale is a float32 sum of squares with a correctly rounded square root and
division, so it may differ from torch's reduction in the last bit, and ``(x * scale) * weight`` is rounded product by
product in ``x``'s dtype; the attention's sums run in their own order. Under ``TRITON_INTERPRET=1`` they run on CPU
tensors (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .launch import INTERPRETING, cdiv, launch, next_power_of_2
from .matmul import dot_precision


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, total_ptr, w_ptr, scale_ptr, out_ptr, d, eps, RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK)
    inside = index < d
    x = tl.load(x_ptr + row * d + index, mask=inside, other=0.0)
    if RESIDUAL:  # the norm of x + delta, rounded to x's dtype as the torch sum is, and that sum stored
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * d + index, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + row * d + index, x, mask=inside)
    xf = x.to(tl.float32)
    mean = tl.sum(xf * xf, axis=0) / d
    scale = tl.div_rn(1.0, tl.sqrt_rn(mean + eps)).to(x.dtype)  # in x's dtype, as the hook point holds it
    tl.store(scale_ptr + row, scale)
    normalized = (xf * scale.to(tl.float32)).to(x.dtype)
    weight = tl.load(w_ptr + index, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * d + index, (normalized.to(tl.float32) * weight).to(x.dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_ops.rms_norm`` for contiguous rows ``x`` ``[T, d]`` and ``weight`` ``[d]`` of one float dtype: the
    scale ``[T, 1]`` and ``(x * scale) * weight``."""
    _, scale, out = _rms_norm(x, None, weight, eps)
    return scale, out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_ops.add_rms_norm``: the sum ``x + delta`` (contiguous ``[T, d]`` rows of one dtype), then ``rms_norm`` of
    it, in one launch: the norm's arithmetic on the sum is ``rms_norm``'s."""
    return _rms_norm(x, delta, weight, eps)


def _rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or not x.is_contiguous() or weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {weight.dtype} {tuple(weight.shape)} for input {x.dtype} {tuple(x.shape)} "
                         f"(contiguous [T, d] rows)")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_contiguous()):
        raise ValueError(f"add_rms_norm: delta {delta.dtype} {tuple(delta.shape)} for input {x.dtype} {tuple(x.shape)}")
    rows, d = x.shape
    scale = torch.empty(rows, 1, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    total = x if delta is None else torch.empty_like(x)
    if x.numel():
        block = next_power_of_2(d)
        launch(_rms_norm_kernel, (rows,), x, x if delta is None else delta, total, weight.contiguous(), scale, out, d,
               eps, RESIDUAL=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
               enable_fp_fusion=False)
    return total, scale, out


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, cols, gate_stride, up_stride, BLOCK: tl.constexpr,
                   LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = index < cols
    gate = tl.load(gate_ptr + row * gate_stride + index, mask=inside, other=0.0)
    g = gate.to(tl.float32)
    # torch's silu, x / (1 + exp(-x)) in float32 with an accurate exp (numpy's under the interpreter), rounded; then
    # the product, rounded
    exp = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    silu = tl.div_rn(g, 1.0 + exp).to(gate.dtype)
    up = tl.load(up_ptr + row * up_stride + index, mask=inside, other=0.0)
    tl.store(out_ptr + row * cols + index, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=inside)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``layer_ops.swiglu``: ``silu(gate) * up`` for ``gate`` and ``up`` ``[T, d]`` of one float dtype, each row a
    contiguous run of values (such as the two halves of a fused projection's output), as a new contiguous tensor."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"swiglu: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)} "
                         f"([T, d] rows of contiguous values)")
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(1024, next_power_of_2(cols))
        launch(_swiglu_kernel, (rows, cdiv(cols, block)), gate, up, out, cols, gate.stride(0), up.stride(0),
               BLOCK=block, LIBDEVICE=not INTERPRETING, num_warps=4, enable_fp_fusion=False)
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_token, stride_head, d,
                 INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_D)[None, :]
    partner = i ^ 1 if INTERLEAVED else (i + d // 2) % d
    inside = (head < heads) & (i < d)
    row = x_ptr + token * stride_token + head * stride_head
    x = tl.load(row + i, mask=inside, other=0.0)
    xf, partner_f = x.to(tl.float32), tl.load(row + partner, mask=inside, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * d + i, mask=i < d, other=0.0)
    sin = tl.load(sin_ptr + token * d + i, mask=i < d, other=0.0)
    out = xf * cos + partner_f * sin
    tl.store(out_ptr + (token * heads + head) * d + i, out.to(x.dtype), mask=inside)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``layer_ops.rope`` for ``x`` ``[T, heads, d_head]`` (any strides over tokens and heads, values contiguous) and
    float32 ``cos``, ``sin`` ``[T, 1, d_head]``: ``x * cos + partner(x) * sin``, a new contiguous tensor."""
    tokens, heads, d = x.shape
    if cos.shape != (tokens, 1, d) or sin.shape != cos.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} (float32 [T, 1, d_head]) for x "
                         f"{tuple(x.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
    if out.numel():
        block_h = min(next_power_of_2(heads), 16)
        launch(_rope_kernel, (tokens, cdiv(heads, block_h)),
            x, cos if cos.is_contiguous() else cos.contiguous(), sin if sin.is_contiguous() else sin.contiguous(), out,
            heads, x.stride(0), x.stride(1), d,
            INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=next_power_of_2(d), num_warps=1 if d <= 64 else 2,
            enable_fp_fusion=False,
        )
    return out


@triton.jit
def _scores_kernel(q_ptr, k_ptr, blocked_ptr, out_ptr, T, S, d, group, q_stride_t, q_stride_h, k_stride_h, k_stride_s,
                   blocked_stride_t, divisor, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    head, t_block, s_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    s = s_block * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]
    i = tl.arange(0, BLOCK_D)[None, :]
    q = tl.load(q_ptr + t * q_stride_t + head * q_stride_h + i, mask=(t < T) & (i < d), other=0.0)
    k = tl.load(k_ptr + (head // group) * k_stride_h + s * k_stride_s + i, mask=(s < S) & (i < d), other=0.0)
    # rounded to the inputs' dtype, as a matmul's output is, then divided in float32
    scores = tl.div_rn(tl.dot(q, tl.trans(k), input_precision=PRECISION).to(q.dtype).to(tl.float32), divisor)
    s_row = tl.trans(s)
    if MASKED:
        blocked = tl.load(blocked_ptr + t * blocked_stride_t + s_row, mask=(t < T) & (s_row < S), other=0)
        scores = tl.where(blocked != 0, float("-inf"), scores)
    tl.store(out_ptr + (head * T + t).to(tl.int64) * S + s_row, scores, mask=(t < T) & (s_row < S))


@triton.jit
def _attend_kernel(pattern_ptr, v_ptr, out_ptr, T, S, d, group, heads, v_stride_h, v_stride_s,
                   PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    head, t_block = tl.program_id(0), tl.program_id(1)
    t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    i = tl.arange(0, BLOCK_D)[None, :]
    dtype = v_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for first in range(0, S, BLOCK_S):
        s_row = first + tl.arange(0, BLOCK_S)[None, :]
        s = tl.trans(s_row)
        # the pattern rounded to the values' dtype, as the torch formula converts it before its matmul
        p = tl.load(pattern_ptr + (head * T + t).to(tl.int64) * S + s_row, mask=(t < T) & (s_row < S), other=0.0)
        v = tl.load(v_ptr + (head // group) * v_stride_h + s * v_stride_s + i, mask=(s < S) & (i < d), other=0.0)
        acc = tl.dot(p.to(dtype), v, acc, input_precision=PRECISION)
    tl.store(out_ptr + (t * heads + head) * d + i, acc.to(dtype), mask=(t < T) & (i < d))


def attention_scores(q: torch.Tensor, keys: torch.Tensor, divisor: float, blocked: torch.Tensor | None) -> torch.Tensor:
    """``layer_ops.attention_scores``: float32 ``[heads, T, S]`` from ``q`` ``[T, heads, d]`` and ``keys``
    ``[kv_heads, S, d]`` (any strides but the last), query head h reading kv head ``h // (heads / kv_heads)``."""
    tokens, heads, d = q.shape
    kv_heads, slots = keys.shape[0], keys.shape[1]
    if keys.shape[2] != d or heads % kv_heads or keys.dtype != q.dtype or q.stride(2) != 1 or keys.stride(2) != 1:
        raise ValueError(f"attention_scores: q {q.dtype} {tuple(q.shape)} and keys {keys.dtype} {tuple(keys.shape)}")
    out = torch.empty(heads, tokens, slots, dtype=torch.float32, device=q.device)
    if blocked is not None and (blocked.shape != (tokens, slots) or blocked.stride(1) != 1):
        raise ValueError(f"attention_scores: mask {tuple(blocked.shape)} for {tokens} tokens and {slots} slots")
    if out.numel():
        block_t, block_s = 16, 64
        mask = blocked.view(torch.uint8) if blocked is not None else out
        launch(_scores_kernel, (heads, cdiv(tokens, block_t), cdiv(slots, block_s)),
            q, keys, mask, out, tokens, slots, d, heads // kv_heads, q.stride(0), q.stride(1), keys.stride(0),
            keys.stride(1), blocked.stride(0) if blocked is not None else 0, divisor, MASKED=blocked is not None,
            PRECISION=dot_precision(q.dtype), BLOCK_T=block_t, BLOCK_S=block_s,
            BLOCK_D=max(16, next_power_of_2(d)), num_warps=4,
        )
    return out


def attend(pattern: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``layer_ops.attend``: ``z`` ``[T, heads, d]`` in the values' dtype from the float32 ``pattern`` ``[heads, T, S]``
    (rounded to the values' dtype) and ``values`` ``[kv_heads, S, d]`` (any strides but the last)."""
    heads, tokens, slots = pattern.shape
    kv_heads, d = values.shape[0], values.shape[2]
    if values.shape[1] != slots or heads % kv_heads or values.stride(2) != 1 or pattern.dtype != torch.float32:
        raise ValueError(f"attend: pattern {pattern.dtype} {tuple(pattern.shape)}, values {tuple(values.shape)}")
    pattern = pattern if pattern.is_contiguous() else pattern.contiguous()
    out = torch.empty(tokens, heads, d, dtype=values.dtype, device=values.device)
    if out.numel():
        block_t = 16
        launch(_attend_kernel, (heads, cdiv(tokens, block_t)),
            pattern, values, out, tokens, slots, d, heads // kv_heads, heads, values.stride(0), values.stride(1),
            PRECISION=dot_precision(values.dtype), BLOCK_T=block_t, BLOCK_S=64,
            BLOCK_D=max(16, next_power_of_2(d)), num_warps=4,
        )
    return out


@triton.jit
def _rows_of_heads(x_ptr, rows, stride_t, head_offset, i, d, inside, cos_ptr, sin_ptr, ROPE: tl.constexpr,
                   INTERLEAVED: tl.constexpr):
    """Packed rows ``rows`` of one head, ``[R, BLOCK_D]``; with ``ROPE``, rotated as ``_rope_kernel`` rotates them (the
    same products and sum, unfused, rounded to the dtype), by the factors of each row in ``cos``/``sin`` ``[N, d]``."""
    row = x_ptr + rows[:, None].to(tl.int64) * stride_t + head_offset
    x = tl.load(row + i, mask=inside, other=0.0)
    if ROPE:
        partner = tl.load(row + (i ^ 1 if INTERLEAVED else (i + d // 2) % d), mask=inside, other=0.0)
        cos = tl.load(cos_ptr + rows[:, None].to(tl.int64) * d + i, mask=inside, other=0.0)
        sin = tl.load(sin_ptr + rows[:, None].to(tl.int64) * d + i, mask=inside, other=0.0)
        x = (x.to(tl.float32) * cos + partner.to(tl.float32) * sin).to(x.dtype)
    return x


@triton.jit
def _packed_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, cos_ptr, sin_ptr, d, heads, group, window,
                             divisor, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                             PRECISION: tl.constexpr, WINDOWED: tl.constexpr, ROPE: tl.constexpr,
                             INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + seq)
    length = tl.load(starts_ptr + seq + 1) - start
    first_row = m_block * BLOCK_M
    if first_row < length:
        rows = first_row + tl.arange(0, BLOCK_M)
        i = tl.arange(0, BLOCK_D)[None, :]
        dtype = v_ptr.dtype.element_ty
        q = _rows_of_heads(q_ptr, start + rows, q_stride_t, head * q_stride_h, i, d,
                           (rows[:, None] < length) & (i < d), cos_ptr, sin_ptr, ROPE, INTERLEAVED)
        kv_head = head // group
        row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        end = tl.minimum(length, first_row + BLOCK_M)  # causal: no key past the block's last query
        lo = 0
        if WINDOWED:
            lo = tl.maximum(0, first_row - window + 1) // BLOCK_N * BLOCK_N
        for first in range(lo, end, BLOCK_N):
            cols = first + tl.arange(0, BLOCK_N)
            inside = (cols[:, None] < end) & (i < d)
            k = _rows_of_heads(k_ptr, start + cols, k_stride_t, kv_head * k_stride_h, i, d, inside, cos_ptr, sin_ptr,
                               ROPE, INTERLEAVED)
            v = tl.load(v_ptr + (start + cols[:, None]).to(tl.int64) * v_stride_t + kv_head * v_stride_h + i,
                        mask=inside, other=0.0)
            # the dot rounded to the inputs' dtype, then divided in float32, as attention_scores computes it
            scores = tl.div_rn(tl.dot(q, tl.trans(k), input_precision=PRECISION).to(q.dtype).to(tl.float32), divisor)
            seen = cols[None, :] <= rows[:, None]
            if WINDOWED:
                seen = seen & (rows[:, None] - cols[None, :] < window)
            scores = tl.where(seen, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # a row that has seen no key yet (a window's first blocks) keeps max -inf: subtract 0 instead of -inf
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(row_max - shift)
            p = tl.exp(scores - shift[:, None])
            row_sum = row_sum * rescale + tl.sum(p, axis=1)
            acc = tl.dot(p.to(dtype), v, acc * rescale[:, None], input_precision=PRECISION)
            row_max = new_max
        z = acc / row_sum[:, None]
        tl.store(out_ptr + ((start + rows[:, None]).to(tl.int64) * heads + head) * d + i, z.to(dtype),
                 mask=(rows[:, None] < length) & (i < d))


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, width: int,
                     divisor: float, window: int = 0,
                     rotation: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> torch.Tensor:
    """``layer_ops.packed_attention``: ``z`` ``[N, heads, d]`` of sequences packed one after another, ``q`` ``[N,
    heads, d]``, ``k`` and ``v`` ``[N, kv_heads, d]`` (any strides but the last), sequence b's tokens the rows
    ``starts[b]`` to ``starts[b + 1]`` (``width`` the longest's length): each token attends causally to its own
    sequence's keys (within ``window`` tokens behind it, where that is not 0), in one launch with no score held.
    ``rotation``: ``(cos, sin, interleaved)`` as ``rope`` takes them (``[N, 1, d]``): q and k are rotated in the
    launch, to the bits ``rope`` gives them."""
    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    if (k.shape != (tokens, kv_heads, d) or v.shape != k.shape or heads % kv_heads or not q.dtype == k.dtype == v.dtype
            or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1):
        raise ValueError(f"packed_attention: q {q.dtype} {tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}, "
                         f"v {v.dtype} {tuple(v.shape)}")
    cos, sin, interleaved = rotation if rotation is not None else (q, q, False)  # unread without a rotation
    if rotation is not None and (cos.shape != (tokens, 1, d) or sin.shape != cos.shape or cos.dtype != torch.float32
                                 or sin.dtype != torch.float32):
        raise ValueError(f"packed_attention: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} (float32 [N, 1, d]) for "
                         f"q {tuple(q.shape)}")
    out = torch.empty(tokens, heads, d, dtype=q.dtype, device=q.device)
    if out.numel():
        block_m = block_n = 32 if q.dtype == torch.float32 else 64
        launch(_packed_attention_kernel, (cdiv(width, block_m), starts.shape[0] - 1, heads),
            q, k, v, out, starts, cos if cos.is_contiguous() else cos.contiguous(),
            sin if sin.is_contiguous() else sin.contiguous(), d, heads, heads // kv_heads, window, divisor, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), PRECISION=dot_precision(q.dtype),
            WINDOWED=window > 0, ROPE=rotation is not None, INTERLEAVED=interleaved, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=max(16, next_power_of_2(d)), num_warps=4, enable_fp_fusion=False,
        )
    return out
