"""Q5_0: 32 values as 5-bit codes around zero with one f16 scale (value = d * (q - 16))."""
from ._legacy import legacy_format

FORMAT = legacy_format("Q5_0", bits=5, affine=False)
