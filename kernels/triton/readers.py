"""Which reader serves each format, for the kernels that take any format (``FMT``, a GGML type number).

Each format family's module holds all of its readers: ``legacy`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), ``k_small`` (Q2_K,
Q3_K), ``k_affine`` (Q4_K, Q5_K), ``q6_k`` and ``mxfp4`` (its units only), each with the pieces of 32-value units,
64-value chunks where the format has them, integer dots and int8 tiles for llama.cpp numerics, and tensor-core fragments
where the fragment kernel reads the format. This module picks among them by ``FMT``: ``unit_pieces`` and ``weight_tile``
for units, ``chunk_load``, ``chunk_tile`` and ``chunk_columns`` for chunks. Which kernel walks chunks is a launch choice
(``workbench.kernels.launch_choices``).

Layout of the work. A kernel handles ``BLOCK_N * BLOCK_U`` *units* (32 values of one weight row: a GGUF
block or a part of a super-block), held as 1-D tensors of (row, unit) pairs so the compiler's layout
choice is the same in every Triton version, and every unit is owned by one thread: its bytes are read
with separate narrow loads (blocks are often only 2-byte aligned) and ``tl.join``-ed into registers,
so all per-block work (scales, mins, sums) happens once per unit and no value crosses threads.

A unit's values come out as four *pieces* of 8 consecutive values, ``[units, 8]``, each a
``1 + q / 2**bits`` float made by moving the quant's bits under the exponent of 1.0 (exact, and a few
integer logic ops, where an int->float conversion runs at a fraction of the ALU rate). A weight is then
``a * f + b`` for per-unit (or per-sub-block) ``a`` and ``b``, which lets the GEMV sum ``f * x`` and
``x`` over a piece and apply ``a`` and ``b`` once per piece instead of once per value.

A chunk is 64 values read with wider loads: for Q4_K and Q5_K a 32-byte chunk of nibbles in 16-byte loads, one byte
permute per value; for Q2_K and Q3_K 16 code bytes holding four pieces of 16 values, so that each byte is loaded once,
not once per piece.

``tl.join(a, b)`` appends a new innermost axis, so in a nest of joins the outermost join picks the
fastest-varying index of the flattened result.
"""
import triton
import triton.language as tl

from .formats import MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .k_affine import k_affine_pieces, k_chunk_load, k_chunk_tile
from .k_small import small_k_chunk_columns, small_k_chunk_load, small_k_chunk_tile, small_k_pieces
from .legacy import q4_0_pieces, q4_1_pieces, q5_0_pieces, q5_1_pieces, q8_0_pieces
from .mxfp4 import mxfp4_pieces
from .q6_k import q6_k_pieces

# ---------------------------------------------------------------------------------------------
# Units: 32 values of one row, owned by one thread: a block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4), a sub-block of 32
# (Q2_K, Q3_K, Q4_K, Q5_K), or for Q6_K the k = 0..3 pieces of one group. ``unit`` counts units along the row,
# ``n_units = K // 32``.


