"""``linear(x, w)``: every matmul of the model, routed to the best kernel for the device and format.

Two pieces of state decide which kernel runs, both explicit:

* the numerics (what quantized matmuls compute): ``with numerics("llamacpp"):`` sets them for the block, in this
  thread or async task only (a ``ContextVar``); outside any block they are the process default of
  ``set_numerics`` ("exact" unless changed). ``workbench.load(..., numerics=...)`` gives a model its own, which its
  calls use outside any block.
* the kernel registry, ``REGISTRY``: the kernels per device type (backends register theirs on import) and what
  ``select_kernel`` keeps of its choices; ``REGISTRY.reset()`` forgets those, ``REGISTRY.copy()`` makes another.
"""
from __future__ import annotations

import contextlib
import typing
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

import torch

from .quant_tensor import FLOAT_DTYPES, QuantTensor
from .tracing import compiling, tracks_grad

Numerics = Literal["exact", "llamacpp"]
NUMERICS: tuple[Numerics, ...] = typing.get_args(Numerics)  # for argument parsers and checks

# Rows dequantized at a time by the blockwise path: bounds the float scratch buffer to ~4 MiB.
_CHUNK_VALUES = 1 << 20


@dataclass(frozen=True)
class Kernel:
    """A matmul implementation for some (device, format, batch) combinations."""

    name: str
    device_type: str
    supports: Callable[[torch.Tensor, QuantTensor], bool]
    run: Callable[[torch.Tensor, QuantTensor], torch.Tensor]
    # Several weights of one input in one call, their outputs side by side (``linear_parts``); None: one call each.
    run_parts: Callable[[torch.Tensor, Sequence[QuantTensor]], torch.Tensor] | None = None
    # Several weights of one shape, each on its own rows of the input, the outputs stacked (``linear_segments``);
    # None: one call each.
    run_segments: Callable[[torch.Tensor, Sequence[QuantTensor], Sequence[int], Sequence[int]],
                           torch.Tensor] | None = None
    # ``supports`` and ``run`` trace under torch.compile (registered torch ops, no data pointers), so compiled graphs
    # call the kernel directly; other kernels are called through the opaque ``workbench::linear`` op.
    traceable: bool = False
    # What it computes: "exact" (``x @ dequantize(w).T`` up to float rounding) or "llamacpp" (see ``set_numerics``).
    numerics: Numerics = "exact"
    # The float32 weights it multiplies, for a gradient's ``grad @ dequantize(w)`` (None: ``QuantTensor.dequantize``).
    dequantize: Callable[[QuantTensor], torch.Tensor] | None = None
    # The weight formats it reads, so that ``select_kernel`` skips it for others without asking ``supports`` (which
    # still says no to them); None: any format.
    formats: tuple[str, ...] | None = None
    # ``supports`` reads only the input's device type and dtype and the weight's format, so ``select_kernel`` may keep
    # its answer for them (the CPU kernels, the fallbacks); a CUDA kernel also reads row counts and alignment.
    by_type: bool = False


