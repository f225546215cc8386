"""RMSNorm and the rope on CUDA, one Triton launch each where the torch formulas launch six to eight kernels
(conversions included): an eager CUDA forward spends its time launching kernels, not running them.

Both round as the torch formulas of ``workbench.kernels.layer_ops`` do, product by product (compiled without fused
multiply-adds): the rope gives the same bits; the norm's scale is a float32 sum of squares, its square root and
division correctly rounded, so it may differ from torch's reduction in the last bit, and ``(x * scale) * weight``
is rounded product by product in ``x``'s dtype. Under ``TRITON_INTERPRET=1`` they run on CPU tensors (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, d, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK)
    inside = index < d
    x = tl.load(x_ptr + row * d + index, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    mean = tl.sum(xf * xf, axis=0) / d
    scale = tl.div_rn(1.0, tl.sqrt_rn(mean + eps)).to(x.dtype)  # in x's dtype, as the hook point holds it
    tl.store(scale_ptr + row, scale)
    normalized = (xf * scale.to(tl.float32)).to(x.dtype)
    weight = tl.load(w_ptr + index, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * d + index, (normalized.to(tl.float32) * weight).to(x.dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_ops.rms_norm`` for ``x`` ``[..., d]`` and ``weight`` ``[d]`` of one float dtype: the scale
    ``[..., 1]`` and ``(x * scale) * weight``."""
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {weight.dtype} {tuple(weight.shape)} for input {x.dtype} {tuple(x.shape)}")
    d = x.shape[-1]
    # The forward's [T, d] input costs no reshape, copy or view: each is a host op call of its own.
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, d).contiguous()
    scale = torch.empty(rows.shape[0], 1, dtype=x.dtype, device=x.device)
    out = torch.empty_like(rows)
    if rows.numel():
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight if weight.is_contiguous() else weight.contiguous(), scale, out,
                                           d, eps, BLOCK=block, num_warps=min(16, max(1, block // 512)),
                                           enable_fp_fusion=False)
    return (scale, out) if x.dim() == 2 else (scale.view(*x.shape[:-1], 1), out.view(x.shape))


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
        block_h = min(triton.next_power_of_2(heads), 16)
        _rope_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, cos if cos.is_contiguous() else cos.contiguous(), sin if sin.is_contiguous() else sin.contiguous(), out,
            heads, x.stride(0), x.stride(1), d,
            INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 64 else 2,
            enable_fp_fusion=False,
        )
    return out
