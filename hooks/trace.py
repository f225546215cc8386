"""A Trace: everything one call produced and everything needed to reproduce it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Trace:
    prompt: str | list[int]
    ids: list[int]
    tokens: list[str]
    logits: torch.Tensor  # float32 [positions, vocab]
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    interventions: list[dict[str, Any]] = field(default_factory=list)  # JSON specs
    fingerprint: dict[str, Any] = field(default_factory=dict)  # model file sha256, architecture, formats
    backend: dict[str, Any] = field(default_factory=dict)  # device, dtype, kernels
    versions: dict[str, str] = field(default_factory=dict)
    seed: int | None = None
    chat: bool = False
    metrics: dict[str, float] = field(default_factory=dict)

    def top_tokens(self, position: int = -1, k: int = 10) -> list[tuple[int, float]]:
        """(token id, probability) of the k most likely next tokens at a position."""
        probs = self.logits[position].softmax(-1)
        values, indices = probs.topk(k)
        return [(int(i), float(v)) for i, v in zip(indices, values)]
