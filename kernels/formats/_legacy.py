"""The 32-value formats of the first GGUF generation (Q4_0, Q4_1, Q5_0, Q5_1, and Q8_0's rounding).

Their quantization rules mirror ``gguf.quants`` operation by operation, all in float32, so the
bytes come out identical; dequantization likewise mirrors its order of float operations.
"""
from __future__ import annotations

import torch

from ._bits import float_bytes, pack_fields, read_f16, unpack_fields
from ._define import define_format
from .base import QuantFormat


def divide(values: torch.Tensor, divisor: float) -> torch.Tensor:
    """``values / divisor``, correctly rounded on every device."""
    # CUDA computes division by a Python scalar as multiplication by its reciprocal, which can
    # differ from numpy's division in the last bit; dividing by a device tensor does not.
    return values / torch.tensor(divisor, dtype=values.dtype, device=values.device)


def inverse_or_zero(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, with 0 for a zero scale (an all-zero block quantizes to the zero code)."""
    return torch.where(scale == 0, 0.0, scale.reciprocal())


def round_half_away(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero, exactly like gguf's ``np_roundf``.

    ``sign(x) * floor(|x| + 0.5)`` would be wrong for 0.49999997, where the addition rounds up to 1.
    """
    magnitude = values.abs()
    whole = magnitude.floor()
    return values.sign() * (whole + (2 * (magnitude - whole)).floor())


def symmetric_codes(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0/Q5_0: ``value ~ d * (code - 2**(bits-1))``; returns float32 ``d [n, 1]`` and uint8 codes ``[n, 32]``.

    The value of largest magnitude maps exactly to the most negative code.
    """
    offset = 1 << (bits - 1)
    extreme = values.gather(-1, values.abs().argmax(dim=-1, keepdim=True))
    scale = divide(extreme, -offset)
    codes = torch.trunc(values * inverse_or_zero(scale) + (offset + 0.5))
    return scale, codes.clamp(0, 2 * offset - 1).to(torch.uint8)


def affine_codes(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1/Q5_1: ``value ~ d * code + m`` with ``m`` the block minimum; returns ``d``, ``m`` ``[n, 1]`` and codes."""
    top = (1 << bits) - 1
    low = values.amin(dim=-1, keepdim=True)
    high = values.amax(dim=-1, keepdim=True)
    scale = divide(high - low, top)
    codes = torch.trunc((values - low) * inverse_or_zero(scale) + 0.5)
    return scale, low, codes.clamp(0, top).to(torch.uint8)


def legacy_format(name: str, bits: int, affine: bool) -> QuantFormat:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: ``bits``-bit codes, symmetric (``d * (q - 2**(bits-1))``) or affine (``d * q + m``).

    Block layout: ``d`` f16, then ``m`` f16 if affine, then (5-bit only) a little-endian 32-bit word
    whose bit ``i`` is bit 4 of code ``i``, then 16 bytes of low nibbles: codes 0-15 in the low
    nibbles, codes 16-31 in the high ones.
    """
    if bits not in (4, 5):
        raise ValueError(f"legacy formats have 4- or 5-bit codes, not {bits}")
    high_bits_at = 4 if affine else 2
    nibbles_at = high_bits_at + (4 if bits == 5 else 0)

    def dequantize(blocks: torch.Tensor) -> torch.Tensor:
        codes = unpack_fields(blocks[:, nibbles_at:], 4).flatten(1)
        if bits == 5:
            high = unpack_fields(blocks[:, high_bits_at:nibbles_at], 1).transpose(1, 2).flatten(1)
            codes = codes | (high << 4)
        # In place on the one float buffer: fresh large allocations cost page faults on CPU.
        values = codes.float()
        if affine:
            return values.mul_(read_f16(blocks, 0)).add_(read_f16(blocks, 2))
        return values.sub_(1 << (bits - 1)).mul_(read_f16(blocks, 0))

    def quantize(values: torch.Tensor) -> torch.Tensor:
        if affine:
            scale, minimum, codes = affine_codes(values, bits)
            header = torch.cat([scale, minimum], dim=-1)
        else:
            header, codes = symmetric_codes(values, bits)
        parts = [float_bytes(header, torch.float16)]
        if bits == 5:
            parts.append(pack_fields((codes >> 4).unflatten(1, (4, 8)).transpose(1, 2), 1))
        parts.append(pack_fields((codes & 0x0F).unflatten(1, (2, 16)), 4))
        return torch.cat(parts, dim=-1)

    return define_format(name, dequantize, quantize, layout_bytes=nibbles_at + 16)
