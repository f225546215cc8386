"""The results layer: next-token distributions, top-k, KL, comparisons of two runs and activation summaries.

Every surface (the CLI, the dashboard, the MCP server) and ``Trace``'s own methods take these numbers from here, so
a KL or a top-k means the same thing wherever it is shown; the surfaces only format the results. It sits above
``workbench.hooks`` (it reads traces) and below the surfaces.

Probabilities come from a log-softmax of the logits in float64. KL and entropy are sums over the vocabulary of
``p * log-ratio`` terms taken from those log-probabilities, never from clamped probabilities: a token the first
distribution gives no probability adds 0, one only the second gives none makes the KL infinite, a NaN logit makes
the result NaN.

Results are small frozen dataclasses; ``to_dict()`` gives plain JSON-ready values. The MCP server derives its output
schemas from them (``workbench.mcp_server.schemas``), with the field descriptions given here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from workbench.errors import WorkbenchError, integer
from workbench.hooks.points import axes

# Rows of float64 log-probabilities worked on at once: [rows, vocab] stays near 32 MiB whatever the vocabulary.
_CHUNK_VALUES = 1 << 22


def _described(description: str) -> Any:
    """A required dataclass field carrying a description (the MCP schemas show it)."""
    return field(metadata={"description": description})


class Result:
    """What every result has: ``to_dict()`` for JSON."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class TokenProb(Result):
    """One token of a next-token distribution, with its log-probability and probability."""

    id: int
    token: str
    logprob: float
    prob: float


@dataclass(frozen=True)
class Distribution(Result):
    """A next-token distribution: its most likely tokens, most likely first, and its entropy."""

    top: list[TokenProb]
    entropy: float = _described("entropy in nats")


@dataclass(frozen=True)
class TokenChange(Result):
    """One token's log-probability in a baseline and an edited run (or trace A and trace B)."""

    id: int
    token: str
    baseline_logprob: float
    edited_logprob: float
    delta: float = _described("edited_logprob - baseline_logprob")

    @property
    def baseline_prob(self) -> float:
        return math.exp(self.baseline_logprob)

    @property
    def edited_prob(self) -> float:
        return math.exp(self.edited_logprob)

    @property
    def prob_delta(self) -> float:
        return self.edited_prob - self.baseline_prob


@dataclass(frozen=True)
class NextTokenComparison(Result):
    """How the next-token distribution moved from a baseline run to an edited one (or from A to B)."""

    baseline: Distribution
    edited: Distribution
    kl: float = _described("KL(baseline || edited) of the next-token distributions, nats")
    top1_changed: bool
    changes: list[TokenChange] = _described("tokens of either top-k, largest |delta| first")
    targets: list[TokenChange]
    baseline_top1: TokenChange = _described("the baseline's most likely token, in both runs")


@dataclass(frozen=True)
class HookDiff(Result):
    """How one activation recorded by both traces differs (non-finite entries left out)."""

    hook: str
    max_abs_diff: float
    relative_diff: float = _described("||a - b|| / ||a|| (inf where a is all zeros and b is not)")


@dataclass(frozen=True)
class TraceComparison(Result):
    """How two traces differ: next-token distributions, logits, and every activation both recorded.

    The next-token fields are of the last position. Logits are compared at every position when the traces are of
    the same tokens and both kept every position's (a batch run may keep the last one's alone), else at the last one.
    """

    same_tokens: bool
    top1_a: TokenProb
    top1_b: TokenProb
    kl: float = _described("KL(a || b) of the next-token distributions, nats")
    max_abs_logit_diff: float
    activations: list[HookDiff]
    max_abs_deviation: float = _described("largest |a - b| over the logits compared and every activation both "
                                          "recorded")
    worst_tensor: str = _described("where it occurs: 'logits' or a hook name")
    kl_per_position: list[float] | None = _described(
        "KL(a || b) at every position (None where logits are compared at the last one only, or when not asked for)")
    top1_changes: list[int] | None = _described(
        "positions whose most likely next token differs (None as for kl_per_position)")


