"""LoRA adapters: llama.cpp GGUF adapters and PEFT folders, read and checked against a base model.

An adapter adds ``s * B (A x)`` to some projections of some layers, next to the packed base weights (never merged):
``A`` is ``[rank, in]``, ``B`` is ``[out, rank]`` and ``s`` is ``alpha / rank`` (PEFT's ``use_rslora``:
``alpha / sqrt(rank)``; llama.cpp: ``alpha / rank``, or 1 when the file stores no alpha) times the scale the adapter
is used at. ``B``'s rows are in the base's layout: a PEFT adapter's q/k rows of a llama model get the rope permutation
that llama.cpp's converter (and our HF loader) gives the base's Q/K (llama.cpp's ``convert_lora_to_gguf.py`` already
applied it to a GGUF adapter).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.config import ModelConfig
from workbench.errors import ModelLoadError, finite_number, real_number, shorten
from workbench.files import read_json, regular_file
from workbench.kernels import QuantTensor, get_format
from workbench.loading import hash_files, permute_for_interleaved_rope

# Our projection (a LayerWeights field) -> its llama.cpp tensor name and its Hugging Face module name.
PROJECTIONS: dict[str, tuple[str, str]] = {
    "wq": ("attn_q", "q_proj"), "wk": ("attn_k", "k_proj"), "wv": ("attn_v", "v_proj"),
    "wo": ("attn_output", "o_proj"), "w_gate": ("ffn_gate", "gate_proj"), "w_up": ("ffn_up", "up_proj"),
    "w_down": ("ffn_down", "down_proj"),
}
_GGUF_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
_PEFT_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# (A, B) of each (layer, projections one tensor pair adapts: one, or a fused matrix's parts)
Pairs = dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, torch.Tensor]]


def _module_targets(config: ModelConfig) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The projections each GGUF and each PEFT module name adapts, for a base of ``config``: one, or the parts of the
    family's fused matrix (Phi-3's ``attn_qkv`` / ``qkv_proj`` and ``ffn_up`` / ``gate_up_proj``), whose LoRA's B
    splits by rows as the loader splits the weights (A is the parts' own)."""
    family = config.arch
    gguf = {name: (ours,) for ours, (name, _) in PROJECTIONS.items()}
    hf = {name: (ours,) for ours, (_, name) in PROJECTIONS.items()}
    for name, parts in family.fused.items():
        gguf[name.removesuffix(".weight")] = parts
    for hf_name, gguf_name in family.hf_tensors.items():
        if gguf_name in family.fused:
            hf[hf_name.removesuffix(".weight").rsplit(".", 1)[-1]] = family.fused[gguf_name]
    return gguf, hf


class AdapterError(ModelLoadError):
    """An adapter file that is corrupt, of an unsupported kind, or made for another base model."""


@dataclass
class Adapter:
    """A LoRA adapter resident next to a model: per layer, ``{projection: (A, B)}`` with ``alpha / rank`` (or its
    rsLoRA form) folded into ``B``, float32 on the CPU. ``scale`` is what it is used at when named alone."""

    name: str
    path: Path
    format: str  # "gguf" or "peft"
    sha256: str
    rank: int
    alpha: float | None
    scale: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def projections(self) -> list[str]:
        """The projections it adapts in some layer, in forward order."""
        present = {p for layer in self.layers for p in layer}
        return [p for p in PROJECTIONS if p in present]

    @property
    def adapted_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer]

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "format": self.format, "sha256": self.sha256,
                "rank": self.rank, "alpha": self.alpha, "scale": self.scale, "layers": self.adapted_layers,
                "projections": self.projections, "parameters": self.n_params}

    @property
    def n_params(self) -> int:
        return sum(a.numel() + b.numel() for layer in self.layers for a, b in layer.values())


