"""Direct logit attribution: how much each component writes the logit (difference) directly.

The final residual at a position is the sum of what the embedding, every attention head (through its
own slice of W_O), attention's output bias where the family has one (GPT-OSS) and every MLP wrote into
it. The final RMSNorm is linear once its scale is frozen at the value of the run, so the logit splits exactly
into one term per component:

    logit = scale * sum_c (component_c . (norm_weight * unembedding_row))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from workbench.errors import WorkbenchError

from .lens import check_position, token_id


@dataclass
class Attribution:
    """One contribution per component, in forward order; they sum to ``total`` (≈ ``logit``)."""

    labels: list[str]  # "embed", "L3H5", "L3 O LoRA", "L3 O bias", "L3 MLP"
    # "embed" | "attn" | "lora" (an adapter's term on W_O, beside the heads) | "bias" (attention's output bias, which
    # belongs to no head: GPT-OSS) | "mlp"
    kinds: list[str]
    contributions: torch.Tensor  # float64 [components]
    target: str  # what the direction reads, e.g. "' Paris'" or "' Paris' - ' London'"
    position: int
    logit: float  # the model's own logit (difference) at this position
    scale: float  # the frozen final-norm scale

    @property
    def total(self) -> float:
        return float(self.contributions.sum())

    @property
    def error(self) -> float:
        """|sum of contributions - the model's logit|: the decomposition's float error."""
        return abs(self.total - self.logit)

    def heads(self) -> torch.Tensor:
        """Head contributions as ``[layers, heads]``."""
        attn = self.contributions[[i for i, k in enumerate(self.kinds) if k == "attn"]]
        n_layers = sum(k == "mlp" for k in self.kinds)
        return attn.view(n_layers, -1)

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` components with the largest absolute contribution."""
        order = self.contributions.abs().argsort(descending=True)[:n]
        return [(self.labels[i], float(self.contributions[i])) for i in order]

    def figure(self, top: int | None = None):
        """Bar chart of contributions in forward order (or the ``top`` largest by size), coloured by kind."""
        import plotly.graph_objects as go

        index = range(len(self.labels)) if top is None else [
            self.labels.index(label) for label, _ in self.top(top)]
        colors = {"embed": "#7f7f7f", "attn": "#1f77b4", "lora": "#2ca02c", "bias": "#9467bd", "mlp": "#ff7f0e"}
        fig = go.Figure(go.Bar(
            x=[self.labels[i] for i in index], y=[float(self.contributions[i]) for i in index],
            marker_color=[colors[self.kinds[i]] for i in index]))
        fig.update_layout(title=f"Direct logit attribution to {self.target} at position {self.position} "
                                f"(sum {self.total:.3f}, model {self.logit:.3f})",
                          xaxis_title="component", yaxis_title="contribution to logit", template="plotly_white")
        return fig


# An adapter's LoRA term on W_O is written beside the heads' results (they are the base's W_O slices): its own component.
RECORD = ["hook_embed", "blocks.*.attn.hook_result", "blocks.*.attn.hook_o_lora", "blocks.*.hook_mlp_out",
          "ln_final.hook_scale"]


def check_linear_heads(model: Any) -> None:
    """Refuse a family whose attention output is normed before it joins the stream (Gemma 2/3, OLMo 2): the heads'
    outputs no longer add up to what the stream receives."""
    if model.config.arch.post_norms:
        raise WorkbenchError(f"direct logit attribution splits attention into heads that add up to its output; "
                             f"{model.config.architecture} norms that output first, so its heads do not add up")


def direct_logit_attribution(model: Any, prompt: str | Sequence[int], target: int | str,
                             baseline: int | str | None = None, position: int = -1, chat: bool = False) -> Attribution:
    """Split the logit of ``target`` (minus ``baseline``'s, when given) at ``position`` over the components."""
    check_linear_heads(model)
    target_id = token_id(model, target)
    baseline_id = None if baseline is None else token_id(model, baseline)
    ids = model.to_ids(prompt, chat=chat)  # the position is checked against these before the forward
    check_position(position, len(ids))
    return _attribution(model, model.run(ids, record=RECORD), target_id, baseline_id, position)


