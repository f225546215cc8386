"""Hooks in a batched forward: each prompt's hooks see that prompt alone, as in ``model.run``.

A batched forward packs its sequences' tokens into one ``[N, ...]`` activation (attention scores and patterns are
``[B, heads, T_max, S]``, see ``workbench.runner.BatchLayout``). Interventions and plain function hooks are written
for one prompt: ``per_prompt_hooks`` calls each prompt's hooks on that prompt's slice, with the prompt's own positions
and index in the ``HookContext``, and writes back what they return. So a hook, intervention or recorder means in a
batch exactly what it means in a run of its prompt alone, whatever else is in the batch.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from workbench.errors import HookError, shorten
from workbench.runner import BatchLayout, HookContext, HookFn, Hooks, run_hooks

from .points import axes
from .recording import join_tokens

# How recorded activations are reduced over positions as they are recorded: every position, the last, or the mean.
REDUCTIONS = ("last", "mean")


def row_view(x: torch.Tensor, name: str, layout: BatchLayout, b: int) -> torch.Tensor:
    """Row ``b``'s part of a batched activation, shaped as ``model.run`` of its prompt alone gives it (a view)."""
    if axes(name).token == 1:  # [B, heads, T_max, S] scores and patterns
        return x[b, :, : layout.lengths[b], : layout.slots(b)]
    if _last_rows_only(x, layout):
        return x[b : b + 1]
    return x[layout.rows(b)]


def _last_rows_only(x: torch.Tensor, layout: BatchLayout) -> bool:
    """Whether a token-major activation holds one row per sequence: its last token's (the final norm and logits of a
    forward that keeps only those)."""
    return x.shape[0] == layout.size != layout.n_tokens


def per_prompt_hooks(prompt_hooks: Mapping[int, Hooks]) -> dict[str, list[HookFn]]:
    """One batch-level hook per hooked point that runs each prompt's hooks (``{prompt index: hooks}``) on its slice."""
    names = dict.fromkeys(name for hooks in prompt_hooks.values() for name in hooks)
    return {name: [_splitter(name, prompt_hooks)] for name in names}


def _row_edits(fns: Sequence[HookFn] | None) -> tuple[tuple, list] | None:
    """A prompt's hook functions at a token-major point as ``RowEdit`` s with their keys (None: not all of them are)."""
    edits = [getattr(f, "row_edit", None) for f in fns or ()]
    if not edits or None in edits:
        return None
    return tuple(e.key for e in edits), edits


def _splitter(name: str, prompt_hooks: Mapping[int, Hooks]) -> HookFn:
    token_major = axes(name).token == 0
    # Where every row's hooks are the same elementwise edits (an intervention shared by the batch), one call edits all
    # rows: a decode step of 32 rows then calls it once, not 32 times.
    row_edits = {p: _row_edits(hooks.get(name)) for p, hooks in prompt_hooks.items()} if token_major else {}
    # On a decode step every row's token is a generated one, which positions None and "generated" both select: where
    # every prompt shares such edits here, of whole tokens (a selection of heads or neurons indexes with a list from the
    # host), the step applies them in one call that a CUDA graph holds (runner.capturable).
    keys = {None if edits is None else edits[0] for edits in row_edits.values()}
    capturable = len(keys) == 1 and None not in keys and all(
        (edit.positions is None or isinstance(edit.positions, str)) and edit.heads is None and edit.neurons is None
        for _, edits in row_edits.values() for edit in edits)
    # Such edits are also those of a prefix that prompts share (kv_cache.prefix_groups), computed once as the rows of
    # prompts -1, -2, ...: they edit each of its tokens as every prompt's do. Taken from the longest prompt, whose length
    # no prefix reaches, so that "generated" selects none of a prefix's tokens.
    prefix_edits = max(row_edits.values(), key=lambda edits: edits[1][0].prompt_len) if capturable else None

    def edits_of(prompt: int) -> tuple[tuple, list] | None:
        return row_edits.get(prompt) if prompt >= 0 else prefix_edits

    def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
        layout = ctx.layout
        last_only = token_major and _last_rows_only(x, layout)
        shared = edits_of(layout.prompts[0])
        if shared is not None and all(edits_of(p) is not None and edits_of(p)[0] == shared[0]
                                      for p in layout.prompts[1:]):
            return _edit_rows(x, ctx, [edits_of(p)[1] for p in layout.prompts], last_only)
        edited = []
        for b, prompt in enumerate(layout.prompts):
            fns = prompt_hooks.get(prompt, {}).get(name)
            if not fns:
                continue
            view = row_view(x, name, layout, b)
            positions = ctx.positions[layout.rows(b)]
            row_ctx = HookContext(name, ctx.layer, positions[-1:] if last_only else positions, ctx.step, prompt)
            try:
                out = run_hooks(fns, view, row_ctx)
            except HookError as err:  # a hook written for one prompt fails on one: say which
                raise HookError(f"prompt {prompt}: {err}") from None
            if out is not view:
                edited.append((b, out))
        if not edited:
            return None
        x = x.clone()
        for b, out in edited:
            row_view(x, name, layout, b).copy_(out)
        return x

    fn.edits_only = all(getattr(f, "edits_only", False) for hooks in prompt_hooks.values() for f in hooks.get(name, ()))
    fn.capturable = capturable
    return fn


