"""Activation patching sweeps: run the corrupt prompt once per cell with one clean activation patched in.

The clean run is recorded once. A patch in block L at position p changes nothing before it: no layer before L, and
(attention being causal) no position before p. So each cell continues the corrupt run: it runs blocks L.. on positions
p.. alone, from the corrupt run's residual stream entering block L and its keys and values of the positions before p
(a cache prefix), and the cells are the rows of batched forwards (docs/batches.md, "Patching sweeps").

Attribution patching estimates the same cells from gradients instead, and either method runs over a dataset of
(clean, corrupt) pairs as their mean (``dataset_patching``), the pairs' runs batched.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from workbench.errors import HookError, WorkbenchError, integer, integer_list, shorten
from workbench.kv_cache import BatchKVCache, KVCache
from workbench.messages import Prompt
from workbench.progress import check_progress, progress_callback
from workbench.runner import BatchLayout, HookContext, block_points

from .interventions import FunctionHook, Patch
from .points import axes, head_count, resolve

# logits [positions, vocab] -> a number (a 0-d tensor computed from them, for attribution patching)
Metric = Callable[[torch.Tensor], "float | torch.Tensor"]
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
    method: str = "activation patching"  # or "attribution patching": the grid estimated from gradients
    pairs: int = 1  # the (clean, corrupt) pairs whose grids and metrics are averaged (``dataset_patching``)
    # attribution's ``verify``: grid's shape, each verified cell's activation-patched value (mean over the pairs,
    # normalized as the grid), NaN where a cell was only estimated
    patched: torch.Tensor | None = None

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
        over = f", mean of {self.pairs} pairs" if self.pairs > 1 else ""
        fig.update_layout(title=title or f"{self.method} {self.hook} (clean {self.clean_metric:.3g}, "
                                         f"corrupt {self.corrupt_metric:.3g}{over})")
        return fig

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for MCP and the app)."""
        return {"grid": self.grid.tolist(), "over": list(self.over), "hook": self.hook, "labels": self.labels,
                "clean_metric": self.clean_metric, "corrupt_metric": self.corrupt_metric,
                "metric_name": self.metric_name, "normalized": self.normalized, "method": self.method,
                "pairs": self.pairs, "verified": self.verified()}

    def verified(self) -> list[dict[str, Any]]:
        """The cells attribution's ``verify`` patched, largest estimated effect first: each cell's index, labels,
        estimate and patched value."""
        if self.patched is None:
            return []
        estimated = self.grid - (0.0 if self.normalized else self.corrupt_metric)
        cells = [tuple(int(i) for i in index) for index in torch.nonzero(~self.patched.isnan())]
        cells.sort(key=lambda index: -abs(float(estimated[index])))
        return [{"index": list(index), "labels": [self.labels[axis][i] for axis, i in zip(self.over, index)],
                 "estimated": float(self.grid[index]), "patched": float(self.patched[index])} for index in cells]


def logit_diff(clean_answer: int, corrupt_answer: int) -> Metric:
    """logit(clean answer) - logit(corrupt answer) at the last position (a 0-d tensor: a gradient starts from it)."""
    return lambda logits: logits[-1, clean_answer] - logits[-1, corrupt_answer]


@dataclass
class _Sweep:
    """One (clean, corrupt) pair's sweep as the arguments of ``patching_sweep``, ``attribution_patching`` and
    ``dataset_patching`` give it, checked."""

    over: tuple[str, ...]
    hook: str
    layers: list[int]
    names: list[str]  # the hook point of each layer
    positions: list[int]
    heads: list[int]
    clean_ids: list[int]
    corrupt_ids: list[int]
    answer_ids: list[int] | None
    label: str = ""  # "pair 3: " in a dataset, for its errors

    def cells(self) -> list[Cell]:
        return [(self.layers[i], name, pos, head) for i, name in enumerate(self.names)
                for pos in (self.positions if "positions" in self.over else [None])
                for head in (self.heads if "heads" in self.over else [None])]

    def answers(self, clean_logits: torch.Tensor, corrupt_logits: torch.Tensor) -> tuple[int, int]:
        """The default metric's answers: as given, else each run's top prediction (unchecked: ``checked``)."""
        if self.answer_ids:
            return self.answer_ids[0], self.answer_ids[1]
        return int(clean_logits[-1].argmax()), int(corrupt_logits[-1].argmax())

    def checked(self, answers: tuple[int, int]) -> tuple[int, int]:
        if answers[0] == answers[1]:
            raise HookError(f"{self.label}the clean and corrupt runs predict the same token; give the clean and "
                            "corrupt answers to compare (answers=(clean, corrupt))")
        return answers


