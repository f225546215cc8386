"""Builds a :class:`QuantFormat` whose functions check their input before touching it."""
from __future__ import annotations

from typing import Callable

import torch

from ._bits import float_bytes, view_bytes
from .base import QuantFormat
from .table import spec


def define_format(
    name: str,
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor],
    quantize_blocks: Callable[[torch.Tensor], torch.Tensor],
    layout_bytes: int | None = None,
) -> QuantFormat:
    """Wrap a format's raw block functions with dtype/shape checks (metadata only, no device sync
    on the dequantize hot path) so that bad input raises a clear error instead of being misread.

    The type number and block sizes come from the format table; ``layout_bytes``, where given, is the block size
    the format's layout code adds up to, which must agree with it.
    """
    fmt_spec = spec(name)
    ggml_type, block_size, type_size = fmt_spec.ggml_type, fmt_spec.block_size, fmt_spec.type_size
    if layout_bytes is not None and layout_bytes != type_size:
        raise ValueError(f"{name}: the layout code reads {layout_bytes}-byte blocks, the format table says {type_size}")

    def dequantize(blocks: torch.Tensor) -> torch.Tensor:
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
            raise TypeError(f"{name} dequantize expects a uint8 tensor of blocks, got {_describe(blocks)}")
        if blocks.dim() != 2 or blocks.shape[1] != type_size:
            raise ValueError(
                f"{name} dequantize expects blocks of shape [n_blocks, {type_size}], got {tuple(blocks.shape)}"
            )
        return dequantize_blocks(blocks)

    def quantize(values: torch.Tensor) -> torch.Tensor:
        if not isinstance(values, torch.Tensor) or values.dtype != torch.float32:
            raise TypeError(f"{name} quantize expects a float32 tensor, got {_describe(values)}")
        if values.dim() != 2 or values.shape[1] != block_size:
            raise ValueError(
                f"{name} quantize expects values of shape [n_blocks, {block_size}], got {tuple(values.shape)}"
            )
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{name} quantize got non-finite values (nan or inf)")
        return quantize_blocks(values)

    return QuantFormat(name, ggml_type, block_size, type_size, dequantize, quantize)


def define_float_format(name: str, dtype: torch.dtype) -> QuantFormat:
    """A plain float format: one value per "block" of ``itemsize`` bytes, widened to float32 exactly."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return define_format(
        name,
        lambda blocks: view_bytes(blocks, 0, itemsize, dtype).float(),
        lambda values: float_bytes(values, dtype),
        layout_bytes=itemsize,
    )


def _describe(obj: object) -> str:
    return str(obj.dtype) if isinstance(obj, torch.Tensor) else type(obj).__name__
