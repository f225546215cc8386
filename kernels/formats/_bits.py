"""Byte-level helpers shared by the format modules: scales stored in the blocks, packed bit fields.

GGUF is little-endian and so is every machine torch runs on, so reinterpreting bytes with
``Tensor.view(dtype)`` reads the stored numbers directly.
"""
from __future__ import annotations

import torch


def view_bytes(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``start:stop`` of every block reinterpreted as ``dtype``: ``[n_blocks, (stop - start) // itemsize]``."""
    # A column slice of the blocks is strided and may start at an odd address; a dtype view
    # needs unit stride and aligned storage, so copy the (small) slice out first.
    return blocks[:, start:stop].clone(memory_format=torch.contiguous_format).view(dtype)


def read_f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float16 at byte ``offset`` of every block, as float32 ``[n_blocks, 1]`` (exact)."""
    return view_bytes(blocks, offset, offset + 2, torch.float16).float()


def narrow_float(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of the float32 ``values`` rounded (nearest-even) to the float ``dtype``.

    Raises ``ValueError`` if a finite value overflows to infinity: a value or block scale that does
    not fit the format would otherwise turn into inf/nan without notice.
    """
    narrow = values.to(dtype, memory_format=torch.contiguous_format, copy=True)
    overflow = torch.isinf(narrow) & torch.isfinite(values)
    if bool(overflow.any()):
        raise ValueError(f"{values[overflow][0].item():g} overflows {dtype} (as a stored value or a block scale)")
    return narrow


def float_bytes(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[n, k]`` stored as the float ``dtype``: little-endian bytes ``[n, k * itemsize]``."""
    return narrow_float(values, dtype).view(torch.uint8)


def unpack_fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Split every byte into ``8 // bits`` fields of ``bits`` bits, lowest bits first.

    ``[..., m]`` uint8 -> ``[..., 8 // bits, m]`` uint8 where ``out[..., k, j] = packed[..., j] >> (k * bits) & mask``.
    This field-major order is how GGUF lays out its planes: e.g. with ``bits=4`` the low nibbles of a
    run of bytes hold the first values and the high nibbles the next ones.
    """
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-2) >> shifts[:, None]) & ((1 << bits) - 1)


def pack_fields(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_fields`: ``[..., 8 // bits, m]`` values below ``2**bits`` -> ``[..., m]`` bytes."""
    if fields.shape[-2] * bits != 8:
        raise ValueError(f"pack_fields: {fields.shape[-2]} fields of {bits} bits do not fill a byte")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=fields.device)
    # The fields occupy disjoint bits, so their sum is their bitwise or.
    return (fields.to(torch.uint8) << shifts[:, None]).sum(dim=-2, dtype=torch.uint8)


def unpack_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte Q4_K/Q5_K header: eight 6-bit scales and eight 6-bit mins, ``[n, 12]`` -> two ``[n, 8]`` uint8.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; scales and mins 4-7
    keep their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the spare top bits
    of bytes 0-3 (scales) and 4-7 (mins).
    """
    low_scales, low_mins, nibbles = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_scales & 0x3F, (nibbles & 0x0F) | ((low_scales >> 2) & 0x30)], dim=-1)
    mins = torch.cat([low_mins & 0x3F, (nibbles >> 4) | ((low_mins >> 2) & 0x30)], dim=-1)
    return scales, mins


def pack_k_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_k_scales`: two ``[n, 8]`` integer tensors with values below 64 -> ``[n, 12]`` uint8."""
    scales, mins = scales.to(torch.uint8), mins.to(torch.uint8)
    low_scales = (scales[:, :4] & 0x3F) | ((scales[:, 4:] >> 4) << 6)
    low_mins = (mins[:, :4] & 0x3F) | ((mins[:, 4:] >> 4) << 6)
    nibbles = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return torch.cat([low_scales, low_mins, nibbles], dim=-1)
