"""The LoRA terms of a group of projections that share an input (``runner.add_lora``): each projection's output plus
its term ``B_p (A_p x)``, one call per group.

``a`` holds the parts' A rows stacked ``[R, in]``, ``b_t`` their B's transposed as the blocks of a block-diagonal
``[R, O]`` (``Model.lora_terms``), ``ranks`` each part's rows of ``a``. The torch formula is two matmuls over the whole
group, a split and an add per part; for few rows (decode) one fused call does it all and reads only the nonzero blocks:

- on the CPU (float32), the C++ extension's ``lora_add`` (``csrc/cpu_kernels.cpp``), on one thread: every matmul of
  the formula is a parallel region of its own, which costs more than a small group's arithmetic (and much more when
  the machine's other threads are busy);
- on CUDA, a Triton kernel (``triton/lora.py``): one launch where the formula takes four kernels or more. Inside
  ``torch.compile`` it is the opaque op ``workbench::lora_add``, so that a compiled decode step (and its CUDA graph)
  launches it too.

Where the base's matmul on CUDA is the GEMV (decode), ``linear_with_terms`` takes the base's matmul and the terms
together: a split shrink, in the GEMV's own launch or just before it, then the GEMV adding the terms in its epilogue
(``triton/lora.py``; in a compiled step the opaque op ``workbench::linear_lora``).

All round as the formula does (``A x``, then the term, each to the activations' dtype, then the sum), summing in
their own order. Many rows (a prompt) take the formula, the BLAS being faster there.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch
import torch.nn.functional as F

from . import cpu
from . import triton as _triton
from .launch_choices import gemv_rows
from .layer_ops import KernelForward, kernel_grad_run
from .linear import _traced_numerics as traced_numerics, linear, select_kernel
from .quant_tensor import QuantTensor
from .tracing import compiling, tracks_grad

# Rows (tokens) up to which the fused call serves: decode, batched decode and short prompts.
MAX_ROWS = 16
# Whether the CUDA GEMV adds the terms in its epilogue (``linear_with_terms``); bench/adapters.py switches it off to
# time ``add_terms`` after the GEMV in the same run.
GEMV_EPILOGUE = True
# Tests set it where Triton's interpreter runs the GEMV on CPU tensors (TRITON_INTERPRET=1).
GEMV_ON_CPU = False
# Multiply-adds per thread from which the CPU op splits its expansion over threads: no decode step of a small model
# gets there (docs/performance.md, "LoRA adapters": on 2 shared cores, threads gained nothing quiet and lost much
# under load).
CPU_PARALLEL_WORK = 1 << 18


def torch_terms(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Every part's term side by side, ``[T, O]``: the two matmuls."""
    return F.linear(x, a) @ b_t


def add_terms(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, outs: Sequence[torch.Tensor],
              ranks: Sequence[int]) -> list[torch.Tensor]:
    """``[out + term for each part]`` for the group's input ``x`` ``[T, in]`` and outputs ``outs`` ``[T, width]``."""
    if kernel_grad_run(x, *outs):  # a gradient run keeps the fused call's bits, differentiated as the two matmuls
        return list(KernelForward.apply(_add_terms_to_parts, x, a, b_t, ranks, *outs))
    summed = None
    if x.shape[0] <= MAX_ROWS and a.dtype == x.dtype and b_t.dtype == x.dtype and not tracks_grad(x, *outs):
        if x.is_cpu and x.dtype == torch.float32 and cpu.extension() is not None:
            summed = cpu.extension().lora_add(x.contiguous(), a, b_t, outs, ranks, CPU_PARALLEL_WORK)
        elif x.is_cuda and _triton.AVAILABLE and len(outs) <= _TRITON_PARTS and max(ranks) <= _TRITON_MAX_RANK:
            x = x if x.stride(-1) == 1 else x.contiguous()
            summed = (_lora_op if compiling() else _triton_lora_add)(x, a, b_t, list(outs), list(ranks))
    if summed is None:
        terms = torch_terms(x, a, b_t).split_with_sizes([out.shape[-1] for out in outs], dim=-1)
        return [out + term for out, term in zip(outs, terms)]
    # a view per part costs microseconds of an eager step: one part is the whole
    return [summed] if len(outs) == 1 else list(summed.split_with_sizes([out.shape[-1] for out in outs], dim=-1))


def terms(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, widths: Sequence[int],
          ranks: Sequence[int]) -> list[torch.Tensor]:
    """Each part's term held apart (its hook point's value), as ``add_terms`` computes it: added to zero by the same
    call, so that ``out + term`` is ``add_terms``' sum bit for bit (the fused kernels add each term to its output once,
    in the output's dtype; on CUDA in bfloat16 or float16 the term is rounded once more first)."""
    return add_terms(x, a, b_t, [x.new_zeros(x.shape[0], width) for width in widths], ranks)


