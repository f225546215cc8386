"""Recording activations during a call, across the prompt and every generation step."""
from __future__ import annotations

import torch

from typing import Sequence

from workbench.config import ModelConfig
from workbench.runner import HookContext, HookFn

from .points import axes, check_patterns, resolve


class Recorder:
    """Keeps a float32 CPU copy of each named activation (integers as they are); generation steps join along the token axis.

    The recorder of a ``model.hooks(record=...)`` block sees every call inside the block: their
    activations join along the token axis in call order, a batch's prompts in the order of its list (one call per block
    keeps them apart).
    """

    def __init__(self, names: list[str]):
        self.names = names
        # (call, prompt, activation) in the order they arrive; a batch runs its prompts longest first
        self._chunks: dict[str, list[tuple[int, int, torch.Tensor]]] = {name: [] for name in names}
        self._calls = 0

    @classmethod
    def for_patterns(cls, patterns: Sequence[str] | None, config: ModelConfig) -> "Recorder | None":
        """A recorder of every point the names or globs match (each once), or None when there are none."""
        if patterns is not None:
            check_patterns(patterns, "record")
        names = list(dict.fromkeys(name for pattern in patterns or () for name in resolve(pattern, config)))
        return cls(names) if names else None

    def hooks(self) -> dict[str, list[HookFn]]:
        """The hooks of one call: what they record comes after everything recorded by the hooks of earlier calls."""
        call = self._calls
        self._calls += 1

        def record(x: torch.Tensor, ctx: HookContext) -> None:
            # the chosen experts' indices stay integers
            dtype = torch.float32 if x.is_floating_point() else x.dtype
            self._chunks[ctx.name].append((call, ctx.prompt, x.detach().to("cpu", dtype, copy=True)))

        return {name: [record] for name in self.names}

    def activations(self) -> dict[str, torch.Tensor]:
        ordered = {name: [x for _, _, x in sorted(chunks, key=lambda c: c[:2])] for name, chunks in self._chunks.items()}
        return {name: join_tokens(name, chunks) for name, chunks in ordered.items() if chunks}


def join_tokens(name: str, chunks: list[torch.Tensor]) -> torch.Tensor:
    """Activations of consecutive tokens joined along the token axis. Scores and patterns ``[heads, T, S]`` of chunks
    that attend over fewer slots (earlier tokens of a sequence, or a shorter prompt) are padded with what a blocked
    slot holds."""
    token_axis = axes(name).token
    if token_axis == 1:
        n_slots = max(c.shape[-1] for c in chunks)
        fill = float("-inf") if name.endswith("hook_attn_scores") else 0.0
        chunks = [torch.nn.functional.pad(c, (0, n_slots - c.shape[-1]), value=fill) for c in chunks]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=token_axis)
