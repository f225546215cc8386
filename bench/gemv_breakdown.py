"""Where the batch-1 Q4_K GEMV's time goes (CUDA): its loads alone, its loads and the activations, all of it.

    python bench/gemv_breakdown.py [--shapes 8b|8b-decode]

For each weight shape it times, side by side in one run (CUDA graph replays over weight copies that
overflow L2, as ``kernels.py`` does):
- ``loads``: a kernel with the GEMV's grid, warps and weight loads (``k_chunk_load``, the same addresses
  in the same order, less the GEMV's final look-ahead, which re-reads cached bytes) that only folds the
  loaded words together: the cost of the GEMV's access pattern;
- ``loads + x``: the same, also loading each unit's activations as the GEMV does;
- ``gemv``: the GEMV itself (``workbench.kernels.triton.gemv``, its default configuration);
- ``floor``: the read floor (``read_floor.py``).
The differences place the GEMV's time: its access pattern (loads vs floor), its activation reads
(loads + x vs loads), and arithmetic that does not overlap the loads (gemv vs loads + x).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from common import copy_bandwidth
from kernels import SHAPES, Timer, read_floor_seconds
from workbench.kernels import QuantTensor
from workbench.kernels.triton import gemv
from workbench.kernels.triton.formats import Q4_K
from workbench.kernels.triton.k_affine import k_chunk_load
from workbench.kernels.triton.matmul import gemv_config, gemv_units
from workbench.synthetic import random_matrix


@triton.jit
def _loads_kernel(w_ptr, x_ptr, out_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
                  WITH_X: tl.constexpr):
    pair_rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N * BLOCK_U) // BLOCK_U, N - 1)
    rowp = w_ptr + pair_rows.to(tl.int64) * row_bytes
    folded = tl.zeros((BLOCK_N * BLOCK_U,), tl.int32)
    n_chunks = K // 64
    for first in range(0, n_chunks, BLOCK_U):
        raw = k_chunk_load(rowp, first, n_chunks, Q4_K, BLOCK_N, BLOCK_U)
        for i in tl.static_range(len(raw)):
            folded ^= raw[i]
        if WITH_X:  # each chunk's 64 activations, as the GEMV loads them, summed as integers
            index = 64 * (first + tl.arange(0, BLOCK_U))[:, None] + tl.arange(0, 64)[None, :]
            x_bits = tl.sum(tl.load(x_ptr + index).to(tl.int16, bitcast=True).to(tl.int32), axis=1)
            folded ^= tl.reshape(tl.broadcast_to(x_bits[None, :], (BLOCK_N, BLOCK_U)), (BLOCK_N * BLOCK_U,))
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Stored, so no load can be optimized away.
    tl.store(out_ptr + rows, tl.sum(tl.reshape(folded, (BLOCK_N, BLOCK_U)), axis=1), mask=rows < N)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=("8b", "8b-decode"), default="8b-decode")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    torch.manual_seed(0)
    timer = Timer("cuda", quick=False)
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
          f"copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'N x K':>12}  " + "".join(f"{name:>20}" for name in ("loads", "loads + x", "gemv", "floor"))
          + "   (us, % of copy)")
    for n, k in SHAPES[args.shapes]:
        w = random_matrix(n, k, "Q4_K", device="cuda", distinct_rows=256)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        config = gemv_config(k, "Q4_K")
        block_u = config.block_u
        if gemv_units(k, "Q4_K") % block_u:
            print(f"{f'{n}x{k}':>12}  skipped: the loads kernel needs whole steps of {block_u} chunks")
            continue

        def weight_copy() -> QuantTensor:
            return QuantTensor(w.data.clone(), w.fmt, w.shape)

        def loads(with_x: bool):
            return lambda ww: _loads_kernel[(triton.cdiv(n, config.block_n),)](
                ww.data, x, out, n, k, ww.data.shape[1], BLOCK_N=config.block_n, BLOCK_U=block_u, WITH_X=with_x,
                num_warps=config.num_warps)

        seconds = [
            timer.seconds(weight_copy, w.nbytes, loads(False)),
            timer.seconds(weight_copy, w.nbytes, loads(True)),
            timer.seconds(weight_copy, w.nbytes, lambda ww: gemv(x, ww)),
            read_floor_seconds(w.nbytes, timer),
        ]
        print(f"{f'{n}x{k}':>12}  " + "".join(
            f"{f'{s * 1e6:.1f} us {100 * w.nbytes / s / copy_bw:.0f} %':>20}" for s in seconds), flush=True)
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
