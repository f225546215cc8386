"""FP8_ROW: E4M3 codes with one float32 scale per row (compressed-tensors' per-channel and per-tensor FP8), stored
in the FP8 row layout of ``_fp8`` (the row's scale repeated per 128 values); activations are quantized per token."""
from ._fp8 import define_fp8_format

FORMAT = define_fp8_format("FP8_ROW", per_row=True)
