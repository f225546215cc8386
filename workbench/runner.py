"""The forward pass: one implementation, read top to bottom, with a hook point at every named activation.

A hook point with nothing attached is a dictionary miss, so the run with no hooks is the production
forward on the quantized kernels of ``workbench.kernels``.
"""
from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from workbench.config import ModelConfig, YaRN
from workbench.errors import HookError, WorkbenchError
from workbench.kernels import QuantTensor, layer_ops, linear, linear_parts
from workbench.kernels import lora as lora_ops
from workbench.kernels.tracing import tracks_grad
from workbench.kv_cache import (BatchKVCache, KVCache, PrefixGroup, StaticBatchKVCache, StaticKVCache, causal_mask,
                                layer_devices, layer_shapes, to_device)
from workbench.moe import (DENSE_BRANCH_POINTS, EXPERTS_BRANCH_POINTS, MOE_POINTS, SHARED_POINTS, gemma4_router_input,
                           moe_mlp, with_moe_points)
from workbench.weights import ModelWeights


@dataclass(frozen=True)
class HookContext:
    """What a hook function knows about the activation it sees."""

    name: str
    layer: int | None
    positions: torch.Tensor  # absolute (rope) positions of the tokens in this forward, [T]
    step: int  # 0 for the prompt, then 1, 2, ... for each generated token
    prompt: int = 0  # which prompt of a batch this is (0 outside batches)
    layout: "BatchLayout | None" = None  # set only for a hook that sees a whole batch at once


class BatchLayout:
    """How the tokens of a batched forward are laid out.

    The sequences' new tokens are packed one after another, ``[N, ...]`` with no padding, so every matmul, norm and
    MLP sees exactly the real tokens. Only attention pads: queries, keys and values are gathered into ``[B, T_max,
    ...]`` (a zero row past each sequence's end), each sequence attends to its own keys alone, and padded slots are
    masked out (causally: a real token never reaches past its own sequence's end).

    ``prompts`` names each row's prompt (its index in the caller's list); ``cached`` is how many slots each row already
    holds in a :class:`BatchKVCache` (all zero without one); ``complete`` is False when later forwards continue the rows
    (a long prompt fed in chunks).
    """

    def __init__(self, lengths: Sequence[int], device: torch.device | str, prompts: Sequence[int] | None = None,
                 cached: Sequence[int] | None = None, complete: bool = True):
        self.complete = complete
        self.lengths = tuple(int(n) for n in lengths)
        self.prompts = tuple(prompts) if prompts is not None else tuple(range(len(self.lengths)))
        self.cached = tuple(cached) if cached is not None else (0,) * len(self.lengths)
        self.starts = tuple(itertools.accumulate(self.lengths, initial=0))[:-1]
        self.width = max(self.lengths)
        self.n_tokens = sum(self.lengths)
        self.device = torch.device(device)
        self.uniform = len(set(self.lengths)) == 1  # padding is then a reshape
        if not self.uniform:
            steps = torch.arange(self.width)
            length = torch.tensor(self.lengths)[:, None]
            start = torch.tensor(self.starts)[:, None]
            # [B, T_max] packed row of each (sequence, step); past a sequence's end, the zero row appended at N
            self.gather = to_device(torch.where(steps < length, start + steps, self.n_tokens), self.device)
            # [N] where each packed token sits in the flattened [B * T_max]
            self.scatter = to_device(torch.cat([b * self.width + torch.arange(n) for b, n in enumerate(self.lengths)]),
                                     self.device)
        self._on_device: dict[tuple[int, ...], torch.Tensor] = {}

    def to(self, device: torch.device | str) -> "BatchLayout":
        """The same layout with its index tensors on ``device`` (where a split model's next layer range runs)."""
        moved = copy.copy(self)
        moved.device = torch.device(device)
        moved._on_device = {}
        if not self.uniform:
            moved.gather, moved.scatter = self.gather.to(device), self.scatter.to(device)
        return moved

    @property
    def size(self) -> int:
        return len(self.lengths)

    def rows(self, b: int) -> slice:
        """Sequence ``b``'s tokens in the packed axis."""
        return slice(self.starts[b], self.starts[b] + self.lengths[b])

    def slots(self, b: int) -> int:
        """How many key slots sequence ``b``'s tokens attend over (cached plus new)."""
        return self.cached[b] + self.lengths[b]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[N, ...]`` to ``[B, T_max, ...]``, zeros past each sequence's end."""
        if self.uniform:
            return x.view(self.size, self.width, *x.shape[1:])
        return torch.cat((x, x.new_zeros(1, *x.shape[1:])))[self.gather]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T_max, ...]`` back to the packed ``[N, ...]``."""
        flat = x.reshape(self.size * self.width, *x.shape[2:])
        return flat if self.uniform else flat[self.scatter]

    @property
    def host_bounds(self) -> tuple[int, ...]:
        """Where each sequence's tokens start in the packed axis, and their total (``B + 1`` values)."""
        return (*self.starts, self.n_tokens)

    def bounds(self) -> torch.Tensor:
        """``host_bounds`` as a tensor ``[B + 1]`` on the device."""
        return self.on_device(self.host_bounds)

    def last_rows(self) -> torch.Tensor:
        """The packed index of each sequence's last token, ``[B]`` (the final norm and every hook on a last-rows
        activation read it)."""
        return self.on_device(tuple(s + n - 1 for s, n in zip(self.starts, self.lengths)))

    def on_device(self, values: tuple[int, ...]) -> torch.Tensor:
        """``values`` as a tensor on the layout's device, built once per layout: a decode step captured as a CUDA
        graph reads the tensors its warm-up made (a copy from the host made during the capture would read, at every
        replay, a host buffer freed after it)."""
        if values not in self._on_device:
            self._on_device[values] = to_device(torch.tensor(values, dtype=torch.long), self.device)
        return self._on_device[values]

    def host_positions(self, next_positions: Sequence[int] | None = None) -> list[int]:
        """Rope positions of the packed tokens, each sequence counting on from its own next position (0 without)."""
        starts = next_positions or (0,) * self.size
        return [p + j for p, n in zip(starts, self.lengths) for j in range(n)]

    def positions(self, next_positions: Sequence[int] | None = None) -> torch.Tensor:
        """``host_positions`` on the layout's device."""
        return to_device(torch.tensor(self.host_positions(next_positions)), self.device)


# The hook points after the last block (the final norm's and the logits'): a forward with a ``stop_at_layer`` never
# reaches them.
FINAL_POINTS = ("ln_final.hook_scale", "ln_final.hook_normalized", "hook_logits")
_FINAL_POINT_SET = frozenset(FINAL_POINTS)

HookFn = Callable[[torch.Tensor, HookContext], "torch.Tensor | None"]
Hooks = Mapping[str, Sequence[HookFn]]
# The LoRA adapters of a call (Model.lora_terms), per layer: {projections that share an input (LORA_GROUPS): (A, B^T,
# the adapted ones, their ranks)}, A the adapted projections' (and a mix's adapters') A rows stacked, B^T their
# (s * B)^T as blocks of a block-diagonal matrix: one pair of matmuls, or one fused call (kernels.lora), gives every
# adapted projection of the group its term ``s * B (A x)``.
Lora = Sequence[Mapping[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, tuple[str, ...], tuple[int, ...]]]]
LORA_GROUPS = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))
# a layer that reuses another's keys and values (Gemma 4 E2B/E4B) projects its queries alone
QUERY_ONLY_LORA_GROUPS = (("wq",), *LORA_GROUPS[1:])


@dataclass(frozen=True)
class LoraRows:
    """Adapters chosen per sequence of a batched forward: ``rows[b]`` the terms (``Lora``) of sequence b's choice, None
    for the base. The forward groups the sequences by choice (the same ``Lora`` object): each group's tokens take its
    terms in one pair of matmuls per group of projections."""

    rows: tuple[Lora | None, ...]

    def keep(self, rows: Sequence[int]) -> "LoraRows":
        """The choices of the sequences ``rows`` (a batch's cache rows kept, ``BatchKVCache.keep_rows``)."""
        return LoraRows(tuple(self.rows[b] for b in rows))


# A layer's adapter terms in one forward: (that layer's terms of one choice, the packed token rows taking them, or None
# for every token), one entry per choice.
LayerLora = Sequence[tuple[Mapping[tuple[str, ...], tuple], torch.Tensor | None]]


