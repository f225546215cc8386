"""A Trace: everything one call produced and everything needed to reproduce it, savable as an artifact.

An artifact is a directory with ``tensors.safetensors`` (logits and every recorded activation) and
``manifest.json`` (schema version, prompt, ids, model fingerprint, backend, versions, seed, intervention
specs, metrics, and sha256 content hashes of each tensor and of the tensors file). Loading verifies every
hash, so a modified, truncated or swapped file is reported instead of read. Nothing is pickled.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workbench.errors import WorkbenchError

if TYPE_CHECKING:  # the results layer sits above this module: imported where used
    from workbench.results import Distribution, TraceComparison

SCHEMA = "workbench.trace"
SCHEMA_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
_ACTIVATION_PREFIX = "activations."


class TraceError(WorkbenchError):
    """A trace artifact that is missing, corrupt, tampered with, or of an unknown schema."""


@dataclass
class Trace:
    prompt: str | list[int]
    ids: list[int]
    tokens: list[str]
    logits: torch.Tensor  # float32 [positions, vocab]
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    interventions: list[dict[str, Any]] = field(default_factory=list)  # JSON specs
    fingerprint: dict[str, Any] = field(default_factory=dict)  # model file sha256, path, architecture, formats
    backend: dict[str, Any] = field(default_factory=dict)  # device, dtype, kernels
    versions: dict[str, str] = field(default_factory=dict)
    seed: int | None = None
    chat: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    adapters: list[dict[str, Any]] = field(default_factory=list)  # LoRA adapters run with: name, scale, path, sha256

    def top_tokens(self, position: int = -1, k: int = 10) -> list[tuple[int, float]]:
        """(token id, probability) of the k most likely next tokens at a position."""
        from workbench.results import top_k

        return [(t.id, t.prob) for t in top_k(self.logits[position], k)]

    def next_token(self, k: int = 10, vocab: Any = None, position: int = -1) -> "Distribution":
        """The next-token distribution at a position: top ``k`` (named by ``vocab``, a model or its tokenizer) and
        entropy (``workbench.results.next_token``)."""
        from workbench.results import next_token

        return next_token(self.logits[position], k, vocab)

    def compare(self, other: "Trace", vocab: Any = None, per_position: bool = True) -> "TraceComparison":
        """How ``other`` differs from this trace: KL, top-1, logits, activations
        (``workbench.results.compare_traces``)."""
        from workbench.results import compare_traces

        return compare_traces(self, other, vocab, per_position)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Logits and activations under the keys the artifact stores them by."""
        out = {"logits": self.logits}
        out.update({_ACTIVATION_PREFIX + name: t for name, t in self.activations.items()})
        return out

    def save(self, path: str | Path) -> Path:
        """Write the artifact directory (created if needed; its two files are replaced atomically)."""
        from safetensors.torch import save_file

        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise TraceError(f"{directory} exists and is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {key: t.detach().to("cpu").contiguous().clone() for key, t in self.tensors().items()}
        tensors_path = directory / TENSORS_FILE
        save_file(tensors, str(tensors_path) + ".tmp")
        os.replace(str(tensors_path) + ".tmp", tensors_path)
        manifest = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "prompt": self.prompt,
            "chat": self.chat,
            "ids": list(self.ids),
            "tokens": list(self.tokens),
            "fingerprint": self.fingerprint,
            "backend": self.backend,
            "versions": self.versions,
            "seed": self.seed,
            "interventions": self.interventions,
            "metrics": self.metrics,
            "adapters": self.adapters,
            "tensors": {key: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                              "sha256": tensor_sha256(t)} for key, t in tensors.items()},
            "tensors_file": {"name": TENSORS_FILE, "bytes": tensors_path.stat().st_size,
                             "sha256": file_sha256(tensors_path)},
        }
        manifest_path = directory / MANIFEST_FILE
        manifest_path.with_suffix(".tmp").write_text(json.dumps(manifest, indent=1))
        os.replace(manifest_path.with_suffix(".tmp"), manifest_path)
        return directory

    def to_activation_cache(self, model: Any = None):
        """A ``transformer_lens.ActivationCache`` of the recorded activations (see hooks.activation_cache)."""
        from .activation_cache import to_activation_cache

        return to_activation_cache(self, model)


