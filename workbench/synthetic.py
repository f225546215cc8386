"""Small random models of any supported architecture and tensor format, for tests and benchmarks.

They can be written as GGUF files (through the gguf package's writer, as llama.cpp's converter would)
so the real loading path is exercised, or used directly in memory.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workbench import moe as moe_lib
from workbench.architectures import ARCHITECTURES, GLOBAL_TENSORS, LAYER_TENSORS
from workbench.config import ModelConfig, MoEConfig
from workbench.kernels import QuantTensor
from workbench.loading import LoadedCheckpoint, row_ranges, swa_layers
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


def tokenizer_metadata(n_merges: int = 64, vocab_size: int | None = None) -> dict:
    """A byte-level BPE vocabulary (GGUF "gpt2" style): specials, 256 bytes, and merges of common pairs; with a larger
    ``vocab_size``, unused tokens after them (llama.cpp takes the vocabulary's size from this list, which must then
    match the embedding's rows)."""
    alphabet = _byte_level_alphabet()
    space = alphabet[ord(" ")]
    merges, merged = [], []
    for a, b in [(space, "t"), ("h", "e"), (space + "t", "he"), ("i", "n"), (space, "a"), ("e", "r"), ("o", "n"),
                 (space, "s"), ("r", "e"), (space, "c"), ("a", "t"), (space, "o"), ("e", "n"), ("i", "s")][:n_merges]:
        merges.append(f"{a} {b}")
        merged.append(a + b)
    tokens = SPECIAL_TOKENS + alphabet + merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    unused = max(0, (vocab_size or 0) - len(tokens))
    tokens += [f"<unused{i}>" for i in range(unused)]
    types += [5] * unused
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


# Each family's special settings in a random model, small enough that a short prompt crosses the sliding window.
FAMILY_SETTINGS: dict[str, dict] = {
    "gemma2": dict(sliding_window=4, attn_softcap=50.0, final_softcap=30.0),
    "gemma3": dict(sliding_window=4, rope_base=1e6, rope_base_local=10000.0),
    "phi3": dict(partial_rotary=0.5),
    "gpt-oss": dict(sliding_window=4),
    "gemma4": dict(final_softcap=30.0),  # what a GGUF without the key takes (llama.cpp's default), as the real ones
}


def random_config(architecture: str = "llama", n_layers: int = 2, d_model: int = 64, n_heads: int = 4,
                  n_kv_heads: int = 2, d_mlp: int = 128, vocab_size: int | None = None, n_ctx: int = 256,
                  d_head: int | None = None, tied_embeddings: bool = True, n_experts: int = 0, n_experts_used: int = 2,
                  d_expert: int | None = None, d_shared_expert: int = 0, **settings) -> ModelConfig:
    """A small config of ``architecture`` with its family's special features on (``FAMILY_SETTINGS``); ``settings``
    set any other ModelConfig field (``sliding_window=4`` on llama: Mistral with a window), or ``partial_rotary``, the
    fraction of each head the rope turns. Sliding-window families alternate sliding and global layers.

    With ``n_experts`` (a "qwen2moe"/"qwen3moe"/"gpt-oss" architecture: 4 by default) every block's MLP is that many
    experts of ``d_expert`` (default ``d_mlp``) hidden units, ``n_experts_used`` per token, weighted as llama.cpp
    weights that family's (Mixtral is "llama" with experts). Gemma 4 is its dense layout with heads of one size."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose from {', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[architecture]
    # the attention scale loading a GGUF of the family gives (Gemma 4's is 1)
    settings = {"attn_scale": family.gguf_attn_scale(n_layers, d_model, n_heads),
                **FAMILY_SETTINGS.get(architecture, {}), **settings}
    n_experts = n_experts or (4 if architecture.endswith("moe") or family.moe else 0)
    if n_experts:
        settings["moe"] = MoEConfig(n_experts, n_experts_used, d_expert or d_mlp, d_shared_expert=d_shared_expert,
                                    **{"normalize_weights": architecture != "qwen2moe", **family.moe})
    vocab = vocab_size or len(tokenizer_metadata()["tokenizer.ggml.tokens"])
    d_head = d_head or d_model // n_heads
    partial = settings.pop("partial_rotary", None)
    if partial is not None:
        settings["d_rotary"] = int(d_head * partial)
    if settings.get("sliding_window") and "sliding_layers" not in settings:
        settings["sliding_layers"] = swa_layers(n_layers, 2 if ARCHITECTURES[architecture].swa_period else 0)
    return ModelConfig(architecture=architecture, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_head=d_head, d_mlp=d_mlp, vocab_size=vocab, n_ctx=n_ctx,
                       rope_base=settings.pop("rope_base", 10000.0), rms_eps=RMS_EPS, tied_embeddings=tied_embeddings,
                       name=f"random-{architecture}", **family.config_flags(), **settings)


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
        biases = dict(router_bias=bias(m.n_experts), gate_bias=bias(m.n_experts, f), up_bias=bias(m.n_experts, f),
                      down_bias=bias(m.n_experts, c.d_model)) if family.moe_biases else {}
        return moe_lib.MoEWeights(router=router, gate=matrix(p + "ffn_gate_exps.weight", rows, c.d_model, std),
                                  up=matrix(p + "ffn_up_exps.weight", rows, c.d_model, std),
                                  down=matrix(p + "ffn_down_exps.weight", m.n_experts * c.d_model, f, f**-0.5),
                                  **shared, **biases)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g, device=device)

    def bias(*shape: int) -> torch.Tensor:
        return 0.02 * torch.randn(*shape, generator=g, device=device)

    std = c.d_model**-0.5
    family = c.arch
    q_dim, kv_dim = c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    rows = {"wq": q_dim, "wk": kv_dim, "wv": kv_dim, "w_gate": c.d_mlp, "w_up": c.d_mlp}
    qk_norm = {"head": (c.d_head, c.d_head), "projection": (q_dim, kv_dim)}.get(family.qk_norm)
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        # a family that stores q/k/v or gate/up fused draws (and quantizes) them as one matrix, as its GGUF keeps them
        parts = {}
        for fused, names in family.fused.items():
            stacked = matrix(p + fused, sum(rows[n] for n in names), c.d_model, std)
            parts.update(zip(names, row_ranges(stacked, [rows[n] for n in names])))
        for name in rows:
            if name not in parts:
                parts[name] = None if c.moe and name.startswith("w_") else matrix(p + LAYER_TENSORS[name], rows[name],
                                                                                  c.d_model, std)
        layers.append(LayerWeights(
            attn_norm=norm(c.d_model) if family.pre_norms else None, **parts,
            wo=matrix(p + "attn_output.weight", c.d_model, q_dim, q_dim**-0.5),
            mlp_norm=norm(c.d_model) if family.pre_norms else None,
            w_down=None if c.moe else matrix(p + "ffn_down.weight", c.d_model, c.d_mlp, c.d_mlp**-0.5),
            bq=bias(q_dim) if c.qkv_bias else None, bk=bias(kv_dim) if c.qkv_bias else None,
            bv=bias(kv_dim) if c.qkv_bias else None, bo=bias(c.d_model) if family.out_bias else None,
            sinks=torch.randn(c.n_heads, generator=g, device=device) if family.attn_sinks else None,
            v_norm=torch.ones(c.d_head, device=device) if family.v_norm else None,
            q_norm=norm(qk_norm[0]) if qk_norm else None, k_norm=norm(qk_norm[1]) if qk_norm else None,
            attn_post_norm=norm(c.d_model) if family.post_norms else None,
            mlp_post_norm=norm(c.d_model) if family.post_norms else None,
            moe=experts(i) if c.moe else None,
        ))
    embed = matrix("token_embd.weight", c.vocab_size, c.d_model, 1.0)
    unembed = embed if c.tied_embeddings else matrix("output.weight", c.vocab_size, c.d_model, std)
    return ModelWeights(embed=embed, layers=layers, final_norm=norm(c.d_model), unembed=unembed)


def random_checkpoint(config: ModelConfig, fmt: str = "Q8_0", seed: int = 0, device: str = "cpu",
                      distinct_rows: int | None = None) -> LoadedCheckpoint:
    metadata = tokenizer_metadata(vocab_size=config.vocab_size)
    weights = random_weights(config, fmt, seed, device, distinct_rows)
    return LoadedCheckpoint(config, weights, Tokenizer.from_gguf_metadata(metadata), Path(f"<{config.name}>"), metadata)


def write_gguf(path: str | Path, config: ModelConfig, weights: ModelWeights, metadata: dict | None = None) -> Path:
    """Write a model as llama.cpp would store it (tensor names, layouts and metadata keys). Gemma 4's per-layer
    layouts (global layers' own head shape, per-layer embeddings and MLP widths, reused keys and values, experts beside
    the dense MLP) are refused: llama.cpp's converter writes those."""
    import gguf

    path = Path(path)
    c, arch = config, config.architecture
    unwritable = [what for what, present in (
        ("global layers with their own head shape", c.d_head_global or c.n_kv_heads_global),
        ("per-layer embeddings", c.d_per_layer), ("layers reusing keys and values", c.kv_shared_layers),
        ("per-layer MLP widths", c.d_mlp_layers), ("experts beside the dense MLP", c.moe and c.moe.dense_mlp)) if present]
    if unwritable:
        raise ValueError(f"write_gguf cannot write {', '.join(unwritable)}; convert the folder with llama.cpp's "
                         "convert_hf_to_gguf.py")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(c.name)
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.n_ctx)
    writer.add_embedding_length(c.d_model)
    writer.add_feed_forward_length(c.d_mlp)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.d_head)
    writer.add_value_length(c.d_head)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_vocab_size(c.vocab_size)
    if c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
        writer.add_array(f"{arch}.attention.sliding_window_pattern", list(c.sliding_layers))
        if c.rope_base_local is not None:
            writer.add_rope_freq_base_swa(c.rope_base_local)
    if c.rope_scale != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_scale)
    if c.rope_yarn is not None:  # as llama.cpp reads it: rounded ramp ends, the default attention factor
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(c.rope_yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(c.rope_yarn.original_context)
        writer.add_rope_scaling_yarn_beta_fast(c.rope_yarn.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(c.rope_yarn.beta_slow)
    if c.rope_long is not None:  # as llama.cpp's converter writes Phi-3's (no scaling type: the factors mark it)
        writer.add_rope_scaling_orig_ctx_len(c.rope_long.original_context)
        writer.add_rope_scaling_attn_factors(c.rope_long.attn_factor)
    if c.d_rotary is not None:
        writer.add_rope_dimension_count(c.d_rotary)
    if c.attn_softcap:
        writer.add_attn_logit_softcapping(c.attn_softcap)
    if c.final_softcap:
        writer.add_final_logit_softcapping(c.final_softcap)
    if c.moe is not None:
        writer.add_expert_count(c.moe.n_experts)
        writer.add_expert_used_count(c.moe.n_experts_used)
        writer.add_expert_feed_forward_length(c.moe.d_expert)
        if c.moe.d_shared_expert:
            writer.add_expert_shared_feed_forward_length(c.moe.d_shared_expert)
    for key, value in (metadata or tokenizer_metadata()).items():
        _add_metadata(writer, key, value)

    def add(name: str, tensor: QuantTensor | torch.Tensor | None, shape: tuple[int, ...] | None = None) -> None:
        """``shape`` (torch order) for stacked experts, ``[n_experts, rows, cols]``, and their biases,
        ``[n_experts, rows]``."""
        if tensor is None:
            return
        if isinstance(tensor, torch.Tensor):  # norms and biases are stored F32
            shape = shape or tuple(tensor.shape)
            tensor = QuantTensor.from_floats(tensor.float())
        data = tensor.data.cpu().numpy()
        if shape is not None:
            data = data.reshape(*shape[:-1], -1)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(tensor.fmt.ggml_type))

    add(GLOBAL_TENSORS["embed"], weights.embed)
    for i, layer in enumerate(weights.layers):
        p = f"blk.{i}."
        fused = {field: name for name, fields in c.arch.fused.items() for field in fields}
        for name, fields in c.arch.fused.items():
            parts = [getattr(layer, f) for f in fields]
            if len({w.fmt.name for w in parts}) != 1:
                raise ValueError(f"{p}{name}: its parts have different formats")
            add(p + name, QuantTensor(torch.cat([w.data for w in parts]), parts[0].fmt,
                                      (sum(w.shape[0] for w in parts), parts[0].shape[1])))
        for field, name in c.arch.layer_tensors.items():
            if field not in fused:
                add(p + name, getattr(layer, field))
        if layer.moe is not None:
            for name, value, shape in moe_lib.gguf_tensors(p, layer.moe):
                add(name, value, shape)
    add(GLOBAL_TENSORS["final_norm"], weights.final_norm)
    if weights.unembed is not weights.embed:
        add(GLOBAL_TENSORS["unembed"], weights.unembed)
    add(GLOBAL_TENSORS["rope_short_factors" if c.rope_long else "rope_freq_factors"], weights.rope_freq_factors)
    add(GLOBAL_TENSORS["rope_long_factors"], weights.rope_long_factors)
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


# transformers' class and config of each family in ``random_hf_checkpoint`` ("mistral": llama's family with a window)
_HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "llama3": ("LlamaConfig", "LlamaForCausalLM"),  # with Llama 3.1's rope scaling
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "gemma4moe": ("Gemma4TextConfig", "Gemma4ForCausalLM"),  # the 26B-A4B's shape: experts beside the dense MLP
    "gemma4e": ("Gemma4TextConfig", "Gemma4ForCausalLM"),  # the E2B's: per-layer embeddings, reused keys and values
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "phi3.5": ("Phi3Config", "Phi3ForCausalLM"),  # with LongRoPE
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),  # OLMo 2 with sliding layers, which llama.cpp converts as olmo2
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),
}


