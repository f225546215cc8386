"""The contract every GGUF block format module fulfils."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF tensor format: its block layout and exact (de)quantization.

    A row of a weight matrix is ``row_length // block_size`` blocks of ``type_size`` bytes each.
    ``dequantize`` maps uint8 blocks ``[n_blocks, type_size]`` to float32 ``[n_blocks, block_size]``
    bit-identically to the gguf package's reference; ``quantize`` is its inverse up to rounding.
    Both run on whatever device the input lives on. A format whose rows are not their blocks in order (FP8: a row's
    codes, then its scales) also reads and writes whole rows: ``dequantize_rows(rows, row_length)`` maps uint8
    ``[n, row_bytes]`` to float32 ``[n, row_length]``, ``quantize_rows`` float32 ``[n, row_length]`` back; its
    ``dequantize``/``quantize`` take rows of one block.
    """

    name: str
    ggml_type: int | None
    block_size: int
    type_size: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]
    quantize: Callable[[torch.Tensor], torch.Tensor]
    dequantize_rows: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    quantize_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def row_bytes(self, row_length: int) -> int:
        if row_length % self.block_size:
            raise ValueError(
                f"{self.name} needs rows that are a multiple of {self.block_size} values, got {row_length}"
            )
        return row_length // self.block_size * self.type_size
