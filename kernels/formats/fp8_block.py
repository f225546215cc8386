"""FP8_BLOCK: E4M3 codes with a float32 scale per 128 values of a row (transformers' fine-grained FP8, DeepSeek-V3
and Qwen3-FP8: a 128x128 block's ``weight_scale_inv`` on each of its rows), in the FP8 row layout of ``_fp8``;
activations are quantized per 128 values of a token, as DeepSeek-V3's kernels do."""
from ._fp8 import define_fp8_format

FORMAT = define_fp8_format("FP8_BLOCK", per_row=False)
