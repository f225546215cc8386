"""Q4_0: 32 values as 4-bit codes around zero with one f16 scale (value = d * (q - 8))."""
from ._legacy import legacy_format

FORMAT = legacy_format("Q4_0", bits=4, affine=False)
