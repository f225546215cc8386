"""Shared math of the K-quant formats: 256-value super-blocks split into sub-blocks of 16 or 32.

Each sub-block has its own scale (and, in the affine formats, its own minimum), stored as a small
integer times one f16 super-block scale. gguf only dequantizes these formats, so the quantizer is
our own: per sub-block a least-squares search over code assignments, then the sub-block scales are
quantized, then every value is rounded to the nearest code under the scales as actually stored.
"""
from __future__ import annotations

import torch

from ._bits import float_bytes, narrow_float, pack_fields, pack_k_scales, read_f16, unpack_fields, unpack_k_scales
from ._define import define_format
from .base import QuantFormat

# Code ranges tried per sub-block, as offsets to the min-max choice: a slightly coarser grid
# (negative offset) clips outliers, a finer one spends the codes on the bulk of the values.
_SEARCH_OFFSETS = [step / 10 for step in range(-10, 11)]


def dequantize_affine(
    super_scale: torch.Tensor, super_min: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, codes: torch.Tensor
) -> torch.Tensor:
    """``(d * scale) * q - (dmin * min)`` per sub-block, in gguf's float32 order.

    ``super_scale``/``super_min`` ``[n, 1]``, ``scales``/``mins`` ``[n, S]`` integers, ``codes`` ``[n, S, G]``.
    """
    step = (super_scale * scales.float()).unsqueeze(-1)
    offset = (super_min * mins.float()).unsqueeze(-1)
    # In place on the one float buffer: fresh large allocations cost page faults on CPU.
    return codes.float().mul_(step).sub_(offset).flatten(1)


def dequantize_symmetric(
    super_scale: torch.Tensor, scales: torch.Tensor, stored_codes: torch.Tensor, code_offset: int
) -> torch.Tensor:
    """``(d * scale) * (stored - code_offset)`` per sub-block; ``stored_codes`` unsigned ``[n, S, G]``."""
    step = (super_scale * scales.float()).unsqueeze(-1)
    return stored_codes.float().sub_(code_offset).mul_(step).flatten(1)


