"""Hook point names: listing, pattern matching with close-match suggestions, and axis layout."""
from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

from workbench.config import ModelConfig
from workbench.errors import HookError, shorten
from workbench.runner import GLOBAL_POINTS, LORA_POINTS, block_points, hook_point_names


@dataclass(frozen=True)
class Axes:
    """Where the token, head and feature axes of a hook point's activation are (None: no such axis)."""

    token: int
    head: int | None
    feature: int | None


# Activations are [T, ...] except attention scores/patterns, which are [heads, T, S].
_AXES = {
    "attn.hook_q": Axes(0, 1, 2), "attn.hook_k": Axes(0, 1, 2), "attn.hook_v": Axes(0, 1, 2),
    "attn.hook_rot_q": Axes(0, 1, 2), "attn.hook_rot_k": Axes(0, 1, 2), "attn.hook_z": Axes(0, 1, 2),
    "attn.hook_result": Axes(0, 1, 2),
    "attn.hook_attn_scores": Axes(1, 0, None), "attn.hook_pattern": Axes(1, 0, None),
    "attn.q_norm.hook_scale": Axes(0, 1, None), "attn.k_norm.hook_scale": Axes(0, 1, None),
    "attn.q_norm.hook_normalized": Axes(0, 1, 2), "attn.k_norm.hook_normalized": Axes(0, 1, 2),
    "ln1.hook_scale": Axes(0, None, None), "ln2.hook_scale": Axes(0, None, None),
    "ln1_post.hook_scale": Axes(0, None, None), "ln2_post.hook_scale": Axes(0, None, None),
    "ln_final.hook_scale": Axes(0, None, None),
    "mlp.hook_expert_indices": Axes(0, None, None), "mlp.hook_expert_weights": Axes(0, None, None),
    "mlp.hook_expert_out": Axes(0, None, 2),  # [T, top_k, d_model]: a vector added reaches every chosen expert
}
_TOKEN_MAJOR = Axes(0, None, 1)
# points whose values are ids, not activations: a declarative edit there may only copy them from other runs or
# choose the experts itself (RegionEdit.writes_ids)
ID_POINTS = ("mlp.hook_expert_indices",)

# The points an SAE attached at a hook fires under it (``blocks.3.hook_resid_post.hook_sae_acts_post``; hooks/saes.py)
SAE_POINTS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
              "hook_sae_output")


def split_sae_point(name: str) -> tuple[str, str] | None:
    """``(SAE hook, point)`` of an SAE hook point name, else None."""
    base, _, suffix = name.rpartition(".")
    return (base, suffix) if suffix in SAE_POINTS and base else None


@lru_cache(maxsize=4096)  # called for every recorded point of every prompt
def axes(name: str) -> Axes:
    """Axis layout of a hook point by its name."""
    suffix = name.split(".", 2)[2] if name.startswith("blocks.") else name
    return _AXES.get(suffix, _TOKEN_MAJOR)


def layer_of(name: str) -> int | None:
    """The block a hook point lies in (None for the embedding's and the final norm's and logits' points)."""
    return int(name.split(".")[1]) if name.startswith("blocks.") else None


def point_shapes(config: ModelConfig, lora: bool = False) -> dict[str, str]:
    """Every hook point with its shape, dimensions filled in from the config (T/S stay symbolic); with ``lora``, the
    LoRA terms' points too."""
    table = _shape_table(config)
    return dict(table if lora else table[:len(hook_point_names(config))])


@lru_cache(maxsize=16)
def lora_point_names(n_layers: int) -> tuple[str, ...]:
    """The hook points of the adapted projections' LoRA terms (``runner.LORA_POINTS``), layer by layer."""
    return tuple(f"blocks.{i}.{p}" for i in range(n_layers) for p in LORA_POINTS.values())


_LORA_PROJECTION = {p: proj for proj, p in LORA_POINTS.items()}


def _lora_width(suffix: str, config: ModelConfig) -> int:
    from workbench.adapters import projection_shape

    return projection_shape(config, _LORA_PROJECTION[suffix])[0]


def _dims(config: ModelConfig, layer: int | None) -> dict[str, int]:
    """The sizes a point's shape names, at ``layer`` (Gemma 4's global layers have heads and MLPs of their own)."""
    n_kv_heads, d_head = config.layer_heads(layer) if layer is not None else (config.n_kv_heads, config.d_head)
    dims = {"d_model": config.d_model, "n_heads": config.n_heads, "n_kv_heads": n_kv_heads, "d_head": d_head,
            "d_mlp": config.layer_d_mlp(layer) if layer is not None else config.d_mlp,
            "vocab_size": config.vocab_size, "d_per_layer": config.d_per_layer or 0}
    if config.moe is not None:
        dims.update(n_experts=config.moe.n_experts, top_k=config.moe.n_experts_used)
    return dims


