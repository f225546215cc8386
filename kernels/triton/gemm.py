"""The fused GEMM: ``x @ w.T`` for batched decode and prefill, weight tiles dequantized into registers and fed to
``tl.dot`` (tensor cores) as its first operand, with K split over several programs when there are few rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_choices import GemmConfig, gemm_config, gemm_walks_chunks
from ..quant_tensor import QuantTensor
from .common import checked_output, dot_precision, tile_grid
from .launch import launch
from .readers import chunk_columns, chunk_load, chunk_tile, weight_tile


@triton.jit
def tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The first activation row and first weight row of this program's output tile. Programs that share weight rows
    run together, GROUP_M row blocks at a time, so their weight tiles are reused from L2."""
    pid = tl.program_id(0)
    programs_m = tl.cdiv(M, BLOCK_M)
    programs_n = tl.cdiv(N, BLOCK_N)
    group_first_m = (pid // (GROUP_M * programs_n)) * GROUP_M
    group_size = tl.minimum(programs_m - group_first_m, GROUP_M)
    pid_m = group_first_m + (pid % (GROUP_M * programs_n)) % group_size
    pid_n = (pid % (GROUP_M * programs_n)) // group_size
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, row_bytes,
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_U: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    # The weight tile is the dot's first operand, so the output tile is [BLOCK_N, BLOCK_M] (w @ x.T): on Hopper the
    # unpacked weights then go to the tensor cores from registers, and a few rows of activations fill an 8- or 16-wide
    # side of the instruction rather than a 64-row one.
    # program_id(1) picks one of SPLIT_K equal runs of K steps (see ``_store_tile`` for how their sums meet).
    first_m, first_n = tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows_m, rows_n = first_m + tl.arange(0, BLOCK_M), first_n + tl.arange(0, BLOCK_N)
    n_units = K // 32
    split_units = tl.cdiv(tl.cdiv(n_units, BLOCK_U), SPLIT_K) * BLOCK_U
    unit_start = tl.program_id(1) * split_units
    unit_end = tl.minimum(unit_start + split_units, n_units)
    # Rows past M (and weight rows past N) re-read rows from the first instead of masking loads; they are never stored.
    # Not all the last row: a partial tile whose rows past M all load one address runs much slower (docs/performance.md,
    # "Fused GEMM tiles and split-K").
    x_columns = x_ptr + (rows_m % M).to(tl.int64)[None, :] * K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if CHUNKS:  # ``gemm_walks_chunks``
        # The GEMV's 64-value chunks (BLOCK_U // 2 per row and step), loaded one step ahead of the unpacking, the
        # activations gathered in the tile's column order.
        pair = tl.arange(0, BLOCK_N * (BLOCK_U // 2))  # (weight row, chunk) pairs, rows slowest
        rowp = w_ptr + ((first_n + pair // (BLOCK_U // 2)) % N).to(tl.int64) * row_bytes
        n_chunks = K // 64
        raw = chunk_load(rowp, unit_start // 2, n_chunks, FMT, BLOCK_N, BLOCK_U // 2)
        for first in range(unit_start // 2, unit_end // 2, BLOCK_U // 2):
            raw_next = chunk_load(rowp, first + BLOCK_U // 2, n_chunks, FMT, BLOCK_N, BLOCK_U // 2)
            k = chunk_columns(first, FMT, BLOCK_U // 2)[:, None]
            x_t = tl.load(x_columns + k, mask=k < K, other=0.0)
            w = chunk_tile(raw, first, FMT, BLOCK_N, BLOCK_U // 2)
            acc = tl.dot(w.to(x_t.dtype), x_t, acc, input_precision=DOT_PRECISION)
            raw = raw_next
    else:
        pair = tl.arange(0, BLOCK_N * BLOCK_U)  # (weight row, unit) pairs, rows slowest
        rowp = w_ptr + ((first_n + pair // BLOCK_U) % N).to(tl.int64) * row_bytes
        for first in range(unit_start, unit_end, BLOCK_U):
            w = weight_tile(FMT, TYPE_SIZE, rowp, first + pair % BLOCK_U, n_units, BLOCK_N, BLOCK_U)
            k = 32 * first + tl.arange(0, 32 * BLOCK_U)[:, None]
            x_t = tl.load(x_columns + k, mask=k < K, other=0.0)
            acc = tl.dot(w.to(x_t.dtype), x_t, acc, input_precision=DOT_PRECISION)
    _store_tile(acc, out_ptr, partial_ptr, counter_ptr, rows_m, rows_n, M, N, SPLIT_K)


@triton.jit
def _store_tile(acc, out_ptr, partial_ptr, counter_ptr, rows_m, rows_n, M, N, SPLIT_K: tl.constexpr):
    """Store a program's ``[BLOCK_N, BLOCK_M]`` tile of ``out`` (``[M, N]``). With ``SPLIT_K`` > 1 it is one of
    ``SPLIT_K`` partial sums: each goes to ``partial_ptr`` (float32 ``[SPLIT_K, M, N]``), and the last program of
    the tile to arrive (counted in ``counter_ptr``, one int32 per program along ``program_id(0)``, zero between
    calls) adds them up in a fixed order, so results repeat exactly, and zeroes its counter for the next call."""
    tile = rows_m.to(tl.int64)[None, :] * N + rows_n[:, None]
    mask = (rows_m[None, :] < M) & (rows_n[:, None] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        plane = tl.cast(M, tl.int64) * N  # M is a constant when it is 1
        tl.store(partial_ptr + tl.program_id(1) * plane + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        arrived = tl.atomic_add(counter_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for part in tl.static_range(SPLIT_K):  # from L2 (.cg): the other programs' stores are not in this L1
                total += tl.load(partial_ptr + part * plane + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + tl.program_id(0), 0)


def gemm(x: torch.Tensor, w: QuantTensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` for any number of rows, dequantizing weight tiles into ``tl.dot``."""
    layout, out = checked_output(x, w)
    (m, k), n = x.shape, w.shape[0]
    if m == 0:
        return out
    config = config or gemm_config(m, n, k, x.device, w.fmt.name)
    if config.split_k < 1:
        raise ValueError(f"split_k must be at least 1, got {config.split_k}")
    # A Q6_K tile is reordered within whole super-blocks (8 units); a chunk tile's steps are whole 64-value chunks
    # (2 units).
    chunks = gemm_walks_chunks(w.fmt.name, config.block_m)
    block_u = max(config.block_u, 8 if w.fmt.name == "Q6_K" else 2 if chunks else 1)
    grid = (*tile_grid(m, n, config), config.split_k)
    partials, counters = out, out  # unused without a split
    if config.split_k > 1:
        partials = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device, grid[0])
    launch(_gemm_kernel, grid,
        x, w.data, out, partials, counters, m, n, k, w.data.shape[1],
        FMT=layout.ggml_type, TYPE_SIZE=layout.type_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_U=block_u, GROUP_M=config.group_m, DOT_PRECISION=dot_precision(x.dtype), SPLIT_K=config.split_k,
        CHUNKS=chunks, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


_SPLIT_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _split_counters(device: torch.device, programs: int) -> torch.Tensor:
    """The split GEMM's arrival counters (``_store_tile``): int32 zeros, at least one per program along the grid's first
    axis. The kernels leave them zeroed, so they are kept, one set per device and stream: GEMMs that run at the
    same time must not share them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    counters = _SPLIT_COUNTERS.get((device, stream))
    if counters is None or counters.numel() < programs:
        counters = _SPLIT_COUNTERS[(device, stream)] = torch.zeros(max(programs, 4096), dtype=torch.int32, device=device)
    return counters
