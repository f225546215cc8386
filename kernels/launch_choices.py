"""Launch choices of the quantized matmuls: which kernel serves how many rows, and their tiles."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

# The formats the GEMV and the GEMM read in whole 64-value chunks (``k_chunk_load``) instead of 32-value units.
CHUNK_FORMATS = ("Q4_K", "Q5_K")
SMALL_K_FORMATS = ("Q2_K", "Q3_K")  # chunks too in the exact GEMV and the GEMM's narrower tiles (``small_k_chunk_*``)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    return 128 if fmt != "Q6_K" and 4 * cdiv(n, 64) >= sm_count(device) else 64


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


MMA_MAX_ROWS = 16


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
    programs, sms = cdiv(n, 16), sm_count(device)
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
    while config.block_n > 16 and cdiv(m, config.block_m) * cdiv(n, config.block_n) < sm_count(device):
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
    while m <= 128 and 2 * tiles * split_k < programs_per_sm * sm_count(device) and 2 * split_k <= min(16, steps):
        split_k *= 2
    return dataclasses.replace(config, split_k=split_k)


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
