"""Helpers shared by the benchmark scripts (run them as ``python bench/NAME.py``: this folder is on sys.path)."""
from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch

from workbench.kernels import cpu


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


def kernels_from(revision: str):
    """The CPU kernels' op namespace built from ``revision``'s C++ source (a build of its own, beside the current one)."""
    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run(["git", "show", f"{revision}:kernels/csrc/cpu_kernels.cpp"], cwd=root,
                           capture_output=True, text=True)
    if shown.returncode:
        raise SystemExit(f"no CPU kernels at git revision {revision!r}: {shown.stderr.strip().splitlines()[-1]}")
    source = shown.stdout
    tag = "".join(c if c.isalnum() else "_" for c in revision)
    path = Path(tempfile.gettempdir()) / f"workbench-kernels-{tag}" / "cpu_kernels.cpp"
    path.parent.mkdir(exist_ok=True)
    path.write_text(source)
    return cpu._build_extension(cpu._native_isa(), path, f"workbench_cpu_kernels_at_{tag}")


@contextlib.contextmanager
def using_kernels(ops) -> Iterator[None]:
    """The CPU kernels' op namespace ``ops`` (``kernels_from``'s) in place of the current one inside the block."""
    current = cpu.extension()
    cpu._extension["ops"] = ops
    try:
        yield
    finally:
        cpu._extension["ops"] = current
