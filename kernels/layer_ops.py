"""The forward's glue between the weight matmuls: RMSNorm (alone, or with the residual sum before it), the rope,
attention's two products, and the MLP's SwiGLU.

Eagerly, each is one call where the torch formulas take two to eight op calls, and an eager forward pays per call
far more than these ops' arithmetic costs:

- on the CPU (float32), RMSNorm (alone or with the residual sum), SwiGLU and the rope are calls of the C++ extension
  (``csrc/cpu_kernels.cpp``), attention's products batched matmuls; where no hook lies between them, the rope of q and
  k, the cache's write and attention are one C++ call (``rope_attention``) that runs the same ops;
- on CUDA, all six are Triton kernels (``triton/layer_ops.py``), and a batch's attention without a cache is one
  launch over the packed sequences (``packed_attention``; the runner computes the padded scores and pattern beside it
  for hooks that ask for them).

Elsewhere (CPU half precision; inside ``torch.compile``, which fuses them with their neighbours; without either
backend) they are the torch formulas. Every product and sum is rounded to float32 alike, the rope to the same bits;
the norm's scale and attention's sums may differ between implementations in the last bit, each summing in its own
order, with attention's dots rounded to the inputs' dtype as a matmul rounds them.
"""
from __future__ import annotations

import contextlib
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from . import cpu, llamacpp_ops
from . import triton as _triton
from .linear import get_numerics
from .quant_tensor import QuantTensor
from .tracing import compiling, tracks_grad

# Set by ``torch_formulas()``: every op runs its torch formula, whatever the backend.
_FORCE_TORCH = {"on": False}


@contextlib.contextmanager
def torch_formulas() -> Iterator[None]:
    """``with torch_formulas(): ...`` runs these ops as their torch formulas on every device: to compare numerics, or
    to time what the C++ and Triton implementations save (``bench/eager_forward.py``)."""
    previous = _FORCE_TORCH["on"]
    _FORCE_TORCH["on"] = True
    try:
        yield
    finally:
        _FORCE_TORCH["on"] = previous


def _native(x: torch.Tensor, factor: torch.Tensor) -> bool:
    """Whether the C++ op takes ``x`` and its factors (``weight``, or ``cos`` and ``sin``, of ``factor``'s device and
    dtype): float32 CPU tensors, eager, and the extension built. Attribute reads only: this runs per op call."""
    return (
        x.is_cpu and factor.is_cpu and x.dtype == torch.float32 and factor.dtype == torch.float32
        and not compiling() and not _FORCE_TORCH["on"] and not tracks_grad(x, factor) and cpu.extension() is not None
    )


def _on_triton(x: torch.Tensor, factor: torch.Tensor) -> bool:
    """Whether the Triton kernel takes ``x`` and its factors: CUDA tensors, eager, Triton installed."""
    return (x.is_cuda and factor.is_cuda and _triton.AVAILABLE and not compiling()
            and not _FORCE_TORCH["on"] and not tracks_grad(x, factor))


