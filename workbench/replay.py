"""Replay a saved trace: re-run its prompt and interventions and compare every tensor with the artifact."""
from __future__ import annotations

import math
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from workbench.adapters import adapter_files
from workbench.errors import WorkbenchError, finite_number, shorten
from workbench.hooks import Trace, load_trace
from workbench.hooks.batching import reduce_tokens
from workbench.hooks.trace import model_mismatch
from workbench.kernels import NUMERICS, numerics
from workbench.loading import check_hf_files, checkpoint_files, default_model_path, files_sha256, hash_files
from workbench.model import Model, load

IDENTICAL, WITHIN_TOLERANCE, DIFFERENT = "identical", "within tolerance", "different"


@dataclass
class ReplayReport:
    """``verdict``: every tensor bit-identical / each within ``atol + rtol * max|recorded|`` / otherwise."""

    verdict: str
    max_abs_deviation: float | None  # largest |replayed - recorded| over all tensors (None: not compared)
    worst_tensor: str | None  # where it occurs ("logits" or a hook name)
    tensors_compared: int
    rtol: float
    atol: float
    reason: str | None = None  # why a replay is "different" without a numeric comparison
    model_forced: bool = False  # the model's fingerprint differs and force=True was given

    @property
    def ok(self) -> bool:
        return self.verdict != DIFFERENT

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: an infinite deviation (NaN against a number) as None."""
        out = asdict(self)
        if out["max_abs_deviation"] is not None and not math.isfinite(out["max_abs_deviation"]):
            out["max_abs_deviation"] = None
        return out

    def __str__(self) -> str:
        if self.reason:
            return f"{self.verdict}: {self.reason}"
        where = f" (in {self.worst_tensor})" if self.worst_tensor else ""
        return (f"{self.verdict}: {self.tensors_compared} tensors, largest deviation "
                f"{self.max_abs_deviation:.3g}{where}")


def replay(trace_or_path: Trace | str | Path, model: Model | None = None, *, force: bool = False,
           rtol: float = 1e-3, atol: float = 1e-5, load_adapters: bool = True, device: str | None = None,
           dtype: str | torch.dtype | None = None, devices: Sequence[str] | None = None) -> ReplayReport:
    """Re-run a trace (or an artifact path) and report how far the new tensors are from the recorded ones.

    Without ``model``, the model is loaded from the path in the trace's fingerprint once its files hash to the
    recorded sha256 (the embedded default when that is its file), on the recorded device with the recorded dtype
    (``device``, ``dtype`` or ``devices``, as ``workbench.load`` takes them, choose others); any other file is
    refused, so an artifact cannot make the replay open what it likes. The re-run computes in the recorded numerics
    (``workbench.kernels.numerics``). A model whose fingerprint (weights sha256, config, tensor formats) differs is
    refused unless ``force``. The trace's LoRA adapters are re-applied at their recorded scales: an adapter resident on
    the model with the recorded sha256, or (``load_adapters``) the recorded path loaded into it once its files, regular
    files and no links, hash to that sha256. Anything else is refused, and a refused replay leaves no adapter loaded.
    """
    if model is not None and (device is not None or dtype is not None or devices is not None):
        raise WorkbenchError("device, dtype and devices say how to load the trace's own model; a given model keeps "
                             "its own")
    for value, name in ((rtol, "rtol"), (atol, "atol")):
        if finite_number(value, name) < 0:
            raise WorkbenchError(f"{name} must be at least 0, got {value!r}")
    trace = trace_or_path if isinstance(trace_or_path, Trace) else load_trace(trace_or_path)
    recorded_numerics = trace.backend.get("numerics", "exact")
    if recorded_numerics not in NUMERICS:
        raise WorkbenchError(f"the trace was recorded in numerics {shorten(recorded_numerics)}, none this workbench "
                             f"computes ({', '.join(NUMERICS)})")
    model = model if model is not None else _load_recorded_model(trace, device, dtype, devices)
    mismatch = model_mismatch(trace.fingerprint, model)
    if mismatch and not force:
        raise WorkbenchError(f"the trace was recorded on another model ({mismatch}); pass force=True to replay anyway")
    before = set(model.adapters)
    try:
        adapter = _recorded_adapters(trace, model, load_adapters)
        with numerics(recorded_numerics):
            fresh = _rerun(trace, model, adapter)
    except BaseException:
        for name in set(model.adapters) - before:  # what this replay loaded goes with its refusal
            model.unload_adapter(name)
        raise
    report = dict(rtol=rtol, atol=atol, model_forced=bool(mismatch))
    if fresh.ids != list(trace.ids):
        how = "renders (through the chat template) and tokenizes" if trace.chat else "tokenizes"
        return ReplayReport(DIFFERENT, None, None, 0, reason=f"the prompt {how} to different ids", **report)
    recorded, replayed = kept_like(trace, fresh)
    verdict, worst, worst_name = IDENTICAL, 0.0, None
    for name, old in recorded.items():
        new = replayed.get(name)
        if new is None:
            return ReplayReport(DIFFERENT, None, name, 0, reason=f"the replay recorded no {shorten(name)}", **report)
        if new.shape != old.shape:
            return ReplayReport(DIFFERENT, None, name, 0, reason=f"{name} has shape {tuple(new.shape)}, "
                                                                  f"recorded {tuple(old.shape)}", **report)
        deviation = _max_deviation(new, old)
        if deviation > worst or worst_name is None:
            worst, worst_name = deviation, name
        if deviation == 0.0 and new.dtype == old.dtype:  # bit for bit, NaN where NaN was recorded included
            continue
        scale = old[old.isfinite()].abs().max().item() if old.isfinite().any() else 0.0
        if deviation <= atol + rtol * scale:
            verdict = WITHIN_TOLERANCE if verdict == IDENTICAL else verdict
        else:
            verdict = DIFFERENT
    return ReplayReport(verdict, worst, worst_name, len(recorded), **report)


def _rerun(trace: Trace, model: Model, adapter: dict[str, float]) -> Trace:
    """The trace's run again: the batched forward it records recomputed whole (the same rows, so the same tiling and
    the same bits), else its prompt alone. A prompt that tokenizes otherwise is run alone, for the report to say so."""
    record, batch = list(trace.activations), trace.batch
    if batch is None or model.to_ids(trace.prompt, chat=trace.chat) != list(trace.ids):
        return model.run(trace.prompt, record=record, interventions=trace.interventions, chat=trace.chat,
                         adapter=adapter)
    floats = {t.dtype for t in trace.activations.values() if t.is_floating_point()}
    per_row = batch["interventions"]
    try:
        return model.run_batch(batch["rows"], record=record,
                               interventions=trace.interventions if per_row is None else (),
                               per_prompt_interventions=per_row, batch_size=len(batch["rows"]),
                               logits=batch["logits"], reduce=trace.reduce, share_prefix=batch["share_prefix"],
                               adapter=adapter, record_dtype=floats.pop() if len(floats) == 1 else torch.float32
                               )[batch["row"]]
    except WorkbenchError as err:  # its "prompt i" is a row of the forward
        raise type(err)(f"the trace's batched forward (its rows are the prompts): {err}") from None


def kept_like(trace: Trace, fresh: Trace) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The recorded tensors by name, and the re-run's ``fresh`` tensors kept as the trace kept them: its logits
    (every position's, the last's alone, or none), each activation reduced as a batch run reduced it (``reduce``,
    unless ``fresh`` was) and, a float, in its recorded float dtype."""
    recorded: dict[str, torch.Tensor] = {} if trace.logits is None else {"logits": trace.logits}
    replayed = {} if trace.logits is None else {"logits": fresh.logits[-trace.logits.shape[0]:]}
    for name, old in trace.activations.items():
        recorded[name] = old
        if name in fresh.activations:
            new = fresh.activations[name]
            new = new if trace.reduce is None or fresh.reduce is not None else reduce_tokens(new, trace.reduce, 0)
            # rounded to a recorded float dtype as the recorder rounds (half precision); never cast across kinds,
            # which would make forged integers of a float point compare equal
            replayed[name] = new.to(old.dtype) if new.is_floating_point() and old.is_floating_point() else new
    return recorded, replayed


