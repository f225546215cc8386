"""BF16: bfloat16 values (the top half of a float32), widened to float32 exactly."""
import torch

from ._define import define_float_format

FORMAT = define_float_format("BF16", torch.bfloat16)
