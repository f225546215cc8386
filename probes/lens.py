"""Logit lens: read the residual stream at every layer through the model's own final norm and unembedding.

At the last layer's ``resid_post`` the lens is exactly the model's output: the same RMSNorm (its scale
recomputed from the residual, as the forward does) and the same unembedding kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from workbench.errors import WorkbenchError, integer, shorten
from workbench.kernels import layer_ops, linear
from workbench.kernels.lens import ROWS_PER_CHUNK, top_k_probs
from workbench.runner import BatchLayout

from .activations import block_hook

POINTS = ("resid_pre", "resid_mid", "resid_post")  # forward order within a block


def final_norm(model: Any, resid: torch.Tensor) -> torch.Tensor:
    """The final RMSNorm of the model on a residual ``[..., d_model]``, op for op as the runner computes it."""
    x = resid.to(model.runner.output_device, model.dtype)
    return layer_ops.rms_norm(x, model.runner.weights.final_norm, model.config.rms_eps)[1]


def unembed(model: Any, normed: torch.Tensor) -> torch.Tensor:
    """Float32 logits of final-normed residuals ``[N, d_model]``, on the production unembedding kernel, in the model's
    numerics (``Model.current_numerics``)."""
    with model.numerics_scope():
        logits = linear(normed, model.runner.unembed).float()
    cap = model.config.final_softcap
    return logits if not cap else layer_ops.soft_cap(logits, cap)


def token_id(model: Any, token: int | str) -> int:
    """A token id from an id or from text that is exactly one token (" Paris")."""
    if isinstance(token, str):
        ids = model.tokenize(token, add_bos=False)
        if len(ids) != 1:
            raise WorkbenchError(f"{token!r} is {len(ids)} tokens {ids}, not one; pass a token id or a single-token "
                                 "string (mind the leading space)")
        return ids[0]
    message = f"token must be an id in 0..{model.config.vocab_size - 1} or a string, got {shorten(token)}"
    try:
        index = integer(token, "token")  # numpy and torch integers too
    except WorkbenchError:
        raise WorkbenchError(message) from None
    if not 0 <= index < model.config.vocab_size:
        raise WorkbenchError(message)
    return index


def check_position(position: int, n_tokens: int, prefix: str = "") -> int:
    """``position`` (an integer, negative from the end) within a prompt of ``n_tokens``, or a clear error (``prefix``
    names the prompt of a batch)."""
    position = integer(position, "position")
    if not -n_tokens <= position < n_tokens:
        raise WorkbenchError(f"{prefix}position {position} is out of range for a prompt of {n_tokens} tokens")
    return position


def token_ids(model: Any, tokens: Sequence[int | str], what: str = "tokens") -> list[int]:
    """Token ids of a list of tokens (see ``token_id``); a single string is refused, not read character by
    character."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise WorkbenchError(f"{what} must be a list of tokens (ids or single-token strings), got {shorten(tokens)}")
    return [token_id(model, t) for t in tokens]


@dataclass
class TokenTrack:
    """Probability and rank (0 = top) of chosen tokens at every layer and position: ``[tokens, layers, positions]``."""

    token_ids: list[int]
    token_texts: list[str]
    prompt_tokens: list[str]
    point: str
    probs: torch.Tensor
    ranks: torch.Tensor

    def figure(self, position: int = -1):
        """Probability of each token across depth at one position (rank in the hover)."""
        import plotly.graph_objects as go

        position = check_position(position, self.probs.shape[2])
        fig = go.Figure()
        layers = list(range(self.probs.shape[1]))
        for i, text in enumerate(self.token_texts):
            fig.add_trace(go.Scatter(
                x=layers, y=self.probs[i, :, position].tolist(), mode="lines+markers", name=repr(text),
                customdata=self.ranks[i, :, position].tolist(),
                hovertemplate="layer %{x}: p=%{y:.4f}, rank %{customdata}<extra>" + repr(text) + "</extra>"))
        fig.update_layout(title=f"Logit lens at token {self.prompt_tokens[position]!r} ({self.point})",
                          xaxis_title="layer", yaxis_title="probability", template="plotly_white")
        return fig


