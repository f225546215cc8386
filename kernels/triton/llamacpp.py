"""llama.cpp's numerics on CUDA: the activations quantized as ggml-cpu quantizes them for the weight's type
(``quantize_activations``), integer dot products per block, scales applied in float32. ``gemv_llamacpp`` runs the
GEMV's loop once per row of activations; ``gemm_llamacpp`` runs the integer products on the tensor cores (int8
``tl.dot``) for many rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_choices import GemvConfig, Int8GemmConfig, gemv_llamacpp_config, int8_gemm_config
from ..quant_tensor import QuantTensor
from .bits import load_f16
from .common import checked_output, tile_grid
from .formats import K_QUANTS, LLAMACPP_FORMATS, Q2_K, Q3_K, Q4_1, Q5_1, Q6_K
from .gemm import tile_origin
from .gemv import by_expert_config, checked_by_expert_output, launch_gemv
from .k_affine import k_chunk_tile_dots_q8k
from .k_small import small_k_tile_dots_q8k
from .launch import launch
from .legacy import legacy_tile_dots_q8
from .q6_k import q6_k_tile_dots_q8k

# ---------------------------------------------------------------------------------------------
# Activations quantized as ggml-cpu quantizes them


@triton.jit
def _nearest_int(v):
    """``v`` (float32, |v| < 2**22) rounded to the nearest integer, ties to even, as int32: adding 1.5 * 2**23 leaves
    the rounded value in the low mantissa bits. The kernels that call it are compiled without fused multiply-adds, so
    that a product feeding it is rounded first, as in ggml."""
    return ((v + 12582912.0).to(tl.int32, bitcast=True) & 0x7FFFFF) - 0x400000


@triton.jit
def _quantize_q8_k_kernel(x_ptr, q_ptr, scales_ptr, sums_ptr):
    """One 256-value block of x as ggml's ``quantize_row_q8_K_ref``: the first value of largest magnitude maps to
    -127, every value to the nearest integer (ties to even) of ``-127 / that value`` times it, at most 127."""
    block = tl.program_id(0)
    index = tl.arange(0, 256)
    x = tl.load(x_ptr + block * 256 + index).to(tl.float32)
    magnitude = tl.abs(x)
    amax = tl.max(magnitude, 0)
    extreme = tl.sum(tl.where(index == tl.argmax(magnitude, 0, tie_break_left=True), x, 0.0), 0)
    iscale = tl.where(amax == 0.0, 0.0, tl.math.div_rn(-127.0, tl.where(amax == 0.0, 1.0, extreme)))
    q = tl.minimum(_nearest_int(iscale * x), 127)
    tl.store(q_ptr + block * 256 + index, q.to(tl.int8))
    tl.store(sums_ptr + block * 16 + tl.arange(0, 16), tl.sum(tl.reshape(q, (16, 16)), 1))
    tl.store(scales_ptr + block, tl.where(amax == 0.0, 0.0, tl.math.div_rn(1.0, tl.where(amax == 0.0, 1.0, iscale))))


@triton.jit
def _quantize_q8_kernel(x_ptr, q_ptr, scales_ptr, sums_ptr):
    """One 32-value block of x as ggml-cpu's x86 ``quantize_row_q8_0`` / ``_q8_1``: values ``x * 127 / amax`` rounded
    to the nearest integer (ties to even), the scale ``amax / 127`` and (Q8_1) scale times the values' sum, both
    rounded to float16."""
    block = tl.program_id(0)
    index = tl.arange(0, 32)
    x = tl.load(x_ptr + block * 32 + index).to(tl.float32)
    amax = tl.max(tl.abs(x), 0)
    scale = tl.math.div_rn(amax, 127.0)
    inverse = tl.where(amax == 0.0, 0.0, tl.math.div_rn(127.0, tl.where(amax == 0.0, 1.0, amax)))
    q = _nearest_int(x * inverse)
    tl.store(q_ptr + block * 32 + index, q.to(tl.int8))
    tl.store(scales_ptr + block, scale.to(tl.float16).to(tl.float32))
    tl.store(sums_ptr + block, (scale * tl.sum(q, 0).to(tl.float32)).to(tl.float16).to(tl.float32))


def quantize_activations(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``x`` ``[M, K]`` quantized as ggml-cpu quantizes activations for a weight of ``fmt``, as the
    llama.cpp-numerics GEMV reads them: int8 values ``[M, K]``, then for the K-quants (Q8_K) a float32 scale per 256
    values and the int32 sum of each 16 (ggml's ``bsums``), for the others (Q8_0 / Q8_1) the float16 scale of each
    32 values and the float16 of scale times their sum (Q8_1's ``s``), both in float32."""
    k_quant = fmt in K_QUANTS
    block, per_sum, kernel, warps = (256, 16, _quantize_q8_k_kernel, 4) if k_quant else (32, 32, _quantize_q8_kernel, 1)
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"{'Q8_K' if k_quant else 'Q8_0'} blocks need [M, K] activations with K a multiple of {block}, "
                         f"got {tuple(x.shape)}")
    x = x.contiguous()
    m, k = x.shape
    values = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(m, k // block, dtype=torch.float32, device=x.device)
    sums = torch.empty(m, k // per_sum, dtype=torch.int32 if k_quant else torch.float32, device=x.device)
    if x.numel():
        launch(kernel, (m * k // block,), x, values, scales, sums, num_warps=warps, enable_fp_fusion=False)
    return values, scales, sums


# ---------------------------------------------------------------------------------------------
# The GEMV and the int8 GEMM


def gemv_llamacpp(x: torch.Tensor, w: QuantTensor, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` in llama.cpp's numerics: each row of ``x`` quantized as ggml-cpu quantizes activations for ``w``'s
    type (Q8_0 for Q4_0, Q5_0 and Q8_0, Q8_1 for Q4_1 and Q5_1, Q8_K for the K-quants), integer dot products per block
    (``dp4a``), scales applied in float32, as ggml-cpu's ``ggml_vec_dot_<type>_q8_<x>``. One pass over the weight per
    row of ``x``: made for decode."""
    layout, out = checked_output(x, w, formats=LLAMACPP_FORMATS)
    m, k = x.shape
    if m == 0:
        return out
    config = config or gemv_llamacpp_config(k, w.fmt.name, m)
    launch_gemv(w, out, layout, config, *quantize_activations(x, w.fmt.name), llamacpp=True)
    return out


def gemv_llamacpp_by_expert(x: torch.Tensor, w: QuantTensor, n_experts: int, experts: torch.Tensor,
                            x_rows: torch.Tensor) -> torch.Tensor:
    """``gemv_by_expert`` in llama.cpp's numerics, as ``gemv_llamacpp`` computes them: each row of ``x`` quantized
    once, whichever experts it goes to."""
    layout, out = checked_by_expert_output(x, w, n_experts, experts, x_rows, formats=LLAMACPP_FORMATS)
    if len(out):
        config = by_expert_config(gemv_llamacpp_config(x.shape[1], w.fmt.name, 1))
        launch_gemv(w, out, layout, config, *quantize_activations(x, w.fmt.name), llamacpp=True,
                    by_expert=(experts, x_rows))
    return out


@triton.jit
def _gemm_llamacpp_kernel(
    xq_ptr, x_scales_ptr, x_sums_ptr, w_ptr, out_ptr, M, N, K, row_bytes,
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    # xq, x_scales, x_sums: ``quantize_activations``' int8 values, scales and sums. Per block the integer dots are
    # scaled as ggml-cpu's vec_dot does: (d_x d_w) * dot, plus Q4_1's and Q5_1's m_w s_x, or per super-block
    # (d_x d) * sum_j scale_j dot_j - (d_x dmin) * sum_j min_j xsum_j over its sub-blocks or 16-value groups j (the
    # K-quants; Q3_K and Q6_K have no mins).
    first_m, first_n = tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows_m, rows_n = first_m + tl.arange(0, BLOCK_M), first_n + tl.arange(0, BLOCK_N)
    # Rows past M and N re-read rows from the first instead of masking loads (as in ``gemm._gemm_kernel``); never stored.
    m_rows = (rows_m % M).to(tl.int64)
    x_rows = xq_ptr + m_rows * K
    rowp = w_ptr + (rows_n % N).to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FMT >= Q2_K:  # the K-quants: Q8_K activations, a scale per 256 values and a sum per 16
        n_blocks = K // 256
        for block in range(0, n_blocks):
            blockp = rowp + block * TYPE_SIZE
            x_scale = tl.load(x_scales_ptr + m_rows * n_blocks + block)[:, None]
            x_block, x_sums = x_rows + 256 * block, x_sums_ptr + m_rows * (K // 16) + 16 * block
            if FMT == Q6_K:
                dots = q6_k_tile_dots_q8k(blockp, x_block, BLOCK_M, BLOCK_N)
                acc += x_scale * load_f16(blockp + 208)[None, :] * dots.to(tl.float32)
            elif FMT == Q3_K:
                dots, _ = small_k_tile_dots_q8k(FMT, blockp, x_block, x_sums, BLOCK_M, BLOCK_N)
                acc += x_scale * load_f16(blockp + 108)[None, :] * dots.to(tl.float32)
            else:  # d and dmin: at the start of Q4_K's and Q5_K's super-blocks, at byte 80 of Q2_K's
                if FMT == Q2_K:
                    dots, mins = small_k_tile_dots_q8k(FMT, blockp, x_block, x_sums, BLOCK_M, BLOCK_N)
                    factors = blockp + 80
                else:
                    dots, mins = k_chunk_tile_dots_q8k(FMT, blockp, x_block, x_sums, BLOCK_M, BLOCK_N)
                    factors = blockp
                acc += x_scale * load_f16(factors)[None, :] * dots.to(tl.float32)
                acc -= x_scale * load_f16(factors + 2)[None, :] * mins.to(tl.float32)
    else:
        n_blocks = K // 32
        for block in range(0, n_blocks):
            blockp = rowp + block * TYPE_SIZE
            dots = legacy_tile_dots_q8(FMT, blockp, x_rows + 32 * block)
            x_scale = tl.load(x_scales_ptr + m_rows * n_blocks + block)[:, None]
            acc += x_scale * load_f16(blockp)[None, :] * dots.to(tl.float32)
            if FMT == Q4_1 or FMT == Q5_1:
                acc += load_f16(blockp + 2)[None, :] * tl.load(x_sums_ptr + m_rows * n_blocks + block)[:, None]
    out_ptrs = out_ptr + rows_m.to(tl.int64)[:, None] * N + rows_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows_m[:, None] < M) & (rows_n[None, :] < N))


def gemm_llamacpp(x: torch.Tensor, w: QuantTensor, config: Int8GemmConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` in llama.cpp's numerics, as ``gemv_llamacpp`` computes them, for many rows of ``x`` (prefill): the
    integer dot products of each block on the tensor cores, one pass over the weight per tile of rows."""
    layout, out = checked_output(x, w, formats=LLAMACPP_FORMATS)
    (m, k), n = x.shape, w.shape[0]
    if m == 0:
        return out
    config = config or int8_gemm_config(m, n, x.device)
    values, scales, sums = quantize_activations(x, w.fmt.name)
    launch(_gemm_llamacpp_kernel, tile_grid(m, n, config),
        values, scales, sums, w.data, out, m, n, k, w.data.shape[1],
        FMT=layout.ggml_type, TYPE_SIZE=layout.type_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