def _max_deviation(new: torch.Tensor, old: torch.Tensor) -> float:
    """Largest absolute difference (in float64 between two dtypes); equal infinities (masked attention scores) and NaN
    where both hold NaN count as equal, NaN against a number as infinitely far."""
    if new.dtype != old.dtype:
        new, old = new.double(), old.double()
    same = (new == old) | (new.isnan() & old.isnan())
    if bool(same.all()):
        return 0.0
    value = (new - old).abs()[~same].max().item()
    return value if not math.isnan(value) else math.inf


def _recorded_adapters(trace: Trace, model: Model, load: bool) -> dict[str, float]:
    """``{name: scale}`` of the trace's adapters on ``model``, each matched (or loaded, with ``load``) by sha256."""
    return {_resident_adapter(model, entry, load): finite_number(entry.get("scale", 1.0), "an adapter's scale")
            for entry in trace.adapters}


def _resident_adapter(model: Model, entry: dict, load: bool) -> str:
    """The name of a trace's adapter on ``model``: one resident with the recorded sha256 (its recorded name first), or,
    with ``load``, the recorded path loaded under the recorded name once its files hash to that sha256, so that a
    manifest can make the replay load no other file (a link, FIFO or device is refused before it is opened)."""
    name, sha, recorded = entry.get("name"), entry.get("sha256"), entry.get("path")
    if not isinstance(name, str) or not name or not isinstance(sha, str):
        raise WorkbenchError(f"the trace's adapter record {shorten(entry)} has no name or sha256")
    matching = [n for n, adapter in model.adapters.items() if adapter.sha256 == sha]
    if matching:
        return name if name in matching else matching[0]
    if name in model.adapters:
        raise WorkbenchError(f"adapter {shorten(name)} has sha256 {model.adapters[name].sha256[:12]}...; the trace was "
                             f"recorded with {sha[:12]}... (another adapter file)")
    if not load:
        raise WorkbenchError(f"the trace ran with adapter {shorten(name)} (sha256 {sha[:12]}...), which is not "
                             "resident on this model; load that adapter first (a replay here never loads a path a "
                             "trace names)")
    if not isinstance(recorded, str) or not recorded:
        raise WorkbenchError(f"the trace's adapter {shorten(name)} records no path; model.load_adapter(path, name=...) "
                             "first")
    path = Path(recorded)
    if not path.exists() and not path.is_symlink():
        raise WorkbenchError(f"the trace ran with adapter {shorten(name)} ({shorten(recorded)}), which is neither "
                             "loaded nor at its recorded path; model.load_adapter(path, name=...) first")
    if hash_files(adapter_files(path, links=False)) != sha:
        raise WorkbenchError(f"the file {shorten(recorded)} recorded for adapter {shorten(name)} is not the adapter "
                             "the trace ran with (its sha256 differs); nothing was loaded")
    if model.load_adapter(path, name=name).sha256 != sha:  # changed since it was hashed
        model.unload_adapter(name)
        raise WorkbenchError(f"adapter {shorten(name)} at {shorten(recorded)} changed while it was loaded; refused")
    return name