def _sweeps(model: Any, pairs: Sequence[tuple[Prompt, Prompt]], over: Sequence[str], hook: str | None,
            layers: Sequence[int] | None, positions: Sequence[int] | None,
            answers: Sequence[tuple[int | str, int | str] | None]) -> list[_Sweep]:
    """Each pair's sweep, ``answers`` one entry per pair; in a dataset (more than one pair) an error names its pair."""
    over = tuple(over)
    if over not in AXES:
        raise HookError(f"over must be one of {sorted(AXES)}, got {over}")
    sweep_heads = "heads" in over
    hook = hook or DEFAULT_HOOKS[sweep_heads]
    if "{layer}" not in hook:
        raise HookError(f"hook must be a template with '{{layer}}', got {hook!r}")
    c = model.config
    # a float layer (1.7) is refused rather than floored
    layers = list(range(c.n_layers)) if layers is None else integer_list(layers, "layers", HookError)
    bad_layers = [i for i in layers if not 0 <= i < c.n_layers]
    if not layers or bad_layers:
        raise HookError(f"layers {bad_layers or layers} out of range 0..{c.n_layers - 1}")
    names = [hook.format(layer=i) for i in layers]
    for name in names:
        resolve(name, c)
        if sweep_heads and head_count(name, c) is None:
            raise HookError(f"{name} has no head axis to sweep")
    heads = list(range(head_count(names[0], c))) if sweep_heads else []
    sweeps = []
    for i, (clean, corrupt) in enumerate(pairs):
        label = f"pair {i}: " if len(pairs) > 1 else ""
        try:
            clean_ids, corrupt_ids = model.to_ids(clean), model.to_ids(corrupt)
            if len(clean_ids) != len(corrupt_ids):
                raise HookError(f"clean and corrupt prompts must have the same number of tokens "
                                f"({len(clean_ids)} vs {len(corrupt_ids)})")
            n_tokens = len(clean_ids)
            if "positions" in over and sweeps and n_tokens != len(sweeps[0].clean_ids):
                raise HookError(f"{n_tokens} tokens where pair 0 has {len(sweeps[0].clean_ids)}: a sweep over "
                                f"positions takes pairs of one length (one over ['layers', 'heads'] takes any)")
            cells_at = (list(range(n_tokens)) if positions is None
                        else [p % n_tokens for p in _checked(positions, n_tokens)])
            answer_ids = _answer_ids(model, answers[i])
        except WorkbenchError as err:
            raise type(err)(f"{label}{err}") from None
        sweeps.append(_Sweep(over, hook, layers, names, cells_at, heads, clean_ids, corrupt_ids, answer_ids, label))
    return sweeps


def _answer_ids(model: Any, answers: tuple[int | str, int | str] | None) -> list[int] | None:
    if answers is None:
        return None
    if isinstance(answers, (str, bytes)) or not isinstance(answers, Sequence) or len(answers) != 2:
        raise HookError(f"answers must be a pair (clean answer, corrupt answer) of token ids or single-token strings, "
                        f"got {shorten(answers)}")
    return [_token_id(model, a) for a in answers]


def _metric_name(model: Any, metric: Metric | None, answers: tuple[int, int] | None) -> str:
    if answers is None:
        return getattr(metric, "__name__", "metric")
    texts = model.token_texts(answers)
    return f"logit diff {texts[0]!r} - {texts[1]!r}"


def _check_metric(metric: Any) -> None:
    if metric is not None and not callable(metric):
        raise HookError("metric must be a function of the logits [positions, vocab]")


def _scalar(value: Any) -> float:
    """A metric's value as a float: a number or a one-element tensor, else a HookError (not float()'s ValueError)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise HookError(f"metric must return a number or a one-element tensor, got {shorten(value)}")


@dataclass
class _PairGrid:
    """One pair's cells (flat, in ``_Sweep.cells`` order) and metrics."""

    grid: torch.Tensor
    clean_metric: float
    corrupt_metric: float
    metric_name: str


def _check_normalizable(normalize: bool, clean_metric: float, corrupt_metric: float, pairs: int = 1) -> None:
    """A normalized grid divides by clean - corrupt (the pairs' means): refused where that is zero."""
    if normalize and clean_metric == corrupt_metric:
        raise HookError("cannot normalize: the clean and corrupt metrics are equal"
                        + (" on average over the pairs" if pairs > 1 else ""))


def _result(model: Any, sweeps: Sequence[_Sweep], pairs: Sequence[_PairGrid], normalize: bool,
            method: str, patched: Sequence[_PairGrid] = ()) -> PatchingResult:
    """The pairs' mean grid and metrics; normalized, by the mean metrics (as EAP normalizes a dataset's scores).
    ``patched``: the pairs' activation patching of the cells attribution's ``verify`` chose (NaN elsewhere)."""
    first = sweeps[0]
    clean_metric = sum(p.clean_metric for p in pairs) / len(pairs)
    corrupt_metric = sum(p.corrupt_metric for p in pairs) / len(pairs)
    _check_normalizable(normalize, clean_metric, corrupt_metric, len(pairs))
    shape = ([len(first.layers)] + ([len(first.positions)] if "positions" in first.over else [])
             + ([len(first.heads)] if "heads" in first.over else []))
    grids = [torch.stack([p.grid for p in pairs]).mean(0).view(shape)]
    if patched:
        grids.append(torch.stack([p.grid for p in patched]).mean(0).view(shape))
    if normalize:
        grids = [(grid - corrupt_metric) / (clean_metric - corrupt_metric) for grid in grids]
    labels = {"layers": [f"L{i}" for i in first.layers], "heads": [f"H{h}" for h in first.heads]}
    if "positions" in first.over:  # a position's token where every pair has the same one there
        texts = [model.token_texts(s.clean_ids) for s in sweeps]
        labels["positions"] = [f"{p}: {texts[0][p]}" if all(t[p] == texts[0][p] for t in texts) else f"{p}"
                               for p in first.positions]
    names = {p.metric_name for p in pairs}
    if len(names) == 1:
        metric_name = names.pop()
    else:
        answers = all(n.startswith("logit diff ") for n in names)
        metric_name = "logit diff of each pair's answers" if answers else "each pair's metric"
    return PatchingResult(grids[0], first.over, first.hook, {axis: labels[axis] for axis in first.over},
                          clean_metric, corrupt_metric, metric_name, normalize, method, len(pairs),
                          grids[1] if patched else None)


