"""CUDA backend in Triton: fused dequantize-matmul kernels that read packed GGUF blocks in place.

Importing this package registers, for every supported format, ``triton-gemv-<fmt>`` (up to ``gemv_rows(fmt)``
rows of activations: decode), for ``MMA_FORMATS`` ``triton-mma-<fmt>`` (float16 and bfloat16 activations, up to
``mma_rows(fmt)`` rows of a multiple of ``MMA_K_MULTIPLE`` values: batched decode), ``triton-gemm-<fmt>`` (up to
``gemm_rows(fmt, n, device)`` rows: batched decode, short prompts) and ``triton-dequant-matmul-<fmt>`` (more rows:
one dequantizing pass, then cuBLAS), and for llama.cpp numerics (``LLAMACPP_FORMATS``)
``triton-gemv-llamacpp-<fmt>`` (activations quantized as ggml-cpu does, integer dot products, one weight pass per
row, up to ``LLAMACPP_GEMM_MIN_ROWS - 1`` rows) and ``triton-gemm-llamacpp-<fmt>`` (the same numerics on the tensor
cores, for more rows), with
``workbench.kernels.linear`` when Triton is installed and a CUDA device is present; without either it registers
nothing and ``AVAILABLE`` / ``REGISTERED`` say why. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors
through ``gemv``, ``mma_gemm`` and ``gemm`` (that is how the tests check them). ``gemv_by_expert`` and
``gemv_llamacpp_by_expert``, the GEMV over (activation row, expert) pairs of a mixture's stacked experts, serve
``workbench.kernels.experts.linear_by_expert``. ``rms_norm``, ``add_rms_norm``, ``rope``, ``attention_scores``,
``attend``, ``packed_attention`` and ``swiglu`` are the forward's other per-token ops, for
``workbench.kernels.layer_ops``. Every kernel is launched through ``launch``, which keeps each compiled kernel to launch
it again without Triton's launcher.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..linear import Kernel, Numerics, register_kernel
from ..quant_tensor import QuantTensor

try:
    import triton  # noqa: F401
except ImportError:  # CPU-only installs: nothing to register
    AVAILABLE = False
else:
    AVAILABLE = True

REGISTERED = False

if AVAILABLE:
    from .matmul import (
        ACTIVATION_DTYPES, GEMV_MAX_ROWS, LAYOUTS, LLAMACPP_FORMATS, LLAMACPP_GEMM_MIN_ROWS, MMA_DTYPES, MMA_FORMATS,
        MMA_K_MULTIPLE, MMA_MAX_ROWS, SUPPORTED_FORMATS, GemmConfig, GemvConfig, Int8GemmConfig, MmaConfig,
        dequant_matmul, dequantize, gemm, gemm_llamacpp, gemm_rows, gemv, gemv_by_expert, gemv_llamacpp,
        gemv_llamacpp_by_expert, gemv_rows, mma_gemm, mma_rows, quantize_activations,
    )
    from .layer_ops import add_rms_norm, attend, attention_scores, packed_attention, rms_norm, rope, swiglu

    def _supports(fmt: str, max_rows: int | Callable[[QuantTensor, torch.device], int] | None,
                  dtypes: tuple[torch.dtype, ...] = ACTIVATION_DTYPES, alignment: int = 1, k_multiple: int = 1):
        # ``max_rows``: the most rows of activations, or a function of the weight and device that says it;
        # ``alignment``: bytes that both the activations and the packed data must start at a multiple of;
        # ``k_multiple``: what the row length must be a multiple of
        word_bytes = LAYOUTS[fmt].word_bytes

        def supports(x: torch.Tensor, w: QuantTensor) -> bool:
            return (
                x.device.type == "cuda"
                and w.fmt.name == fmt
                and x.dim() == 2
                and x.shape[1] % k_multiple == 0
                and (max_rows is None or x.shape[0] <= (max_rows(w, x.device) if callable(max_rows) else max_rows))
                and x.dtype in dtypes
                and w.data.data_ptr() % max(word_bytes, alignment) == 0
                and x.data_ptr() % alignment == 0
            )

        return supports

    def _register(kind: str, fmt: str, supports: Callable[[torch.Tensor, QuantTensor], bool],
                  run: Callable[[torch.Tensor, QuantTensor], torch.Tensor], numerics: Numerics = "exact") -> None:
        register_kernel(Kernel(f"triton-{kind}-{fmt.lower()}", "cuda", supports, run, numerics=numerics, formats=(fmt,)))

    def register() -> None:
        """Add the kernels to ``linear``'s CUDA list, narrowest first, since it takes the first that fits."""
        global REGISTERED
        if REGISTERED:
            return
        for fmt in SUPPORTED_FORMATS:
            _register("gemv", fmt, _supports(fmt, gemv_rows(fmt)), gemv)
            if fmt in MMA_FORMATS:
                _register("mma", fmt,
                          _supports(fmt, mma_rows(fmt), MMA_DTYPES, alignment=16, k_multiple=MMA_K_MULTIPLE), mma_gemm)
            _register("gemm", fmt, _supports(fmt, lambda w, device, fmt=fmt: gemm_rows(fmt, w.shape[0], device)), gemm)
            _register("dequant-matmul", fmt, _supports(fmt, None), dequant_matmul)
        for fmt in LLAMACPP_FORMATS:
            _register("gemv-llamacpp", fmt, _supports(fmt, LLAMACPP_GEMM_MIN_ROWS - 1), gemv_llamacpp, "llamacpp")
            _register("gemm-llamacpp", fmt, _supports(fmt, None), gemm_llamacpp, "llamacpp")
        REGISTERED = True

    if torch.cuda.is_available():
        register()

    __all__ = [
        "AVAILABLE", "REGISTERED", "SUPPORTED_FORMATS", "MMA_FORMATS", "LLAMACPP_FORMATS", "GEMV_MAX_ROWS",
        "LLAMACPP_GEMM_MIN_ROWS",
        "MMA_K_MULTIPLE", "MMA_MAX_ROWS", "GemmConfig", "GemvConfig", "Int8GemmConfig", "MmaConfig", "dequant_matmul",
        "dequantize", "gemm", "gemm_llamacpp", "gemm_rows", "gemv", "gemv_by_expert", "gemv_llamacpp",
        "gemv_llamacpp_by_expert", "gemv_rows", "mma_gemm",
        "mma_rows", "quantize_activations", "rms_norm", "add_rms_norm", "rope", "attention_scores", "attend",
        "packed_attention", "swiglu",
        "register",
    ]
else:
    __all__ = ["AVAILABLE", "REGISTERED"]
