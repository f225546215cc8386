"""The logit lens's top-k on CUDA, for ``workbench.kernels.lens``: the softmax's top-k probabilities and ids of rows
``x @ w.T`` without ever writing the ``[rows, vocab]`` logits.

Each program takes a block of rows and a slice of the vocabulary, and walks the slice in tiles: it computes a tile of
logits on the tensor cores, folds it into a running max and sum of exponentials per row (softmax's denominator), and
into a running top ``K_PAD`` per row where the tile beats it. A logit and its id travel as one float64 key (the float's
bits above the id, ordered as the logit), so the bitonic ``tl.topk`` carries ids for free, and merging the running top
with a tile's is one ``maximum`` of two sorted halves (as triton_kernels' routing top-k does). Each program writes its
slice's max, sum and ``K_PAD`` candidates; the caller merges the slices (``top_k_probs``). Under
``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests).

Float32 inputs are multiplied at ``"fp16x3"``, about float32's accuracy: each row of ``x`` and ``w`` is scaled by a
power of two into float16's range and split into a float16 high and low half (``split``), and a tile is the three
products high x high, high x low and low x high on the float16 tensor cores, scaled back. Float16 keeps 11 bits of a
significand as TF32 does, so this is TF32x3's accuracy on tensor cores that multiply float16 at twice TF32's rate, and
the split is made once per weight rather than at every tile (docs/performance.md, "The four tasks on an H200"). Half
inputs multiply exactly, the tile rounded to their dtype as the dense matmul's result is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_power_of_2

MAX_K = 64  # a larger k takes the unfused path
# the dtype a tile's logits are rounded to: the dense matmul's result is in the activations' dtype
_LOGITS = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _keys(logits, cols):
    # float32 bits above the int32 id, read as a float64: sign-magnitude both, so the float64 order is the logits'
    bits = logits.to(tl.uint32, bitcast=True).to(tl.uint64) << 32
    return (bits | cols.to(tl.uint64)).to(tl.float64, bitcast=True)


@triton.jit
def _lens_kernel(x_ptr, x_low_ptr, x_scale_ptr, w_ptr, w_low_ptr, w_scale_ptr, max_ptr, sum_ptr, values_ptr, ids_ptr,
                 M, N, K, x_stride, w_stride, split_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, K_PAD: tl.constexpr, FOLD: tl.constexpr, SPLIT: tl.constexpr,
                 LOGITS: tl.constexpr):
    block, split = tl.program_id(0), tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_inside = rows < M
    x_offsets = rows.to(tl.int64)[:, None] * x_stride
    if SPLIT:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_inside, other=1.0)
    first_col = split * split_cols
    end_col = tl.minimum(first_col + split_cols, N)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    # bitonic, not sorted, between tiles; a slice narrower than K_PAD leaves keys of -inf (never among the top k)
    top = _keys(tl.full([BLOCK_M, K_PAD], float("-inf"), tl.float32), tl.zeros([BLOCK_M, K_PAD], tl.int32))
    for start in range(first_col, end_col, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_inside = cols < end_col
        w_offsets = cols.to(tl.int64)[:, None] * w_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for first in range(0, K, BLOCK_K):
            i = first + tl.arange(0, BLOCK_K)
            x_mask = row_inside[:, None] & (i < K)[None, :]
            w_mask = col_inside[:, None] & (i < K)[None, :]
            x = tl.load(x_ptr + x_offsets + i[None, :], mask=x_mask, other=0.0)
            w = tl.load(w_ptr + w_offsets + i[None, :], mask=w_mask, other=0.0)
            if SPLIT:
                # each step's three products summed apart, the small first, and added to the running sum in float32:
                # the tensor cores' own sums drop low bits (probabilities 7e-5 off float64's, against 1e-5)
                x_low = tl.load(x_low_ptr + x_offsets + i[None, :], mask=x_mask, other=0.0)
                w_low = tl.load(w_low_ptr + w_offsets + i[None, :], mask=w_mask, other=0.0)
                step = tl.dot(x_low, tl.trans(w))
                step = tl.dot(x, tl.trans(w_low), step)
                acc += tl.dot(x, tl.trans(w), step)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32")
        if SPLIT:  # powers of two: exact
            acc = acc * x_scale[:, None] * tl.load(w_scale_ptr + cols, mask=col_inside, other=1.0)[None, :]
        logits = acc.to(LOGITS).to(tl.float32)
        logits = tl.where(col_inside[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), axis=1)
        running_max = new_max
        keys = _keys(logits, cols)
        # (rows past M, all logits 0, would see each tile's larger ids beat their top)
        above = (keys > tl.min(top, axis=1)[:, None]) & row_inside[:, None]
        # a tile with no key above its row's running top changes no top: the sort is skipped
        if tl.sum(tl.sum(above.to(tl.int32), axis=1), axis=0) > 0:
            # Keys folded onto FOLD lanes, the largest of each lane kept, hold every key above its row's top where no
            # lane has two of them (most tiles past a slice's first few): their top K_PAD is the tile's, for a sort
            # of FOLD keys a row instead of BLOCK_N.
            lanes = tl.reshape(above.to(tl.int32), [BLOCK_M, BLOCK_N // FOLD, FOLD])
            if tl.max(tl.max(tl.sum(lanes, axis=1), axis=1), axis=0) > 1:
                tile_top = tl.topk(keys, K_PAD, dim=1)
            else:
                tile_top = tl.topk(tl.max(tl.reshape(keys, [BLOCK_M, BLOCK_N // FOLD, FOLD]), axis=1), K_PAD, dim=1)
            # the running top sorted ascending against the tile's descending: the larger of each pair are the top K_PAD
            top = tl.maximum(tl.bitonic_merge(top), tile_top)
    slot = rows.to(tl.int64) * n_splits + split
    tl.store(max_ptr + slot, running_max, mask=row_inside)
    tl.store(sum_ptr + slot, running_sum, mask=row_inside)
    bits = top.to(tl.uint64, bitcast=True)
    out = slot[:, None] * K_PAD + tl.arange(0, K_PAD)[None, :]
    tl.store(values_ptr + out, (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True), mask=row_inside[:, None])
    tl.store(ids_ptr + out, bits.to(tl.uint32).to(tl.int32, bitcast=True), mask=row_inside[:, None])


def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(high, low, scale)`` of float32 rows ``t``: ``high`` and ``low`` float16, ``(high + low) * scale[:, None]``
    equal to ``t`` within 2^-22 of each row's largest magnitude where that is 2^-99 or more. Each row is scaled by a
    power of two (exact) that puts its largest magnitude in [2^13, 2^14): well inside float16's range, where its low
    half's smallest normal number is 2^-27 of that magnitude."""
    largest = t.abs().amax(1) if t.shape[1] else t.new_zeros(t.shape[0])
    shift = (14 - torch.frexp(largest).exponent).clamp(-113, 113)  # 2^113 and 2^-113 are normal float32 numbers
    shift = shift.where(largest.isfinite() & (largest > 0), 0)  # zero rows, and rows whose NaN must come through
    scaled = t * torch.exp2(shift.float())[:, None]
    high = scaled.to(torch.float16)
    return high, (scaled - high.float()).to(torch.float16), torch.exp2(-shift.float())