def patching_sweep(model: Any, clean: Prompt, corrupt: Prompt, metric: Metric | None = None,
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
    _check_metric(metric)
    sweeps = _sweeps(model, [(clean, corrupt)], over, hook, layers, positions, [answers])
    check_progress(progress)
    return _result(model, sweeps, _patched(model, sweeps, [metric], normalize, progress), normalize,
                   "activation patching")


def _patched(model: Any, sweeps: Sequence[_Sweep], metrics: Sequence[Metric | None], refuse_equal: bool,
             progress: bool | ProgressFn, only: Sequence[int] | None = None) -> list[_PairGrid]:
    """The pairs' activation patching, their runs batched: each pair's grid as its single-pair call gives it, within
    the batched kernels' rounding (one pair runs its clean and corrupt prompts alone). ``refuse_equal``: the
    normalization's check, before the cells run. ``only``: the indices of the cells to run (the grid NaN at the
    others). ``progress`` counts the cells of every pair."""
    names = sweeps[0].names
    cleans = _traces(model, [s.clean_ids for s in sweeps], names)
    every = sweeps[0].cells()  # the pairs' cells are the same: positions swept take pairs of one length
    run = range(len(every)) if only is None else only
    cells = [every[n] for n in run]
    continued = _can_continue(model, names)
    if continued:
        first = _first_positions(model, cells)
        corrupts = _corrupt_runs(model, sweeps, {_start_of(model, layer) for layer in sweeps[0].layers}, any(first))
        corrupt_logits = [corrupt.logits for corrupt in corrupts]
    else:
        corrupt_logits = [t.logits for t in _traces(model, [s.corrupt_ids for s in sweeps], [])]
    answer_pairs, chosen, grids = [], [], []
    for sweep, metric, clean, corrupt in zip(sweeps, metrics, cleans, corrupt_logits):
        answer_pair = sweep.checked(sweep.answers(clean.logits, corrupt)) if metric is None else None
        metric = logit_diff(*answer_pair) if metric is None else metric
        grids.append(_PairGrid(torch.empty(0), _scalar(metric(clean.logits)), _scalar(metric(corrupt)),
                               _metric_name(model, metric, answer_pair)))
        _check_normalizable(refuse_equal, grids[-1].clean_metric, grids[-1].corrupt_metric)
        answer_pairs.append(answer_pair)
        chosen.append(metric)

    if continued:
        values = _continued_cells(model, cells, first, cleans, corrupts, sweeps, chosen, answer_pairs, progress)
    else:
        # every cell is a row of batched forwards of its pair's whole corrupt prompt, each row with its own patch
        patches = [[Patch(name, positions=None if pos is None else [pos], heads=None if head is None else [head],
                          donor=clean)] for clean in cleans for _, name, pos, head in cells]
        values = torch.empty(len(sweeps), len(cells))
        # the default metric reads the last position alone: the cells then skip every other position's unembedding
        rows = "last" if all(answer_pairs) else "all"
        for n, trace in model.iter_batch([s.corrupt_ids for s in sweeps for _ in cells],
                                         per_prompt_interventions=patches, logits=rows, progress=progress):
            values[n // len(cells), n % len(cells)] = _scalar(chosen[n // len(cells)](trace.logits))
    for grid, row in zip(grids, values):
        grid.grid = row if only is None else torch.full((len(every),), math.nan).index_put_((torch.tensor(run),), row)
    return grids


def attribution_patching(model: Any, clean: Prompt, corrupt: Prompt,
                         metric: Metric | None = None, *, over: Sequence[str] = ("layers", "positions"),
                         hook: str | None = None, layers: Sequence[int] | None = None,
                         positions: Sequence[int] | None = None, answers: tuple[int | str, int | str] | None = None,
                         normalize: bool = False, steps: int = 1, verify: int = 0) -> PatchingResult:
    """``patching_sweep``'s grid estimated to first order from gradients (attribution patching): each cell is the
    corrupt metric plus ``(clean - corrupt) . d metric / d activation`` over the cell's activation. Arguments and
    result as ``patching_sweep``'s; ``metric`` must return a tensor computed from the logits (docs/hooks.md,
    "Gradients").

    ``steps=1`` takes the gradient in the corrupt run: two forwards and a backward however many cells. More steps
    average the gradients of ``steps`` runs whose inputs (the embeddings, and Gemma 4's per-layer inputs) lie at the
    midpoints of equal steps on the straight line from the corrupt run's to the clean run's (integrated gradients,
    as EAP-IG takes them): closer to the patched values where the metric saturates, for a forward and a backward a
    step. Either way a map of where to patch: ``verify=k`` patches the k cells of the largest estimated effect
    (activation patching, their rows batched), the result's ``patched`` grid holding them (``verified()`` lists
    them beside their estimates)."""
    steps = _checked_steps(steps)
    _check_metric(metric)
    sweep, = _sweeps(model, [(clean, corrupt)], over, hook, layers, positions, [answers])
    top = _checked_verify(verify, len(sweep.cells()))
    grids = _attributed(model, [sweep], [metric], steps)
    return _result(model, [sweep], grids, normalize, _attribution_method(steps),
                   _verified(model, [sweep], [metric], grids, top))


def check_patching_method(method: str, steps: int, verify: int) -> int:
    """``steps`` checked for ``method`` ("activation" or "attribution"), with ``steps`` and ``verify`` refused where
    they do not apply (activation patching runs each cell once)."""
    if method not in ("activation", "attribution"):
        raise HookError(f"method must be 'activation' or 'attribution', got {shorten(method)}")
    steps = _checked_steps(steps)
    if method == "activation" and (steps != 1 or verify):
        raise HookError(f"{'steps' if steps != 1 else 'verify'} applies to method='attribution' (activation patching "
                        f"runs each cell once)")
    return steps


def _checked_steps(steps: int) -> int:
    steps = integer(steps, "steps", HookError)
    if steps < 1:
        raise HookError(f"steps must be at least 1, got {steps}")
    return steps


def _checked_verify(verify: int, n_cells: int) -> int:
    verify = integer(verify, "verify", HookError)
    if not 0 <= verify <= n_cells:
        raise HookError(f"verify must be between 0 and the sweep's {n_cells} cells, got {verify}")
    return verify


def _verified(model: Any, sweeps: Sequence[_Sweep], metrics: Sequence[Metric | None], grids: Sequence[_PairGrid],
              top: int, done: Callable[[int], None] = lambda pairs: None) -> list[_PairGrid]:
    """Each pair's activation patching of the ``top`` cells whose mean estimated effect is the largest (none for 0);
    ``done(pairs)`` after each pair."""
    if not top:
        return []
    effect = torch.stack([g.grid for g in grids]).mean(0) - sum(g.corrupt_metric for g in grids) / len(grids)
    chosen = effect.abs().argsort(descending=True, stable=True)[:top].tolist()
    patched: list[_PairGrid] = []
    for pairs in _pair_chunks(model, sweeps):
        patched += _patched(model, [sweeps[i] for i in pairs], [metrics[i] for i in pairs], False, False, only=chosen)
        done(len(patched))
    return patched


def _attribution_method(steps: int) -> str:
    return "attribution patching" + (f", integrated gradients ({steps} steps)" if steps > 1 else "")


class _PairMetric:
    """A pair's metric: the caller's, or the logit difference of the pair's answers at the last position, as given or
    else each run's top prediction, the corrupt run's read from the first logits it is given (the corrupt run's)."""

    def __init__(self, sweep: _Sweep, clean_logits: torch.Tensor, metric: Metric | None):
        self.sweep, self.clean_logits, self.metric = sweep, clean_logits, metric
        self.answers: tuple[int, int] | None = None

    def __call__(self, logits: torch.Tensor) -> float | torch.Tensor:
        if self.metric is not None:
            return self.metric(logits)
        if self.answers is None:
            self.answers = self.sweep.answers(self.clean_logits, logits.detach())
        return logit_diff(*self.answers)(logits)

    def name(self, model: Any) -> str:
        return _metric_name(model, self.metric, self.answers)


def _traces(model: Any, prompts: Sequence[list[int]], record: Sequence[str]) -> list[Any]:
    """Each prompt's Trace: one prompt runs alone (the production forward's bits), more in batched forwards."""
    if len(prompts) == 1:
        return [model.run(prompts[0], record=record)]
    return model.run_batch(prompts, record=record)


def _attributed(model: Any, sweeps: Sequence[_Sweep], metrics: Sequence[Metric | None], steps: int) -> list[_PairGrid]:
    """Each pair's attribution patching grid, the pairs' forwards and backwards batched."""
    names = sweeps[0].names
    inputs = _input_points(model.config) if steps > 1 else []
    cleans = _traces(model, [s.clean_ids for s in sweeps], [*names, *inputs])
    chosen = [_PairMetric(s, clean.logits, m) for s, clean, m in zip(sweeps, cleans, metrics)]
    corrupt_ids = [s.corrupt_ids for s in sweeps]
    if steps == 1:
        runs = ([model.run_with_gradients(corrupt_ids[0], chosen[0], names)] if len(sweeps) == 1
                else model.run_with_gradients_batch(corrupt_ids, chosen, names))
        corrupt_values, corrupt_metrics = [r.activations for r in runs], [r.metric for r in runs]
        gradients = [r.gradients for r in runs]
    else:
        corrupts = _traces(model, corrupt_ids, [*names, *inputs])
        corrupt_values = [t.activations for t in corrupts]
        corrupt_metrics = [_scalar(metric(t.logits)) for metric, t in zip(chosen, corrupts)]
        between = [[FunctionHook(name, _interpolation(corrupt.activations[name], clean.activations[name],
                                                      (step + 0.5) / steps)) for name in inputs]
                   for clean, corrupt in zip(cleans, corrupts) for step in range(steps)]
        runs = model.run_with_gradients_batch([ids for ids in corrupt_ids for _ in range(steps)],
                                              [metric for metric in chosen for _ in range(steps)], names,
                                              per_prompt_interventions=between)
        gradients = [{name: torch.stack([run.gradients[name] for run in runs[i * steps:(i + 1) * steps]]).mean(0)
                      for name in names} for i in range(len(sweeps))]
    grids = []
    for sweep, clean, metric, values, corrupt_metric, gradient in zip(sweeps, cleans, chosen, corrupt_values,
                                                                      corrupt_metrics, gradients):
        if metric.answers is not None:
            sweep.checked(metric.answers)
        effects = {name: _first_order_effect(clean.activations[name], values[name], gradient[name]) for name in names}
        cells = sweep.cells()
        grid = torch.empty(len(cells))
        for n, (_, name, pos, head) in enumerate(cells):
            region = [slice(None)] * effects[name].dim()
            for axis, index in ((axes(name).token, pos), (axes(name).head, head)):
                if index is not None:
                    region[axis] = index
            grid[n] = corrupt_metric + float(effects[name][tuple(region)].sum())
        grids.append(_PairGrid(grid, _scalar(metric(clean.logits)), corrupt_metric, metric.name(model)))
    return grids


# Pairs a batched gradient call takes, each row's activations and gradients at the swept points kept until its pair's
# grid is taken: a dataset of pairs runs in chunks of rows (a pair's integrated-gradient steps are a row each).
_GRADIENT_ROWS = 32


def dataset_patching(model: Any, pairs: Sequence[tuple[Prompt, Prompt]],
                     metric: Metric | Sequence[Metric] | None = None, *, method: str = "activation", steps: int = 1,
                     over: Sequence[str] = ("layers", "positions"), hook: str | None = None,
                     layers: Sequence[int] | None = None, positions: Sequence[int] | None = None,
                     answers: Sequence[tuple[int | str, int | str]] | None = None, normalize: bool = False,
                     verify: int = 0, progress: bool | ProgressFn = True) -> PatchingResult:
    """``patching_sweep`` (``method="activation"``) or ``attribution_patching`` (``"attribution"``, with its
    ``steps``) over a dataset of ``(clean, corrupt)`` pairs: the grid and the clean and corrupt metrics are the means
    of each pair's, as the single-pair call gives them, and ``normalize`` divides by the mean change (as EAP
    normalizes). ``metric`` is one function for every pair or a list of one per pair; ``answers`` a list of one
    ``(clean answer, corrupt answer)`` per pair (default: each run's top prediction). A sweep over positions takes
    pairs of one token count (a template filled in); one over ``("layers", "heads")`` takes any. Attribution runs
    the pairs' forwards and backwards batched, activation patching each pair's cells; attribution's ``verify=k``
    patches the k cells of the largest mean estimate in every pair. Errors name the pair."""
    steps = check_patching_method(method, steps, verify)
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not pairs:
        raise HookError(f"pairs must be a non-empty list of (clean, corrupt) prompt pairs, got {shorten(pairs)}")
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes, dict)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise HookError(f"pair {i}: a pair is (clean prompt, corrupt prompt), got {shorten(pair)}")
    metrics = list(metric) if isinstance(metric, (list, tuple)) else [metric] * len(pairs)
    if len(metrics) != len(pairs):
        raise HookError(f"metric must be one function or a list of one per pair ({len(pairs)}), got {len(metrics)}")
    for m in metrics:
        _check_metric(m)
    if answers is not None and (isinstance(answers, (str, bytes)) or not isinstance(answers, Sequence)
                                or len(answers) != len(pairs)):
        raise HookError(f"answers must be a list of one (clean answer, corrupt answer) per pair ({len(pairs)}), "
                        f"got {shorten(answers)}")
    sweeps = _sweeps(model, pairs, over, hook, layers, positions, answers or [None] * len(pairs))
    n_cells = len(sweeps[0].cells())  # every pair's count: positions swept take pairs of one length
    top = _checked_verify(verify, n_cells)
    check_progress(progress)
    if method == "attribution":
        grids: list[_PairGrid] = []
        chunk = max(1, _GRADIENT_ROWS // steps)
        # pairs attributed, then pairs verified
        update, close = progress_callback(progress, len(sweeps) * (2 if top else 1), "pairs")
        try:
            for start in range(0, len(sweeps), chunk):
                grids += _attributed(model, sweeps[start:start + chunk], metrics[start:start + chunk], steps)
                update(len(grids))
            patched = _verified(model, sweeps, metrics, grids, top, lambda done: update(len(sweeps) + done))
        finally:
            close()
        return _result(model, sweeps, grids, normalize, _attribution_method(steps), patched)
    update, close = progress_callback(progress, n_cells * len(sweeps), "cells")
    try:
        grids = []
        for pairs in _pair_chunks(model, sweeps):
            grids += _patched(model, [sweeps[i] for i in pairs], [metrics[i] for i in pairs], False,
                              lambda done, total, before=len(grids): update(before * n_cells + done))
    finally:
        close()
    return _result(model, sweeps, grids, normalize, "activation patching")


def _input_points(config: Any) -> list[str]:
    """The points that hold a run's inputs, everything computed from the token ids before the first block: the
    embeddings, and Gemma 4 E2B/E4B's per-layer inputs (their token embeddings would stay the corrupt run's if only
    the embeddings moved)."""
    per_layer = [f"blocks.{i}.per_layer.hook_input" for i in range(config.n_layers)] if config.d_per_layer else []
    return ["hook_embed", *per_layer]


def _interpolation(start: torch.Tensor, end: torch.Tensor, fraction: float) -> Callable:
    """A hook that puts ``start + fraction * (end - start)`` in place of the activation."""
    value = start + fraction * (end - start)

    def interpolate(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        return value.to(x.device, x.dtype)

    return interpolate


def _first_order_effect(clean: torch.Tensor, corrupt: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """``(clean - corrupt) * gradient`` per value, 0 where the two runs agree (the masked scores, -inf in both, whose
    difference would be NaN)."""
    return torch.where(clean == corrupt, 0.0, (clean - corrupt) * gradient)


Cell = tuple[int, str, "int | None", "int | None"]  # (layer, hook point, position or None for all, head or None)

# What one more forward costs beyond its blocks' arithmetic (its layout, cache rows, positions and patches: Python, and
# on a GPU the launches of small kernels), as FLOPs of arithmetic in the same time, weighed by ``_segments`` against the
# blocks a later cell recomputes when it joins an earlier forward. On the CPU's 2 threads it took what 30 to 40 tokens
# of an embedded-model block take (docs/batches.md, "Patching sweeps"); CUDA's is an estimate (3 ms of an H100).
FORWARD_FLOPS = {"cpu": 3e8, "cuda": 1e11}
# What a forward whose rows continue from cache rows costs beyond one whose rows start at the first token, as FLOPs of
# arithmetic in the same time, weighed by ``_first_positions`` against the tokens before the cells' positions. On CUDA
# a batch with no cache takes one attention launch a layer over its packed rows, and one with a cache the padded path's
# some 25: about 40 ms of host time a forward of the embedded model on an H200 (docs/batches.md, "Patching sweeps").
# On the CPU both are one C++ call a layer.
CACHED_FORWARD_FLOPS = {"cpu": 0.0, "cuda": 1e12}


@dataclass
class _CorruptRun:
    logits: torch.Tensor  # [T, vocab] float32, on the CPU
    cache: KVCache | None  # every layer's keys and values, where the cells continue from them
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


def _corrupt_run(model: Any, ids: list[int], starts: set[int], keep_cache: bool) -> _CorruptRun:
    """The corrupt prompt's forward, keeping the residual stream entering each of ``starts``, and its keys and values
    where ``keep_cache``."""
    resid: dict[int, torch.Tensor] = {}

    def keep(x: torch.Tensor, ctx: HookContext) -> None:
        resid[ctx.layer] = x

    hooks = {f"blocks.{layer}.hook_resid_pre": [keep] for layer in starts if layer}
    cache = model.runner.new_cache(len(ids)) if keep_cache else None
    with torch.inference_mode(), model.numerics_scope():
        logits = model.runner.forward(torch.tensor(ids, dtype=torch.long), cache=cache, hooks=hooks or None)
    return _CorruptRun(logits.cpu(), cache, resid)


def _corrupt_runs(model: Any, sweeps: Sequence[_Sweep], starts: set[int], keep_cache: bool) -> list[_CorruptRun]:
    """Each pair's corrupt run (``_corrupt_run``): one forward a pair where the cells continue from its keys and
    values, else the pairs' prompts in batched forwards, each keeping the residual stream entering ``starts``."""
    if keep_cache or len(sweeps) == 1:
        return [_corrupt_run(model, s.corrupt_ids, starts, keep_cache) for s in sweeps]
    layers = sorted(layer for layer in starts if layer)
    traces = model.run_batch([s.corrupt_ids for s in sweeps], record=[f"blocks.{i}.hook_resid_pre" for i in layers])
    return [_CorruptRun(t.logits, None, {i: t.activations[f"blocks.{i}.hook_resid_pre"] for i in layers})
            for t in traces]


# The clean runs' recorded activations a call of several pairs keeps at once (``_pair_chunks``).
DONOR_BYTES = 1 << 28


def _pair_chunks(model: Any, sweeps: Sequence[_Sweep]) -> list[range]:
    """The pairs in chunks whose clean runs' recorded points take at most ``DONOR_BYTES``, to be patched together."""
    c = model.config
    per_pair = 4 * c.d_model * len(sweeps[0].names) * max(len(s.clean_ids) for s in sweeps)
    size = max(1, DONOR_BYTES // per_pair)
    return [range(i, min(i + size, len(sweeps))) for i in range(0, len(sweeps), size)]


def _block_flops_per_token(c: Any) -> float:
    """A block's arithmetic for one token: twice its weights (the embedding and unembedding left out)."""
    return 2 * (c.n_params - c.vocab_size * c.d_model * (1 if c.tied_embeddings else 2)) / c.n_layers


def _first_positions(model: Any, cells: Sequence[Cell]) -> list[int]:
    """The first position of the corrupt prompt each cell's row runs: the cell's own, its cache row seeded with the
    corrupt run's keys and values before it; or 0 for every cell, with no cache, where the tokens before the cells'
    positions cost less to recompute through their blocks than cache rows cost a forward (``CACHED_FORWARD_FLOPS``)."""
    first = [pos or 0 for _, _, pos, _ in cells]
    blocks = [model.config.n_layers - _start_of(model, cell[0]) for cell in cells]  # the blocks each row runs
    recomputed = _block_flops_per_token(model.config) * sum(p * n for p, n in zip(first, blocks))
    return [0] * len(cells) if recomputed < CACHED_FORWARD_FLOPS.get(model.runner.device.type, 0.0) else first


def _continued_cells(model: Any, cells: Sequence[Cell], first: Sequence[int], cleans: Sequence[Any],
                     corrupts: Sequence[_CorruptRun], sweeps: Sequence[_Sweep], metrics: Sequence[Metric],
                     answer_pairs: Sequence[tuple[int, int] | None], progress: bool | ProgressFn) -> torch.Tensor:
    """Each pair's metric of each cell, ``[pairs, cells]``, the cell continuing its pair's corrupt run from its block
    and position ``first`` (at or before its own) as a row of batched forwards. The rows (in chunks that fit memory)
    pass through the blocks in segments (``_segments``): a row joins at the start of the segment holding its layer, from
    its corrupt run's residual stream there, its cache row seeded with that run's keys and values before its first
    position; each segment goes on from the stream the last one stopped at. The pairs' rows share forwards."""
    runner, n_cells = model.runner, len(cells)
    # a row u: pair u // n_cells, cell u % n_cells
    units = range(len(sweeps) * n_cells)
    pair = [u // n_cells for u in units]
    layer = [cells[u % n_cells][0] for u in units]
    begin = [first[u % n_cells] for u in units]  # the first position each row runs
    lengths = [len(sweeps[p].corrupt_ids) for p in pair]
    last_only = all(answer_pairs)
    answer_ids = columns = None
    if last_only:  # the default metrics take their answers' logits alone: one small copy back
        ids = sorted({i for answers in answer_pairs for i in answers})
        answer_ids = torch.tensor(ids, device=runner.output_device)
        columns = torch.tensor([[ids.index(a) for a in answers] for answers in answer_pairs])
    # each point's recordings [pairs, positions, ...], a shorter prompt's padded with zeros
    donors = {name: pad_sequence([clean.activations[name] for clean in cleans], batch_first=True).to(
        model.point_device(name), model.dtype) for _, name, _, _ in cells}
    grid = torch.empty(len(sweeps) * n_cells)
    update, close = progress_callback(progress, len(grid), "cells")
    done = 0
    try:
        for chunk in _chunks(model, sorted(units, key=lambda u: (layer[u], begin[u])), begin, lengths, last_only):
            rows: list[int] = []  # the forward's rows, in order: each segment's joining ones are appended
            x = None
            for start, stop, joining in _segments(model, chunk, layer, begin, lengths):
                rows += joining
                cached = [begin[u] for u in rows]
                layout = BatchLayout([lengths[u] - begin[u] for u in rows], runner.device, cached=cached)
                cache = (BatchKVCache.from_prefixes([corrupts[pair[u]].cache for u in rows], cached,
                                                    max(cached) + layout.width, range(start, stop))
                         if any(cached) else None)
                ids = torch.tensor([t for u in rows for t in sweeps[pair[u]].corrupt_ids[begin[u]:]], dtype=torch.long)
                if start:  # rows so far go on from where the last segment stopped, joining ones from their runs
                    stream = ([] if x is None else [x]) + [corrupts[pair[u]].resid[start][begin[u]:]
                                                           for u in joining]
                    x = torch.cat([part.to(runner.devices[start], model.dtype) for part in stream])
                patched = [(b, pair[u], cells[u % n_cells], begin[u]) for b, u in enumerate(rows)
                           if start <= layer[u] < stop]
                with torch.inference_mode(), model.numerics_scope():
                    x = runner.forward(ids, cache=cache, hooks=_patch_hooks(model, patched, layout, donors),
                                       layout=layout, last_logits_only=last_only, start_at_layer=start, resid=x,
                                       stop_at_layer=stop if stop < model.config.n_layers else None,
                                       logit_ids=answer_ids)
            if last_only:
                chosen = columns[[pair[u] for u in rows]]
                x = x.cpu()
                grid[rows] = x.gather(1, chosen[:, :1])[:, 0] - x.gather(1, chosen[:, 1:])[:, 0]
            else:  # a metric of every position sees the corrupt run's logits before the row's first position
                logits = x.cpu()
                for b, u in enumerate(rows):
                    before = corrupts[pair[u]].logits[:begin[u]]
                    grid[u] = _scalar(metrics[pair[u]](torch.cat((before, logits[layout.rows(b)]))))
            done += len(chunk)
            update(done)
    finally:
        close()
    return grid.view(len(sweeps), n_cells)


def _chunks(model: Any, order: list[int], first: Sequence[int], lengths: Sequence[int],
            last_only: bool) -> list[list[int]]:
    """The rows ``order`` (by layer, then position) in chunks that fit one forward, all of them at once: within
    ``model.max_batch_tokens()`` padded tokens, and ``model.batch_bytes`` for activations, attention scores and cache
    rows. Row ``u`` runs its prompt's ``lengths[u]`` tokens from ``first[u]``."""
    c = model.config
    per_token, per_score, budget = model.batch_bytes(vocab_rows=not last_only)
    element = torch.finfo(model.dtype).bits // 8
    slot_bytes = element * 2 * sum(math.prod(c.layer_heads(i)) for i in range(c.n_layers))  # a row's cache slot
    chunks, chunk, width, prefix = [], [], 0, 0  # width: the chunk's longest row; prefix: its longest cached prefix
    for u in order:
        grown_width, grown_prefix = max(width, lengths[u] - first[u]), max(prefix, first[u])
        rows = len(chunk) + 1
        padded, slots = rows * grown_width, grown_prefix + grown_width
        if chunk and (padded > model.max_batch_tokens()
                      or padded * (per_token + per_score * slots) + rows * slots * slot_bytes > budget):
            chunks.append(chunk)
            chunk, grown_width, grown_prefix = [], lengths[u] - first[u], first[u]
        chunk.append(u)
        width, prefix = grown_width, grown_prefix
    return chunks + [chunk]


def _segments(model: Any, rows: Sequence[int], layer: Sequence[int], first: Sequence[int], lengths: Sequence[int]
              ) -> list[tuple[int, int, list[int]]]:
    """The blocks split into forwards ``(start, stop, the rows joining at start)``, each going on from the last one's
    stream, so that the tokens run through blocks plus the forwards (``FORWARD_FLOPS``' worth of tokens each) are
    fewest. A row joins at the start of its layer's segment, recomputing the blocks from there to its own (the patch
    lies past them). A forward is cheap against the arithmetic on the CPU and for large models: about a segment per
    layer; for a small model on a GPU, whose blocks are bound by kernel launches, one forward from the first layer."""
    c = model.config
    setup = FORWARD_FLOPS.get(model.runner.device.type, FORWARD_FLOPS["cuda"]) / _block_flops_per_token(c)
    tokens: dict[int, int] = {}  # layer -> its rows' tokens
    for u in rows:
        tokens[layer[u]] = tokens.get(layer[u], 0) + lengths[u] - first[u]
    # where a segment may start: the first row's start, and each later swept layer a forward can start at
    starts = [_start_of(model, min(tokens))]
    starts += [i for i in sorted(tokens) if i > starts[0] and model.runner.can_start_at_layer(i)]
    bounds = starts + [c.n_layers]
    # active[j]: the tokens of the rows whose layer lies before bounds[j], all running in a segment that ends there
    active = [sum(t for i, t in tokens.items() if i < bound) for bound in bounds]
    cost, split = [0.0] + [math.inf] * (len(bounds) - 1), [0] * len(bounds)
    for j in range(1, len(bounds)):
        for i in range(j):
            here = cost[i] + setup + (bounds[j] - bounds[i]) * active[j]
            if here < cost[j]:
                cost[j], split[j] = here, i
    segments, j = [], len(bounds) - 1
    while j:
        i = split[j]
        joining = [u for u in rows if bounds[i] <= layer[u] < bounds[j]]
        segments.append((bounds[i], bounds[j], joining))
        j = i
    return segments[::-1]


def _patch_hooks(model: Any, patched: Sequence[tuple[int, int, Cell, int]], layout: BatchLayout,
                 donors: dict[str, torch.Tensor]) -> dict[str, list] | None:
    """One hook per patched point of a forward, ``(b, pair, cell, first)`` of ``patched`` naming row ``b``'s pair and
    cell and the corrupt prompt's position the row starts at: the hook writes the pair's clean activation (``donors``,
    ``[pairs, positions, ...]``) into all its rows' cells at once (every position from the row's first where the cell
    names none)."""
    edits: dict[str, tuple[list[int], list[int], list[int], list[int]]] = {}
    for b, pair, (_, name, pos, head), first in patched:
        dst, pairs, src, heads = edits.setdefault(name, ([], [], [], []))
        positions = range(first, first + layout.lengths[b]) if pos is None else [pos]
        dst += [layout.starts[b] + p - first for p in positions]
        pairs += [pair] * len(positions)
        src += list(positions)
        heads += [head] * len(positions)
    hooks = {}
    for name, (dst, pairs, src, heads) in edits.items():
        device = model.point_device(name)
        index = (torch.tensor(dst, device=device),)
        if heads[0] is not None:
            index += (torch.tensor(heads, device=device),)
        values = donors[name][torch.tensor(pairs, device=device), torch.tensor(src, device=device), *index[1:]]
        hooks[name] = [_writer(index, values)]
    return hooks or None


def _writer(index: tuple[torch.Tensor, ...], values: torch.Tensor):
    def write(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        x = x.clone()
        x[index] = values.to(x.dtype)
        return x

    return write


def _checked(positions: Sequence[int], n_tokens: int) -> list[int]:
    out = integer_list(positions, "positions", HookError)
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
    index = integer(answer, "an answer (a token id or a single-token string)", HookError)
    if not 0 <= index < model.config.vocab_size:
        raise HookError(f"answer token id {index} out of range 0..{model.config.vocab_size - 1}")
    return index