@dataclass(frozen=True)
class ActivationSummary(Result):
    """Shape, norm and largest |value| of one recorded activation, and its norm at each token position."""

    hook: str
    shape: list[int]
    norm: float
    max_abs: float
    position_norms: list[float] = _described("L2 norm at each token position (empty when not asked for)")


# ---------------------------------------------------------------------------------------------- distributions


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last axis, in float64 (on the logits' device)."""
    return logits.detach().to(torch.float64).log_softmax(-1)


def probs(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis, in float64: ``log_probs(logits).exp()``."""
    return log_probs(logits).exp()


def _rowwise(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` over the rows of [..., vocab] tensors, a bounded number of rows at a time; shape [...]."""
    vocab = tensors[0].shape[-1]
    lead = tensors[0].shape[:-1]
    flat = [t.reshape(-1, vocab) for t in tensors]
    step = max(1, _CHUNK_VALUES // max(vocab, 1))
    parts = [fn(*(t[i:i + step] for t in flat)) for i in range(0, flat[0].shape[0], step)]
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64, device=tensors[0].device)
    return out.reshape(lead)


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    lp = log_probs(logits)
    p = lp.exp()
    return -torch.where(p == 0, torch.zeros_like(p), p * lp).sum(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row of logits [..., vocab] -> [...], float64."""
    return _rowwise(_entropy_rows, logits)


def _kl_rows(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp, lq = log_probs(p_logits), log_probs(q_logits)
    p = lp.exp()
    # p == 0 adds nothing (even where q is 0 too); a NaN stays NaN; p > 0 where q == 0 gives inf.
    terms = torch.where(p == 0, torch.zeros_like(p), p * (lp - lq))
    return terms.sum(-1).clamp_min(0.0)  # KL >= 0: a negative sum is rounding of two near-equal distributions


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum over the vocabulary of p * (log p - log q), in nats, for each row of two [..., vocab]
    logit tensors of one shape -> [...], float64 (0-d for two rows)."""
    if p_logits.shape != q_logits.shape:
        raise WorkbenchError(f"KL needs logits of one shape, got {list(p_logits.shape)} and {list(q_logits.shape)}")
    return _rowwise(_kl_rows, p_logits, q_logits.to(p_logits.device))


def _token_text(vocab: Any) -> Callable[[int], str]:
    """Token texts from a model or a tokenizer (anything with ``token_text``); empty strings without one."""
    if vocab is None:
        return lambda _: ""
    tokenizer = getattr(vocab, "tokenizer", vocab)
    return tokenizer.token_text


def _check_one_vocabulary(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two rows of logits to compare come from one vocabulary (one model's)."""
    if a.shape != b.shape:
        raise WorkbenchError(f"the vocabularies differ ({a.numel()} and {b.numel()} tokens): comparing logits needs "
                             "one model's")


def _row(logits: torch.Tensor) -> torch.Tensor:
    """One row of logits: a [vocab] tensor as it is, the last row of [positions, vocab]."""
    if logits.dim() == 2:
        if logits.shape[0] == 0:
            raise WorkbenchError("the logits hold no positions")
        return logits[-1]
    if logits.dim() != 1:
        raise WorkbenchError(f"expected logits [vocab] or [positions, vocab], got shape {list(logits.shape)}")
    return logits


def top_k(logits: torch.Tensor, k: int, vocab: Any = None) -> list[TokenProb]:
    """The ``k`` most likely next tokens of a row of logits ([vocab], or the last row of [positions, vocab]), most
    likely first, in ``torch.topk``'s order; ``vocab`` (a model or tokenizer) names them."""
    lp = log_probs(_row(logits))
    k = integer(k, "top_k")
    if not 0 <= k <= lp.numel():
        raise WorkbenchError(f"top_k must be between 0 and the vocabulary size {lp.numel()}, got {k}")
    values, indices = lp.topk(k)
    text = _token_text(vocab)
    return [TokenProb(id=i, token=text(i), logprob=v, prob=math.exp(v))
            for v, i in zip(values.tolist(), indices.tolist())]


def next_token(logits: torch.Tensor, k: int = 10, vocab: Any = None) -> Distribution:
    """The next-token distribution of a row of logits ([vocab], or the last row of [positions, vocab]): its top
    ``k`` and its entropy."""
    row = _row(logits)
    return Distribution(top=top_k(row, k, vocab), entropy=float(entropy(row)))


# -------------------------------------------------------------------------------------------------- comparisons


def compare_next_token(baseline_logits: torch.Tensor, edited_logits: torch.Tensor, vocab: Any = None, k: int = 10,
                       targets: Iterable[int] = ()) -> NextTokenComparison:
    """How the next-token distribution of ``edited_logits`` differs from that of ``baseline_logits`` (rows of
    logits as for ``next_token``): both top-k, KL(baseline || edited), the log-probability changes of the tokens in
    either top-k (largest |delta| first, at most ``k``) and of the ``targets`` (token ids)."""
    base_row, edit_row = _row(baseline_logits), _row(edited_logits)
    _check_one_vocabulary(base_row, edit_row)
    targets = [integer(i, "a target token id") for i in targets]
    outside = [i for i in targets if not 0 <= i < base_row.numel()]
    if outside:
        raise WorkbenchError(f"target token id {outside[0]} is outside the vocabulary [0, {base_row.numel()})")
    before, after = log_probs(base_row), log_probs(edit_row.to(base_row.device))
    baseline = Distribution(top=top_k(base_row, k, vocab), entropy=float(entropy(base_row)))
    edited = Distribution(top=top_k(edit_row, k, vocab), entropy=float(entropy(edit_row)))
    text = _token_text(vocab)

    def change(i: int) -> TokenChange:
        b, a = float(before[i]), float(after[i])
        return TokenChange(id=i, token=text(i), baseline_logprob=b, edited_logprob=a, delta=a - b)

    shown = dict.fromkeys(t.id for t in baseline.top + edited.top)
    changes = sorted((change(i) for i in shown), key=lambda c: -abs(c.delta))
    return NextTokenComparison(
        baseline=baseline, edited=edited, kl=float(kl_divergence(base_row, edit_row)),
        top1_changed=bool(baseline.top and edited.top and baseline.top[0].id != edited.top[0].id),
        changes=changes[:k], targets=[change(i) for i in targets],
        baseline_top1=change(baseline.top[0].id if baseline.top else int(before.argmax())))


def hook_diff(name: str, a: torch.Tensor, b: torch.Tensor) -> HookDiff:
    """Largest |a - b| and ||a - b|| / ||a|| of one activation, over the entries finite in both. Integer activations
    (an MoE's chosen experts) and half-precision ones compare as float32 numbers."""
    a, b = a.float(), b.float().to(a.device)
    both = torch.isfinite(a) & torch.isfinite(b)
    delta = torch.where(both, a - b, torch.zeros_like(a))
    reference = torch.where(both, a, torch.zeros_like(a)).norm()
    relative = float(delta.norm() / reference) if reference > 0 else (math.inf if delta.norm() > 0 else 0.0)
    return HookDiff(hook=name, max_abs_diff=float(delta.abs().max()), relative_diff=relative)


def compare_traces(a: Any, b: Any, vocab: Any = None, per_position: bool = True) -> TraceComparison:
    """How trace ``b`` differs from trace ``a`` (see ``TraceComparison``); ``per_position=False`` skips the KL and
    top-1 of every position (a float64 softmax over [positions, vocab])."""
    last_a, last_b = a.logits_at(-1), b.logits_at(-1).to(a.logits.device)
    _check_one_vocabulary(last_a, last_b)
    same_tokens = list(a.ids) == list(b.ids)
    # every position's logits where both kept them (a batch run may keep the last position's alone)
    every_position = same_tokens and a.logits.shape[0] == b.logits.shape[0] == len(a.ids)
    logits_a, logits_b = (a.logits, b.logits.to(a.logits.device)) if every_position else (last_a, last_b)
    # equal entries (a token both traces banned with -inf) differ by 0, not by -inf - -inf = NaN
    logit_diff = float(torch.where(logits_a == logits_b, 0.0, (logits_a - logits_b).abs()).max())
    diffs = sorted((hook_diff(name, a.activations[name], b.activations[name])
                    for name in a.activations.keys() & b.activations.keys()
                    if a.activations[name].shape == b.activations[name].shape), key=lambda d: d.hook)
    worst, worst_tensor = logit_diff, "logits"
    for d in diffs:
        if d.max_abs_diff > worst:
            worst, worst_tensor = d.max_abs_diff, d.hook
    kl_per_position = top1_changes = None
    if per_position and every_position:
        kl_per_position = kl_divergence(a.logits, logits_b).tolist()
        top1_changes = torch.nonzero(a.logits.argmax(-1) != logits_b.argmax(-1)).flatten().tolist()
    return TraceComparison(
        same_tokens=same_tokens, top1_a=top_k(last_a, 1, vocab)[0], top1_b=top_k(last_b, 1, vocab)[0],
        kl=float(kl_divergence(last_a, last_b)), max_abs_logit_diff=logit_diff, activations=diffs,
        max_abs_deviation=worst, worst_tensor=worst_tensor, kl_per_position=kl_per_position,
        top1_changes=top1_changes)


def relative_change(base: Any, other: Any, hooks: Sequence[str]) -> torch.Tensor:
    """||other - base|| / ||base|| over the feature axis, per hook and position, of two traces of the same tokens
    that both recorded ``hooks`` (token-major points such as ``blocks.*.hook_resid_post``): [len(hooks), positions]."""
    missing = [n for n in hooks if n not in base.activations or n not in other.activations]
    if missing:
        raise WorkbenchError(f"both traces must record {missing[0]}")
    if list(base.ids) != list(other.ids):
        raise WorkbenchError("the traces are of different prompts; comparing activations needs the same tokens")
    if base.reduce is not None or other.reduce is not None:
        raise WorkbenchError("a trace kept one row per recorded point (reduce), not every position's")
    grown = [n for n in hooks if axes(n).token != 0]
    if grown:
        raise WorkbenchError(f"{grown[0]} is not token-major ([heads, T, S]): compare token-major points")
    return torch.stack([(other.activations[n] - base.activations[n]).flatten(1).norm(dim=-1)
                        / base.activations[n].flatten(1).norm(dim=-1) for n in hooks])


# ---------------------------------------------------------------------------------------------------- summaries


def summarize_activation(name: str, activation: torch.Tensor, per_position: bool = True,
                         reduced: bool = False) -> ActivationSummary:
    """Shape, norm and max |value| of a recorded activation, and (``per_position``) its norm at each token position;
    non-finite entries (masked attention scores) count as 0. A ``reduced`` one (a batch run's ``reduce``) is one row
    with no positions."""
    rows = (activation.reshape(1, -1) if reduced else activation.movedim(axes(name).token, 0).flatten(1)).float()
    finite = torch.where(torch.isfinite(rows), rows, torch.zeros_like(rows))
    return ActivationSummary(hook=name, shape=[int(n) for n in activation.shape], norm=float(finite.norm()),
                             max_abs=float(finite.abs().max()),
                             position_norms=finite.norm(dim=1).tolist() if per_position and not reduced else [])


def summarize_activations(trace: Any, per_position: bool = True) -> list[ActivationSummary]:
    """``summarize_activation`` of every activation a trace recorded, in recording order."""
    return [summarize_activation(name, act, per_position, trace.reduce is not None)
            for name, act in trace.activations.items()]
