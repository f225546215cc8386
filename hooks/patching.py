"""Activation patching sweeps: run the corrupt prompt once per cell with one clean activation patched in.

The clean run is recorded once. A patch in block L at position p changes nothing before it: no layer before L, and
(attention being causal) no position before p. So each cell continues the corrupt run: it runs blocks L.. on positions
p.. alone, from the corrupt run's residual stream entering block L and its keys and values of the positions before p
(a cache prefix), and the cells are the rows of batched forwards (docs/batches.md, "Patching sweeps").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from workbench.errors import HookError
from workbench.kv_cache import BatchKVCache, KVCache
from workbench.progress import progress_callback
from workbench.runner import BatchLayout, HookContext, block_points

from .interventions import Patch
from .points import axes, head_count, resolve

Metric = Callable[[torch.Tensor], float]  # logits [positions, vocab] -> number
ProgressFn = Callable[[int, int], None]  # (cells done, cells in all)

AXES = {("layers", "positions"), ("layers", "heads"), ("layers", "positions", "heads")}
DEFAULT_HOOKS = {False: "blocks.{layer}.hook_resid_pre", True: "blocks.{layer}.attn.hook_z"}


@dataclass
class PatchingResult:
    """A sweep's grid of metric values, ``grid[i, j(, k)]`` for ``over`` = (layers, positions(, heads))."""

    grid: torch.Tensor
    over: tuple[str, ...]
    hook: str  # the hook name template, "{layer}" filled in per row
    labels: dict[str, list[str]]  # axis name -> tick labels ("L3", "4: Tower", "H2")
    clean_metric: float
    corrupt_metric: float
    metric_name: str
    normalized: bool  # grid is (patched - corrupt) / (clean - corrupt): 0 = no effect, 1 = clean restored

    def figure(self, title: str | None = None):
        """A plotly heatmap (one panel per head for a layers x positions x heads sweep)."""
        import plotly.express as px

        values = self.grid.numpy()
        rows, cols = self.labels[self.over[0]], self.labels[self.over[1]]
        midpoint = 0.0 if self.normalized else self.corrupt_metric
        kwargs = dict(x=cols, y=rows, aspect="auto", color_continuous_scale="RdBu", color_continuous_midpoint=midpoint,
                      labels={"x": self.over[1], "y": self.over[0], "color": self.metric_name})
        if len(self.over) == 3:
            kwargs.update(facet_col=2, facet_col_wrap=min(4, values.shape[2]))
        fig = px.imshow(values, **kwargs)
        if len(self.over) == 3:
            heads = self.labels["heads"]
            fig.for_each_annotation(lambda a: a.update(text=heads[int(a.text.split("=")[-1])]))
        fig.update_layout(title=title or f"patching {self.hook} (clean {self.clean_metric:.3g}, "
                                         f"corrupt {self.corrupt_metric:.3g})")
        return fig

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for MCP and the app)."""
        return {"grid": self.grid.tolist(), "over": list(self.over), "hook": self.hook, "labels": self.labels,
                "clean_metric": self.clean_metric, "corrupt_metric": self.corrupt_metric,
                "metric_name": self.metric_name, "normalized": self.normalized}


def logit_diff(clean_answer: int, corrupt_answer: int) -> Metric:
    """logit(clean answer) - logit(corrupt answer) at the last position."""
    return lambda logits: float(logits[-1, clean_answer] - logits[-1, corrupt_answer])


def patching_sweep(model: Any, clean: str | Sequence[int], corrupt: str | Sequence[int], metric: Metric | None = None,
                   *, over: Sequence[str] = ("layers", "positions"), hook: str | None = None,
                   layers: Sequence[int] | None = None, positions: Sequence[int] | None = None,
                   answers: tuple[int | str, int | str] | None = None, normalize: bool = False,
                   progress: bool | ProgressFn = True) -> PatchingResult:
    """Patch each (layer, position | head) cell of ``hook`` from the clean run into the corrupt run.

    ``hook`` is a template with ``{layer}`` (default ``blocks.{layer}.hook_resid_pre``, or
    ``blocks.{layer}.attn.hook_z`` when sweeping heads). ``metric(logits)`` defaults to the logit
    difference between the clean and corrupt answers at the last position (``answers`` as token ids or
    single-token strings; by default each run's top prediction). A heads-only sweep patches each head
    at every position. ``progress``: True for a progress bar, False for none, or ``fn(done, total)``.
    """
    over = tuple(over)
    if over not in AXES:
        raise HookError(f"over must be one of {sorted(AXES)}, got {over}")
    sweep_heads = "heads" in over
    hook = hook or DEFAULT_HOOKS[sweep_heads]
    if "{layer}" not in hook:
        raise HookError(f"hook must be a template with '{{layer}}', got {hook!r}")
    c = model.config
    layers = list(range(c.n_layers)) if layers is None else [int(i) for i in layers]
    bad_layers = [i for i in layers if not 0 <= i < c.n_layers]
    if not layers or bad_layers:
        raise HookError(f"layers {bad_layers or layers} out of range 0..{c.n_layers - 1}")
    names = [hook.format(layer=i) for i in layers]
    for name in names:
        resolve(name, c)
        if sweep_heads and head_count(name, c) is None:
            raise HookError(f"{name} has no head axis to sweep")
    clean_ids, corrupt_ids = model.to_ids(clean), model.to_ids(corrupt)
    if len(clean_ids) != len(corrupt_ids):
        raise HookError(f"clean and corrupt prompts must have the same number of tokens "
                        f"({len(clean_ids)} vs {len(corrupt_ids)})")
    n_tokens = len(clean_ids)
    positions = list(range(n_tokens)) if positions is None else [p % n_tokens for p in _checked(positions, n_tokens)]
    heads = list(range(head_count(names[0], c))) if sweep_heads else []
    answer_ids = [_token_id(model, a) for a in answers] if answers is not None else None
    if metric is not None and not callable(metric):
        raise HookError("metric must be a function of the logits [positions, vocab]")

    clean_trace = model.run(clean_ids, record=names)
    cells = [(layers[i], name, pos, head) for i, name in enumerate(names)
             for pos in (positions if "positions" in over else [None])
             for head in (heads if sweep_heads else [None])]
    continued = _can_continue(model, names)
    if continued:
        corrupt = _corrupt_run(model, corrupt_ids, {_start_of(model, layer) for layer in layers})
        corrupt_logits = corrupt.logits
    else:
        corrupt_logits = model.forward(corrupt_ids)
    answer_pair = None
    if metric is None:
        answer_pair = answer_ids or (int(clean_trace.logits[-1].argmax()), int(corrupt_logits[-1].argmax()))
        if answer_pair[0] == answer_pair[1]:
            raise HookError("the clean and corrupt runs predict the same token; pass answers=(clean, corrupt)")
        metric = logit_diff(*answer_pair)
        texts = model.token_texts(answer_pair)
        metric_name = f"logit diff {texts[0]!r} - {texts[1]!r}"
    else:
        metric_name = getattr(metric, "__name__", "metric")
    clean_metric, corrupt_metric = float(metric(clean_trace.logits)), float(metric(corrupt_logits))
    if normalize and clean_metric == corrupt_metric:
        raise HookError("cannot normalize: the clean and corrupt metrics are equal")

    if continued:
        grid = _continued_cells(model, cells, clean_trace, corrupt, corrupt_ids, metric, answer_pair, progress)
    else:
        # every cell is a row of batched forwards of the whole corrupt prompt, each row with its own patch
        patches = [[Patch(name, positions=None if pos is None else [pos], heads=None if head is None else [head],
                          donor=clean_trace)] for _, name, pos, head in cells]
        grid = torch.empty(len(cells))
        # the default metric reads the last position alone: the cells then skip every other position's unembedding
        rows = "last" if answer_pair else "all"
        for n, trace in model.iter_batch([corrupt_ids] * len(cells), per_prompt_interventions=patches, logits=rows,
                                         progress=progress):
            grid[n] = float(metric(trace.logits))
    shape = [len(layers)] + ([len(positions)] if "positions" in over else []) + ([len(heads)] if sweep_heads else [])
    grid = grid.view(shape)
    if normalize:
        grid = (grid - corrupt_metric) / (clean_metric - corrupt_metric)
    tokens = model.token_texts(clean_ids)
    labels = {"layers": [f"L{i}" for i in layers],
              "positions": [f"{p}: {tokens[p]}" for p in positions],
              "heads": [f"H{h}" for h in heads]}
    return PatchingResult(grid, over, hook, {axis: labels[axis] for axis in over}, clean_metric, corrupt_metric,
                          metric_name, normalize)


Cell = tuple[int, str, "int | None", "int | None"]  # (layer, hook point, position or None for all, head or None)

# What one block's call costs beyond its arithmetic (kernel launches, Python), as FLOPs of the arithmetic it could have
# done meanwhile: cells of several layers share forwards from the first one's block while recomputing the blocks
# between costs less than more calls. The CPU's is measured on 2 threads (docs/batches.md); CUDA's is an estimate.
CALL_FLOPS = {"cpu": 3e8, "cuda": 1e10}


@dataclass
class _CorruptRun:
    logits: torch.Tensor  # [T, vocab] float32, on the CPU
    cache: KVCache  # every layer's keys and values
    resid: dict[int, torch.Tensor]  # layer -> the residual stream entering it, [T, d_model]


def _can_continue(model: Any, names: Sequence[str]) -> bool:
    """Whether the cells can continue the corrupt run (each a token-major point inside its block), rather than each
    rerun it whole. Not under a ``model.hooks()`` block, whose edits may read what a continued cell skips."""
    points = block_points(model.config)
    return not model.in_hooks_block() and all(
        resolve(name, model.config) == [name] and name.split(".", 2)[2] in points and axes(name).token == 0
        for name in names)


def _start_of(model: Any, layer: int) -> int:
    """The block a forward for cells of ``layer`` starts at: the latest at or before it that a forward can start at
    from the residual stream (0: from the tokens)."""
    return next((a for a in range(layer, 0, -1) if model.runner.can_start_at_layer(a)), 0)


def _corrupt_run(model: Any, ids: list[int], starts: set[int]) -> _CorruptRun:
    """The corrupt prompt's forward, keeping its keys and values and the residual stream entering each of ``starts``."""
    resid: dict[int, torch.Tensor] = {}

    def keep(x: torch.Tensor, ctx: HookContext) -> None:
        resid[ctx.layer] = x

    hooks = {f"blocks.{layer}.hook_resid_pre": [keep] for layer in starts if layer}
    cache = model.runner.new_cache(len(ids))
    with torch.inference_mode(), model.numerics_scope():
        logits = model.runner.forward(torch.tensor(ids, dtype=torch.long), cache=cache, hooks=hooks or None)
    return _CorruptRun(logits.cpu(), cache, resid)


def _continued_cells(model: Any, cells: Sequence[Cell], clean: Any, corrupt: _CorruptRun, corrupt_ids: list[int],
                     metric: Metric, answer_pair: tuple[int, int] | None, progress: bool | ProgressFn) -> torch.Tensor:
    """Each cell's metric, the cell continuing the corrupt run from its block and position: cells are grouped into
    bands of layers (``_bands``), and each band's cells, sorted by position, are the rows of batched forwards from the
    band's first block, each row seeded with the corrupt run's keys and values before its position."""
    runner, c = model.runner, model.config
    n_tokens = len(corrupt_ids)
    first = [pos or 0 for _, _, pos, _ in cells]  # the first position each cell runs
    last_only = answer_pair is not None
    donors = {name: clean.activations[name].to(model.point_device(name), model.dtype) for _, name, _, _ in cells}
    per_token, per_score, budget = model.batch_bytes(vocab_rows=not last_only)
    element = torch.finfo(model.dtype).bits // 8
    slot_bytes = element * 2 * sum(math.prod(c.layer_heads(i)) for i in range(c.n_layers))  # a row's cache slot
    grid = torch.empty(len(cells))
    update, close = progress_callback(progress, len(cells), "cells")
    done = 0
    try:
        for start, band in _bands(model, cells, first, n_tokens):
            band.sort(key=lambda n: first[n])
            for rows in _chunks(band, first, n_tokens, per_token, per_score, slot_bytes, budget,
                                model.max_batch_tokens()):
                cached = [first[n] for n in rows]
                layout = BatchLayout([n_tokens - p for p in cached], runner.device, cached=cached)
                cache = (BatchKVCache.from_prefixes(corrupt.cache, cached, max(cached) + layout.width,
                                                    range(start, c.n_layers)) if any(cached) else None)
                ids = torch.tensor([t for p in cached for t in corrupt_ids[p:]], dtype=torch.long)
                resid = torch.cat([corrupt.resid[start][p:] for p in cached]) if start else None
                hooks = _patch_hooks(model, [cells[n] for n in rows], layout, donors)
                with torch.inference_mode(), model.numerics_scope():
                    out = runner.forward(ids, cache=cache, hooks=hooks, layout=layout, last_logits_only=last_only,
                                         start_at_layer=start, resid=resid)
                if last_only:  # the default metric, on the device: one small copy back
                    grid[rows] = (out[:, answer_pair[0]] - out[:, answer_pair[1]]).float().cpu()
                else:  # a metric of every position sees the corrupt run's logits before the row's first position
                    out = out.cpu()
                    for b, n in enumerate(rows):
                        grid[n] = float(metric(torch.cat((corrupt.logits[:first[n]], out[layout.rows(b)]))))
                done += len(rows)
                update(done)
    finally:
        close()
    return grid


def _bands(model: Any, cells: Sequence[Cell], first: Sequence[int], n_tokens: int) -> list[tuple[int, list[int]]]:
    """The cells grouped by consecutive swept layers, ``(the block their forwards start at, cell indices)`` each, so that
    blocks run (as tokens) plus calls (as ``CALL_FLOPS``' tokens) are fewest: one band per layer where calls are cheap
    (the CPU), few where they are dear (small models on a GPU)."""
    c = model.config
    flops_per_token = 2 * (c.n_params - c.vocab_size * c.d_model * (1 if c.tied_embeddings else 2)) / c.n_layers
    call_tokens = CALL_FLOPS.get(model.runner.device.type, CALL_FLOPS["cuda"]) / flops_per_token
    by_layer: dict[int, list[int]] = {}
    for n, (layer, _, _, _) in enumerate(cells):
        by_layer.setdefault(layer, []).append(n)
    layers = sorted(by_layer)
    tokens = [sum(n_tokens - first[n] for n in by_layer[layer]) for layer in layers]
    starts = [_start_of(model, layer) for layer in layers]
    # cost[j]: the least cost of the first j layers, split[j]: where the last band of that split begins
    cost, split = [0.0] + [math.inf] * len(layers), [0] * (len(layers) + 1)
    for j in range(1, len(layers) + 1):
        for i in range(j):
            here = cost[i] + (c.n_layers - starts[i]) * (call_tokens + sum(tokens[i:j]))
            if here < cost[j]:
                cost[j], split[j] = here, i
    bands, j = [], len(layers)
    while j:
        i = split[j]
        bands.append((starts[i], [n for layer in layers[i:j] for n in by_layer[layer]]))
        j = i
    return bands[::-1]


def _chunks(rows: list[int], first: Sequence[int], n_tokens: int, per_token: int, per_score: int, slot_bytes: int,
            budget: int, max_tokens: int) -> list[list[int]]:
    """``rows`` (sorted by first position) in forwards within ``max_tokens`` padded tokens and ``budget`` bytes of
    activations, attention scores and cache slots."""
    chunks: list[list[int]] = [[]]
    for n in rows:
        chunk = chunks[-1] + [n]
        width = n_tokens - first[chunk[0]]  # the longest row's tokens
        slots = first[n] + width
        padded = len(chunk) * width
        if len(chunk) > 1 and (padded > max_tokens or padded * (per_token + per_score * slots)
                               + len(chunk) * slots * slot_bytes > budget):
            chunks.append([n])
        else:
            chunks[-1] = chunk
    return chunks


def _patch_hooks(model: Any, cells: Sequence[Cell], layout: BatchLayout, donors: dict[str, torch.Tensor]
                 ) -> dict[str, list]:
    """One hook per patched point of a forward whose row ``b`` is the cell ``cells[b]``: it writes the clean run's
    activation into every row's cell at once (row b starts at its cell's position, or at 0 to patch every position)."""
    edits: dict[str, tuple[list[int], list[int], list[int]]] = {}
    for b, (_, name, pos, head) in enumerate(cells):
        dst, src, heads = edits.setdefault(name, ([], [], []))
        positions = range(layout.lengths[b]) if pos is None else [pos]
        dst += [layout.starts[b] + p - (pos or 0) for p in positions]
        src += list(positions)
        heads += [head] * len(positions)
    hooks = {}
    for name, (dst, src, heads) in edits.items():
        device = model.point_device(name)
        index = (torch.tensor(dst, device=device),) + (() if heads[0] is None else (torch.tensor(heads, device=device),))
        values = donors[name][torch.tensor(src, device=device), *index[1:]]
        hooks[name] = [_writer(index, values)]
    return hooks


def _writer(index: tuple[torch.Tensor, ...], values: torch.Tensor):
    def write(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        x = x.clone()
        x[index] = values.to(x.dtype)
        return x

    return write


def _checked(positions: Sequence[int], n_tokens: int) -> list[int]:
    out = [int(p) for p in positions]
    bad = [p for p in out if not -n_tokens <= p < n_tokens]
    if not out or bad:
        raise HookError(f"positions {bad or out} out of range for {n_tokens} tokens")
    return out


def _token_id(model: Any, answer: int | str) -> int:
    if isinstance(answer, str):
        ids = model.tokenize(answer, add_bos=False)
        if len(ids) != 1:
            raise HookError(f"answer {answer!r} is {len(ids)} tokens; give a single token (or its id)")
        return ids[0]
    if not 0 <= int(answer) < model.config.vocab_size:
        raise HookError(f"answer token id {answer} out of range 0..{model.config.vocab_size - 1}")
    return int(answer)
