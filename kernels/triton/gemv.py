"""The GEMV: ``x @ w.T`` for a few rows of activations (decode), on the CUDA cores, each weight unpacked once for all
of them. The same kernel computes llama.cpp's numerics (``llamacpp.gemv_llamacpp``): integer dot products of the
activations quantized as ggml-cpu quantizes them.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..launch_choices import GEMV_MAX_ROWS, GemvConfig, gemv_config, gemv_units, walks_chunks
from ..quant_tensor import QuantTensor
from .common import check_inputs, checked_output
from .formats import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Layout
from .k_affine import k_chunk_dots, k_chunk_dots_q8k
from .k_small import small_k_chunk_dots, small_k_dots_q8k
from .launch import INTERPRETING, cdiv, launch, next_power_of_2, programmatic_launch
from .legacy import legacy_dots_q8
from .q6_k import q6_k_dots_q8k
from .readers import chunk_load, piece_start, unit_pieces

# ---------------------------------------------------------------------------------------------
# The dot of 32-value units with float activations (exact numerics)


@triton.jit
def load_x(xp, first, K):
    """Activations ``xp[first .. first + 7]`` for each row pointer ``xp`` ``[BLOCK_M]`` and unit, as float32
    ``[BLOCK_M, BLOCK_U, 8]``."""
    index = first[:, None] + tl.arange(0, 8)[None, :]
    return tl.load(xp[:, None, None] + index[None], mask=index[None] < K, other=0.0).to(tl.float32)


@triton.jit
def dot_units(
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, first, n_units, xp, K,
    BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """For ``BLOCK_N`` weight rows, units ``first .. first + BLOCK_U - 1`` and the activation rows at ``xp``
    (``[BLOCK_M]`` pointers), the dot of each unit's weights with each row's activations,
    ``sum_p a_p * sum(f_p x_p) + b_p * sum(x_p)`` over its pieces p: ``[BLOCK_M, BLOCK_N, BLOCK_U]``.

    ``rowp`` holds the row pointer of each (row, unit) pair, rows slowest, so a thread holds the same
    unit of every weight row and of every activation row: a weight is unpacked once for all activation rows, and
    the activations, loaded once per unit (``[BLOCK_M, BLOCK_U, 8]``), are shared by all weight rows.
    """
    unit = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    x_unit = first + tl.arange(0, BLOCK_U)
    f0, f1, f2, f3, a0, b0, a1, b1, a2, b2, a3, b3 = unit_pieces(FMT, TYPE_SIZE, rowp, unit, n_units)
    if FMT == Q6_K or FMT == Q2_K or FMT == Q3_K:  # an affine map per 16 values
        dot = _dot_piece(f0, a0, b0, xp, piece_start(FMT, x_unit, 0), K, BLOCK_N, BLOCK_U)
        dot += _dot_piece(f1, a1, b1, xp, piece_start(FMT, x_unit, 1), K, BLOCK_N, BLOCK_U)
        dot += _dot_piece(f2, a2, b2, xp, piece_start(FMT, x_unit, 2), K, BLOCK_N, BLOCK_U)
        dot += _dot_piece(f3, a3, b3, xp, piece_start(FMT, x_unit, 3), K, BLOCK_N, BLOCK_U)
    else:
        dot = _dot_shared_affine(f0, f1, f2, f3, a0, b0, xp, 32 * x_unit, K, BLOCK_N, BLOCK_U)
    return dot


@triton.jit
def _pieces_of(f, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """A piece ``[units, 8]`` as ``[1, BLOCK_N, BLOCK_U, 8]``, to broadcast over activation rows."""
    return tl.reshape(f, (1, BLOCK_N, BLOCK_U, 8))


@triton.jit
def _dot_piece(f, a, b, xp, first, K, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """One piece of 8 values starting at ``first`` with its own affine map."""
    x = load_x(xp, first, K)
    fx = tl.sum(_pieces_of(f, BLOCK_N, BLOCK_U) * x[:, None], axis=3)
    return _affine(a, b, fx, tl.sum(x, axis=2), BLOCK_N, BLOCK_U)


@triton.jit
def _dot_shared_affine(f0, f1, f2, f3, a, b, xp, first, K, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """Four pieces of 32 consecutive values starting at ``first`` with one affine map: sum them element-wise
    first (a fused multiply-add per value), then across the 8 values of a piece."""
    x0 = load_x(xp, first, K)
    x1 = load_x(xp, first + 8, K)
    x2 = load_x(xp, first + 16, K)
    x3 = load_x(xp, first + 24, K)
    fx = tl.sum(
        _pieces_of(f0, BLOCK_N, BLOCK_U) * x0[:, None] + _pieces_of(f1, BLOCK_N, BLOCK_U) * x1[:, None]
        + _pieces_of(f2, BLOCK_N, BLOCK_U) * x2[:, None] + _pieces_of(f3, BLOCK_N, BLOCK_U) * x3[:, None],
        axis=3,
    )
    return _affine(a, b, fx, tl.sum(x0 + x1 + x2 + x3, axis=2), BLOCK_N, BLOCK_U)


@triton.jit
def _affine(a, b, fx, x, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``a * fx + b * x`` for per-(row, unit) ``a``, ``b``, per-(activation row, row, unit) ``fx`` and
    per-(activation row, unit) ``x``."""
    return tl.reshape(a, (1, BLOCK_N, BLOCK_U)) * fx + tl.reshape(b, (1, BLOCK_N, BLOCK_U)) * x[:, None, :]


