"""``fp8_gemm``: E4M3 activations times FP8 weights (``FP8_ROW``, ``FP8_BLOCK``) on the tensor cores, in Triton.

The tensor-core path where ``torch._scaled_mm`` has no scaling for a format (the 1x128 block scales need Hopper and
cuBLAS 12.9): for each 128 values of K, one FP8 ``tl.dot`` of an activation tile and a weight tile, scaled by the
activations' and the weights' scales of that group and added to a float32 accumulator, as DeepSeek-V3's ``fp8_gemm``
does (the tensor cores' FP8 sums are promoted to float32 every 128 products). It reads the weight's codes and its
per-row scales where they lie in the packed rows (``formats/_fp8.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import _fp8
from ..quant_tensor import QuantTensor
from .launch import cdiv, launch


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, codes_ptr, w_scale_ptr, out_ptr, M, N, K, a_scale_stride, row_stride,
                     w_scale_stride, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     A_PER_GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, K // GROUP):
        a = tl.load(a_ptr + rows[:, None] * K + group * GROUP + ks[None, :], mask=row_ok[:, None], other=0.0)
        # the weight tile [GROUP, BLOCK_N]: each output row's 128 codes, K-major as FP8 tensor cores take them
        b = tl.load(codes_ptr + cols[None, :] * row_stride + group * GROUP + ks[:, None], mask=col_ok[None, :],
                    other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * a_scale_stride + (group if A_PER_GROUP else 0), mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols * w_scale_stride + group, mask=col_ok, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: QuantTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a`` E4M3 ``[M, K]`` with float32 scales ``[M, 1]`` (per token) or ``[M, K / 128]`` (per 128 values) times the
    FP8 weight ``w`` ``[N, K]``: ``[M, N]`` in ``out_dtype``."""
    rows, cols = a.shape
    n = w.shape[0]
    codes, w_scales = _fp8.codes(w.data, cols), _fp8.scales(w.data, cols)
    out = torch.empty(rows, n, dtype=out_dtype, device=a.device)
    # tl.dot takes at least 16 rows; few rows of activations (decode) leave more programs to narrower weight tiles
    block_m = min(128, max(16, 1 << (rows - 1).bit_length()))
    block_n = 32 if rows <= 16 else 64 if rows <= 64 else 128
    launch(_fp8_gemm_kernel, (cdiv(rows, block_m), cdiv(n, block_n)), a, a_scale, codes, w_scales, out, rows, n, cols,
           a_scale.stride(0), codes.stride(0), w_scales.stride(0), GROUP=_fp8.GROUP, BLOCK_M=block_m,
           BLOCK_N=block_n, A_PER_GROUP=a_scale.shape[1] > 1, num_warps=4, num_stages=3)
    return out