def quantize_affine(
    values: torch.Tensor, group_size: int, code_bits: int, scale_bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``[n, 256]`` values to ``(d * scale) * q - (dmin * min)`` with ``q`` in ``0 .. 2**code_bits - 1``.

    Returns ``d``, ``dmin`` (float32 ``[n, 1]``, exact in f16), ``scales``, ``mins`` (integers below
    ``2**scale_bits``, ``[n, S]``) and ``codes`` (uint8 ``[n, S, group_size]``).
    """
    top = (1 << code_bits) - 1
    groups = values.unflatten(1, (-1, group_size))
    step, offset = _fit_affine(groups, top)
    super_scale, scales = _quantize_scales(step, 0, (1 << scale_bits) - 1)
    super_min, mins = _quantize_scales(offset, 0, (1 << scale_bits) - 1)
    stored_step = (super_scale * scales.float()).unsqueeze(-1)
    stored_offset = (super_min * mins.float()).unsqueeze(-1)
    codes = _round_codes(groups + stored_offset, stored_step, 0, top).to(torch.uint8)
    return super_scale, super_min, scales, mins, codes


def quantize_symmetric(
    values: torch.Tensor, group_size: int, code_bits: int, scale_bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``[n, 256]`` values to ``(d * scale) * q`` with signed ``q`` in ``-2**(code_bits-1) .. 2**(code_bits-1) - 1``.

    Returns ``d`` (float32 ``[n, 1]``, exact in f16), ``scales`` (signed ``scale_bits``-bit integers
    ``[n, S]``) and ``codes`` (int8 ``[n, S, group_size]``).
    """
    low = 1 << (code_bits - 1)
    groups = values.unflatten(1, (-1, group_size))
    step = _fit_symmetric(groups, low)
    scale_low = 1 << (scale_bits - 1)
    super_scale, scales = _quantize_scales(step, -scale_low, scale_low - 1)
    stored_step = (super_scale * scales.float()).unsqueeze(-1)
    codes = _round_codes(groups, stored_step, -low, low - 1).to(torch.int8)
    return super_scale, scales, codes


def _fit_affine(groups: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group the step >= 0 and offset >= 0 minimizing ``sum((step * q - offset - x)**2)``, ``q`` in ``0..top``.

    The offset is stored unsigned and subtracted, so the represented range always includes zero.
    """
    low = groups.amin(dim=-1).clamp(max=0)
    span = groups.amax(dim=-1) - low
    # Min-max is the fallback where no search candidate gives a proper fit (e.g. constant groups).
    best_step, best_low = span / top, low
    best_error = torch.full_like(span, float("inf"))
    count = groups.shape[-1]
    sum_x = groups.sum(dim=-1)
    for search_offset in _SEARCH_OFFSETS:
        inverse = torch.where(span > 0, (top + search_offset) / span, 0.0)
        codes = torch.round((groups - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, top)
        sum_q, sum_qq, sum_qx = codes.sum(-1), (codes * codes).sum(-1), (codes * groups).sum(-1)
        # Least squares for x ~ step * q + base, then base clipped to <= 0 with step refitted.
        det = count * sum_qq - sum_q * sum_q
        step = (count * sum_qx - sum_q * sum_x) / det
        base = (sum_x - step * sum_q) / count
        clipped = base > 0
        step = torch.where(clipped, sum_qx / sum_qq, step)
        base = torch.where(clipped, 0.0, base)
        error = ((step.unsqueeze(-1) * codes + base.unsqueeze(-1) - groups) ** 2).sum(-1)
        better = (det > 0) & (step >= 0) & (error < best_error)
        best_step = torch.where(better, step, best_step)
        best_low = torch.where(better, base, best_low)
        best_error = torch.where(better, error, best_error)
    return best_step, -best_low


def _fit_symmetric(groups: torch.Tensor, low: int) -> torch.Tensor:
    """Per group the (signed) step minimizing ``sum((step * q - x)**2)`` over codes ``q`` in ``-low .. low-1``.

    The value of largest magnitude goes to the negative end, which has one code more.
    """
    extreme = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    best_step = extreme / -low
    best_error = torch.full_like(extreme, float("inf"))
    for search_offset in _SEARCH_OFFSETS:
        inverse = torch.where(extreme != 0, -(low + search_offset) / extreme, 0.0)
        codes = torch.round(groups * inverse.unsqueeze(-1)).clamp(-low, low - 1)
        sum_qq, sum_qx = (codes * codes).sum(-1), (codes * groups).sum(-1)
        step = sum_qx / sum_qq
        error = ((step.unsqueeze(-1) * codes - groups) ** 2).sum(-1)
        better = (sum_qq > 0) & (error < best_error)
        best_step = torch.where(better, step, best_step)
        best_error = torch.where(better, error, best_error)
    return best_step


def _quantize_scales(steps: torch.Tensor, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-block ``steps [n, S]`` as ``d * code`` with one f16 ``d`` per row and integer codes in ``low..high``.

    ``d`` is chosen so the step of largest magnitude lands on the end of the code range with more room.
    """
    extreme = steps.gather(-1, steps.abs().argmax(dim=-1, keepdim=True))
    target = low if -low > high else high
    super_scale = narrow_float(extreme / target, torch.float16).float()
    codes = torch.where(super_scale != 0, torch.round(steps / super_scale), 0.0).clamp(low, high)
    return super_scale, codes.to(torch.int32)


def _round_codes(targets: torch.Tensor, steps: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Nearest code in ``low..high`` for ``targets / steps`` (code 0 where a step is 0), as floats."""
    return torch.where(steps != 0, torch.round(targets / steps), 0.0).clamp(low, high)


def affine_k_format(name: str, code_bits: int) -> QuantFormat:
    """Q4_K (4-bit codes) and Q5_K (5-bit): 8 sub-blocks of 32, ``value = (d * scale) * q - (dmin * min)``.

    Block layout: ``d`` f16, ``dmin`` f16, 12 bytes of 6-bit scales and mins (:func:`unpack_k_scales`),
    for 5-bit codes 32 bytes whose bit ``j`` is bit 4 of the codes of sub-block ``j``, then 128 bytes
    of low nibbles: bytes ``32i .. 32i+31`` hold sub-block ``2i`` in their low nibbles and ``2i+1`` in
    their high ones.
    """
    if code_bits not in (4, 5):
        raise ValueError(f"Q4_K/Q5_K-style formats have 4- or 5-bit codes, not {code_bits}")
    nibbles_at = 16 + (32 if code_bits == 5 else 0)

    def dequantize(blocks: torch.Tensor) -> torch.Tensor:
        scales, mins = unpack_k_scales(blocks[:, 4:16])
        codes = unpack_fields(blocks[:, nibbles_at:].unflatten(1, (4, 32)), 4).flatten(1, 2)
        if code_bits == 5:
            codes = codes | (unpack_fields(blocks[:, 16:48], 1) << 4)
        return dequantize_affine(read_f16(blocks, 0), read_f16(blocks, 2), scales, mins, codes)

    def quantize(values: torch.Tensor) -> torch.Tensor:
        super_scale, super_min, scales, mins, codes = quantize_affine(values, 32, code_bits, 6)
        parts = [float_bytes(torch.cat([super_scale, super_min], dim=-1), torch.float16), pack_k_scales(scales, mins)]
        if code_bits == 5:
            parts.append(pack_fields(codes >> 4, 1))
        parts.append(pack_fields((codes & 0x0F).unflatten(1, (4, 2)), 4).flatten(1))
        return torch.cat(parts, dim=-1)

    return define_format(name, dequantize, quantize, layout_bytes=nibbles_at + 128)
