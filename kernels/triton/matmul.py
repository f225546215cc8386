"""Matmuls on packed GGUF blocks: a fused GEMV for decode, a fused GEMM, and dequantize + cuBLAS.

All compute ``out = x @ w.T`` for ``x`` ``[M, K]`` (float16, bfloat16 or float32) and a ``QuantTensor``
``w`` ``[N, K]``, reading ``w.data`` (the GGUF bytes, never a repacked copy) directly, accumulating in
float32 and returning ``x.dtype``. ``gemv`` (decode, up to ``GEMV_MAX_ROWS`` rows) multiplies on the CUDA cores,
unpacking each weight once for a block of rows; ``mma_gemm`` (batched decode, up to ``MMA_MAX_ROWS`` rows) runs
``mma.sync`` on weights each lane unpacks into its own tensor-core fragment (``fragments``); ``gemm`` (batched decode
and prefill) dequantizes weight tiles into registers and feeds them to ``tl.dot`` (tensor cores) as its first operand,
with K split over several programs when there are few rows; ``dequant_matmul`` writes the whole weight
out once in ``x.dtype`` (``dequantize``) and hands it to cuBLAS, which wins once there are enough rows to amortize
that.
``gemv_llamacpp`` computes llama.cpp's numerics instead: the activations quantized as ggml-cpu quantizes them
(``quantize_activations``), integer dot products per block, the GEMV's loop run once per row; ``gemm_llamacpp``
computes the same for many rows with the integer dot products on the tensor cores (int8 ``tl.dot``).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..quant_tensor import QuantTensor
from .fragments import legacy_pair_dots, q4_k_fragment_dots, q6_k_fragment_dots
from .dequant import (
    Q2_K, Q3_K, Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, chunk_columns, chunk_load, chunk_tile, dot_units, k_chunk_dots,
    k_chunk_dots_q8k, k_chunk_tile_dots_q8k, legacy_dots_q8, legacy_tile_dots_q8, load_f16, q6_k_dots_q8k,
    q6_k_tile_dots_q8k, small_k_chunk_dots, small_k_dots_q8k, small_k_tile_dots_q8k, weight_tile,
)
from .launch import INTERPRETING, cdiv, launch


@dataclass(frozen=True)
class Layout:
    """What the kernels hard-code about a GGUF format, checked against the ``QuantFormat`` at launch."""

    ggml_type: int
    block_size: int
    type_size: int
    word_bytes: int  # width of the kernel's loads; every block starts at a multiple of it


LAYOUTS: dict[str, Layout] = {
    "Q4_0": Layout(2, 32, 18, 2),
    "Q4_1": Layout(3, 32, 20, 4),
    "Q5_0": Layout(6, 32, 22, 2),
    "Q5_1": Layout(7, 32, 24, 4),
    "Q8_0": Layout(8, 32, 34, 2),
    "Q2_K": Layout(10, 256, 84, 2),
    "Q3_K": Layout(11, 256, 110, 2),
    "Q4_K": Layout(12, 256, 144, 4),
    "Q5_K": Layout(13, 256, 176, 4),
    "Q6_K": Layout(14, 256, 210, 2),
}
SUPPORTED_FORMATS = tuple(LAYOUTS)  # the GEMV, the GEMM, the dequantizer and the llama.cpp-numerics kernels read them all
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # llama.cpp quantizes their activations to Q8_K, the others' to Q8_0/1
# The formats with tensor-core fragment kernels (``mma_gemm``); the others (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K) hand batched
# decode to the GEMM.
MMA_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
LLAMACPP_FORMATS = SUPPORTED_FORMATS
# The formats the GEMV and the GEMM read in whole 64-value chunks (``k_chunk_load``) instead of 32-value units.
CHUNK_FORMATS = ("Q4_K", "Q5_K")
SMALL_K_FORMATS = ("Q2_K", "Q3_K")  # chunks too in the exact GEMV and the GEMM's narrower tiles (``small_k_chunk_*``)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 4  # weight rows per program; each thread holds all of them and shares its activations
    num_warps: int = 4
    block_u: int = 128  # units of each row one loop step covers; per thread, block_n * block_u / (32 * num_warps)
    block_m: int = 1  # rows of activations per program (a power of two); each thread unpacks its weights once for all


# The most rows of activations the GEMV takes (``gemv_rows`` says up to how many it is the faster kernel).
GEMV_MAX_ROWS = 4


def gemv_rows(fmt: str) -> int:
    """Rows of activations up to which the GEMV outruns the other kernels on all three Llama-3-8B shapes on an H100
    (bench/RESULTS.md, thirteenth and fourteenth sessions): one for Q4_K and Q6_K, whose ``mma_gemm`` is 1.3-1.5x
    faster than the GEMV at two rows, else two (at two rows the fragment kernels of Q4_0, Q4_1 and Q8_0 tie with the
    GEMV, from three rows on they are 1.3-1.9x faster). The formats without a fragment kernel hand three rows on to the
    GEMM, which ran 1.07-1.33x faster than the GEMV there in Q5_0, Q5_1 and Q5_K (twenty-first session); in Q2_K and
    Q3_K, with both kernels on 64-value chunks, it tied on 4096x4096 and ran up to 1.27x faster on the larger 8B
    matrices at three and four rows (twenty-third session)."""
    return 1 if fmt in ("Q4_K", "Q6_K") else 2


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 64
    block_u: int = 4  # 32-value units per K step
    num_warps: int = 8
    num_stages: int = 2
    group_m: int = 8  # programs that share weight columns run together, so their tiles are reused from L2
    split_k: int = 1  # programs over parts of K per output tile; the last to finish adds up their partial sums


def gemm_rows(fmt: str, n: int, device: torch.device) -> int:
    """Rows of activations up to which the fused GEMM outruns dequantize + cuBLAS on an H100 (bench/RESULTS.md,
    eighteenth and nineteenth sessions): 64; or one tile of 128 in every format but Q6_K for weights of at least one
    64-row tile per four multiprocessors, where ``gemm_config`` splits K at most four ways. At 65-128 rows such weights
    (4096 to 28672 rows of 4096 or 14336 values) ran 1.26-2.09x faster in the GEMM in Q4_K, 1.02-1.66x in Q4_0 and Q4_1,
    0.93-1.39x in Q8_0 (whose one loss is 6144x4096); narrower weights, split eight ways or more, and Q6_K mostly lost.
    From 256 rows the GEMM re-unpacks the weights per tile and tied or lost on all but one shape.
    Q5_0, Q5_1, Q2_K, Q3_K and Q5_K follow the rule: at 64-128 rows their GEMM ran 1.15-1.9x faster on the two larger
    8B matrices and 0.85-1.35x on 4096x4096 (twenty-first session)."""
    return 128 if fmt != "Q6_K" and 4 * cdiv(n, 64) >= _sm_count(device) else 64


@dataclass(frozen=True)
class MmaConfig:
    """The fragment kernel's programs: 16 weight rows each, K dealt out over ``num_warps`` warps a step at a time
    (their sums added at the end): one super-block for Q4_K and Q6_K, ``step_pairs`` pairs of 32-value blocks for the
    others."""

    num_warps: int = 4
    step_pairs: int = 1

    def step_values(self, fmt: str) -> int:
        """Values of a row one warp takes per step."""
        return 256 if fmt in ("Q4_K", "Q6_K") else 64 * self.step_pairs


# Rows of activations ``mma_gemm`` takes: one or two tiles of 8 (the m16n8k16 instruction's columns), each tile an
# instruction on the same unpacked weights. Four tiles (17-32 rows) ran at 0.66-1.01x the GEMM's speed on the
# Llama-3-8B shapes in every format on an H100 (bench/RESULTS.md, fifteenth session); programs over further 8-row tiles
# that re-read the weights from L2 had tied with it at 12-16 rows (thirteenth session).
MMA_MAX_ROWS = 16
MMA_K_MULTIPLE = 64  # pairs of 32-value blocks, so that each pair starts at a multiple of 4 bytes
MMA_DTYPES = (torch.float16, torch.bfloat16)


def mma_rows(fmt: str) -> int:
    """Rows of activations up to which ``mma_gemm`` outruns the GEMM on the Llama-3-8B shapes on an H100
    (bench/RESULTS.md, fifteenth session): at 9-16 rows, two tiles of 8, it is 1.02-1.54x faster in every format but
    Q4_1, whose GEMM is the faster on two of the three shapes (0.84-0.91x); for Q4_1 the one-tile kernel, up to 8
    rows."""
    return 8 if fmt == "Q4_1" else MMA_MAX_ROWS


@dataclass(frozen=True)
class Int8GemmConfig:
    """Tiles of the llama.cpp-numerics GEMM, which steps over K one block (Q4_0, Q4_1, Q8_0) or super-block at a time."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    group_m: int = 8