@dataclass
class LogitLens:
    """Top-k predictions of the lens at each (point, layer, position); see :func:`logit_lens`."""

    model: Any = field(repr=False)
    ids: list[int]
    tokens: list[str]
    points: tuple[str, ...]
    normed: dict[str, torch.Tensor] = field(repr=False)  # final-normed residuals per point, [layers, positions, d]
    top_ids: dict[str, torch.Tensor] = field(repr=False)  # [layers, positions, k]
    top_probs: dict[str, torch.Tensor] = field(repr=False)

    @property
    def probs(self) -> torch.Tensor:
        """Top-k probabilities ``[layers, positions, k]`` at the first point."""
        return self.top_probs[self.points[0]]

    def _point(self, point: str | None) -> str:
        point = point or self.points[0]
        if point not in self.points:
            raise WorkbenchError(f"this lens was computed at {list(self.points)}, not {point!r}")
        return point

    def _index(self, value: int, what: str, size: int) -> int:
        index = integer(value, what)
        if not -size <= index < size:
            raise WorkbenchError(f"{what} {index} is out of range for {size} {what}s")
        return index

    def top_tokens(self, layer: int = -1, position: int = -1, point: str | None = None) -> list[int]:
        """Token ids the lens predicts at a layer and position, best first."""
        ids = self.top_ids[self._point(point)]
        return ids[self._index(layer, "layer", ids.shape[0]), self._index(position, "position", ids.shape[1])].tolist()

    def logits(self, layer: int, point: str | None = None) -> torch.Tensor:
        """Full lens logits ``[positions, vocab]`` at one layer."""
        normed = self.normed[self._point(point)]
        return unembed(self.model, normed[self._index(layer, "layer", normed.shape[0])]).cpu()

    def track_token(self, token: int | str, point: str | None = None) -> TokenTrack:
        """Rank and probability of one token across depth, at every position."""
        return self.track_race([token], point)

    def track_race(self, tokens: Sequence[int | str], point: str | None = None) -> TokenTrack:
        """Probabilities (and ranks) of several candidate tokens across depth, at every position."""
        point = self._point(point)
        ids = token_ids(self.model, tokens)  # track_token takes one
        if not ids:
            raise WorkbenchError("track_race needs at least one token")
        chosen = torch.tensor(ids, device=self.normed[point].device)
        probs, ranks = [], []
        for logits in _layer_logits(self.model, self.normed[point]):
            target = logits[:, chosen]  # [positions, tokens]
            probs.append((target - logits.logsumexp(-1, keepdim=True)).exp().T)
            ranks.append((logits[:, None, :] > target[:, :, None]).sum(-1).T)
        return TokenTrack(ids, self.model.token_texts(ids), self.tokens, point,
                          torch.stack(probs, 1).cpu(), torch.stack(ranks, 1).cpu())

    def figure(self, point: str | None = None):
        """Heatmap layers x positions coloured by the top token's probability; hover lists the top-k."""
        import plotly.graph_objects as go

        point = self._point(point)
        top_ids, top_probs = self.top_ids[point], self.top_probs[point]
        n_layers, n_pos, k = top_ids.shape
        texts = [[self.model.token_texts(top_ids[l, t].tolist()) for t in range(n_pos)] for l in range(n_layers)]
        hover = [[f"layer {l}, after {self.tokens[t]!r}<br>" + "<br>".join(
            f"{repr(texts[l][t][j])} {float(top_probs[l, t, j]):.3f}" for j in range(k))
            for t in range(n_pos)] for l in range(n_layers)]
        fig = go.Figure(go.Heatmap(
            z=top_probs[:, :, 0].tolist(), x=list(range(n_pos)), y=list(range(n_layers)), zmin=0, zmax=1,
            colorscale="Blues", text=[[row[0] for row in layer] for layer in texts], texttemplate="%{text}",
            customdata=hover, hovertemplate="%{customdata}<extra></extra>", colorbar_title="top-1 p"))
        fig.update_layout(title=f"Logit lens ({point})", xaxis_title="position", yaxis_title="layer",
                          template="plotly_white", height=max(400, 22 * n_layers))
        fig.update_xaxes(tickvals=list(range(n_pos)), ticktext=[repr(t) for t in self.tokens])
        return fig


