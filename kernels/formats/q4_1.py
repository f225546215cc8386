"""Q4_1: 32 values as 4-bit codes with an f16 scale and an f16 minimum (value = d * q + m)."""
from ._legacy import legacy_format

FORMAT = legacy_format("Q4_1", bits=4, affine=True)