def _edit_rows(x: torch.Tensor, ctx: HookContext, edits: list[list], last_only: bool) -> torch.Tensor | None:
    """The rows' equal-keyed edits (``edits[b]``, row ``b``'s) applied to the whole packed ``x`` at once."""
    layout = ctx.layout
    positions = ctx.positions[layout.last_rows()] if last_only else ctx.positions
    out = x
    for j, edit in enumerate(edits[0]):
        prompt_len = 0
        if isinstance(edit.positions, str):  # "generated": each token selected by its own prompt's length
            counts = [1] * layout.size if last_only else layout.lengths
            prompt_len = layout.on_device(tuple(row[j].prompt_len for row, n in zip(edits, counts) for _ in range(n)))
        result = edit(out, ctx, positions, prompt_len)
        if result is not None:
            out = result.to(x.dtype)
    return None if out is x else out


class BatchRecorder:
    """Records named activations of batched forwards, split per prompt.

    Each point is copied once per forward (not once per prompt) to ``device`` in ``dtype``; from a GPU to the CPU the
    copy goes to pinned memory without waiting, so it overlaps the rest of the forward. ``reduce`` keeps one row per
    prompt as it records (``"last"`` position, ``"mean"`` over positions, or an ``int`` position, negative from the
    prompt's end), so that activations of many prompts fit in memory. A prompt whose tokens run over several forwards
    (a long prompt in chunks, or after a shared prefix) is recorded whole and reduced when it is taken.
    """

    def __init__(self, names: Sequence[str], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 reduce: str | int | None = None, own_buffers: bool = True):
        check_reduce(reduce, names)
        self.names, self.device, self.dtype, self.reduce = list(names), torch.device(device), dtype, reduce
        self.own_buffers = own_buffers
        self._forwards: list[_Recorded] = []  # forwards with prompts not yet taken, in order

    def hooks(self) -> dict[str, list[HookFn]]:
        def record(x: torch.Tensor, ctx: HookContext) -> None:
            layout = ctx.layout
            if not self._forwards or self._forwards[-1].layout is not layout:
                reduce_now = self.reduce is not None and layout.complete and not any(layout.cached)
                self._forwards.append(_Recorded(layout, reduce_now))
            forward = self._forwards[-1]
            kept = self._reduce_rows(x.detach(), layout) if forward.reduced else x.detach()
            forward.tensors[ctx.name] = forward.copy(kept, self.device, self._dtype(kept))

        return {name: [record] for name in self.names}

    def _reduce_rows(self, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """One row per sequence ``[B, ...]``."""
        return torch.stack([reduce_tokens(x[layout.rows(b)], self.reduce, layout.prompts[b])
                            for b in range(layout.size)])

    def take(self, prompt: int) -> dict[str, torch.Tensor]:
        """The activations recorded for one prompt, forgotten here. With ``own_buffers`` they share one buffer of their
        own, so a kept trace holds no other prompt's activations (one copy per prompt, not one per point); without,
        they are views of their forward's buffers, for a caller that keeps every prompt's trace anyway."""
        parts: dict[str, list[torch.Tensor]] = {}
        reduced = False
        for forward in self._forwards:
            b = forward.row.get(prompt)
            if b is None:
                continue
            forward.wait()
            reduced = forward.reduced
            for name, x in forward.tensors.items():
                parts.setdefault(name, []).append(x[b] if reduced else row_view(x, name, forward.layout, b))
            forward.untaken -= 1
        self._forwards = [f for f in self._forwards if f.untaken]
        if reduced or self.reduce is None:
            joined = {name: join_tokens(name, chunks) for name, chunks in parts.items()}
            return _own_buffer(joined) if self.own_buffers else joined
        rows = {name: reduce_tokens(join_tokens(name, chunks), self.reduce, prompt) for name, chunks in parts.items()}
        return {name: x.to(self._dtype(x)) for name, x in rows.items()}

    def _dtype(self, x: torch.Tensor) -> torch.dtype:
        """The recording dtype for floating activations; integer ones (an MoE's chosen experts) keep theirs, as
        ``model.run`` records them (a float16 or bfloat16 expert id would be rounded past 2048 or 256 experts)."""
        return self.dtype if x.is_floating_point() else x.dtype


class _Recorded:
    """What one batched forward recorded: each point's activation for the whole batch."""

    def __init__(self, layout: BatchLayout, reduced: bool):
        self.layout, self.reduced = layout, reduced
        self.row = {prompt: b for b, prompt in enumerate(layout.prompts)}
        self.untaken = layout.size
        self.tensors: dict[str, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None  # set while copies from it to pinned memory may be in flight

    def copy(self, x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if x.is_cuda and device.type == "cpu":
            self._stream = torch.cuda.current_stream(x.device)
            return pinned_copy(x, dtype, wait=False)
        return x.to(device, dtype, copy=True)

    def wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
            self._stream = None


def pinned_copy(x: torch.Tensor, dtype: torch.dtype | None = None, wait: bool = True) -> torch.Tensor:
    """A GPU tensor copied to pinned CPU memory (several times faster than to pageable memory; torch caches the pinned
    blocks). With ``wait=False`` the copy may still be in flight: synchronize the current stream before reading it."""
    out = torch.empty(x.shape, dtype=dtype or x.dtype, pin_memory=True)
    out.copy_(x, non_blocking=not wait)
    return out


def _own_buffer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors copied into one new buffer per dtype (an MoE's chosen experts stay integers), each a view of its
    own part, in their order."""
    views = {}
    for dtype in {x.dtype for x in tensors.values()}:
        group = {name: x for name, x in tensors.items() if x.dtype == dtype}
        pieces = torch.cat([x.reshape(-1) for x in group.values()]).split([x.numel() for x in group.values()])
        views.update({name: piece.view(x.shape) for (name, x), piece in zip(group.items(), pieces)})
    return {name: views[name] for name in tensors}


def reduce_tokens(x: torch.Tensor, reduce: str | int, prompt: int) -> torch.Tensor:
    """One prompt's token-major activation ``[T, ...]`` reduced to one row: the last, the mean (in float32), or the
    row at a position (negative from the end)."""
    if reduce == "mean":
        return x.float().mean(0)
    return x[_reduce_position(reduce, x.shape[0], prompt)]


def _reduce_position(reduce: str | int, n: int, prompt: int) -> int:
    """The row ``reduce`` ("last" or a position) keeps of a prompt of ``n`` tokens, checked."""
    at = n - 1 if reduce == "last" else reduce
    if not -n <= at < n:
        raise HookError(f"prompt {prompt} has {n} tokens; reduce={reduce} lies outside them")
    return at


def check_reduce(reduce: str | int | None, names: Sequence[str] = (), lengths: Sequence[int] = ()) -> None:
    """Refuse a ``reduce`` that is not one, one of points that are not token-major (``names``), or, naming the prompt,
    a position outside a prompt (``lengths``); before any compute."""
    if reduce is None:
        return
    if not (reduce in REDUCTIONS or (isinstance(reduce, int) and not isinstance(reduce, bool))):
        raise HookError(f"reduce must be None, {', '.join(map(repr, REDUCTIONS))} or a position, got {shorten(reduce)}")
    grown = [n for n in names if axes(n).token != 0]
    if grown:
        raise HookError(f"reduce works on token-major hook points, not {grown[0]}")
    if isinstance(reduce, int):
        for i, n in enumerate(lengths):
            _reduce_position(reduce, n, i)
