"""The read floor of a GEMV: the time of a kernel that only streams the same bytes in (CUDA, Triton).

A GEMV has to read its weights once, so no GEMV of a weight of ``n`` bytes can beat a kernel that reads
``n`` bytes and does nothing else. For small weights that floor sits well below the copy bandwidth
measured on 1 GiB: launch, the first loads' latency and the last wave's tail do not shrink with the size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # int32 per program (four 16-byte loads per thread); 1024 measured the same on an H100


@triton.jit
def _read_kernel(words, partials, n, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # One sum per program, stored, so the loads cannot be optimized away.
    tl.store(partials + tl.program_id(0), tl.sum(tl.load(words + index, mask=index < n, other=0), axis=0))


def read_all(words: torch.Tensor, partials: torch.Tensor) -> None:
    """Read every int32 of the CUDA tensor ``words`` once; ``partials`` takes one sum per program."""
    programs = triton.cdiv(words.numel(), BLOCK)
    if partials.numel() < programs:
        raise ValueError(f"partials holds {partials.numel()} sums, {programs} programs need one each")
    _read_kernel[(programs,)](words, partials, words.numel(), BLOCK=BLOCK, num_warps=4)