def load_adapter(path: str | Path, config: ModelConfig, name: str, scale: float = 1.0) -> Adapter:
    """Read a GGUF LoRA adapter file or a PEFT adapter folder and check it fits a base model of ``config``: every
    tensor named, shaped and finite as the base's projections need, A's rank equal to B's. Raises AdapterError."""
    path = Path(path)
    if not path.exists():
        raise AdapterError(f"no adapter at {path}")
    scale = finite_number(scale, "adapter scale")
    files = adapter_files(path)
    if path.is_dir():
        pairs, alpha_scale, info = _read_peft(path, config)
    else:
        pairs, alpha_scale, info = _read_gguf_adapter(path, config)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.n_layers)]
    ranks = set()
    for (layer, proj), (a, b) in sorted(_unfused(pairs, config, path, info["tensor_names"]).items()):
        where = f"{path}: layer {layer} {PROJECTIONS[proj][1]}"
        lacks = missing_projection(config, layer, proj)
        if lacks:  # an adapter there would load and change nothing
            raise AdapterError(f"{where} ({info['tensor_names'][layer, proj]}): the base has no such projection "
                               f"({lacks})")
        out_dim, in_dim = projection_shape(config, proj, layer)
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"{where}: lora A and B must be matrices, got shapes {tuple(a.shape)}, {tuple(b.shape)}")
        if not all(t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) for t in (a, b)):
            raise AdapterError(f"{where}: lora A and B must be float16, bfloat16, float32 or float64, got {a.dtype} "
                               f"and {b.dtype}")
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: rank mismatch, A has {a.shape[0]} rows and B {b.shape[1]} columns")
        if a.shape[0] < 1:
            raise AdapterError(f"{where}: rank 0 (A and B hold no rows / columns)")
        if a.shape[1] != in_dim or b.shape[0] != out_dim:
            raise AdapterError(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base's "
                               f"[{out_dim}, {in_dim}] projection (an adapter for another model?)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{where}: the adapter holds NaN or Inf")
        rank = a.shape[0]
        ranks.add(rank)
        s = alpha_scale(rank)
        if not _finite_float32(s):
            raise AdapterError(f"{where}: the scale alpha / rank = {s:g} is not a finite float32")
        if proj in ("wq", "wk") and info.get("needs_permute"):
            b = permute_rows_for_rope(b, config, proj)
        # checked as kept (float32, s folded into B)
        a, b = a.float().contiguous(), (b.float() * s).contiguous()
        check_term_range(a, b, torch.float32, f"{where}: ", f"alpha / rank ({s:g})")
        layers[layer][proj] = (a, b)
    if not ranks:
        raise AdapterError(f"{path}: the adapter holds no LoRA tensors for the base's projections")
    info.pop("needs_permute", None)
    info.pop("tensor_names", None)
    return Adapter(name, path, "peft" if path.is_dir() else "gguf", hash_files(files), max(ranks),
                   info.pop("alpha"), scale, layers, info)


def adapter_files(path: Path, *, links: bool = True) -> list[Path]:
    """The files an adapter is read from and hashed over (a GGUF file, or a PEFT folder's config and weights), each a
    regular file (``files.regular_file``: never a FIFO; a link only where ``links`` and the caller's confinement
    allow, the folder itself included)."""
    if not links and path.is_symlink():
        raise AdapterError(f"{path} is a symbolic link; refused")
    if not path.is_dir():
        return [regular_file(path, AdapterError, links=links)]
    files = [path / "adapter_config.json", path / "adapter_model.safetensors"]
    if not os.path.lexists(files[0]):
        raise AdapterError(f"{path} has no adapter_config.json (expected a PEFT adapter folder or a GGUF file)")
    if not os.path.lexists(files[1]):
        raise AdapterError(f"{path} has no adapter_model.safetensors (a .bin adapter is a pickle: convert it)")
    return [regular_file(file, AdapterError, links=links) for file in files]


def projection_shape(config: ModelConfig, proj: str, layer: int | None = None) -> tuple[int, int]:
    """``(out, in)`` of one of the base's projections: of ``layer`` where given (Gemma 4's global layers and MLP
    widths differ by layer), else of the model-wide sizes."""
    n_kv_heads, d_head = (config.n_kv_heads, config.d_head) if layer is None else config.layer_heads(layer)
    d_mlp = config.d_mlp if layer is None else config.layer_d_mlp(layer)
    q_dim, kv_dim = config.n_heads * d_head, n_kv_heads * d_head
    return {"wq": (q_dim, config.d_model), "wk": (kv_dim, config.d_model), "wv": (kv_dim, config.d_model),
            "wo": (config.d_model, q_dim), "w_gate": (d_mlp, config.d_model),
            "w_up": (d_mlp, config.d_model), "w_down": (config.d_model, d_mlp)}[proj]


def missing_projection(config: ModelConfig, layer: int, proj: str) -> str | None:
    """Why ``layer`` of the base has no ``proj`` matrix (None: it has one)."""
    if proj in ("w_gate", "w_up", "w_down") and config.moe is not None and not config.moe.dense_mlp:
        return "its feed-forward is a mixture of experts only, without a dense MLP"
    if proj in ("wk", "wv") and config.kv_source(layer) != layer:
        return f"the layer reuses layer {config.kv_source(layer)}'s keys and values"
    return None