def lora_segments(lora: "Lora | LoraRows | None", layout: BatchLayout | None
                  ) -> list[tuple[Lora, torch.Tensor | None]]:
    """Each adapter choice of a forward with the packed token rows that take it (None: every token)."""
    if lora is None:
        return []
    if not isinstance(lora, LoraRows):
        return [(lora, None)]
    if layout is None or len(lora.rows) != layout.size:
        raise WorkbenchError(f"per-sequence adapters need a batch layout of {len(lora.rows)} sequences")
    groups: dict[int, tuple[Lora, list[int]]] = {}
    for b, terms in enumerate(lora.rows):
        if terms is not None:
            groups.setdefault(id(terms), (terms, []))[1].append(b)
    if len(groups) == 1 and len(next(iter(groups.values()))[1]) == layout.size:
        return [(next(iter(groups.values()))[0], None)]
    return [(terms, torch.cat([torch.arange(layout.starts[b], layout.starts[b] + layout.lengths[b]) for b in rows]
                              ).to(layout.device)) for terms, rows in groups.values()]


# Per-block hook points of a llama block and their shapes (T = tokens in this forward, S = all attended slots).
BLOCK_POINTS: dict[str, str] = {
    "hook_resid_pre": "[T, d_model]",
    "ln1.hook_scale": "[T, 1]",
    "ln1.hook_normalized": "[T, d_model]",
    "attn.hook_q": "[T, n_heads, d_head]",
    "attn.hook_k": "[T, n_kv_heads, d_head]",
    "attn.hook_v": "[T, n_kv_heads, d_head]",
    "attn.hook_rot_q": "[T, n_heads, d_head]",
    "attn.hook_rot_k": "[T, n_kv_heads, d_head]",
    "attn.hook_attn_scores": "[n_heads, T, S]",
    "attn.hook_pattern": "[n_heads, T, S]",
    "attn.hook_z": "[T, n_heads, d_head]",
    "attn.hook_result": "[T, n_heads, d_model]",
    "hook_attn_out": "[T, d_model]",
    "hook_resid_mid": "[T, d_model]",
    "ln2.hook_scale": "[T, 1]",
    "ln2.hook_normalized": "[T, d_model]",
    "mlp.hook_pre": "[T, d_mlp]",
    "mlp.hook_pre_linear": "[T, d_mlp]",
    "mlp.hook_post": "[T, d_mlp]",
    "hook_mlp_out": "[T, d_model]",
    "hook_resid_post": "[T, d_model]",
}
# Each adapted projection's LoRA term, fired only in a call with an adapter on that projection; listed apart from the
# block's points (globs match them only where they name them: see hooks.points).
LORA_POINTS: dict[str, str] = {
    "wq": "attn.hook_q_lora", "wk": "attn.hook_k_lora", "wv": "attn.hook_v_lora", "wo": "attn.hook_o_lora",
    "w_gate": "mlp.hook_gate_lora", "w_up": "mlp.hook_up_lora", "w_down": "mlp.hook_down_lora",
}
# The points of the parts other families add, after the point each follows in the forward (TransformerLens'
# TransformerBridge names: ln1_post/ln2_post for the norms after attention and the MLP, attn.q_norm/k_norm).
QK_NORM_POINTS: dict[str, str] = {
    "attn.q_norm.hook_scale": "[T, n_heads, 1]",
    "attn.q_norm.hook_normalized": "[T, n_heads, d_head]",
    "attn.k_norm.hook_scale": "[T, n_kv_heads, 1]",
    "attn.k_norm.hook_normalized": "[T, n_kv_heads, d_head]",
}
V_NORM_POINTS: dict[str, str] = {
    "attn.v_norm.hook_scale": "[T, n_kv_heads, 1]",
    "attn.v_norm.hook_normalized": "[T, n_kv_heads, d_head]",
}
POST_NORM_POINTS: dict[str, dict[str, str]] = {
    "attn.hook_result": {"ln1_post.hook_scale": "[T, 1]", "ln1_post.hook_normalized": "[T, d_model]"},
    "mlp.hook_post": {"ln2_post.hook_scale": "[T, 1]", "ln2_post.hook_normalized": "[T, d_model]"},
}
# Gemma 4 E2B/E4B: each block's slice of the per-layer inputs and what it adds to the stream, after hook_mlp_out
PER_LAYER_POINTS: dict[str, str] = {"per_layer.hook_input": "[T, d_per_layer]", "hook_per_layer_out": "[T, d_model]"}
# The points of a layer's own keys and values, which a layer reusing an earlier layer's does not have
KV_POINTS = ("attn.hook_k", "attn.hook_v", "attn.k_norm.hook_scale", "attn.k_norm.hook_normalized",
             "attn.v_norm.hook_scale", "attn.v_norm.hook_normalized", "attn.hook_rot_k")
GLOBAL_POINTS: dict[str, str] = {
    "hook_embed": "[T, d_model]",
    "ln_final.hook_scale": "[T, 1]",
    "ln_final.hook_normalized": "[T, d_model]",
    "hook_logits": "[T, vocab_size]",
}


@functools.lru_cache(maxsize=16)
def block_points(config: ModelConfig) -> dict[str, str]:
    """The hook points of one block of ``config``'s family, in the order the forward reaches them, with shapes."""
    family = config.arch
    points: dict[str, str] = {}
    for name, shape in BLOCK_POINTS.items():
        if name.startswith(("ln1.", "ln2.")) and not family.pre_norms:
            continue
        if name == "attn.hook_rot_q" and family.qk_norm:
            points.update(QK_NORM_POINTS)
        if name == "attn.hook_rot_q" and family.v_norm:
            points.update(V_NORM_POINTS)
        points[name] = shape
        if family.post_norms:
            points.update(POST_NORM_POINTS.get(name, {}))
        if name == "hook_mlp_out" and config.d_per_layer:
            points.update(PER_LAYER_POINTS)
    if family.qk_norm == "projection":  # one scale per token over all heads
        points["attn.q_norm.hook_scale"] = points["attn.k_norm.hook_scale"] = "[T, 1, 1]"
    return with_moe_points(points, config.moe)


@functools.lru_cache(maxsize=16)
def hook_point_names(config: ModelConfig) -> tuple[str, ...]:
    """Every hook point in the order the forward reaches them (built once per config: every intervention resolves its
    hook name against them)."""
    blocks = [f"blocks.{i}.{p}" for i in range(config.n_layers) for p in block_points(config)
              if config.kv_source(i) == i or p not in KV_POINTS]
    return ("hook_embed", *blocks, *FINAL_POINTS)


