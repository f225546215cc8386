"""Recording activations during a call, across the prompt and every generation step."""
from __future__ import annotations

import torch

from typing import Sequence

from workbench.config import ModelConfig
from workbench.runner import HookContext, HookFn

from .points import axes, resolve


class Recorder:
    """Keeps a float32 CPU copy of each named activation (integers as they are); generation steps join along the token axis.

    The recorder of a ``model.hooks(record=...)`` block sees every call inside the block: their
    activations join along the token axis in call order (one call per block keeps them apart).
    """

    def __init__(self, names: list[str]):
        self.names = names
        self._chunks: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    @classmethod
    def for_patterns(cls, patterns: Sequence[str] | None, config: ModelConfig) -> "Recorder | None":
        """A recorder of every point the names or globs match (each once), or None when there are none."""
        names = list(dict.fromkeys(name for pattern in patterns or () for name in resolve(pattern, config)))
        return cls(names) if names else None

    def hooks(self) -> dict[str, list[HookFn]]:
        def record(x: torch.Tensor, ctx: HookContext) -> None:
            # the chosen experts' indices stay integers
            dtype = torch.float32 if x.is_floating_point() else x.dtype
            self._chunks[ctx.name].append(x.detach().to("cpu", dtype, copy=True))

        return {name: [record] for name in self.names}

    def activations(self) -> dict[str, torch.Tensor]:
        return {name: join_tokens(name, chunks) for name, chunks in self._chunks.items() if chunks}


def join_tokens(name: str, chunks: list[torch.Tensor]) -> torch.Tensor:
    """Activations of consecutive tokens of one sequence joined along the token axis. Scores and patterns ``[heads,
    T, S]`` attend over more slots in later chunks: earlier ones are padded with what a blocked slot holds."""
    token_axis = axes(name).token
    if token_axis == 1:
        n_slots = chunks[-1].shape[-1]
        fill = float("-inf") if name.endswith("hook_attn_scores") else 0.0
        chunks = [torch.nn.functional.pad(c, (0, n_slots - c.shape[-1]), value=fill) for c in chunks]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=token_axis)
