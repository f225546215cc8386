"""F32: plain little-endian float32 values."""
import torch

from ._define import define_float_format

FORMAT = define_float_format("F32", torch.float32)
