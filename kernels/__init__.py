"""Quantized kernels: GGUF tensor formats kept packed, and the matmuls that run on them."""
from .formats import FORMATS, QuantFormat, get_format
from .linear import (
    KERNELS, NUMERICS, REGISTRY, Kernel, KernelRegistry, get_numerics, linear, linear_parts, linear_segments, numerics,
    register_kernel, select_kernel, set_numerics,
)
from .quant_tensor import QuantTensor

from . import cpu  # noqa: E402  registers the C++ GGUF kernels (built on first use)
from . import layer_ops  # noqa: E402
from . import triton as _triton  # noqa: E402  registers the Triton CUDA kernels where CUDA and triton exist
# after the traceable kernels above: a compiled graph calls those directly, and the opaque op from the first one that
# is not traceable on
from . import fp8  # noqa: E402  registers the FP8 kernels

__all__ = [
    "FORMATS",
    "QuantFormat",
    "get_format",
    "QuantTensor",
    "Kernel",
    "KERNELS",
    "KernelRegistry",
    "REGISTRY",
    "linear",
    "linear_parts",
    "linear_segments",
    "layer_ops",
    "register_kernel",
    "select_kernel",
    "numerics",
    "NUMERICS",
    "set_numerics",
    "get_numerics",
]
