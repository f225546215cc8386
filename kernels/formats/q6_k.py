"""Q6_K: 256 values in 16 sub-blocks of 16 signed 6-bit codes, each with an int8 scale (value = (d * scale) * q).

Block layout (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales,
``d`` f16. Each half of the block (128 values) uses 64 nibble bytes (values 0-63 in the low nibbles,
64-127 in the high ones) and 32 high-part bytes (bits ``2k, 2k+1`` of byte ``p`` belong to value ``32k + p``).
"""
import torch

from ._bits import float_bytes, pack_fields, read_f16, unpack_fields
from ._define import define_format
from ._kquant import dequantize_symmetric, quantize_symmetric

_OFFSET = 32  # stored codes are q + 32 in 0..63


def _dequantize(blocks: torch.Tensor) -> torch.Tensor:
    low = unpack_fields(blocks[:, :128].unflatten(1, (2, 64)), 4)
    high = unpack_fields(blocks[:, 128:192].unflatten(1, (2, 32)), 2)
    stored = low.flatten(1) | (high.flatten(1) << 4)
    scales = blocks[:, 192:208].view(torch.int8)
    return dequantize_symmetric(read_f16(blocks, 208), scales, stored.unflatten(1, (16, 16)), _OFFSET)


def _quantize(values: torch.Tensor) -> torch.Tensor:
    super_scale, scales, codes = quantize_symmetric(values, 16, 6, 8)
    stored = (codes + _OFFSET).to(torch.uint8).flatten(1)
    low = pack_fields((stored & 0x0F).unflatten(1, (2, 2, 64)), 4).flatten(1)
    high = pack_fields((stored >> 4).unflatten(1, (2, 4, 32)), 2).flatten(1)
    scale_bytes = scales.to(torch.int8).view(torch.uint8)
    return torch.cat([low, high, scale_bytes, float_bytes(super_scale, torch.float16)], dim=-1)


FORMAT = define_format("Q6_K", _dequantize, _quantize)
