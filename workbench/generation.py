"""Sampling and the decode loop over the runner's KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from workbench.errors import WorkbenchError
from workbench.kv_cache import KVCache
from workbench.runner import Hooks, Transformer


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise softmax(logits / temperature) cut to top_k and top_p, seeded."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise WorkbenchError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise WorkbenchError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise WorkbenchError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g

    def pick(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """One token id from float32 logits ``[vocab]``."""
        if self.temperature == 0:
            return int(logits.argmax())
        logits = logits.float().cpu() / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the best token)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))


def generate_tokens(runner: Transformer, prompt_ids: Sequence[int], max_new_tokens: int,
                    sampling: Sampling = Sampling(), stop_ids: set[int] = frozenset(), hooks: Hooks | None = None,
                    cache: KVCache | None = None) -> Iterator[int]:
    """Yield new token ids. The prompt is prefilled once; each step feeds one token through the cache.

    With ``cache``, the prompt tokens continue it and generation appends to it.
    """
    if not prompt_ids:
        raise WorkbenchError("generation needs at least one prompt token")
    if max_new_tokens < 0:
        raise WorkbenchError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cache = cache if cache is not None else runner.new_cache(len(prompt_ids) + max_new_tokens)
    if cache.next_position + len(prompt_ids) + max_new_tokens > runner.config.n_ctx:
        raise WorkbenchError(
            f"prompt ({len(prompt_ids)} tokens) + cache ({cache.length}) + {max_new_tokens} new tokens "
            f"exceed the context of {runner.config.n_ctx}"
        )
    generator = sampling.generator()
    ids = torch.tensor(list(prompt_ids), dtype=torch.long)
    for step in range(max_new_tokens):
        logits = runner.forward(ids, cache=cache, hooks=hooks, last_logits_only=True, step=step)
        token = sampling.pick(logits[-1], generator)
        yield token
        if token in stop_ids:
            return
        ids = torch.tensor([token], dtype=torch.long)
