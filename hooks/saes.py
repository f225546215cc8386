"""Sparse autoencoders and transcoders attached to a forward, with SAELens' hook points under the SAE's hook.

An SAE attached at hook ``H`` runs after every other hook at ``H`` (interventions and recorders there see the
forward's own activation) and fires ``H.hook_sae_input``, ``H.hook_sae_acts_pre``, ``H.hook_sae_acts_post``,
``H.hook_sae_recons``, ``H.hook_sae_error`` and ``H.hook_sae_output``, hookable and recordable like any other point. A
transcoder reads its input point (``H``, e.g. ``blocks.3.ln2.hook_normalized``) and runs at its output point
(``hook_out``, e.g. ``blocks.3.hook_mlp_out``); its points are named under ``H`` too.

With ``use_error_term`` (the default) the activation passed on is the forward's own plus what hooks on the SAE's points
changed in the SAE's output (and in its error term): with no edit, no bit changes. Without it, the reconstruction
alone is spliced in (SAELens' ``use_error_term=False``), and ``hook_sae_error`` does not fire.

The SAE objects are duck-typed (``workbench.probes.sae.SAE``): ``hook``, ``hook_out``, ``is_transcoder``, ``d_in``,
``d_out``, ``dtype``, ``label()`` and ``forward(x, fire) -> (acts, output)``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from workbench.config import ModelConfig
from workbench.errors import HookError
from workbench.kernels.tracing import tracks_grad
from workbench.runner import HookContext, HookFn, hook_point_names, run_hooks

from .points import SAE_POINTS, axes, feature_size, layer_of, split_sae_point


def check_saes(saes: Sequence[Any], config: ModelConfig) -> list[Any]:
    """The SAEs of a call, checked against the model before any compute: known hook points with a feature axis of
    the SAE's width, a transcoder's input before its output in the same forward, one SAE per hook."""
    if saes is None:
        return []
    if isinstance(saes, (str, bytes)) or not isinstance(saes, Sequence):
        raise HookError(f"saes must be a list of SAEs, got {type(saes).__name__}")
    names = hook_point_names(config)
    seen: dict[str, Any] = {}
    for sae in saes:
        if not all(hasattr(sae, a) for a in ("hook", "hook_out", "forward", "d_in", "d_out")):
            raise HookError(f"saes takes SAE objects (workbench.probes.load_sae), got {type(sae).__name__}")
        for point, width, what in ((sae.hook, sae.d_in, "d_in"), (sae.hook_out, sae.d_out, "d_out")):
            if point not in names:
                raise HookError(f"{sae.label()}: cannot attach to {point!r}: not a hook point of this model "
                                "(model.hook_points() lists them)")
            size = feature_size(point, config)
            if axes(point).token != 0 or axes(point).head is not None or size is None:
                raise HookError(f"{sae.label()}: cannot attach to {point}: an SAE reads one vector per token")
            if size != width:
                raise HookError(f"{sae.label()}: its {what} is {width} but {point} has {size} features")
        if sae.is_transcoder:
            start, end = names.index(sae.hook), names.index(sae.hook_out)
            if not start < end or layer_of(sae.hook) != layer_of(sae.hook_out):
                raise HookError(f"{sae.label()}: a transcoder reads {sae.hook} and writes {sae.hook_out}: the input "
                                "must come first, in the same block")
        if sae.hook in seen and seen[sae.hook] is not sae:
            raise HookError(f"two SAEs attached at {sae.hook}: attach one per hook point")
        seen[sae.hook] = sae
    return list(dict.fromkeys(saes))


def check_sae_points(names: Sequence[str], saes: Sequence[Any]) -> None:
    """Refuse hooks or records on an SAE point whose SAE is not attached to the call."""
    attached = {sae.hook for sae in saes}
    for name in names:
        split = split_sae_point(name)
        if split and split[0] not in attached:
            raise HookError(f"{name} needs an SAE at {split[0]}: pass saes=[...] with one")


def attach_saes(hooks: Mapping[str, Sequence[HookFn]] | None, saes: Sequence[Any], use_error_term: bool = True
                ) -> dict[str, list[HookFn]]:
    """``hooks`` with each SAE run at its point after them, firing its points from the same map (so a batch's
    per-prompt hooks and recorders of those points act as at any other point)."""
    merged = {name: list(fns) for name, fns in (hooks or {}).items()}
    check_sae_points(list(merged), saes)
    for sae in saes:
        if sae.is_transcoder:
            stash: list[torch.Tensor] = []
            merged.setdefault(sae.hook, []).append(_stash(stash))
            merged.setdefault(sae.hook_out, []).append(_sae_hook(sae, merged, use_error_term, stash))
        else:
            merged.setdefault(sae.hook, []).append(_sae_hook(sae, merged, use_error_term, None))
    return merged


def _stash(stash: list[torch.Tensor]) -> HookFn:
    def keep(x: torch.Tensor, ctx: HookContext) -> None:
        stash[:] = [x]

    return keep


def _sae_hook(sae: Any, hooks: Mapping[str, Sequence[HookFn]], use_error_term: bool,
              stash: list[torch.Tensor] | None) -> HookFn:
    names = {point: f"{sae.hook}.{point}" for point in SAE_POINTS}

    def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
        hooked = {point for point, name in names.items() if hooks.get(name)}
        if use_error_term and not hooked:
            return None  # nothing reads or edits the SAE: it passes the activation on as it is
        source = stash[0] if stash is not None else x

        def fire(point: str, value: torch.Tensor) -> torch.Tensor:
            if point not in hooked:
                return value
            # hooks get a copy: an in-place edit then counts, and never reaches the forward's own tensor
            return run_hooks(hooks[names[point]], value.clone(), HookContext(
                names[point], ctx.layer, ctx.positions, ctx.step, ctx.prompt, ctx.layout))

        _, out = sae.forward(source, fire)
        if not use_error_term:
            return fire("hook_sae_output", out)
        # in a gradient run the clean reconstruction is differentiated too: x + (out - clean) is x where nothing is
        # edited, and so is its gradient (a constant clean would add the SAE's Jacobian to every gradient before it)
        with torch.set_grad_enabled(tracks_grad(source)):
            _, clean = sae.forward(source)
        delta = out - clean
        if "hook_sae_error" in hooked:
            error = x.to(clean.dtype) - clean
            delta = delta + (fire("hook_sae_error", error) - error)
        # x itself wherever nothing changed (x + 0 would turn -0.0 into +0.0), but in a gradient run, whose taps add
        # zeros that the gradient must pass through
        out = x + delta if delta.requires_grad else torch.where(delta != 0, x + delta, x)
        return fire("hook_sae_output", out)

    return fn