def walks_chunks(fmt: str, llamacpp: bool = False) -> bool:
    """Whether the GEMV walks 64-value chunks of ``fmt`` (``k_chunk_dots``, ``small_k_chunk_dots``), not 32 values."""
    return fmt in CHUNK_FORMATS or (fmt in SMALL_K_FORMATS and not llamacpp)


def gemm_walks_chunks(fmt: str, block_m: int) -> bool:
    """Whether the fused GEMM reads ``fmt`` in 64-value chunks: Q4_K and Q5_K always; Q2_K and Q3_K in tiles of up to
    64 rows of activations, where chunks ran 1.06-1.63x faster than 32-value units on an H100, and not in 128-row tiles,
    where they ran 0.82-0.93x (bench/RESULTS.md, twenty-third session)."""
    return fmt in CHUNK_FORMATS or (fmt in SMALL_K_FORMATS and block_m <= 64)


def gemv_units(k: int, fmt: str, llamacpp: bool = False) -> int:
    """Units of one row the GEMV walks (``walks_chunks``)."""
    return k // (64 if walks_chunks(fmt, llamacpp) else 32)


@functools.cache  # a pure function of its arguments, asked on every matmul
def gemv_config(k: int, fmt: str, m: int = 1, llamacpp: bool = False) -> GemvConfig:
    """Enough warps to cover a row in few steps without leaving many threads idle on the last one; for several rows of
    activations, the tilings that ran best on an H100 (bench/RESULTS.md, eleventh session).

    ``bench/kernels.py --sweep`` on an H100 (Llama-3-8B shapes): where that is 4 warps (K = 4096), Q4_0 and
    Q4_1 run 5-10 % faster on half the warps with two units per thread; Q6_K, whose units need more
    registers, does not. Q4_K's 64-value chunks run best one warp per four rows on all three shapes, and so do two
    rows of activations, as two programs side by side that share the weights through L2. Q5_K's chunks take that
    tiling unswept; Q2_K's and Q3_K's ran best on it, or within 0.5 us of the best (twenty-third session). From three
    rows on, every format runs best with two rows of activations per program and eight weight rows per warp, sixteen
    units a step.
    """
    if m >= 3:
        return GemvConfig(block_n=8, num_warps=1, block_u=16, block_m=2)
    chunks = walks_chunks(fmt, llamacpp)
    if m == 2 and not chunks:
        return GemvConfig(block_n=8, num_warps=2, block_u=32, block_m=2) if fmt in ("Q4_0", "Q4_1") else \
            GemvConfig(block_n=4, num_warps=1, block_u=32, block_m=2)
    if chunks:
        return GemvConfig(block_n=4, num_warps=1, block_u=32)
    units = gemv_units(k, fmt, llamacpp)
    warps = min((4, 2, 1), key=lambda warps: (-(-units // (32 * warps)) * 32 * warps, -warps))
    if warps == 4 and fmt in ("Q4_0", "Q4_1"):
        return GemvConfig(num_warps=2, block_u=128)
    return GemvConfig(num_warps=warps, block_u=32 * warps)


@functools.cache  # a pure function of its arguments, asked on every matmul
def gemv_llamacpp_config(k: int, m: int) -> GemvConfig:
    """The Q8_K-activation Q4_K GEMV's tiling: on an H100 (bench/RESULTS.md, ninth and tenth sessions) 16 chunks per
    step ran best on rows of 4096 values and 32 on rows of 14336 for one row of activations; for several rows (2 and 4
    measured), sixteen weight rows per program in steps of 16 chunks. Q5_K's chunks take the same tiling, unswept."""
    if m > 1:
        return GemvConfig(block_n=16, num_warps=1, block_u=16)
    return GemvConfig(block_n=4, num_warps=1, block_u=16 if k <= 4096 else 32)


@functools.cache  # a pure function of its arguments, asked on every matmul
def mma_config(n: int, k: int, device: torch.device, fmt: str, m: int) -> MmaConfig:
    """8 warps per 16 weight rows while there are at most two such tiles per multiprocessor, 4 up to sixteen, else 2,
    and no more warps than steps in a row: the best, or within 3 % of the best, of 1-16 warps on an H100 for Q4_K
    on the Llama-3-8B shapes from 4096x4096 to 128256x4096 (bench/RESULTS.md, thirteenth session). Q6_K ran best on
    8 warps on all of them up to 8 rows, or within 1 % (fourteenth session); at 16 rows it takes Q4_K's rule
    (14336x4096: 45.8 us on 4 warps against 52.8 on 8, fifteenth session)."""
    # The 32-value formats, measured on the same shapes at 8 rows (fourteenth session), ran best with Q4_K's warps and
    # one pair of blocks per step, or within 3 % of the best.
    programs, sms = cdiv(n, 16), _sm_count(device)
    warps = 8 if programs <= 2 * sms or (fmt == "Q6_K" and m <= 8) else 4 if programs <= 16 * sms else 2
    config = MmaConfig(num_warps=warps)
    while config.num_warps > 1 and config.num_warps > k // config.step_values(fmt):
        config = dataclasses.replace(config, num_warps=config.num_warps // 2)
    return config


@functools.cache  # a pure function of its arguments, asked on every matmul
def int8_gemm_config(m: int, n: int, device: torch.device) -> Int8GemmConfig:
    """The llama.cpp-numerics GEMM's tiles, picked by ``bench/kernels.py --numerics llamacpp --sweep`` on an H100, with
    weight tiles narrowed as in ``gemm_config`` while there are fewer programs than multiprocessors."""
    config = Int8GemmConfig(block_m=16 if m <= 16 else 64, block_n=64)
    while config.block_n > 16 and cdiv(m, config.block_m) * cdiv(n, config.block_n) < _sm_count(device):
        config = dataclasses.replace(config, block_n=config.block_n // 2)
    return config


@functools.cache  # a pure function of its arguments, asked on every matmul
def gemm_config(m: int, n: int, k: int, device: torch.device, fmt: str) -> GemmConfig:
    """Tiles that ran best on an H100 (bench/RESULTS.md, twelfth session; ``bench/kernels.py --sweep`` times others).
    Up to 16 rows (batched decode): 64 weight rows by 8 or 16 activation rows per program, the loop not
    pipelined (staging the many narrow weight loads through shared memory cost more than it hid). Up to 128 rows K is
    split in two while that leaves fewer than 7 programs per multiprocessor (up to 16 rows), or 2 (17-128 rows): for a
    few rows that ran 1.3-1.5x faster than fewer, longer programs; from 17 rows on the fewer programs ran 1.12x faster
    than splits to 7 per multiprocessor (geometric mean over every format and Llama-3-8B shape at 17-64 rows, at most
    1.14x from the best split; fifteenth session). At 65-128 rows this split was the best of itself, half and double
    on every weight ``gemm_rows`` gives the GEMM there (4096-8192 rows of 4096 or 14336 values measured in Q4_0, Q4_1,
    Q4_K and Q8_0), or within 3 % (nineteenth session); from 256 rows splitting lost as often as it won."""
    if m <= 16:
        config = GemmConfig(block_m=8 if m <= 8 else 16, block_n=64, block_u=8 if fmt == "Q8_0" else 4, num_warps=4,
                            num_stages=1)
    # More rows (prefill; linear hands more than ``gemm_rows`` to dequantize + cuBLAS): 64 weight rows a tile, so that
    # the weight-first dot stays on Hopper's warpgroup instructions, and the loop pipelined.
    elif m <= 32:
        config = GemmConfig(block_m=32, block_n=64, block_u=8, num_warps=4, num_stages=3)
    else:
        config = GemmConfig(block_m=64 if m <= 64 else 128, block_n=64, block_u=4, num_warps=4, num_stages=3)
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    steps = cdiv(k // 32, config.block_u)
    split_k, programs_per_sm = 1, 7 if m <= 16 else 2
    while m <= 128 and 2 * tiles * split_k < programs_per_sm * _sm_count(device) and 2 * split_k <= min(16, steps):
        split_k *= 2
    return dataclasses.replace(config, split_k=split_k)


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, x_scales_ptr, x_sums_ptr,
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
    USE_ASM: tl.constexpr, EVEN: tl.constexpr, LLAMACPP: tl.constexpr, CHUNKS: tl.constexpr,
):
    # Each program takes BLOCK_N weight rows and BLOCK_M rows of activations, unpacking each weight once for all of
    # them; the programs over one weight block run next to each other, so all but the first read it from L2.
    # With LLAMACPP (BLOCK_M = 1) the activations are quantized as ggml-cpu quantizes them for the weight
    # (``quantize_activations``): int8 values as int32 words at x_ptr, their scales and sums.
    m_blocks = tl.cdiv(M, BLOCK_M)
    m_block, n_block = tl.program_id(0) % m_blocks, tl.program_id(0) // m_blocks
    m_rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows of activations past M and weight rows past N re-read rows from the first (never stored).
    x_rows = x_ptr + (m_rows % M).to(tl.int64) * K
    if LLAMACPP:
        tl.static_assert(BLOCK_M == 1, "the llama.cpp-numerics GEMV takes one row of activations per program")
        m = m_block
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
    # One partial sum per (activation row, weight row, unit), reduced across threads once at the end.
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_U), dtype=tl.float32)
    if CHUNKS:  # ``walks_chunks``
        n_chunks = K // 64
        # Each step's weights are loaded one step ahead (the last step's look-ahead re-reads the row's last
        # chunk, which is cached): an 8B decode step's GEMVs took 4.5 % less time on an H100 (bench/RESULTS.md).
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
    out_ptrs = out_ptr + m_rows.to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out_ptrs, tl.sum(acc, axis=2).to(out_ptr.dtype.element_ty), mask=(m_rows[:, None] < M) & (rows[None, :] < N))


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


@triton.jit
def _mma_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, FMT: tl.constexpr, TYPE_SIZE: tl.constexpr,
                STEP_PAIRS: tl.constexpr, WARPS: tl.constexpr, TILES: tl.constexpr, USE_ASM: tl.constexpr):
    # One program per 16 weight rows; its warps take every WARPS-th step of K: a super-block (Q4_K, Q6_K) or STEP_PAIRS
    # pairs of blocks. Each weight tensor holds one value per lane (``fragments``): lane 4 g + t has weight rows g and
    # g + 8. The activations come in TILES tiles of 8 rows, one instruction each on the same unpacked weights: the
    # activation tensors are [TILES, lanes], lane 4 g + t holding row 8 i + g of tile i (re-reading rows from the first
    # past M, and weight rows past N, as ``_gemm_kernel`` does; never stored).
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
                    acc0, acc1, acc2, acc3, w_ptr + top + block * 144, w_ptr + bottom + block * 144,
                    x_row + (block * 512 + 16 * t)[None, :], valid, BF16, USE_ASM)
            else:
                acc0, acc1, acc2, acc3 = q6_k_fragment_dots(
                    acc0, acc1, acc2, acc3, w_ptr, top + block * 210, bottom + block * 210,
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


@triton.jit
def _tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
    first_m, first_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows_m, rows_n = first_m + tl.arange(0, BLOCK_M), first_n + tl.arange(0, BLOCK_N)
    n_units = K // 32
    split_units = tl.cdiv(tl.cdiv(n_units, BLOCK_U), SPLIT_K) * BLOCK_U
    unit_start = tl.program_id(1) * split_units
    unit_end = tl.minimum(unit_start + split_units, n_units)
    # Rows past M (and weight rows past N) re-read rows from the first instead of masking loads; they are never stored.
    # Not all the last row: a tile's loads of one address from every row past M ran up to 2.4x slower (bench/RESULTS.md,
    # eighteenth session).
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


@triton.jit
def _gemm_llamacpp_kernel(
    xq_ptr, x_scales_ptr, x_sums_ptr, w_ptr, out_ptr, M, N, K, row_bytes,
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    # xq, x_scales, x_sums: ``quantize_activations``' int8 values, scales and sums. Per block the integer dots are
    # scaled as ggml-cpu's vec_dot does: (d_x d_w) * dot, plus Q4_1's and Q5_1's m_w s_x, or per super-block
    # (d_x d) * sum_j scale_j dot_j - (d_x dmin) * sum_j min_j xsum_j over its sub-blocks or 16-value groups j (the
    # K-quants; Q3_K and Q6_K have no mins).
    first_m, first_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows_m, rows_n = first_m + tl.arange(0, BLOCK_M), first_n + tl.arange(0, BLOCK_N)
    # Rows past M and N re-read rows from the first instead of masking loads (as in ``_gemm_kernel``); never stored.
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


def layout_of(w: QuantTensor) -> Layout:
    """The kernel layout for ``w``'s format; raises ``ValueError`` for a format these kernels don't read."""
    layout = LAYOUTS.get(w.fmt.name)
    if layout is None:
        raise ValueError(f"triton kernels read {', '.join(SUPPORTED_FORMATS)}; got {w.fmt.name}")
    if (layout.block_size, layout.type_size) != (w.fmt.block_size, w.fmt.type_size):
        raise ValueError(
            f"{w.fmt.name}: format registry says blocks of {w.fmt.block_size} values in {w.fmt.type_size} bytes, "
            f"the triton kernels expect {layout.block_size} in {layout.type_size}"
        )
    return layout


def check_inputs(x: torch.Tensor, w: QuantTensor, max_rows: int | None = None,
                 dtypes: tuple[torch.dtype, ...] = ACTIVATION_DTYPES, alignment: int = 1,
                 k_multiple: int = 1, formats: tuple[str, ...] = SUPPORTED_FORMATS) -> Layout:
    """Raise a clear error for anything the kernels would otherwise compute wrongly or crash on. A kernel that reads
    fewer formats or takes fewer activation dtypes than the others, needs its data at multiples of ``alignment`` bytes
    or rows of a multiple of ``k_multiple`` values, says so."""
    if not isinstance(w, QuantTensor):
        raise TypeError(f"expected a QuantTensor weight, got {type(w).__name__}")
    layout = layout_of(w)
    if w.fmt.name not in formats:
        raise ValueError(f"this kernel reads {', '.join(formats)}; got {w.fmt.name}")
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D input [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"input has {x.shape[1]} features, weight {w.fmt.name} {w.shape} expects {w.shape[1]}")
    if x.dtype not in dtypes:
        names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
        raise ValueError(f"activations must be {', '.join(names[:-1])} or {names[-1]}, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("input must be contiguous (the kernels index rows with stride K)")
    if not w.data.is_contiguous():
        raise ValueError("packed weight data must be contiguous")
    if x.device != w.device:
        raise ValueError(f"input on {x.device}, weight on {w.device}")
    if max_rows is not None and x.shape[0] > max_rows:
        raise ValueError(f"this kernel takes at most {max_rows} row(s) of activations, got {x.shape[0]}")
    if w.data.data_ptr() % layout.word_bytes:
        raise ValueError(f"{w.fmt.name} packed data must start at a multiple of {layout.word_bytes} bytes")
    if x.shape[1] % k_multiple:
        raise ValueError(f"this kernel needs rows of a multiple of {k_multiple} values, got {x.shape[1]}")
    if x.data_ptr() % alignment or w.data.data_ptr() % alignment:
        raise ValueError(f"this kernel needs activations and packed data that start at multiples of {alignment} bytes")
    if x.device.type != "cuda" and not INTERPRETING:
        raise ValueError(f"triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    return layout


def _checked_output(x: torch.Tensor, w: QuantTensor, max_rows: int | None = None,
                    **limits) -> tuple[Layout, torch.Tensor]:
    """``check_inputs``, and the uninitialized ``[M, N]`` output of ``x @ w.T`` in ``x.dtype``."""
    layout = check_inputs(x, w, max_rows, **limits)
    return layout, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)


def _tile_grid(m: int, n: int, config: GemmConfig | Int8GemmConfig) -> tuple[int]:
    """One program per ``block_m x block_n`` tile of the output (``_tile_origin`` orders them)."""
    return (cdiv(m, config.block_m) * cdiv(n, config.block_n),)


def dequantize(w: QuantTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """All of ``w`` as a dense ``[N, K]`` tensor of ``dtype`` (float16, bfloat16 or float32), in one pass."""
    layout = check_inputs(torch.empty(0, w.shape[1], dtype=dtype, device=w.device), w)  # checks w and dtype
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    block_n, block_u = 16, 8  # Q6_K's reorder needs whole super-blocks of 8 units
    launch(_dequantize_kernel, (cdiv(n, block_n), cdiv(k // 32, block_u)),
        w.data, out, n, k, w.data.shape[1],
        FMT=layout.ggml_type, TYPE_SIZE=layout.type_size, BLOCK_N=block_n, BLOCK_U=block_u, num_warps=4,
    )
    return out


def dequant_matmul(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """``x @ w.T`` as one dequantizing pass to ``x.dtype`` and a dense (cuBLAS) matmul: for many rows the
    dense product outruns re-dequantizing weight tiles in every row block of the fused GEMM."""
    check_inputs(x, w)
    return F.linear(x, dequantize(w, x.dtype))


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs are for tests: keep them exact rather than rounding to tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def gemv(x: torch.Tensor, w: QuantTensor, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` for up to ``GEMV_MAX_ROWS`` rows of ``x`` (decode, batched decode), on the CUDA cores: one
    pass over the weight per ``config.block_m`` rows, its programs side by side so that the others read it from L2."""
    layout, out = _checked_output(x, w, max_rows=GEMV_MAX_ROWS)
    m, k = x.shape
    if m == 0:
        return out
    _launch_gemv(w, out, layout, config or gemv_config(k, w.fmt.name, m), x, x, x, llamacpp=False)
    return out


def mma_gemm(x: torch.Tensor, w: QuantTensor, config: MmaConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` for up to ``MMA_MAX_ROWS`` rows of float16 or bfloat16 ``x`` (K a multiple of ``MMA_K_MULTIPLE``), on the
    tensor cores, each lane unpacking the weights of its own fragment (``fragments``) once for every 8 rows of ``x``:
    batched decode."""
    if config is not None and config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {config.num_warps}")
    if config is not None and config.step_pairs < 1:
        raise ValueError(f"step_pairs must be at least 1, got {config.step_pairs}")
    # 16-byte loads of the activations and of each super-block's header
    layout, out = _checked_output(x, w, MMA_MAX_ROWS, dtypes=MMA_DTYPES, alignment=16, k_multiple=MMA_K_MULTIPLE,
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


def _launch_gemv(w: QuantTensor, out: torch.Tensor, layout: Layout, config: GemvConfig, activations: torch.Tensor,
                 x_scales: torch.Tensor, x_sums: torch.Tensor, llamacpp: bool) -> None:
    """``_gemv_kernel`` over ``out``'s rows of activations: floats, or (``llamacpp``) ``quantize_activations``'
    values, scales and sums (the exact GEMV passes its activations for the two unused pointers)."""
    (m, n), k = out.shape, w.shape[1]
    launch(_gemv_kernel, (cdiv(n, config.block_n) * cdiv(m, config.block_m),),
        activations, w.data, out, m, n, k, w.data.shape[1], x_scales, x_sums,
        FMT=layout.ggml_type, TYPE_SIZE=layout.type_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_U=config.block_u, USE_ASM=not INTERPRETING,
        EVEN=gemv_units(k, w.fmt.name, llamacpp) % config.block_u == 0, LLAMACPP=llamacpp,
        CHUNKS=walks_chunks(w.fmt.name, llamacpp), num_warps=config.num_warps,
    )


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


def gemv_llamacpp(x: torch.Tensor, w: QuantTensor, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` in llama.cpp's numerics: each row of ``x`` quantized as ggml-cpu quantizes activations for ``w``'s
    type (Q8_0 for Q4_0, Q5_0 and Q8_0, Q8_1 for Q4_1 and Q5_1, Q8_K for the K-quants), integer dot products per block
    (``dp4a``), scales applied in float32, as ggml-cpu's ``ggml_vec_dot_<type>_q8_<x>``. One pass over the weight per
    row of ``x``: made for decode."""
    layout, out = _checked_output(x, w, formats=LLAMACPP_FORMATS)
    m, k = x.shape
    if m == 0:
        return out
    config = config or (gemv_llamacpp_config(k, m) if w.fmt.name in CHUNK_FORMATS else
                        gemv_config(k, w.fmt.name, llamacpp=True))
    _launch_gemv(w, out, layout, config, *quantize_activations(x, w.fmt.name), llamacpp=True)
    return out


def gemm_llamacpp(x: torch.Tensor, w: QuantTensor, config: Int8GemmConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` in llama.cpp's numerics, as ``gemv_llamacpp`` computes them, for many rows of ``x`` (prefill): the
    integer dot products of each block on the tensor cores, one pass over the weight per tile of rows."""
    layout, out = _checked_output(x, w, formats=LLAMACPP_FORMATS)
    (m, k), n = x.shape, w.shape[0]
    if m == 0:
        return out
    config = config or int8_gemm_config(m, n, x.device)
    values, scales, sums = quantize_activations(x, w.fmt.name)
    launch(_gemm_llamacpp_kernel, _tile_grid(m, n, config),
        values, scales, sums, w.data, out, m, n, k, w.data.shape[1],
        FMT=layout.ggml_type, TYPE_SIZE=layout.type_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def gemm(x: torch.Tensor, w: QuantTensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` for any number of rows, dequantizing weight tiles into ``tl.dot``."""
    layout, out = _checked_output(x, w)
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
    grid = (*_tile_grid(m, n, config), config.split_k)
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
