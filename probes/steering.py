"""Steering vectors: contrastive mean differences added to the residual stream with ``hooks.Steer``.

A vector holds one direction per layer, ``mean(activations of positive prompts) - mean(of negative
prompts)``, and applies as ``scale * direction`` at every selected position of those layers.

llama.cpp control vectors (``--control-vector``) are GGUF files with general.architecture
"controlvector", one F32 tensor ``direction.{k}`` of n_embd values per layer, and metadata
``controlvector.model_hint`` / ``controlvector.layer_count``. llama.cpp adds ``direction.k`` to the
output of block k (0-based), i.e. our ``blocks.{k}.hook_resid_post``, at every position; it rejects
``direction.0`` and keeps no slot for block 0, so the output of block 0 cannot be steered there.
(Its cvector-generator writes ``direction.{i+1}`` from the output of block i, so a generated vector is
applied one block later than where it was measured; it is loaded here where llama.cpp applies it.)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from workbench.errors import WorkbenchError, clip, finite_number, integer_list, number_list, shorten
from workbench.files import regular_file
from workbench.generation import check_max_new_tokens
from workbench.gguf_file import GGUFFile
from workbench.hooks import Steer
from workbench.kernels.formats.table import SPECS
from workbench.progress import progress_callback

from .activations import Progress, block_hook, collect_activations
from .data import Dataset, load_dataset, pairs_dataset
from .lens import token_ids

CONTROL_VECTOR_ARCH = "controlvector"
CONTROL_VECTOR_POINT = "resid_post"
F32_TYPE = SPECS["F32"].ggml_type


@dataclass
class SteeringVector:
    """Per-layer directions at one residual point (``resid_post`` unless said otherwise)."""

    directions: dict[int, torch.Tensor]  # layer -> float32 [d_model]
    point: str = CONTROL_VECTOR_POINT
    model_hint: str = ""  # the architecture it was made on
    source: str = ""

    @property
    def layers(self) -> list[int]:
        return sorted(self.directions)

    def hook(self, layer: int) -> str:
        return f"blocks.{layer}.hook_{self.point}"

    def interventions(self, scale: float = 1.0, positions: Sequence[int] | str | None = None) -> list[Steer]:
        """``Steer`` interventions adding ``scale * direction`` at each layer (every position by default)."""
        return [Steer(self.hook(layer), self.directions[layer], scale, positions) for layer in self.layers]

    def norms(self) -> dict[int, float]:
        return {layer: float(v.norm()) for layer, v in sorted(self.directions.items())}

    def export_control_vector(self, path: str | Path, scale: float = 1.0, model: Any | None = None) -> Path:
        """Write a llama.cpp control vector (``llama-cli --control-vector path``) of ``scale * direction``; with
        ``model``, its layers and width are checked against that model's too."""
        import gguf

        self._check_directions(model)  # a file from_control_vector would refuse is never written
        if self.point != CONTROL_VECTOR_POINT:
            raise WorkbenchError(f"llama.cpp control vectors act on the block output (resid_post); this vector is at "
                                 f"{self.point}")
        if 0 in self.directions:
            raise WorkbenchError("llama.cpp cannot steer the output of block 0 (it rejects direction.0); drop layer 0")
        scale = finite_number(scale, "a control vector's scale")
        scaled = {layer: (scale * self.directions[layer]).float() for layer in self.layers}
        for layer, direction in scaled.items():  # finite before scaling (checked above): the scale overflowed
            if not bool(direction.isfinite().all()):
                raise WorkbenchError(f"scale {scale:g} takes direction.{layer} past float32's range (not finite); "
                                     "use a smaller scale")
        path = Path(path)
        if path.is_dir() or path.is_symlink() or (path.exists() and not path.is_file()):
            raise WorkbenchError(f"{path} exists and is not a regular file; give a file name for the control vector")
        writer = gguf.GGUFWriter(str(path), CONTROL_VECTOR_ARCH)
        writer.add_string(f"{CONTROL_VECTOR_ARCH}.model_hint", self.model_hint)
        writer.add_int32(f"{CONTROL_VECTOR_ARCH}.layer_count", len(self.directions))
        for layer in self.layers:
            writer.add_tensor(f"direction.{layer}", scaled[layer].cpu().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def _check_directions(self, model: Any | None) -> None:
        """One-dimensional, finite directions of one length (``model``'s width, within its depth, when given)."""
        if not self.directions:
            raise WorkbenchError("this steering vector has no directions")
        widths = set()
        for layer, direction in sorted(self.directions.items()):
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise WorkbenchError(f"direction layers must be integers >= 0, got {shorten(layer)}")
            if not isinstance(direction, torch.Tensor) or direction.dim() != 1:
                raise WorkbenchError(f"the direction of layer {layer} must be a 1-D tensor")
            if not bool(direction.isfinite().all()):
                raise WorkbenchError(f"the direction of layer {layer} holds NaN or Inf")
            widths.add(direction.shape[0])
        if len(widths) > 1:
            raise WorkbenchError(f"the directions have different lengths {sorted(widths)}; a control vector holds one "
                                 "width")
        if model is not None:
            c = model.config
            if widths != {c.d_model}:
                raise WorkbenchError(f"the directions have {widths.pop()} values; this model's width is {c.d_model}")
            if self.layers[-1] >= c.n_layers:
                raise WorkbenchError(f"layer {self.layers[-1]} is past this model's depth (layers 0.."
                                     f"{c.n_layers - 1})")

    @classmethod
    def from_control_vector(cls, path: str | Path, model: Any) -> "SteeringVector":
        """Read a llama.cpp control vector GGUF; ``direction.k`` steers ``blocks.{k}.hook_resid_post``."""
        path = Path(path)
        if not path.is_file():
            raise WorkbenchError(f"control vector file not found: {path}")
        try:
            file = GGUFFile(regular_file(path))
        except (ValueError, OSError, struct.error) as err:  # a header that lies, or invalid UTF-8 in a string
            raise WorkbenchError(f"{path} is not a GGUF file: {clip(str(err), 160)}") from None
        arch = file.metadata.get("general.architecture")
        if arch != CONTROL_VECTOR_ARCH:
            raise WorkbenchError(f"{path} is not a control vector (general.architecture is {shorten(arch)})")
        hint = file.metadata.get(f"{CONTROL_VECTOR_ARCH}.model_hint", "")
        if hint and hint != model.config.architecture:
            raise WorkbenchError(f"{path} was made for a {shorten(hint)} model; this one is "
                                 f"{model.config.architecture!r}")
        c = model.config
        directions: dict[int, torch.Tensor] = {}
        for tensor in file.tensors.values():
            prefix, _, index = tensor.name.partition(".")
            # direction.<k> exactly as llama.cpp writes it: "direction.01" would silently stand for direction.1
            if prefix != "direction" or not (index.isascii() and index.isdigit()) or str(int(index)) != index:
                raise WorkbenchError(f"{path}: unexpected tensor {shorten(tensor.name)} (expected direction.<layer>)")
            layer = int(index)
            if not 1 <= layer < c.n_layers:
                raise WorkbenchError(f"{path}: {tensor.name} is outside llama.cpp's range direction.1.."
                                     f"direction.{c.n_layers - 1} for a model of {c.n_layers} blocks")
            if tensor.ggml_type != F32_TYPE or tensor.shape != (c.d_model,):
                raise WorkbenchError(f"{path}: {tensor.name} must be a 1-D F32 vector of {c.d_model} values, got "
                                     f"type {tensor.ggml_type} of shape {list(tensor.shape)}")
            try:
                data = file.data(tensor, 4 * c.d_model).view(np.float32)
            except ValueError as err:
                raise WorkbenchError(f"{path}: {err}") from None
            direction = torch.from_numpy(data.copy())
            if not torch.isfinite(direction).all():
                raise WorkbenchError(f"{path}: {tensor.name} holds NaN or Inf")
            directions[layer] = direction
        if not directions:
            raise WorkbenchError(f"{path} holds no direction tensors")
        return cls(directions, CONTROL_VECTOR_POINT, hint or c.architecture, str(path))


def steering_vector(model: Any, dataset: str | Path | Dataset | tuple[Sequence[str], Sequence[str]] = "happy_sad",
                    layers: Sequence[int] = (8, 9, 10), point: str = CONTROL_VECTOR_POINT, pooling: str = "mean",
                    positive: str | None = None, progress: Progress = None) -> SteeringVector:
    """Mean difference of positive minus negative prompts' pooled activations, per layer.

    ``dataset``: a pairs dataset (by name, file or ``Dataset``), a two-class classification set
    (``positive`` names its positive class; "positive"/"true" by default), or ``(positives, negatives)``.
    """
    if isinstance(dataset, tuple):
        dataset = pairs_dataset(*dataset)
    data = load_dataset(dataset)
    pos, neg = data.contrast(positive)
    layers = sorted(set(integer_list(layers, "layers")))
    if not layers:
        raise WorkbenchError("no layers given for the steering vector")
    point = point.removeprefix("hook_")
    names = [block_hook(model, layer, point) for layer in layers]
    acts = collect_activations(model, pos + neg, names, pooling, progress)
    directions = {layer: acts[name][:len(pos)].mean(0) - acts[name][len(pos):].mean(0)
                  for layer, name in zip(layers, names)}
    return SteeringVector(directions, point, model.config.architecture, data.name)


@dataclass
class SteeringSweep:
    """Effect of a steering vector per scale: target-token log-probs at the next position, and generations."""

    prompt: str
    scales: list[float]
    target_texts: list[str]
    logprobs: torch.Tensor  # [scales, targets]
    baseline: torch.Tensor  # [targets] at scale 0
    generations: list[str] = field(default_factory=list)

    @property
    def shift(self) -> torch.Tensor:
        """Log-prob change of each target relative to no steering, ``[scales, targets]``."""
        return self.logprobs - self.baseline

    def figure(self):
        """Log-prob shift of each target token against scale; generations side by side beneath."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        rows = 2 if self.generations else 1
        fig = make_subplots(rows=rows, cols=1, specs=[[{"type": "xy"}]] + ([[{"type": "table"}]] if rows == 2 else []),
                            row_heights=[0.55, 0.45][:rows] if rows == 2 else None, vertical_spacing=0.08)
        for i, text in enumerate(self.target_texts):
            fig.add_trace(go.Scatter(x=self.scales, y=self.shift[:, i].tolist(), mode="lines+markers", name=repr(text),
                                     hovertemplate="scale %{x}: %{y:+.3f}<extra>" + repr(text) + "</extra>"), 1, 1)
        if rows == 2:
            fig.add_trace(go.Table(header={"values": ["scale", "generation"]},
                                   cells={"values": [self.scales, self.generations], "align": "left"},
                                   columnwidth=[1, 8]), 2, 1)
        fig.update_xaxes(title_text="steering scale", row=1, col=1)
        fig.update_yaxes(title_text="log-prob shift vs. scale 0", row=1, col=1)
        fig.update_layout(title=f"Steering sweep on {self.prompt!r}", template="plotly_white",
                          height=450 + 250 * (rows - 1))
        return fig


def steering_sweep(model: Any, vector: SteeringVector, prompt: str, target_tokens: Sequence[int | str],
                   scales: Sequence[float] = (-8, -4, -2, 0, 2, 4, 8), max_new_tokens: int = 20,
                   positions: Sequence[int] | str | None = None, progress: Progress = None) -> SteeringSweep:
    """Next-token log-probs of the targets at each scale (greedy generations too, when ``max_new_tokens`` > 0); the
    scales run as the rows of one batch."""
    ids = token_ids(model, target_tokens, "target_tokens")
    if not ids:
        raise WorkbenchError("give at least one target token")
    scales = number_list(scales, "scales")
    if not scales:
        raise WorkbenchError("give at least one scale")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    update, close = progress_callback(progress, 2, "steering sweep")  # the log-probs, then the generations
    try:
        # the unsteered run and every scale as the rows of one batch
        rows = [[]] + [vector.interventions(scale, positions) for scale in scales]
        last = model.forward_batch([prompt] * len(rows), per_prompt_interventions=rows, last_only=True)
        baseline, *logprobs = (logits[-1].log_softmax(-1)[ids] for logits in last)
        update(1)
        generations = (model.generate_batch([prompt] * len(scales), max_new_tokens, per_prompt_interventions=rows[1:])
                       if max_new_tokens > 0 else [])
        update(2)
    finally:
        close()
    return SteeringSweep(prompt, scales, model.token_texts(ids), torch.stack(logprobs), baseline, generations)
