"""The logit lens's top-k on CUDA, for ``workbench.kernels.lens``: the softmax's top-k probabilities and ids of rows
``x @ w.T`` without ever writing the ``[rows, vocab]`` logits.

Each program takes a block of rows and a slice of the vocabulary, and walks the slice in tiles: it computes a tile of
logits on the tensor cores (float32 inputs at ``"tf32x3"``: three TF32 products, about float32's accuracy; half inputs
exact products, the tile rounded to their dtype as the dense matmul's result is), folds it into a running max and sum
of exponentials per row (softmax's denominator), and into a running top ``K_PAD`` per row where the tile beats it. A
logit and its id travel as one float64 key (the float's bits above the id, ordered as the logit), so the bitonic
``tl.topk`` carries ids for free, and merging the running top with a tile's is one ``maximum`` of two sorted halves
(as triton_kernels' routing top-k does). Each program writes its slice's max, sum and ``K_PAD`` candidates; the caller
merges the slices (``top_k_probs``). Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_power_of_2

MAX_K = 64  # a larger k takes the unfused path


@triton.jit
def _keys(logits, cols):
    # float32 bits above the int32 id, read as a float64: sign-magnitude both, so the float64 order is the logits'
    bits = logits.to(tl.uint32, bitcast=True).to(tl.uint64) << 32
    return (bits | cols.to(tl.uint64)).to(tl.float64, bitcast=True)


@triton.jit
def _lens_kernel(x_ptr, w_ptr, max_ptr, sum_ptr, values_ptr, ids_ptr, M, N, K, x_stride, w_stride, split_cols,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PAD: tl.constexpr,
                 PRECISION: tl.constexpr):
    block, split = tl.program_id(0), tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_inside = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    first_col = split * split_cols
    end_col = tl.minimum(first_col + split_cols, N)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    # bitonic, not sorted, between tiles; a slice narrower than K_PAD leaves keys of -inf (never among the top k)
    top = _keys(tl.full([BLOCK_M, K_PAD], float("-inf"), tl.float32), tl.zeros([BLOCK_M, K_PAD], tl.int32))
    for start in range(first_col, end_col, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_inside = cols < end_col
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for first in range(0, K, BLOCK_K):
            i = first + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + i[None, :], mask=row_inside[:, None] & (i < K)[None, :], other=0.0)
            w = tl.load(w_rows + i[None, :], mask=col_inside[:, None] & (i < K)[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        # the dense matmul's result is in the activations' dtype
        logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(col_inside[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), axis=1)
        running_max = new_max
        keys = _keys(logits, cols)
        # a tile with no key above its row's running top changes no top: the sort is skipped
        if tl.sum((tl.max(keys, axis=1) > tl.min(top, axis=1)).to(tl.int32), axis=0) > 0:
            # the running top sorted ascending against the tile's descending: the larger of each pair are the top K_PAD
            top = tl.maximum(tl.bitonic_merge(top), tl.topk(keys, K_PAD, dim=1))
    slot = rows.to(tl.int64) * n_splits + split
    tl.store(max_ptr + slot, running_max, mask=row_inside)
    tl.store(sum_ptr + slot, running_sum, mask=row_inside)
    bits = top.to(tl.uint64, bitcast=True)
    out = slot[:, None] * K_PAD + tl.arange(0, K_PAD)[None, :]
    tl.store(values_ptr + out, (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True), mask=row_inside[:, None])
    tl.store(ids_ptr + out, bits.to(tl.uint32).to(tl.int32, bitcast=True), mask=row_inside[:, None])


def top_k_probs(x: torch.Tensor, w: torch.Tensor, k: int, block_m: int = 128, block_n: int = 128, block_k: int = 32,
                splits: int | None = None, precision: str = "tf32x3", num_warps: int = 8, num_stages: int = 3
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` (up to ``MAX_K``) of ``softmax(x @ w.T)`` per row, ``(probs [M, k] float32, ids [M, k] int64)``
    best first, for ``x`` ``[M, K]`` and the dense weight ``w`` ``[N, K]`` of one float dtype (rows of contiguous
    values). ``splits``: vocabulary slices per row block (default: enough programs to fill the device); ``precision``:
    the dot's for float32 inputs (half inputs multiply exactly whatever it says). The default tile (128 x 128, 8 warps,
    3 stages) is the fastest of ``bench/lens_kernel.py --sweep`` on an H100 at TF32x3 (21.3 ms for task (d)'s 19,200
    rows, 64 x 128 took 38.9)."""
    m, d = x.shape
    n = w.shape[0]
    if (not 1 <= k <= min(MAX_K, n) or w.shape[1] != d or w.dtype != x.dtype or x.stride(1) != 1 or w.stride(1) != 1
            or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
        raise ValueError(f"lens top_k_probs: x {x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}, k {k}")
    k_pad = max(2, next_power_of_2(k))  # tl.topk takes a power of two
    block_n = max(block_n, k_pad)
    row_blocks = cdiv(m, block_m)
    if splits is None:
        # a few programs per streaming multiprocessor, each slice many tiles long
        programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        splits = max(1, min(cdiv(programs, row_blocks), n // (8 * block_n)))
    split_cols = cdiv(cdiv(n, splits), block_n) * block_n
    splits = cdiv(n, split_cols)  # none empty
    maxes = torch.empty(m, splits, dtype=torch.float32, device=x.device)
    sums = torch.empty_like(maxes)
    values = torch.empty(m, splits * k_pad, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, splits * k_pad, dtype=torch.int32, device=x.device)
    if m:
        launch(_lens_kernel, (row_blocks, splits), x, w, maxes, sums, values, ids, m, n, d, x.stride(0), w.stride(0),
               split_cols, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_PAD=k_pad,
               PRECISION=precision if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
               num_stages=num_stages)
    # merge the slices: their sums of exponentials onto one max, their candidates into the top k
    top, where = values.topk(k, dim=1)
    top_max = top[:, :1]
    total = (sums * (maxes - top_max).exp()).sum(1, keepdim=True)
    return (top - top_max).exp() / total, ids.gather(1, where).long()
