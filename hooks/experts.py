"""Interventions on a mixture-of-experts model's routing, as JSON specs like the others.

- ``ablate_expert``: take experts out of the MoE blocks. ``mode="drop"`` (default) keeps each token's choice and
  gives the ablated experts' slots weight zero (``renormalize``: the other chosen experts' weights are scaled back
  to the token's original total); ``mode="reroute"``: a token that chose one of them takes instead the top
  ``n_experts_used`` of the other experts by its router logits, weighted as the model weights that choice (from the
  router's probabilities over all experts, as ``force_routing``); a token that chose none is untouched, so ablating
  an expert no token picks changes nothing.
- ``force_routing``: the experts (``n_experts_used`` of them) every selected token goes to, with the router's own
  weights for them, or ``weights`` given.
- ``steer_expert``: multiply the outputs of experts by ``scale`` and add ``vector`` (before the routing weight).

Each names the MoE block by ``layer`` (None: every block) and selects tokens by ``positions`` as the other edits do.
An edit that needs to know which experts a token chose sees them after the interventions listed before it.
"""
from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from workbench.errors import HookError
from workbench.runner import HookContext, HookFn

from .interventions import (Positions, Region, RegionEdit, RunShape, _as_int_list, _as_vector, _check_finite,
                            _region_mask)
from .points import axes

MODES = ("drop", "reroute")


