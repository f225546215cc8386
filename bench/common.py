"""Helpers shared by the benchmark scripts (run them as ``python bench/NAME.py``: this folder is on sys.path)."""
from __future__ import annotations

import statistics
import sys
from typing import Callable

import torch


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_seconds([lambda: dst.copy_(src)])
    return 2 * src.numel() / seconds


def cuda_seconds(calls: list[Callable[[], object]], repeats: int = 15) -> float:
    """Median time of one call: a CUDA graph runs every call (each on its own data) back to back.

    Code that cannot be captured (a host sync, say) is timed as a plain launch loop instead, and
    says so on stderr: its time then includes launch gaps.
    """
    for call in calls:  # warm-up: compiles, autotunes, allocates
        call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        run = graph.replay
    except RuntimeError as err:
        print(f"(not capturable, timed without a graph: {str(err).splitlines()[0][:80]})", file=sys.stderr)
        torch.cuda.synchronize()

        def run():
            for call in calls:
                call()
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return statistics.median(times)
