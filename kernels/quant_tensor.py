"""A weight matrix kept in its GGUF block layout."""
from __future__ import annotations

import torch

from .formats import QuantFormat, get_format

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class QuantTensor:
    """A 2-D weight ``[out_features, in_features]`` stored as packed GGUF blocks.

    ``data`` is uint8 ``[out_features, bytes_per_row]`` exactly as in the GGUF file (float formats too,
    viewed as bytes), so resident memory equals the file's tensor bytes.
    """

    def __init__(self, data: torch.Tensor, fmt: QuantFormat | str, shape: tuple[int, int]):
        fmt = get_format(fmt) if not isinstance(fmt, QuantFormat) else fmt
        rows, cols = shape
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError(f"packed data must be a 2-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
        if tuple(data.shape) != (rows, fmt.row_bytes(cols)):
            raise ValueError(
                f"{fmt.name} tensor of shape {shape} needs {rows} rows of {fmt.row_bytes(cols)} bytes, "
                f"got {tuple(data.shape)}"
            )
        self.data = data.contiguous()
        self.fmt = fmt
        self.shape = (rows, cols)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: QuantFormat | str) -> "QuantTensor":
        """Quantize a float ``[out, in]`` matrix into ``fmt``."""
        fmt = get_format(fmt) if not isinstance(fmt, QuantFormat) else fmt
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
        rows, cols = weight.shape
        fmt.row_bytes(cols)  # validates divisibility
        values = weight.detach().to(torch.float32)
        if fmt.quantize_rows is not None:
            return cls(fmt.quantize_rows(values), fmt, (rows, cols))
        packed = fmt.quantize(values.reshape(-1, fmt.block_size)).reshape(rows, -1)
        return cls(packed, fmt, (rows, cols))

    @classmethod
    def from_floats(cls, matrix: torch.Tensor) -> "QuantTensor":
        """A float32/float16/bfloat16 matrix (a vector: one row) as F32/F16/BF16 over its own bytes, unconverted."""
        matrix = matrix.reshape(1, -1) if matrix.dim() == 1 else matrix
        fmt = next((name for name, dtype in FLOAT_DTYPES.items() if dtype == matrix.dtype), None)
        if fmt is None or matrix.dim() != 2:
            raise ValueError(f"expected a 1-D or 2-D float32/float16/bfloat16 tensor, got {matrix.dtype} "
                             f"{tuple(matrix.shape)}")
        return cls(matrix.contiguous().view(torch.uint8).reshape(matrix.shape[0], -1), fmt, tuple(matrix.shape))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(slice(None)).to(dtype)

    def dequantize_rows(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """Float32 values of the selected rows (an embedding lookup, or a chunk of a matmul)."""
        packed = self.data[rows]
        if self.fmt.dequantize_rows is not None:
            return self.fmt.dequantize_rows(packed, self.shape[1])
        n = packed.shape[0]
        blocks = packed.reshape(-1, self.fmt.type_size)
        return self.fmt.dequantize(blocks).reshape(n, self.shape[1])

    def select_rows(self, rows: torch.Tensor) -> "QuantTensor":
        """The weight of the rows ``rows`` alone (their packed bytes): a matmul with it computes only those outputs."""
        return QuantTensor(self.data[rows.to(self.device)], self.fmt, (int(rows.numel()), self.shape[1]))

    def to(self, device: torch.device | str) -> "QuantTensor":
        return QuantTensor(self.data.to(device), self.fmt, self.shape)

    def __repr__(self) -> str:
        return f"QuantTensor({self.fmt.name}, shape={self.shape}, device={self.device})"
