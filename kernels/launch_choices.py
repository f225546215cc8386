"""The launch choices of the quantized matmuls, as one table: which kernel serves how many rows of activations, and
the tiles each kernel runs with.

Each row of ``CHOICES`` is one choice: the setting it decides, the formats it holds for, the condition on the call
under which it holds, its value, the benchmark command that measures it, and the section of docs/performance.md that
holds those measurements. A setting's rows are read in order and the first that holds decides (``choose``); every
setting ends with a row that always holds. The functions below (``gemv_rows``, ``gemm_config``, ...) ask the table,
and add only what the kernels themselves require (a kernel's warps no more than its steps along a row, Q6_K's tiles of
whole super-blocks). Nothing here imports Triton: the CPU kernels read their row too.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .formats.table import QK, QK_K

# Sections of docs/performance.md that hold the measurements behind the rows.
DOCS_CPU = 'docs/performance.md, "CPU: fused dot products or dequantized panels"'
DOCS_FEW_ROWS = 'docs/performance.md, "Few rows: the GEMV, the fragment kernel or the GEMM"'
DOCS_GEMV = 'docs/performance.md, "GEMV tiling"'
DOCS_CHUNKS = 'docs/performance.md, "64-value chunks"'
DOCS_MMA = 'docs/performance.md, "The fragment kernel"'
DOCS_GEMM = 'docs/performance.md, "Fused GEMM tiles and split-K"'
DOCS_PREFILL = 'docs/performance.md, "Prefill: the fused GEMM or dequantize + cuBLAS"'
DOCS_LLAMACPP = 'docs/performance.md, "llama.cpp numerics on CUDA"'

_CUDA = "python bench/kernels.py --device cuda"
_8B = f"{_CUDA} --shapes 8b"
_DECODE = f"{_CUDA} --shapes 8b-decode"
_LLAMACPP = f"{_CUDA} --numerics llamacpp --shapes 8b"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 4  # weight rows per program; each thread holds all of them and shares its activations
    num_warps: int = 4
    block_u: int = 128  # units of each row one loop step covers; per thread, block_n * block_u / (32 * num_warps)
    block_m: int = 1  # rows of activations per program (a power of two); each thread unpacks its weights once for all


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 64
    block_u: int = 4  # 32-value units per K step
    num_warps: int = 8
    num_stages: int = 2
    group_m: int = 8  # programs that share weight columns run together, so their tiles are reused from L2
    split_k: int = 1  # programs over parts of K per output tile; the last to finish adds up their partial sums


@dataclass(frozen=True)
class MmaConfig:
    """The fragment kernel's programs: 16 weight rows each, K dealt out over ``num_warps`` warps a step at a time
    (their sums added at the end): one super-block for Q4_K and Q6_K, ``step_pairs`` pairs of 32-value blocks for the
    others."""

    num_warps: int = 4
    step_pairs: int = 1

    def step_values(self, fmt: str) -> int:
        """Values of a row one warp takes per step."""
        return QK_K if fmt in ("Q4_K", "Q6_K") else 2 * QK * self.step_pairs


@dataclass(frozen=True)
class Int8GemmConfig:
    """Tiles of the llama.cpp-numerics GEMM, which steps over K one block (Q4_0, Q4_1, Q8_0) or super-block at a
    time."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    group_m: int = 8


@dataclass(frozen=True)
class DequantConfig:
    """Tiles of the dequantizer: ``block_n`` weight rows by ``block_u`` 32-value units per program (Q6_K's reorder needs
    whole super-blocks, a multiple of 8 units)."""

    block_n: int = 16
    block_u: int = 8
    num_warps: int = 4


@dataclass(frozen=True)
class Call:
    """What a choice may depend on: the weight's format, the rows of activations ``m``, the weight's rows ``n`` and
    row length ``k``, the device's multiprocessors, the numerics, whether the kernel walks 64-value chunks
    (``walks_chunks``) and the rows of activations of the GEMM's tile."""

    fmt: str = ""
    m: int = 1
    n: int = 0
    k: int = 0
    sms: int = 1
    llamacpp: bool = False
    chunks: bool = False
    block_m: int = 0