class _Points:
    """Fires hooks; built once per forward so each point costs one dictionary lookup."""

    def __init__(self, hooks: Hooks | None, positions: torch.Tensor, step: int, layout: BatchLayout | None = None):
        self.hooks = hooks or {}
        self.positions = positions
        self.step = step
        self.layout = layout

    def wants(self, name: str) -> bool:
        return name in self.hooks

    def wants_any(self, names: frozenset[str]) -> bool:
        return bool(self.hooks) and not self.hooks.keys().isdisjoint(names)

    def __call__(self, name: str, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        fns = self.hooks.get(name)
        if not fns:
            return x
        return run_hooks(fns, x, HookContext(name, layer, self.positions, self.step, layout=self.layout))


def edits_only(hooks: Hooks | None) -> bool:
    """Whether every hook function only edits its activation and keeps no tensor of the forward (marked
    ``edits_only``, as the interventions' are): a forward whose tensors nothing outside it holds may run under
    ``torch.inference_mode``, which skips autograd's bookkeeping on every op, but whose tensors a later autograd run
    could not take."""
    return all(getattr(fn, "edits_only", False) for fns in (hooks or {}).values() for fn in fns)


def capturable(hooks: Hooks | None) -> bool:
    """Whether every hook function is marked ``capturable``: on a batched decode step of one token per row, it edits
    its activation on the device alone, the same way at every step (it reads neither the step nor anything on the
    host, and builds no tensor from the host), so a CUDA graph of the step holds it (``generation``)."""
    return all(getattr(fn, "capturable", False) for fns in (hooks or {}).values() for fn in fns)


def run_hooks(fns: Sequence[HookFn], x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """``x`` through hook functions in order: each may return a replacement of the same shape (cast to ``x``'s dtype)
    or None; ``x`` itself is returned when none replaces it."""
    for fn in fns:
        if tracks_grad(x):  # autograd may have kept x for the backward (softmax's output, the pattern): edit a copy
            x = x.clone()
        out = fn(x, ctx)
        if out is not None:
            if out.shape != x.shape:
                raise HookError(f"hook on {ctx.name} returned shape {tuple(out.shape)}, expected {tuple(x.shape)}")
            x = out.to(x.dtype)
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, point: _Points, names: tuple[str, str],
             layer: int | None) -> torch.Tensor:
    """RMSNorm with TransformerLens' two hook points: the scale (TransformerLens' divisor ``sqrt(mean(x^2) + eps)``),
    and the normalized input before the weight. With a hook on either, the products after it are taken from what
    the hooks return; they round as the norm's own do, so a hook that returns its input changes no bit. A family
    without this norm passes no ``weight``: the stream goes on as it is."""
    if weight is None:
        return x
    return _norm_points(x, *layer_ops.rms_norm(x, weight, eps), weight, point, names, layer)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float, point: _Points,
                 stream_points: Sequence[tuple[str, int]], names: tuple[str, str],
                 layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``x + delta`` through its hook points (``(name, layer)`` each), and ``rms_norm`` of it. With
    none of those points hooked, the sum and the norm are one call (``layer_ops.add_rms_norm``), with the same bits.
    ``delta`` None: ``x`` is the stream already."""
    if delta is None or weight is None or any(point.wants(name) for name, _ in stream_points):
        x = x if delta is None else x + delta
        for name, at in stream_points:
            x = point(name, x, at)
        return x, rms_norm(x, weight, eps, point, names, layer)
    x, scale, out = layer_ops.add_rms_norm(x, delta, weight, eps)
    return x, _norm_points(x, scale, out, weight, point, names, layer)


def _norm_points(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, point: _Points,
                 names: tuple[str, str], layer: int | None) -> torch.Tensor:
    if not (point.wants(names[0]) or point.wants(names[1])):
        return out
    if point.wants(names[0]):
        # hooks see TransformerLens' divisor; the norm keeps its own multiplier unless they change the divisor
        divisor = 1.0 / scale
        edited = point(names[0], divisor, layer)
        if edited is not divisor:
            if not torch.equal(edited, divisor):
                scale = 1.0 / edited
            elif edited.requires_grad:  # a gradient run's tap: the multiplier's bits, the divisor's gradient
                reciprocal = 1.0 / edited
                scale = scale.detach() + (reciprocal - reciprocal.detach())
    normalized = point(names[1], x * scale, layer)
    return normalized * weight


def _to(device: torch.device, *values):
    """Each of ``values`` (a tensor, a tuple of tensors, or None) on ``device``."""
    return [v.to(device) if isinstance(v, torch.Tensor) else tuple(t.to(device) for t in v) if isinstance(v, tuple)
            else v for v in values]


def project(x: torch.Tensor, stacked: QuantTensor | None, parts: Sequence[QuantTensor]) -> list[torch.Tensor]:
    """``x`` through each of ``parts``: one matmul over their ``stacked`` rows when they were fused, else one
    kernel call for all of them where the kernel takes several weights (``linear_parts``)."""
    if stacked is None:
        return linear_parts(x, parts)
    return list(linear(x, stacked).split_with_sizes([w.shape[0] for w in parts], dim=-1))


def project_adapted(x: torch.Tensor, stacked: QuantTensor | None, weights: Sequence[QuantTensor],
                    parts: tuple[str, ...], lora: LayerLora, point: _Points, names: Mapping[str, str],
                    layer: int) -> Sequence[torch.Tensor]:
    """``project``, then ``add_lora``; where one choice covers every token and no hook asks for a term, the base's
    own kernel may add the terms (``kernels.lora.linear_with_terms``: the CUDA GEMV, decode)."""
    shared = _unhooked_terms(parts, lora, point, names) if lora else None
    if shared is not None:
        a, b_t, adapted, ranks = shared
        part_ranks = [ranks[adapted.index(p)] if p in adapted else 0 for p in parts]
        outs = lora_ops.linear_with_terms(x, stacked, weights, a, b_t, part_ranks)
        if outs is not None:
            return outs
    outs = project(x, stacked, weights)
    return add_lora(x, outs, parts, lora, point, names, layer) if lora else outs


def _unhooked_terms(parts: tuple[str, ...], lora: LayerLora, point: _Points, names: Mapping[str, str]
                    ) -> tuple | None:
    """The group's terms ``(a, b_t, adapted, ranks)`` where one adapter choice covers every token and no hook asks for
    an adapted projection's term, so that they may be added without being held apart; else None."""
    if len(lora) != 1 or lora[0][1] is not None or parts not in lora[0][0]:
        return None
    terms = lora[0][0][parts]
    return None if any(point.wants(names[p]) for p in terms[2]) else terms


def add_lora(x: torch.Tensor, outs: Sequence[torch.Tensor], parts: tuple[str, ...], lora: LayerLora,
             point: _Points, names: Mapping[str, str], layer: int) -> Sequence[torch.Tensor]:
    """The outputs ``outs`` of projections ``parts`` of ``x``, each adapted one plus its LoRA term ``s * B (A x)``
    (through the term's hook point, ``[T, out]``: zero on the tokens whose choice leaves the projection alone). Where
    one choice covers every token and no hook asks for a term, the terms are never held apart: ``kernels.lora`` adds
    them in one call per group (one fused kernel for few rows)."""
    shared = _unhooked_terms(parts, lora, point, names)
    if shared is not None:
        a, b_t, adapted, ranks = shared
        if adapted == parts:
            return lora_ops.add_terms(x, a, b_t, outs, ranks)
        added = iter(lora_ops.add_terms(x, a, b_t, [outs[parts.index(p)] for p in adapted], ranks))
        return [next(added) if p in adapted else out for p, out in zip(parts, outs)]
    added: dict[str, torch.Tensor] = {}
    for terms, rows in lora:
        if parts not in terms:
            continue
        a, b_t, adapted, ranks = terms[parts]
        rows = rows if rows is None else rows.to(x.device)  # a no-op but where a split model moved the layer
        x_rows = x if rows is None else x.index_select(0, rows)
        widths = [outs[parts.index(p)].shape[-1] for p in adapted]
        # one choice for every token: the terms the unhooked forward's add_terms adds, bit for bit
        products = (lora_ops.terms(x, a, b_t, widths, ranks) if rows is None
                    else lora_ops.torch_terms(x_rows, a, b_t).split(widths, dim=-1))
        for p, product in zip(adapted, products):
            if rows is None:  # the one choice of every token
                added[p] = product
                continue
            if p not in added:
                added[p] = product.new_zeros(x.shape[0], product.shape[-1])
            added[p].index_copy_(0, rows, product)
    outs = list(outs)
    for j, p in enumerate(parts):
        if p in added:
            outs[j] = outs[j] + point(names[p], added[p], layer)
    return outs


def hf_head_order(x: torch.Tensor) -> torch.Tensor:
    """Each head's values ``[..., d_head]`` from llama.cpp's order for adjacent-pair rope (its converter interleaves
    each head's two halves) to Hugging Face's and TransformerLens' (the halves apart)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def gguf_head_order(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``hf_head_order``."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


class Transformer:
    """A decoder of any family of ``workbench.architectures`` (llama, Qwen2/3, Gemma 2/3, Phi-3, OLMo 2, the
    mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS) over quantized weights: llama's block, with each family's
    differences where its description switches them on."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, fuse_projections: bool | None = None,
                 split: Sequence[tuple[str | torch.device, int]] | None = None):
        """``fuse_projections`` (default: on CUDA) stacks q/k/v and gate/up into one matrix each, so decode
        runs fewer, larger GEMVs; on CPU the weights stay the file's own memory-mapped bytes (the CPU kernels
        take q/k/v, and gate/up, in one call without stacking them).

        ``split`` runs the layers in contiguous ranges, ``(device, n_layers)`` each in order (``device`` is then
        unused): each layer's weights and cache live on its range's device, the embedding on the first, the final norm
        and the unembedding on the last, and the forward hands the residual stream from one range to the next."""
        self.config = config
        self.arch = config.arch
        split = [(torch.device(d), n) for d, n in split] if split else [(torch.device(device), config.n_layers)]
        self.devices = [d for d, n in split for _ in range(n)]  # each layer's
        # the layers where a range starts: the forward hands its stream over there (even between two "cpu" ranges,
        # so that a split over CPU devices runs the same code as one over GPUs)
        self.range_starts = frozenset(itertools.accumulate(n for _, n in split[:-1]))
        self.device, self.output_device = self.devices[0], self.devices[-1]
        self.dtype = dtype
        self.weights = weights.placed(self.devices, dtype)
        # the unembedding where the logits are computed (a copy of a tied embedding that lives on another device)
        unembed = self.weights.unembed
        self.unembed = unembed if unembed.device == self.output_device else unembed.to(self.output_device)
        if fuse_projections if fuse_projections is not None else self.device.type == "cuda":
            for layer in self.weights.layers:
                layer.fuse_projections()
        c = config
        self._heads = [c.layer_heads(i) for i in range(c.n_layers)]  # each layer's (n_kv_heads, d_head)
        self._kv_reused = {c.kv_source(i) for i in range(c.n_layers) if c.kv_source(i) != i}
        # the global layers' table; sliding layers with a rope base or head size of their own (Gemma 3, Gemma 4) take
        # a second one
        global_rotary = c.d_rotary or (c.d_head_global or c.d_head)
        self.rope_cos, self.rope_sin = self._rope_table(c.rope_base, c.rope_scale, weights.rope_freq_factors,
                                                        global_rotary, c.rope_yarn, weights.rope_long_factors)
        self.local_rope = None
        local_rotary = c.d_rotary or c.d_head
        # each table's (base, scale, frequency factors, rotary dims), for llama.cpp numerics' own tables (not YaRN's:
        # those keep the table above)
        self._rope_params = ({} if c.rope_yarn is not None or c.rope_long is not None else
                             {False: (c.rope_base, c.rope_scale, weights.rope_freq_factors, global_rotary)})
        if c.sliding_window and (c.rope_base_local is not None or local_rotary != global_rotary):
            local = ((c.rope_base_local, 1.0, None) if c.rope_base_local is not None
                     else (c.rope_base, c.rope_scale, weights.rope_freq_factors))
            # a rope base of their own also leaves the global table's YaRN or LongRoPE out (OLMo 3's sliding layers)
            scaled_global = c.rope_yarn is not None or c.rope_long is not None
            if (c.rope_base_local is not None and scaled_global
                    or (*local[:2], local_rotary) != (c.rope_base, c.rope_scale, global_rotary)):
                self.local_rope = self._rope_table(*local, local_rotary)
                self._rope_params[True] = (*local, local_rotary)
        self._llamacpp_rope: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # ggml's tables, built on first use
        self.attn_scale = c.attn_scale or math.sqrt(c.d_head)
        self.embed_scale = math.sqrt(c.d_model) if self.arch.embed_scale else None
        self._sliding = [c.is_sliding(i) for i in range(c.n_layers)]
        self._names = [self._block_names(i, last=i + 1 == c.n_layers) for i in range(c.n_layers)]
        layers = self.weights.layers
        # the layers whose attention is a plain softmax over their own keys: layer_ops.packed_attention may run a
        # batch's without a cache
        self._packed_attention = [layer.wk is not None and not c.attn_softcap and layer.sinks is None
                                  and i not in self._kv_reused for i, layer in enumerate(layers)]
        # of those, the ones whose attention is llama's (Qwen2's biases and Qwen3's norms of each head of q and k
        # included): layer_ops.rope_attention may run it
        self._plain_attention = [own and self.arch.qk_norm in (None, "head") and layer.v_norm is None
                                 for own, layer in zip(self._packed_attention, layers)]
        # of those, the blocks of llama's form in formats the C++ kernels read (a merged adapter keeps each matrix's
        # format), which layer_ops.blocks_exact may run whole where no hook lies inside
        self._plain_block = [own and layer.bo is None and not self.arch.post_norms and layer.moe is None
                             and self.arch.activation != "gelu_tanh" and layer.per_layer_gate is None
                             and layer.out_scale is None and layer.attn_norm is not None
                             and layer.mlp_norm is not None and layer.wqkv is None and layer.w_gate_up is None
                             and layer_ops.readable(layer.block_weights())
                             for own, layer in zip(self._plain_attention, layers)]

    def _rope_table(self, base: float, scale: float, freq_factors: torch.Tensor | None, d_rotary: int,
                    yarn: YaRN | None = None, long_factors: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's rope angles, ``[n_ctx, d_rotary / 2]`` each, taken in float64 once: a
        forward gathers its rows instead of evaluating float64 trig in every layer's kernels. With ``long_factors``
        (LongRoPE), the positions from the original context on divide by those instead of ``freq_factors``."""
        exponents = torch.arange(0, d_rotary, 2, dtype=torch.float64) / d_rotary
        inv_freq = 1.0 / (base**exponents) / scale
        unscaled = inv_freq
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double().cpu()
        magnitude = 1.0
        positions = torch.arange(self.config.n_ctx, dtype=torch.float64)[:, None]
        if long_factors is not None:
            long_rope = self.config.rope_long
            inv_freq = torch.where(positions < long_rope.original_context, inv_freq,
                                   unscaled / long_factors.double().cpu())
            magnitude = long_rope.attn_factor
        if yarn is not None:  # each frequency between interpolated and as trained, along a ramp over the dimensions
            def dim(rotations: float) -> float:  # the dimension whose wavelength fits ``rotations`` in the context
                turns = yarn.original_context / (rotations * 2 * math.pi)
                return d_rotary * math.log(turns) / (2 * math.log(base))

            low, high = dim(yarn.beta_fast), dim(yarn.beta_slow)
            if yarn.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, d_rotary - 1)
            ramp = ((torch.arange(d_rotary // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
            inv_freq = inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)
            magnitude = yarn.mscale
        angles = positions * inv_freq
        cos, sin = angles.cos() * magnitude, angles.sin() * magnitude
        return cos.to(torch.float32).to(self.device), sin.to(torch.float32).to(self.device)

    def _llamacpp_rope_table(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope table (global, or the sliding layers' ``local`` one) with ggml's own angles and cos/sin, for
        llama.cpp numerics."""
        if local not in self._llamacpp_rope:
            base, scale, factors, rotary = self._rope_params[local]
            cos, sin = layer_ops.llamacpp_ops.rope_table(self.config.n_ctx, rotary, base, scale,
                                                        None if factors is None else factors.cpu())
            self._llamacpp_rope[local] = cos.to(self.device), sin.to(self.device)
        return self._llamacpp_rope[local]

    @staticmethod
    def _block_names(i: int, last: bool) -> dict:
        points = [*BLOCK_POINTS, *QK_NORM_POINTS, *V_NORM_POINTS,
                  *(p for extra in POST_NORM_POINTS.values() for p in extra), *MOE_POINTS, *SHARED_POINTS,
                  *DENSE_BRANCH_POINTS, *EXPERTS_BRANCH_POINTS, *PER_LAYER_POINTS]
        names: dict = {p: f"blocks.{i}.{p}" for p in points}
        for norm in ("ln1", "ln2", "ln1_post", "ln2_post", "attn.q_norm", "attn.k_norm", "attn.v_norm", "ln2_experts"):
            names[norm] = (names[f"{norm}.hook_scale"], names[f"{norm}.hook_normalized"])
        # the residual stream's points between each sum and the norm after it (``add_rms_norm``)
        names["after_attn"] = ((names["hook_resid_mid"], i),)
        # the points between attention's projections and z (layer_ops.rope_attention skips them)
        names["inside_attention"] = frozenset(names[p] for p in (
            "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_attn_scores",
            "attn.hook_pattern", *(f"attn.{n}_norm.hook_{p}" for n in "qk" for p in ("scale", "normalized"))))
        names["scores_and_pattern"] = frozenset(names[p] for p in ("attn.hook_attn_scores", "attn.hook_pattern"))
        names["rotated_to_pattern"] = names["scores_and_pattern"] | {names["attn.hook_rot_q"], names["attn.hook_rot_k"]}
        names["lora"] = {part: f"blocks.{i}.{p}" for part, p in LORA_POINTS.items()}
        # the points of the block after its first norm and before its output (layer_ops.blocks_exact skips them)
        names["inside_block"] = frozenset(name for p, name in names.items() if isinstance(name, str) and p not in (
            "hook_resid_pre", "hook_resid_post", "ln1.hook_scale", "ln1.hook_normalized"))
        if not last:  # the last block's output goes to the final norm, with no next block's resid_pre between them
            names["after_mlp"] = ((names["hook_resid_post"], i), (f"blocks.{i + 1}.hook_resid_pre", i + 1))
            # the points between this block and the next one's first norm (layer_ops.blocks_exact skips them)
            names["between_blocks"] = frozenset({names["hook_resid_post"], f"blocks.{i + 1}.hook_resid_pre",
                                                 f"blocks.{i + 1}.ln1.hook_scale", f"blocks.{i + 1}.ln1.hook_normalized"})
        return names

    def _cache_heads(self) -> tuple:
        """The caches' ``(n_kv_heads, d_head)``: one pair, or a list of each per layer where layers differ."""
        c = self.config
        if not c.heads_vary:
            return c.n_kv_heads, c.d_head
        return [h for h, _ in self._heads], [d for _, d in self._heads]

    def _kv_sources(self) -> list[int]:
        return [self.config.kv_source(i) for i in range(self.config.n_layers)]

    def new_cache(self, capacity: int = 64) -> KVCache:
        return KVCache(self.config.n_layers, *self._cache_heads(), self.dtype, self.devices, capacity,
                       self._kv_sources())

    def check_cache(self, cache: object) -> None:
        """A single-sequence cache of this model (``new_cache``), or a clear error before any compute: a cache of
        another model would fail mid-forward, or be read past its layers, after some layers had grown it."""
        if not isinstance(cache, KVCache):
            raise WorkbenchError(f"cache must be a KVCache of this model (model.new_cache()), got "
                                 f"{type(cache).__name__}")
        n = self.config.n_layers
        if cache.n_layers != n:
            raise WorkbenchError(f"the cache belongs to another model: {cache.n_layers} layers, this model has {n}")
        theirs = layer_shapes(n, cache.n_kv_heads, cache.d_head)
        for i, (shape, mine) in enumerate(zip(theirs, layer_shapes(n, *self._cache_heads()))):
            if tuple(shape) != tuple(mine):
                raise WorkbenchError(f"the cache belongs to another model: layer {i} holds {shape[0]} kv heads of size "
                                     f"{shape[1]}, this model's {mine[0]} of size {mine[1]}")
        if tuple(cache.kv_sources) != tuple(self._kv_sources()):
            raise WorkbenchError("the cache belongs to another model: its layers share keys and values otherwise "
                                 "(kv_sources)")
        if cache.dtype != self.dtype:
            raise WorkbenchError(f"the cache holds {cache.dtype}, this model computes in {self.dtype}")
        for i, (theirs_at, mine_at) in enumerate(zip(cache.devices, layer_devices(self.devices, n))):
            if theirs_at != mine_at:
                raise WorkbenchError(f"the cache's layer {i} is on {theirs_at}, this model's on {mine_at}")

    def new_batch_cache(self, n_rows: int, capacity: int = 64) -> BatchKVCache:
        return BatchKVCache(n_rows, self.config.n_layers, *self._cache_heads(), self.dtype, self.devices, capacity,
                            self._kv_sources())

    @property
    def is_split(self) -> bool:
        return bool(self.range_starts)

    def point_device(self, name: str) -> torch.device:
        """The device a hook point's activation lives on: its layer's (the embedding's is the first layer's, the
        final norm's and the logits' the last's)."""
        if name.startswith("blocks."):
            return self.devices[int(name.split(".")[1])]
        return self.device if name == "hook_embed" else self.output_device

    def stop_after(self, names: Sequence[str]) -> int | None:
        """The ``stop_at_layer`` of a forward that only has to reach these hook points: the block after the deepest
        one they lie in. None where one lies after the last block (the final norm's, the logits'): the whole forward."""
        last = 0
        for name in names:
            if name.startswith("blocks."):
                last = max(last, int(name.split(".")[1]))
            elif name.split(".")[0] != "hook_embed":
                return None
        return last + 1

    def prefill_prefixes(self, rows: Sequence[Sequence[int]], groups: Sequence[PrefixGroup], capacity: int,
                         hooks: Hooks | None = None, last_logits_only: bool = False, lora: Lora | None = None,
                         stop_at_layer: int | None = None) -> tuple[BatchKVCache, torch.Tensor]:
        """The forward of each group's shared prefix (``kv_cache.prefix_groups``), once for all its rows: a
        BatchKVCache of one row per row of ``rows`` (room for ``capacity`` slots a row), a grouped row's holding its
        prefix's keys and values and the others empty, and the prefixes' logits packed as a batch of the prefixes
        (with ``stop_at_layer``, their residual stream entering that block, as ``forward`` gives it).
        Hooks see group ``g`` as prompt ``-1 - g``."""
        prefixes = [list(rows[group.rows[0]][:group.length]) for group in groups]
        cache = self.new_batch_cache(len(prefixes), max(map(len, prefixes)))
        layout = BatchLayout([len(p) for p in prefixes], self.device, prompts=[-1 - g for g in range(len(groups))])
        logits = self.forward(torch.tensor([t for p in prefixes for t in p], dtype=torch.long), cache=cache,
                              hooks=hooks, layout=layout, last_logits_only=last_logits_only, lora=lora,
                              stop_at_layer=stop_at_layer)
        source: list[int | None] = [None] * len(rows)
        for g, group in enumerate(groups):
            for r in group.rows:
                source[r] = g
        return cache.spread(source, capacity), logits

    def new_static_cache(self, capacity: int) -> StaticKVCache:
        c = self.config
        if not 0 < capacity <= c.n_ctx:
            raise WorkbenchError(f"a static cache holds 1 to {c.n_ctx} (the model's context) slots, not {capacity}")
        return StaticKVCache(c.n_layers, *self._cache_heads(), self.dtype, self.devices, capacity, self._kv_sources())

    def rotation(self, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors ``rope`` multiplies by, ``[T, 1, d_rotary]`` each, laid out as the pairs it rotates: cos of the
        pair's angle at both of its values, and sin with the sign each value's partner takes (-sin at the first).
        ``table``: another rope table than the global layers' (``local_rope``)."""
        cos, sin = table if table is not None else (self.rope_cos, self.rope_sin)
        if layer_ops.llamacpp_glue(cos) and (table is not None) in self._rope_params:
            cos, sin = self._llamacpp_rope_table(local=table is not None)
        cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
        if self.config.rope_interleaved:
            return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def rope(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate each pair of ``[T, heads, d_head]`` (adjacent values, or for "neox" the two halves of each head):
        ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)`` in float32. With partial rotary, only the first
        ``d_rotary`` values of each head turn (their halves paired), the rest pass through."""
        d_rotary = rotation[0].shape[-1]
        if d_rotary < x.shape[-1]:
            turned = layer_ops.rope(x[..., :d_rotary], *rotation, self.config.rope_interleaved)
            return torch.cat((turned, x[..., d_rotary:]), dim=-1)
        return layer_ops.rope(x, *rotation, self.config.rope_interleaved)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, hooks: Hooks | None = None,
                last_logits_only: bool = False, step: int = 0, layout: BatchLayout | None = None,
                lora: Lora | LoraRows | None = None, start_at_layer: int = 0,
                resid: torch.Tensor | None = None, stop_at_layer: int | None = None,
                logit_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` (``[1, vocab]`` with ``last_logits_only``) for token ids ``[T]``.

        With a cache, the tokens continue it: they attend to every cached slot and are appended to it.
        With a ``layout``, ``ids`` are the packed tokens of a batch of sequences: the logits are packed alike (each
        sequence's last row alone with ``last_logits_only``, ``[B, vocab]``) and a cache is a ``BatchKVCache``.
        ``lora``: the adapters' terms to add to the projections (None: the base model), or with a ``layout`` a choice
        per sequence (``LoraRows``).

        ``start_at_layer`` (TransformerLens' name): the forward starts at that block, from ``resid``, the residual
        stream entering it (``[T, d_model]``, packed as ``ids``); the embedding and the blocks before it do not run,
        and a cache's layers before it are left as they are (``can_start_at_layer`` says where a forward may start).
        ``stop_at_layer``: the forward stops before that block and returns the residual stream entering it (``[T,
        d_model]``, packed), for a later forward to start from; a cache's layers from it on are left as they are.
        ``n_layers`` stops after the last block, before the final norm (no logits).
        ``logit_ids``: the logits of these vocabulary ids alone (``[T, len(logit_ids)]``, as ``hook_logits`` sees them),
        for a caller that reads no others: the unembedding multiplies only their rows.
        """
        c, w = self.config, self.weights
        fed = ids  # what a cache records: the caller's tensor, on the host when the caller's was
        ids = to_device(ids, self.device)
        segments = lora_segments(lora, layout)
        positions, blocked = self._positions(ids.shape[0], cache, layout)
        rotation = local_rotation = self.rotation(positions)
        local_blocked = blocked
        if c.sliding_window:  # sliding layers also mask the slots past the window, and may rotate by their own base
            local_blocked = self._sliding_mask(positions, blocked, cache, layout)
            if self.local_rope is not None:
                local_rotation = self.rotation(positions, self.local_rope)
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # keys and values later layers reuse

        first, stop = start_at_layer, c.n_layers if stop_at_layer is None else stop_at_layer
        if stop_at_layer is not None and not first < stop <= c.n_layers:
            raise WorkbenchError(f"a forward stops at a layer after the one it starts at ({first}) and at most "
                                 f"{c.n_layers}, not {stop_at_layer}")
        if first or resid is not None:
            self._check_start(first, resid, ids.shape[0])
            device = self.devices[first]  # a split model's block may run on another device than the embedding
            x, positions, rotation, blocked, local_rotation, local_blocked = _to(
                device, resid.to(self.dtype), positions, rotation, blocked, local_rotation, local_blocked)
            layout = layout.to(device) if layout is not None and device != self.device else layout
            point, per_layer = _Points(hooks, positions, step, layout), None
        else:
            point = _Points(hooks, positions, step, layout)
            x = w.embed.dequantize_rows(ids).to(self.dtype)
            if self.embed_scale is not None:
                x = x * self.embed_scale
            x = point("hook_embed", x)
            per_layer = self._per_layer_inputs(ids, x) if w.per_layer_embed is not None else None
        x = point(self._names[first]["hook_resid_pre"], x, first)
        normalized = rms_norm(x, w.layers[first].attn_norm, c.rms_eps, point, self._names[first]["ln1"], first)
        # Each residual sum comes with the norm after it (the next block's ln1 after resid_post), so that where no
        # hook sits between them the two are one call.
        # whether layer_ops.blocks_exact declines this forward's inputs (it does for every block or none)
        i, whole_declined = first, not layer_ops.blocks_exact_may_run(x, normalized, rotation[0])
        while i < stop:
            layer, names = w.layers[i], self._names[i]
            run = 0 if whole_declined else self._whole_run(i, stop, point, segments, cache)
            whole = (self._whole_blocks(x, normalized, i, run, rotation, blocked, local_rotation, local_blocked, cache,
                                        layout) if run else None)
            whole_declined = whole_declined or (run > 0 and whole is None)
            if whole is not None:  # blocks i .. i + run - 1 in one call, with the bits of the steps below
                (x, mlp_out), i = whole, i + run - 1
                layer, names = w.layers[i], self._names[i]
            else:
                adapter = [(terms[i], rows) for terms, rows in segments if terms[i]]
                layer_rotation, layer_blocked = ((local_rotation, local_blocked) if self._sliding[i]
                                                 else (rotation, blocked))
                attn_out = self.attention(normalized, layer, i, layer_rotation, layer_blocked, cache, point, layout,
                                          adapter, shared_kv)
                if self.arch.post_norms:
                    attn_out = rms_norm(attn_out, layer.attn_post_norm, c.rms_eps, point, names["ln1_post"], i)
                attn_out = point(names["hook_attn_out"], attn_out, i)
                x, normalized = add_rms_norm(x, attn_out, layer.mlp_norm, c.rms_eps, point, names["after_attn"],
                                             names["ln2"], i)
                mlp_out = self.mlp(normalized, layer, i, point, adapter, resid=x)
                if self.arch.post_norms:
                    mlp_out = rms_norm(mlp_out, layer.mlp_post_norm, c.rms_eps, point, names["ln2_post"], i)
                mlp_out = point(names["hook_mlp_out"], mlp_out, i)
            if layer.per_layer_gate is not None or layer.out_scale is not None:  # Gemma 4: the sum is taken here
                x, mlp_out = self._block_tail(x + mlp_out, layer, i, point, per_layer), None
            i += 1
            if i < stop and i not in self.range_starts:
                x, normalized = add_rms_norm(x, mlp_out, w.layers[i].attn_norm, c.rms_eps, point, names["after_mlp"],
                                             self._names[i]["ln1"], i)
                continue
            x = point(names["hook_resid_post"], x if mlp_out is None else x + mlp_out, i - 1)
            if i < stop:  # the next range's device takes the residual stream and what every layer reads
                device = self.devices[i]
                x, positions, rotation, blocked, local_rotation, local_blocked, per_layer = _to(
                    device, x, positions, rotation, blocked, local_rotation, local_blocked, per_layer)
                shared_kv = {j: _to(device, *kv) for j, kv in shared_kv.items()}
                layout = layout.to(device) if layout is not None else None
                point = _Points(hooks, positions, step, layout)
                x = point(self._names[i]["hook_resid_pre"], x, i)
                normalized = rms_norm(x, w.layers[i].attn_norm, c.rms_eps, point, self._names[i]["ln1"], i)

        if stop_at_layer is None:
            x = self._logits(x, point, layout, last_logits_only, logit_ids)
        if cache is not None:
            cache.commit(fed)
        return x

    def _whole_run(self, i: int, stop: int, point: _Points, segments: list, cache: KVCache | None) -> int:
        """How many blocks from block ``i`` on (before ``stop``) may run as one call (``layer_ops.blocks_exact``):
        plain blocks of one device (of formats the call reads), without an adapter's terms, whose cache layers take the
        op's writes, with no hook inside them nor between two of them (a hook on the first one's input or first norm,
        or the last one's output, keeps them). 0 where block ``i`` may not."""
        n = 0
        while (i + n < stop and self._plain_block[i + n] and not point.wants_any(self._names[i + n]["inside_block"])
               and not any(terms[i + n] for terms, _ in segments)
               and (cache is None or cache.buffers(i + n) is not None)):
            n += 1
            if (i + n == stop or i + n in self.range_starts
                    or point.wants_any(self._names[i + n - 1]["between_blocks"])):
                break
        return n

    def _whole_blocks(self, x: torch.Tensor, normalized: torch.Tensor, i: int, n: int,
                      rotation: tuple[torch.Tensor, torch.Tensor], blocked: torch.Tensor | None,
                      local_rotation: tuple[torch.Tensor, torch.Tensor], local_blocked: torch.Tensor | None,
                      cache: KVCache | None, layout: BatchLayout | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Blocks ``i`` .. ``i + n - 1`` as one call (``layer_ops.blocks_exact``): the last one's stream after attention
        and its MLP's output; None where that call does not run."""
        c, span = self.config, range(i, i + n)
        blocks = [layer_ops.PlainBlock(
            layer.attn_norm, layer.block_weights(), (layer.bq, layer.bk, layer.bv) if c.qkv_bias else (),
            (layer.q_norm, layer.k_norm) if c.qk_norm else (), layer.mlp_norm) for layer in self.weights.layers[i:i + n]]
        return layer_ops.blocks_exact(
            x, normalized, blocks, c.rms_eps, c.n_heads,
            [local_rotation if self._sliding[j] else rotation for j in span], c.rope_interleaved,
            None if cache is None else [cache.buffers(j) for j in span], self.attn_scale,
            [local_blocked if self._sliding[j] else blocked for j in span],
            None if layout is None else layout.host_bounds)

    def _logits(self, x: torch.Tensor, point: _Points, layout: BatchLayout | None, last_logits_only: bool,
                logit_ids: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits of the residual stream after the last block (each sequence's last row alone with
        ``last_logits_only``; the ids ``logit_ids`` alone)."""
        c = self.config
        # a hook on the final norm or the logits sees every row, as in a whole run: the last rows are taken after it
        hooked = last_logits_only and point.wants_any(_FINAL_POINT_SET)
        if last_logits_only and not hooked:
            x = x[-1:] if layout is None else x[layout.last_rows()]
        scale_name, normalized_name, logits_name = FINAL_POINTS
        x = rms_norm(x, self.weights.final_norm, c.rms_eps, point, (scale_name, normalized_name), None)
        logits = linear(x, self.unembed if logit_ids is None else self.unembed.select_rows(logit_ids)).float()
        if c.final_softcap:
            logits = layer_ops.soft_cap(logits, c.final_softcap)
        logits = point(logits_name, logits)
        if hooked:
            logits = logits[-1:] if layout is None else logits[layout.last_rows()]
        return logits

    def can_start_at_layer(self, layer: int) -> bool:
        """Whether a forward can start at block ``layer`` from its residual stream: not where a later block reads the
        keys and values of an earlier one (Gemma 4) or the per-layer inputs taken from the embedding (E2B/E4B)."""
        c = self.config
        return (0 <= layer < c.n_layers and self.weights.per_layer_embed is None
                and all(c.kv_source(i) >= layer for i in range(layer, c.n_layers)))

    def _check_start(self, layer: int, resid: torch.Tensor | None, n_tokens: int) -> None:
        if not self.can_start_at_layer(layer):
            raise WorkbenchError(f"a forward cannot start at layer {layer} of this model (0..{self.config.n_layers - 1}"
                                 "; not past a layer whose keys, values or per-layer inputs later layers read)")
        if resid is None or tuple(resid.shape) != (n_tokens, self.config.d_model):
            shape = None if resid is None else tuple(resid.shape)
            raise WorkbenchError(f"a forward starting at layer {layer} takes the residual stream "
                                 f"[{n_tokens}, {self.config.d_model}] entering it, got {shape}")

    def _per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4 E2B/E4B's per-layer inputs ``[T, n_layers, d_per_layer]``: each token's per-layer embeddings (times
        sqrt(d_per_layer)) and the normalized projection of its embedding ``x`` (times 1/sqrt(d_model)), summed and
        divided by sqrt(2), as llama.cpp's ``project_per_layer_inputs``."""
        c, w = self.config, self.weights
        shape = (x.shape[0], c.n_layers, c.d_per_layer)
        projected = (linear(x, w.per_layer_model_proj) * c.d_model**-0.5).view(shape)
        projected = layer_ops.rms_norm(projected, w.per_layer_proj_norm, c.rms_eps)[1]
        embedded = w.per_layer_embed.dequantize_rows(ids).to(x.dtype).view(shape) * c.d_per_layer**0.5
        return (projected + embedded) * 2**-0.5

    def _block_tail(self, x: torch.Tensor, layer, i: int, point: _Points, per_layer: torch.Tensor | None
                    ) -> torch.Tensor:
        """Gemma 4's end of a block on the stream ``x`` after the MLP: the per-layer input, gated by the stream and
        projected back (E2B/E4B), then the block's output scale."""
        names, c = self._names[i], self.config
        if layer.per_layer_gate is not None:
            gate = F.gelu(linear(x, layer.per_layer_gate), approximate="tanh")
            hidden = gate * point(names["per_layer.hook_input"], per_layer[:, i], i)
            out = layer_ops.rms_norm(linear(hidden, layer.per_layer_proj), layer.per_layer_post_norm, c.rms_eps)[1]
            x = x + point(names["hook_per_layer_out"], out, i)
        return x if layer.out_scale is None else x * layer.out_scale

    def _positions(self, n_new: int, cache: KVCache | None, layout: BatchLayout | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new tokens' rope positions ``[N]`` and the key slots each may not see (None: every slot may be seen),
        checked against the context (a static cache keeps its length on the device, within its capacity)."""
        if layout is not None and cache is not None and not isinstance(cache, (BatchKVCache, StaticBatchKVCache)):
            raise WorkbenchError("a batched forward takes a BatchKVCache")
        if isinstance(cache, StaticBatchKVCache):  # its lengths live on the device, within its capacity
            end = 0
        elif layout is not None:
            starts = cache.next_positions if cache is not None else (0,) * layout.size
            end = max(p + n for p, n in zip(starts, layout.lengths))
        else:
            end = n_new + (cache.next_position if cache is not None and not isinstance(cache, StaticKVCache) else 0)
        if end > self.config.n_ctx:
            raise WorkbenchError(f"positions up to {end - 1} lie past the model's context of {self.config.n_ctx}")
        if cache is not None:
            return cache.prepare(layout if layout is not None else n_new)
        if layout is not None:  # a [T_max, T_max] mask, the same for every sequence (padding lies past their ends)
            return layout.positions(), causal_mask(layout.width, layout.width, self.device)
        return torch.arange(n_new, device=self.device), causal_mask(n_new, n_new, self.device)

    def _sliding_mask(self, positions: torch.Tensor, blocked: torch.Tensor | None, cache: KVCache | None,
                      layout: BatchLayout | None) -> torch.Tensor:
        """``blocked`` plus, for a sliding layer, every key ``sliding_window`` or more positions behind its query (the
        rule of llama.cpp and transformers), by rope position: after cache surgery, kept slots keep their positions,
        so the window stays exact."""
        if cache is not None:
            keys = to_device(cache.slot_positions(positions), self.device)  # [S], or [B, S] for a batch
        elif layout is not None:  # each sequence's keys are its own tokens, padded alike
            keys = layout.pad(positions)
        else:
            keys = positions
        queries = positions if layout is None else layout.pad(positions)
        far = (queries[..., :, None] - keys[..., None, :]) >= self.config.sliding_window
        if layout is not None:
            far = far[:, None]  # [B, 1, T_max, S], as a batch's mask
        return far if blocked is None else blocked | far

    def _head_point(self, point: _Points, name: str, x: torch.Tensor, i: int) -> torch.Tensor:
        """A q/k hook point in TransformerLens' per-head order: families whose Q/K rows llama.cpp's converter
        permuted (interleaved rope) show their hooks the heads in Hugging Face's order, and take the edit back."""
        if not (self.config.rope_interleaved and point.wants(name)):
            return point(name, x, i)
        shown = hf_head_order(x)
        edited = point(name, shown, i)
        return x if edited is shown else gguf_head_order(edited)

    def _qk_norm(self, x: torch.Tensor, weight: torch.Tensor, point: _Points, names: tuple[str, str],
                 i: int) -> torch.Tensor:
        """RMSNorm of queries or keys ``[T, heads, d_head]``: over each head, or over the whole projection (OLMo 2)."""
        if self.arch.qk_norm == "head":
            return rms_norm(x, weight, self.config.rms_eps, point, names, i)
        whole = x.flatten(-2)
        if point.wants(names[0]) or point.wants(names[1]):  # the points keep the heads apart, [T, heads, d_head]
            heads = x.shape[-2]
            scale = layer_ops.rms_norm(whole, weight, self.config.rms_eps)[0]
            return _norm_points(x, scale[:, :, None], None, weight.view(heads, -1), point, names, i)
        return layer_ops.rms_norm(whole, weight, self.config.rms_eps)[1].view(x.shape)

    def attention(self, x: torch.Tensor, layer, i: int, rotation: tuple[torch.Tensor, torch.Tensor],
                  blocked: torch.Tensor | None, cache: KVCache | None, point: _Points,
                  layout: BatchLayout | None = None, lora: LayerLora = (),
                  shared_kv: dict | None = None) -> torch.Tensor:
        """``shared_kv``: the keys and values of this forward's layers that later layers reuse (Gemma 4 E2B/E4B), by
        layer, as the attention reads them: filled by those layers, read by a layer without key/value projections."""
        c, names = self.config, self._names[i]
        n_new = x.shape[0]
        n_kv_heads, d_head = self._heads[i]
        own_kv = layer.wk is not None
        if own_kv:
            q, k, v = project_adapted(x, layer.wqkv, (layer.wq, layer.wk, layer.wv), ("wq", "wk", "wv"), lora, point,
                                      names["lora"], i)
            if c.qkv_bias:
                q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
        else:
            q, = project_adapted(x, None, (layer.wq,), ("wq",), lora, point, names["lora"], i)
        # Where no hook lies between the projections and z, the rope, the cache's write and attention are one call
        # with the same bits (layer_ops.rope_attention; None where it does not run).
        if self._plain_attention[i] and not point.wants_any(names["inside_attention"]):
            slots = cache.buffers(i) if cache is not None else None
            if cache is None or slots is not None:
                z = layer_ops.rope_attention(q, k, v, c.n_heads, *rotation, c.rope_interleaved, slots, self.attn_scale,
                                             blocked, (layer.q_norm, layer.k_norm, c.rms_eps) if c.qk_norm else None,
                                             None if layout is None else layout.host_bounds)
                if z is not None:
                    return self._attention_out(z, layer, i, point, lora)
        q = self._head_point(point, names["attn.hook_q"], q.view(n_new, c.n_heads, d_head), i)
        if own_kv:
            k = self._head_point(point, names["attn.hook_k"], k.view(n_new, n_kv_heads, d_head), i)
            v = point(names["attn.hook_v"], v.view(n_new, n_kv_heads, d_head), i)
        if c.qk_norm:
            q = self._qk_norm(q, layer.q_norm, point, names["attn.q_norm"], i)
            if own_kv:
                k = self._qk_norm(k, layer.k_norm, point, names["attn.k_norm"], i)
        if layer.v_norm is not None:
            v = rms_norm(v, layer.v_norm, c.rms_eps, point, names["attn.v_norm"], i)
        # A batch's whole sequences, each attending to its own keys, may take one launch over the packed rows: with the
        # rope of q and k inside it where no hook asks for them rotated or for the scores or pattern.
        packs = self._packed_attention[i] and layout is not None and cache is None
        window = c.sliding_window if self._sliding[i] else 0
        if packs and rotation[0].shape[-1] == q.shape[-1] and not point.wants_any(names["rotated_to_pattern"]):
            z = layer_ops.packed_attention(q, k, v, layout.bounds(), layout.width, self.attn_scale, window,
                                           (*rotation, c.rope_interleaved))
            if z is not None:
                return self._attention_out(z, layer, i, point, lora)
        q = self._head_point(point, names["attn.hook_rot_q"], self.rope(q, rotation), i)
        if own_kv:
            k = self._head_point(point, names["attn.hook_rot_k"], self.rope(k, rotation), i)
        # a z computed without the scores and pattern (the packed attention's, or llama.cpp numerics'): it stands
        # unless a hook edits them
        standing = None
        if packs:
            standing = layer_ops.packed_attention(q, k, v, layout.bounds(), layout.width, self.attn_scale, window)
            if standing is not None and not point.wants_any(names["scores_and_pattern"]):
                return self._attention_out(standing, layer, i, point, lora)
        if layout is not None:  # each sequence's own queries, keys and values: [B, T_max, ...]
            q = layout.pad(q)
        if own_kv:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [n_kv, T, d_head]
            if layout is not None:
                keys, values = layout.pad(k).transpose(1, 2), layout.pad(v).transpose(1, 2)
            if cache is not None:
                keys, values = cache.write(i, keys, values)
            if i in self._kv_reused and shared_kv is not None:
                shared_kv[i] = keys, values
        else:
            keys, values = shared_kv[c.kv_source(i)]
        # Query head h reads key/value head h // (n_heads / n_kv_heads), as in llama.cpp's broadcast.
        if c.attn_softcap or layer.sinks is not None or point.wants_any(names["scores_and_pattern"]):
            if (standing is None and not c.attn_softcap and layer.sinks is None
                    and layer_ops.llamacpp_glue(q, keys, values)):
                # llama.cpp's attention holds no scores nor pattern: its z is the forward's unless a hook edits them
                standing = layer_ops.attention(q, keys, values, self.attn_scale, blocked)
                standing = standing if layout is None else layout.unpad(standing)
            z = self._attention_through_pattern(q, keys, values, blocked, layer, i, point, standing is not None)
            if z is None:  # the hooks changed neither the scores nor the pattern: the standing z stays
                return self._attention_out(standing, layer, i, point, lora)
        else:  # the same products, without holding a long prompt's [heads, T, S] scores at once
            z = layer_ops.attention(q, keys, values, self.attn_scale, blocked)
        return self._attention_out(z if layout is None else layout.unpad(z), layer, i, point, lora)

    def _attention_through_pattern(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                   blocked: torch.Tensor | None, layer, i: int, point: _Points,
                                   standing: bool) -> torch.Tensor | None:
        """``z`` of attention through its scores and pattern, and their hook points. ``standing``: a ``z`` computed
        without them (the packed attention's, or llama.cpp numerics') is there already; the scores and pattern are then
        computed for the hooks alone, and None is returned where the hooks changed neither (so that recording them
        keeps the forward's bits)."""
        c, names = self.config, self._names[i]
        if c.attn_softcap:  # capped before the mask, which must stay -inf
            scores = layer_ops.soft_cap(layer_ops.attention_scores(q, keys, self.attn_scale, None), c.attn_softcap)
            scores = scores if blocked is None else scores.masked_fill(blocked, float("-inf"))
        else:
            scores = layer_ops.attention_scores(q, keys, self.attn_scale, blocked)
        computed = scores.clone() if standing else None  # a hook may edit its tensor in place
        scores = point(names["attn.hook_attn_scores"], scores, i)
        standing = standing and torch.equal(scores, computed)
        if layer.sinks is None:
            pattern = scores.softmax(dim=-1)
        else:  # each head's sink logit joins the softmax and takes its share, which no value receives
            sinks = layer.sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
            pattern = torch.cat((scores, sinks), dim=-1).softmax(dim=-1)[..., :-1]
        computed = pattern.clone() if standing else None
        pattern = point(names["attn.hook_pattern"], pattern, i)
        if standing and torch.equal(pattern, computed):
            return None
        return layer_ops.attend(pattern, values)

    def _attention_out(self, z: torch.Tensor, layer, i: int, point: _Points, lora: LayerLora) -> torch.Tensor:
        """Attention's output from ``z`` ``[T, n_heads, d_head]`` (packed), through its hook points."""
        c, names = self.config, self._names[i]
        n_new = z.shape[0]
        z = point(names["attn.hook_z"], z, i)
        z_flat = z.reshape(n_new, c.n_heads * self._heads[i][1])
        out, = project_adapted(z_flat, None, (layer.wo,), ("wo",), lora, point, names["lora"], i)
        if layer.bo is not None:
            out = out + layer.bo
        if point.wants(names["attn.hook_result"]):
            out = out + self._edited_head_results(z, layer, i, point)
        return out

    def _edited_head_results(self, z: torch.Tensor, layer, i: int, point: _Points) -> torch.Tensor:
        """Per-head outputs through W_O for hook_result; returns what edits to them add to attn_out.

        attn_out itself still comes from the production kernel: an unchanged result adds exactly zero,
        so recording keeps the run bit-identical. Hooks get a copy, so in-place edits count too.
        """
        c = self.config
        w_o = layer.wo.dequantize(z.dtype).view(c.d_model, c.n_heads, self._heads[i][1])
        result = torch.einsum("thd,mhd->thm", z, w_o)
        edited = point(self._names[i]["attn.hook_result"], result.clone(), i)
        return (edited - result).sum(dim=1)

    def mlp(self, x: torch.Tensor, layer, i: int, point: _Points, lora: LayerLora = (),
            resid: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of normalized ``x``; ``resid`` is the residual stream it was normalized from (Gemma 4's experts
        normalize it their own way and route on it)."""
        names, c = self._names[i], self.config
        if layer.moe is not None and not c.moe.dense_mlp:
            return moe_mlp(x, layer.moe, c.moe, point, names, i)
        gate, up = project_adapted(x, layer.w_gate_up, (layer.w_gate, layer.w_up), ("w_gate", "w_up"), lora, point,
                                   names["lora"], i)
        gate = point(names["mlp.hook_pre"], gate, i)
        up = point(names["mlp.hook_pre_linear"], up, i)
        if self.arch.activation == "gelu_tanh":
            hidden = F.gelu(gate, approximate="tanh") * up
        else:
            hidden = layer_ops.swiglu(gate, up)
        hidden = point(names["mlp.hook_post"], hidden, i)
        out, = project_adapted(hidden, None, (layer.w_down,), ("w_down",), lora, point, names["lora"], i)
        if layer.moe is None:
            return out
        # Gemma 4: the experts beside the dense MLP, each branch through its own output norm, summed
        dense = point(names["mlp.hook_dense_out"], layer_ops.rms_norm(out, layer.dense_post_norm, c.rms_eps)[1], i)
        experts_in = rms_norm(resid, layer.experts_norm, c.rms_eps, point, names["ln2_experts"], i)
        experts = moe_mlp(experts_in, layer.moe, c.moe, point, names, i,
                          router_input=gemma4_router_input(resid, layer.moe, c.rms_eps), activation=self.arch.activation)
        experts = layer_ops.rms_norm(experts, layer.experts_post_norm, c.rms_eps)[1]
        return dense + point(names["mlp.hook_experts_out"], experts, i)
