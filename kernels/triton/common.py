"""What every Triton matmul checks before it launches, and the pieces of host code they share."""
from __future__ import annotations

import torch

from ..launch_choices import GemmConfig, Int8GemmConfig
from ..quant_tensor import QuantTensor
from .formats import LAYOUTS, SUPPORTED_FORMATS, Layout
from .launch import INTERPRETING, cdiv

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def checked_output(x: torch.Tensor, w: QuantTensor, max_rows: int | None = None,
                    **limits) -> tuple[Layout, torch.Tensor]:
    """``check_inputs``, and the uninitialized ``[M, N]`` output of ``x @ w.T`` in ``x.dtype``."""
    layout = check_inputs(x, w, max_rows, **limits)
    return layout, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)


def tile_grid(m: int, n: int, config: GemmConfig | Int8GemmConfig) -> tuple[int]:
    """One program per ``block_m x block_n`` tile of the output (``tile_origin`` orders them)."""
    return (cdiv(m, config.block_m) * cdiv(n, config.block_n),)


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs are for tests: keep them exact rather than rounding to tf32.
    return "ieee" if dtype == torch.float32 else "tf32"
