"""Gradients of a metric of the logits with respect to activations at hook points (``Model.run_with_gradients``).

Each point gets a hook that adds a zero tensor autograd tracks (``x + 0``, the same values), so the gradient with
respect to that zero is the gradient with respect to the activation as the rest of the forward reads it, after any
intervention at the point. The forward keeps its kernels' bits (``kernels/layer_ops.py``, ``KernelForward``); the
matmuls' input gradients multiply the weights their kernel multiplies (``kernels/linear.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from workbench.config import ModelConfig
from workbench.errors import HookError, shorten
from workbench.runner import HookContext, HookFn

from .points import ID_POINTS, check_patterns, resolve

Metric = Callable[[torch.Tensor], torch.Tensor]  # logits [positions, vocab] -> a 0-d tensor computed from them


@dataclass
class Gradients:
    """One forward and backward: the logits, the metric's value, and at each point its activation and the metric's
    gradient with respect to it (float32, on the CPU, the activation's shape)."""

    ids: list[int]
    tokens: list[str]
    logits: torch.Tensor
    metric: float
    activations: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]


class GradientTaps:
    """The hooks of a gradient run at ``names``: each keeps its activation and the zero it adds."""

    def __init__(self, names: list[str]):
        for name in names:
            if name.endswith(ID_POINTS):
                raise HookError(f"{name} holds integer expert ids, which have no gradient")
        self.names = names
        self.activations: dict[str, torch.Tensor] = {}
        self.zeros: dict[str, torch.Tensor] = {}

    @classmethod
    def for_patterns(cls, patterns: Sequence[str], config: ModelConfig) -> "GradientTaps":
        """The taps of every point the names or globs match, each once: a glob passes over the integer points (``*``
        on a mixture of experts), a name of one is refused."""
        check_patterns(patterns, "points")
        names: list[str] = []
        for pattern in patterns:
            matched = resolve(pattern, config)
            names += matched if matched == [pattern] else [n for n in matched if not n.endswith(ID_POINTS)]
        if not names:
            raise HookError(f"points {shorten(patterns)} name no hook point with a gradient")
        return cls(list(dict.fromkeys(names)))

    def hooks(self) -> dict[str, list[HookFn]]:
        def tap(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
            zero = torch.zeros_like(x, requires_grad=True)
            self.activations[ctx.name], self.zeros[ctx.name] = x.detach(), zero
            return x + zero

        return {name: [tap] for name in self.names}

    def check_fired(self) -> None:
        """Refuse points the forward did not run (they have no activation to take a gradient at)."""
        unfired = [name for name in self.names if name not in self.zeros]
        if unfired:
            raise HookError(f"{shorten(unfired)} did not run in this forward (a LoRA term's point runs only where the "
                            f"call's adapter adapts its projection)")

    def gradients(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """d value / d activation at each point; zeros where the value does not depend on it."""
        found = torch.autograd.grad(value, [self.zeros[n] for n in self.names], allow_unused=True)
        return {name: (torch.zeros_like(self.zeros[name]) if grad is None else grad).to("cpu", torch.float32)
                for name, grad in zip(self.names, found)}


def metric_value(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    """``metric`` of the logits as the 0-d tensor a backward starts from, or a clear error. The metric reads a copy:
    an in-place edit of it must not change the logits a caller returns."""
    value = metric(logits.clone())
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        hint = " (a Python number has no gradient)" if isinstance(value, (int, float)) else ""
        raise HookError(f"metric must return a one-element float tensor computed from the logits, got "
                        f"{shorten(value)}{hint}")
    if not value.requires_grad:
        raise HookError("metric's value does not depend on the logits it was given (it has no gradient)")
    if not torch.isfinite(value.detach()).all():  # every gradient would be NaN
        raise HookError(f"metric's value is {value.item()}, not a finite number")
    return value.reshape(())
