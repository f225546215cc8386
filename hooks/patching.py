"""Activation patching sweeps: run the corrupt prompt once per cell with one clean activation patched in.

The clean run is recorded once; each cell is one forward of the corrupt prompt with a Patch from that
trace, so a sweep of L layers x T positions costs L*T + 2 forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from workbench.errors import HookError

from .interventions import Patch
from .points import head_count, resolve

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
    corrupt_logits = model.forward(corrupt_ids)
    default_metric = metric is None
    if metric is None:
        clean_answer, corrupt_answer = answer_ids or (int(clean_trace.logits[-1].argmax()),
                                                      int(corrupt_logits[-1].argmax()))
        if clean_answer == corrupt_answer:
            raise HookError("the clean and corrupt runs predict the same token; pass answers=(clean, corrupt)")
        metric = logit_diff(clean_answer, corrupt_answer)
        texts = model.token_texts([clean_answer, corrupt_answer])
        metric_name = f"logit diff {texts[0]!r} - {texts[1]!r}"
    else:
        metric_name = getattr(metric, "__name__", "metric")
    clean_metric, corrupt_metric = float(metric(clean_trace.logits)), float(metric(corrupt_logits))
    if normalize and clean_metric == corrupt_metric:
        raise HookError("cannot normalize: the clean and corrupt metrics are equal")

    cells = [(i, name, pos, head) for i, name in enumerate(names)
             for pos in (positions if "positions" in over else [None])
             for head in (heads if sweep_heads else [None])]
    # every cell is a row of batched forwards of the corrupt prompt, each row with its own patch
    patches = [[Patch(name, positions=None if pos is None else [pos], heads=None if head is None else [head],
                      donor=clean_trace)] for _, name, pos, head in cells]
    grid = torch.empty(len(cells))
    # the default metric reads the last position alone: the cells then skip every other position's unembedding
    rows = "last" if default_metric else "all"
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
