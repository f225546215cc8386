"""Quantized kernels: GGUF tensor formats kept packed, and the matmuls that run on them."""
from .formats import FORMATS, QuantFormat, get_format
from .linear import KERNELS, Kernel, linear, register_kernel, select_kernel
from .quant_tensor import QuantTensor

__all__ = [
    "FORMATS",
    "QuantFormat",
    "get_format",
    "QuantTensor",
    "Kernel",
    "KERNELS",
    "linear",
    "register_kernel",
    "select_kernel",
]
