"""Base against adapter: what a LoRA fine-tune changes, and where, on the same prompts (batched forwards).

Both sides are the same packed base model, run once with each adapter choice (``adapter=None`` is the base):

- ``resid_norms[l]``: the mean over prompts and positions of ``|resid_post_A - resid_post_B|`` at layer ``l``
  (``resid_relative``: over the mean ``|resid_post_B|``), where the fine-tune's effect enters and grows;
- ``lens``: the logit lens of the difference at ``position``: per layer, the mean over prompts of
  ``lens(resid_A) - lens(resid_B)`` (each residual read through the final norm and unembedding), its most promoted and
  most suppressed tokens;
- ``kl``: ``KL(P_A || P_B)`` of the next-token distributions at every position of every prompt;
- ``attribution``: the direct logit attribution of the target's logit, A's minus B's per component (embedding, heads,
  MLPs), averaged over prompts: which components write the change;
- ``steering``: the mean residual difference per layer as a SteeringVector ("adapter minus base"), to steer the base
  toward the adapter (``steering.interventions(...)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from workbench.errors import WorkbenchError

from .dla import RECORD as DLA_RECORD, Attribution, _attribution
from .lens import check_position, final_norm, token_id, unembed
from .steering import SteeringVector


@dataclass
class ModelDiff:
    a: str  # what each side ran with, e.g. "adapter 'ft'" and "base"
    b: str
    prompt_tokens: list[list[str]]
    resid_norms: torch.Tensor  # float32 [n_layers]
    resid_relative: torch.Tensor  # float32 [n_layers]
    kl: list[torch.Tensor]  # per prompt, float32 [T]: KL(P_a || P_b) in nats
    lens_promoted: list[list[tuple[str, float]]]  # per layer: (token, mean logit change) of the k most raised
    lens_suppressed: list[list[tuple[str, float]]]  # ... and the k most lowered
    attribution: Attribution  # contributions a minus b, averaged over prompts
    steering: SteeringVector  # mean resid_post difference a - b per layer

    @property
    def mean_kl(self) -> float:
        return float(torch.cat(self.kl).mean())

    def summary(self, k: int = 5) -> dict[str, Any]:
        """The figures as plain JSON values (the MCP tool's answer)."""
        return {
            "a": self.a, "b": self.b, "prompts": len(self.kl), "mean_kl": self.mean_kl,
            "max_kl": float(torch.cat(self.kl).max()),
            "kl_per_position": [[round(float(v), 6) for v in kl] for kl in self.kl],
            "resid_diff_norm": [round(float(v), 6) for v in self.resid_norms],
            "resid_diff_relative": [round(float(v), 6) for v in self.resid_relative],
            "lens_promoted": [row[:k] for row in self.lens_promoted],
            "lens_suppressed": [row[:k] for row in self.lens_suppressed],
            "attribution_target": self.attribution.target,
            "attribution_top": self.attribution.top(k),
            "steering_norms": self.steering.norms(),
        }

    def figure(self):
        """Residual difference per layer (absolute and relative to the base's norm)."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        layers = list(range(len(self.resid_norms)))
        fig = make_subplots(specs=[[{"secondary_y": True}]])
        fig.add_trace(go.Scatter(x=layers, y=self.resid_norms.tolist(), name="|resid diff|"))
        fig.add_trace(go.Scatter(x=layers, y=self.resid_relative.tolist(), name="relative", line=dict(dash="dot")),
                      secondary_y=True)
        fig.update_layout(title=f"Residual stream: {self.a} minus {self.b}", xaxis_title="layer (resid_post)",
                          yaxis_title="mean norm of the difference", template="plotly_white")
        fig.update_yaxes(title_text="relative to |resid|", secondary_y=True)
        return fig


def compare_models(model: Any, prompts: Sequence[str | Sequence[int]], adapter: Any, base: Any = None, *,
                   target: int | str | None = None, position: int = -1, k: int = 10, chat: bool = False,
                   batch_size: int | None = None, progress: Any = False) -> ModelDiff:
    """Run ``prompts`` with ``adapter`` and with ``base`` (None: the base model; either a loaded adapter's name or
    ``{name: scale}``) and compare them (see the module's docstring). ``target``: the token whose logit the attribution
    splits (default: the one whose logit at ``position`` the adapter raises most on average)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise WorkbenchError(f"k must be a positive integer, got {k!r}")
    ids = model.batch_ids(prompts, chat)
    for i, prompt_ids in enumerate(ids):
        check_position(position, len(prompt_ids), f"prompt {i}: ")
    sides = [model.adapter_scales(adapter), model.adapter_scales(base)]  # unknown names fail here, before compute
    target_id = None if target is None else token_id(model, target)
    record = [*DLA_RECORD, "blocks.*.hook_resid_post"]
    n_layers = model.config.n_layers
    o_lora = sorted({i for side in sides for name in side for i, layer in enumerate(model.adapters[name].layers)
                     if "wo" in layer})
    runs = [model.run_batch(ids, record=record, batch_size=batch_size, progress=progress, adapter=side)
            for side in sides]
    if target_id is None:
        shift = sum(a.logits[position] - b.logits[position] for a, b in zip(*runs))
        target_id = int(shift.argmax())

    diff_norm, base_norm, n_rows = torch.zeros(n_layers), torch.zeros(n_layers), 0
    direction_sum = torch.zeros(n_layers, model.config.d_model)
    lens_change = torch.zeros(n_layers, model.config.vocab_size)
    kls, contributions, logit = [], 0, 0.0
    for trace_a, trace_b in zip(*runs):
        resid_a = torch.stack([trace_a.activations[f"blocks.{l}.hook_resid_post"] for l in range(n_layers)])
        resid_b = torch.stack([trace_b.activations[f"blocks.{l}.hook_resid_post"] for l in range(n_layers)])
        diff = resid_a - resid_b  # [layers, T, d_model]
        diff_norm += diff.norm(dim=-1).sum(-1)
        base_norm += resid_b.norm(dim=-1).sum(-1)
        direction_sum += diff.sum(1)
        n_rows += diff.shape[1]
        lens_change += _lens(model, resid_a[:, position]) - _lens(model, resid_b[:, position])
        log_a, log_b = trace_a.logits.double().log_softmax(-1), trace_b.logits.double().log_softmax(-1)
        kls.append((log_a.exp() * (log_a - log_b)).sum(-1).float())
        dla_a, dla_b = (_attribution(model, t, target_id, None, position, o_lora) for t in (trace_a, trace_b))
        contributions = contributions + (dla_a.contributions - dla_b.contributions)
        logit += dla_a.logit - dla_b.logit
    n_prompts = len(ids)
    lens_change /= n_prompts
    names = [_describe(model, side) for side in sides]
    attribution = Attribution(dla_a.labels, dla_a.kinds, contributions / n_prompts,
                              f"{model.token_texts([target_id])[0]!r} ({names[0]} minus {names[1]})",
                              dla_a.position, logit / n_prompts, math.nan)
    steering = SteeringVector({l: direction_sum[l] / n_rows for l in range(n_layers)}, "resid_post",
                              model.config.architecture, f"{names[0]} minus {names[1]}")
    return ModelDiff(names[0], names[1], [model.token_texts(x) for x in ids], diff_norm / n_rows,
                     diff_norm / base_norm.clamp(min=1e-30), kls,
                     [_tokens(model, row, k, largest=True) for row in lens_change],
                     [_tokens(model, row, k, largest=False) for row in lens_change], attribution, steering)


def _lens(model: Any, resid: torch.Tensor) -> torch.Tensor:
    """Logits ``[layers, vocab]`` of one position's residual at each layer, read as the model reads its last."""
    return unembed(model, final_norm(model, resid)).cpu()


def _tokens(model: Any, row: torch.Tensor, k: int, largest: bool) -> list[tuple[str, float]]:
    top = row.topk(min(k, row.numel()), largest=largest)
    return [(text, round(float(v), 4)) for text, v in zip(model.token_texts(top.indices.tolist()), top.values)]


def _describe(model: Any, scales: dict[str, float]) -> str:
    if not scales:
        return "base"
    return " + ".join(f"adapter {name!r}" + ("" if scale == model.adapters[name].scale else f" x {scale:g}")
                      for name, scale in scales.items())