def check_term_range(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, where: str, scale: str) -> None:
    """A LoRA term's A and its B times ``scale`` within ``dtype``'s range, and a bound on the largest entry of their
    product (the sum over the rank of the largest |B| times the largest |A|): finite halves that overflow there, or
    whose product does, would make every logit NaN."""
    limit, kind = torch.finfo(dtype).max, str(dtype).removeprefix("torch.")
    if not a.abs().max() <= limit:
        raise AdapterError(f"{where}lora A overflows {kind}")
    if not b.abs().max() <= limit:
        raise AdapterError(f"{where}lora B times {scale} overflows {kind}")
    bound = float((b.double().abs().amax(dim=0) * a.double().abs().amax(dim=1)).sum())
    if not bound <= limit:
        raise AdapterError(f"{where}the delta B A (B times {scale}) can reach {bound:.3g}, past {kind}'s range")


def _finite_float32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= torch.finfo(torch.float32).max


def permute_rows_for_rope(b: torch.Tensor, config: ModelConfig, proj: str) -> torch.Tensor:
    """B's rows in the order llama.cpp's converter gives the base's Q or K rows (``B A``'s rows are the delta's)."""
    return permute_for_interleaved_rope(b, config.n_heads if proj == "wq" else config.n_kv_heads)


# --------------------------------------------------------------------------------------------- GGUF


def _read_gguf_adapter(path: Path, config: ModelConfig):
    from workbench.loading import _gguf_tensor_bytes, _read_gguf

    file = _read_gguf(path)
    metadata, tensors = file.metadata, file.tensors
    if metadata.get("general.type") != "adapter" or metadata.get("adapter.type") != "lora":
        raise AdapterError(f"{path} is not a LoRA adapter (general.type={metadata.get('general.type')!r}, "
                           f"adapter.type={metadata.get('adapter.type')!r})")
    arch = metadata.get("general.architecture")
    if arch != config.architecture:
        raise AdapterError(f"{path} is an adapter for a {arch!r} model; the base is {config.architecture!r}")
    if metadata.get("adapter.alora.invocation_tokens") is not None:
        raise AdapterError(f"{path} is an activated LoRA (aLoRA), which is not supported")
    alpha = real_number(metadata.get("adapter.lora.alpha", 0.0), f"{path}: adapter.lora.alpha", AdapterError)
    targets = _module_targets(config)[0]
    halves: dict[tuple[int, tuple[str, ...]], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, Any], str] = {}
    for tensor_name, tensor in tensors.items():
        match = _GGUF_TENSOR.fullmatch(tensor_name)
        if match is None or match.group(2) not in targets:
            raise AdapterError(f"{path}: tensor {tensor_name} is not a LoRA of a supported projection "
                               f"({', '.join(targets)})")
        if 0 in tensor.shape:  # rank 0: no bytes to read, and nothing to add
            raise AdapterError(f"{path}: tensor {tensor_name} has shape {tuple(int(n) for n in reversed(tensor.shape))}"
                               "; a LoRA needs a rank of at least 1")
        raw, shape = _gguf_tensor_bytes(file, tensor, path)
        rows, cols = (1, shape[0]) if len(shape) == 1 else (math.prod(shape[:-1]), shape[-1])
        matrix = QuantTensor(raw, get_format(tensor.ggml_type), (rows, cols)).dequantize()
        key = (int(match.group(1)), targets[match.group(2)])
        halves.setdefault(key, {})[match.group(3)] = matrix
        names[key] = tensor_name[:-len(".lora_a")]
    info = {"alpha": alpha or None, "architecture": arch, "tensor_names": names}
    # llama.cpp: alpha / rank, or the bare adapter scale where the file's alpha is 0
    return _pairs(halves, path, "ab", names), (lambda rank: alpha / rank if alpha else 1.0), info


def _pairs(halves: dict, path: Path, keys: str, names: dict) -> Pairs:
    """(A, B) of each (layer, projections adapted) from the tensors found for it (``keys``: A's and B's suffixes)."""
    pairs = {}
    for key, found in halves.items():
        missing = [k for k in keys if k not in found]
        if missing:
            raise AdapterError(f"{path}: {names[key]} has no lora_{missing[0]} tensor")
        pairs[key] = (found[keys[0]], found[keys[1]])
    return pairs


