"""Logit lens: read the residual stream at every layer through the model's own final norm and unembedding.

At the last layer's ``resid_post`` the lens is exactly the model's output: the same RMSNorm (its scale
recomputed from the residual, as the forward does) and the same unembedding kernel.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from workbench.errors import WorkbenchError
from workbench.kernels import layer_ops, linear
from workbench.kernels.lens import ROWS_PER_CHUNK, top_k_probs

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
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.config.vocab_size:
        raise WorkbenchError(f"token must be an id in 0..{model.config.vocab_size - 1} or a string, got {token!r}")
    return token


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

    def top_tokens(self, layer: int = -1, position: int = -1, point: str | None = None) -> list[int]:
        """Token ids the lens predicts at a layer and position, best first."""
        return self.top_ids[self._point(point)][layer, position].tolist()

    def logits(self, layer: int, point: str | None = None) -> torch.Tensor:
        """Full lens logits ``[positions, vocab]`` at one layer."""
        return unembed(self.model, self.normed[self._point(point)][layer]).cpu()

    def track_token(self, token: int | str, point: str | None = None) -> TokenTrack:
        """Rank and probability of one token across depth, at every position."""
        return self.track_race([token], point)

    def track_race(self, tokens: Sequence[int | str], point: str | None = None) -> TokenTrack:
        """Probabilities (and ranks) of several candidate tokens across depth, at every position."""
        point = self._point(point)
        ids = [token_id(self.model, t) for t in tokens]
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
    return _lenses(model, [trace], names, k, tuned)[0]


def logit_lens_batch(model: Any, prompts: Sequence[str | Sequence[int]], points: str | Sequence[str] = ("resid_post",),
                     k: int = 10, chat: bool = False, tuned: Any | None = None, batch_size: int | None = None,
                     progress: Any = False) -> list[LogitLens]:
    """``logit_lens`` of every prompt: the prompts run in batched forwards (``model.run_batch``), and every prompt's
    residuals go through the final norm and the unembedding together."""
    points, names = _lens_points(model, points, k, tuned)
    traces = model.run_batch(prompts, record=[n for group in names.values() for n in group], chat=chat,
                             batch_size=batch_size, logits="last", record_device=model.runner.output_device,
                             progress=progress)
    return _lenses(model, traces, names, k, tuned)


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
    if not 1 <= k <= model.config.vocab_size:
        raise WorkbenchError(f"k must be in 1..{model.config.vocab_size}, got {k}")
    return points, {p: [block_hook(model, layer, p) for layer in range(model.config.n_layers)] for p in points}


def _lenses(model: Any, traces: Sequence[Any], names: dict[str, list[str]], k: int, tuned: Any | None
            ) -> list[LogitLens]:
    """The lens of each trace. Every trace's positions are normed and unembedded together, the top-k taken on the
    model's device (``kernels.lens.top_k_probs``: no layer's full logits kept); each lens keeps its own slice."""
    sizes = [len(trace.ids) for trace in traces]
    device = model.runner.output_device
    normed = {}
    for point, group in names.items():
        # one op per layer, not per prompt: [layers, every prompt's positions, d]
        resid = torch.stack([torch.cat([t.activations[n] for t in traces]).to(device) for n in group])
        normed[point] = final_norm(model, resid if tuned is None else tuned.translate(resid))
    shape = next(iter(normed.values())).shape[:2]
    with model.numerics_scope():  # every point's rows in one call: the weight is dequantized once
        probs, ids = top_k_probs(torch.cat([x.reshape(-1, x.shape[-1]) for x in normed.values()]), model.runner.unembed,
                                 k, model.config.final_softcap or None)
    top_probs = dict(zip(names, probs.cpu().view(len(names), *shape, k)))
    top_ids = dict(zip(names, ids.cpu().view(len(names), *shape, k)))
    return [LogitLens(model, trace.ids, trace.tokens, tuple(names),
                      *({point: x[point][:, start:start + n] for point in names} for x in (normed, top_ids, top_probs)))
            for trace, start, n in zip(traces, itertools.accumulate([0] + sizes[:-1]), sizes)]
