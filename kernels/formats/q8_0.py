"""Q8_0: 32 values as int8 codes with one f16 scale (value = d * q).

Block layout (34 bytes): ``d`` f16, then 32 int8 codes.
"""
import torch

from ._bits import float_bytes, read_f16
from ._define import define_format
from ._legacy import divide, inverse_or_zero, round_half_away


def _dequantize(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float().mul_(read_f16(blocks, 0))


def _quantize(values: torch.Tensor) -> torch.Tensor:
    scale = divide(values.abs().amax(dim=-1, keepdim=True), 127)
    codes = round_half_away(values * inverse_or_zero(scale)).to(torch.int8)
    return torch.cat([float_bytes(scale, torch.float16), codes.view(torch.uint8)], dim=-1)


FORMAT = define_format("Q8_0", _dequantize, _quantize)
