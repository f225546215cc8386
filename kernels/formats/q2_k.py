"""Q2_K: 256 values in 16 sub-blocks of 16 2-bit codes, each with a 4-bit scale and min.

value = (d * scale) * q - (dmin * min). Block layout (84 bytes): 16 bytes with each sub-block's
scale in the low and min in the high nibble, 64 bytes of codes (each half of the block: bits
``2k, 2k+1`` of byte ``p`` belong to value ``32k + p``), ``d`` f16, ``dmin`` f16.
"""
import torch

from ._bits import float_bytes, pack_fields, read_f16, unpack_fields
from ._define import define_format
from ._kquant import dequantize_affine, quantize_affine


def _dequantize(blocks: torch.Tensor) -> torch.Tensor:
    packed_scales = blocks[:, :16]
    codes = unpack_fields(blocks[:, 16:80].unflatten(1, (2, 32)), 2).flatten(1).unflatten(1, (16, 16))
    return dequantize_affine(
        read_f16(blocks, 80), read_f16(blocks, 82), packed_scales & 0x0F, packed_scales >> 4, codes
    )


def _quantize(values: torch.Tensor) -> torch.Tensor:
    super_scale, super_min, scales, mins, codes = quantize_affine(values, 16, 2, 4)
    packed_scales = (scales | (mins << 4)).to(torch.uint8)
    packed_codes = pack_fields(codes.flatten(1).unflatten(1, (2, 4, 32)), 2).flatten(1)
    header = float_bytes(torch.cat([super_scale, super_min], dim=-1), torch.float16)
    return torch.cat([packed_scales, packed_codes, header], dim=-1)


FORMAT = define_format("Q2_K", _dequantize, _quantize)
