"""LoRA terms on CUDA, for ``workbench.kernels.lora``: each output of a group of projections that share an input plus its
term ``B_p (A_p x)``, the shrink, the expansion and the add in one launch per group where the two matmuls, the split
and the adds take four kernels or more (a decode step of a small model is bound by its kernel count).

Each program takes one token, one part of the group and a tile of that part's output columns: it computes the part's
``A_p x`` itself (at most ``MAX_RANK`` values; every program of a part reads the same rows of A, from L2), then its
tile of ``B_p^T`` times them, then adds the base output. A launch this small takes the time of its chain of dependent
memory round trips, so the chain is kept short: the tile of ``B_p^T`` and the base output, which do not depend on the
shrink, are loaded before it, the shrink's steps load several ahead (a pipelined loop) and its products are summed
across threads once, after the loop: on the embedded model's shapes a program waits for one round trip, then sums
and stores (an 8B's inputs of 4096 and more take a round trip per 3 steps of the shrink).

Where the base's matmul is the GEMV, ``linear_with_terms`` adds the terms there instead (``gemv.LoraEpilogue``): the
GEMV's epilogue sums the partial sums of ``A x`` over slices of the input, multiplies its tile of ``B^T`` and adds the
term to its own output, which is stored once. The partial sums come from many small programs, each a slice of the
input by a few rows of A: in the GEMV's own launch, ahead of its programs, which wait for them at a counter, where all
the launch's programs run at once (a small model's decode step, bound by its launches); else from ``shrink``, a launch
of its own, which on Hopper starts while the kernel that writes x ends, the GEMV while the shrink runs.

Both round where the torch formula does: ``A x`` and the term each to the activations' dtype (as a matmul's result),
then the sum. Under ``TRITON_INTERPRET=1`` they run on CPU tensors (the tests).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..launch_choices import gemv_config, sm_count
from ..quant_tensor import QuantTensor
from .gemv import ARRIVALS, LoraEpilogue, gemv, shrink_slice, shrink_tiling
from .launch import cdiv, launch, next_power_of_2, programmatic_launch

MAX_PARTS = 3  # q, k and v
MAX_RANK = 128  # per part; a larger rank takes the torch formula
MAX_STAGES = 4  # buffers of the shrink's pipelined loop: 3 steps loading ahead of the one summed
STAGE_BYTES = 72 * 1024  # shared memory for them


@triton.jit
def _part_terms(x_ptr, a_ptr, b_ptr, base_ptr, out_ptr, token, tile, k, cols, x_stride, base_stride, width, col0,
                rank0, rank, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr):
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if tile * BLOCK_N < width:
        r = tl.arange(0, BLOCK_R)
        ranked = r < rank
        inside = n < width
        # B^T's tile and the base output do not wait for the shrink: loaded first, they arrive while it runs
        b = tl.load(b_ptr + (rank0 + r)[:, None] * cols + (col0 + n)[None, :], mask=ranked[:, None] & inside[None, :],
                    other=0.0)
        base = tl.load(base_ptr + token * base_stride + n, mask=inside, other=0.0)
        # the shrink's steps load up to STAGES - 1 ahead (their round trips overlap) and sum across threads once,
        # after the loop, not once a step
        products = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for first in tl.range(0, k, BLOCK_K, num_stages=STAGES):
            i = first + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * x_stride + i, mask=i < k, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + (rank0 + r)[:, None] * k + i[None, :], mask=ranked[:, None] & (i < k)[None, :],
                        other=0.0).to(tl.float32)
            products += a * x[None, :]
        dtype = out_ptr.dtype.element_ty
        shrunk = tl.sum(products, axis=1).to(dtype).to(tl.float32)
        term = tl.sum(b.to(tl.float32) * shrunk[:, None], axis=0).to(dtype).to(tl.float32)
        tl.store(out_ptr + token * cols + col0 + n, (base.to(tl.float32) + term).to(dtype), mask=inside)


@triton.jit
def _lora_kernel(x_ptr, a_ptr, b_ptr, base0, base1, base2, out_ptr, k, cols, x_stride,
                 stride0, stride1, stride2, width0, width1, width2, rank0, rank1, rank2,
                 PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr):
    tile, part, token = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if part == 0:
        _part_terms(x_ptr, a_ptr, b_ptr, base0, out_ptr, token, tile, k, cols, x_stride, stride0, width0, 0, 0, rank0,
                    BLOCK_N, BLOCK_R, BLOCK_K, STAGES)
    if PARTS > 1:
        if part == 1:
            _part_terms(x_ptr, a_ptr, b_ptr, base1, out_ptr, token, tile, k, cols, x_stride, stride1, width1, width0,
                        rank0, rank1, BLOCK_N, BLOCK_R, BLOCK_K, STAGES)
    if PARTS > 2:
        if part == 2:
            _part_terms(x_ptr, a_ptr, b_ptr, base2, out_ptr, token, tile, k, cols, x_stride, stride2, width2,
                        width0 + width1, rank0 + rank1, rank2, BLOCK_N, BLOCK_R, BLOCK_K, STAGES)


def lora_add(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, outs: Sequence[torch.Tensor],
             ranks: Sequence[int]) -> torch.Tensor:
    """``lora.add_terms`` in one launch: ``x`` ``[T, in]`` (rows of contiguous values), ``a`` ``[R, in]`` and ``b_t``
    ``[R, O]`` contiguous, up to ``MAX_PARTS`` outputs ``[T, width]`` (rows of contiguous values), all of one float
    dtype, ranks up to ``MAX_RANK``; the sums side by side, a new ``[T, O]``."""
    tokens, k = x.shape
    widths = [out.shape[-1] for out in outs]
    if (not 0 < len(outs) <= MAX_PARTS or len(ranks) != len(outs) or min(ranks) < 1 or max(ranks) > MAX_RANK
            or a.shape != (sum(ranks), k) or b_t.shape != (sum(ranks), sum(widths)) or x.stride(1) != 1
            or not a.is_contiguous() or not b_t.is_contiguous()
            or any(out.dtype != x.dtype or out.shape[0] != tokens or out.stride(-1) != 1 for out in outs)
            or a.dtype != x.dtype or b_t.dtype != x.dtype):
        raise ValueError(f"lora_add: x {x.dtype} {tuple(x.shape)}, a {a.dtype} {tuple(a.shape)}, b_t {b_t.dtype} "
                         f"{tuple(b_t.shape)}, outputs {[tuple(out.shape) for out in outs]}, ranks {list(ranks)}")
    result = torch.empty(tokens, sum(widths), dtype=x.dtype, device=x.device)
    if tokens:
        # each step of the shrink 32 products a thread, and every step in flight at once where shared memory holds
        # them (the pipelined loop keeps STAGES - 1 ahead): the embedded model's inputs of 576 and 1536 take 3 and 6
        # steps, an 8B's 4096 and 14336 16 and 56. Every program of a part reads all of its A, so a program's tile of
        # B^T grows with the input (an eighth of it, up to 8192 values): an 8B's gate/up reads its A 56 times a layer
        # (7 MB), not 224 (29 MB). At 512 columns 8 warps took 4-30 % longer than 4 in each of the 8B's groups (H100)
        block_r = max(16, next_power_of_2(max(ranks)))
        num_warps = 4
        block_k = max(32, min(next_power_of_2(k), 1024 * num_warps // block_r))
        block_n = max(32, min(next_power_of_2(k) // 8, 8192 // block_r))
        steps = cdiv(k, block_k)
        stages = 1 if steps == 1 else max(1, min(steps + 1, MAX_STAGES,
                                                 STAGE_BYTES // ((block_r + 1) * block_k * x.element_size())))
        pad = 3 - len(outs)
        bases = [*outs, *[outs[0]] * pad]
        launch(_lora_kernel, (cdiv(max(widths), block_n), len(outs), tokens),
               x, a, b_t, *bases, result, k, b_t.shape[1], x.stride(0), *[out.stride(0) for out in bases],
               *widths, *[0] * pad, *ranks, *[0] * pad,
               PARTS=len(outs), BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k, STAGES=stages,
               num_warps=num_warps)
    return result


# ---------------------------------------------------------------------------------------------
# The terms inside the base's GEMV (``linear_with_terms``): the shrink in a launch of its own or in the GEMV's first
# programs, the rest in its epilogue (``gemv.LoraEpilogue``)

# The shrink goes into the GEMV's own launch where every launch of the group comes to at most this many warps a
# multiprocessor (a GEMV of 255 registers a thread holds 8 at once): there the launch saved is worth more than the
# atomic's round trip each program pays, in larger launches programs that run one after another each pay it. On an
# H200 (docs/performance.md, "LoRA adapters") the embedded shape's launches (up to 768 programs of one warp) decoded
# at 0.81x the base with the shrink in them against 0.78x apart; the 8B's (1,024 programs and more) at 0.77x against
# 0.88x.
IN_LAUNCH_WARPS = 6
COUNTER_SLOTS = 64  # streams of one device that may launch the GEMV with its shrink at the same time
_counter_pools: dict[torch.device, torch.Tensor] = {}
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counter(device: torch.device) -> torch.Tensor | None:
    """The int32 at which the programs of a GEMV with its shrink on ``device``'s current stream meet
    (``gemv.LoraEpilogue``): one per stream, since launches on one stream never overlap and each leaves it at 0. None
    where there is none to be had: every slot taken, or the first one asked for inside a CUDA graph capture, which
    cannot zero new memory (a captured step's warm-up asks first, outside it)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    counter = _counters.get((device, stream))
    if counter is None:
        pool = _counter_pools.get(device)
        if pool is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            # a 128-byte line a slot: streams' counters apart
            pool = _counter_pools[device] = torch.zeros(COUNTER_SLOTS, 32, dtype=torch.int32, device=device)
        taken = sum(1 for taken_device, _ in _counters if taken_device == device)
        if taken == COUNTER_SLOTS:
            return None
        counter = _counters[device, stream] = pool[taken, :1]
    return counter


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, partials_ptr, M, K, R, x_stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    shrink_slice(x_ptr, a_ptr, partials_ptr, tl.program_id(0), tl.program_id(1), M, K, R, x_stride, BLOCK_R, BLOCK_K,
                 PDL)


def shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``A x`` for ``x`` ``[T, in]`` (rows of contiguous values) and ``a`` ``[R, in]`` contiguous, summed over slices
    of the input in float32 but not across them: ``[splits, T, R]``, many small programs of 4 warps
    (``gemv.shrink_tiling``). On Hopper it may start before the kernel ahead of it ends and reads A then, so that kernel
    must not write A (in the forward it is the one that writes x)."""
    tokens, k = x.shape
    splits, block_k, block_r = shrink_tiling(k, a.shape[0], 4)
    partials = torch.empty(splits, tokens, a.shape[0], dtype=torch.float32, device=x.device)
    pdl = programmatic_launch(x.device)
    launch(_shrink_kernel, (splits, cdiv(a.shape[0], block_r)), x, a, partials, tokens, k, a.shape[0], x.stride(0),
           BLOCK_R=block_r, BLOCK_K=block_k, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return partials


def linear_with_terms(x: torch.Tensor, weights: Sequence[QuantTensor], widths: Sequence[int], a: torch.Tensor,
                      b_t: torch.Tensor, part_ranks: Sequence[int]) -> list[torch.Tensor] | None:
    """``x @ w.T`` for each of ``weights`` through the GEMV, which adds each part's LoRA term, and the base's output is
    never read back: where every launch's programs run at once (``IN_LAUNCH_WARPS``), one launch a weight, whose
    first programs compute its parts' ``A x``; else ``shrink`` first, then the GEMVs.

    ``weights`` cover the group's parts of ``widths`` output rows in order (one stacked weight for all, or one each);
    ``part_ranks`` the parts' ranks (0: no term), the rows of ``a`` ``[R, in]`` in part order, ``b_t`` ``[R, O]`` the
    adapted parts' ``B^T`` as blocks of a block-diagonal matrix (``lora.add_terms``); ``x`` ``[T, in]`` contiguous,
    up to ``GEMV_MAX_ROWS`` rows, one float dtype with ``a`` and ``b_t``; ranks up to ``MAX_RANK``. None where a
    weight's parts start at rows that its GEMV's programs would straddle (nothing launched). It rounds as ``lora_add``
    does."""
    tokens, k = x.shape
    starts = list(accumulate(widths, initial=0))  # each part's first row in the group
    rank0s = list(accumulate(part_ranks, initial=0))
    columns = list(accumulate((width if rank else 0 for width, rank in zip(widths, part_ranks)), initial=0))
    if (len(part_ranks) != len(widths) or min(part_ranks) < 0 or not 0 < max(part_ranks) <= MAX_RANK
            or not set(accumulate((w.shape[0] for w in weights), initial=0)) <= set(starts)
            or sum(w.shape[0] for w in weights) != starts[-1] or a.shape != (rank0s[-1], k)
            or b_t.shape != (rank0s[-1], columns[-1]) or not a.is_contiguous() or not b_t.is_contiguous()
            or a.dtype != x.dtype or b_t.dtype != x.dtype):
        raise ValueError(f"linear_with_terms: weights of {[w.shape[0] for w in weights]} rows for parts {list(widths)}"
                         f" of ranks {list(part_ranks)}, x {x.dtype}, a {a.dtype} {tuple(a.shape)}, b_t {b_t.dtype} "
                         f"{tuple(b_t.shape)}")
    plans, first_row = [], 0  # each weight's GEMV tiling and parts
    for w in weights:
        parts = [p for p in range(len(widths)) if first_row <= starts[p] < first_row + w.shape[0]]
        config = gemv_config(k, w.fmt.name, tokens)
        if any(part_ranks[p] for p in parts) and (len(parts) > MAX_PARTS or any(
                (starts[p] - first_row) % config.block_n for p in parts)):
            return None
        plans.append((w, config, parts, first_row))
        first_row += w.shape[0]
    programs = [cdiv(w.shape[0], config.block_n) * cdiv(tokens, config.block_m) for w, config, _, _ in plans]
    warps = max(n * config.num_warps for n, (_, config, _, _) in zip(programs, plans))
    in_launch = warps <= IN_LAUNCH_WARPS * sm_count(x.device) and max(programs) <= ARRIVALS.value
    counter = arrival_counter(x.device) if in_launch else None
    partials = shrink(x, a) if counter is None else None
    outs = []
    for w, config, parts, first_row in plans:
        ranks = [part_ranks[p] for p in parts]
        if not any(ranks):
            outs.append(gemv(x, w, config))
            continue
        # the launch's rows of a and b_t: its parts' where it shrinks them itself, else the whole group's
        first_rank, last_rank = (rank0s[parts[0]], rank0s[parts[-1] + 1]) if counter is not None else (0, rank0s[-1])
        pad = [0] * (MAX_PARTS - len(parts))
        edges = (*[starts[p] - first_row for p in parts[1:]], *[w.shape[0]] * (len(pad) + 1))[:2]
        lora = LoraEpilogue(b_t[first_rank:last_rank], edges, (*[rank0s[p] - first_rank for p in parts], *pad),
                            (*ranks, *pad), (*[columns[p] - (starts[p] - first_row) for p in parts], *pad), partials,
                            None if counter is None else a[first_rank:last_rank], counter)
        outs.append(gemv(x, w, config, lora))
    return outs
