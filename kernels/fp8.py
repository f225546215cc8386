"""Matmuls on FP8 weights (``FP8_ROW``, ``FP8_BLOCK``, formats/_fp8.py), in both numerics.

* exact: the dequantized weights times the activations (``blockwise-dequant-matmul`` on the CPU, as for any format;
  ``fp8-dequant-matmul`` on CUDA).
* llamacpp: for FP8 weights this mode computes what FP8 serving engines compute (vLLM, SGLang, DeepSeek-V3's and
  transformers' kernels), since llama.cpp runs no FP8: the activations quantized to E4M3 on the fly, per token for
  ``FP8_ROW`` (compressed-tensors' dynamic per-token scheme), per 128 values of a token for ``FP8_BLOCK``
  (DeepSeek-V3's ``act_quant``), multiplied by the E4M3 codes with float32 sums and both scales applied.

On CUDA, ``fp8-scaled-mm`` runs that product on the FP8 tensor cores through ``torch._scaled_mm`` (row-wise scales
for ``FP8_ROW``; 1x128 by 1x128 block scales for ``FP8_BLOCK``, which cuBLAS 12.9 has on Hopper), reading the codes
where they lie. Where it cannot (a torch or cuBLAS without the scaling, a row stride cuBLAS does not take),
``fp8-triton-gemm`` (``triton/fp8.py``) runs it on the tensor cores in Triton; without Triton, or on a card before
sm_89 (no FP8 tensor cores, where Triton's FP8 dot is emulated slowly or refused), ``fp8-emulated-activations``
computes the same numerics by dequantizing: the quantized activations times the dequantized weights in float32, as
on the CPU.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .formats import _fp8
from .formats.table import FP8_FORMATS
from .linear import Kernel, _blockwise_dequant_matmul, register_kernel
from .quant_tensor import QuantTensor

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (device index, format) -> whether torch._scaled_mm runs this format's scaling there (asked once per device).
_SCALED_MM_WORKS: dict[tuple[int, str], bool] = {}


def quantize_activations(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as E4M3 codes ``[M, K]`` and float32 scales: ``[M, 1]`` per token (FP8_ROW) or ``[M, K / 128]``
    per 128 values (FP8_BLOCK), each the largest magnitude over 448 (a zero group gets a tiny scale and zero codes)."""
    rows, cols = x.shape
    groups = x.float().view(rows, -1 if fmt == "FP8_BLOCK" else 1, _fp8.GROUP if fmt == "FP8_BLOCK" else cols)
    scale = groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / _fp8.E4M3_MAX
    codes = (groups / scale).clamp(-_fp8.E4M3_MAX, _fp8.E4M3_MAX).to(_fp8.E4M3)
    return codes.view(rows, cols), scale.squeeze(2)


