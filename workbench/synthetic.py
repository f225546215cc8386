"""Small random models of any supported architecture and tensor format, for tests and benchmarks.

They can be written as GGUF files (through the gguf package's writer, as llama.cpp's converter would)
so the real loading path is exercised, or used directly in memory.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workbench import moe as moe_lib
from workbench.config import ModelConfig, MoEConfig
from workbench.kernels import QuantTensor
from workbench.loading import ARCHITECTURES, LoadedCheckpoint
from workbench.quant_mix import matrix_format
from workbench.tokenizer import Tokenizer
from workbench.weights import LayerWeights, ModelWeights

RMS_EPS = float(np.float32(1e-5))  # GGUF stores it as float32: keep configs equal after a round trip
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tokenizer_metadata(n_merges: int = 64) -> dict:
    """A byte-level BPE vocabulary (GGUF "gpt2" style): specials, 256 bytes, and merges of common pairs."""
    alphabet = _byte_level_alphabet()
    space = alphabet[ord(" ")]
    merges, merged = [], []
    for a, b in [(space, "t"), ("h", "e"), (space + "t", "he"), ("i", "n"), (space, "a"), ("e", "r"), ("o", "n"),
                 (space, "s"), ("r", "e"), (space, "c"), ("a", "t"), (space, "o"), ("e", "n"), ("i", "s")][:n_merges]:
        merges.append(f"{a} {b}")
        merged.append(a + b)
    tokens = SPECIAL_TOKENS + alphabet + merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


def random_config(architecture: str = "llama", n_layers: int = 2, d_model: int = 64, n_heads: int = 4,
                  n_kv_heads: int = 2, d_mlp: int = 128, vocab_size: int | None = None, n_ctx: int = 256,
                  d_head: int | None = None, tied_embeddings: bool = True, n_experts: int = 0,
                  n_experts_used: int = 2, d_expert: int | None = None, d_shared_expert: int = 0) -> ModelConfig:
    """A model config; with ``n_experts`` (a "qwen2moe"/"qwen3moe" architecture: 4 by default) every block's MLP is
    that many experts of ``d_expert`` (default ``d_mlp``) hidden units, ``n_experts_used`` per token, weighted as
    llama.cpp weights that architecture's (Mixtral is "llama" with experts)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose from {', '.join(ARCHITECTURES)}")
    vocab = vocab_size or len(tokenizer_metadata()["tokenizer.ggml.tokens"])
    n_experts = n_experts or (4 if architecture.endswith("moe") else 0)
    moe = MoEConfig(n_experts, n_experts_used, d_expert or d_mlp, normalize_weights=architecture != "qwen2moe",
                    d_shared_expert=d_shared_expert) if n_experts else None
    return ModelConfig(architecture=architecture, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_head=d_head or d_model // n_heads, d_mlp=d_mlp, vocab_size=vocab,
                       n_ctx=n_ctx, rope_base=10000.0, rms_eps=RMS_EPS, tied_embeddings=tied_embeddings,
                       name=f"random-{architecture}", moe=moe, **ARCHITECTURES[architecture])