# ---------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, x_scales_ptr, x_sums_ptr, experts_ptr, x_index_ptr,
    a_ptr, partials_ptr, counter_ptr, b_ptr, shrinks, splits, ranks, b_cols, edge1, edge2, rank0_0, rank0_1, rank0_2,
    rank_0, rank_1, rank_2, shift_0, shift_1, shift_2,
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
    USE_ASM: tl.constexpr, EVEN: tl.constexpr, LLAMACPP: tl.constexpr, CHUNKS: tl.constexpr, BY_EXPERT: tl.constexpr,
    LORA: tl.constexpr, IN_LAUNCH: tl.constexpr, SHRINK_R: tl.constexpr, SHRINK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    # Each program takes BLOCK_N weight rows and BLOCK_M rows of activations, unpacking each weight once for all of
    # them; the programs over one weight block run next to each other, so all but the first read it from L2.
    # With LLAMACPP (BLOCK_M = 1) the activations are quantized as ggml-cpu quantizes them for the weight
    # (``quantize_activations``): int8 values as int32 words at x_ptr, their scales and sums.
    program = tl.program_id(0)
    if LORA and IN_LAUNCH:  # ``LoraEpilogue``: the first programs compute the shrink, the others are the GEMV's
        if program < shrinks:
            shrink_slice(x_ptr, a_ptr, partials_ptr, program % splits, program // splits, M, K, ranks, K, SHRINK_R,
                         SHRINK_K, False)
            tl.debug_barrier()  # every thread's sums stored before one thread releases them
            tl.atomic_add(counter_ptr, SHRUNK, sem="release", scope="gpu")
            return
        program -= shrinks
    m_blocks = tl.cdiv(M, BLOCK_M)
    m_block, n_block = program % m_blocks, program // m_blocks
    m_rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    # With BY_EXPERT (BLOCK_M = 1), output row m_block is the activation row x_index[m_block] times the N rows of
    # expert experts[m_block], w's rows from experts[m_block] * N on (the stacked experts of a mixture).
    if BY_EXPERT:
        tl.static_assert(BLOCK_M == 1, "the GEMV by expert takes one (activation row, expert) pair per program")
        m = tl.load(x_index_ptr + m_block).to(tl.int64)
        w_ptr += tl.load(experts_ptr + m_block).to(tl.int64) * N * row_bytes
        x_rows = x_ptr + (m * K + tl.zeros((BLOCK_M,), dtype=tl.int64))
    else:
        m = m_block
        # Rows of activations past M and weight rows past N re-read rows from the first (never stored).
        x_rows = x_ptr + (m_rows % M).to(tl.int64) * K
    if LLAMACPP:
        tl.static_assert(BLOCK_M == 1, "the llama.cpp-numerics GEMV takes one row of activations per program")
        x_words = x_ptr.to(tl.pointer_type(tl.int32)) + m * (K // 4)
        if FMT >= Q2_K:  # the K-quants (GGML types 10-14): Q8_K, a scale per 256 values, a sum per 16
            x_scales_ptr += m * (K // 256)
            x_sums_ptr += m * (K // 16)
        else:  # Q8_0 / Q8_1: a scale and a sum per 32
            x_scales_ptr += m * (K // 32)
            x_sums_ptr += m * (K // 32)
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    # Row of each (row, unit) pair, rows slowest; rows past N are read rather than masking every load.
    pair_rows = (n_block * BLOCK_N + tl.arange(0, BLOCK_N * BLOCK_U) // BLOCK_U) % N
    rowp = w_ptr + pair_rows.to(tl.int64) * row_bytes
    if LORA:  # its tile of B^T, loaded before the weights' loop, which hides the round trip
        tl.static_assert(not LLAMACPP and not BY_EXPERT, "the LoRA epilogue takes the exact GEMV")
        lora_rank0, lora_rank, lora_b = lora_b_tile(b_ptr, b_cols, edge1, edge2, rank0_0, rank0_1, rank0_2, rank_0,
                                                    rank_1, rank_2, shift_0, shift_1, shift_2, n_block * BLOCK_N, rows,
                                                    N, BLOCK_R)
        if not IN_LAUNCH and not PDL:  # the shrink ended before this launch
            lora_partials = lora_partials_load(partials_ptr, splits, ranks, lora_rank0, lora_rank, m_rows, M, BLOCK_S,
                                               BLOCK_R)
    # One partial sum per (activation row, weight row, unit), reduced across threads once at the end.
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_U), dtype=tl.float32)
    if CHUNKS:  # ``walks_chunks``
        n_chunks = K // 64
        # Each step's weights are loaded one step ahead (the last step's look-ahead re-reads the row's last
        # chunk, which is cached), so that a step's loads are in flight while the previous step's chunks are unpacked
        # (docs/performance.md, "The Q4_K GEMV").
        raw = chunk_load(rowp, 0, n_chunks, FMT, BLOCK_N, BLOCK_U)
        for first in range(0, n_chunks, BLOCK_U):
            raw_next = chunk_load(rowp, first + BLOCK_U, n_chunks, FMT, BLOCK_N, BLOCK_U)
            if LLAMACPP:
                acc += k_chunk_dots_q8k(raw, first, n_chunks, x_words, x_scales_ptr, x_sums_ptr, FMT, BLOCK_N, BLOCK_U,
                                        USE_ASM, EVEN)[None]
            elif FMT == Q4_K or FMT == Q5_K:
                acc += k_chunk_dots(raw, first, x_rows, K, FMT, BLOCK_N, BLOCK_U, USE_ASM, EVEN)
            else:
                acc += small_k_chunk_dots(raw, first, x_rows, K, FMT, BLOCK_N, BLOCK_U, USE_ASM, EVEN)
            raw = raw_next
    else:
        n_units = K // 32
        for first in range(0, n_units, BLOCK_U):
            if LLAMACPP and FMT == Q6_K:
                acc += q6_k_dots_q8k(rowp, first, n_units, x_words, x_scales_ptr, TYPE_SIZE, BLOCK_N, BLOCK_U,
                                     USE_ASM)[None]
            elif LLAMACPP and (FMT == Q2_K or FMT == Q3_K):
                acc += small_k_dots_q8k(FMT, TYPE_SIZE, rowp, first, n_units, x_words, x_scales_ptr, x_sums_ptr, BLOCK_N,
                                        BLOCK_U, USE_ASM)[None]
            elif LLAMACPP:
                acc += legacy_dots_q8(FMT, TYPE_SIZE, rowp, first, n_units, x_words, x_scales_ptr, x_sums_ptr, BLOCK_N,
                                      BLOCK_U, USE_ASM)[None]
            else:
                acc += dot_units(FMT, TYPE_SIZE, rowp, first, n_units, x_rows, K, BLOCK_N, BLOCK_U)
    if LORA and (IN_LAUNCH or PDL):  # the weights' loop ran beside the shrink; only the partial sums wait for it
        if IN_LAUNCH:
            arrival = lora_arrive(counter_ptr, shrinks)
        else:
            gdc_wait()
        lora_partials = lora_partials_load(partials_ptr, splits, ranks, lora_rank0, lora_rank, m_rows, M, BLOCK_S,
                                           BLOCK_R)
    out_ptrs = out_ptr + m_rows.to(tl.int64)[:, None] * N + rows[None, :]
    out = tl.sum(acc, axis=2).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, lora_sum(out, lora_b, lora_partials) if LORA else out,
             mask=(m_rows[:, None] < M) & (rows[None, :] < N))
    if LORA and IN_LAUNCH:
        lora_leave(counter_ptr, arrival, tl.num_programs(0) - shrinks)


# The GEMV's programs of one launch meet at a counter (``LoraEpilogue.counter``): each shrink program adds SHRUNK once
# its partial sums are stored, each tile program 1 when its weights' loop is done, and the last tile to arrive sets it
# back to 0 for the next launch. Up to 32,767 shrink and 65,535 tile programs.
SHRUNK = tl.constexpr(1 << 16)
ARRIVALS = tl.constexpr((1 << 16) - 1)


@triton.jit
def shrink_slice(x_ptr, a_ptr, partials_ptr, split, block, M, K, ranks, x_stride, SHRINK_R: tl.constexpr,
                 SHRINK_K: tl.constexpr, PDL: tl.constexpr):
    """``SHRINK_R`` rows of A by one slice of ``SHRINK_K`` inputs, for every row of activations, into the partial
    sums ``[splits, M, ranks]``, all its loads in flight at once. With ``PDL`` (a launch of its own, started while the
    kernel that writes x runs) A's load is on its way before it waits for that kernel, and the GEMV after it may start
    then."""
    r = block * SHRINK_R + tl.arange(0, SHRINK_R)
    i = split * SHRINK_K + tl.arange(0, SHRINK_K)
    a = tl.load(a_ptr + r[:, None] * K + i[None, :], mask=(r < ranks)[:, None] & (i < K)[None, :], other=0.0)
    a = a.to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for m in range(M):
        x = tl.load(x_ptr + m * x_stride + i, mask=i < K, other=0.0).to(tl.float32)
        tl.store(partials_ptr + (split * M + m) * ranks + r, tl.sum(a * x[None, :], axis=1), mask=r < ranks)


@triton.jit
def lora_arrive(counter_ptr, shrinks):
    """A tile program's arrival after its weights' loop; it returns once every shrink program is done (the count of
    them reached, or the counter already set back to 0 by the last tile, which only does so after that), with its
    arrival number. The shrink programs come first in the grid, so they started before any tile waits for them."""
    arrival = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    seen = arrival + 1
    while seen < shrinks * SHRUNK and seen != 0:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    return arrival & ARRIVALS


@triton.jit
def lora_leave(counter_ptr, arrival, tiles):
    """The last tile program to arrive sets the counter back to 0 (every other one has seen the shrink done by then, or
    sees the 0)."""
    if arrival == tiles - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="release", scope="gpu")


@triton.jit
def lora_b_tile(b_ptr, b_cols, edge1, edge2, rank0_0, rank0_1, rank0_2, rank_0, rank_1, rank_2, shift_0, shift_1,
                shift_2, first_row, rows, N, BLOCK_R: tl.constexpr):
    """A program's part of its LoRA terms (``LoraEpilogue``): its first rank and rank, and its tile of ``B^T``
    ``[BLOCK_R, BLOCK_N]``. Its weight rows lie in one part (the parts' first rows ``edge1`` and ``edge2`` are
    multiples of ``BLOCK_N``), whose ranks are rows ``rank0 ..`` of the partials and whose B^T columns are its rows
    plus ``shift``; a part of rank 0 has no term."""
    rank0 = tl.where(first_row >= edge2, rank0_2, tl.where(first_row >= edge1, rank0_1, rank0_0))
    rank = tl.where(first_row >= edge2, rank_2, tl.where(first_row >= edge1, rank_1, rank_0))
    shift = tl.where(first_row >= edge2, shift_2, tl.where(first_row >= edge1, shift_1, shift_0))
    r = tl.arange(0, BLOCK_R)
    b = tl.load(b_ptr + (rank0 + r)[:, None] * b_cols + (rows + shift)[None, :],
                mask=(r < rank)[:, None] & (rows < N)[None, :], other=0.0)
    return rank0, rank, b


@triton.jit
def lora_partials_load(partials_ptr, splits, ranks, rank0, rank, m_rows, M, BLOCK_S: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    """The shrink's partial sums ``[splits, M, ranks]`` of a program's rows of activations and its part's ranks,
    ``[BLOCK_S, BLOCK_M, BLOCK_R]``."""
    r = tl.arange(0, BLOCK_R)
    split = tl.arange(0, BLOCK_S)
    partial_rows = (split[:, None, None] * M + m_rows[None, :, None]) * ranks
    # from L2: another multiprocessor's shrink program wrote them during this launch
    return tl.load(partials_ptr + partial_rows + (rank0 + r)[None, None, :],
                   mask=(split < splits)[:, None, None] & (m_rows < M)[None, :, None] & (r < rank)[None, None, :],
                   other=0.0, cache_modifier=".cg")


@triton.jit
def lora_sum(out, b, partials):
    """The GEMV's rounded ``out`` ``[BLOCK_M, BLOCK_N]`` plus its LoRA terms, rounded as the torch formula rounds:
    ``A x`` (the partials summed) to the output's dtype, then the term, then the sum."""
    dtype = out.dtype
    shrunk = tl.sum(partials, axis=0).to(dtype).to(tl.float32)
    term = tl.sum(shrunk[:, :, None] * b.to(tl.float32)[None, :, :], axis=1).to(dtype).to(tl.float32)
    return (out.to(tl.float32) + term).to(dtype)


class LoraEpilogue(NamedTuple):
    """LoRA terms the GEMV adds to its output (``kernels.triton.lora.linear_with_terms``): ``b_t`` ``[R, O]`` the
    ``B^T`` rows of the parts of the GEMV's output rows, up to three, the first from row 0, the others from ``edges``
    (multiples of the GEMV's ``block_n``, past the rows where there are fewer parts): part p takes ranks ``rank0s[p]``
    to ``rank0s[p] + ranks[p] - 1`` (none: rank 0) and row n of it ``B^T``'s column ``n + shifts[p]``.

    ``A x`` comes one of two ways, both as float32 sums over slices of the input:

    - ``partials`` ``[splits, M, R]``, from a launch of its own right before (``lora.shrink``); on Hopper the GEMV
      starts while it runs, streams its weights and waits for it only to read the sums;
    - or, with ``a`` ``[R, K]`` and ``counter`` (one int32, 0 between launches, used by no other stream at the same
      time: ``lora.arrival_counter``), from the launch's own first programs, which the GEMV's programs wait for at
      the counter: one launch where the other way takes two, but every program pays an atomic's round trip, so it
      serves launches whose programs all run at once."""

    b_t: torch.Tensor
    edges: tuple[int, int]
    rank0s: tuple[int, int, int]
    ranks: tuple[int, int, int]
    shifts: tuple[int, int, int]
    partials: torch.Tensor | None = None
    a: torch.Tensor | None = None
    counter: torch.Tensor | None = None


SHRINK_SLICE = 1024  # inputs per shrink program, at least
MAX_SPLITS = 32  # slices of the input at most: every program of the GEMV reads its part's partial sums of each
SHRINK_VALUES = 1024  # values of A per warp of a shrink program: 32 a thread, all loaded at once


def shrink_tiling(k: int, ranks: int, num_warps: int) -> tuple[int, int, int]:
    """The shrink programs' tiles for an input of ``k`` and ``ranks`` rows of A: (slices of the input, inputs a slice,
    rows of A a program). With 4 warps, an 8B's down (rank 16 by 14,336 inputs) takes 14 slices of 4 rows, 56 programs
    of 4,096 values of A, where one program's dependent steps over the whole input took 9.9 us."""
    block_k = min(max(SHRINK_SLICE, next_power_of_2(cdiv(k, MAX_SPLITS))), max(32, next_power_of_2(k)))
    block_r = max(1, min(next_power_of_2(ranks), SHRINK_VALUES * num_warps // block_k))
    return cdiv(k, block_k), block_k, block_r


def gemv(x: torch.Tensor, w: QuantTensor, config: GemvConfig | None = None,
         lora: LoraEpilogue | None = None) -> torch.Tensor:
    """``x @ w.T`` for up to ``GEMV_MAX_ROWS`` rows of ``x`` (decode, batched decode), on the CUDA cores: one
    pass over the weight per ``config.block_m`` rows, its programs side by side so that the others read it from L2;
    with ``lora``, plus its terms."""
    layout, out = checked_output(x, w, max_rows=GEMV_MAX_ROWS)
    m, k = x.shape
    if m == 0:
        return out
    launch_gemv(w, out, layout, config or gemv_config(k, w.fmt.name, m), x, x, x, llamacpp=False, lora=lora)
    return out


def gemv_by_expert(x: torch.Tensor, w: QuantTensor, n_experts: int, experts: torch.Tensor,
                   x_rows: torch.Tensor) -> torch.Tensor:
    """Row ``p`` of the ``[P, w.shape[0] // n_experts]`` result is ``x[x_rows[p]] @ W_e.T`` for ``e = experts[p]``,
    where ``w`` stacks ``n_experts`` matrices ``W_e`` by rows (an MoE's ``ffn_*_exps``, as stored): llama.cpp's
    ``mul_mat_id``. Only the chosen experts' rows are read, and the pairs come as device tensors (no host sync); each
    pair is one pass over its expert's rows, so this is made for decode. ``experts`` must lie in ``0..n_experts - 1``
    and ``x_rows`` in ``0..len(x) - 1`` (not checked here: that would read them on the host)."""
    layout, out = checked_by_expert_output(x, w, n_experts, experts, x_rows)
    if len(out):
        launch_gemv(w, out, layout, by_expert_config(gemv_config(x.shape[1], w.fmt.name)), x, x, x, llamacpp=False,
                    by_expert=(experts, x_rows))
    return out


def checked_by_expert_output(x: torch.Tensor, w: QuantTensor, n_experts: int, experts: torch.Tensor,
                             x_rows: torch.Tensor, **limits) -> tuple[Layout, torch.Tensor]:
    """``check_inputs`` and the pairs' shapes, and the uninitialized ``[P, rows per expert]`` output in ``x.dtype``."""
    if n_experts < 1 or w.shape[0] % n_experts:
        raise ValueError(f"{w.shape[0]} rows do not stack {n_experts} experts")
    if (experts.dim() != 1 or experts.shape != x_rows.shape or experts.device != x.device or x_rows.device != x.device
            or experts.dtype not in (torch.int32, torch.int64) or x_rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"experts and x_rows must be 1-D int32/int64 tensors of one length on {x.device}, got "
                         f"{tuple(experts.shape)} {experts.dtype} and {tuple(x_rows.shape)} {x_rows.dtype}")
    layout = check_inputs(x, w, **limits)
    return layout, torch.empty(len(experts), w.shape[0] // n_experts, dtype=x.dtype, device=x.device)


def by_expert_config(config: GemvConfig) -> GemvConfig:
    """``config`` with one row of activations per program: the GEMV by expert gives each program one pair."""
    return config if config.block_m == 1 else dataclasses.replace(config, block_m=1)


def launch_gemv(w: QuantTensor, out: torch.Tensor, layout: Layout, config: GemvConfig, activations: torch.Tensor,
                 x_scales: torch.Tensor, x_sums: torch.Tensor, llamacpp: bool,
                 by_expert: tuple[torch.Tensor, torch.Tensor] | None = None, lora: LoraEpilogue | None = None) -> None:
    """``_gemv_kernel`` over ``out``'s rows of activations: floats, or (``llamacpp``) ``quantize_activations``'
    values, scales and sums (the exact GEMV passes its activations for the two unused pointers); or, with
    ``by_expert`` (experts, x_rows), over ``out``'s (activation row, expert) pairs (``gemv_by_expert``); with
    ``lora`` (exact floats only), its terms added."""
    (m, n), k = out.shape, w.shape[1]
    experts, x_rows = by_expert if by_expert is not None else (activations, activations)
    tiles = cdiv(n, config.block_n) * cdiv(m, config.block_m)
    shrinks, tiling, in_launch, pdl = 0, (1, 1, 1), False, False
    if lora is None:  # the epilogue's arguments unused: the kernel compiles without it
        lora_arguments, block_s, block_r = (activations,) * 4 + (0,) * 15, 1, 1
    else:
        ranks = lora.b_t.shape[0]
        in_launch = lora.partials is None
        if in_launch:
            tiling = shrink_tiling(k, ranks, config.num_warps)
            shrinks = tiling[0] * cdiv(ranks, tiling[2])
            partials = torch.empty(tiling[0], m, ranks, dtype=torch.float32, device=out.device)
        else:
            partials = lora.partials
            pdl = programmatic_launch(out.device)
        a, counter = (lora.a, lora.counter) if in_launch else (activations, activations)
        lora_arguments = (a, partials, counter, lora.b_t, shrinks, partials.shape[0], ranks, lora.b_t.shape[1],
                          *lora.edges, *lora.rank0s, *lora.ranks, *lora.shifts)
        block_s, block_r = next_power_of_2(partials.shape[0]), max(16, next_power_of_2(max(lora.ranks)))
    launch(_gemv_kernel, (shrinks + tiles,),
        activations, w.data, out, m, n, k, w.data.shape[1], x_scales, x_sums, experts, x_rows, *lora_arguments,
        FMT=layout.ggml_type, TYPE_SIZE=layout.type_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_U=config.block_u, USE_ASM=not INTERPRETING,
        EVEN=gemv_units(k, w.fmt.name, llamacpp) % config.block_u == 0, LLAMACPP=llamacpp,
        CHUNKS=walks_chunks(w.fmt.name, llamacpp), BY_EXPERT=by_expert is not None,
        LORA=lora is not None, IN_LAUNCH=in_launch, SHRINK_R=tiling[2], SHRINK_K=tiling[1], BLOCK_S=block_s,
        BLOCK_R=block_r, PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
    )
