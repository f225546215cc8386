"""Sparse autoencoders and transcoders in SAELens' format: load, save, encode, decode, attach, edit features.

An SAE reads the activation at its hook point (SAELens and TransformerLens name hooks alike,
``blocks.12.hook_resid_post``) and writes a reconstruction of it; a transcoder reads one point (the MLP's input) and
writes another (its output). The math and parameter names are SAELens 6.x's (``W_enc [d_in, d_sae]``, ``b_enc``,
``W_dec [d_sae, d_out]``, ``b_dec``, ``threshold``, ``b_gate``, ``b_mag``, ``r_mag``, ``W_skip [d_out, d_in]``), so that
a file moves both ways.

Attached to a run (``model.run(prompt, saes=[sae])``), an SAE fires the hook points SAELens gives it under its hook:
``<hook>.hook_sae_input``, ``.hook_sae_acts_pre``, ``.hook_sae_acts_post``, ``.hook_sae_recons``, ``.hook_sae_error``,
``.hook_sae_output`` (see ``workbench.hooks.saes``).
"""
from __future__ import annotations

import json
import math
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from workbench.errors import HookError, WorkbenchError, clip, finite_number, shorten
from workbench.files import read_json, read_root, reads_within, regular_file
from workbench.hooks import check_saes
from workbench.hooks.interventions import Positions, Region, RegionEdit, RunShape

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"
SPARSITY_FILENAME = "sparsity.safetensors"

# architecture -> (activation, is a transcoder, has a skip connection); "topk_transcoder" is the workbench's own
# (SAELens has no TopK transcoder): SAELens cannot load it.
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "standard": ("relu", False, False),
    "topk": ("topk", False, False),
    "jumprelu": ("jumprelu", False, False),
    "gated": ("gated", False, False),
    "transcoder": ("relu", True, False),
    "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
    "topk_transcoder": ("topk", True, False),
}
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
# cfg.json keys SAELens keeps in its metadata block (the hook, the model, ...)
METADATA_KEYS = ("model_name", "hook_name", "hook_name_out", "hook_head_index", "hook_head_index_out", "prepend_bos",
                 "context_size", "dataset_path", "neuronpedia_id", "model_class_name", "exclude_special_tokens",
                 "seqpos_slice", "model_from_pretrained_kwargs", "sae_lens_version", "sae_lens_training_version",
                 "hf_hook_name", "hf_hook_name_out")
SAE_LENS_VERSION = "6.54.12"  # written into saved configs: SAELens reads pre-6.0 configs differently

Fire = Callable[[str, torch.Tensor], torch.Tensor]


def _no_hooks(name: str, x: torch.Tensor) -> torch.Tensor:
    return x


