"""Declarative interventions: JSON-serializable specs that compile into hook functions for one call.

Every intervention selects a hook point (name or glob), optionally token positions, heads and neurons
(feature indices), and edits only that region; everything outside it passes through bit-identically.

Positions are absolute token positions (0 is the first prompt token; with a KV cache, the rope positions
the cache continues from). Negative positions count from the end of the prompt (-1 is the last prompt
token). ``positions="generated"`` selects only tokens produced by generation, from the moment they are fed
back: the first new token is picked from the last prompt position's logits, so an edit that should change
it must also select that position (``-1`` or ``None``). ``None`` selects every position, generated ones
included.

A call validates all its interventions (hook names, ranges, shapes, NaN, donor models) before it computes
anything, donor runs included. Donor prompts are run clean: without this call's interventions and without
those of an enclosing ``model.hooks()`` block.
"""
from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import torch

from workbench.config import ModelConfig
from workbench.errors import HookError, WorkbenchError, finite_number, seed as checked_seed, shorten
from workbench.runner import LORA_POINTS, HookContext, HookFn

from .points import ID_POINTS, axes, feature_size, head_count, resolve, token_shape
from .recording import Recorder
from .trace import model_mismatch

Positions = Sequence[int] | str | None
# Edits of an SAE's features, defined with the SAEs in workbench.probes.sae
FEATURE_KINDS = ("feature_steer", "feature_ablate", "feature_clamp")
Editor = Callable[[torch.Tensor, torch.Tensor, HookContext], torch.Tensor]


@dataclass
class RunShape:
    """What an intervention is validated against: the model and the token positions of the call."""

    model: Any  # the workbench.Model being run (donor prompts are recorded with it)
    prompt_len: int
    total_len: int  # prompt plus the most tokens generation may add
    _donor_runs: dict = field(default_factory=dict, repr=False)
    # per MoE block, the experts its reroute ablations take out and the last one compiled (hooks/experts.py): a
    # later reroute also keeps tokens off the earlier ones' experts
    reroutes: dict = field(default_factory=dict, repr=False)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def donor_ids(self, prompt: Any) -> list[int]:
        try:
            return self.model.to_ids(prompt)
        except (WorkbenchError, TypeError, ValueError) as err:
            raise HookError(f"donor prompt {shorten(prompt)}: {err}") from None

    def record_donor(self, prompt: Any, names: list[str]) -> dict[str, torch.Tensor]:
        """Activations of a clean run of a donor prompt; each (prompt, names) is run once per call."""
        ids = self.donor_ids(prompt)
        key = (tuple(ids), tuple(names))
        if key not in self._donor_runs:
            recorder = Recorder(names)
            self.model.runner.forward(torch.tensor(ids, dtype=torch.long), hooks=recorder.hooks(),
                                      stop_at_layer=self.model.runner.stop_after(names))
            self._donor_runs[key] = recorder.activations()
        return self._donor_runs[key]


@dataclass(frozen=True)
class Region:
    """The resolved selection of a RegionEdit at one hook point."""

    name: str
    positions: list[int] | str | None  # absolute positions, "generated" or None (all)
    heads: list[int] | None
    neurons: list[int] | None

    def last_position(self, run: RunShape) -> int:
        return max(self.positions) if isinstance(self.positions, list) else run.total_len - 1


def _as_int_list(values, what: str) -> list[int] | None:
    if values is None:
        return None
    if not hasattr(values, "__iter__") or (isinstance(values, torch.Tensor) and values.dim() == 0):
        values = [values]
    try:
        if isinstance(values, (str, bytes)) or any(isinstance(v, bool) for v in values):
            raise TypeError
        out = [operator.index(v) for v in values]
    except TypeError:
        raise HookError(f"{what} must be a list of integers, got {shorten(values)}") from None
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


def _check_finite(value, what: str) -> float:
    return finite_number(value, what, HookError)


