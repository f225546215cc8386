"""``launch(kernel, grid, *args, **constants)``: ``kernel[grid](*args, **constants)`` for about half the host time.

An eager CUDA forward launches ~300 Triton kernels, and Triton's launcher (binding the arguments, specializing them,
building the cache key, reading its knobs) takes several times the host time of the compiled kernel's own launch, so
an eager forward is bound by the host (docs/performance.md, "Triton launches"). ``launch`` goes through Triton once
per specialization, keeps the compiled kernel it returns, and launches that directly afterwards.

The cache key is at least as fine as Triton's specialization of the arguments, so a kept kernel is only reused for
arguments Triton would have compiled it for: each tensor's dtype and whether its data starts at a multiple of 16
bytes, each int's value class (1, a multiple of 16, 32 or 64 bits), each other argument's type, the constants and
options, and the device. Under ``TRITON_INTERPRET=1`` or with a Triton launch hook set (profilers), every launch
goes through Triton, and so does every launch inside ``through_triton()`` (for benchmarks).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# Compiled kernels by key; one per specialization actually launched, so a handful per kernel.
_COMPILED: dict[tuple, tuple[Any, tuple]] = {}
_direct = True
# Whether Triton runs the kernels in its interpreter, on CPU tensors: read once, as ``triton.jit`` reads it when the
# kernels are defined.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` can start before the kernel ahead of them ends (programmatic dependent launch:
    Hopper and later; a kernel so launched waits for the one ahead with ``gdc_wait`` before reading what it wrote)."""
    if INTERPRETING or device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _PROGRAMMATIC:
        _PROGRAMMATIC[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _PROGRAMMATIC[index]


_PROGRAMMATIC: dict[int, bool] = {}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``, for the host: ``triton.cdiv`` is a constexpr function, whose Python call costs microseconds."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` >= 1, for the host (see ``cdiv``)."""
    return 1 << (n - 1).bit_length()


def _int_class(value: int) -> tuple[bool, bool, int]:
    # Triton makes 1 a constant, marks multiples of 16, and passes 32-bit, 64-bit or unsigned 64-bit ints.
    width = 32 if -(1 << 31) <= value < (1 << 31) else 64 if -(1 << 63) <= value < (1 << 63) else 65
    return value == 1, value % 16 == 0, width


def _argument_class(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):  # before int: bool is an int
        return bool, arg
    if isinstance(arg, int):
        return _int_class(arg)
    return type(arg), None if isinstance(arg, float) else arg


def _hooked(hook: Any) -> bool:
    # Newer Tritons keep a chain of launch hooks, empty unless a profiler added one; older ones a function or None.
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel: JITFunction, grid: tuple[int, ...], *args: Any, **constants: Any) -> None:
    """Run ``kernel`` over ``grid`` (one to three ints) with the runtime arguments ``args`` (positional, in the
    kernel's order) and its constexpr parameters and launch options (``num_warps``, ...) as keywords."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and first.is_cuda and first.device.index != torch.cuda.current_device():
        # Triton launches on the current device: a model split over GPUs runs some layers on another one
        with torch.cuda.device(first.device):
            return launch(kernel, grid, *args, **constants)
    hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if not _direct or INTERPRETING or _hooked(hooks[0]) or _hooked(hooks[1]):
        kernel[grid](*args, **constants)
        return
    device = driver.active.get_current_device()
    # the Python function: it hashes faster than its JITFunction, whose hash reads a property
    key = (kernel.fn, device, tuple(constants.items()), tuple(map(_argument_class, args)))
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **constants)
        # Every parameter after the runtime arguments is a constexpr given as a keyword, or left at its default.
        params = kernel.params[len(args):]
        if not all(p.is_constexpr for p in params):
            raise TypeError(f"launch: pass {kernel.fn.__name__}'s runtime arguments positionally")
        tail = tuple(constants[p.name] if p.name in constants else p.default for p in params)
        _COMPILED[key] = (compiled, tail)
        return
    compiled, tail = entry
    x, y, z = (*grid, 1, 1)[:3]
    compiled.run(x, y, z, driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)


@contextlib.contextmanager
def through_triton() -> Iterator[None]:
    """Launch every kernel through Triton's own launcher inside the block (``bench/eager_forward.py`` compares)."""
    global _direct
    previous, _direct = _direct, False
    try:
        yield
    finally:
        _direct = previous
