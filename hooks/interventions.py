"""Declarative interventions: JSON-serializable specs that compile into hook functions for one call.

Every intervention selects a hook point (name or glob), optionally token positions, heads and neurons
(feature indices), and edits only that region; everything outside it passes through bit-identically.

Positions are absolute token positions (0 is the first prompt token). Negative positions count from the
end of the prompt (-1 is the last prompt token). ``positions="generated"`` selects only tokens produced
during generation; ``None`` selects every position, generated ones included.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

from workbench.config import ModelConfig
from workbench.errors import HookError
from workbench.runner import HookContext, HookFn

from .points import axes, feature_size, head_count, resolve

Positions = Sequence[int] | str | None


@dataclass
class RunShape:
    """What an intervention is validated against: the model and the token positions of the call."""

    model: Any  # the workbench.Model being run (donor prompts are recorded with it)
    prompt_len: int
    total_len: int  # prompt plus the most tokens generation may add

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def record_donor(self, prompt: Any, names: list[str]) -> dict[str, torch.Tensor]:
        return self.model.run(prompt, record=names).activations


def _as_int_list(values, what: str) -> list[int] | None:
    if values is None:
        return None
    if isinstance(values, int):
        values = [values]
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise HookError(f"{what} must be a list of integers, got {values!r}") from None
    if not out:
        raise HookError(f"{what} is empty")
    return out


def _as_vector(value, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        vector = value.detach().to("cpu")
    else:
        try:
            vector = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise HookError(f"{what} must be a tensor or a list of numbers") from None
    if not (vector.is_floating_point() or vector.dtype in (torch.int32, torch.int64)):
        raise HookError(f"{what} must hold real numbers, got dtype {vector.dtype}")
    vector = vector.to(torch.float32)
    if not torch.isfinite(vector).all():
        raise HookError(f"{what} contains NaN or Inf")
    return vector


class Intervention(ABC):
    """Anything that turns into hook functions for one call and back into a JSON spec."""

    kind: ClassVar[str] = ""
    registry: ClassVar[dict[str, type["Intervention"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.kind:
            Intervention.registry[cls.kind] = cls

    @abstractmethod
    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        """Validate against the call and return hook functions per hook point name."""

    @abstractmethod
    def to_spec(self) -> dict[str, Any]:
        """A JSON-serializable dict that ``from_spec`` turns back into an equal intervention."""


@dataclass
class RegionEdit(Intervention):
    """An edit of one region of a hook point: the hook (name or glob), positions, heads, neurons."""

    hook: str
    positions: Positions = None
    heads: Sequence[int] | None = None
    neurons: Sequence[int] | None = None

    def to_spec(self) -> dict[str, Any]:
        spec = {"type": self.kind, "hook": self.hook}
        for key in ("positions", "heads", "neurons"):
            value = getattr(self, key)
            if value is not None:
                spec[key] = value if isinstance(value, str) else [int(v) for v in value]
        spec.update(self._params_spec())
        return spec

    def _params_spec(self) -> dict[str, Any]:
        return {}

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        names = resolve(self.hook, run.config)
        positions = self._check_positions(run)
        hooks = {}
        for name in names:
            heads = self._check_index(self.heads, head_count(name, run.config), "heads", name)
            neurons = self._check_index(self.neurons, feature_size(name, run.config), "neurons", name)
            hooks[name] = [self._hook_fn(name, positions, heads, neurons, run)]
        return hooks

    def _check_positions(self, run: RunShape) -> list[int] | str | None:
        if self.positions is None:
            return None
        if isinstance(self.positions, str):
            if self.positions != "generated":
                raise HookError(f"positions must be a list of integers, None or 'generated', got {self.positions!r}")
            return "generated"
        resolved = []
        for p in _as_int_list(self.positions, "positions"):
            absolute = p + run.prompt_len if p < 0 else p
            if not 0 <= absolute < run.total_len:
                raise HookError(f"position {p} is out of range for a run of {run.prompt_len} prompt tokens"
                                + (f" and up to {run.total_len - run.prompt_len} new ones" if run.total_len > run.prompt_len else ""))
            resolved.append(absolute)
        return resolved

    @staticmethod
    def _check_index(values, size: int | None, what: str, name: str) -> list[int] | None:
        values = _as_int_list(values, what)
        if values is None:
            return None
        if size is None:
            raise HookError(f"{name} has no {what[:-1]} axis to select")
        bad = [v for v in values if not 0 <= v < size]
        if bad:
            raise HookError(f"{what} {bad} out of range 0..{size - 1} at {name}")
        return values

    def _hook_fn(self, name: str, positions, heads, neurons, run: RunShape) -> HookFn:
        ax = axes(name)
        edit = self._editor(name, run)

        def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            mask = _region_mask(x, ax, ctx.positions, positions, heads, neurons, run.prompt_len)
            if mask is None:
                return None
            return edit(x, mask, ctx)

        return fn

    @abstractmethod
    def _editor(self, name: str, run: RunShape) -> Callable[[torch.Tensor, torch.Tensor, HookContext], torch.Tensor]:
        """``edit(x, mask, ctx)``: the new activation, equal to ``x`` wherever ``mask`` is False."""


def _region_mask(x: torch.Tensor, ax, token_positions: torch.Tensor, positions, heads, neurons,
                 prompt_len: int) -> torch.Tensor | None:
    """Boolean mask broadcastable to ``x`` selecting the region, or None when nothing here is selected."""
    shape = [1] * x.dim()
    if positions is None:
        token_mask = torch.ones_like(token_positions, dtype=torch.bool)
    elif positions == "generated":
        token_mask = token_positions >= prompt_len
    else:
        token_mask = torch.isin(token_positions, torch.tensor(positions, device=token_positions.device))
    if not bool(token_mask.any()):
        return None
    shape[ax.token] = x.shape[ax.token]
    mask = token_mask.view(shape)
    for axis, index in ((ax.head, heads), (ax.feature, neurons)):
        if index is None:
            continue
        axis_shape = [1] * x.dim()
        axis_shape[axis] = x.shape[axis]
        selected = torch.zeros(x.shape[axis], dtype=torch.bool, device=x.device)
        selected[index] = True
        mask = mask & selected.view(axis_shape)
    return mask


def _vector_along_feature(vector: torch.Tensor, x: torch.Tensor, feature_axis: int) -> torch.Tensor:
    shape = [1] * x.dim()
    shape[feature_axis] = vector.numel()
    return vector.to(x.device, x.dtype).view(shape)


@dataclass
class ZeroAblate(RegionEdit):
    kind: ClassVar[str] = "zero_ablate"

    def _editor(self, name, run):
        return lambda x, mask, ctx: x.masked_fill(mask, 0)


@dataclass
class Scale(RegionEdit):
    factor: float = 1.0
    kind: ClassVar[str] = "scale"

    def _params_spec(self):
        return {"factor": float(self.factor)}

    def _editor(self, name, run):
        if not math.isfinite(float(self.factor)):
            raise HookError(f"scale factor must be finite, got {self.factor}")
        return lambda x, mask, ctx: torch.where(mask, x * self.factor, x)


@dataclass
class Steer(RegionEdit):
    """Add ``scale * vector`` along the feature axis of the selected region."""

    vector: Any = None
    scale: float = 1.0
    kind: ClassVar[str] = "steer"

    def __init__(self, hook: str, vector: Any, scale: float = 1.0, positions: Positions = None,
                 heads: Sequence[int] | None = None):
        RegionEdit.__init__(self, hook, positions, heads, None)
        self.vector = _as_vector(vector, "steering vector")
        self.scale = float(scale)

    def _params_spec(self):
        return {"vector": self.vector.tolist(), "scale": self.scale}

    def _editor(self, name, run):
        ax = axes(name)
        size = feature_size(name, run.config)
        if ax.feature is None:
            raise HookError(f"{name} has no feature axis to steer along")
        if self.vector.dim() != 1 or self.vector.numel() != size:
            raise HookError(f"steering vector for {name} must have shape ({size},), got {tuple(self.vector.shape)}")
        if not math.isfinite(self.scale):
            raise HookError(f"steering scale must be finite, got {self.scale}")
        delta = self.scale * self.vector

        def edit(x, mask, ctx):
            return x + mask.to(x.dtype) * _vector_along_feature(delta, x, ax.feature)

        return edit


@dataclass
class MeanAblate(RegionEdit):
    """Replace the region with a mean activation (over the positions of reference runs)."""

    mean: Any = None
    kind: ClassVar[str] = "mean_ablate"

    def __init__(self, hook: str, mean: Any, positions: Positions = None, heads=None, neurons=None):
        RegionEdit.__init__(self, hook, positions, heads, neurons)
        self.mean = _as_vector(mean, "mean activation")

    @classmethod
    def from_traces(cls, hook: str, traces: Sequence[Any], **selectors) -> "MeanAblate":
        """Mean of ``hook`` over every position of traces that recorded it."""
        rows = []
        for trace in traces:
            if hook not in trace.activations:
                raise HookError(f"trace of {trace.prompt!r} did not record {hook}")
            act = trace.activations[hook]
            rows.append(act.movedim(axes(hook).token, 0))
        return cls(hook, torch.cat(rows).float().mean(0), **selectors)

    def _params_spec(self):
        return {"mean": self.mean.tolist()}

    def _editor(self, name, run):
        ax = axes(name)

        def edit(x, mask, ctx):
            expected = x.movedim(ax.token, 0).shape[1:]
            if tuple(self.mean.shape) != tuple(expected):
                raise HookError(f"mean activation for {name} must have shape {tuple(expected)}, got {tuple(self.mean.shape)}")
            mean = self.mean.to(x.device, x.dtype).unsqueeze(ax.token)
            return torch.where(mask, mean.expand_as(x), x)

        return edit


@dataclass
class Patch(RegionEdit):
    """Overwrite the region with a donor run's activation at the same positions (and heads)."""

    donor: Any = None  # a prompt (str or token ids) or a Trace that recorded the hook
    kind: ClassVar[str] = "patch"

    def _params_spec(self):
        donor = self.donor
        if hasattr(donor, "prompt"):
            donor = donor.ids
        return {"donor": donor}

    def _donor_activation(self, name: str, run: RunShape) -> torch.Tensor:
        if hasattr(self.donor, "activations"):
            if self.donor.fingerprint.get("sha256") != run.model.file_sha256:
                raise HookError("the donor trace was recorded on another model (its fingerprint differs)")
            act = self.donor.activations.get(name)
            if act is None:
                raise HookError(f"the donor trace did not record {name}")
            return act
        if self.donor is None:
            raise HookError("patch needs a donor prompt or trace")
        return run.record_donor(self.donor, [name])[name]

    def _editor(self, name, run):
        ax = axes(name)
        donor = self._donor_activation(name, run)

        def edit(x, mask, ctx):
            covered = int(ctx.positions.max()) < donor.shape[ax.token]
            if not covered:
                raise HookError(f"donor for {name} has {donor.shape[ax.token]} tokens; selected position "
                                f"{int(ctx.positions.max())} is beyond it (choose positions)")
            aligned = donor.to(x.device, x.dtype).index_select(ax.token, ctx.positions.to(x.device))
            if aligned.shape != x.shape:
                raise HookError(f"donor activation {tuple(aligned.shape)} does not fit {name} {tuple(x.shape)}")
            return torch.where(mask, aligned, x)

        return edit


