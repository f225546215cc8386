"""Q4_K: 256 values in 8 sub-blocks of 32 4-bit codes, each with a 6-bit scale and min (144 bytes)."""
from ._kquant import affine_k_format

FORMAT = affine_k_format("Q4_K", code_bits=4)