def _load_recorded_model(trace: Trace, device: str | None, dtype: str | torch.dtype | None,
                         devices: Sequence[str] | None) -> Model:
    """The model the trace names, loaded only once its files hash to the trace's fingerprint: a manifest cannot make
    the replay open any other file (the embedded default model stands in when the recorded file is not here). It
    loads on ``device`` (or ``devices``) with ``dtype`` where given, else as recorded."""
    fingerprint, backend = trace.fingerprint, trace.backend
    recorded = fingerprint.get("path")
    path = Path(recorded) if isinstance(recorded, str) and recorded else None
    if path is None or not path.exists():
        default = default_model_path()
        if fingerprint.get("file") != default.name:
            raise WorkbenchError(f"the trace's model {shorten(recorded or fingerprint.get('file'))} is not here; "
                                 "pass model=")
        path = default
    elif not (path.is_dir() or stat.S_ISREG(path.stat().st_mode)):
        raise WorkbenchError(f"the trace's model {shorten(recorded)} is not a model file; pass model=")
    else:
        if path.is_dir():
            check_hf_files(path)  # a FIFO among its files would block the hash
        if files_sha256(checkpoint_files(path)) != fingerprint.get("sha256"):
            raise WorkbenchError(f"the file at the trace's model path {shorten(recorded)} is not the model it was "
                                 "recorded on (its sha256 differs); pass model=")
    if device is None and devices is None:
        device = backend.get("device", "cpu")
        if not isinstance(device, str) or (device.startswith("cuda") and not torch.cuda.is_available()):
            device = "cpu"
    if dtype is None and isinstance(backend.get("dtype"), str):
        dtype = backend["dtype"]
    model = load(path, device=device, dtype=dtype, devices=devices)
    # merged on the recorded model: merged here the same way, each file checked as a trace's adapter is
    for entry in fingerprint.get("merged_adapters", []):
        model.merge_adapter(_resident_adapter(model, entry, True), finite_number(entry.get("scale", 1.0),
                                                                                 "a merged adapter's scale"))
    return model
