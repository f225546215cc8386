"""CUDA backend in Triton: fused dequantize-matmul kernels that read packed GGUF blocks in place.

Importing this package registers ``triton-gemv-<fmt>`` (one row of activations) and
``triton-gemm-<fmt>`` (any number of rows) for every supported format with
``workbench.kernels.linear`` when Triton is installed and a CUDA device is present; without either it
registers nothing and ``AVAILABLE`` / ``REGISTERED`` say why. Under ``TRITON_INTERPRET=1`` the same
kernels run on CPU tensors through ``gemv`` and ``gemm`` (that is how the tests check them).
"""
from __future__ import annotations

import torch

from ..linear import Kernel, register_kernel
from ..quant_tensor import QuantTensor

try:
    import triton  # noqa: F401
except ImportError:  # CPU-only installs: nothing to register
    AVAILABLE = False
else:
    AVAILABLE = True

REGISTERED = False

if AVAILABLE:
    from .matmul import ACTIVATION_DTYPES, LAYOUTS, SUPPORTED_FORMATS, GemmConfig, GemvConfig, gemm, gemv

    def _supports(fmt: str, max_rows: int | None):
        layout = LAYOUTS[fmt]

        def supports(x: torch.Tensor, w: QuantTensor) -> bool:
            return (
                x.device.type == "cuda"
                and w.fmt.name == fmt
                and x.dim() == 2
                and (max_rows is None or x.shape[0] <= max_rows)
                and x.dtype in ACTIVATION_DTYPES
                and w.data.data_ptr() % layout.word_bytes == 0
            )

        return supports

    def register() -> None:
        """Add the kernels to ``linear``'s CUDA list, the GEMV first so single rows pick it."""
        global REGISTERED
        if REGISTERED:
            return
        for fmt in SUPPORTED_FORMATS:
            register_kernel(Kernel(f"triton-gemv-{fmt.lower()}", "cuda", _supports(fmt, 1), gemv))
            register_kernel(Kernel(f"triton-gemm-{fmt.lower()}", "cuda", _supports(fmt, None), gemm))
        REGISTERED = True

    if torch.cuda.is_available():
        register()

    __all__ = ["AVAILABLE", "REGISTERED", "SUPPORTED_FORMATS", "GemmConfig", "GemvConfig", "gemm", "gemv", "register"]
else:
    __all__ = ["AVAILABLE", "REGISTERED"]
