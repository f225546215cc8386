"""``top_k_probs(x, w, k)``: the top-k of ``softmax(x @ w.T)`` per row and their ids, for the logit lens, whose rows
(every layer's residual at every position) times a vocabulary make logits far larger than the answer.

- On CUDA in exact numerics, one fused Triton kernel (``triton/lens.py``) takes the weight dequantized once to the
  activations' dtype (what the production matmul multiplies in exact numerics; float32 split into float16 halves) and
  never writes the logits: it keeps each row's max, sum of exponentials and top-k as it walks the vocabulary in tiles.
- Elsewhere (the CPU, llama.cpp numerics, a k past the kernel's), the logits of a chunk of rows at a time, then their
  top-k and softmax (on the CPU one C++ pass a row, ``top_k_softmax``): one chunk's logits alive at a time. In exact
  numerics the weight is dequantized once and each chunk is a dense matmul (what ``blockwise-dequant-matmul`` and
  ``triton-dequant-matmul`` compute); in llama.cpp numerics each chunk goes through the production matmul ``linear``.

Both give the probabilities ``exp(logit - max) / sum(exp(logits - max))`` of float32 logits, best first. The C++ pass
sums ggml's exp polynomial block by block, the blocks in double: within 1e-6 relative of float64's softmax (ATen's
float32 softmax was 1e-5 off on one of the embedded model's rows).
"""
from __future__ import annotations

import torch

from . import cpu
from . import triton as _triton
from .layer_ops import soft_cap
from .linear import get_numerics, linear
from .quant_tensor import QuantTensor

# Logit rows computed at once by the chunked path: bounds its float buffer to ~200 MB for a 49k vocabulary.
ROWS_PER_CHUNK = 1024
# The chunked path dequantizes the weight once where the rows take more than one chunk, and it holds at most
# DENSE_BYTES of floats; else it reads it packed (``linear``): the dequantization pays only over several chunks. On the
# embedded model's unembedding, 2 CPU threads (the same bits either way): 64 rows 27 ms through ``linear``, 63 ms
# dequantized once and dense; 256 rows 65 and 94 ms; 1,024 rows 250 and 240 ms, of which the dequantization is ~45 ms.
DENSE_BYTES = 1 << 29


def top_k_probs(x: torch.Tensor, w: QuantTensor, k: int, cap: float | None = None, kept: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, ids)``, each ``[N, k]`` (float32, int64), of ``softmax(linear(x, w).float())`` for ``x`` ``[N, in]``:
    the ``k`` most probable outputs of each row, best first, in the current numerics; with ``cap``, of the logits
    soft-capped first (``layer_ops.soft_cap``), as the forward caps a model's final logits. ``kept``: a dict the caller
    keeps over calls with the same ``w`` (a lens's groups of layers), where the fused kernel's form of it is made
    once."""
    if cap is None and fuses(x, k):
        kept = {} if kept is None else kept
        if x.dtype not in kept:
            dense = dense_weight(w, x.dtype)
            kept[x.dtype] = dense, _split(dense) if x.dtype == torch.float32 else None
        dense, parts = kept[x.dtype]
        return _fused_top_k_probs(x if x.stride(-1) == 1 else x.contiguous(), dense, k, w_split=parts)
    # in exact numerics, the weight dequantized once and a dense matmul per chunk, as the production kernels compute it
    dense = (dense_weight(w, x.dtype) if get_numerics() == "exact" and x.shape[0] > ROWS_PER_CHUNK
             and w.shape[0] * w.shape[1] * x.element_size() <= DENSE_BYTES else None)
    probs, ids = [], []
    for chunk in x.split(ROWS_PER_CHUNK):
        logits = (linear(chunk, w) if dense is None else chunk @ dense.T).float()
        if cap is not None:
            logits = soft_cap(logits, cap)
        chunk_probs, chunk_ids = _top_k_softmax(logits, k)
        probs.append(chunk_probs)
        ids.append(chunk_ids)
    if not probs:
        return x.new_empty(0, k, dtype=torch.float32), torch.empty(0, k, dtype=torch.long, device=x.device)
    return torch.cat(probs), torch.cat(ids)


def _top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``softmax(logits)`` per row and their ids: on the CPU one C++ pass over each row (ATen's topk
    and softmax took 1.9 s of task (d)'s 6.9 on 2 threads), the rows holding a NaN or an infinity as torch gives them."""
    extension = cpu.extension() if logits.is_cpu and logits.dtype == torch.float32 and logits.stride(-1) == 1 else None
    if extension is not None:
        probs, ids = extension.top_k_softmax(logits, k)
        bad = ids[:, 0] < 0
        if not bad.any():
            return probs, ids
        probs[bad], ids[bad] = _top_k_softmax_torch(logits[bad], k)
        return probs, ids
    return _top_k_softmax_torch(logits, k)


def _top_k_softmax_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = logits.topk(k, dim=-1)
    return logits.softmax(-1).gather(1, top.indices), top.indices


def fuses(x: torch.Tensor, k: int) -> bool:
    """Whether ``top_k_probs`` takes the fused kernel for rows ``x`` and ``k``."""
    return x.is_cuda and _triton.AVAILABLE and k <= _MAX_K and get_numerics() == "exact"


def dense_weight(w: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    """``w`` dequantized to ``dtype``, as the production matmul multiplies it in exact numerics: on CUDA by the Triton
    dequantizer of ``triton-dequant-matmul`` where it reads the format."""
    if w.device.type == "cuda" and _triton.AVAILABLE and w.fmt.name in _triton.SUPPORTED_FORMATS:
        return _triton.dequantize(w, dtype)
    return w.dequantize(dtype)


if _triton.AVAILABLE:
    from .triton.lens import MAX_K as _MAX_K, split as _split, top_k_probs as _fused_top_k_probs
else:
    _MAX_K = 0
