"""A Trace: everything one call produced and everything needed to reproduce it, savable as an artifact.

An artifact is a directory with ``tensors.safetensors`` (logits and every recorded activation) and
``manifest.json`` (schema version, prompt, ids, model fingerprint, backend, versions, seed, intervention
specs, metrics, sha256 content hashes of each tensor and of the tensors file, and a sha256 of all of that).
Loading verifies every hash and that the manifest agrees with the tensors, so a modified, truncated or swapped
file is reported instead of read. Nothing is pickled, and nothing is read or written through a symbolic link
(docs/security.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workbench.config import ModelConfig
from workbench.errors import WorkbenchError, clip, shorten
from workbench.files import open_folder, replace_file
from workbench.messages import check_messages, is_messages

from .batching import check_reduce
from .points import ID_POINTS, axes, is_point_name

if TYPE_CHECKING:  # the results layer sits above this module: imported where used
    from workbench.results import Distribution, TraceComparison

SCHEMA = "workbench.trace"
SCHEMA_VERSION = 2  # 2: the manifest carries manifest_sha256
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # intervention specs hold vectors; far more is not a manifest
_ACTIVATION_PREFIX = "activations."


class TraceError(WorkbenchError):
    """A trace artifact that is missing, corrupt, tampered with, or of an unknown schema."""


@dataclass
class Trace:
    prompt: str | list[int] | list[dict[str, str]]  # a text, ids, or a conversation (rendered with chat)
    ids: list[int]
    tokens: list[str]
    # float32 [positions, vocab]; [1, vocab], the last position's, from a batch run with logits="last"; None with
    # logits=None
    logits: torch.Tensor | None
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    interventions: list[dict[str, Any]] = field(default_factory=list)  # JSON specs
    fingerprint: dict[str, Any] = field(default_factory=dict)  # model file sha256, path, architecture, formats
    backend: dict[str, Any] = field(default_factory=dict)  # device, dtype, kernels
    versions: dict[str, str] = field(default_factory=dict)
    seed: int | None = None
    chat: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    adapters: list[dict[str, Any]] = field(default_factory=list)  # LoRA adapters run with: name, scale, path, sha256
    reduce: str | int | None = None  # how a batch run kept one row per recorded point ("last", "mean", a position)
    # The batched forward that computed it, which a replay recomputes whole so that its bits come out the same (a
    # forward's rows choose the kernels' tiling and what is computed once): every row's ids, this trace's "row", the
    # "logits" kept ("all", "last" or None), "share_prefix", and each row's "interventions" (None: all ran this
    # trace's). None from a one-prompt run, or rows of differing adapters (then the replay runs the prompt alone,
    # within the batched kernels' rounding).
    batch: dict[str, Any] | None = field(default=None, repr=False)  # every row's ids: too long to print

    def logits_at(self, position: int = -1) -> torch.Tensor:
        """The logits ``[vocab]`` at a position (negative from the end), where the trace kept them."""
        n = len(self.ids)
        if self.logits is None:
            raise TraceError("this trace kept no logits (it was recorded with logits=None)")
        if isinstance(position, bool) or not isinstance(position, int) or not -n <= position < n:
            raise TraceError(f"position {shorten(position)} is outside the trace's {n} tokens")
        if self.logits.shape[0] == n:
            return self.logits[position]
        if position % n != n - 1:
            raise TraceError(f"this trace kept the last position's logits alone (logits='last'), not position "
                             f"{position}'s")
        return self.logits[-1]

    def top_tokens(self, position: int = -1, k: int = 10) -> list[tuple[int, float]]:
        """(token id, probability) of the k most likely next tokens at a position."""
        from workbench.results import top_k

        return [(t.id, t.prob) for t in top_k(self.logits_at(position), k)]

    def next_token(self, k: int = 10, vocab: Any = None, position: int = -1) -> "Distribution":
        """The next-token distribution at a position: top ``k`` (named by ``vocab``, a model or its tokenizer) and
        entropy (``workbench.results.next_token``)."""
        from workbench.results import next_token

        return next_token(self.logits_at(position), k, vocab)

    def compare(self, other: "Trace", vocab: Any = None, per_position: bool = True) -> "TraceComparison":
        """How ``other`` differs from this trace: KL, top-1, logits, activations
        (``workbench.results.compare_traces``)."""
        from workbench.results import compare_traces

        return compare_traces(self, other, vocab, per_position)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Logits (where kept) and activations under the keys the artifact stores them by."""
        out = {} if self.logits is None else {"logits": self.logits}
        out.update({_ACTIVATION_PREFIX + name: t for name, t in self.activations.items()})
        return out

    def save(self, path: str | Path) -> Path:
        """Write the artifact directory (created if needed; its two files are replaced atomically). Nothing is
        written through a symbolic link: a directory or member that is one is refused, and each file is first
        written to a new temporary name in the directory (created exclusively) and then renamed into place."""
        from safetensors.torch import save

        directory = _artifact_path(path)
        if directory.is_symlink():
            raise TraceError(f"{directory} is a symbolic link; a trace is written into a real directory only")
        if directory.exists() and not directory.is_dir():
            raise TraceError(f"{directory} exists and is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {key: t.detach().to("cpu").contiguous().clone() for key, t in self.tensors().items()}
        tensor_bytes = save(tensors)
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
            "reduce": self.reduce,
            "batch": self.batch,
            "tensors": {key: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                              "sha256": tensor_sha256(t)} for key, t in tensors.items()},
            "tensors_file": {"name": TENSORS_FILE, "bytes": len(tensor_bytes),
                             "sha256": hashlib.sha256(tensor_bytes).hexdigest()},
        }
        manifest["manifest_sha256"] = manifest_sha256(manifest)
        with open_folder(directory, TraceError) as fd:
            for name in (TENSORS_FILE, MANIFEST_FILE):  # both checked before either is written
                _refuse_link(fd, directory, name)
            replace_file(fd, TENSORS_FILE, tensor_bytes)
            replace_file(fd, MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        return directory

    def to_activation_cache(self, model: Any = None):
        """A ``transformer_lens.ActivationCache`` of the recorded activations (see hooks.activation_cache)."""
        from .activation_cache import to_activation_cache

        return to_activation_cache(self, model)


def load_trace(path: str | Path, max_bytes: int | None = None) -> Trace:
    """Read an artifact saved by ``Trace.save`` (its directory or its manifest), verifying every hash and that what
    the manifest says agrees with the tensors. A member that is a symbolic link or not a regular file is refused;
    sizes (at most ``max_bytes`` in all, when given) are checked before anything is hashed or parsed."""
    from safetensors.torch import load

    directory = _artifact_path(path)
    if directory.name == MANIFEST_FILE:
        directory = directory.parent
    directory = directory.resolve()  # the folder may be reached through a link; its members may not be links
    if not (directory / MANIFEST_FILE).exists() and not (directory / MANIFEST_FILE).is_symlink():
        raise TraceError(f"{directory} is not a trace artifact: {MANIFEST_FILE} is missing")
    budget = MAX_MANIFEST_BYTES if max_bytes is None else min(max_bytes, MAX_MANIFEST_BYTES)
    with open_folder(directory, TraceError) as fd:
        manifest = _parse_manifest(_read_member(fd, directory, MANIFEST_FILE, budget), directory / MANIFEST_FILE)
        expected = manifest["tensors_file"]
        limit = None if max_bytes is None else max_bytes
        data = _read_member(fd, directory, TENSORS_FILE, limit, expected["bytes"])
    tensors_path = directory / TENSORS_FILE
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise TraceError(f"{tensors_path} does not match the sha256 in its manifest: the file was modified or is "
                         "corrupt")
    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types on a malformed header
        raise TraceError(f"{tensors_path} cannot be read: {clip(str(err), 200)}") from None
    expected_tensors = manifest["tensors"]
    if set(tensors) != set(expected_tensors):
        missing, extra = sorted(set(expected_tensors) - set(tensors)), sorted(set(tensors) - set(expected_tensors))
        raise TraceError(f"{tensors_path} does not hold the tensors its manifest lists (missing "
                         f"{shorten(missing)}, extra {shorten(extra)})")
    for key, t in tensors.items():
        entry = expected_tensors[key]
        if (list(t.shape) != entry.get("shape") or str(t.dtype).removeprefix("torch.") != entry.get("dtype")
                or tensor_sha256(t) != entry.get("sha256")):
            raise TraceError(f"tensor {shorten(key)} in {tensors_path} does not match its manifest entry (shape, dtype "
                             "or hash)")
    stray = [key for key in tensors if key != "logits" and not key.startswith(_ACTIVATION_PREFIX)]
    if stray:
        raise TraceError(f"{tensors_path} holds {shorten(stray[0])}, neither logits nor an activation")
    trace = Trace(prompt=manifest["prompt"], ids=manifest["ids"], tokens=manifest["tokens"],
                  logits=tensors.get("logits"),
                  activations={key[len(_ACTIVATION_PREFIX):]: t for key, t in tensors.items()
                               if key.startswith(_ACTIVATION_PREFIX)},
                  interventions=manifest["interventions"], fingerprint=manifest["fingerprint"],
                  backend=manifest["backend"], versions=manifest["versions"], seed=manifest["seed"],
                  chat=manifest["chat"], metrics=manifest["metrics"], adapters=manifest.get("adapters", []),
                  reduce=manifest.get("reduce"), batch=manifest.get("batch"))
    _check_consistent(trace, tensors_path)
    return trace


def _artifact_path(path: str | Path) -> Path:
    """An artifact's folder; an empty string is refused (it would name the current folder)."""
    if isinstance(path, str) and not path.strip():
        raise TraceError("the artifact's path is empty")
    return Path(path)


def manifest_sha256(manifest: dict[str, Any]) -> str:
    """sha256 of everything a manifest says (its canonical JSON), the hash field itself left out."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# The manifest's fields and the types they must have: checked before anything reads them.
_MANIFEST_TYPES: dict[str, tuple[type, ...]] = {
    "prompt": (str, list), "chat": (bool,), "ids": (list,), "tokens": (list,), "fingerprint": (dict,),
    "backend": (dict,), "versions": (dict,), "seed": (int, type(None)), "interventions": (list,),
    "metrics": (dict,), "tensors": (dict,), "tensors_file": (dict,), "manifest_sha256": (str,),
}


def _parse_manifest(data: bytes, manifest_path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except ValueError as err:  # invalid JSON or text, or an integer of more digits than Python converts
        raise TraceError(f"{manifest_path} is not valid JSON ({clip(str(err), 120)})") from None
    except RecursionError:
        raise TraceError(f"{manifest_path} nests too deeply to be a trace manifest") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise TraceError(f"{manifest_path} is not a workbench trace manifest")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version != SCHEMA_VERSION:
        raise TraceError(f"{manifest_path} has schema version {shorten(version)}; this workbench reads version "
                         f"{SCHEMA_VERSION} (older artifacts carry no manifest hash: save them again)")
    for key, types in _MANIFEST_TYPES.items():
        if key not in manifest:
            raise TraceError(f"{manifest_path} lacks the field {key!r}")
        if not isinstance(manifest[key], types) or (key == "seed" and isinstance(manifest[key], bool)):
            raise TraceError(f"{manifest_path}: {key!r} has the wrong type ({type(manifest[key]).__name__})")
    try:
        digest = manifest_sha256(manifest)
    except (RecursionError, ValueError):  # a float the canonical JSON cannot write
        raise TraceError(f"{manifest_path} cannot be hashed (nested too deeply)") from None
    if digest != manifest["manifest_sha256"]:
        raise TraceError(f"{manifest_path} does not match its manifest_sha256: the manifest was edited or is corrupt")
    tensors_file = manifest["tensors_file"]
    if (not isinstance(tensors_file.get("bytes"), int) or isinstance(tensors_file.get("bytes"), bool)
            or tensors_file["bytes"] < 0 or not isinstance(tensors_file.get("sha256"), str)
            or not all(isinstance(entry, dict) for entry in manifest["tensors"].values())):
        raise TraceError(f"{manifest_path} has malformed tensor entries")
    return manifest


_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
# what a trace keeps floats in (a recorded activation may be kept in half precision)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_consistent(trace: Trace, tensors_path: Path) -> None:
    """What the manifest says agrees with itself and with the tensors: types, and one row per token."""
    def ints(values: Any) -> bool:
        return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)

    where = tensors_path.parent
    if not trace.ids or not ints(trace.ids) or any(i < 0 for i in trace.ids):
        raise TraceError(f"{where}: 'ids' must be a non-empty list of token ids")
    if not all(isinstance(t, str) for t in trace.tokens) or len(trace.tokens) != len(trace.ids):
        raise TraceError(f"{where}: 'tokens' must be {len(trace.ids)} strings, one per id")
    if is_messages(trace.prompt):
        try:
            check_messages(trace.prompt)
        except WorkbenchError as err:
            raise TraceError(f"{where}: 'prompt' is no conversation ({err})") from None
        if not trace.chat:
            raise TraceError(f"{where}: a prompt given as messages is rendered through the chat template: 'chat' must "
                             "be true")
    elif isinstance(trace.prompt, list) and trace.prompt != trace.ids:
        raise TraceError(f"{where}: a prompt given as ids must equal 'ids'")
    if not all(isinstance(spec, dict) for spec in trace.interventions):
        raise TraceError(f"{where}: 'interventions' must be a list of intervention specs")
    if not isinstance(trace.adapters, list) or not all(isinstance(entry, dict) for entry in trace.adapters):
        raise TraceError(f"{where}: 'adapters' must be a list of adapter records")
    merged = trace.fingerprint.get("merged_adapters", [])
    if not isinstance(merged, list) or not all(isinstance(entry, dict) for entry in merged):
        raise TraceError(f"{where}: the fingerprint's 'merged_adapters' must be a list of adapter records")
    logits = trace.logits
    if logits is None and not trace.activations:
        raise TraceError(f"{where}: the trace holds neither logits nor activations")
    if logits is not None and (logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES
                               or logits.shape[0] not in (len(trace.ids), 1)):
        raise TraceError(f"{where}: logits have shape {tuple(logits.shape)}; a trace of {len(trace.ids)} tokens "
                         f"holds [{len(trace.ids)}, vocab] floats (or [1, vocab], the last position's)")
    try:
        check_reduce(trace.reduce, list(trace.activations), [len(trace.ids)])
    except WorkbenchError as err:
        raise TraceError(f"{where}: 'reduce': {err}") from None
    _check_batch(trace, where)
    for name, activation in trace.activations.items():
        if not is_point_name(name):
            raise TraceError(f"{where}: activation {shorten(name)} is not named by one hook point")
        ids = name.endswith(ID_POINTS)  # an MoE's chosen experts, kept as integers
        if activation.dtype not in (_INTEGER_DTYPES if ids else FLOAT_DTYPES):
            kept = "integers" if ids else "float16, bfloat16, float32 or float64 numbers"
            raise TraceError(f"{where}: activation {shorten(name)} holds {str(activation.dtype).removeprefix('torch.')}"
                             f"; this point is recorded as {kept}")
        axis = axes(name).token
        if trace.reduce is None and (activation.dim() <= axis or activation.shape[axis] != len(trace.ids)):
            raise TraceError(f"{where}: activation {shorten(name)} has shape {tuple(activation.shape)}, not one row "
                             f"per token of {len(trace.ids)}")


_BATCH_KEYS = {"rows", "row", "logits", "share_prefix", "interventions"}


def _check_batch(trace: Trace, where: Path) -> None:
    """A recorded batched forward holds this trace's ids and interventions at its row, and the logits it kept."""
    batch = trace.batch
    if batch is None:
        return
    if not isinstance(batch, dict) or set(batch) != _BATCH_KEYS:
        raise TraceError(f"{where}: 'batch' must be null or hold exactly {', '.join(sorted(_BATCH_KEYS))}")
    rows, row, logits = batch["rows"], batch["row"], batch["logits"]
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, list) and r and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in r)
            for r in rows):
        raise TraceError(f"{where}: the batch's 'rows' must be a non-empty list of non-empty lists of token ids")
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(rows) or rows[row] != trace.ids:
        raise TraceError(f"{where}: the batch's 'row' must index the row that holds the trace's ids")
    kept = None if trace.logits is None else "last" if trace.logits.shape[0] == 1 else "all"
    if logits != kept and not (kept == "last" and logits == "all" and len(trace.ids) == 1):
        raise TraceError(f"{where}: the batch's 'logits' ({shorten(logits)}) must say which logits the trace kept")
    if not isinstance(batch["share_prefix"], bool):
        raise TraceError(f"{where}: the batch's 'share_prefix' must be true or false")
    specs = batch["interventions"]
    if specs is not None and (
            not isinstance(specs, list) or len(specs) != len(rows) or specs[row] != trace.interventions
            or not all(isinstance(x, list) and all(isinstance(spec, dict) for spec in x) for x in specs)):
        raise TraceError(f"{where}: the batch's 'interventions' must be null or a list of each row's specs, the "
                         "trace's own at its row")


