"""MXFP4: 32 four-bit E2M1 floats sharing one E8M0 power-of-two scale (OCP microscaling; GPT-OSS's experts).

Block layout (17 bytes): the scale's exponent byte ``e``, then 16 bytes of codes: values 0-15 in the low nibbles,
16-31 in the high ones (as Q4_0). A code is E2M1's sign bit and three magnitude bits, looked up in ggml's table of
*doubled* values (0, 1, 2, 3, 4, 6, 8, 12, negated for codes 8-15), which is why the scale is halved:
``value = kvalue[q] * 2**(e - 128)``. ggml builds that float from its bits (``ggml_e8m0_to_fp32_half``), exact for every
``e``: 2**-128 and 2**-127 are float32 subnormals. The quantizer is gguf's: ``e = floor(log2(amax)) - 2 + 127``, each
value to the nearest entry (the first of a tie).
"""
import torch

from ._bits import pack_fields, unpack_fields
from ._define import define_format

# ggml's kvalues_mxfp4: twice the E2M1 value of each code
KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def half_scale(e: torch.Tensor) -> torch.Tensor:
    """``2**(e - 128)`` as float32 for exponent bytes ``e``, built from its bits as ggml does."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _dequantize(blocks: torch.Tensor) -> torch.Tensor:
    codes = unpack_fields(blocks[:, 1:], 4).flatten(1)
    table = torch.tensor(KVALUES, dtype=torch.float32, device=blocks.device)
    return table[codes.long()].mul_(half_scale(blocks[:, :1]))


def _quantize(values: torch.Tensor) -> torch.Tensor:
    amax = values.abs().amax(dim=-1, keepdim=True)
    # log2 of a float32 is exact at powers of two, as the C library's log2f
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).to(torch.uint8)
    table = torch.tensor(KVALUES, dtype=torch.float32, device=values.device)
    errors = (half_scale(e)[..., None] * table - values[..., None]).abs()  # [n, 32, 16]
    codes = errors.argmin(dim=-1).to(torch.uint8)  # the first of equal errors, as numpy's argmin
    return torch.cat([e, pack_fields(codes.unflatten(1, (2, 16)), 4)], dim=-1)


FORMAT = define_format("MXFP4", _dequantize, _quantize, layout_bytes=17)