@lru_cache(maxsize=16)
def _shape_table(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    def fill(shape: str, layer: int | None) -> str:
        for key, value in _dims(config, layer).items():
            shape = shape.replace(key, str(value))
        return shape

    out = []
    blocks = block_points(config)
    for name in hook_point_names(config):
        suffix = name.split(".", 2)[2] if name.startswith("blocks.") else name
        out.append((name, fill(blocks.get(suffix) or GLOBAL_POINTS[suffix], layer_of(name))))
    out += [(name, f"[T, {_lora_width(name.split('.', 2)[2], config)}]") for name in lora_point_names(config.n_layers)]
    return tuple(out)


def token_shape(name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """Shape of one token's slice of the activation (e.g. ``(d_model,)``, ``(n_heads, d_head)``).

    None for attention scores and patterns, whose slices grow with the attended slots, and for an SAE's features.
    """
    if split_sae_point(name):
        size = feature_size(name, config)
        return None if size is None else (size,)
    return _token_shapes(config)[name]


@lru_cache(maxsize=16)
def _token_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    out = {}
    for name, shape in _shape_table(config):
        dims = shape.strip("[]").split(", ")[1:]
        out[name] = tuple(int(d) for d in dims) if all(d.isdigit() for d in dims) else None
    return out


def head_count(name: str, config: ModelConfig) -> int | None:
    if axes(name).head is None:
        return None
    kv = name.endswith(("hook_k", "hook_v", "hook_rot_k")) or ".k_norm." in name or ".v_norm." in name
    return _dims(config, layer_of(name))["n_kv_heads"] if kv else config.n_heads


def feature_size(name: str, config: ModelConfig) -> int | None:
    """Length of the last (feature) axis that a vector added at this point must have."""
    sae_point = split_sae_point(name)
    if sae_point:  # an SAE's feature axis is the SAE's own (its width is not the model's to tell)
        acts = sae_point[1] in ("hook_sae_acts_pre", "hook_sae_acts_post")
        return None if acts else feature_size(sae_point[0], config)
    a = axes(name)
    if a.feature is None:
        return None
    if a.head is not None:
        return config.d_model if name.endswith("hook_result") else _dims(config, layer_of(name))["d_head"]
    if name.endswith("_lora"):
        return _lora_width(name.split(".", 2)[2], config)
    if name.endswith(("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")):
        return _dims(config, layer_of(name))["d_mlp"]
    if name.endswith("per_layer.hook_input"):
        return config.d_per_layer
    if name.endswith("mlp.hook_router_logits"):
        return config.moe.n_experts
    return config.vocab_size if name == "hook_logits" else config.d_model


MAX_NAME_LENGTH = 256
# What a hook point's name can look like (a global point, or blocks.<layer>.<suffix>): no glob, no empty part.
_POINT_NAME = re.compile(r"(blocks\.\d+\.)?[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_point_name(name: str) -> bool:
    """Whether ``name`` could name one hook point of some model (``resolve`` says which a model has)."""
    return isinstance(name, str) and len(name) <= MAX_NAME_LENGTH and _POINT_NAME.fullmatch(name) is not None


def check_patterns(patterns: object, what: str) -> None:
    """Refuse ``patterns`` unless they are a list of hook point names or globs: a name on its own would be walked
    letter by letter. ``what`` names the argument in the error."""
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Iterable):
        raise HookError(f"{what} must be a list of hook point names or globs, got {shorten(patterns)}"
                        + ("; pass [it]" if isinstance(patterns, str) else ""))


def resolve(pattern: str, config: ModelConfig) -> list[str]:
    """Hook point names matching an exact name or a glob (``blocks.*.hook_resid_post``, ``*``). The LoRA terms'
    points (``blocks.3.attn.hook_q_lora``) match only patterns that name them (with ``lora``), and an SAE's points
    only a last part that does (``<hook>.hook_sae_*``): ``*`` matches what it matches in a model without adapters or
    SAEs."""
    if not isinstance(pattern, str) or not pattern:
        raise HookError(f"a hook name must be a non-empty string, got {shorten(pattern)}")
    if len(pattern) > MAX_NAME_LENGTH:  # no point is named so; a huge glob or layer number costs time to reject
        raise HookError(f"unknown hook point {shorten(pattern)}: longer than {MAX_NAME_LENGTH} characters")
    sae_point = split_sae_point(pattern)
    if sae_point:  # a point of an SAE at the hook (the call checks that one is attached)
        return [f"{base}.{sae_point[1]}" for base in resolve(sae_point[0], config)]
    base, _, suffix = pattern.rpartition(".")
    sae_points = fnmatch.filter(SAE_POINTS, suffix) if base and "sae" in suffix else []
    if sae_points:  # a glob over an SAE's points (``blocks.3.hook_resid_post.hook_sae_*``), named as above
        return [f"{name}.{point}" for name in resolve(base, config) for point in sae_points]
    names = lora_point_names(config.n_layers) if "lora" in pattern else hook_point_names(config)
    if any(ch in pattern for ch in "*?["):
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise HookError(f"no hook point matches {shorten(pattern)}{_suggestion(pattern.replace('*', '0'), names)}")
        return matched
    if pattern in names:
        return [pattern]
    if pattern.startswith("blocks.") and pattern.split(".")[1].isascii() and pattern.split(".")[1].isdigit():
        layer = int(pattern.split(".")[1])
        if not 0 <= layer < config.n_layers:
            raise HookError(f"layer {layer} in {shorten(pattern)} is out of range: the model has layers 0..{config.n_layers - 1}")
    raise HookError(f"unknown hook point {shorten(pattern)}{_suggestion(pattern, names)}")


def _suggestion(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else "; model.hook_points() lists them"
