"""Matmuls on packed GGUF blocks: a fused GEMV for decode, a fused GEMM, and dequantize + cuBLAS.

All compute ``out = x @ w.T`` for ``x`` ``[M, K]`` (float16, bfloat16 or float32) and a ``QuantTensor``
``w`` ``[N, K]``, reading ``w.data`` (the GGUF bytes, never a repacked copy) directly, accumulating in
float32 and returning ``x.dtype``. ``gemv`` (decode, up to ``GEMV_MAX_ROWS`` rows) multiplies on the CUDA cores,
unpacking each weight once for a block of rows; ``mma_gemm`` (batched decode, up to ``MMA_MAX_ROWS`` rows) runs
``mma.sync`` on weights each lane unpacks into its own tensor-core fragment (``fragments``); ``gemm`` (batched decode
and prefill) dequantizes weight tiles into registers and feeds them to ``tl.dot`` (tensor cores) as its first operand,
with K split over several programs when there are few rows; ``dequant_matmul`` writes the whole weight
out once in ``x.dtype`` (``dequantize``) and hands it to cuBLAS, which wins once there are enough rows to amortize
that.
``gemv_by_expert`` (and ``gemv_llamacpp_by_expert``) is the GEMV over (activation row, expert) pairs of a
mixture's stacked experts, llama.cpp's ``mul_mat_id`` for decode.
``gemv_llamacpp`` computes llama.cpp's numerics instead: the activations quantized as ggml-cpu quantizes them
(``quantize_activations``), integer dot products per block, the GEMV's loop run once per row; ``gemm_llamacpp``
computes the same for many rows with the integer dot products on the tensor cores (int8 ``tl.dot``).


The kernels live by kind (``gemv``, ``gemm``, ``mma``, ``dequant``, ``llamacpp``), the readers of each format family
by family (``legacy``, ``k_small``, ``k_affine``, ``q6_k``, picked by ``readers``), and the launch choices (which
kernel takes how many rows, and its tiles) in ``workbench.kernels.launch_choices``; this module gathers their public
names.
"""
from __future__ import annotations

from ..launch_choices import (
    GEMV_MAX_ROWS, LLAMACPP_GEMM_MIN_ROWS, MMA_MAX_ROWS, DequantConfig, GemmConfig, GemvConfig, Int8GemmConfig,
    MmaConfig, dequant_config, gemm_config, gemm_rows, gemm_walks_chunks, gemv_config, gemv_llamacpp_config, gemv_rows,
    gemv_units, int8_gemm_config, mma_config, mma_rows, walks_chunks,
)
from .common import ACTIVATION_DTYPES, check_inputs, dot_precision, layout_of
from .dequant import dequant_matmul, dequantize
from .formats import K_QUANTS, LAYOUTS, LLAMACPP_FORMATS, MMA_FORMATS, SUPPORTED_FORMATS, Layout
from .gemm import gemm
from .gemv import gemv, gemv_by_expert
from .llamacpp import gemm_llamacpp, gemv_llamacpp, gemv_llamacpp_by_expert, quantize_activations
from .mma import MMA_DTYPES, MMA_K_MULTIPLE, mma_gemm

__all__ = [
    "ACTIVATION_DTYPES", "GEMV_MAX_ROWS", "K_QUANTS", "LAYOUTS", "LLAMACPP_FORMATS", "LLAMACPP_GEMM_MIN_ROWS",
    "MMA_DTYPES", "MMA_FORMATS", "MMA_K_MULTIPLE", "MMA_MAX_ROWS", "SUPPORTED_FORMATS", "GemmConfig", "GemvConfig",
    "Int8GemmConfig", "Layout", "DequantConfig", "MmaConfig", "check_inputs", "dequant_config", "dequant_matmul",
    "dequantize", "dot_precision", "gemm", "gemm_config", "gemm_llamacpp", "gemm_rows", "gemm_walks_chunks", "gemv",
    "gemv_by_expert", "gemv_config", "gemv_llamacpp", "gemv_llamacpp_by_expert", "gemv_llamacpp_config", "gemv_rows",
    "gemv_units", "int8_gemm_config",
    "layout_of", "mma_config", "mma_gemm", "mma_rows", "quantize_activations", "walks_chunks",
]