@triton.jit
def unit_pieces(FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, unit, n_units):
    """The unit's four pieces and their affine maps: ``(f0, f1, f2, f3, a0, b0, a1, b1, a2, b2, a3, b3)``."""
    if FMT == Q4_K or FMT == Q5_K:
        blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
        f0, f1, f2, f3, a, b = k_affine_pieces(FMT, blockp, unit % 8)
        pieces = f0, f1, f2, f3, a, b, a, b, a, b, a, b
    elif FMT == Q6_K:
        blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
        pieces = q6_k_pieces(blockp, (unit // 4) % 2, unit % 4)
    elif FMT == Q2_K or FMT == Q3_K:
        blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
        pieces = small_k_pieces(FMT, blockp, unit % 8)
    else:
        blockp = rowp + tl.minimum(unit, n_units - 1) * TYPE_SIZE
        if FMT == Q4_0:
            f0, f1, f2, f3, a, b = q4_0_pieces(blockp)
        elif FMT == Q4_1:
            f0, f1, f2, f3, a, b = q4_1_pieces(blockp)
        elif FMT == Q5_0:
            f0, f1, f2, f3, a, b = q5_0_pieces(blockp)
        elif FMT == Q5_1:
            f0, f1, f2, f3, a, b = q5_1_pieces(blockp)
        elif FMT == MXFP4:
            f0, f1, f2, f3, a, b = mxfp4_pieces(blockp)
        else:
            tl.static_assert(FMT == Q8_0, "unsupported format")
            f0, f1, f2, f3, a, b = q8_0_pieces(blockp)
        pieces = f0, f1, f2, f3, a, b, a, b, a, b, a, b
    return pieces


@triton.jit
def piece_start(FMT: tl.constexpr, unit, piece):
    """Index within the row of the first value of piece ``piece`` of ``unit``."""
    if FMT == Q6_K:
        # unit = 8 * super-block + 4 * half + group, piece = k: value 128 * half + 32 * k + 8 * group + i
        start = 256 * (unit // 8) + 128 * ((unit // 4) % 2) + 32 * piece + 8 * (unit % 4)
    else:
        start = 32 * unit + 8 * piece
    return start


@triton.jit
def weight_tile(
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, unit, n_units, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr
):
    """Float32 weights ``[BLOCK_N, 32 * BLOCK_U]`` in row order, of (row, unit) pairs enumerated rows slowest
    (for Q6_K, ``BLOCK_U`` must cover whole super-blocks)."""
    f0, f1, f2, f3, a0, b0, a1, b1, a2, b2, a3, b3 = unit_pieces(FMT, TYPE_SIZE, rowp, unit, n_units)
    w0 = f0 * a0[:, None] + b0[:, None]
    w1 = f1 * a1[:, None] + b1[:, None]
    w2 = f2 * a2[:, None] + b2[:, None]
    w3 = f3 * a3[:, None] + b3[:, None]
    tile = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [units, 8 (i), 2, 2 (p)]
    tile = tl.permute(tile, (0, 2, 3, 1))  # [units, p, i]: value piece_start(unit, p) + i
    if FMT == Q6_K:
        # Units (half, group) hold pieces k; row order is (half, k, group, i) within a super-block.
        tile = tl.reshape(tile, (BLOCK_N, BLOCK_U // 8, 2, 4, 4, 8))
        tile = tl.permute(tile, (0, 1, 2, 4, 3, 5))
    return tl.reshape(tile, (BLOCK_N, 32 * BLOCK_U))

# ---------------------------------------------------------------------------------------------
# 64-value chunks (Q2_K, Q3_K, Q4_K, Q5_K)


@triton.jit
def chunk_load(rowp, first, n_chunks, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``k_chunk_load`` (Q4_K, Q5_K) or ``small_k_chunk_load`` (Q2_K, Q3_K)."""
    if FMT == Q4_K or FMT == Q5_K:
        raw = k_chunk_load(rowp, first, n_chunks, FMT, BLOCK_N, BLOCK_U)
    else:
        raw = small_k_chunk_load(rowp, first, n_chunks, FMT, BLOCK_N, BLOCK_U)
    return raw


@triton.jit
def chunk_tile(raw, first, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``k_chunk_tile`` or ``small_k_chunk_tile`` of the chunks ``chunk_load`` read."""
    if FMT == Q4_K or FMT == Q5_K:
        tile = k_chunk_tile(raw, first, FMT, BLOCK_N, BLOCK_U)
    else:
        tile = small_k_chunk_tile(raw, first, FMT, BLOCK_N, BLOCK_U)
    return tile


@triton.jit
def chunk_columns(first, FMT: tl.constexpr, BLOCK_U: tl.constexpr):
    """Row index of each of ``chunk_tile``'s ``64 * BLOCK_U`` columns: in order for Q4_K and Q5_K, whose chunks are 64
    consecutive values, else ``small_k_chunk_columns``."""
    if FMT == Q4_K or FMT == Q5_K:
        columns = 64 * first + tl.arange(0, 64 * BLOCK_U)
    else:
        columns = small_k_chunk_columns(first, BLOCK_U)
    return columns
