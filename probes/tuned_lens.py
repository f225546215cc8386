"""Tuned lens: one affine translator per layer, mapping that layer's residual towards the final one.

The plain logit lens assumes every layer already speaks the last layer's basis. A translator
``h -> h @ W_l + b_l`` corrects for the drift before the final norm and unembedding. Here the
translators are fitted in closed form by ridge regression of the last layer's ``resid_post`` on layer
l's ``resid_post`` over every token of a set of prompts; Belrose et al. (2023) instead train them by
gradient descent on the KL divergence to the final logits, which this simpler fit approximates.
Saved as safetensors (the translators) + JSON (the model signature); no pickle.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from workbench.errors import WorkbenchError, finite_number

from .activations import Progress, check_prompts
from .data import load_dataset
from .saving import check_signature, model_signature, read_artifact, write_artifact

DEFAULT_TRAINING_SETS = ("sentiment", "facts", "happy_sad")
FORMAT = "workbench-tuned-lens/1"


@dataclass
class TunedLens:
    """Affine translators ``[n_layers, d_model, d_model]`` and ``[n_layers, d_model]`` for ``resid_post``."""

    weight: torch.Tensor
    bias: torch.Tensor
    signature: dict[str, Any]
    ridge: float
    n_positions: int

    def translate(self, resid: torch.Tensor, first_layer: int = 0) -> torch.Tensor:
        """Translate residuals ``[layers, positions, d_model]``, one slice per layer from ``first_layer`` on (every
        layer's by default)."""
        layers = slice(first_layer, first_layer + resid.shape[0])
        weight, bias = self.weight[layers].to(resid.device), self.bias[layers].to(resid.device)
        return (resid.double() @ weight + bias[:, None, :]).float()

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Write ``path.safetensors`` (the translators) and ``path.json`` (model signature, fit settings)."""
        meta = {"format": FORMAT, "signature": self.signature, "ridge": self.ridge, "n_positions": self.n_positions}
        return write_artifact(path, {"weight": self.weight, "bias": self.bias}, meta)

    @classmethod
    def load(cls, path: str | Path, model: Any | None = None) -> "TunedLens":
        """Read a saved tuned lens; check it fits ``model`` when given."""
        tensors, meta = read_artifact(path, "tuned lens", FORMAT)
        lens = cls(tensors["weight"], tensors["bias"], meta["signature"], meta["ridge"], meta["n_positions"])
        if model is not None:
            lens.check_model(model)
        return lens

    def check_model(self, model: Any) -> None:
        check_signature(self.signature, model, "this tuned lens")


def train_tuned_lens(model: Any, prompts: Sequence[str] | None = None, ridge: float = 1e-3,
                     progress: Progress = None) -> TunedLens:
    """Fit the translators on every token of ``prompts`` (default: the shipped sentiment, facts, happy_sad sets).

    ``ridge`` is relative: the penalty is ``ridge * mean eigenvalue`` of each layer's residual covariance.
    """
    if prompts is None:
        prompts = [p for name in DEFAULT_TRAINING_SETS for p in load_dataset(name).prompts]
    prompts = check_prompts(prompts)
    if finite_number(ridge, "ridge") <= 0:  # NaN fails every comparison: checked finite first
        raise WorkbenchError(f"ridge must be positive, got {ridge}")
    c = model.config
    ids = model.batch_ids(prompts)  # counted before the forwards: each token position is one sample
    if sum(map(len, ids)) <= c.d_model:
        raise WorkbenchError(f"{sum(map(len, ids))} token positions are too few to fit {c.d_model}-wide translators; "
                             "give more prompts")
    names = [f"blocks.{layer}.hook_resid_post" for layer in range(c.n_layers)]
    # Streamed sufficient statistics, so memory does not grow with the number of prompts.
    sum_x = torch.zeros(c.n_layers, c.d_model, dtype=torch.float64)
    gram = torch.zeros(c.n_layers, c.d_model, c.d_model, dtype=torch.float64)
    cross = torch.zeros(c.n_layers, c.d_model, c.d_model, dtype=torch.float64)
    sum_y = torch.zeros(c.d_model, dtype=torch.float64)
    n = 0
    for _, trace in model.iter_batch(ids, record=names, logits=None, progress=progress):
        x = torch.stack([trace.activations[name] for name in names]).double()  # [layers, T, d]
        y = x[-1]
        sum_x += x.sum(1)
        sum_y += y.sum(0)
        gram += x.transpose(1, 2) @ x
        cross += x.transpose(1, 2) @ y
        n += y.shape[0]
    if n <= c.d_model:
        raise WorkbenchError(f"{n} token positions are too few to fit {c.d_model}-wide translators; give more prompts")
    mean_x, mean_y = sum_x / n, sum_y / n
    cov = gram / n - mean_x[:, :, None] * mean_x[:, None, :]
    cov_xy = cross / n - mean_x[:, :, None] * mean_y[None, None, :]
    penalty = ridge * cov.diagonal(dim1=1, dim2=2).mean(-1)
    eye = torch.eye(c.d_model, dtype=torch.float64)
    weight = torch.linalg.solve(cov + penalty[:, None, None] * eye, cov_xy)
    weight[-1] = eye  # the last layer is the final residual itself
    bias = mean_y - (mean_x[:, None, :] @ weight).squeeze(1)
    bias[-1] = 0
    return TunedLens(weight, bias, model_signature(model), ridge, n)
