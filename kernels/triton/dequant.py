"""Dequantize + cuBLAS: the whole weight written out once in the activations' dtype and handed to a dense matmul,
which wins once there are enough rows to amortize that.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..launch_choices import dequant_config
from ..quant_tensor import QuantTensor
from .common import check_inputs
from .formats import Layout
from .launch import cdiv, launch
from .readers import weight_tile


@triton.jit
def _dequantize_kernel(
    w_ptr, out_ptr, N, K, row_bytes,
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * BLOCK_U
    pair = tl.arange(0, BLOCK_N * BLOCK_U)  # (row, unit) pairs, rows slowest
    pair_rows = (tl.program_id(0) * BLOCK_N + pair // BLOCK_U) % N
    rowp = w_ptr + pair_rows.to(tl.int64) * row_bytes
    w = weight_tile(FMT, TYPE_SIZE, rowp, first + pair % BLOCK_U, K // 32, BLOCK_N, BLOCK_U)
    cols = 32 * first + tl.arange(0, 32 * BLOCK_U)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < N) & (cols[None, :] < K))


def dequantize(w: QuantTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """All of ``w`` as a dense ``[N, K]`` tensor of ``dtype`` (float16, bfloat16 or float32), in one pass."""
    return _dequantize(w, dtype, check_inputs(torch.empty(0, w.shape[1], dtype=dtype, device=w.device), w))


def _dequantize(w: QuantTensor, dtype: torch.dtype, layout: Layout) -> torch.Tensor:
    """``dequantize`` of a weight already checked (``layout`` its kernel layout)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    config = dequant_config()
    launch(_dequantize_kernel, (cdiv(n, config.block_n), cdiv(k // 32, config.block_u)),
        w.data, out, n, k, w.data.shape[1],
        FMT=layout.ggml_type, TYPE_SIZE=layout.type_size, BLOCK_N=config.block_n, BLOCK_U=config.block_u,
        num_warps=config.num_warps,
    )
    return out


def dequant_matmul(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """``x @ w.T`` as one dequantizing pass to ``x.dtype`` and a dense (cuBLAS) matmul: for many rows the
    dense product outruns re-dequantizing weight tiles in every row block of the fused GEMM."""
    return F.linear(x, _dequantize(w, x.dtype, check_inputs(x, w)))
