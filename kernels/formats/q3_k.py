"""Q3_K: 256 values in 16 sub-blocks of 16 signed 3-bit codes, each with a signed 6-bit scale (value = (d * scale) * q).

Block layout (110 bytes): 32 bytes of high bits (bit ``j`` of byte ``p`` belongs to value ``32j + p``),
64 bytes of 2-bit low parts (each half of the block: bits ``2k, 2k+1`` of byte ``p`` belong to value
``32k + p``), 12 bytes of scales, ``d`` f16. Stored codes are ``q + 4`` in 0..7, scales ``scale + 32``
in 0..63: their low nibbles fill bytes 0-7 (scales 0-7 low, 8-15 high nibbles), their top two bits
are packed four to a byte in bytes 8-11 (scale ``4k + b`` in bits ``2k, 2k+1`` of byte ``8 + b``).
"""
import torch

from ._bits import float_bytes, pack_fields, read_f16, unpack_fields
from ._define import define_format
from ._kquant import dequantize_symmetric, quantize_symmetric

_CODE_OFFSET = 4
_SCALE_OFFSET = 32


def _dequantize(blocks: torch.Tensor) -> torch.Tensor:
    high = unpack_fields(blocks[:, :32], 1).flatten(1)
    low = unpack_fields(blocks[:, 32:96].unflatten(1, (2, 32)), 2).flatten(1)
    stored = low | (high << 2)
    packed_scales = blocks[:, 96:108]
    scale_low = unpack_fields(packed_scales[:, :8], 4).flatten(1)
    scale_high = unpack_fields(packed_scales[:, 8:], 2).flatten(1)
    scales = (scale_low | (scale_high << 4)).to(torch.int8) - _SCALE_OFFSET
    return dequantize_symmetric(read_f16(blocks, 108), scales, stored.unflatten(1, (16, 16)), _CODE_OFFSET)


def _quantize(values: torch.Tensor) -> torch.Tensor:
    super_scale, scales, codes = quantize_symmetric(values, 16, 3, 6)
    stored = (codes + _CODE_OFFSET).to(torch.uint8).flatten(1)
    high = pack_fields((stored >> 2).unflatten(1, (8, 32)), 1)
    low = pack_fields((stored & 0x03).unflatten(1, (2, 4, 32)), 2).flatten(1)
    stored_scales = (scales + _SCALE_OFFSET).to(torch.uint8)
    scale_low = pack_fields((stored_scales & 0x0F).unflatten(1, (2, 8)), 4)
    scale_high = pack_fields((stored_scales >> 4).unflatten(1, (4, 4)), 2)
    return torch.cat([high, low, scale_low, scale_high, float_bytes(super_scale, torch.float16)], dim=-1)


FORMAT = define_format("Q3_K", _dequantize, _quantize)