def _layer_logits(model: Any, normed: torch.Tensor) -> Iterator[torch.Tensor]:
    """Lens logits ``[positions, vocab]`` of each layer (on the model's device), unembedding several layers per kernel
    call."""
    n_layers, n_pos, d = normed.shape
    per_chunk = max(1, ROWS_PER_CHUNK // n_pos)
    for start in range(0, n_layers, per_chunk):
        block = normed[start:start + per_chunk]
        logits = unembed(model, block.reshape(-1, d)).view(block.shape[0], n_pos, -1)
        yield from logits


def logit_lens(model: Any, prompt: str | Sequence[int], points: str | Sequence[str] = ("resid_post",), k: int = 10,
               chat: bool = False, tuned: Any | None = None) -> LogitLens:
    """Run the prompt once and read every layer's residual (at ``points``) through the final norm and unembedding.

    With ``tuned`` (a :class:`TunedLens`), each layer's ``resid_post`` first goes through its translator.
    """
    points, names = _lens_points(model, points, k, tuned)
    trace = model.run(prompt, record=[n for group in names.values() for n in group], chat=chat)
    layout = BatchLayout([len(trace.ids)], model.runner.output_device)
    lens = _PackedLens(model, points, k, tuned, [trace.ids])
    for layer in range(model.config.n_layers):  # in forward order, as the hooks of a forward would see them
        for point in points:
            lens.add(layout, point, layer, trace.activations[names[point][layer]])
    return lens.results([trace.ids])[0]


def logit_lens_batch(model: Any, prompts: Sequence[str | Sequence[int]], points: str | Sequence[str] = ("resid_post",),
                     k: int = 10, chat: bool = False, tuned: Any | None = None, batch_size: int | None = None,
                     progress: Any = False) -> list[LogitLens]:
    """``logit_lens`` of every prompt: the prompts run in batched forwards whose hooks take the lens of each whole
    forward as it runs (``_PackedLens``), with no trace per prompt. Positions that prompts of a forward share (the
    same tokens up to there: a template, a contrastive pair's start) are unembedded once."""
    points, names = _lens_points(model, points, k, tuned)
    ids = model.batch_ids(prompts, chat)
    lens = _PackedLens(model, points, k, tuned, ids)
    model.run_with_batch_hooks(ids, {name: lens.hook(point, layer) for point, group in names.items()
                                     for layer, name in enumerate(group)}, batch_size=batch_size, progress=progress,
                               logits=False)
    return lens.results(ids)


# On CUDA the lens of every LENS_GROUP hooked points is launched as soon as the forward has passed them, so the GPU
# takes it while the host is still launching the forward's later layers. Task (d) of bench/vs_transformerlens.py on an
# H100 (`python bench/lens_kernel.py --device cuda --groups 1,3,5,10,30`, median ms): 73 after each layer (each launch
# costs the host a few ops), 63 every 3, 57 every 5, 60 every 10, 70 once after the forward. Elsewhere one call after
# the forward: the CPU gains nothing from it, and each call dequantizes the unembedding.
LENS_GROUP = 5


@dataclass
class _LensForward:
    """One forward's lens buffers, ``[points x layers in forward order, N, ...]`` for its ``N`` packed tokens."""

    layout: BatchLayout
    normed: torch.Tensor
    probs: torch.Tensor
    ids: torch.Tensor
    distinct: tuple[torch.Tensor, torch.Tensor] | None  # distinct_prefixes of the layout


class _PackedLens:
    """The lens of batched forwards from whole-forward hooks (``Model.run_with_batch_hooks``): each hooked point's
    residual goes into its forward's buffer, and once a group of them is complete they are final-normed in place and
    their top-k launched."""

    def __init__(self, model: Any, points: tuple[str, ...], k: int, tuned: Any | None, ids: Sequence[Sequence[int]]):
        self.model, self.points, self.k, self.tuned, self.prompt_ids = model, points, k, tuned, ids
        self.n_points = len(points) * model.config.n_layers
        on_cuda = model.runner.output_device.type == "cuda"
        self.group = LENS_GROUP if on_cuda else self.n_points
        self.forwards: list[_LensForward] = []
        self.kept_weight: dict = {}  # the unembedding as the fused top-k reads it, made once for all groups

    def hook(self, point: str, layer: int) -> Callable[[torch.Tensor, Any], None]:
        return lambda x, ctx: self.add(ctx.layout, point, layer, x)

    def add(self, layout: BatchLayout, point: str, layer: int, resid: torch.Tensor) -> None:
        """One point's residual of the forward of ``layout``, the points coming in forward order."""
        index = layer * len(self.points) + self.points.index(point)  # forward order: layer by layer, points in order
        forward = self._forward(layout, resid)
        forward.normed[index] = resid  # normed in place with the rest of its group: one norm a group, not a point
        if (index + 1) % self.group == 0 or index + 1 == self.n_points:
            self._top_k(forward, index + 1 - ((index % self.group) + 1), index + 1)

    def _forward(self, layout: BatchLayout, x: torch.Tensor) -> _LensForward:
        if not self.forwards or self.forwards[-1].layout is not layout:
            device, n = self.model.runner.output_device, x.shape[0]
            self.forwards.append(_LensForward(
                layout, torch.empty(self.n_points, n, x.shape[-1], dtype=self.model.dtype, device=device),
                torch.empty(self.n_points, n, self.k, device=device),
                torch.empty(self.n_points, n, self.k, dtype=torch.long, device=device),
                distinct_prefixes(layout, self.prompt_ids, device)))
        return self.forwards[-1]

    def _top_k(self, forward: _LensForward, first: int, end: int) -> None:
        resid = forward.normed[first:end]
        if self.tuned is not None:  # it translates resid_post alone, so the points are the layers
            resid = self.tuned.translate(resid, first_layer=first)
        normed = forward.normed[first:end] = final_norm(self.model, resid)
        if forward.distinct is not None:
            normed = normed[:, forward.distinct[0]]
        with self.model.numerics_scope():
            probs, ids = top_k_probs(normed.reshape(-1, normed.shape[-1]), self.model.runner.unembed, self.k,
                                     self.model.config.final_softcap or None, self.kept_weight)
        probs, ids = probs.view(end - first, -1, self.k), ids.view(end - first, -1, self.k)
        if forward.distinct is not None:
            probs, ids = probs[:, forward.distinct[1]], ids[:, forward.distinct[1]]
        forward.probs[first:end], forward.ids[first:end] = probs, ids

    def results(self, ids: list[list[int]]) -> list[LogitLens]:
        """Each prompt's lens, in the prompts' order: its rows of its forwards (several for a prompt in chunks)."""
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        layers, n_points = self.model.config.n_layers, len(self.points)
        for forward in self.forwards:
            # [layers, points, N, ...], so that one point is [layers, N, ...]; the top-k read back once per forward
            normed, probs, top = (t.view(layers, n_points, *t.shape[1:])
                                  for t in (forward.normed, forward.probs.cpu(), forward.ids.cpu()))
            for b, prompt in enumerate(forward.layout.prompts):
                rows = forward.layout.rows(b)
                parts.setdefault(prompt, []).append((normed[:, :, rows], probs[:, :, rows], top[:, :, rows]))
        lenses = []
        for prompt, prompt_ids in enumerate(ids):
            normed, probs, top = (torch.cat(chunks, dim=2) if len(chunks) > 1 else chunks[0]
                                  for chunks in zip(*parts[prompt]))
            lenses.append(LogitLens(self.model, prompt_ids, self.model.token_texts(prompt_ids), self.points,
                                    *({point: x[:, j] for j, point in enumerate(self.points)}
                                      for x in (normed, top, probs))))
        return lenses


def distinct_prefixes(layout: BatchLayout, ids: Sequence[Sequence[int]], device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a forward whose prompts start alike, one packed row of each distinct prefix of tokens (a row's prompt up to
    and with its token) and, for every row, which of those holds its prefix; None when no two rows share one. A
    forward computes a prefix's rows the same in every prompt (its tokens, and kernels that take each row on its own),
    so the lens unembeds one of them."""
    child: dict[tuple[int, int], int] = {}  # (node, token) -> node: the prefixes as a tree
    row_of: dict[int, int] = {}  # node -> its place among the distinct rows
    distinct: list[int] = []
    inverse: list[int] = []
    for b, prompt in enumerate(layout.prompts):
        node, cached = -1, layout.cached[b]
        for j, token in enumerate(ids[prompt][:cached + layout.lengths[b]]):
            node = child.setdefault((node, token), len(child))
            if j >= cached:
                if node not in row_of:
                    row_of[node] = len(distinct)
                    distinct.append(layout.starts[b] + j - cached)
                inverse.append(row_of[node])
    if len(distinct) == layout.n_tokens:
        return None
    return torch.tensor(distinct, device=device), torch.tensor(inverse, device=device)


def _lens_points(model: Any, points: str | Sequence[str], k: int, tuned: Any | None
                 ) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """The lens points in forward order and the hook names of each, checked."""
    points = (points,) if isinstance(points, str) else tuple(points)
    bad = [p for p in points if p not in POINTS]
    if bad or not points:
        raise WorkbenchError(f"lens points must be among {POINTS}, got {list(points)}")
    points = tuple(p for p in POINTS if p in points)
    if tuned is not None:
        tuned.check_model(model)
        if points != ("resid_post",):
            raise WorkbenchError("a tuned lens translates resid_post only; use points=('resid_post',)")
    if not 1 <= integer(k, "k") <= model.config.vocab_size:
        raise WorkbenchError(f"k must be in 1..{model.config.vocab_size}, got {k}")
    return points, {p: [block_hook(model, layer, p) for layer in range(model.config.n_layers)] for p in points}