def load_trace(path: str | Path) -> Trace:
    """Read an artifact saved by ``Trace.save`` (its directory or its manifest), verifying every hash."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path)
    if directory.name == MANIFEST_FILE:
        directory = directory.parent
    manifest_path, tensors_path = directory / MANIFEST_FILE, directory / TENSORS_FILE
    if not manifest_path.is_file():
        raise TraceError(f"{directory} is not a trace artifact: {MANIFEST_FILE} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TraceError(f"{manifest_path} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise TraceError(f"{manifest_path} is not a workbench trace manifest")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise TraceError(f"{manifest_path} has schema version {version!r}; this workbench reads up to {SCHEMA_VERSION}")
    try:
        expected_file, expected_tensors = manifest["tensors_file"], manifest["tensors"]
        ids, tokens, prompt = manifest["ids"], manifest["tokens"], manifest["prompt"]
    except KeyError as err:
        raise TraceError(f"{manifest_path} lacks the field {err}") from None
    if not (isinstance(expected_file, dict) and isinstance(expected_tensors, dict)
            and all(isinstance(entry, dict) for entry in expected_tensors.values())):
        raise TraceError(f"{manifest_path} has malformed tensor entries")
    if not tensors_path.is_file():
        raise TraceError(f"{tensors_path} is missing")
    if file_sha256(tensors_path) != expected_file.get("sha256"):
        raise TraceError(f"{tensors_path} does not match the sha256 in its manifest: the file was modified or is corrupt")
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise TraceError(f"{tensors_path} cannot be read: {err}") from None
    if set(tensors) != set(expected_tensors):
        missing, extra = sorted(set(expected_tensors) - set(tensors)), sorted(set(tensors) - set(expected_tensors))
        raise TraceError(f"{tensors_path} does not hold the tensors its manifest lists (missing {missing}, extra {extra})")
    for key, t in tensors.items():
        entry = expected_tensors[key]
        if (list(t.shape) != entry.get("shape") or str(t.dtype).removeprefix("torch.") != entry.get("dtype")
                or tensor_sha256(t) != entry.get("sha256")):
            raise TraceError(f"tensor {key!r} in {tensors_path} does not match its manifest entry (shape, dtype or hash)")
    activations = {key[len(_ACTIVATION_PREFIX):]: t for key, t in tensors.items() if key.startswith(_ACTIVATION_PREFIX)}
    return Trace(prompt=prompt, ids=list(ids), tokens=list(tokens), logits=tensors["logits"], activations=activations,
                 interventions=manifest.get("interventions", []), fingerprint=manifest.get("fingerprint", {}),
                 backend=manifest.get("backend", {}), versions=manifest.get("versions", {}), seed=manifest.get("seed"),
                 chat=bool(manifest.get("chat", False)), metrics=manifest.get("metrics", {}),
                 adapters=manifest.get("adapters", []))


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in memory order (the manifest records dtype and shape beside it)."""
    return hashlib.sha256(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_mismatch(fingerprint: dict[str, Any], model: Any) -> str | None:
    """Why a trace's fingerprint does not describe ``model`` (weights hash, config, tensor formats), or None."""
    sha = fingerprint.get("sha256")
    if sha != model.file_sha256:
        return f"weights sha256 {str(sha)[:12]}... vs this model's {model.file_sha256[:12]}..."
    config = model.config.to_dict()
    differing = sorted(k for k in config.keys() | fingerprint.get("config", {}).keys()
                       if config.get(k) != fingerprint.get("config", {}).get(k))
    if differing:
        return f"config differs in {', '.join(differing)}"
    formats = fingerprint.get("formats")
    if formats is not None and formats != model.tensor_formats():
        return "tensor formats differ (quantized differently)"
    return None