def random_matrix(rows: int, cols: int, fmt: str, std: float = 1.0, generator: torch.Generator | None = None,
                  device: str = "cpu", distinct_rows: int | None = None) -> QuantTensor:
    """A Gaussian ``[rows, cols]`` matrix quantized into ``fmt``.

    With ``distinct_rows``, only that many rows are drawn and quantized, then tiled: a quick stand-in for a
    matrix of a real model's size (benchmarks), since quantizing is the slow part.
    """
    n = rows if distinct_rows is None else min(rows, distinct_rows)
    distinct = QuantTensor.quantize(torch.randn(n, cols, generator=generator, device=device) * std, fmt)
    if n == rows:
        return distinct
    return QuantTensor(distinct.data.repeat(-(-rows // n), 1)[:rows].contiguous(), distinct.fmt, (rows, cols))


def random_weights(config: ModelConfig, fmt: str = "Q8_0", seed: int = 0, device: str = "cpu",
                   distinct_rows: int | None = None) -> ModelWeights:
    """Gaussian weights quantized into ``fmt``, a format or a mix such as Q4_K_M, each matrix as quantizing on load
    would store it (``workbench.quant_mix``: rows too short for a K-quant's blocks fall back to a 32-value format);
    norms stay F32 around 1; ``distinct_rows`` as in random_matrix."""
    c = config
    g = torch.Generator(device=device).manual_seed(seed)

    def matrix(name: str, rows: int, cols: int, std: float) -> QuantTensor:
        matrix_fmt = matrix_format(fmt, name, c, cols)
        if matrix_fmt is None:
            raise ValueError(f"{name}: rows of {cols} values fit no block of {fmt}")
        return random_matrix(rows, cols, matrix_fmt.name, std, g, device, distinct_rows)

    def experts(i: int) -> moe_lib.MoEWeights:
        m, p = c.moe, f"blk.{i}."
        rows, f, s = m.n_experts * m.d_expert, m.d_expert, m.d_shared_expert
        shared = dict(shared_gate=matrix(p + "ffn_gate_shexp.weight", s, c.d_model, std),
                      shared_up=matrix(p + "ffn_up_shexp.weight", s, c.d_model, std),
                      shared_down=matrix(p + "ffn_down_shexp.weight", c.d_model, s, s**-0.5),
                      shared_router=QuantTensor.from_floats(torch.randn(1, c.d_model, generator=g, device=device)
                                                            * std)) if s else {}
        # the router stays float32, as llama.cpp's quantizer leaves it
        router = QuantTensor.from_floats(torch.randn(m.n_experts, c.d_model, generator=g, device=device) * std)
        return moe_lib.MoEWeights(router=router, gate=matrix(p + "ffn_gate_exps.weight", rows, c.d_model, std),
                                  up=matrix(p + "ffn_up_exps.weight", rows, c.d_model, std),
                                  down=matrix(p + "ffn_down_exps.weight", m.n_experts * c.d_model, f, f**-0.5),
                                  **shared)

    def dense(name: str, rows: int, cols: int, std: float) -> QuantTensor | None:
        return None if c.moe else matrix(name, rows, cols, std)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g, device=device)

    def bias(n: int) -> torch.Tensor:
        return 0.02 * torch.randn(n, generator=g, device=device)

    std = c.d_model**-0.5
    q_dim, kv_dim = c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    layers = [
        LayerWeights(
            attn_norm=norm(c.d_model), wq=matrix(f"blk.{i}.attn_q.weight", q_dim, c.d_model, std),
            wk=matrix(f"blk.{i}.attn_k.weight", kv_dim, c.d_model, std),
            wv=matrix(f"blk.{i}.attn_v.weight", kv_dim, c.d_model, std),
            wo=matrix(f"blk.{i}.attn_output.weight", c.d_model, q_dim, q_dim**-0.5), mlp_norm=norm(c.d_model),
            w_gate=dense(f"blk.{i}.ffn_gate.weight", c.d_mlp, c.d_model, std),
            w_up=dense(f"blk.{i}.ffn_up.weight", c.d_mlp, c.d_model, std),
            w_down=dense(f"blk.{i}.ffn_down.weight", c.d_model, c.d_mlp, c.d_mlp**-0.5),
            bq=bias(q_dim) if c.qkv_bias else None, bk=bias(kv_dim) if c.qkv_bias else None,
            bv=bias(kv_dim) if c.qkv_bias else None,
            q_norm=norm(c.d_head) if c.qk_norm else None, k_norm=norm(c.d_head) if c.qk_norm else None,
            moe=experts(i) if c.moe else None,
        )
        for i in range(c.n_layers)
    ]
    embed = matrix("token_embd.weight", c.vocab_size, c.d_model, 1.0)
    unembed = embed if c.tied_embeddings else matrix("output.weight", c.vocab_size, c.d_model, std)
    return ModelWeights(embed=embed, layers=layers, final_norm=norm(c.d_model), unembed=unembed)


def random_checkpoint(config: ModelConfig, fmt: str = "Q8_0", seed: int = 0, device: str = "cpu",
                      distinct_rows: int | None = None) -> LoadedCheckpoint:
    metadata = tokenizer_metadata()
    weights = random_weights(config, fmt, seed, device, distinct_rows)
    return LoadedCheckpoint(config, weights, Tokenizer.from_gguf_metadata(metadata), Path(f"<{config.name}>"), metadata)


def write_gguf(path: str | Path, config: ModelConfig, weights: ModelWeights, metadata: dict | None = None) -> Path:
    """Write a model as llama.cpp would store it (tensor names, layouts and metadata keys)."""
    import gguf

    path = Path(path)
    arch = config.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.name)
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.n_ctx)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_mlp)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.d_head)
    writer.add_value_length(config.d_head)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.rms_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.moe is not None:
        m = config.moe
        writer.add_expert_count(m.n_experts)
        writer.add_expert_used_count(m.n_experts_used)
        writer.add_expert_feed_forward_length(m.d_expert)
        writer.add_expert_weights_norm(m.normalize_weights)
        if m.d_shared_expert:
            writer.add_expert_shared_feed_forward_length(m.d_shared_expert)
    for key, value in (metadata or tokenizer_metadata()).items():
        _add_metadata(writer, key, value)

    def add(name: str, tensor: QuantTensor | torch.Tensor | None, shape: tuple[int, ...] | None = None) -> None:
        """``shape`` (torch order) for a tensor that is not 2-D: a vector's, or stacked experts' [n_experts, ...]."""
        if tensor is None:
            return
        if isinstance(tensor, torch.Tensor):  # norms and biases are stored F32
            tensor = QuantTensor.from_floats(tensor.float())
            data = tensor.data.cpu().numpy().reshape(-1)
        else:
            data = tensor.data.cpu().numpy()
            if shape is not None:
                data = data.reshape(*shape[:-1], -1)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(tensor.fmt.ggml_type))

    add("token_embd.weight", weights.embed)
    for i, layer in enumerate(weights.layers):
        p = f"blk.{i}."
        for name, value in [("attn_norm.weight", layer.attn_norm), ("attn_q.weight", layer.wq),
                            ("attn_k.weight", layer.wk), ("attn_v.weight", layer.wv),
                            ("attn_output.weight", layer.wo), ("attn_q.bias", layer.bq), ("attn_k.bias", layer.bk),
                            ("attn_v.bias", layer.bv), ("attn_q_norm.weight", layer.q_norm),
                            ("attn_k_norm.weight", layer.k_norm), ("ffn_norm.weight", layer.mlp_norm),
                            ("ffn_gate.weight", layer.w_gate), ("ffn_up.weight", layer.w_up),
                            ("ffn_down.weight", layer.w_down)]:
            add(p + name, value)
        if layer.moe is not None:
            for name, value, shape in moe_lib.gguf_tensors(p, layer.moe):
                add(name, value, shape)
    add("output_norm.weight", weights.final_norm)
    if weights.unembed is not weights.embed:
        add("output.weight", weights.unembed)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"cannot write metadata {key} of type {type(value).__name__}")