class SAE:
    """A sparse dictionary: an SAE (``hook_in == hook_out``) or a transcoder, with SAELens' parameters and options.

    ``params`` holds the tensors by SAELens name; ``cfg`` the rest of ``cfg.json`` (kept so that ``save`` writes back
    what was read).
    """

    def __init__(self, architecture: str, params: dict[str, torch.Tensor], hook: str, *, hook_out: str | None = None,
                 k: int | None = None, apply_b_dec_to_input: bool | None = None,
                 normalize_activations: str = "none", rescale_acts_by_decoder_norm: bool = False,
                 cfg: dict[str, Any] | None = None, name: str | None = None):
        if architecture not in ARCHITECTURES:
            raise WorkbenchError(f"unknown SAE architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
        self.architecture = architecture
        self.activation, self.is_transcoder, self.has_skip = ARCHITECTURES[architecture]
        self.params = {key: value for key, value in params.items()}
        self.hook = hook
        self.hook_out = hook_out or hook
        if self.is_transcoder and apply_b_dec_to_input:
            raise WorkbenchError("a transcoder cannot apply b_dec to its input (b_dec lives in the output space)")
        self.apply_b_dec_to_input = (not self.is_transcoder) if apply_b_dec_to_input is None else apply_b_dec_to_input
        if normalize_activations not in NORMALIZATIONS:
            raise WorkbenchError(f"normalize_activations {normalize_activations!r} is not supported; "
                                 f"choose from {', '.join(NORMALIZATIONS)}")
        self.normalize_activations = normalize_activations
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
        self.k = k
        self.cfg = dict(cfg or {})
        self.name = name
        self.source: str | None = None  # the file it was loaded from or saved to: how a spec names it
        self._check()

    # ------------------------------------------------------------------------------------------- shape

    @property
    def W_enc(self) -> torch.Tensor:
        return self.params["W_enc"]

    @property
    def W_dec(self) -> torch.Tensor:
        return self.params["W_dec"]

    @property
    def b_dec(self) -> torch.Tensor:
        return self.params["b_dec"]

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def required_params(self) -> tuple[str, ...]:
        names = ["W_enc", "W_dec", "b_dec"]
        names += ["b_gate", "b_mag", "r_mag"] if self.activation == "gated" else ["b_enc"]
        names += ["threshold"] if self.activation == "jumprelu" else []
        names += ["W_skip"] if self.has_skip else []
        return tuple(names)

    def _check(self) -> None:
        """Shapes, finiteness and options, so that a bad file fails here and not inside a forward."""
        missing = [n for n in self.required_params() if n not in self.params]
        if missing:
            raise WorkbenchError(f"{self.architecture} SAE is missing parameters {missing}")
        for name, value in self.params.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise WorkbenchError(f"SAE parameter {name} must be a floating-point tensor")
            if not torch.isfinite(value).all():
                raise WorkbenchError(f"SAE parameter {name} contains NaN or Inf")
        if self.W_enc.dim() != 2 or self.W_dec.dim() != 2 or self.W_dec.shape[0] != self.d_sae:
            raise WorkbenchError(f"SAE weights do not fit: W_enc {tuple(self.W_enc.shape)} (d_in, d_sae), "
                                 f"W_dec {tuple(self.W_dec.shape)} (d_sae, d_out)")
        vectors = {"b_dec": self.d_out, "b_enc": self.d_sae, "threshold": self.d_sae, "b_gate": self.d_sae,
                   "b_mag": self.d_sae, "r_mag": self.d_sae}
        for name, size in vectors.items():
            if name in self.params and tuple(self.params[name].shape) != (size,):
                raise WorkbenchError(f"SAE parameter {name} has shape {tuple(self.params[name].shape)}, "
                                     f"expected ({size},)")
        if self.has_skip and tuple(self.params["W_skip"].shape) != (self.d_out, self.d_in):
            raise WorkbenchError(f"W_skip has shape {tuple(self.params['W_skip'].shape)}, "
                                 f"expected ({self.d_out}, {self.d_in})")
        if not self.is_transcoder and self.d_in != self.d_out:
            raise WorkbenchError(f"an SAE reconstructs its input: d_in {self.d_in} != d_out {self.d_out}")
        if self.activation == "topk" and not (isinstance(self.k, int) and not isinstance(self.k, bool)
                                              and 0 < self.k <= self.d_sae):
            raise WorkbenchError(f"a TopK SAE needs k in 1..{self.d_sae}, got {self.k!r}")
        if not isinstance(self.hook, str) or not self.hook:
            raise WorkbenchError("the SAE names no hook point (cfg.json metadata.hook_name)")

    def check_feature(self, feature: Any) -> int:
        """A feature index, checked against the dictionary's size."""
        if isinstance(feature, bool) or not isinstance(feature, (int, np.integer)):
            raise HookError(f"a feature index must be an integer, got {feature!r}")
        if not 0 <= int(feature) < self.d_sae:
            raise HookError(f"feature {feature} is out of range 0..{self.d_sae - 1} for {self.label()}")
        return int(feature)

    def label(self) -> str:
        return self.name or f"{self.architecture} SAE on {self.hook}"

    def __repr__(self) -> str:
        out = f", hook_out={self.hook_out!r}" if self.is_transcoder else ""
        return (f"SAE({self.architecture!r}, hook={self.hook!r}{out}, d_in={self.d_in}, d_sae={self.d_sae}"
                + (f", k={self.k}" if self.k else "") + ")")

    def on(self, device: str | torch.device) -> "SAE":
        """This SAE on ``device``: itself when it is there, else a copy made once and kept."""
        device = torch.device(device)
        if self.device == device or (device.type == self.device.type and device.index is None):
            return self
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            copies[device] = self.to(device)
            copies[device].name = self.name
        return copies[device]

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "SAE":
        """This SAE with its tensors moved (a new object; the original is untouched)."""
        params = {n: p.detach().to(device or p.device, dtype or p.dtype) for n, p in self.params.items()}
        moved = SAE(self.architecture, params, self.hook, hook_out=self.hook_out, k=self.k,
                    apply_b_dec_to_input=self.apply_b_dec_to_input, normalize_activations=self.normalize_activations,
                    rescale_acts_by_decoder_norm=self.rescale_acts_by_decoder_norm, cfg=self.cfg, name=self.name)
        moved.source = self.source
        return moved

    # ------------------------------------------------------------------------------------------- math

    def forward(self, x: torch.Tensor, fire: Fire = _no_hooks) -> tuple[torch.Tensor, torch.Tensor]:
        """``(feature activations [..., d_sae], output [..., d_out])`` of input ``x [..., d_in]``, in SAELens' order
        of operations; ``fire(point, tensor)`` runs the hooks of each of the SAE's points and returns what they give.
        """
        x = x.to(self.dtype)
        sae_in = fire("hook_sae_input", x)
        normalized, undo = self._normalize(sae_in)
        centered = normalized - self.b_dec if self.apply_b_dec_to_input else normalized
        p = self.params
        if self.activation == "gated":
            pre = fire("hook_sae_acts_pre", centered @ (self.W_enc * p["r_mag"].exp()) + p["b_mag"])
            acts = ((centered @ self.W_enc + p["b_gate"]) > 0).to(pre.dtype) * pre.relu()
        else:
            pre = fire("hook_sae_acts_pre", centered @ self.W_enc + p["b_enc"])
            acts = self._activate(pre)
        acts = fire("hook_sae_acts_post", acts)
        out = self._decode(acts, undo, fire)
        return acts, out + x @ p["W_skip"].T if self.has_skip else out

    def _activate(self, pre: torch.Tensor) -> torch.Tensor:
        if self.activation == "topk":
            if self.rescale_acts_by_decoder_norm:
                pre = pre * self.W_dec.norm(dim=-1)
            values, indices = pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        if self.activation == "jumprelu":
            return pre.relu() * (pre > self.params["threshold"]).to(pre.dtype)
        return pre.relu()

    def _decode(self, acts: torch.Tensor, undo: Callable[[torch.Tensor], torch.Tensor], fire: Fire) -> torch.Tensor:
        if self.rescale_acts_by_decoder_norm:
            acts = acts / self.W_dec.norm(dim=-1)
        recons = fire("hook_sae_recons", acts @ self.W_dec + self.b_dec)
        # SAELens' transcoders do not undo the input normalization on their output
        return recons if self.is_transcoder else undo(recons)

    def _normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """The input as the SAE was trained to see it, and the map back to the model's scale. Only the per-token
        rescalings act at run time: "expected_average_only_in" is folded into the weights when SAELens saves."""
        if self.normalize_activations == "constant_norm_rescale":
            coeff = self.d_in**0.5 / x.norm(dim=-1, keepdim=True)
            return x * coeff, lambda y: y / coeff
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            centered = x - mu
            std = centered.std(dim=-1, keepdim=True)
            return centered / (std + 1e-5), lambda y: y * std + mu
        return x, lambda y: y

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]``."""
        return self.forward(x)[0]

    def decode(self, acts: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """What the decoder makes of feature activations, as SAELens' ``decode`` (a skip connection's term is not
        in it: ``forward`` adds it). A per-token input normalization needs the input ``x`` the activations came
        from, to scale back."""
        per_token = self.normalize_activations in ("constant_norm_rescale", "layer_norm") and not self.is_transcoder
        if per_token and x is None:
            raise WorkbenchError(f"decoding an SAE with {self.normalize_activations} normalization needs its input x")
        undo = self._normalize(x.to(self.dtype))[1] if per_token else (lambda y: y)
        return self._decode(acts.to(self.dtype), undo, _no_hooks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)[1]

    def decoder_direction(self, feature: int) -> torch.Tensor:
        """The output one unit of the feature adds (its decoder row; divided by its norm where the SAE rescales
        activations by it)."""
        row = self.W_dec[self.check_feature(feature)]
        return row / row.norm() if self.rescale_acts_by_decoder_norm else row

    # -------------------------------------------------------------------------------------------- io

    def to_cfg(self) -> dict[str, Any]:
        """The ``cfg.json`` SAELens 6.x writes for this SAE."""
        metadata = {key: value for key, value in self.cfg.get("metadata", {}).items()}
        metadata.update(hook_name=self.hook, sae_lens_version=metadata.get("sae_lens_version", SAE_LENS_VERSION))
        if self.is_transcoder:
            metadata["hook_name_out"] = self.hook_out
        cfg = {key: value for key, value in self.cfg.items() if key not in METADATA_KEYS and key != "metadata"}
        cfg.update(architecture=self.architecture, d_in=self.d_in, d_sae=self.d_sae,
                   dtype=str(self.dtype).removeprefix("torch."), device="cpu",
                   apply_b_dec_to_input=self.apply_b_dec_to_input, normalize_activations=self.normalize_activations,
                   reshape_activations="none", metadata=metadata)
        if self.is_transcoder:
            cfg["d_out"] = self.d_out
        if self.activation == "topk":
            cfg.update(k=self.k, rescale_acts_by_decoder_norm=self.rescale_acts_by_decoder_norm)
        return cfg

    def save(self, path: str | Path, sparsity: torch.Tensor | None = None) -> Path:
        """Write ``cfg.json`` and ``sae_weights.safetensors`` into folder ``path`` (SAELens' layout; with
        ``sparsity``, each feature's log10 firing rate as ``sparsity.safetensors``). Returns the folder."""
        folder = check_save_folder(Path(path))
        folder.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().cpu().contiguous() for n, p in self.params.items()}, str(folder / WEIGHTS_FILENAME))
        if sparsity is not None:
            save_file({"sparsity": sparsity.detach().float().cpu().contiguous()}, str(folder / SPARSITY_FILENAME))
        (folder / CFG_FILENAME).write_text(json.dumps(self.to_cfg(), indent=2))
        if self.source is None:
            self.source = str(folder.resolve())
        return folder