def _unfused(pairs: Pairs, config: ModelConfig, path: Path, names: dict
             ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """One (A, B) per projection: a fused matrix's B split by the rows of its parts, each with the same A (B A split
    by rows is each part's own delta)."""
    out = {}
    for (layer, parts), (a, b) in pairs.items():
        if not 0 <= layer < config.n_layers:
            raise AdapterError(f"{path}: {names[layer, parts]}: the base model has layers 0..{config.n_layers - 1}")
        if len(parts) > 1:
            sizes = [projection_shape(config, part, layer)[0] for part in parts]
            if b.dim() != 2 or b.shape[0] != sum(sizes):
                raise AdapterError(f"{path}: {names[layer, parts]}: B {tuple(b.shape)} does not fit the base's fused "
                                   f"{' + '.join(map(str, sizes))} rows (an adapter for another model?)")
            b_parts = b.split(sizes)
        else:
            b_parts = [b]
        for part, b_part in zip(parts, b_parts):
            out[layer, part] = (a, b_part)
            names[layer, part] = names[layer, parts]
    return out


# --------------------------------------------------------------------------------------------- PEFT


def _read_peft(path: Path, config: ModelConfig):
    from safetensors.torch import load_file

    config_file, weights_file = adapter_files(path)  # regular files, checked
    cfg = read_json(config_file, AdapterError)
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_file}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} "
                           "is not LORA")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern"),
                      ("modules_to_save", "modules_to_save"), ("lora_bias", "LoRA biases")):
        if cfg.get(key):
            raise AdapterError(f"{config_file}: {what} is not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:  # int() would truncate 4.7; r = 0 divides by zero
        raise AdapterError(f"{config_file}: r must be a positive integer, got {shorten(r)}")
    alpha = real_number(cfg.get("lora_alpha", r), f"{config_file}: lora_alpha", AdapterError)  # "8" is refused
    if not _finite_float32(alpha):  # as llama.cpp's GGUF field holds it
        raise AdapterError(f"{config_file}: lora_alpha {alpha:g} is past float32's range")
    modules = _module_targets(config)[1]
    targets = cfg.get("target_modules")
    if not isinstance(targets, (list, str, type(None))):  # PEFT's forms: names, or one pattern over them
        raise AdapterError(f"{config_file}: target_modules must be a list of names or a pattern, got "
                           f"{shorten(targets)}")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise AdapterError(f"{config_file}: target_modules must be names, got {shorten(targets)}")
        unsupported = sorted(set(targets) - set(modules))
        if unsupported:
            raise AdapterError(f"{config_file}: target modules {unsupported} are not supported; "
                               f"supported: {', '.join(modules)}")
    try:
        loaded = load_file(str(weights_file))
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise AdapterError(f"{weights_file} is not a valid safetensors file: {err}") from None
    halves: dict[tuple[int, tuple[str, ...]], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, Any], str] = {}
    for tensor_name, tensor in loaded.items():
        match = _PEFT_TENSOR.fullmatch(tensor_name)
        if match is None or match.group(2) not in modules:
            raise AdapterError(f"{weights_file}: tensor {tensor_name} is not a LoRA of a supported projection "
                               f"({', '.join(modules)})")
        module = match.group(2)
        if isinstance(targets, list) and module not in targets:
            raise AdapterError(f"{weights_file}: tensor {tensor_name} adapts {module}, not in target_modules {targets}")
        key = (int(match.group(1)), modules[module])
        halves.setdefault(key, {})[match.group(3)] = tensor
        names[key] = tensor_name.rsplit(".lora_", 1)[0]
    pairs = _pairs(halves, weights_file, "AB", names)
    for key, (a, _) in pairs.items():
        if a.dim() == 2 and a.shape[0] != r:
            raise AdapterError(f"{weights_file}: {names[key]} has rank {a.shape[0]}; adapter_config.json says r = {r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):  # "no" would read as True and change every scale
        raise AdapterError(f"{config_file}: use_rslora must be true or false, got {shorten(rslora)}")
    info = {"alpha": alpha, "rslora": rslora, "base_model": cfg.get("base_model_name_or_path"),
            "needs_permute": config.rope_interleaved, "tensor_names": names}
    return pairs, (lambda rank: alpha / math.sqrt(rank) if rslora else alpha / rank), info