def _add_terms_to_parts(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, ranks: Sequence[int],
                        *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``add_terms`` with each output an argument of its own, as ``KernelForward`` tracks them."""
    return tuple(add_terms(x, a, b_t, outs, ranks))


def linear_with_terms(x: torch.Tensor, stacked: QuantTensor | None, parts: Sequence[QuantTensor], a: torch.Tensor,
                      b_t: torch.Tensor, part_ranks: Sequence[int]) -> list[torch.Tensor] | None:
    """``[x @ w.T + term for w in parts]`` for a group of projections, their weights ``parts`` (``stacked``: their rows
    in one weight, or None), ``part_ranks`` their ranks (0: no term), ``a`` and ``b_t`` the adapted ones' (as
    ``add_terms`` takes them), where the base's matmul may be the CUDA GEMV (decode): it adds the terms in its epilogue
    after a split shrink (``triton/lora.py``), no launch or one more than the base where ``add_terms`` after it takes
    one more with a shrink of dependent steps, and the base's output is never read back. None where it cannot serve (the
    caller takes the base's matmuls and ``add_terms``)."""
    if not (GEMV_EPILOGUE and (x.is_cuda or GEMV_ON_CPU) and _triton.AVAILABLE and not tracks_grad(x)
            and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and a.dtype == x.dtype and b_t.dtype == x.dtype and max(part_ranks) <= _TRITON_MAX_RANK):
        return None
    weights = [stacked] if stacked is not None else list(parts)
    widths = [w.shape[0] for w in parts]
    x = x if x.is_contiguous() else x.contiguous()
    if compiling():  # the op chooses the kernels when it runs; tracing rules out what it can see
        if not all(_may_take_gemv(x, w) for w in weights):
            return None
        outs = _linear_terms_op(x, [w.data for w in weights], ",".join(w.fmt.name for w in weights),
                                [w.shape[0] for w in weights], a, b_t, widths, list(part_ranks))
    else:
        if not all(_takes_gemv(x, w) for w in weights):
            return None
        outs = _triton_linear_with_terms(x, weights, widths, a, b_t, part_ranks)
        if outs is None:
            return None
    if len(weights) > 1:
        return outs
    return [outs[0]] if len(parts) == 1 else list(outs[0].split_with_sizes(widths, dim=-1))


def _linear_terms(x: torch.Tensor, weights: Sequence[QuantTensor], widths: Sequence[int], a: torch.Tensor,
                  b_t: torch.Tensor, part_ranks: Sequence[int]) -> list[torch.Tensor]:
    """``linear_with_terms``' outputs per weight (new tensors): the GEMV's with the terms where the kernel of every
    weight is the GEMV, else the base's kernels and ``add_terms``."""
    if all(_takes_gemv(x, w) for w in weights):
        fused = _triton_linear_with_terms(x, weights, widths, a, b_t, part_ranks)
        if fused is not None:
            return fused
    outs = list(torch.cat([linear(x, w) for w in weights], dim=-1).split_with_sizes(widths, dim=-1))
    adapted = [p for p, rank in enumerate(part_ranks) if rank]
    for p, out in zip(adapted, add_terms(x, a, b_t, [outs[p] for p in adapted], [part_ranks[p] for p in adapted])):
        outs[p] = out
    starts = list(accumulate(widths, initial=0))  # each weight's parts
    bounds = [starts.index(row) for row in accumulate((w.shape[0] for w in weights), initial=0)]
    return [torch.cat(outs[first:last], dim=-1) for first, last in zip(bounds, bounds[1:])]


def _takes_gemv(x: torch.Tensor, w: QuantTensor) -> bool:
    """Whether ``linear(x, w)`` runs the Triton GEMV (exact numerics, few rows), whose epilogue takes the terms."""
    return select_kernel(x, w).run is _triton_gemv


def _may_take_gemv(x: torch.Tensor, w: QuantTensor) -> bool:
    """What of ``_takes_gemv`` torch.compile's tracing can ask (not the data's alignment): the GEMV reads the format,
    takes the rows, and the numerics are exact."""
    return x.shape[0] <= _gemv_max_rows(w.fmt.name) and traced_numerics() == "exact"


def _gemv_max_rows(fmt: str) -> int:
    """The most rows the GEMV takes of ``fmt`` (0: it does not read it), a constant of a traced graph."""
    return gemv_rows(fmt) if fmt in _TRITON_FORMATS else 0


# torch.compiler.assume_constant_result's mark, set by hand as on linear's _traced_numerics
_gemv_max_rows._dynamo_marked_constant = True  # type: ignore[attr-defined]


if _triton.AVAILABLE:
    from .triton import SUPPORTED_FORMATS as _TRITON_FORMATS, gemv as _triton_gemv
    from .triton.lora import MAX_PARTS as _TRITON_PARTS, MAX_RANK as _TRITON_MAX_RANK, lora_add as _triton_lora_add
    from .triton.lora import linear_with_terms as _triton_linear_with_terms

    @torch.library.custom_op("workbench::lora_add", mutates_args=())
    def _lora_op(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, outs: list[torch.Tensor],
                 ranks: list[int]) -> torch.Tensor:
        """The Triton kernel as one opaque op, for compiled graphs."""
        return _triton_lora_add(x, a, b_t, outs, ranks)

    @_lora_op.register_fake
    def _lora_op_shape(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, outs: list[torch.Tensor],
                       ranks: list[int]) -> torch.Tensor:
        return x.new_empty(x.shape[0], b_t.shape[1])

    @torch.library.custom_op("workbench::linear_lora", mutates_args=())
    def _linear_terms_op(x: torch.Tensor, datas: list[torch.Tensor], fmts: str, rows: list[int], a: torch.Tensor,
                         b_t: torch.Tensor, widths: list[int], part_ranks: list[int]) -> list[torch.Tensor]:
        """``_linear_terms`` as one opaque op, for compiled graphs: the weights as ``linear``'s op takes them (their
        formats joined by commas). Which kernels run is chosen when it runs, as ``linear``'s op chooses."""
        weights = [QuantTensor(data, fmt, (n, x.shape[1])) for data, fmt, n in zip(datas, fmts.split(","), rows)]
        return _linear_terms(x, weights, widths, a, b_t, part_ranks)

    @_linear_terms_op.register_fake
    def _linear_terms_op_shape(x: torch.Tensor, datas: list[torch.Tensor], fmts: str, rows: list[int], a: torch.Tensor,
                               b_t: torch.Tensor, widths: list[int], part_ranks: list[int]) -> list[torch.Tensor]:
        return [x.new_empty(x.shape[0], n) for n in rows]