def top_k_probs(x: torch.Tensor, w: torch.Tensor, k: int, block_m: int = 128, block_n: int = 128, block_k: int = 64,
                splits: int | None = None, precision: str = "fp16x3", num_warps: int = 8, num_stages: int = 3,
                fold: int = 32, w_split: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` (up to ``MAX_K``) of ``softmax(x @ w.T)`` per row, ``(probs [M, k] float32, ids [M, k] int64)``
    best first, for ``x`` ``[M, K]`` and the dense weight ``w`` ``[N, K]`` of one float dtype (rows of contiguous
    values). ``splits``: vocabulary slices per row block (default: enough programs to fill the device); ``precision``:
    the products of float32 inputs, ``"fp16x3"`` (about float32's accuracy) or ``"tf32"`` (half inputs multiply
    exactly whatever it says); ``fold``: the lanes a tile's keys fold onto before its top is sorted; ``w_split``:
    ``split(w)``, where the caller keeps it for many calls. The default tile (128 x 128 x 64, 8 warps, 3 stages, 32
    lanes) is the fastest of ``bench/lens_kernel.py --sweep`` on an H200 (11.3 ms for task (d)'s 19,200 rows; 12.3 at
    a depth of 32, 13.5 at 64 rows)."""
    m, d = x.shape
    n = w.shape[0]
    if (not 1 <= k <= min(MAX_K, n) or w.shape[1] != d or w.dtype != x.dtype or x.stride(1) != 1 or w.stride(1) != 1
            or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or precision not in ("fp16x3", "tf32")
            or fold < 1 or fold & (fold - 1)):
        raise ValueError(f"lens top_k_probs: x {x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}, k {k}, "
                         f"precision {precision!r}, fold {fold} (a power of two)")
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
        three = x.dtype == torch.float32 and precision == "fp16x3"
        logits = _LOGITS[x.dtype]
        (x, x_low, x_scale), (w, w_low, w_scale) = (split(x), w_split or split(w)) if three else ((x,) * 3, (w,) * 3)
        launch(_lens_kernel, (row_blocks, splits), x, x_low, x_scale, w, w_low, w_scale, maxes, sums, values, ids, m,
               n, d, x.stride(0), w.stride(0), split_cols, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
               K_PAD=k_pad, FOLD=min(max(fold, k_pad), block_n), SPLIT=three, LOGITS=logits, num_warps=num_warps,
               num_stages=num_stages)
    # merge the slices: their sums of exponentials onto one max, their candidates into the top k
    top, where = values.topk(k, dim=1)
    top_max = top[:, :1]
    total = (sums * (maxes - top_max).exp()).sum(1, keepdim=True)
    return (top - top_max).exp() / total, ids.gather(1, where).long()