class ExpertEdit(RegionEdit):
    """An edit of the experts ``experts`` in the MoE block ``layer`` (None: every block), at ``positions``."""

    point: ClassVar[str] = "mlp.hook_router_logits"  # the hook point whose name resolves the blocks
    writes_ids: ClassVar[bool] = True  # rerouting and forcing choose the experts

    def __init__(self, experts: Sequence[int], layer: int | None = None, positions: Positions = None):
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise HookError(f"layer must be an integer or None, got {layer!r}")
        RegionEdit.__init__(self, f"blocks.{'*' if layer is None else layer}.{self.point}", positions)
        self.layer = layer
        self.experts = _as_int_list(experts, "experts")

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"type": self.kind, "experts": self.experts, "layer": self.layer}
        if self.positions is not None:
            spec["positions"] = self.positions if isinstance(self.positions, str) else _as_int_list(self.positions,
                                                                                                   "positions")
        spec.update(self._params_spec())
        return spec

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_spec() == self.to_spec()

    def validate(self, run: RunShape) -> None:
        moe = run.config.moe
        if moe is None:
            raise HookError(f"{self.kind} needs a mixture-of-experts model; {run.config.name or 'this model'} is dense")
        bad = [e for e in self.experts if not 0 <= e < moe.n_experts]
        if bad:
            raise HookError(f"experts {bad} out of range 0..{moe.n_experts - 1}")
        super().validate(run)

    def _token_mask(self, region: Region, run: RunShape):
        """``mask(x, ctx)``: the selected tokens of activation ``x`` as a ``[T, 1, ...]`` mask, None where none is."""
        positions = region.positions
        if isinstance(positions, list):
            positions = torch.tensor(positions, device=run.model.device)

        def mask(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            return _region_mask(x, axes(ctx.name), ctx.positions, positions, None, None, run.prompt_len)

        return mask

    def _editor(self, region, run):  # compile() is overridden: these edits reach several points of a block
        raise NotImplementedError

    @staticmethod
    def _block(region: Region) -> str:
        return region.name.rsplit(".", 1)[0]  # "blocks.{i}.mlp"


class _ChosenExperts:
    """The experts each token of a forward chose (per prompt of a batch), seen at ``hook_expert_indices``."""

    def __init__(self):
        self.by_prompt: dict[int, torch.Tensor] = {}

    def observe(self, x: torch.Tensor, ctx: HookContext) -> None:
        self.by_prompt[ctx.prompt] = x

    def chose(self, ctx: HookContext, experts: torch.Tensor) -> torch.Tensor:
        """``[T, k]``: whether each slot of each token holds one of ``experts``."""
        return torch.isin(self.by_prompt[ctx.prompt], experts)


class _Reroute:
    """One reroute edit of one block: the router logits it sees, and the experts each token may not take, its own
    (at its positions) and those of the reroute edits of the block listed before it (per prompt of a batch)."""

    def __init__(self, experts: torch.Tensor, n_experts: int, token_mask, before: _Reroute | None):
        self.experts, self.token_mask, self.before = experts, token_mask, before
        self.columns = torch.zeros(n_experts, dtype=torch.bool, device=experts.device)
        self.columns[experts] = True
        self.logits: dict[int, torch.Tensor] = {}
        self.excluded: dict[int, torch.Tensor] = {}

    def observe(self, logits: torch.Tensor, ctx: HookContext) -> None:
        mask = self.token_mask(logits, ctx)
        excluded = torch.zeros_like(logits, dtype=torch.bool) if mask is None else mask & self.columns
        if self.before is not None:  # its hook ran before this one, on the same logits
            excluded = excluded | self.before.excluded[ctx.prompt]
        self.logits[ctx.prompt], self.excluded[ctx.prompt] = logits, excluded

    def reroute(self, indices: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
        mask = self.token_mask(indices, ctx)
        if mask is None:
            return None
        # only tokens that chose an ablated expert move: the others keep their choice, and so their weights
        moved = mask & torch.isin(indices, self.experts).any(-1, keepdim=True)
        scores = self.logits[ctx.prompt].masked_fill(self.excluded[ctx.prompt], float("-inf"))
        return torch.where(moved, scores.topk(indices.shape[-1], dim=-1).indices, indices)


def _reroutes(run: RunShape, block: str) -> dict[str, Any]:
    """The reroute ablations of ``block`` in this call so far: the experts they take out, the last one compiled."""
    return run.reroutes.setdefault(block, {"taken_out": set(), "last": None})


class AblateExpert(ExpertEdit):
    kind: ClassVar[str] = "ablate_expert"

    def __init__(self, experts: Sequence[int], layer: int | None = None, positions: Positions = None,
                 mode: str = "drop", renormalize: bool = False):
        super().__init__(experts, layer, positions)
        self.mode, self.renormalize = mode, renormalize

    def _params_spec(self):
        return {"mode": self.mode, "renormalize": self.renormalize}

    def validate(self, run: RunShape) -> None:
        if self.mode not in MODES:
            raise HookError(f"ablate_expert mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.renormalize, bool):
            raise HookError(f"renormalize must be true or false, got {self.renormalize!r}")
        if self.renormalize and self.mode == "reroute":
            raise HookError("renormalize applies to mode 'drop'; a rerouted token's weights are the model's own")
        super().validate(run)
        moe = run.config.moe
        if self.mode != "reroute":
            return
        for region in self.regions(run):  # with the reroutes of the block listed before this one
            taken_out = _reroutes(run, self._block(region))["taken_out"]
            taken_out.update(self.experts)
            if moe.n_experts - len(taken_out) < moe.n_experts_used:
                raise HookError(f"rerouting around {len(taken_out)} of {moe.n_experts} experts "
                                f"{sorted(taken_out)} leaves fewer than the {moe.n_experts_used} each token uses")

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        hooks: dict[str, list[HookFn]] = {}
        experts = torch.tensor(self.experts, device=run.model.device)
        n_experts = run.config.moe.n_experts
        for region in self.regions(run):
            token_mask, block = self._token_mask(region, run), self._block(region)
            if self.mode == "reroute":
                chain = _reroutes(run, block)
                chain["last"] = reroute = _Reroute(experts, n_experts, token_mask, chain["last"])
                hooks[region.name] = [reroute.observe]
                hooks[f"{block}.hook_expert_indices"] = [reroute.reroute]
                continue
            chosen = _ChosenExperts()
            hooks[f"{block}.hook_expert_indices"] = [chosen.observe]
            hooks[f"{block}.hook_expert_weights"] = [self._drop(token_mask, chosen, experts)]
        return hooks

    def _drop(self, token_mask, chosen: _ChosenExperts, experts: torch.Tensor) -> HookFn:
        renormalize = self.renormalize

        def fn(weights: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            mask = token_mask(weights, ctx)
            if mask is None:
                return None
            kept = weights.masked_fill(mask & chosen.chose(ctx, experts), 0.0)
            if renormalize:  # the token's other experts carry its original total weight
                total, left = weights.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
                kept = torch.where(left > 0, kept * (total / left.clamp_min(torch.finfo(left.dtype).tiny)), kept)
            return kept

        return fn


class ForceRouting(ExpertEdit):
    kind: ClassVar[str] = "force_routing"
    point: ClassVar[str] = "mlp.hook_expert_indices"

    def __init__(self, experts: Sequence[int], layer: int | None = None, positions: Positions = None,
                 weights: Sequence[float] | None = None):
        super().__init__(experts, layer, positions)
        self.weights = None if weights is None else _as_vector(weights, "routing weights")

    def _params_spec(self):
        return {} if self.weights is None else {"weights": self.weights.tolist()}

    def validate(self, run: RunShape) -> None:
        super().validate(run)
        k = run.config.moe.n_experts_used
        if len(self.experts) != k or len(set(self.experts)) != k:
            raise HookError(f"force_routing needs {k} distinct experts (the model routes each token to {k}), "
                            f"got {self.experts}")
        if self.weights is not None and tuple(self.weights.shape) != (k,):
            raise HookError(f"routing weights must be {k} numbers, got shape {tuple(self.weights.shape)}")

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        hooks: dict[str, list[HookFn]] = {}
        device = run.model.device
        for region in self.regions(run):
            token_mask = self._token_mask(region, run)
            hooks[region.name] = [self._replace(token_mask, torch.tensor(self.experts, device=device))]
            if self.weights is not None:
                hooks[f"{self._block(region)}.hook_expert_weights"] = [self._replace(token_mask,
                                                                                     self.weights.to(device))]
        return hooks

    @staticmethod
    def _replace(token_mask, row: torch.Tensor) -> HookFn:
        def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            mask = token_mask(x, ctx)
            return None if mask is None else torch.where(mask, row.to(x.dtype).expand_as(x), x)

        return fn


class SteerExpert(ExpertEdit):
    kind: ClassVar[str] = "steer_expert"

    def __init__(self, experts: Sequence[int], layer: int | None = None, positions: Positions = None,
                 scale: float = 1.0, vector: Any = None):
        super().__init__(experts, layer, positions)
        self.scale = _check_finite(scale, "expert output scale")
        self.vector = None if vector is None else _as_vector(vector, "steering vector")

    def _params_spec(self):
        return {"scale": self.scale, **({} if self.vector is None else {"vector": self.vector.tolist()})}

    def validate(self, run: RunShape) -> None:
        super().validate(run)
        if self.vector is not None and tuple(self.vector.shape) != (run.config.d_model,):
            raise HookError(f"steering vector for an expert's output must have shape ({run.config.d_model},), "
                            f"got {tuple(self.vector.shape)}")

    def compile(self, run: RunShape) -> dict[str, list[HookFn]]:
        hooks: dict[str, list[HookFn]] = {}
        experts = torch.tensor(self.experts, device=run.model.device)
        vector = None if self.vector is None else self.vector.to(run.model.device)
        scale = self.scale
        for region in self.regions(run):
            token_mask, chosen, block = self._token_mask(region, run), _ChosenExperts(), self._block(region)

            def fn(out: torch.Tensor, ctx: HookContext, token_mask=token_mask, chosen=chosen) -> torch.Tensor | None:
                mask = token_mask(out, ctx)  # [T, 1, 1]
                if mask is None:
                    return None
                edited = out * scale if vector is None else out * scale + vector.to(out.dtype)
                return torch.where(mask & chosen.chose(ctx, experts)[..., None], edited, out)

            hooks[f"{block}.hook_expert_indices"] = [chosen.observe]
            hooks[f"{block}.hook_expert_out"] = [fn]
        return hooks
