"""Reading an SAE's features: where they fire over a corpus (top contexts, density), what each decoder direction
writes into the logits, which features fire on each token of a prompt, and how much each feature's output adds to a
logit (difference) directly, through the final norm frozen at the run's scale as ``probes.dla`` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from workbench.errors import WorkbenchError, integer

from .lens import check_position, token_id
from .sae import SAE


@dataclass
class FeatureStats:
    """Each feature's firing over a corpus: ``density`` (fraction of tokens it is active on), ``max_act``, and its
    ``n`` strongest activations with where they were (``top_prompt``, ``top_position``; -1 where fewer fired)."""

    density: torch.Tensor  # [d_sae]
    max_act: torch.Tensor  # [d_sae]
    top_values: torch.Tensor  # [d_sae, n], descending
    top_prompt: torch.Tensor  # [d_sae, n]
    top_position: torch.Tensor  # [d_sae, n]
    ids: list[list[int]]  # every prompt's token ids
    tokens: int

    def examples(self, model: Any, feature: int, context: int = 8) -> list[dict[str, Any]]:
        """The feature's top contexts: the tokens up to ``context`` either side, which one fired, how strongly."""
        feature = integer(feature, "feature")
        if not 0 <= feature < self.top_values.shape[0]:
            raise WorkbenchError(f"feature {feature} is out of range 0..{self.top_values.shape[0] - 1}")
        out = []
        for value, prompt, position in zip(self.top_values[feature].tolist(), self.top_prompt[feature].tolist(),
                                           self.top_position[feature].tolist()):
            if prompt < 0 or value <= 0:
                break
            ids = self.ids[prompt]
            start = max(0, position - context)
            out.append({"activation": value, "prompt": prompt, "position": position,
                        "tokens": model.token_texts(ids[start:position + context + 1]), "at": position - start})
        return out


def feature_stats(model: Any, sae: SAE, prompts: Sequence[Any], n: int = 10, batch_size: int | None = None,
                  progress: Any = False) -> FeatureStats:
    """Run the prompts (batched) and keep each feature's density and ``n`` top activations. The SAE's input is
    recorded and encoded prompt by prompt, so memory holds one prompt's ``[T, d_sae]`` activations at a time."""
    from workbench import hooks as hooks_lib

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise WorkbenchError(f"n must be a positive integer, got {n!r}")
    hooks_lib.check_saes([sae], model.config)
    ids = model.batch_ids(prompts)  # a string is refused, not read as prompts of one character
    d = sae.d_sae
    fired = torch.zeros(d, dtype=torch.long)
    top_values = torch.zeros(d, n)
    top_prompt = torch.full((d, n), -1, dtype=torch.long)
    top_position = torch.full((d, n), -1, dtype=torch.long)
    tokens = 0
    with torch.no_grad():
        for i, trace in model.iter_batch(ids, record=[sae.hook], logits=None, batch_size=batch_size,
                                          progress=progress):
            acts = sae.on(model.device).encode(trace.activations[sae.hook].to(model.device)).float().cpu()  # [T, d_sae]
            tokens += acts.shape[0]
            fired += (acts > 0).sum(0)
            m = min(n, acts.shape[0])
            values, positions = acts.topk(m, dim=0)  # [m, d_sae]
            merged = torch.cat([top_values, values.T], dim=1)
            order = merged.topk(n, dim=1).indices
            top_values = merged.gather(1, order)
            top_prompt = torch.cat([top_prompt, torch.full((d, m), i)], dim=1).gather(1, order)
            top_position = torch.cat([top_position, positions.T], dim=1).gather(1, order)
    return FeatureStats(fired.float() / max(tokens, 1), top_values[:, 0].clone(), top_values, top_prompt,
                        top_position, ids, tokens)


def promoted_tokens(model: Any, sae: SAE, feature: int, k: int = 10) -> dict[str, list[tuple[str, float]]]:
    """The tokens the feature's decoder direction promotes and suppresses most, read straight through the final
    norm's weight and the unembedding (the direction's direct effect on the logits)."""
    if sae.d_out != model.config.d_model:
        raise WorkbenchError(f"{sae.label()} writes {sae.d_out} features, not the residual stream's "
                             f"{model.config.d_model}: its directions have no logits to read")
    k = integer(k, "k")
    if not 1 <= k <= model.config.vocab_size:
        raise WorkbenchError(f"k must be in 1..{model.config.vocab_size} (the vocabulary), got {k}")
    direction = sae.decoder_direction(feature).float().cpu() * model.runner.weights.final_norm.float().cpu()
    logits = _unembed_direction(model, direction)
    top, bottom = logits.topk(k), (-logits).topk(k)
    texts = model.token_texts
    return {"promoted": list(zip(texts(top.indices.tolist()), top.values.tolist())),
            "suppressed": list(zip(texts(bottom.indices.tolist()), (-bottom.values).tolist()))}


