"""``linear_by_expert``: the matmuls of a mixture's decode, over (activation row, expert) pairs of the stacked experts.

llama.cpp's ``mul_mat_id``: for each pair p, ``x[x_rows[p]] @ W_e.T`` with ``e = experts[p]``, where the weight stacks
the experts' matrices by rows as the GGUF stores them (``ffn_gate_exps`` ...). The pairs stay on the device, so a
decode step reads no routing on the host and can be captured as a CUDA graph. Quantized experts go through the Triton
GEMV (``triton.gemv_by_expert``: only the chosen experts' rows are read, one launch for all pairs), float experts
through a batched matmul of the gathered experts.
"""
from __future__ import annotations

import torch

from . import triton as _triton
from .linear import Numerics, _traced_numerics, get_numerics
from .quant_tensor import FLOAT_DTYPES, QuantTensor
from .tracing import compiling


def by_expert_supported(w: QuantTensor, device: torch.device) -> bool:
    """Whether ``linear_by_expert`` takes the stacked experts ``w`` with activations on ``device``: float experts
    anywhere, quantized ones on CUDA in the formats of the Triton GEMV."""
    if w.fmt.name in FLOAT_DTYPES:
        return True
    return _triton.AVAILABLE and device.type == "cuda" and w.fmt.name in _triton.SUPPORTED_FORMATS


def linear_by_expert(x: torch.Tensor, w: QuantTensor, n_experts: int, experts: torch.Tensor,
                     x_rows: torch.Tensor) -> torch.Tensor:
    """``[P, w.shape[0] // n_experts]``: row p is ``x[x_rows[p]] @ W_e.T`` for ``e = experts[p]``, ``W_e`` the e-th of
    the ``n_experts`` matrices ``w`` stacks by rows, in the current numerics. ``x`` is ``[T, in_features]``; ``experts``
    and ``x_rows`` are ``[P]`` integer tensors on its device, which must lie in range (reading them here would sync)."""
    x = x.contiguous()
    if w.fmt.name in FLOAT_DTYPES:
        return _dense_by_expert(x, w, n_experts, experts, x_rows, _traced_numerics() if compiling() else get_numerics())
    if compiling():  # the Triton launch is opaque to torch.compile, as ``linear``'s op
        return _by_expert_op(x, w.data, w.fmt.name, *w.shape, n_experts, experts, x_rows, _traced_numerics())
    return _quantized_by_expert(x, w, n_experts, experts, x_rows, get_numerics())


def _quantized_by_expert(x: torch.Tensor, w: QuantTensor, n_experts: int, experts: torch.Tensor,
                         x_rows: torch.Tensor, mode: Numerics) -> torch.Tensor:
    # llama.cpp numerics where the format has them; MXFP4 runs exact, as ``linear`` runs it
    if mode == "llamacpp" and w.fmt.name in _triton.LLAMACPP_FORMATS:
        return _triton.gemv_llamacpp_by_expert(x, w, n_experts, experts, x_rows)
    return _triton.gemv_by_expert(x, w, n_experts, experts, x_rows)


def _dense_by_expert(x: torch.Tensor, w: QuantTensor, n_experts: int, experts: torch.Tensor, x_rows: torch.Tensor,
                     mode: Numerics) -> torch.Tensor:
    """Float experts: the chosen matrices gathered (a decode's few), one batched matmul; in llama.cpp numerics the
    activations rounded to the weights' type and the products summed in float32, as ``linear``'s float kernels do."""
    weight = w.data.view(FLOAT_DTYPES[w.fmt.name]).view(n_experts, w.shape[0] // n_experts, w.shape[1])[experts]
    rows = x.index_select(0, x_rows)
    if mode == "llamacpp":
        return torch.bmm(weight.float(), rows.to(weight.dtype).float()[:, :, None])[..., 0].to(x.dtype)
    return torch.bmm(weight.to(x.dtype), rows[:, :, None])[..., 0]


@torch.library.custom_op("workbench::linear_by_expert", mutates_args=())
def _by_expert_op(x: torch.Tensor, data: torch.Tensor, fmt: str, rows: int, cols: int, n_experts: int,
                  experts: torch.Tensor, x_rows: torch.Tensor, mode: str) -> torch.Tensor:
    return _quantized_by_expert(x, QuantTensor(data, fmt, (rows, cols)), n_experts, experts, x_rows, mode)


@_by_expert_op.register_fake
def _by_expert_op_shape(x: torch.Tensor, data: torch.Tensor, fmt: str, rows: int, cols: int, n_experts: int,
                        experts: torch.Tensor, x_rows: torch.Tensor, mode: str) -> torch.Tensor:
    return x.new_empty(experts.shape[0], rows // n_experts)
