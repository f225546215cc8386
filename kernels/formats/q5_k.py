"""Q5_K: 256 values in 8 sub-blocks of 32 5-bit codes, each with a 6-bit scale and min (176 bytes)."""
from ._kquant import affine_k_format

FORMAT = affine_k_format("Q5_K", code_bits=5)