def _unembed_direction(model: Any, direction: torch.Tensor) -> torch.Tensor:
    """``W_U @ direction`` for every vocabulary row, dequantized a slice of rows at a time."""
    unembedding = model.runner.weights.unembed
    rows = []
    for start in range(0, model.config.vocab_size, 8192):
        index = torch.arange(start, min(start + 8192, model.config.vocab_size), device=unembedding.device)
        rows.append(unembedding.dequantize_rows(index).float().cpu() @ direction)
    return torch.cat(rows)


def top_features(model: Any, sae: SAE, prompt: str | Sequence[int], k: int = 5) -> list[dict[str, Any]]:
    """Each token of the prompt with its ``k`` most active features ``[(feature, activation), ...]``."""
    trace = model.run(prompt, saes=[sae], record=[f"{sae.hook}.hook_sae_acts_post"])
    acts = trace.activations[f"{sae.hook}.hook_sae_acts_post"]
    values, features = acts.topk(min(k, sae.d_sae), dim=-1)
    return [{"position": p, "token": trace.tokens[p],
             "features": [(int(f), float(v)) for f, v in zip(features[p], values[p]) if v > 0]}
            for p in range(len(trace.tokens))]


@dataclass
class FeatureAttribution:
    """Each feature's direct contribution to a logit (difference) at one position, with the SAE's error, decoder bias
    and (a skip transcoder's) skip connection: together they are the direct contribution of the activation the SAE
    writes."""

    features: torch.Tensor  # float64 [d_sae]
    error: float
    bias: float
    target: str
    position: int
    scale: float  # the frozen final-norm scale
    skip: float = 0.0  # a skip transcoder's input times W_skip (0 without)

    @property
    def total(self) -> float:
        return float(self.features.sum()) + self.error + self.bias + self.skip

    def top(self, n: int = 10) -> list[tuple[int, float]]:
        order = self.features.abs().argsort(descending=True)[:n]
        return [(int(i), float(self.features[i])) for i in order if self.features[i] != 0]


def feature_attribution(model: Any, sae: SAE, prompt: str | Sequence[int], target: int | str,
                        baseline: int | str | None = None, position: int = -1) -> FeatureAttribution:
    """Activation times the decoder direction, through the final norm frozen at this run's scale and the unembedding
    row of ``target`` (minus ``baseline``'s): each feature's direct effect on the logit (difference)."""
    if sae.d_out != model.config.d_model or sae.normalize_activations in ("constant_norm_rescale", "layer_norm"):
        raise WorkbenchError(f"{sae.label()}: feature attribution needs an SAE writing the residual stream's "
                             f"{model.config.d_model} features with no per-token normalization")
    target_id = token_id(model, target)
    baseline_id = None if baseline is None else token_id(model, baseline)
    acts_name, input_name = f"{sae.hook}.hook_sae_acts_post", f"{sae.hook}.hook_sae_input"
    trace = model.run(prompt, saes=[sae], record=[acts_name, input_name, f"{sae.hook}.hook_sae_error",
                                                  "ln_final.hook_scale"])
    position = check_position(position, len(trace.ids))
    ids = [target_id] if baseline_id is None else [target_id, baseline_id]
    unembedding = model.runner.weights.unembed
    rows = unembedding.dequantize_rows(torch.tensor(ids, device=unembedding.device)).cpu().double()
    direction = (rows[0] if baseline_id is None else rows[0] - rows[1]) * model.runner.weights.final_norm.cpu().double()
    scale = 1.0 / float(trace.activations["ln_final.hook_scale"][position, 0])  # the hook point holds the divisor
    w_dec = sae.W_dec.detach().cpu().double()
    if sae.rescale_acts_by_decoder_norm:
        w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
    acts = trace.activations[acts_name][position].double()
    skip = 0.0
    if sae.has_skip:  # the input's own path to the output, beside the features
        sae_in = trace.activations[input_name][position].double()
        skip = scale * float(sae_in @ sae.params["W_skip"].detach().cpu().double().T @ direction)
    texts = model.token_texts(ids)
    return FeatureAttribution(
        features=scale * acts * (w_dec @ direction),
        error=scale * float(trace.activations[f"{sae.hook}.hook_sae_error"][position].double() @ direction),
        bias=scale * float(sae.b_dec.detach().cpu().double() @ direction),
        target=repr(texts[0]) if baseline_id is None else f"{texts[0]!r} - {texts[1]!r}",
        position=position % len(trace.ids), scale=scale, skip=skip)