def check_save_folder(folder: Path) -> Path:
    """``folder``, if ``SAE.save`` may write there: a folder (or nothing yet) that is not a link, holding no link in
    place of the files it writes, in a folder this process can write (checked before a long training, not after)."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise WorkbenchError(f"{folder} exists and is not a folder")
    for name in (CFG_FILENAME, WEIGHTS_FILENAME, SPARSITY_FILENAME):
        if (folder / name).is_symlink():
            raise WorkbenchError(f"{folder / name} is a symbolic link; refusing to write through it")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise WorkbenchError(f"cannot write into {existing}")
    return folder


def load_sae(path: str | Path, *, hook: str | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> SAE:
    """An SAE or transcoder from a SAELens folder (``cfg.json`` + ``sae_weights.safetensors``), its weights file, or a
    Gemma Scope ``params.npz`` (a JumpReLU SAE; its hook is ``hook`` or, from a ``layer_<n>`` in the path, that
    layer's ``hook_resid_post``). ``hook`` overrides the file's hook name. Nothing is unpickled."""
    path = Path(path)
    if not path.exists():
        raise WorkbenchError(f"no SAE at {path}")
    if path.suffix == ".npz":
        sae = _load_npz(path, hook)
    else:
        folder = path if path.is_dir() else path.parent
        if not (folder / CFG_FILENAME).is_file() and (folder / "params.npz").is_file():
            sae = _load_npz(folder / "params.npz", hook)
        else:
            sae = _load_saelens(folder, hook)
    sae = sae.to(device, dtype) if (dtype is not None or torch.device(device) != sae.device) else sae
    sae.source = str(path.resolve())
    return sae


def _load_saelens(folder: Path, hook: str | None) -> SAE:
    cfg_file, weights_file = folder / CFG_FILENAME, folder / WEIGHTS_FILENAME
    if not all(os.path.lexists(f) for f in (cfg_file, weights_file)):
        raise WorkbenchError(f"{folder} holds no SAELens SAE ({CFG_FILENAME} and {WEIGHTS_FILENAME})")
    for member in (cfg_file, weights_file):
        regular_file(member)
    cfg = _upgrade_cfg(_checked_cfg(read_json(cfg_file), cfg_file))
    try:
        params = load_file(str(weights_file))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise WorkbenchError(f"cannot read {weights_file}: {err}") from None
    if "scaling_factor" in params:  # SAELens drops an all-ones finetuning factor and refuses any other
        factor = params.pop("scaling_factor")
        if not torch.equal(factor, torch.ones_like(factor)):
            raise WorkbenchError("SAEs with a finetuning scaling factor are not supported")
    metadata = cfg.get("metadata", {})
    if metadata.get("hook_head_index") is not None or cfg.get("reshape_activations", "none") != "none":
        raise WorkbenchError("per-head (hook_z) SAEs are not supported yet")
    dtype = _dtype(cfg.get("dtype", "float32"))
    for name, value in params.items():  # as stored: the cast to the cfg's dtype below would hide integer weights
        if not value.is_floating_point():
            raise WorkbenchError(f"SAE parameter {name} must be a floating-point tensor, {weights_file.name} holds "
                                 f"{value.dtype}")
    params = {name: value.to(dtype) for name, value in params.items()}
    architecture = cfg.get("architecture", "standard")
    hook_name = hook or metadata.get("hook_name")
    if architecture not in ARCHITECTURES:
        raise WorkbenchError(f"unknown SAE architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
    sae = SAE(architecture, params, hook_name, hook_out=metadata.get("hook_name_out"), k=cfg.get("k"),
              apply_b_dec_to_input=cfg.get("apply_b_dec_to_input", True),
              normalize_activations=cfg.get("normalize_activations") or "none",
              rescale_acts_by_decoder_norm=cfg.get("rescale_acts_by_decoder_norm", False), cfg=cfg,
              name=folder.name)
    # a cfg that disagrees with its weights describes another SAE (a wrong file copied in): trust neither
    for field, actual in (("d_in", sae.d_in), ("d_sae", sae.d_sae)):
        if field in cfg and cfg[field] != actual:
            raise WorkbenchError(f"{CFG_FILENAME} says {field} {shorten(cfg[field])}, but the weights have {actual}")
    return sae


# The fields of a SAELens config that are read, and the types they must have (a list where an object belongs raised
# AttributeError deep inside); under "metadata" too.
_CFG_TYPES: dict[str, tuple[type, ...]] = {
    "metadata": (dict,), "activation_fn_kwargs": (dict,), "architecture": (str,), "dtype": (str,),
    "sae_lens_version": (str, int, float), "hook_name": (str,), "hook_point": (str,), "hook_name_out": (str,),
    "apply_b_dec_to_input": (bool,), "rescale_acts_by_decoder_norm": (bool,), "normalize_activations": (str, bool),
    "activation_fn": (str,)}


def _checked_cfg(cfg: Any, cfg_file: Path) -> dict[str, Any]:
    if not isinstance(cfg, dict):
        raise WorkbenchError(f"{cfg_file} is not a JSON object")
    for where in (cfg, cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}):
        for key, types in _CFG_TYPES.items():
            if where.get(key) is not None and not isinstance(where[key], types):
                raise WorkbenchError(f"{cfg_file}: {key} must be of type {' or '.join(t.__name__ for t in types)}, "
                                     f"got {shorten(where[key])}")
        version = where.get("sae_lens_version")
        if version is not None and not re.match(r"\d+(\.|$)", str(version)):
            raise WorkbenchError(f"{cfg_file}: sae_lens_version {shorten(version)} is not a version number")
    return cfg


def _upgrade_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    """A pre-6.0 SAELens config (``hook_point``, ``activation_fn_kwargs``, top-level metadata) in the 6.x layout, as
    SAELens' own ``handle_pre_6_0_config`` reads it."""
    version = cfg.get("sae_lens_version") or cfg.get("metadata", {}).get("sae_lens_version")
    if version and int(str(version).split(".")[0]) >= 6:
        return cfg
    cfg = {{"hook_point": "hook_name", "hook_point_head_index": "hook_head_index"}.get(k, k): v
           for k, v in cfg.items()}
    cfg.setdefault("apply_b_dec_to_input", True)
    cfg.setdefault("architecture", "standard")
    if cfg.get("activation_fn") == "topk" and cfg.get("activation_fn_kwargs", {}).get("k") is not None:
        cfg["architecture"], cfg["k"] = "topk", cfg["activation_fn_kwargs"]["k"]
    if isinstance(cfg.get("normalize_activations"), bool):
        cfg["normalize_activations"] = "expected_average_only_in" if cfg["normalize_activations"] else "none"
    cfg["metadata"] = {k: cfg.pop(k) for k in list(cfg) if k in METADATA_KEYS}
    return cfg


# How many times its own size an .npz's arrays may hold: savez stores them as they are and savez_compressed shrinks
# float weights little, while a zip of 4 MB that inflates to 4 GiB is a bomb.
NPZ_INFLATION = 8


def _npz_arrays(path: Path) -> dict[str, np.ndarray]:
    """The float arrays of an .npz, each checked before it is read: a member ``<name>.npy`` of a float dtype whose
    header's shape matches its bytes, and all of them within ``NPZ_INFLATION`` times the file's size (a header may not
    claim 37 GiB of a 500-byte file). Read without ``np.load``, which allocates what a header claims."""
    budget = NPZ_INFLATION * regular_file(path).stat().st_size + (1 << 20)
    arrays = {}
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            claimed = sum(m.file_size for m in members)
            if claimed > budget:
                raise WorkbenchError(f"{path}: its arrays claim {claimed:,} bytes, more than {NPZ_INFLATION} times the "
                                     "file's size")
            for member in members:
                name = member.filename.removesuffix(".npy")
                with archive.open(member) as f:
                    major, _ = np.lib.format.read_magic(f)
                    read_header = np.lib.format.read_array_header_1_0 if major == 1 else \
                        np.lib.format.read_array_header_2_0
                    shape, fortran, dtype = read_header(f)
                    if dtype.kind != "f" or dtype.fields is not None or name == member.filename:
                        raise WorkbenchError(f"{path}: member {shorten(member.filename)} is not a float array .npy "
                                             f"({dtype})")
                    size = math.prod(shape) * dtype.itemsize
                    if member.file_size - f.tell() != size:
                        raise WorkbenchError(f"{path}: array {shorten(name)}'s header claims shape {shape} of {dtype}, "
                                             f"which its {member.file_size - f.tell():,} bytes do not hold")
                    arrays[name] = np.frombuffer(f.read(size), dtype).reshape(shape, order="F" if fortran else "C")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise WorkbenchError(f"cannot read {path} as a numpy .npz of float arrays: {clip(str(err), 160)}") from None
    return arrays


def _load_npz(path: Path, hook: str | None) -> SAE:
    arrays = _npz_arrays(path)
    params = {("W_" + key[2:] if key.startswith("w_") else key): torch.from_numpy(value.astype(np.float32))
              for key, value in arrays.items()}
    if "scaling_factor" in params:
        factor = params.pop("scaling_factor")
        if not torch.equal(factor, torch.ones_like(factor)):
            raise WorkbenchError("Gemma Scope SAEs with a finetuning scaling factor are not supported")
    if hook is None:
        layer = re.search(r"layer_(\d+)", str(path))
        if layer is None:
            raise WorkbenchError(f"cannot tell the hook of {path} (no layer_<n> in its path): pass hook=")
        hook = f"blocks.{layer.group(1)}.hook_resid_post"
    # Gemma Scope's JumpReLU SAEs read the raw activation (no b_dec subtracted)
    return SAE("jumprelu", params, hook, apply_b_dec_to_input=False, name=path.parent.name,
               cfg={"metadata": {"hook_name": hook}})


def _dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float64": torch.float64}
    key = str(name).removeprefix("torch.")
    if key not in dtypes:
        raise WorkbenchError(f"unsupported SAE dtype {name!r}")
    return dtypes[key]


# ------------------------------------------------------------------------------------------ references

_REGISTERED: dict[str, SAE] = {}
# Inside MCP tool calls a spec's SAE path must point into the artifacts folder (a forged trace cannot make the server
# read a file outside it), and the SAE folder's files must not be links.
sae_paths_within = reads_within
_LOADED: dict[tuple[str, int], SAE] = {}  # (resolved path, modification time) -> SAE, so a replay loads a file once


def register_sae(name: str, sae: SAE) -> SAE:
    """Make ``sae`` known by ``name`` in this process: feature edit specs then name it (``{"sae": name}``)."""
    if not isinstance(name, str) or not name:
        raise WorkbenchError(f"an SAE's name must be a non-empty string, got {name!r}")
    if not isinstance(sae, SAE):
        raise WorkbenchError(f"register_sae takes an SAE, got {type(sae).__name__}")
    _REGISTERED[name] = sae
    return sae


def registered_saes() -> dict[str, SAE]:
    return dict(_REGISTERED)


def resolve_sae(reference: SAE | str | Path) -> SAE:
    """An SAE from itself, a name given to ``register_sae``, or a path ``load_sae`` reads (cached while the file is
    unchanged)."""
    if isinstance(reference, SAE):
        return reference
    if not isinstance(reference, (str, Path)) or not str(reference):
        raise HookError(f"an SAE is an SAE object, a registered name or a path, got {reference!r}")
    if str(reference) in _REGISTERED:
        return _REGISTERED[str(reference)]
    path = Path(reference).expanduser()
    root = read_root()
    if root is not None and not path.resolve().is_relative_to(root):
        raise HookError(f"SAE path {str(reference)[:80]!r} is outside the folder SAEs may be read from ({root})")
    if not path.exists():
        known = ", ".join(sorted(_REGISTERED)) or "none"
        raise HookError(f"no SAE named or stored at {str(reference)!r} (registered: {known})")
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = load_sae(path)
    return _LOADED[key]


def sae_reference(sae: SAE) -> str:
    """How a spec names ``sae``: its latest registered name, else its file; an SAE with neither is registered under a
    name made from its hook (so that a spec never embeds weights)."""
    for name, registered in reversed(_REGISTERED.items()):
        if registered is sae:
            return name
    if sae.source is not None:
        return sae.source
    return register_sae(f"{sae.name or sae.architecture}@{sae.hook}#{id(sae):x}", sae) and sae_reference(sae)


# --------------------------------------------------------------------------------------- feature edits


class FeatureEdit(RegionEdit):
    """An edit of one feature's activation at ``<hook>.hook_sae_acts_post`` of an SAE, at chosen positions (None:
    all, generated ones included). The call attaches the SAE when it does not already, with its error term, so the
    output changes by exactly the edit's change of the SAE's reconstruction."""

    def __init__(self, sae: SAE | str, feature: int, positions: Positions = None):
        try:
            self.sae = resolve_sae(sae)
        except WorkbenchError as err:
            raise HookError(str(err)) from None
        self.feature = self.sae.check_feature(feature)
        RegionEdit.__init__(self, f"{self.sae.hook}.hook_sae_acts_post", positions)

    def saes(self) -> list[Any]:
        return [self.sae]

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.sae is self.sae and other.to_spec() == self.to_spec()

    __hash__ = None  # mutable, as the other interventions

    def to_spec(self) -> dict[str, Any]:
        spec = {"type": self.kind, "sae": sae_reference(self.sae), "feature": self.feature}
        if self.positions is not None:
            spec["positions"] = self.positions if isinstance(self.positions, str) else list(self.positions)
        spec.update(self._params_spec())
        return spec

    def regions(self, run: RunShape):
        return [Region(self.hook, self._check_positions(run), None, [self.feature])]

    def validate(self, run: RunShape) -> None:
        check_saes([self.sae], run.config)
        super().validate(run)


class FeatureSteer(FeatureEdit):
    """Add ``scale`` to the feature's activation: its decoder direction times ``scale`` joins the output."""

    kind: ClassVar[str] = "feature_steer"

    def __init__(self, sae: SAE | str, feature: int, scale: float = 1.0, positions: Positions = None):
        super().__init__(sae, feature, positions)
        self.scale = _finite(scale, "feature steering scale")

    def _params_spec(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def _editor(self, region, run):
        return lambda x, mask, ctx: x + mask.to(x.dtype) * self.scale


class FeatureAblate(FeatureEdit):
    """Set the feature's activation to zero: its contribution leaves the output, the SAE's error term stays."""

    kind: ClassVar[str] = "feature_ablate"

    def _editor(self, region, run):
        return lambda x, mask, ctx: x.masked_fill(mask, 0)


class FeatureClamp(FeatureEdit):
    """Hold the feature's activation at ``value``."""

    kind: ClassVar[str] = "feature_clamp"

    def __init__(self, sae: SAE | str, feature: int, value: float = 0.0, positions: Positions = None):
        super().__init__(sae, feature, positions)
        self.value = _finite(value, "feature clamp value")

    def _params_spec(self) -> dict[str, Any]:
        return {"value": self.value}

    def _editor(self, region, run):
        return lambda x, mask, ctx: x.masked_fill(mask, self.value)


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise HookError(f"{what} must be a number, got {value!r}")
    return finite_number(value, what, HookError)
