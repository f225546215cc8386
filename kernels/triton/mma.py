"""The fragment kernel: ``x @ w.T`` for batched decode on ``mma.sync``, each lane unpacking the weights of its own
tensor-core fragment (``fragments``) once for every 8 rows of activations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.table import QK
from ..launch_choices import MMA_MAX_ROWS, MmaConfig, mma_config
from ..quant_tensor import QuantTensor
from .common import checked_output
from .formats import MMA_FORMATS, Q4_K, Q4_K_BYTES, Q6_K, Q6_K_BYTES
from .k_affine import q4_k_fragment_dots
from .launch import INTERPRETING, cdiv, launch
from .legacy import legacy_pair_dots
from .q6_k import q6_k_fragment_dots

MMA_K_MULTIPLE = 2 * QK  # pairs of 32-value blocks, so that each pair starts at a multiple of 4 bytes
MMA_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _mma_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, FMT: tl.constexpr, TYPE_SIZE: tl.constexpr,
                STEP_PAIRS: tl.constexpr, WARPS: tl.constexpr, TILES: tl.constexpr, USE_ASM: tl.constexpr):
    # One program per 16 weight rows; its warps take every WARPS-th step of K: a super-block (Q4_K, Q6_K) or STEP_PAIRS
    # pairs of blocks. Each weight tensor holds one value per lane (``fragments``): lane 4 g + t has weight rows g and
    # g + 8. The activations come in TILES tiles of 8 rows, one instruction each on the same unpacked weights: the
    # activation tensors are [TILES, lanes], lane 4 g + t holding row 8 i + g of tile i (re-reading rows from the first
    # past M, and weight rows past N, as ``gemm._gemm_kernel`` does; never stored).
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    first_row = tl.program_id(0) * 16
    lane = tl.arange(0, 32 * WARPS)
    warp, g, t = lane // 32, (lane % 32) // 4, lane % 4
    top = ((first_row + g) % N).to(tl.int64) * row_bytes
    bottom = ((first_row + g + 8) % N).to(tl.int64) * row_bytes
    x_rows = (8 * tl.arange(0, TILES)[:, None] + g[None, :]) % M
    x_row = x_ptr.to(tl.pointer_type(tl.uint8)) + x_rows.to(tl.int64) * (2 * K)
    acc0 = tl.zeros((TILES, 32 * WARPS), tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    if FMT == Q4_K or FMT == Q6_K:
        n_blocks = K // 256
        for step in range(0, tl.cdiv(n_blocks, WARPS)):
            block = step * WARPS + warp
            valid = block < n_blocks  # a warp past the row's end re-reads its last super-block and adds nothing
            block = tl.minimum(block, n_blocks - 1)
            if FMT == Q4_K:
                acc0, acc1, acc2, acc3 = q4_k_fragment_dots(
                    acc0, acc1, acc2, acc3, w_ptr + top + block * Q4_K_BYTES, w_ptr + bottom + block * Q4_K_BYTES,
                    x_row + (block * 512 + 16 * t)[None, :], valid, BF16, USE_ASM)
            else:
                acc0, acc1, acc2, acc3 = q6_k_fragment_dots(
                    acc0, acc1, acc2, acc3, w_ptr, top + block * Q6_K_BYTES, bottom + block * Q6_K_BYTES,
                    x_row + (block * 512)[None, :], valid, BF16, USE_ASM)
    else:
        n_pairs = K // 64
        for step in range(0, tl.cdiv(n_pairs, STEP_PAIRS * WARPS)):
            for i in tl.static_range(STEP_PAIRS):
                pair = (step * WARPS + warp) * STEP_PAIRS + i
                valid = pair < n_pairs
                pair = tl.minimum(pair, n_pairs - 1)
                acc0, acc1, acc2, acc3 = legacy_pair_dots(
                    acc0, acc1, acc2, acc3, w_ptr, top + pair * (2 * TYPE_SIZE), bottom + pair * (2 * TYPE_SIZE),
                    x_row + (pair * 128)[None, :], valid, FMT, BF16, USE_ASM)
    # In tile i, lane 4 g + t now holds out[8 i + 2 t, row g], out[8 i + 2 t + 1, row g], out[8 i + 2 t, row g + 8],
    # out[8 i + 2 t + 1, row g + 8].
    lane = tl.arange(0, 32)
    rows, columns = first_row + lane // 4, 8 * tl.arange(0, TILES)[:, None] + 2 * (lane % 4)[None, :]
    _store_fragment(acc0, out_ptr, columns, rows, M, N, WARPS)
    _store_fragment(acc1, out_ptr, columns + 1, rows, M, N, WARPS)
    _store_fragment(acc2, out_ptr, columns, rows + 8, M, N, WARPS)
    _store_fragment(acc3, out_ptr, columns + 1, rows + 8, M, N, WARPS)


@triton.jit
def _store_fragment(acc, out_ptr, m_rows, n_rows, M, N, WARPS: tl.constexpr):
    """The sum over the warps of one result register (``[tiles, lanes]``), stored at ``out[m_rows, n_rows]``
    (``[tiles, 32]``, ``[32]``)."""
    total = tl.sum(tl.reshape(acc, (acc.shape[0], WARPS, 32)), axis=1)
    out = out_ptr + m_rows.to(tl.int64) * N + n_rows[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=(m_rows < M) & (n_rows < N)[None, :])


def mma_gemm(x: torch.Tensor, w: QuantTensor, config: MmaConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` for up to ``MMA_MAX_ROWS`` rows of float16 or bfloat16 ``x`` (K a multiple of ``MMA_K_MULTIPLE``), on the
    tensor cores, each lane unpacking the weights of its own fragment (``fragments``) once for every 8 rows of ``x``:
    batched decode."""
    if config is not None and config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {config.num_warps}")
    if config is not None and config.step_pairs < 1:
        raise ValueError(f"step_pairs must be at least 1, got {config.step_pairs}")
    # 16-byte loads of the activations and of each super-block's header
    layout, out = checked_output(x, w, MMA_MAX_ROWS, dtypes=MMA_DTYPES, alignment=16, k_multiple=MMA_K_MULTIPLE,
                                  formats=MMA_FORMATS)
    (m, k), n = x.shape, w.shape[0]
    if m == 0:
        return out
    config = config or mma_config(n, k, x.device, w.fmt.name, m)
    launch(_mma_kernel, (cdiv(n, 16),),
        x, w.data, out, m, n, k, w.data.shape[1], FMT=layout.ggml_type, TYPE_SIZE=layout.type_size,
        STEP_PAIRS=config.step_pairs, WARPS=config.num_warps, TILES=cdiv(m, 8),
        USE_ASM=not INTERPRETING, num_warps=config.num_warps,
    )
    return out