def implementations(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """What runs each op in an eager forward on ``device`` in ``dtype`` (for ``workbench info``): ``"cpu-cxx"``,
    ``"triton"``, or the torch formulas (``"torch"``; attention's products as ``"torch-bmm"``)."""
    probe = torch.empty(1, 1, device=device, dtype=dtype)
    on_triton = _on_triton(probe, probe)
    native = _native(probe, probe)
    glue = "cpu-cxx" if native else "triton" if on_triton else "torch"
    attention = "triton" if on_triton else "torch-bmm"
    return {"rms_norm": glue, "add_rms_norm": "torch add + torch" if glue == "torch" else glue, "rope": glue,
            "attention_scores": attention, "attend": attention, "swiglu": glue,
            "rope_attention": "cpu-cxx" if native else "separate ops",
            "blocks_exact": "cpu-cxx" if native else "separate ops",
            "packed_attention": "triton" if on_triton else "padded ops"}


def llamacpp_glue(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether an op on ``x`` (and ``others``, the rest of the tensors it reads) computes as llama.cpp's CPU does
    (``llamacpp_ops``): float32 on the CPU, eager, in llama.cpp numerics, outside ``exact_glue()``, and none of them
    tracked by autograd (the C++ kernels have no backward: a gradient at the keys alone must not pass through one).
    Compiled graphs keep the exact numerics' glue, and so do CUDA tensors: ggml-cpu's loops are not what llama.cpp's
    CUDA backend runs, and would run there one key at a time. The numerics are asked right after ``compiling()``
    (torch.compile cannot trace the ``ContextVar`` read): in exact numerics they answer, and this runs at every op of
    the glue."""
    return (not compiling() and get_numerics() == "llamacpp" and x.is_cpu and x.dtype == torch.float32
            and not _EXACT_GLUE["on"] and not tracks_grad(x, *others))


# Set by ``exact_glue()``: llama.cpp numerics keep the exact numerics' glue (their matmuls stay llama.cpp's).
_EXACT_GLUE = {"on": False}


@contextlib.contextmanager
def exact_glue() -> Iterator[None]:
    """``with exact_glue(): ...`` runs the glue between the matmuls as exact numerics do, in llama.cpp numerics too
    (as a compiled graph runs it): to tell what the glue's emulation changes."""
    previous = _EXACT_GLUE["on"]
    _EXACT_GLUE["on"] = True
    try:
        yield
    finally:
        _EXACT_GLUE["on"] = previous


_SAVED = object()  # marks the arguments KernelForward keeps as saved tensors
# Set while KernelForward's backward recomputes an op, in that thread alone: the op then runs as autograd can follow
# it (its torch formula, since the kernels refuse tensors autograd tracks) instead of going through KernelForward.
_DIFFERENTIATING: ContextVar[bool] = ContextVar("workbench_differentiating", default=False)


class KernelForward(torch.autograd.Function):
    """``op(*args)`` as a forward without gradients computes it (the C++, Triton or llama.cpp-numerics kernel, its
    bits), differentiated as its torch formula: the backward recomputes the op on inputs autograd tracks, where no
    kernel without a backward runs (``_native``, ``_on_triton``, ``llamacpp_glue``), and takes that graph's gradients.
    So a gradient run's forward is the production forward."""

    @staticmethod
    def forward(ctx, op: Callable, *args: Any) -> Any:
        ctx.op, ctx.args = op, [_SAVED if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        return op(*args)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        saved, wants = iter(ctx.saved_tensors), ctx.needs_input_grad[1:]
        args = [next(saved).detach().requires_grad_(want) if a is _SAVED else a for a, want in zip(ctx.args, wants)]
        token = _DIFFERENTIATING.set(True)
        try:
            with torch.enable_grad():
                outs = ctx.op(*args)
        finally:
            _DIFFERENTIATING.reset(token)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(out, grad) for out, grad in zip(outs, grads) if grad is not None and out.requires_grad]
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
                     if pairs and inputs else [None] * len(inputs))
        return (None, *(next(found) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args))


def kernel_grad_run(*tensors: torch.Tensor) -> bool:
    """Whether an op on ``tensors`` runs through ``KernelForward``: autograd tracks them, outside its backward."""
    return tracks_grad(*tensors) and not _DIFFERENTIATING.get()


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, with no op call when ``x`` already has it: the eager forward pays per call, even for a no-op."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis of ``x`` ``[..., d]``: the scale ``1 / sqrt(mean(x^2) + eps)`` ``[..., 1]``
    (computed in float32, in ``x``'s dtype) and ``(x * scale) * weight``."""
    if kernel_grad_run(x, weight):
        return KernelForward.apply(rms_norm, x, weight, eps)
    if llamacpp_glue(x):
        return llamacpp_ops.rms_norm(x, weight, eps)
    native = _native(x, weight)
    if native or (_on_triton(x, weight) and weight.dtype == x.dtype):
        kernel = cpu.extension().rms_norm if native else _triton.rms_norm
        if x.dim() == 2:  # the forward's case: no reshapes, each a host op call of its own
            return kernel(x.contiguous(), weight.contiguous(), eps)
        scale, out = kernel(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), eps)
        return scale.view(*x.shape[:-1], 1), out.view(x.shape)
    scale = as_dtype(torch.rsqrt(as_dtype(x, torch.float32).pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    return scale, x * scale * weight


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual sum ``x + delta`` (both ``[T, d]``, in ``x``'s dtype) and ``rms_norm`` of it: the sum, its scale and
    its normalized output, as ``x + delta`` then ``rms_norm`` give them bit for bit; one call on CUDA and the CPU."""
    if kernel_grad_run(x, delta, weight):
        return KernelForward.apply(add_rms_norm, x, delta, weight, eps)
    if (x.dim() == 2 and delta.shape == x.shape and delta.dtype == x.dtype and not llamacpp_glue(x)
            and not tracks_grad(delta)):
        if _native(x, weight) and delta.is_cpu:
            return cpu.extension().add_rms_norm(x.contiguous(), delta.contiguous(), weight.contiguous(), eps)
        if _on_triton(x, weight) and weight.dtype == x.dtype and delta.is_cuda:
            return _triton.add_rms_norm(x.contiguous(), delta.contiguous(), weight.contiguous(), eps)
    total = x + delta
    return (total, *rms_norm(total, weight, eps))


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's attention logits, Gemma's final logits)."""
    return torch.tanh(x / cap) * cap


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate`` and ``up`` ``[T, d]``, each product rounded to their dtype as the torch formula
    rounds it: one call on CUDA and the CPU (in float32, the bits of the formula)."""
    if kernel_grad_run(gate, up):
        return KernelForward.apply(swiglu, gate, up)
    if llamacpp_glue(gate, up):
        return llamacpp_ops.swiglu(gate, up)
    if (_native(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.stride(-1) == 1
            and up.stride(-1) == 1):
        return cpu.extension().swiglu(gate, up)
    if (_on_triton(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.stride(-1) == 1 and up.stride(-1) == 1):
        return _triton.swiglu(gate, up)
    return F.silu(gate) * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first of equal maxima; a NaN counts as the largest): one C++ pass on the CPU, where
    ATen's reduction takes 1.2-2.3 ns a value (a third of a millisecond a greedy token over a 150k vocabulary)."""
    if _native(logits, logits) and logits.dim() in (1, 2) and logits.shape[-1] and logits.stride(-1) == 1:
        rows = cpu.extension().argmax_rows(logits.view(-1, logits.shape[-1]))
        return rows.view(logits.shape[:-1])
    return logits.argmax(-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate each pair of values of ``x`` ``[T, heads, d_head]`` (adjacent values, or the two halves of each head):
    ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)`` in float32, returned in ``x``'s dtype. ``cos`` and ``sin``
    ``[T, 1, d_head]`` hold each pair's factors at both of its values, sin signed for each value (-sin at the first):
    ``x * cos + partner(x) * sin`` is the formula in two products and a sum."""
    if kernel_grad_run(x):
        return KernelForward.apply(rope, x, cos, sin, interleaved)
    if llamacpp_glue(x):
        return llamacpp_ops.rope(x, cos, sin, interleaved)
    if _native(x, cos):
        return cpu.extension().rope(x.contiguous(), cos.contiguous(), sin.contiguous(), interleaved)
    if _on_triton(x, cos):
        return _triton.rope(x, cos, sin, interleaved)
    xf = as_dtype(x, torch.float32)
    half = x.shape[-1] // 2
    shape, member_axis = ((half, 2), -1) if interleaved else ((2, half), -2)
    pairs = xf.unflatten(-1, shape)
    if compiling() and x.device.type == "cpu":
        # inductor's C++ code runs the formula over the pair members faster than the flip, its Triton code slower
        # (docs/performance.md, "The compiled decode step")
        x0, x1 = pairs.unbind(member_axis)
        cos, sin = cos.unflatten(-1, shape).select(member_axis, 0), sin.unflatten(-1, shape).select(member_axis, 1)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=member_axis).flatten(-2)
    else:
        out = xf * cos + pairs.flip(member_axis).flatten(-2) * sin
    return as_dtype(out, x.dtype)


def _query_key_dots(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``queries @ keys.T`` per kv head (``[H, M, d] x [H, S, d] -> [H, M, S]``), summed in float32 and rounded
    once to the inputs' dtype, as a matmul does.

    Inside ``torch.compile`` with a few query rows (decode), written as a product summed over ``d``: the
    compiler then fuses it with the rope of the queries into one small kernel, where a batched matmul
    stays a cuBLAS call of its own.
    """
    if compiling() and queries.shape[1] <= 16:
        return (queries.float()[:, :, None, :] * keys.float()[:, None, :, :]).sum(-1).to(queries.dtype)
    return torch.bmm(queries, keys.transpose(1, 2))


def attention_scores(q: torch.Tensor, keys: torch.Tensor, divisor: float, blocked: torch.Tensor | None) -> torch.Tensor:
    """Float32 scores ``[heads, T, S]``: each query ``q`` ``[T, heads, d]`` dotted with the ``keys`` ``[kv_heads, S,
    d]`` of its kv head (query head h reads kv head ``h // (heads / kv_heads)``), the dot rounded to the inputs' dtype
    as a matmul rounds it, divided by ``divisor``, and -inf where ``blocked`` ``[T, S]`` is True (None: nowhere).

    A batch of sequences adds a leading axis to each: ``q`` ``[B, T, heads, d]``, ``keys`` ``[B, kv_heads, S, d]``,
    ``blocked`` broadcastable to ``[B, 1, T, S]``, scores ``[B, heads, T, S]``; it takes the batched matmul."""
    if kernel_grad_run(q, keys):
        return KernelForward.apply(attention_scores, q, keys, divisor, blocked)
    if (q.dim() == 3 and _on_triton(q, keys) and q.stride(-1) == 1 and keys.stride(-1) == 1
            and (blocked is None or blocked.stride(-1) == 1)):
        return _triton.attention_scores(q, keys, divisor, blocked)
    *batch, tokens, heads, d = q.shape
    kv_heads, slots = keys.shape[-3], keys.shape[-2]
    rows = kv_heads * (batch[0] if batch else 1)
    q_grouped = q.transpose(-3, -2).reshape(rows, heads // kv_heads * tokens, d)
    dots = _query_key_dots(q_grouped, keys.reshape(rows, slots, d))
    scores = as_dtype(dots.view(*batch, heads, tokens, slots), torch.float32) / divisor
    return scores if blocked is None else scores.masked_fill(blocked, float("-inf"))


def attend(pattern: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``z`` ``[T, heads, d]`` in the values' dtype: the float32 ``pattern`` ``[heads, T, S]``, rounded to the values'
    dtype, times the ``values`` ``[kv_heads, S, d]`` of each head's kv head. A batch adds a leading axis to each
    (``[B, heads, T, S]`` and ``[B, kv_heads, S, d]`` give ``[B, T, heads, d]``)."""
    if kernel_grad_run(pattern, values):
        return KernelForward.apply(attend, pattern, values)
    if (pattern.dim() == 3 and _on_triton(pattern, values) and values.stride(-1) == 1
            and pattern.dtype == torch.float32):
        return _triton.attend(pattern, values)
    *batch, heads, tokens, slots = pattern.shape
    kv_heads, d = values.shape[-3], values.shape[-1]
    rows = kv_heads * (batch[0] if batch else 1)
    z = torch.bmm(as_dtype(pattern, values.dtype).reshape(rows, heads // kv_heads * tokens, slots),
                  values.reshape(rows, slots, d))
    return z.view(*batch, heads, tokens, d).transpose(-3, -2)


# Bytes of float32 scores one attention call holds at most where no hook asks for them: past this, attention is one
# fused ``scaled_dot_product_attention`` call (docs/performance.md, "Long prompts").
SCORES_BUDGET = 64 << 20


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, divisor: float,
              blocked: torch.Tensor | None, budget: int | None = None) -> torch.Tensor:
    """``z`` as ``attend(attention_scores(...).softmax(-1), values)`` gives it (shapes as there, a batch's leading axis
    included), holding at most about ``budget`` bytes of scores (None: ``SCORES_BUDGET``).

    A forward whose scores fit takes exactly those three calls, which a hook on the scores or the pattern sees. Past
    the budget, one ``scaled_dot_product_attention`` call on every device (flash or memory-efficient kernels: scores in
    float32 registers, never rounded to the inputs' dtype as the matmul rounds them, and a causal mask skips the blocks
    above the diagonal), so logits differ from the materialized path's in the last bits
    (``tests/test_runner.py`` bounds it).

    In llama.cpp numerics (eager), llama.cpp's CPU flash attention instead (``llamacpp_ops``): F16 keys and
    values, and its own order and precision of every sum."""
    if kernel_grad_run(q, keys, values):
        return KernelForward.apply(attention, q, keys, values, divisor, blocked, budget)
    if llamacpp_glue(q, keys, values):
        return llamacpp_ops.attention(q, keys, values, divisor, blocked)
    budget = SCORES_BUDGET if budget is None else budget
    *batch, tokens, heads, d = q.shape
    if heads * tokens * keys.shape[-2] * 4 * (batch[0] if batch else 1) <= budget:
        return attend(attention_scores(q, keys, divisor, blocked).softmax(dim=-1), values)
    return _sdpa(q, keys, values, divisor, blocked)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, width: int,
                     divisor: float, window: int = 0,
                     rotation: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> torch.Tensor | None:
    """``z`` ``[N, heads, d]`` of a batch's sequences packed one after another with no cache: ``q`` ``[N, heads, d]``,
    ``k`` and ``v`` ``[N, kv_heads, d]``, sequence b the rows ``starts[b]`` to ``starts[b + 1]`` (``width`` the
    longest's length), each token attending causally to its own sequence's keys (those less than ``window`` tokens
    behind it, where ``window`` is not 0). One Triton launch on CUDA that holds no scores (``attention`` over the
    padded sequences takes some 25 op calls a layer); its sums run in their own order, so ``z`` differs from the padded
    products' in the last bits. ``rotation``: ``(cos, sin, interleaved)``, ``rope``'s arguments for the whole head: q
    and k are rotated in the same launch, to ``rope``'s bits. None where it does not run (off CUDA, or inside
    ``torch.compile``)."""
    if not _on_triton(q, k) or tracks_grad(q, k, v):
        return None
    return _triton.packed_attention(q, k, v, starts, width, divisor, window, rotation)


# A cache layer's key and value buffers and where the new tokens' slots start: ``[kv_heads, capacity, d]`` and the
# first new slot (``KVCache.buffers``), or a batch's ``[B, kv_heads, capacity, d]`` and each row's (``BatchKVCache``).
KVSlots = tuple[torch.Tensor, torch.Tensor, "int | tuple[int, ...]"]


def _fused_attention_starts(tokens: int, heads: int, kv_slots: KVSlots | None, bounds: Sequence[int] | None,
                            blocked: torch.Tensor | None) -> list[int] | None:
    """The new slots' starts that ``rope_attention`` and ``blocks_exact`` pass their C++ call (one, or one a sequence
    of a batch packed at ``bounds``), or None where that call declines the shapes: scores past ``SCORES_BUDGET`` (as
    ``attention`` holds none past it), or a batch without its mask."""
    if bounds is None:
        start = kv_slots[2] if kv_slots is not None else 0
        return [start] if heads * tokens * (tokens + start) * 4 <= SCORES_BUDGET else None
    if blocked is None:
        return None
    width = max(b - a for a, b in zip(bounds, bounds[1:]))
    starts = list(kv_slots[2]) if kv_slots is not None else [0] * (len(bounds) - 1)
    return starts if heads * (len(bounds) - 1) * width * blocked.shape[-1] * 4 <= SCORES_BUDGET else None


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, cos: torch.Tensor,
                   sin: torch.Tensor, interleaved: bool, kv_slots: KVSlots | None, divisor: float,
                   blocked: torch.Tensor | None, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                   bounds: Sequence[int] | None = None) -> torch.Tensor | None:
    """``z`` ``[T, heads, d]`` of ``attention`` over the rope of ``q`` ``[T, heads * d]`` and ``k`` ``[T, kv_heads *
    d]`` (``cos`` and ``sin`` ``[T, 1, d]`` as ``rope`` takes them), and ``v`` ``[T, kv_heads * d]``: with ``kv_slots``
    (a cache layer's buffers and the first new slot), the new keys and values written into the buffers and every slot
    up to them attended over; without, the new ones alone. With ``qk_norm`` (q's and k's RMSNorm weights ``[d]`` and
    the epsilon, Qwen3's), each head of q and k goes through its norm first (``rms_norm``). With ``bounds`` (where
    each sequence starts in the packed rows, and their total: ``BatchLayout.host_bounds``), the rows of a batch of
    sequences, each over its own row of a ``BatchKVCache`` (``kv_slots``) with ``blocked`` ``[B, 1, T_max, S]``, or
    without a cache over its own tokens with ``blocked`` ``[T_max, T_max]``, as the runner pads them for
    ``attention``.

    One C++ call that gives the bits of ``rope``, the cache's write, ``attention_scores``, softmax and ``attend`` (~25
    op calls of an eager forward): the runner takes it where no hook lies between the projections and ``z``. None
    where that call does not run: it takes float32 CPU tensors in an eager forward's exact numerics, the rope over
    every value of a head, and scores within ``SCORES_BUDGET`` (past it, ``attention`` holds none)."""
    starts = _fused_attention_starts(q.shape[0], heads, kv_slots, bounds, blocked)
    if (starts is None or not _native(q, cos) or llamacpp_glue(q) or tracks_grad(q, k, v)
            or cos.shape[-1] * heads != q.shape[1]):
        return None
    keys, values = kv_slots[:2] if kv_slots is not None else (None, None)
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    return cpu.extension().rope_attention(q, k, v, cos.contiguous(), sin.contiguous(), interleaved, keys, values,
                                          starts, divisor, blocked, q_norm, k_norm, eps, list(bounds or ()))


class PlainBlock(NamedTuple):
    """A decoder block of llama's form as ``blocks_exact`` reads it."""
    attn_norm: torch.Tensor  # its first norm's weight
    weights: Sequence[QuantTensor]  # wq, wk, wv, wo, w_gate, w_up, w_down
    qkv_bias: Sequence[torch.Tensor]  # q, k and v's biases (Qwen2's), or none
    qk_norm: Sequence[torch.Tensor]  # the RMSNorm weights of each head of q and of k (Qwen3's), or none
    mlp_norm: torch.Tensor


def blocks_exact(x: torch.Tensor, normalized: torch.Tensor, blocks: Sequence[PlainBlock], eps: float, heads: int,
                 rotations: Sequence[tuple[torch.Tensor, torch.Tensor]], interleaved: bool,
                 kv_slots: Sequence[KVSlots] | None, divisor: float, blocked: Sequence[torch.Tensor | None],
                 bounds: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Consecutive blocks of llama's form with no hook inside them nor between them, in one C++ call: from the first
    one's input stream ``x`` ``[T, d_model]`` and its first norm ``normalized``, each block's projections, attention
    (``rope_attention`` with its own ``rotations``, ``kv_slots`` and ``blocked``, ``heads`` and ``divisor``), residual
    sum with its second norm, SwiGLU, and between two blocks the residual sum with the next one's first norm (a batch's
    packed sequences with ``bounds``, as ``rope_attention`` takes them): the last block's stream after attention and
    its MLP's output, with the bits of the separate calls (``linear``'s exact CPU kernel, the bias sums, ``rms_norm``,
    ``rope_attention``, ``add_rms_norm``, ``swiglu``), which an eager decode step pays for in Python more than in
    arithmetic. Every weight is of a format the C++ kernels read (``readable``: the caller picks such blocks). None
    where it does not run: as ``rope_attention``, and in exact numerics; none of that depends on the block, so a
    caller declined once may take every block of the forward apart."""
    starts = _fused_attention_starts(x.shape[0], heads, kv_slots[0] if kv_slots is not None else None, bounds,
                                     blocked[0])
    if (starts is None or not blocks_exact_may_run(x, normalized, rotations[0][0])
            or any(cos.shape[-1] * heads != blocks[0].weights[0].shape[0] for cos, _ in rotations)):
        return None
    weights = [w for block in blocks for w in block.weights]
    return cpu.extension().blocks_exact(
        x, normalized, [w.data for w in weights], [w.fmt.ggml_type for w in weights], [w.shape[0] for w in weights],
        [t for block in blocks for t in block.qkv_bias], [t for block in blocks for t in block.qk_norm],
        [block.attn_norm for block in blocks[1:]], [block.mlp_norm for block in blocks], eps,
        [cos.contiguous() for cos, _ in rotations], [sin.contiguous() for _, sin in rotations], interleaved,
        [keys for keys, _, _ in kv_slots or ()], [values for _, values, _ in kv_slots or ()], starts, divisor,
        list(blocked), list(bounds or ()), cpu.PANEL_MIN_BATCH)


def blocks_exact_may_run(x: torch.Tensor, normalized: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether ``blocks_exact`` may take a forward whose stream is ``x``, first norm's output ``normalized`` and rope
    table ``cos``: float32 CPU tensors of an eager forward (the glue's own C++ calls) in exact numerics, autograd
    tracking neither (a gradient at the first norm alone tracks ``normalized`` alone). A cheap test before the
    blocks' arguments are gathered."""
    return _native(x, cos) and get_numerics() == "exact" and not tracks_grad(x, normalized)


def readable(weights: Sequence[QuantTensor]) -> bool:
    """Whether every weight is of a format the C++ kernels read (``blocks_exact`` takes none other)."""
    return all(w.fmt.ggml_type in cpu.SUPPORTED_TYPES for w in weights)


# The last mask ``_causal`` looked at and its answer, as one pair: every layer of a forward passes the same mask, and
# the check reads all of it (70 ms at 8k tokens). A weak reference, so the memo neither keeps a mask alive nor mistakes
# a new mask at a freed one's address for it; one pair replaced whole, so two threads never read one mask's reference
# with another's answer.
_CAUSAL_MEMO: list[tuple[weakref.ref | Callable[[], None], bool]] = [(lambda: None, False)]


def _causal(blocked: torch.Tensor) -> bool:
    """Whether ``blocked`` ``[T, T]`` is the plain causal mask (True above the diagonal), which SDPA takes as
    ``is_causal``: its kernels then skip the blocked half instead of reading a mask."""
    seen, answer = _CAUSAL_MEMO[0]
    if seen() is blocked:
        return answer
    causal = (blocked.dim() == 2 and blocked.shape[0] == blocked.shape[1]
              and torch.equal(blocked, torch.ones_like(blocked).triu(1)))
    _CAUSAL_MEMO[0] = (weakref.ref(blocked), causal)
    return causal


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, divisor: float,
          blocked: torch.Tensor | None) -> torch.Tensor:
    """Fused attention for ``attention``'s shapes: ``[.., T, heads, d]`` queries, ``[.., kv_heads, S, d]`` keys and
    values, kv head ``h // (heads / kv_heads)`` for query head ``h``."""
    # SDPA falls back to its math kernel, which holds every score (128 GiB for a 32k-token 8B prompt), unless the
    # inputs are [batch, heads, T, d] and, for the memory-efficient kernel (masks, float32), keys are not grouped
    if q.dim() == 3:
        return _sdpa(q[None], keys[None], values[None], divisor, blocked)[0]
    group = q.shape[-2] // keys.shape[-3]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    causal = blocked is not None and not compiling() and _causal(blocked)
    z = F.scaled_dot_product_attention(q.transpose(-3, -2), keys, values, scale=1.0 / divisor, is_causal=causal,
                                       attn_mask=None if blocked is None or causal else ~blocked)
    return z.transpose(-3, -2)

