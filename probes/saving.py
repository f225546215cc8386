"""Saving fitted objects (probes, tuned lenses) as safetensors + JSON, and checking they fit a model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from workbench.errors import WorkbenchError, shorten
from workbench.files import read_json
from workbench.hooks import point_shapes


def artifact_paths(path: str | Path) -> tuple[Path, Path]:
    """(``base.safetensors``, ``base.json``) for a base path given with or without either suffix."""
    path = Path(path)
    base = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    return base.with_suffix(".safetensors"), base.with_suffix(".json")


def existing_artifact(path: str | Path, what: str) -> tuple[Path, Path]:
    files = artifact_paths(path)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WorkbenchError(f"{what} files not found: {', '.join(missing)}")
    return files


def write_artifact(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``tensors`` to ``path.safetensors`` and ``meta`` to ``path.json``; returns both paths."""
    tensors_file, json_file = artifact_paths(path)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(tensors_file))
    json_file.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return tensors_file, json_file


def read_artifact(path: str | Path, what: str, fmt: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata ``write_artifact`` wrote, after checking the metadata names format ``fmt``."""
    tensors_file, json_file = existing_artifact(path, what)
    meta = read_json(json_file)
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise WorkbenchError(f"{json_file} is not a workbench {what} (format {shorten(found)})")
    return load_file(str(tensors_file)), meta


def model_signature(model: Any, hook: str | None = None) -> dict[str, Any]:
    """What a fitted object (probe, tuned lens) must match to apply to a model: architecture, widths, depth,
    and the shape of the hook it reads."""
    c = model.config
    signature = {"architecture": c.architecture, "d_model": c.d_model, "n_layers": c.n_layers, "model_name": c.name}
    if hook is not None:
        signature.update(hook=hook, hook_shape=point_shapes(c)[hook])
    return signature


def check_signature(saved: dict[str, Any], model: Any, what: str) -> None:
    """Raise a clear error when ``model`` differs from the one ``saved`` was fitted on."""
    hook = saved.get("hook")
    if hook is not None and hook not in point_shapes(model.config):
        raise WorkbenchError(f"{what} reads {hook}, which model {model.config.name!r} does not have")
    theirs = model_signature(model, hook)
    for key in ("architecture", "d_model", "n_layers", "hook_shape"):
        if key in saved and theirs[key] != saved[key]:
            raise WorkbenchError(f"{what} was fitted on {saved['model_name']!r} ({key} {saved[key]}); "
                                 f"model {theirs['model_name']!r} has {key} {theirs[key]}")
