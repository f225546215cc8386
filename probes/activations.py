"""Collecting pooled activations over many prompts: batched forwards record every hook asked for, pooled as they go."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from workbench import hooks
from workbench.errors import HookError, WorkbenchError, shorten
from workbench.hooks.points import axes
from workbench.messages import Prompt
from workbench.progress import Progress

POOLINGS = ("last", "mean")


def block_hook(model: Any, layer: int, point: str) -> str:
    """``blocks.{layer}.hook_{point}`` for a point such as "resid_post" (or "hook_resid_post"), validated."""
    if not 0 <= layer < model.config.n_layers:
        raise HookError(f"layer {layer} is out of range: the model has layers 0..{model.config.n_layers - 1}")
    name = f"blocks.{layer}.{point if point.startswith(('hook_', 'attn.', 'mlp.', 'ln')) else 'hook_' + point}"
    return hooks.resolve(name, model.config)[0]


def check_prompts(prompts: Sequence[Prompt]) -> list[Prompt]:
    """The prompts as a list: texts, token ids or conversations (lists of ids or messages are checked with the batch
    they run in, which names the prompt)."""
    if isinstance(prompts, str):
        raise WorkbenchError("expected a list of prompts, got a single string")
    prompts = list(prompts)
    if not prompts:
        raise WorkbenchError("no prompts given")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)) and (not isinstance(prompt, str) or not prompt.strip()):
            raise WorkbenchError(f"prompt {i} is empty or neither a text, token ids nor a list of messages: "
                                 f"{shorten(prompt)}")
    return prompts


def collect_activations(model: Any, prompts: Sequence[Prompt], hook_names: Sequence[str], pooling: str = "last",
                        progress: Progress = None) -> dict[str, torch.Tensor]:
    """Pooled activations ``{hook: [len(prompts), features]}`` (float32 CPU), from batched forwards.

    ``pooling="last"`` keeps the last token (what the model knows when it must predict), ``"mean"``
    averages over the prompt's tokens. Multi-axis points (``attn.hook_z`` [T, heads, d_head]) are
    flattened after pooling.
    """
    prompts = check_prompts(prompts)
    if pooling not in POOLINGS:
        raise WorkbenchError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    names = list(dict.fromkeys(n for pattern in hook_names for n in hooks.resolve(pattern, model.config)))
    token_major = [n for n in names if axes(n).token != 0]
    if token_major:
        raise HookError(f"{token_major[0]} is not token-major ([heads, T, S]); it cannot be pooled over tokens")
    traces = model.run_batch(prompts, record=names, reduce=pooling, logits=None, progress=progress)
    return {name: torch.stack([t.activations[name].flatten() for t in traces]) for name in names}