@dataclass(frozen=True)
class Choice:
    """One row of the table: ``value`` (or ``value(call)``) for ``setting`` where the format is one of ``formats``
    (``None``: any) and ``when(call)`` holds (``None``: always)."""

    setting: str
    value: Any
    bench: str
    docs: str
    formats: tuple[str, ...] | None = None
    when: Callable[[Call], bool] | None = None

    def holds(self, call: Call) -> bool:
        return (self.formats is None or call.fmt in self.formats) and (self.when is None or self.when(call))


def _row_warps(call: Call) -> int:
    """The most warps (4, 2 or 1) that cover a row's units in few steps without leaving many threads idle on the
    last."""
    units = gemv_units(call.k, call.fmt, call.llamacpp)
    return min((4, 2, 1), key=lambda warps: (-(-units // (32 * warps)) * 32 * warps, -warps))


CHOICES: tuple[Choice, ...] = (
    # --- CPU (C++): exact matmuls from this many rows on dequantize panels of W for the BLAS instead of fusing the
    # dequantization into the dot products (on 2 threads; at 16 rows the fused dots ran 1.30-1.43x faster in Q4_1,
    # Q8_0 and Q4_K, 0.96x in Q6_K; at 24, 0.79-1.08x; at 32 the panels won).
    Choice("cpu.panel_min_batch", 24, "python bench/cpu_builds.py --paths --formats Q4_1,Q8_0 --shape 1536x576 "
           "--batch 24 --threads 2", DOCS_CPU),

    # --- Few rows: which kernel serves them. The GEMV takes at most ``gemv.max_rows`` rows; the router gives it up to
    # ``gemv.rows``: one for Q4_K and Q6_K, whose fragment kernel is faster from two rows on; two for the rest (the
    # fragment kernels of Q4_0, Q4_1 and Q8_0 tie with it at two rows and win from three, and the formats without one
    # hand three rows on to the GEMM, which ties or wins there).
    Choice("gemv.max_rows", 4, f"{_8B} --batches 2,3,4,8 --sweep", DOCS_FEW_ROWS),
    Choice("gemv.rows", 1, f"{_8B} --formats Q4_K,Q6_K --batches 1,2 --sweep", DOCS_FEW_ROWS,
           formats=("Q4_K", "Q6_K")),
    Choice("gemv.rows", 2, f"{_8B} --batches 2,3,4 --sweep", DOCS_FEW_ROWS),
    # The fragment kernel takes one or two tiles of 8 rows (the m16n8k16 instruction's columns), each an instruction
    # on the same unpacked weights; a third and fourth tile lost to the GEMM. Q4_1's GEMM is the faster at 9-16 rows.
    Choice("mma.max_rows", 16, f"{_8B} --formats Q4_0,Q4_1,Q8_0,Q4_K,Q6_K --batches 8,16,17,32 --sweep", DOCS_MMA),
    Choice("mma.rows", 8, f"{_8B} --formats Q4_1 --batches 8,9,16 --sweep", DOCS_FEW_ROWS, formats=("Q4_1",)),
    Choice("mma.rows", lambda call: choose("mma.max_rows"),
           f"{_8B} --formats Q4_0,Q8_0,Q4_K,Q6_K --batches 9,16 --sweep", DOCS_FEW_ROWS),
    # The fused GEMM outruns dequantize + cuBLAS up to 64 rows; up to one tile of 128 for weights of at least one
    # 64-row tile per four multiprocessors (where ``gemm_config`` splits K at most four ways), but not in Q6_K.
    Choice("gemm.rows", 64, f"{_DECODE} --formats Q6_K --batches 64,65,128 --sweep", DOCS_PREFILL, formats=("Q6_K",)),
    Choice("gemm.rows", 128, f"{_DECODE} --batches 64,65,128,256 --sweep", DOCS_PREFILL,
           when=lambda call: 4 * cdiv(call.n, 64) >= call.sms),
    Choice("gemm.rows", 64, f"{_8B} --batches 64,65,128 --sweep", DOCS_PREFILL),
    # llama.cpp numerics: from this many rows on the int8 GEMM runs instead of a GEMV pass per row.
    Choice("llamacpp.gemm_min_rows", 8, f"{_LLAMACPP} --batches 4,8,16 --sweep", DOCS_LLAMACPP),

    # --- 64-value chunks instead of 32-value units (the chunk readers exist for Q2_K, Q3_K, Q4_K and Q5_K).
    Choice("gemv.chunks", True, f"{_8B} --formats Q4_K,Q5_K --batches 1", DOCS_CHUNKS, formats=("Q4_K", "Q5_K")),
    Choice("gemv.chunks", True, f"{_8B} --formats Q2_K,Q3_K --batches 1,3", DOCS_CHUNKS, formats=("Q2_K", "Q3_K"),
           when=lambda call: not call.llamacpp),
    Choice("gemv.chunks", False, f"{_8B} --batches 1", DOCS_CHUNKS),
    Choice("gemm.chunks", True, f"{_8B} --formats Q4_K,Q5_K --batches 8,64", DOCS_CHUNKS, formats=("Q4_K", "Q5_K")),
    # Q2_K's and Q3_K's chunks win in tiles of up to 64 rows of activations and lose in 128-row tiles.
    Choice("gemm.chunks", True, f"{_8B} --formats Q2_K,Q3_K --batches 8,64,128", DOCS_CHUNKS,
           formats=("Q2_K", "Q3_K"), when=lambda call: call.block_m <= 64),
    Choice("gemm.chunks", False, f"{_8B} --batches 8,64", DOCS_CHUNKS),

    # --- The GEMV's tiling. From three rows on: two rows of activations per program, eight weight rows per warp,
    # sixteen units a step. At two rows, units: Q4_0 and Q4_1 two warps per eight rows, the others one warp per four
    # rows; chunks (one or two rows, two as two programs side by side that share the weights through L2): one warp
    # per four rows. One row: enough warps to cover a row in few steps, but Q4_0 and Q4_1 half the warps with two
    # units per thread where that is 4 (K = 4096).
    Choice("gemv.config", GemvConfig(block_n=8, num_warps=1, block_u=16, block_m=2), f"{_8B} --batches 3,4 --sweep",
           DOCS_GEMV, when=lambda call: call.m >= 3),
    Choice("gemv.config", GemvConfig(block_n=8, num_warps=2, block_u=32, block_m=2),
           f"{_8B} --formats Q4_0,Q4_1 --batches 2 --sweep", DOCS_GEMV, formats=("Q4_0", "Q4_1"),
           when=lambda call: call.m == 2 and not call.chunks),
    Choice("gemv.config", GemvConfig(block_n=4, num_warps=1, block_u=32, block_m=2),
           f"{_8B} --formats Q8_0,Q6_K --batches 2 --sweep", DOCS_GEMV,
           when=lambda call: call.m == 2 and not call.chunks),
    Choice("gemv.config", GemvConfig(block_n=4, num_warps=1, block_u=32),
           f"{_8B} --formats Q4_K,Q5_K,Q2_K,Q3_K --batches 1,2 --sweep", DOCS_GEMV, when=lambda call: call.chunks),
    Choice("gemv.config", GemvConfig(num_warps=2, block_u=128), f"{_8B} --formats Q4_0,Q4_1 --batches 1 --sweep",
           DOCS_GEMV, formats=("Q4_0", "Q4_1"), when=lambda call: _row_warps(call) == 4),
    Choice("gemv.config", lambda call: GemvConfig(num_warps=_row_warps(call), block_u=32 * _row_warps(call)),
           f"{_8B} --batches 1 --sweep", DOCS_GEMV),
    # The llama.cpp-numerics GEMV on chunks (Q4_K, Q5_K): sixteen weight rows per program for several rows of
    # activations, else sixteen chunks a step on rows of up to 4096 values and 32 on longer ones. The others take the
    # exact GEMV's one-row tiling.
    Choice("gemv_llamacpp.config", GemvConfig(block_n=16, num_warps=1, block_u=16),
           f"{_LLAMACPP} --formats Q4_K,Q5_K --batches 2,4 --sweep", DOCS_LLAMACPP,
           when=lambda call: call.chunks and call.m > 1),
    Choice("gemv_llamacpp.config", GemvConfig(block_n=4, num_warps=1, block_u=16),
           f"{_LLAMACPP} --formats Q4_K,Q5_K --batches 1 --sweep", DOCS_LLAMACPP,
           when=lambda call: call.chunks and call.k <= 4096),
    Choice("gemv_llamacpp.config", GemvConfig(block_n=4, num_warps=1, block_u=32),
           f"{_LLAMACPP} --formats Q4_K,Q5_K --batches 1 --sweep", DOCS_LLAMACPP, when=lambda call: call.chunks),
    Choice("gemv_llamacpp.config", lambda call: gemv_config(call.k, call.fmt, llamacpp=True),
           f"{_LLAMACPP} --batches 1 --sweep", DOCS_LLAMACPP),

    # --- The fragment kernel's warps per 16 weight rows: 8 while there are at most two such tiles per multiprocessor
    # (and for Q6_K up to 8 rows of activations), 4 up to sixteen, else 2.
    Choice("mma.warps", 8, f"{_DECODE} --formats Q4_K --batches 2,4,8 --sweep", DOCS_MMA,
           when=lambda call: cdiv(call.n, 16) <= 2 * call.sms),
    Choice("mma.warps", 8, f"{_DECODE} --formats Q6_K --batches 8,16 --sweep", DOCS_MMA, formats=("Q6_K",),
           when=lambda call: call.m <= 8),
    Choice("mma.warps", 4, f"{_DECODE} --formats Q4_0,Q4_1,Q8_0,Q4_K --batches 8 --sweep", DOCS_MMA,
           when=lambda call: cdiv(call.n, 16) <= 16 * call.sms),
    Choice("mma.warps", 2, f"{_DECODE} --formats Q4_K --batches 8 --sweep", DOCS_MMA),

    # --- The fused GEMM's tiles. Up to 16 rows (batched decode): 64 weight rows by 8 or 16 activation rows per program,
    # the loop not pipelined. More rows: 64 weight rows a tile (the weight-first dot stays on Hopper's warpgroup
    # instructions) and the loop pipelined.
    Choice("gemm.tile", GemmConfig(block_m=8, block_n=64, block_u=8, num_warps=4, num_stages=1),
           f"{_8B} --formats Q8_0 --batches 8 --sweep", DOCS_GEMM, formats=("Q8_0",), when=lambda call: call.m <= 8),
    Choice("gemm.tile", GemmConfig(block_m=8, block_n=64, block_u=4, num_warps=4, num_stages=1),
           f"{_8B} --batches 8 --sweep", DOCS_GEMM, when=lambda call: call.m <= 8),
    Choice("gemm.tile", GemmConfig(block_m=16, block_n=64, block_u=8, num_warps=4, num_stages=1),
           f"{_8B} --formats Q8_0 --batches 16 --sweep", DOCS_GEMM, formats=("Q8_0",), when=lambda call: call.m <= 16),
    Choice("gemm.tile", GemmConfig(block_m=16, block_n=64, block_u=4, num_warps=4, num_stages=1),
           f"{_8B} --batches 16 --sweep", DOCS_GEMM, when=lambda call: call.m <= 16),
    Choice("gemm.tile", GemmConfig(block_m=32, block_n=64, block_u=8, num_warps=4, num_stages=3),
           f"{_8B} --batches 32 --sweep", DOCS_GEMM, when=lambda call: call.m <= 32),
    Choice("gemm.tile", GemmConfig(block_m=64, block_n=64, block_u=4, num_warps=4, num_stages=3),
           f"{_8B} --batches 64 --sweep", DOCS_GEMM, when=lambda call: call.m <= 64),
    Choice("gemm.tile", GemmConfig(block_m=128, block_n=64, block_u=4, num_warps=4, num_stages=3),
           f"{_DECODE} --batches 128 --sweep", DOCS_GEMM),
    # K split in two while that leaves fewer programs per multiprocessor than this (up to 128 rows; from 256 rows
    # splitting lost as often as it won), at most ``gemm.max_split_k`` ways.
    Choice("gemm.split_programs_per_sm", 7, f"{_8B} --batches 8,16 --sweep", DOCS_GEMM, when=lambda call: call.m <= 16),
    Choice("gemm.split_programs_per_sm", 2, f"{_DECODE} --batches 32,64,65,128 --sweep", DOCS_GEMM,
           when=lambda call: call.m <= 128),
    Choice("gemm.split_programs_per_sm", 0, f"{_DECODE} --batches 256", DOCS_GEMM),
    Choice("gemm.max_split_k", 16, f"{_8B} --batches 8,16 --sweep", DOCS_GEMM),

    # --- The llama.cpp-numerics GEMM's tiles (weight tiles then narrowed while there are fewer programs than
    # multiprocessors, ``int8_gemm_config``).
    Choice("int8_gemm.tile", Int8GemmConfig(block_m=16, block_n=64), f"{_LLAMACPP} --batches 8,16 --sweep",
           DOCS_LLAMACPP, when=lambda call: call.m <= 16),
    Choice("int8_gemm.tile", Int8GemmConfig(block_m=64, block_n=64), f"{_LLAMACPP} --batches 128,512 --sweep",
           DOCS_LLAMACPP),

    # --- The dequantizer ahead of cuBLAS (not swept).
    Choice("dequantize.tile", DequantConfig(block_n=16, block_u=8, num_warps=4), f"{_8B} --batches 512", DOCS_PREFILL),
)

_BY_SETTING: dict[str, tuple[Choice, ...]] = {}
for _choice in CHOICES:
    _BY_SETTING[_choice.setting] = (*_BY_SETTING.get(_choice.setting, ()), _choice)
for _setting, _rows in _BY_SETTING.items():
    if _rows[-1].formats is not None or _rows[-1].when is not None:
        raise ValueError(f"launch choices: the last row of {_setting!r} must always hold")


def rows(setting: str) -> tuple[Choice, ...]:
    """The table's rows for ``setting``, in the order they are read."""
    return _BY_SETTING[setting]


def choose(setting: str, call: Call = Call()) -> Any:
    """The value of the first row of ``setting`` that holds for ``call``."""
    for choice in _BY_SETTING[setting]:
        if choice.holds(call):
            return choice.value(call) if callable(choice.value) else choice.value
    raise AssertionError("unreachable: every setting ends with a row that always holds")


# The table's plain numbers, under the names the kernels have always used.
PANEL_MIN_BATCH = choose("cpu.panel_min_batch")
GEMV_MAX_ROWS = choose("gemv.max_rows")  # the most rows of activations the GEMV takes (``gemv_rows``: it wins up to)
MMA_MAX_ROWS = choose("mma.max_rows")
LLAMACPP_GEMM_MIN_ROWS = choose("llamacpp.gemm_min_rows")


def gemv_rows(fmt: str) -> int:
    """Rows of activations up to which the GEMV outruns the other kernels (``gemv.rows``)."""
    return choose("gemv.rows", Call(fmt=fmt))


@functools.cache  # asked on every matmul that might take the GEMM
def gemm_rows(fmt: str, n: int, device: torch.device) -> int:
    """Rows of activations up to which the fused GEMM outruns dequantize + cuBLAS (``gemm.rows``)."""
    return choose("gemm.rows", Call(fmt=fmt, n=n, sms=sm_count(device)))


def mma_rows(fmt: str) -> int:
    """Rows of activations up to which ``mma_gemm`` outruns the GEMM (``mma.rows``)."""
    return choose("mma.rows", Call(fmt=fmt))


def walks_chunks(fmt: str, llamacpp: bool = False) -> bool:
    """Whether the GEMV walks 64-value chunks of ``fmt`` (``k_chunk_dots``, ``small_k_chunk_dots``), not 32 values
    (``gemv.chunks``)."""
    return choose("gemv.chunks", Call(fmt=fmt, llamacpp=llamacpp))


def gemm_walks_chunks(fmt: str, block_m: int) -> bool:
    """Whether the fused GEMM reads ``fmt`` in 64-value chunks in tiles of ``block_m`` rows of activations
    (``gemm.chunks``)."""
    return choose("gemm.chunks", Call(fmt=fmt, block_m=block_m))


def gemv_units(k: int, fmt: str, llamacpp: bool = False) -> int:
    """Units of one row the GEMV walks (``walks_chunks``)."""
    return k // (2 * QK if walks_chunks(fmt, llamacpp) else QK)


@functools.cache  # a pure function of its arguments, asked on every matmul
def gemv_config(k: int, fmt: str, m: int = 1, llamacpp: bool = False) -> GemvConfig:
    """The GEMV's tiling for ``m`` rows of activations of ``k`` values (``gemv.config``)."""
    return choose("gemv.config", Call(fmt=fmt, m=m, k=k, llamacpp=llamacpp, chunks=walks_chunks(fmt, llamacpp)))


@functools.cache  # a pure function of its arguments, asked on every matmul
def gemv_llamacpp_config(k: int, fmt: str, m: int) -> GemvConfig:
    """The llama.cpp-numerics GEMV's tiling (``gemv_llamacpp.config``)."""
    return choose("gemv_llamacpp.config", Call(fmt=fmt, m=m, k=k, llamacpp=True, chunks=walks_chunks(fmt, True)))


@functools.cache  # a pure function of its arguments, asked on every matmul
def mma_config(n: int, k: int, device: torch.device, fmt: str, m: int) -> MmaConfig:
    """The fragment kernel's warps (``mma.warps``), no more than there are steps in a row."""
    config = MmaConfig(num_warps=choose("mma.warps", Call(fmt=fmt, m=m, n=n, k=k, sms=sm_count(device))))
    while config.num_warps > 1 and config.num_warps > k // config.step_values(fmt):
        config = dataclasses.replace(config, num_warps=config.num_warps // 2)
    return config


@functools.cache  # a pure function of its arguments, asked on every matmul
def int8_gemm_config(m: int, n: int, device: torch.device) -> Int8GemmConfig:
    """The llama.cpp-numerics GEMM's tiles (``int8_gemm.tile``), weight tiles halved down to 16 rows while there are
    fewer programs than multiprocessors."""
    config = choose("int8_gemm.tile", Call(m=m, n=n))
    while config.block_n > 16 and cdiv(m, config.block_m) * cdiv(n, config.block_n) < sm_count(device):
        config = dataclasses.replace(config, block_n=config.block_n // 2)
    return config


@functools.cache  # a pure function of its arguments, asked on every matmul
def gemm_config(m: int, n: int, k: int, device: torch.device, fmt: str) -> GemmConfig:
    """The fused GEMM's tiles (``gemm.tile``), with K split in two while that leaves fewer programs than
    ``gemm.split_programs_per_sm`` per multiprocessor, at most ``gemm.max_split_k`` ways and no more than there are
    steps along K."""
    call = Call(fmt=fmt, m=m, n=n, k=k, sms=sm_count(device))
    config = choose("gemm.tile", call)
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    steps = cdiv(k // QK, config.block_u)
    split_k, programs_per_sm = 1, choose("gemm.split_programs_per_sm", call)
    max_split = min(choose("gemm.max_split_k", call), steps)
    while 2 * tiles * split_k < programs_per_sm * call.sms and 2 * split_k <= max_split:
        split_k *= 2
    return dataclasses.replace(config, split_k=split_k)


def dequant_config() -> DequantConfig:
    """The dequantizer's tiles (``dequantize.tile``)."""
    return choose("dequantize.tile")


__all__ = [
    "CHOICES", "Call", "Choice", "DequantConfig", "GEMV_MAX_ROWS", "GemmConfig", "GemvConfig", "Int8GemmConfig",
    "LLAMACPP_GEMM_MIN_ROWS", "MMA_MAX_ROWS", "MmaConfig", "PANEL_MIN_BATCH", "choose", "dequant_config",
    "gemm_config", "gemm_rows", "gemm_walks_chunks", "gemv_config", "gemv_llamacpp_config", "gemv_rows", "gemv_units",
    "int8_gemm_config", "mma_config", "mma_rows", "rows", "sm_count", "walks_chunks",
]