def direct_logit_attribution_batch(model: Any, prompts: Sequence[str | Sequence[int]],
                                   targets: int | str | Sequence[int | str],
                                   baselines: int | str | Sequence[int | str] | None = None, position: int = -1,
                                   chat: bool = False, batch_size: int | None = None,
                                   progress: Any = False) -> list[Attribution]:
    """``direct_logit_attribution`` of every prompt, run in batched forwards: ``targets`` (and ``baselines``) one token
    for all prompts, or a list with one per prompt."""
    def per_prompt(tokens, what: str) -> list[int | None]:
        if tokens is None or isinstance(tokens, (int, str)):
            return [None if tokens is None else token_id(model, tokens)] * len(prompts)
        if len(tokens) != len(prompts):
            raise WorkbenchError(f"{what} needs one token per prompt ({len(prompts)}), got {len(tokens)}")
        return [token_id(model, t) for t in tokens]

    check_linear_heads(model)
    target_ids, baseline_ids = per_prompt(targets, "targets"), per_prompt(baselines, "baselines")
    ids = model.batch_ids(prompts, chat)  # run as ids: the chat template is applied once, here
    for i, prompt_ids in enumerate(ids):
        check_position(position, len(prompt_ids), f"prompt {i}: ")
    traces = model.run_batch(ids, record=RECORD, batch_size=batch_size, progress=progress)
    return [_attribution(model, trace, t, b, position) for trace, t, b in zip(traces, target_ids, baseline_ids)]


def _attribution(model: Any, trace: Any, target_id: int, baseline_id: int | None, position: int,
                 lora_layers: Sequence[int] = ()) -> Attribution:
    """The attribution of one trace; an "O LoRA" component in each layer whose W_O term the trace recorded, or that
    ``lora_layers`` lists (zero where it was not recorded: so two runs' components line up)."""
    c = model.config
    n_pos = len(trace.ids)
    position = check_position(position, n_pos)
    acts = trace.activations

    components = [acts["hook_embed"][position]]
    labels, kinds = ["embed"], ["embed"]
    for layer in range(c.n_layers):
        components.extend(acts[f"blocks.{layer}.attn.hook_result"][position])
        labels += [f"L{layer}H{h}" for h in range(c.n_heads)]
        kinds += ["attn"] * c.n_heads
        o_lora = acts.get(f"blocks.{layer}.attn.hook_o_lora")
        if o_lora is not None or layer in lora_layers:
            components.append(o_lora[position] if o_lora is not None else torch.zeros(c.d_model))
            labels.append(f"L{layer} O LoRA")
            kinds.append("lora")
        # attn_out = sum of the heads' results + W_O's bias, which no head's result holds: a term of its own
        bias = model.runner.weights.layers[layer].bo
        if bias is not None:
            components.append(bias.float().cpu())
            labels.append(f"L{layer} O bias")
            kinds.append("bias")
        components.append(acts[f"blocks.{layer}.hook_mlp_out"][position])
        labels.append(f"L{layer} MLP")
        kinds.append("mlp")

    unembedding = model.runner.weights.unembed
    ids = [target_id] if baseline_id is None else [target_id, baseline_id]
    rows = unembedding.dequantize_rows(torch.tensor(ids, device=unembedding.device)).cpu().double()
    direction = rows[0] if baseline_id is None else rows[0] - rows[1]
    direction = direction * model.runner.weights.final_norm.cpu().double()
    scale = 1.0 / float(acts["ln_final.hook_scale"][position, 0])  # the hook point holds the divisor
    contributions = scale * (torch.stack(components).double() @ direction)

    logit = trace.logits[position, target_id] - (0 if baseline_id is None else trace.logits[position, baseline_id])
    texts = model.token_texts(ids)
    description = repr(texts[0]) if baseline_id is None else f"{texts[0]!r} - {texts[1]!r}"
    return Attribution(labels, kinds, contributions, description, position % n_pos, float(logit), scale)