def _emulated_scaled_mm(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """The llamacpp numerics by dequantizing: E4M3 activations (dequantized, exact in float32) times the weights,
    a chunk of rows at a time, float32 sums."""
    codes, scale = quantize_activations(x, w.fmt.name)
    rows, cols = x.shape
    activations = (codes.float().view(rows, scale.shape[1], -1) * scale.unsqueeze(2)).view(rows, cols)
    return _blockwise_dequant_matmul(activations, w).to(x.dtype)


def _scaled_mm(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """``torch._scaled_mm`` on the weight's codes in place (a column-major view of the packed rows), bf16 out."""
    cols = w.shape[1]
    a, scale_a = quantize_activations(x, w.fmt.name)
    b = _fp8.codes(w.data, cols).t()  # [K, N], strides (1, row bytes)
    scale_w = _fp8.scales(w.data, cols)
    if w.fmt.name == "FP8_ROW":
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_w[:, 0].reshape(1, -1).contiguous(),
                               out_dtype=torch.bfloat16)
    else:
        from torch.nn.functional import ScalingType, scaled_mm

        # cuBLAS takes 1x128 scales outer-dimension-major: [M, K / 128] with strides (1, M), [N, K / 128] (1, N)
        out = scaled_mm(a, b, scale_a.t().contiguous().t(), ScalingType.BlockWise1x128,
                        scale_w.t().contiguous().t(), ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)
    return out.to(x.dtype)


def _device_key(device: torch.device, fmt: str) -> tuple[int, str]:
    return device.index if device.index is not None else torch.cuda.current_device(), fmt


def _scaled_mm_works(device: torch.device, fmt: str) -> bool:
    """Whether ``_scaled_mm`` takes ``fmt``'s scaling on ``device``: tried once on a small product (sm_89 and later
    have FP8 tensor cores; the 1x128 block scaling needs Hopper and a torch/cuBLAS that have it)."""
    key = _device_key(device, fmt)
    if key not in _SCALED_MM_WORKS:
        try:  # cuBLAS refuses a configuration when the call is made: no synchronization needed (nor allowed while a
            # CUDA graph is being captured); the operands are not random, so no generator's state moves
            x = torch.linspace(-1, 1, 3 * 512, device=device, dtype=torch.bfloat16).view(3, 512)
            codes = torch.linspace(-1, 1, 32 * 512, device=device).view(32, 512).to(_fp8.E4M3)
            _scaled_mm(x, QuantTensor(_fp8.pack(codes, torch.ones(32, 4, device=device)), fmt, (32, 512)))
            _SCALED_MM_WORKS[key] = True
        except (RuntimeError, ImportError, AttributeError, TypeError, ValueError):
            _SCALED_MM_WORKS[key] = False
    return _SCALED_MM_WORKS[key]


def _supports_scaled_mm(x: torch.Tensor, w: QuantTensor) -> bool:
    # cuBLASLt's FP8 operands: 16-byte aligned, leading dimensions and N multiples of 16
    return (x.dtype in ACTIVATION_DTYPES and x.shape[0] > 0 and w.shape[0] % 16 == 0 and w.data.data_ptr() % 16 == 0
            and (w.shape[0] == 1 or w.data.stride(0) % 16 == 0) and _scaled_mm_works(x.device, w.fmt.name))


@functools.cache
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _triton_gemm(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    a, scale_a = quantize_activations(x, w.fmt.name)
    return fp8_gemm(a, scale_a, w, x.dtype)


def _scaled_mm_or_next(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """``_scaled_mm``; if cuBLAS refuses a shape the probe did not try, the same numerics by the next kernel (the Triton
    GEMM, else dequantizing) from then on."""
    try:
        return _scaled_mm(x, w)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as err:
        _SCALED_MM_WORKS[_device_key(x.device, w.fmt.name)] = False
        fallback = TRITON_GEMM if TRITON_GEMM is not None else _emulated("cuda")
        warnings.warn(f"workbench.kernels: torch._scaled_mm refused {w.fmt.name} {w.shape} ({str(err)[:120]}); "
                      f"its matmuls on {x.device} now run {fallback.name}", RuntimeWarning, 2)
        return fallback.run(x, w)


SCALED_MM = Kernel("fp8-scaled-mm", "cuda", _supports_scaled_mm, _scaled_mm_or_next, numerics="llamacpp",
                   formats=FP8_FORMATS)
try:
    from .triton.fp8 import fp8_gemm
except ImportError:  # no Triton: CUDA falls back to the emulated kernel
    TRITON_GEMM = None
else:
    TRITON_GEMM = Kernel("fp8-triton-gemm", "cuda", lambda x, w: x.dtype in ACTIVATION_DTYPES and x.shape[0] > 0
                         and _has_fp8_tensor_cores(x.device), _triton_gemm, numerics="llamacpp", formats=FP8_FORMATS)


def _emulated(device_type: str) -> Kernel:
    return Kernel("fp8-emulated-activations", device_type, lambda x, w: x.dtype in ACTIVATION_DTYPES,
                  _emulated_scaled_mm, numerics="llamacpp", formats=FP8_FORMATS, by_type=True)


# Exact numerics on CUDA: the whole weight dequantized to the activations' dtype, then cuBLAS (the CPU, short of memory
# bandwidth and of RAM, takes ``blockwise-dequant-matmul``'s chunks of rows).
DEQUANT_MATMUL = Kernel("fp8-dequant-matmul", "cuda", lambda x, w: x.dtype in ACTIVATION_DTYPES,
                        lambda x, w: x @ w.dequantize(x.dtype).T, formats=FP8_FORMATS, by_type=True)

register_kernel(_emulated("cpu"))
register_kernel(SCALED_MM)
if TRITON_GEMM is not None:
    register_kernel(TRITON_GEMM)
register_kernel(_emulated("cuda"))
register_kernel(DEQUANT_MATMUL)