class Intervention(ABC):
    """Anything that turns into hook functions for one call and back into a JSON spec."""

    kind: ClassVar[str] = ""
    registry: ClassVar[dict[str, type["Intervention"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.kind:
            Intervention.registry[cls.kind] = cls

    @abstractmethod
    def validate(self, run: RunShape) -> None:
        """Raise HookError if this does not fit the call; computes nothing."""

    @abstractmethod
    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        """Hook functions per hook point name (after ``validate``; may run donor prompts)."""

    @abstractmethod
    def to_spec(self) -> dict[str, Any]:
        """A JSON-serializable dict that ``from_spec`` turns back into an equal intervention."""

    def saes(self) -> list[Any]:
        """The SAEs whose points this edits: a call attaches them where it does not already (hooks/saes.py)."""
        return []


@dataclass
class RegionEdit(Intervention):
    """An edit of one region of a hook point: the hook (name or glob), positions, heads, neurons."""

    hook: str
    positions: Positions = None
    heads: Sequence[int] | None = None
    neurons: Sequence[int] | None = None
    # whether the editor computes each value from that value alone, the same way in every prompt (no donor, no draws
    # per row, no reading of ``ctx``): a batched forward then edits all its rows in one call (``RowEdit``)
    elementwise: ClassVar[bool] = False
    # whether the edit may stand at a point of ids (ID_POINTS): it copies other runs' values there (a donor's, a
    # resample's) or chooses the experts itself, where arithmetic on ids would mean nothing
    writes_ids: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.hook, str) or not self.hook:
            raise HookError(f"an intervention's hook must be a hook point name, got {shorten(self.hook)}")

    def to_spec(self) -> dict[str, Any]:
        spec = {"type": self.kind, "hook": self.hook}
        for key in ("positions", "heads", "neurons"):
            value = getattr(self, key)
            if value is not None:
                spec[key] = value if isinstance(value, str) else _as_int_list(value, key)
        spec.update(self._params_spec())
        return spec

    def _params_spec(self) -> dict[str, Any]:
        return {}

    def regions(self, run: RunShape) -> list[Region]:
        """The selection resolved against the call, one region per matching hook point."""
        names = resolve(self.hook, run.config)
        positions = self._check_positions(run)
        return [Region(name, positions, self._check_index(self.heads, head_count(name, run.config), "heads", name),
                       self._check_index(self.neurons, feature_size(name, run.config), "neurons", name))
                for name in names]

    def validate(self, run: RunShape) -> None:
        for region in self.regions(run):
            if not self.writes_ids and region.name.endswith(ID_POINTS):
                raise HookError(f"{self.kind} on {region.name}: its values are expert ids, not activations (patch "
                                "them from another run, or use ablate_expert / force_routing)")
            self._check(region, run)

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        return {region.name: [self._hook_fn(region, run)] for region in self.regions(run)}

    def _check_positions(self, run: RunShape) -> list[int] | str | None:
        if self.positions is None:
            return None
        if isinstance(self.positions, str):
            if self.positions != "generated":
                raise HookError(f"positions must be a list of integers, None or 'generated', got {shorten(self.positions)}")
            return "generated"
        resolved = []
        for p in _as_int_list(self.positions, "positions"):
            absolute = p + run.prompt_len if p < 0 else p
            if not 0 <= absolute < run.total_len:
                new = run.total_len - run.prompt_len
                raise HookError(f"position {p} is out of range for a run of {run.prompt_len} prompt tokens"
                                + (f" and up to {new} new ones" if new else ""))
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

    def _check(self, region: Region, run: RunShape) -> None:
        """Check this edit's parameters against one region (no compute)."""

    def _hook_fn(self, region: Region, run: RunShape) -> HookFn:
        ax = axes(region.name)
        edit = self._editor(region, run)
        positions = region.positions
        if isinstance(positions, list):
            positions = torch.tensor(positions, device=run.model.point_device(region.name))
        scores = region.name.endswith("attn.hook_attn_scores")

        def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            mask = _region_mask(x, ax, ctx.positions, positions, region.heads, region.neurons, run.prompt_len)
            if mask is None:
                return None
            if scores:  # a blocked slot (causal, sliding window, padding) holds -inf on every path: it stays blocked
                mask = mask & (x != float("-inf"))
            return edit(x, mask, ctx)

        fn.edits_only = True  # see runner.edits_only
        if self.elementwise:
            selected = tuple(positions.tolist()) if isinstance(positions, torch.Tensor) else positions
            fn.row_edit = RowEdit((id(self), region.name, selected), self, ax, positions, region.heads,
                                  region.neurons, edit, run.prompt_len)
        return fn

    @abstractmethod
    def _editor(self, region: Region, run: RunShape) -> Editor:
        """``edit(x, mask, ctx)``: the new activation, equal to ``x`` wherever ``mask`` is False."""


@dataclass(frozen=True, eq=False)
class RowEdit:
    """An ``elementwise`` region edit compiled for one prompt, in the form a batched forward applies to many rows at
    once (``hooks.batching``): rows whose hook functions carry equal ``key`` s (the same intervention, region and
    selected positions) share one call on the packed activation, each token selected by its own prompt's length
    (``"generated"``), which gives each value the bits the row-by-row calls give it."""

    key: tuple
    source: RegionEdit  # kept alive with the key, which holds its id
    ax: Any
    positions: torch.Tensor | str | None
    heads: list[int] | None
    neurons: list[int] | None
    edit: Editor
    prompt_len: int

    def __call__(self, x: torch.Tensor, ctx: HookContext, token_positions: torch.Tensor,
                 prompt_len: int | torch.Tensor) -> torch.Tensor | None:
        """The edit of the packed ``x``, each token at ``token_positions`` of a prompt ``prompt_len`` long (per token)."""
        mask = _region_mask(x, self.ax, token_positions, self.positions, self.heads, self.neurons, prompt_len)
        return None if mask is None else self.edit(x, mask, ctx)


def _region_mask(x: torch.Tensor, ax, token_positions: torch.Tensor, positions, heads, neurons,
                 prompt_len: int | torch.Tensor) -> torch.Tensor | None:
    """Boolean mask broadcastable to ``x`` selecting the region, or None when nothing here is selected (known without
    asking the GPU: there the test would make the host wait for the device at every hook, and a mask that selects
    nothing leaves every value as it is)."""
    if positions is None:
        token_mask = torch.ones_like(token_positions, dtype=torch.bool)
    elif isinstance(positions, str):  # "generated"
        token_mask = token_positions >= prompt_len
    else:
        token_mask = torch.isin(token_positions, positions)
    if token_mask.device.type == "cpu" and not bool(token_mask.any()):
        return None
    shape = [1] * x.dim()
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


def _per_token_shape(name: str, run: RunShape, what: str) -> tuple[int, ...]:
    shape = token_shape(name, run.config)
    if shape is None:
        raise HookError(f"{what} needs a fixed per-token shape; {name} grows with the attended slots")
    return shape


@dataclass
class ZeroAblate(RegionEdit):
    kind: ClassVar[str] = "zero_ablate"
    elementwise: ClassVar[bool] = True

    def _editor(self, region, run):
        return lambda x, mask, ctx: x.masked_fill(mask, 0)


@dataclass
class Scale(RegionEdit):
    """Multiply the selected region by ``factor``."""

    factor: float = 1.0
    kind: ClassVar[str] = "scale"
    elementwise: ClassVar[bool] = True

    def __init__(self, hook: str, factor: float = 1.0, positions: Positions = None, heads=None, neurons=None):
        RegionEdit.__init__(self, hook, positions, heads, neurons)
        self.factor = factor

    def _params_spec(self):
        return {"factor": float(self.factor)}

    def _check(self, region, run):
        _check_finite(self.factor, "scale factor")

    def _editor(self, region, run):
        factor = float(self.factor)
        return lambda x, mask, ctx: torch.where(mask, x * factor, x)


@dataclass
class Steer(RegionEdit):
    """Add ``scale * vector`` along the feature axis of the selected region (per head with ``heads``)."""

    vector: Any = None
    scale: float = 1.0
    kind: ClassVar[str] = "steer"
    elementwise: ClassVar[bool] = True

    def __init__(self, hook: str, vector: Any, scale: float = 1.0, positions: Positions = None,
                 heads: Sequence[int] | None = None):
        RegionEdit.__init__(self, hook, positions, heads, None)
        self.vector = _as_vector(vector, "steering vector")
        self.scale = _check_finite(scale, "steering scale")

    def _params_spec(self):
        return {"vector": self.vector.tolist(), "scale": self.scale}

    def _check(self, region, run):
        size = feature_size(region.name, run.config)
        if size is None:
            raise HookError(f"{region.name} has no feature axis to steer along")
        if self.vector.dim() != 1 or self.vector.numel() != size:
            raise HookError(f"steering vector for {region.name} must have shape ({size},), "
                            f"got {tuple(self.vector.shape)}")

    def _editor(self, region, run):
        feature_axis = axes(region.name).feature
        delta = self.scale * self.vector
        placed = {}  # delta as each (device, dtype, rank) of activation takes it: moved there once, not at every call

        def edit(x, mask, ctx):
            key = (x.device, x.dtype, x.dim())
            if key not in placed:
                shape = [1] * x.dim()
                shape[feature_axis] = delta.numel()
                placed[key] = delta.to(x.device, x.dtype).view(shape)
            return torch.where(mask, x + placed[key], x)

        return edit


@dataclass
class MeanAblate(RegionEdit):
    """Replace the region with a mean activation of one token (over the positions of reference runs)."""

    mean: Any = None
    kind: ClassVar[str] = "mean_ablate"
    elementwise: ClassVar[bool] = True

    def __init__(self, hook: str, mean: Any, positions: Positions = None, heads=None, neurons=None):
        RegionEdit.__init__(self, hook, positions, heads, neurons)
        self.mean = _as_vector(mean, "mean activation")

    @classmethod
    def from_traces(cls, hook: str, traces: Sequence[Any], **selectors) -> "MeanAblate":
        """Mean of ``hook`` (one exact hook name) over every position of traces that recorded it (over their one
        row each, for traces of a batch run that reduced them)."""
        if not traces:
            raise HookError("mean ablation needs at least one trace to average")
        rows = []
        for trace in traces:
            if hook not in trace.activations:
                raise HookError(f"trace of {shorten(trace.prompt)} did not record {hook}")
            recorded = trace.activations[hook]
            rows.append(recorded[None] if getattr(trace, "reduce", None) is not None
                        else recorded.movedim(axes(hook).token, 0))
        shapes = {tuple(r.shape[1:]) for r in rows}
        if len(shapes) > 1:
            raise HookError(f"traces recorded {hook} with different per-token shapes {sorted(shapes)}")
        return cls(hook, torch.cat(rows).float().mean(0), **selectors)

    def _params_spec(self):
        return {"mean": self.mean.tolist()}

    def _check(self, region, run):
        expected = _per_token_shape(region.name, run, "mean ablation")
        if tuple(self.mean.shape) != expected:
            raise HookError(f"mean activation for {region.name} must have shape {expected}, "
                            f"got {tuple(self.mean.shape)}")

    def _editor(self, region, run):
        mean = self.mean.to(run.model.point_device(region.name), run.model.dtype)
        return lambda x, mask, ctx: torch.where(mask, mean.unsqueeze(0).expand_as(x), x)


@dataclass
class Patch(RegionEdit):
    """Overwrite the region with a donor run's activation at the same positions (and heads, neurons).

    The donor is a prompt (text or token ids, run clean on this model) or a Trace of this model that
    recorded the hook. In a spec a Trace donor is stored as its token ids, so it is re-recorded clean.
    """

    donor: Any = None
    kind: ClassVar[str] = "patch"
    writes_ids: ClassVar[bool] = True

    def __init__(self, hook: str, donor: Any = None, positions: Positions = None, heads=None, neurons=None):
        RegionEdit.__init__(self, hook, positions, heads, neurons)
        self.donor = donor

    def _params_spec(self):
        donor = self.donor
        if _is_trace(donor):
            donor = list(donor.ids)
        return {"donor": donor}

    def validate(self, run: RunShape) -> None:
        if self.donor is None:
            raise HookError("patch needs a donor prompt or trace")
        if _is_trace(self.donor):
            mismatch = model_mismatch(self.donor.fingerprint, run.model)
            if mismatch:
                raise HookError(f"the donor trace was recorded on another model: {mismatch}")
        super().validate(run)

    def _check(self, region, run):
        if _is_trace(self.donor):
            donor_len = len(self.donor.ids)
            _check_donor_activation(self.donor, region.name, donor_len, run.config)
        else:
            donor_len = len(run.donor_ids(self.donor))
        if token_shape(region.name, run.config) is None and (donor_len != run.prompt_len
                                                             or run.total_len != run.prompt_len):
            raise HookError(f"patching {region.name} needs a donor of the same length as the run "
                            f"({donor_len} vs {run.prompt_len} tokens) and no generation")
        if region.last_position(run) >= donor_len:
            raise HookError(f"the donor has {donor_len} tokens; the patch of {region.name} selects position "
                            f"{region.last_position(run)} (choose positions within the donor)")

    def _editor(self, region, run):
        ax = axes(region.name)
        if _is_trace(self.donor):
            donor = self.donor.activations[region.name]
        else:
            donor = run.record_donor(self.donor, resolve(self.hook, run.config))[region.name]
        donor = donor.to(run.model.point_device(region.name), run.model.dtype)
        last = donor.shape[ax.token] - 1

        def edit(x, mask, ctx):
            # unselected positions beyond the donor read its last row, which ``where`` then ignores
            aligned = donor.index_select(ax.token, ctx.positions.clamp(max=last))
            return torch.where(mask, aligned, x)

        return edit


def _is_trace(value: Any) -> bool:
    return hasattr(value, "activations") and hasattr(value, "fingerprint")


def _check_donor_activation(trace: Any, name: str, n_tokens: int, config: ModelConfig) -> None:
    """A donor trace holds ``name`` as this model's forward gives it for its ``n_tokens`` tokens (a loaded trace may
    say anything, and a batch run's may keep one row per point)."""
    if name not in trace.activations:
        raise HookError(f"the donor trace did not record {name}")
    if getattr(trace, "reduce", None) is not None:
        raise HookError(f"the donor trace kept one row per point (reduce={trace.reduce!r}); a patch reads its "
                        "positions: record the donor without reduce")
    donor, per_token, heads = trace.activations[name], token_shape(name, config), head_count(name, config)
    if per_token is not None:
        expected = (n_tokens, *per_token)
    elif heads is not None:  # attention scores and patterns: [heads, T, S], S the donor's own tokens
        expected = (heads, n_tokens, n_tokens)
    else:  # an SAE's features of a size the config does not give
        return
    if tuple(donor.shape) != expected:
        raise HookError(f"the donor trace's {name} has shape {tuple(donor.shape)}, not this model's for its "
                        f"{n_tokens} tokens")


@dataclass
class ResampleAblate(RegionEdit):
    """Replace each selected position with the activation of a random position of random donor prompts."""

    donors: Sequence[Any] = field(default_factory=list)
    seed: int = 0
    kind: ClassVar[str] = "resample_ablate"
    writes_ids: ClassVar[bool] = True

    def __init__(self, hook: str, donors: Sequence[Any] = (), positions: Positions = None, heads=None, neurons=None,
                 seed: int = 0):
        RegionEdit.__init__(self, hook, positions, heads, neurons)
        self.donors, self.seed = donors, seed

    def _params_spec(self):
        return {"donors": list(self.donors), "seed": int(self.seed)}

    def _check(self, region, run):
        if not isinstance(self.donors, (list, tuple)) or not self.donors:
            raise HookError("resample ablation needs a list of donor prompts")
        checked_seed(self.seed, "resample seed", HookError)
        if axes(region.name).token != 0:
            raise HookError(f"resample ablation works on token-major hook points, not {region.name}")
        for donor in self.donors:
            run.donor_ids(donor)

    def _editor(self, region, run):
        names = resolve(self.hook, run.config)
        pool = torch.cat([run.record_donor(d, names)[region.name] for d in self.donors])
        pool = pool.to(run.model.point_device(region.name), run.model.dtype)
        generator = torch.Generator().manual_seed(int(self.seed))

        def edit(x, mask, ctx):
            rows = torch.randint(0, pool.shape[0], (x.shape[0],), generator=generator)
            return torch.where(mask, pool[rows.to(pool.device)], x)

        return edit


# "q" -> "attn.hook_q_lora", ...: the projections a ScaleAdapter names
_LORA_POINT_OF = {p.split(".")[1].removeprefix("hook_").removesuffix("_lora"): p for p in LORA_POINTS.values()}


@dataclass
class ScaleAdapter(Intervention):
    """Scale the call's LoRA terms by ``factor`` (0 removes the adapters) in chosen ``layers`` and ``projections``
    (``"q"``, ``"k"``, ``"v"``, ``"o"``, ``"gate"``, ``"up"``, ``"down"``; None: all), at chosen positions: where does
    the fine-tune act? A ``scale`` edit at each selected ``..._lora`` hook point; projections the adapters leave alone
    are untouched."""

    factor: float = 0.0
    layers: Sequence[int] | None = None
    projections: Sequence[str] | None = None
    positions: Positions = None
    kind: ClassVar[str] = "scale_adapter"

    def _parts(self, run: RunShape) -> list[Scale]:
        factor = _check_finite(self.factor, "adapter scale factor")
        projections = list(_LORA_POINT_OF) if self.projections is None else self.projections
        if isinstance(projections, str) or not all(isinstance(p, str) for p in projections):
            raise HookError(f"projections must be a list of names, got {self.projections!r}")
        unknown = sorted(set(projections) - set(_LORA_POINT_OF))
        if unknown:
            raise HookError(f"unknown projections {unknown}; choose from {', '.join(_LORA_POINT_OF)}")
        layers = _as_int_list(self.layers, "layers") if self.layers is not None else range(run.config.n_layers)
        bad = [i for i in layers if not 0 <= i < run.config.n_layers]
        if bad:
            raise HookError(f"layers {bad} out of range 0..{run.config.n_layers - 1}")
        return [Scale(f"blocks.{i}.{_LORA_POINT_OF[p]}", factor, self.positions) for i in layers for p in projections]

    def validate(self, run: RunShape) -> None:
        for part in self._parts(run):
            part.validate(run)

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        return merge_hooks(part.compile(run) for part in self._parts(run))

    def to_spec(self) -> dict[str, Any]:
        spec = {"type": self.kind, "factor": float(self.factor)}
        for key in ("layers", "projections", "positions"):
            value = getattr(self, key)
            if value is not None:
                spec[key] = value if isinstance(value, str) else list(value)
        return spec


@dataclass
class FunctionHook(Intervention):
    """A plain Python function at every matching hook point: ``fn(activation, ctx)`` returns the new
    activation (same shape) or None to leave it as is. ``ctx`` has the name, layer, positions and step.

    It runs in this process only: its spec names the function but cannot rebuild it (no replay).
    """

    hook: str
    fn: Callable[[torch.Tensor, HookContext], torch.Tensor | None]
    kind: ClassVar[str] = "function"

    def validate(self, run: RunShape) -> None:
        resolve(self.hook, run.config)
        if not callable(self.fn):
            raise HookError(f"a function hook needs a callable, got {type(self.fn).__name__}")

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        return {name: [self.fn] for name in resolve(self.hook, run.config)}

    def to_spec(self) -> dict[str, Any]:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return {"type": self.kind, "hook": self.hook, "function": f"{getattr(self.fn, '__module__', '?')}.{name}"}


@dataclass
class Composite(Intervention):
    """Several interventions applied together, in order."""

    parts: Sequence[Intervention] = field(default_factory=list)
    kind: ClassVar[str] = "composite"

    def __post_init__(self):
        if not isinstance(self.parts, (list, tuple)):
            raise HookError(f"a composite's parts must be a list of interventions, got {shorten(self.parts)}")
        self.parts = [from_spec(p) for p in self.parts]
        spec_leaves(self)  # as deep as a spec may nest, so that what runs also saves, loads and replays

    def to_spec(self) -> dict[str, Any]:
        return {"type": self.kind, "parts": [p.to_spec() for p in self.parts]}

    def validate(self, run: RunShape) -> None:
        for part in self.parts:
            part.validate(run)

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        return merge_hooks(part.compile(run) for part in self.parts)

    def saes(self) -> list[Any]:
        return [sae for part in self.parts for sae in part.saes()]


def merge_hooks(hook_maps) -> dict[str, list[HookFn]]:
    merged: dict[str, list[HookFn]] = {}
    for hooks in hook_maps:
        for name, fns in hooks.items():
            merged.setdefault(name, []).extend(fns)
    return merged


MAX_SPEC_DEPTH = 8  # composites inside composites; deeper specs are refused, not recursed into


def spec_leaves(spec: Any, max_depth: int = MAX_SPEC_DEPTH) -> list[Any]:
    """The interventions a spec applies: a composite's parts, recursively (walked without recursion, so a deeply
    nested spec is refused with a HookError instead of a RecursionError); anything else is one leaf."""
    leaves, stack = [], [(spec, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Composite):
            parts = item.parts
        elif isinstance(item, dict) and item.get("type") == Composite.kind:
            parts = item.get("parts", [])
        else:
            leaves.append(item)
            continue
        if depth >= max_depth:
            raise HookError(f"composite interventions nest more than {max_depth} deep")
        if not isinstance(parts, (list, tuple)):
            raise HookError(f"a composite's parts must be a list of interventions, got {shorten(parts)}")
        stack.extend((part, depth + 1) for part in reversed(parts))
    return leaves


def has_function_hook(specs: Sequence[Any]) -> bool:
    """Whether any of these specs, composites' parts included, is a plain function's (which no spec rebuilds)."""
    return any(isinstance(leaf, dict) and leaf.get("type") == FunctionHook.kind
               for spec in specs for leaf in spec_leaves(spec))


def intervention_list(value: Any, what: str = "interventions") -> list[Intervention]:
    """A call's interventions, a list (or other iterable) of them, each parsed by ``from_spec``. One intervention, spec
    or ``(hook, function)`` pair on its own is refused, not walked item by item (a spec's keys, a name's letters)."""
    single = isinstance(value, (Intervention, Mapping)) or (isinstance(value, tuple) and len(value) == 2
                                                            and isinstance(value[0], str) and callable(value[1]))
    if single or isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        shown = f"one {type(value).__name__}" if isinstance(value, Intervention) else shorten(value)
        raise HookError(f"{what} must be a list of interventions, got {shown}" + ("; pass [it]" if single else ""))
    return [from_spec(x) for x in value]


def from_spec(spec: dict[str, Any] | Intervention | tuple) -> Intervention:
    """An intervention from its JSON spec (``{"type": "steer", "hook": ..., ...}``), an Intervention, or a
    TransformerLens-style ``(hook_name, function)`` pair."""
    if isinstance(spec, Intervention):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2 and callable(spec[1]):
        return FunctionHook(*spec)
    if not isinstance(spec, dict) or "type" not in spec:
        raise HookError(f"an intervention is an Intervention, a (hook, function) pair or a dict with a 'type', "
                        f"got {shorten(spec)}")
    spec_leaves(spec)  # depth checked before the parts are built recursively
    spec = dict(spec)
    kind = spec.pop("type")
    cls = Intervention.registry.get(kind) if isinstance(kind, str) else None
    if cls is None and kind in FEATURE_KINDS:
        import workbench.probes.sae  # noqa: F401  (defines and registers the feature edits, which need SAEs)

        cls = Intervention.registry.get(kind)
    if cls is None:
        raise HookError(f"unknown intervention type {shorten(kind)}; known: {', '.join(sorted(Intervention.registry))}")
    if cls is FunctionHook:
        raise HookError(f"the function hook {shorten(spec.get('function'))} cannot be rebuilt from its spec; "
                        "pass the Python function itself")
    if not all(isinstance(key, str) for key in spec):
        raise HookError(f"a {kind} spec's keys must be strings")
    try:
        return cls(**spec)
    except TypeError as err:
        raise HookError(f"bad {kind} spec: {err}") from None