@dataclass
class ResampleAblate(RegionEdit):
    """Replace each selected position with the activation of a random position of random donor prompts."""

    donors: Sequence[Any] = field(default_factory=list)
    seed: int = 0
    kind: ClassVar[str] = "resample_ablate"

    def _params_spec(self):
        return {"donors": list(self.donors), "seed": int(self.seed)}

    def _editor(self, name, run):
        ax = axes(name)
        if not self.donors:
            raise HookError("resample ablation needs at least one donor prompt")
        if ax.token != 0:
            raise HookError(f"resample ablation works on token-major hook points, not {name}")
        pool = torch.cat([run.record_donor(d, [name])[name] for d in self.donors])
        generator = torch.Generator().manual_seed(int(self.seed))

        def edit(x, mask, ctx):
            rows = torch.randint(0, pool.shape[0], (x.shape[0],), generator=generator)
            return torch.where(mask, pool[rows].to(x.device, x.dtype), x)

        return edit


@dataclass
class Composite(Intervention):
    """Several interventions applied together, in order."""

    parts: Sequence[Intervention] = field(default_factory=list)
    kind: ClassVar[str] = "composite"

    def to_spec(self) -> dict[str, Any]:
        return {"type": self.kind, "parts": [p.to_spec() for p in self.parts]}

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        return merge_hooks(part.compile(run) for part in self.parts)


def merge_hooks(hook_maps) -> dict[str, list[HookFn]]:
    merged: dict[str, list[HookFn]] = {}
    for hooks in hook_maps:
        for name, fns in hooks.items():
            merged.setdefault(name, []).extend(fns)
    return merged


def from_spec(spec: dict[str, Any] | Intervention) -> Intervention:
    """Build an intervention from its JSON spec (``{"type": "steer", "hook": ..., ...}``)."""
    if isinstance(spec, Intervention):
        return spec
    if not isinstance(spec, dict) or "type" not in spec:
        raise HookError(f"an intervention spec is a dict with a 'type', got {spec!r}")
    spec = dict(spec)
    kind = spec.pop("type")
    cls = Intervention.registry.get(kind)
    if cls is None:
        raise HookError(f"unknown intervention type {kind!r}; known: {', '.join(sorted(Intervention.registry))}")
    if cls is Composite:
        return Composite([from_spec(p) for p in spec.get("parts", [])])
    try:
        return cls(**spec)
    except TypeError as err:
        raise HookError(f"bad {kind} spec: {err}") from None