def _blockwise_dequant_matmul(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """Dequantize a chunk of rows into a float buffer, multiply, move on: no full float copy of ``w``."""
    rows, cols = w.shape
    chunk = max(1, _CHUNK_VALUES // cols)
    if chunk >= rows:
        return x @ w.dequantize(x.dtype).T
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        torch.matmul(x, w.dequantize_rows(slice(start, stop)).to(x.dtype).T, out=out[:, start:stop])
    return out


BLOCKWISE = Kernel("blockwise-dequant-matmul", "any", lambda x, w: True, _blockwise_dequant_matmul, by_type=True)

def _dense_matmul(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """Float weights are their own bytes viewed as floats: a plain BLAS/cuBLAS matmul, no conversion."""
    weight = w.data.view(FLOAT_DTYPES[w.fmt.name])
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return x @ weight.T


DENSE = Kernel("dense-matmul", "any", lambda x, w: w.fmt.name in FLOAT_DTYPES, _dense_matmul,
               formats=tuple(FLOAT_DTYPES), by_type=True)


def _dense_matmul_llamacpp(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """ggml-cpu's float dot products: the activations rounded to the weight's type (its ``vec_dot_type``), products
    and sums in float32; the weight converted a chunk of rows at a time."""
    rounded = x.to(FLOAT_DTYPES[w.fmt.name]).float()
    if w.fmt.name == "F32":  # its bytes are the float32 weight (an MoE router): no copy to convert
        return _dense_matmul(rounded, w).to(x.dtype)
    return _blockwise_dequant_matmul(rounded, w).to(x.dtype)


DENSE_LLAMACPP = Kernel("dense-matmul-llamacpp", "any", lambda x, w: w.fmt.name in FLOAT_DTYPES,
                        _dense_matmul_llamacpp, numerics="llamacpp", formats=tuple(FLOAT_DTYPES), by_type=True)
# Kernels for any device, tried after the device's own.
FALLBACKS = (DENSE_LLAMACPP, DENSE, BLOCKWISE)


def check_numerics(mode: str) -> Numerics:
    """``mode`` if it names numerics, else a ValueError that lists them."""
    if mode not in NUMERICS:
        raise ValueError(f"numerics must be 'exact' or 'llamacpp', got {mode!r}")
    return mode  # type: ignore[return-value]


# The process default, and the mode of the innermost ``numerics()`` block of this thread or async task (None: none).
_default_numerics: Numerics = "exact"
_scoped_numerics: ContextVar[Numerics | None] = ContextVar("workbench_numerics", default=None)


def set_numerics(mode: Numerics) -> None:
    """Set the process-wide default of what quantized matmuls compute: ``"exact"`` floats, or ``"llamacpp"``:
    activations quantized to Q8 blocks and integer block dot products, as ggml-cpu computes them (the CPU kernels
    implement it; a matmul with no kernel for the mode runs exactly and warns once, naming the path that ran).

    The default holds wherever no ``numerics()`` block (nor a model's own numerics, ``workbench.load(numerics=...)``)
    says otherwise; for a scope of its own, concurrent code should use ``with numerics(mode):``."""
    global _default_numerics
    _default_numerics = check_numerics(mode)


def get_numerics() -> Numerics:
    """The numerics matmuls compute here and now: the innermost ``numerics()`` block's, else the process default."""
    mode = _scoped_numerics.get()
    return _default_numerics if mode is None else mode


def scoped_numerics() -> Numerics | None:
    """The mode of the innermost ``numerics()`` block around this call (this thread or async task), None outside."""
    return _scoped_numerics.get()


@contextlib.contextmanager
def numerics(mode: Numerics) -> Iterator[None]:
    """``with numerics("llamacpp"): ...`` runs the block under ``mode``: in this thread or async task only (threads and
    tasks started elsewhere keep theirs), restoring the previous mode after it."""
    token = _scoped_numerics.set(check_numerics(mode))
    try:
        yield
    finally:
        _scoped_numerics.reset(token)


def _traced_numerics() -> Numerics:
    """``get_numerics()`` for torch.compile's tracing, which cannot trace a ``ContextVar``: read once, as a constant of
    the graph, with no guard on it. A graph compiled under one numerics therefore keeps it for the kernels it calls
    directly, whatever block it later runs in: compile once per numerics and run each build under its own (what the
    decode steps of ``workbench.generation`` do)."""
    return get_numerics()


# The mark ``torch.compiler.assume_constant_result`` sets, set by hand: that function imports torch._dynamo, seconds
# at every ``import workbench`` (tests/test_numerics.py checks that the two agree).
_traced_numerics._dynamo_marked_constant = True  # type: ignore[attr-defined]


# (device type, format, input dtype, numerics) of a choice ``select`` keeps; (numerics, device type, format, dtype) of
# a fallback it warned about.
_ChoiceKey = tuple[str, str, torch.dtype, Numerics]


@dataclass(eq=False)
class KernelRegistry:
    """The matmul kernels per device type, best first (backends register theirs on import; ``fallbacks``, for any
    device, come after them), and what ``select`` keeps of its answers. ``linear`` uses the module's ``REGISTRY``."""

    kernels: dict[str, list[Kernel]] = field(default_factory=lambda: {"cpu": [], "cuda": []})
    fallbacks: tuple[Kernel, ...] = FALLBACKS
    # (device type, format) -> the kernels that may read it, in ``select``'s order: a matmul asks the ``supports`` of a
    # few kernels instead of every kernel of every format (on CUDA, 30).
    _candidates: dict[tuple[str, str], tuple[Kernel, ...]] = field(default_factory=dict, repr=False)
    # The kernel chosen per ``_ChoiceKey``, where ``select`` asked only ``by_type`` kernels: an eager CPU decode token
    # asks ~200 times.
    _chosen: dict[_ChoiceKey, Kernel] = field(default_factory=dict, repr=False)
    _warned: set[tuple[str, str, str, torch.dtype]] = field(default_factory=set, repr=False)

    def register(self, kernel: Kernel) -> None:
        """Add ``kernel`` after the others of its device type (the first that fits runs)."""
        self.kernels.setdefault(kernel.device_type, []).append(kernel)
        self.reset()

    def reset(self) -> None:
        """Forget every kept choice and every fallback warned about: the next matmuls ask the kernels again."""
        self._candidates.clear()
        self._chosen.clear()
        self._warned.clear()

    def copy(self) -> "KernelRegistry":
        """Another registry with the same kernels and nothing kept: registering in one leaves the other alone."""
        return KernelRegistry({device: list(kernels) for device, kernels in self.kernels.items()}, self.fallbacks)

    @property
    def chosen(self) -> dict[_ChoiceKey, Kernel]:
        """The choices ``select`` keeps, by (device type, format, input dtype, numerics)."""
        return dict(self._chosen)

    def candidates(self, device_type: str, fmt: str) -> tuple[Kernel, ...]:
        kernels = self._candidates.get((device_type, fmt))
        if kernels is None:
            kernels = self._candidates[(device_type, fmt)] = tuple(
                k for k in (*self.kernels.get(device_type, []), *self.fallbacks) if k.formats is None or fmt in k.formats)
        return kernels

    def select(self, x: torch.Tensor, w: QuantTensor, mode: Numerics | None = None) -> Kernel:
        """The first kernel (``x``'s device's, then the fallbacks) that takes ``(x, w)`` and computes ``mode`` (default:
        the current numerics); else the first exact one, with a warning that names it."""
        mode = get_numerics() if mode is None else mode
        device_type = _device_type(x)
        key = (device_type, w.fmt.name, x.dtype, mode)
        chosen = self._chosen.get(key)
        if chosen is not None:
            return chosen
        exact, asked = None, []
        for kernel in self.candidates(device_type, w.fmt.name):
            if kernel.numerics in (mode, "exact"):
                asked.append(kernel)
                if kernel.supports(x, w):
                    if kernel.numerics == mode:
                        chosen = kernel
                        break
                    exact = exact or kernel
        if chosen is None:
            self._warn_fallback(x, w, exact, mode)  # BLOCKWISE takes everything, so there is one
            chosen = exact
        if all(kernel.by_type for kernel in asked):
            self._chosen[key] = chosen
        return chosen

    def _warn_fallback(self, x: torch.Tensor, w: QuantTensor, kernel: Kernel, mode: Numerics) -> None:
        key = (mode, x.device.type, w.fmt.name, x.dtype)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"workbench.kernels: no {mode!r}-numerics kernel for {w.fmt.name} weights with {x.dtype} input on "
                f"{x.device.type}; these matmuls run exact numerics on the '{kernel.name}' path.",
                RuntimeWarning,
                stacklevel=4,
            )


REGISTRY = KernelRegistry()
# The default registry's kernels per device type, best first (the same dict as ``REGISTRY.kernels``).
KERNELS = REGISTRY.kernels


def register_kernel(kernel: Kernel) -> None:
    """Add ``kernel`` to the default registry (``REGISTRY.register``)."""
    REGISTRY.register(kernel)


def _device_type(x: torch.Tensor) -> str:
    """``x.device.type``, without building a device object for CPU tensors: asked on every matmul."""
    return "cpu" if x.is_cpu else x.device.type


def select_kernel(x: torch.Tensor, w: QuantTensor, mode: Numerics | None = None) -> Kernel:
    """The kernel ``linear(x, w)`` runs: ``REGISTRY.select`` under ``mode`` (default: the current numerics)."""
    return REGISTRY.select(x, w, mode)


def _compiled_kernel(x: torch.Tensor, w: QuantTensor) -> Kernel | None:
    """While torch.compile traces: the kernel to put straight into the graph, or None for the opaque op (a kernel that
    cannot be traced comes first, so its ``supports`` cannot be asked; or no traceable kernel computes the numerics)."""
    mode = _traced_numerics()
    for kernel in REGISTRY.kernels.get(x.device.type, []):
        if not kernel.traceable:
            return None
        if kernel.numerics == mode and kernel.supports(x, w):
            return kernel
    return None


@torch.library.custom_op("workbench::linear", mutates_args=())
def _linear_op(x: torch.Tensor, data: torch.Tensor, fmt: str, rows: int, cols: int) -> torch.Tensor:
    """``linear`` as one opaque op, so torch.compile traces around the kernels instead of into them."""
    w = QuantTensor(data, fmt, (rows, cols))
    return select_kernel(x, w).run(x, w)


@_linear_op.register_fake
def _linear_op_shape(x: torch.Tensor, data: torch.Tensor, fmt: str, rows: int, cols: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], rows)


def _check_input(x: torch.Tensor, w: QuantTensor) -> None:
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight {w.fmt.name} {w.shape} expects {w.shape[1]}")
    if not (x.is_cpu and w.data.is_cpu) and x.device != w.device:  # two CPU tensors share a device: no device objects
        raise ValueError(f"linear: input on {x.device}, weight on {w.device}")


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous ``[rows, features]``; a 2-D input, the forward's case, costs no op call."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def _as_input_shape(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's ``[rows, out_features]`` result in ``x``'s leading shape."""
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def _input_grad(grad: torch.Tensor, w: QuantTensor, kernel: Kernel) -> torch.Tensor:
    """``grad @ dequantize(w)``, the gradient of ``linear``'s input, with the weights ``kernel`` multiplies, a chunk of
    rows at a time (as ``_blockwise_dequant_matmul``: no float copy of the whole weight)."""
    rows, cols = w.shape
    chunk = max(1, _CHUNK_VALUES // cols)
    out = grad.new_zeros(grad.shape[0], cols)
    for start in range(0, rows, chunk):
        part = QuantTensor(w.data[start:start + chunk], w.fmt, (min(chunk, rows - start), cols))
        weights = kernel.dequantize(part) if kernel.dequantize is not None else part.dequantize()
        out.addmm_(grad[:, start:start + chunk], weights.to(grad.dtype))
    return out


class _LinearWithInputGrad(torch.autograd.Function):
    """``kernel.run(x, w)``, the forward's own kernel and bits, with the gradient of ``x``: the derivative of ``x @
    dequantize(w).T`` (in llama.cpp numerics too, whose rounding of ``x`` it passes straight through). Weights take
    none: they are the model's, not parameters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kernel: Kernel, w: QuantTensor) -> torch.Tensor:
        ctx.kernel, ctx.w = kernel, w
        return kernel.run(x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _input_grad(grad, ctx.w, ctx.kernel), None, None


def linear(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` of shape ``[..., in_features]``, computed on ``w``'s packed blocks; differentiable in
    ``x`` where autograd tracks it."""
    _check_input(x, w)
    x2 = _as_rows(x)
    if tracks_grad(x2):
        return _as_input_shape(_LinearWithInputGrad.apply(x2, select_kernel(x2, w), w), x)
    kernel = _compiled_kernel(x2, w) if compiling() else select_kernel(x2, w)
    out = _linear_op(x2, w.data, w.fmt.name, *w.shape) if kernel is None else kernel.run(x2, w)
    return _as_input_shape(out, x)


def linear_parts(x: torch.Tensor, parts: Sequence[QuantTensor]) -> list[torch.Tensor]:
    """``[linear(x, w) for w in parts]``, in one kernel call where one kernel serves every part and takes
    several weights at once (the CPU kernels: one parallel region for q, k and v instead of three)."""
    if len(parts) < 2 or tracks_grad(x):
        return [linear(x, w) for w in parts]
    for w in parts:
        _check_input(x, w)
    x2 = _as_rows(x)
    pick = _compiled_kernel if compiling() else select_kernel
    kernel = pick(x2, parts[0])
    if kernel is None or kernel.run_parts is None or any(pick(x2, w) is not kernel for w in parts[1:]):
        return [linear(x, w) for w in parts]
    out = _as_input_shape(kernel.run_parts(x2, parts), x)
    return list(out.split_with_sizes([w.shape[0] for w in parts], dim=-1))


def linear_segments(x: torch.Tensor, parts: Sequence[QuantTensor], starts: Sequence[int],
                    counts: Sequence[int]) -> torch.Tensor:
    """Each weight on its own rows of ``x`` ``[N, in_features]``: rows ``starts[p]`` to ``starts[p] + counts[p]`` times
    ``parts[p]``, the results stacked in part order, ``[sum(counts), out_features]`` (every part of one shape). One
    kernel call where one kernel serves every part and takes them so (the CPU kernels: llama.cpp's ``mul_mat_id``, a
    token's chosen experts in one parallel region), else one call per part; the same bits either way."""
    shape = parts[0].shape
    for w in parts:
        if w.shape != shape:
            raise ValueError(f"linear_segments: parts of shapes {shape} and {w.shape}; they must have one shape")
        _check_input(x, w)
    x2 = _as_rows(x)
    pick = _compiled_kernel if compiling() else select_kernel
    kernel = pick(x2, parts[0])
    # parts of one shape, format and input take one kernel: asked once a format (a decode step's 8 to 16 experts)
    formats = {w.fmt.name: w for w in parts}
    if (kernel is not None and kernel.run_segments is not None and not tracks_grad(x2)
            and all(pick(x2, w) is kernel for w in formats.values())):
        return kernel.run_segments(x2, parts, starts, counts)
    return torch.cat([linear(x2[start:start + count], w) for w, start, count in zip(parts, starts, counts)])
