"""Hooks and interventions: record, ablate, steer and patch any activation, scoped to one call."""
from __future__ import annotations

from typing import Any, Sequence

from workbench.errors import HookError
from workbench.runner import HookContext, HookFn

from .batching import BatchRecorder, per_prompt_hooks
from .experts import AblateExpert, ForceRouting, SteerExpert
from .gradients import GradientTaps, Gradients, metric_value
from .interventions import (Composite, FunctionHook, Intervention, MeanAblate, Patch, RegionEdit, ResampleAblate,
                            RunShape, Scale, ScaleAdapter, Steer, ZeroAblate, from_spec, has_function_hook,
                            intervention_list, merge_hooks, spec_leaves)
from .patching import PatchingResult, attribution_patching, check_patching_method, dataset_patching, patching_sweep
from .points import point_shapes, resolve
from .recording import Recorder, join_tokens
from .saes import SAE_POINTS, attach_saes, check_sae_points, check_saes
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


def compile_prompt_hooks(model: Any, interventions: Sequence[Sequence[Intervention | dict]],
                         prompt_lens: Sequence[int], total_lens: Sequence[int]
                         ) -> list[tuple[dict[str, list[HookFn]], list[dict]]]:
    """``compile_hooks`` for each prompt of a batch (its interventions, prompt length and longest run): every prompt's
    interventions are validated, and an error names the prompt, before anything is computed; donor prompts are run
    once for the whole batch."""
    parsed, runs, donor_runs = [], [], {}
    for i, (prompt_interventions, prompt_len, total_len) in enumerate(zip(interventions, prompt_lens, total_lens)):
        run = RunShape(model, prompt_len, max(total_len, prompt_len), donor_runs)
        try:
            items = [from_spec(x) for x in prompt_interventions]
            for intervention in items:
                intervention.validate(run)
        except HookError as err:
            raise HookError(f"prompt {i}: {err}") from None
        parsed.append(items)
        runs.append(run)
    return [(merge_hooks(x.compile(run) for x in items), [x.to_spec() for x in items])
            for items, run in zip(parsed, runs)]


__all__ = [
    "Intervention", "RegionEdit", "ZeroAblate", "MeanAblate", "ResampleAblate", "Steer", "Patch", "Scale", "ScaleAdapter",
    "Composite", "FunctionHook", "from_spec", "compile_hooks", "merge_hooks", "Recorder", "Trace", "TraceError",
    "load_trace", "point_shapes", "resolve", "HookContext", "patching_sweep", "PatchingResult", "BatchRecorder",
    "per_prompt_hooks", "compile_prompt_hooks", "join_tokens", "spec_leaves", "has_function_hook", "SAE_POINTS",
    "attach_saes", "check_saes", "check_sae_points", "FeatureSteer", "FeatureAblate", "FeatureClamp", "AblateExpert",
    "ForceRouting", "SteerExpert", "intervention_list", "Gradients", "GradientTaps", "metric_value",
    "attribution_patching", "dataset_patching", "check_patching_method",
]


def __getattr__(name: str) -> Any:
    # The feature edits live with the SAEs (workbench.probes.sae), which build on this package: loaded on first use.
    if name in ("FeatureSteer", "FeatureAblate", "FeatureClamp"):
        from workbench.probes import sae

        return getattr(sae, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
