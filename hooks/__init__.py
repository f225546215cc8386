"""Hooks and interventions: record, ablate, steer and patch any activation, scoped to one call."""
from __future__ import annotations

from typing import Any, Sequence

from workbench.runner import HookContext, HookFn

from .interventions import (Composite, FunctionHook, Intervention, MeanAblate, Patch, RegionEdit, ResampleAblate,
                            RunShape, Scale, Steer, ZeroAblate, from_spec, merge_hooks)
from .patching import PatchingResult, patching_sweep
from .points import point_shapes, resolve
from .recording import Recorder
from .trace import Trace, TraceError, load_trace


def compile_hooks(model: Any, interventions: Sequence[Intervention | dict] = (), record: Sequence[str] | None = None,
                  prompt_len: int = 0, total_len: int = 0) -> tuple[dict[str, list[HookFn]], Recorder | None, list[dict]]:
    """Validate interventions and record patterns for one call; return (hooks, recorder, specs).

    Everything is checked before any compute (donor runs included): hook names, shapes, ranges, NaN,
    donor models. Recording hooks run after the interventions at the same point, so traces show edited values.
    """
    parsed = [from_spec(i) for i in interventions]
    recorder = Recorder.for_patterns(record, model.config)
    run = RunShape(model, prompt_len, max(total_len, prompt_len))
    for intervention in parsed:
        intervention.validate(run)
    hooks = merge_hooks(i.compile(run) for i in parsed)
    if recorder is not None:
        hooks = merge_hooks([hooks, recorder.hooks()])
    return hooks, recorder, [i.to_spec() for i in parsed]


__all__ = [
    "Intervention", "RegionEdit", "ZeroAblate", "MeanAblate", "ResampleAblate", "Steer", "Patch", "Scale",
    "Composite", "FunctionHook", "from_spec", "compile_hooks", "merge_hooks", "Recorder", "Trace", "TraceError",
    "load_trace", "point_shapes", "resolve", "HookContext", "patching_sweep", "PatchingResult",
]