# Gemma 4 (the 31B's shape, tiny): global layers with heads of their own size and count whose values are the keys'
# projection, a proportional rope on them (a quarter of each head's pairs turn), no per-layer embeddings
_GEMMA4 = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
               hidden_size_per_layer_input=0, final_logit_softcapping=3.0)


def random_hf_checkpoint(family: str, path: str | Path, vocab_size: int | None = None, n_layers: int = 4,
                         tie: bool = True, seed: int = 0, **settings):
    """A tiny random transformers model of ``family`` saved to ``path`` (safetensors and config.json, no tokenizer);
    returns the model. Each family's features are on where a short prompt shows them (``settings`` override any
    config key): a sliding window of 4, alternating sliding and global layers, soft caps, a query scale other than
    sqrt(d_head), a linear-scaled global rope of its own base, partial rotary. Norm weights, biases and GPT-OSS's
    attention sinks are drawn away from their initial values, so a wrong norm offset or a missed term shows."""
    import transformers

    config_name, model_name = _HF_FAMILIES[family]
    vocab = vocab_size or len(tokenizer_metadata()["tokenizer.ggml.tokens"])
    alternating = [("sliding_attention", "full_attention")[i % 2] for i in range(n_layers)]
    options = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                   tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    options.update({
        "qwen3": dict(head_dim=16),
        "mistral": dict(sliding_window=4),
        "gemma2": dict(head_dim=16, sliding_window=4, layer_types=alternating, query_pre_attn_scalar=24,
                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3": dict(head_dim=16, sliding_window=4, layer_types=alternating, query_pre_attn_scalar=16,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}),
        "gemma4": dict(_GEMMA4, layer_types=alternating),
        "gemma4moe": dict(_GEMMA4, layer_types=alternating, enable_moe_block=True, num_experts=4, top_k_experts=2,
                          moe_intermediate_size=32),
        # the last half of the layers reuse the keys and values of the last earlier sliding and global ones
        "gemma4e": dict(_GEMMA4, layer_types=alternating, attention_k_eq_v=False, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=vocab, num_kv_shared_layers=n_layers // 2,
                        use_double_wide_mlp=True),
        # Llama 3.1's rope scaling over 64 positions: of the 8 pairs, one kept, one interpolated, the rest divided
        "llama3": dict(head_dim=16, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=64)),
        "phi3": dict(partial_rotary_factor=0.5, original_max_position_embeddings=128),
        # Phi-3.5's long-context rope: short factors below 8 positions, long ones from there on
        "phi3.5": dict(partial_rotary_factor=0.5, original_max_position_embeddings=8, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5, original_max_position_embeddings=8,
            short_factor=[1.0, 1.25, 1.5, 2.0], long_factor=[2.0, 3.0, 5.0, 8.0])),
        # every 4th layer global, its rope alone YaRN-scaled (OLMo 3's long-context rope, 8x over 16 positions)
        "olmo3": dict(sliding_window=4, rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "attention_factor": 1.2,
                               "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen2moe": dict(moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=8,
                         num_experts_per_tok=2),
        "qwen3moe": dict(head_dim=16, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=True),
        # GPT-OSS's own rope (YaRN, factor 32 over 4096 positions, unrounded ramp) and SwiGLU constants
        "gpt-oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                        layer_types=alternating, max_position_embeddings=131072),
    }.get(family, {}))
    options.update(settings)
    config = getattr(transformers, config_name)(**options)
    config._attn_implementation = "eager"  # the one that takes soft caps
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma 2/3 store w for a norm that multiplies by 1 + w
                param.normal_(0.0 if family in ("gemma2", "gemma3") else 1.0, 0.3)
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's, initially ones
                param.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif family == "gpt-oss":
                # sinks comparable to a token's score, expert biases, a SwiGLU clamp (7) that bites, router weights that
                # matter beside its bias, and embeddings large enough that tokens, not the biases, pick the experts
                if name.endswith("sinks") or name == "model.embed_tokens.weight":
                    param.normal_(0.0, 1.0)
                elif name.endswith(("_bias", "experts.gate_up_proj", "router.weight")):
                    param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, initially one
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return model
