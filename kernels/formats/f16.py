"""F16: IEEE half-precision values, widened to float32 exactly."""
import torch

from ._define import define_float_format

FORMAT = define_float_format("F16", torch.float16)