def _refuse_link(fd: int, directory: Path, name: str) -> None:
    """A member that exists as a symbolic link (or anything but a regular file) is refused rather than replaced."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise TraceError(f"{directory / name} is a symbolic link or not a regular file; refused")


def _read_member(fd: int, directory: Path, name: str, max_bytes: int | None, size: int | None = None) -> bytes:
    """The bytes of a regular file in the directory (not a link, not a FIFO), its size checked before reading."""
    path = directory / name
    try:
        member = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except FileNotFoundError:
        raise TraceError(f"{path} is missing") from None
    except OSError as err:
        raise TraceError(f"{path} cannot be read: a symbolic link or not a regular file ({err.strerror})") from None
    info = os.fstat(member)
    if not stat.S_ISREG(info.st_mode):  # checked before fdopen, which refuses a folder with its own error
        os.close(member)
        raise TraceError(f"{path} is not a regular file")
    with os.fdopen(member, "rb") as f:
        if size is not None and info.st_size != size:
            raise TraceError(f"{path} has {info.st_size:,} bytes, its manifest says {size:,}: the file was modified "
                             "or is corrupt")
        if max_bytes is not None and info.st_size > max_bytes:
            raise TraceError(f"{path} has {info.st_size:,} bytes; the limit is {max_bytes:,}")
        data = f.read(info.st_size + 1)
    if len(data) != info.st_size:
        raise TraceError(f"{path} changed while it was read")
    return data


_DEVICE_CHUNK = 64 << 20


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in memory order (the manifest records dtype and shape beside it).

    A tensor on a GPU goes through a pinned buffer a chunk at a time: a whole pageable copy of a model's weights
    would run at a fraction of the bus's speed and hold a second copy in host memory."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":
        return hashlib.sha256(data.numpy()).hexdigest()
    digest = hashlib.sha256()
    buffer = torch.empty(min(_DEVICE_CHUNK, data.numel()), dtype=torch.uint8, pin_memory=data.device.type == "cuda")
    for start in range(0, data.numel(), _DEVICE_CHUNK):
        part = buffer[:min(_DEVICE_CHUNK, data.numel() - start)]
        part.copy_(data[start:start + part.numel()])
        digest.update(part.numpy())
    return digest.hexdigest()


_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                    if f.default is not dataclasses.MISSING}


def model_mismatch(fingerprint: dict[str, Any], model: Any) -> str | None:
    """Why a trace's fingerprint does not describe ``model`` (weights hash, config, tensor formats), or None."""
    sha = fingerprint.get("sha256")
    if sha != model.file_sha256:
        return f"weights sha256 {str(sha)[:12]}... vs this model's {model.file_sha256[:12]}..."
    # compared as JSON gives them back: a saved fingerprint's tuples (sliding_layers) come back as lists
    config, recorded = json.loads(json.dumps(model.config.to_dict())), fingerprint.get("config")
    recorded = json.loads(json.dumps(recorded, default=str)) if isinstance(recorded, dict) else {}
    # a trace from before a setting existed recorded its default
    recorded = {**json.loads(json.dumps(_CONFIG_DEFAULTS)), **recorded}
    differing = sorted(str(k) for k in config.keys() | recorded.keys() if config.get(k) != recorded.get(k))
    if differing:
        return f"config differs in {clip(', '.join(differing), 200)}"
    formats = fingerprint.get("formats")
    if formats is not None and formats != model.tensor_formats():
        return "tensor formats differ (quantized differently)"
    merged = [(m.get("name"), m.get("sha256"), m.get("scale")) for m in fingerprint.get("merged_adapters", [])]
    if merged != [(m["name"], m["sha256"], m["scale"]) for m in getattr(model, "merged", [])]:
        return "the adapters merged into the weights differ"
    return None
