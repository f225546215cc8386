"""FP8 weights as Hugging Face folders store them, kept in FP8 (``FP8_ROW``, ``FP8_BLOCK``).

One row of ``cols`` values is its ``cols`` E4M3 codes, then one little-endian float32 scale per 128 of them
(value = code * scale): ``cols / 128 * 132`` bytes, ``cols`` a multiple of 128. The codes come first so that a whole
matrix's codes are one strided E4M3 matrix that ``torch._scaled_mm`` reads in place (``codes``); each row carries its
own scales so that any row range (a fused projection's part, one expert) is a matrix of the same format.

Both checkpoint kinds map onto this layout exactly: a 128x128 block's scale (``weight_scale_inv``) is repeated on
each of its rows (``FP8_BLOCK``, 3 % over the codes' bytes), a row's scale (compressed-tensors' per-channel
``weight_scale``) on each 128 values of the row (``FP8_ROW``, whose kernels read the first). On a row of one block
the layout is the block's codes then its scale, which is what the block functions ``dequantize``/``quantize`` take.
"""
from __future__ import annotations

import torch

from ._define import define_format
from .base import QuantFormat
from .table import spec

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
GROUP = spec("FP8_BLOCK").block_size  # values per scale


def codes(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """The E4M3 codes of packed rows ``[n, row_bytes]``: a ``[n, cols]`` view, strided by the row bytes."""
    return rows[:, :cols].view(E4M3)


def scales(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """The float32 scales of packed rows: a ``[n, cols / 128]`` view (the codes' bytes are a multiple of 4)."""
    tail = rows[:, cols:]
    if tail.data_ptr() % 4 or (tail.shape[0] > 1 and tail.stride(0) % 4):  # a byte-offset slice: copy it out
        tail = tail.contiguous()
    return tail.view(torch.float32)


def pack(codes_: torch.Tensor, scales_: torch.Tensor) -> torch.Tensor:
    """E4M3 codes ``[n, cols]`` and float32 scales ``[n, cols / 128]`` as packed rows ``[n, cols / 128 * 132]``."""
    n, cols = codes_.shape
    if codes_.dtype != E4M3 or cols % GROUP or tuple(scales_.shape) != (n, cols // GROUP):
        raise ValueError(f"FP8 pack expects {E4M3} codes [n, k * {GROUP}] and scales [n, k], got {codes_.dtype} "
                         f"{tuple(codes_.shape)} and {tuple(scales_.shape)}")
    scale_bytes = scales_.to(torch.float32).contiguous().view(torch.uint8)
    return torch.cat([codes_.contiguous().view(torch.uint8), scale_bytes], dim=1)


def dequantize_rows(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """Packed rows ``[n, row_bytes]`` -> float32 ``[n, cols]`` (exact: an E4M3 code times a float32 scale)."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or cols % GROUP or rows.shape[1] != cols // GROUP * (GROUP + 4):
        raise ValueError(f"FP8 rows of {cols} values need uint8 [n, {cols // GROUP * (GROUP + 4)}], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    n = rows.shape[0]
    values = codes(rows, cols).float().view(n, -1, GROUP) * scales(rows, cols).unsqueeze(-1)
    return values.view(n, cols)


def quantize_rows(values: torch.Tensor, per_row: bool) -> torch.Tensor:
    """float32 ``[n, cols]`` -> packed rows: each scale the largest magnitude of its values over 448 (of the row with
    ``per_row``, else of each 128), as transformers' and llm-compressor's quantizers compute it."""
    n, cols = values.shape
    if cols % GROUP:
        raise ValueError(f"FP8 needs rows that are a multiple of {GROUP} values, got {cols}")
    if not bool(torch.isfinite(values).all()):
        raise ValueError("FP8 quantize got non-finite values (nan or inf)")
    groups = values.view(n, -1, GROUP)
    amax = groups.abs().amax(dim=(1, 2) if per_row else 2, keepdim=True)
    scale = amax / E4M3_MAX
    inverse = torch.where(scale == 0, 0.0, scale.reciprocal())
    codes_ = (groups * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # clamped: E4M3 has no infinity to overflow to
    return pack(codes_.view(n, cols), scale.expand(n, cols // GROUP, 1).reshape(n, -1))


def define_fp8_format(name: str, per_row: bool) -> QuantFormat:
    """An FP8 format over this layout; the block functions take rows of one block."""
    fmt = define_format(name, lambda blocks: dequantize_rows(blocks, GROUP),
                        lambda values: quantize_rows(values, per_row), layout_bytes=GROUP + 4)
    return QuantFormat(fmt.name, fmt.ggml_type, fmt.block_size, fmt.type_size, fmt.dequantize, fmt.quantize,
                       dequantize_rows, lambda values: quantize_rows(values, per_row))
