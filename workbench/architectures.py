"""Each supported model family as a small declarative description: what its blocks do differently from llama's, and
how GGUF files and Hugging Face folders name its tensors and settings.

The forward (``workbench.runner``) reads these flags at the few places a block differs; the numbers each checkpoint
sets (sliding window, soft caps, rope bases) live in ``ModelConfig``. A new family is a new entry of
``ARCHITECTURES`` plus, where it computes something new, one branch in the forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Union

if TYPE_CHECKING:
    from workbench.config import ModelConfig
    from workbench.weights import ModelWeights

# What ``workbench info`` lists as a family's special: a string every model of the family has, or (text, whether the
# loaded model has it, from its config and weights).
Feature = Union[str, "tuple[str, Callable[[ModelConfig, ModelWeights], bool]]"]

# GGUF tensor name suffix (``blk.{i}.`` + suffix) of each LayerWeights field; the fused tensors a family may store in
# their place are named by ``Architecture.fused``.
LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "bo": "attn_output.bias",
    "sinks": "attn_sinks.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "attn_post_norm": "post_attention_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    "mlp_post_norm": "post_ffw_norm.weight",
    "out_scale": "layer_output_scale.weight",
    # Gemma 4's MoE blocks: the experts' own input norm and the two branches' output norms
    "experts_norm": "pre_ffw_norm_2.weight",
    "dense_post_norm": "post_ffw_norm_1.weight",
    "experts_post_norm": "post_ffw_norm_2.weight",
    # Gemma 4 E2B/E4B's per-layer embeddings: the gate from the stream, the projection back, its norm
    "per_layer_gate": "inp_gate.weight",
    "per_layer_proj": "proj.weight",
    "per_layer_post_norm": "post_norm.weight",
}
GLOBAL_TENSORS: dict[str, str] = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "unembed": "output.weight",
    "rope_freq_factors": "rope_freqs.weight",
    "rope_short_factors": "rope_factors_short.weight",  # Phi-3's long-context rope, as the converter stores it
    "rope_long_factors": "rope_factors_long.weight",
    "per_layer_embed": "per_layer_token_embd.weight",
    "per_layer_model_proj": "per_layer_model_proj.weight",
    "per_layer_proj_norm": "per_layer_proj_norm.weight",
}

# Hugging Face layer tensor suffix (after ``model.layers.{i}.``) -> GGUF suffix, as llama.cpp's converter maps them.
HF_LAYER_TENSORS: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HF_GLOBAL_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}

# Post-norm families name the norm after attention "post_attention_layernorm", which llama's map takes for the norm
# before the MLP.
_POST_NORM_HF = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


@dataclass(frozen=True)
class Architecture:
    """What one family computes differently from llama, and where its files keep it.

    Every flag's default is llama's, and a flag that is off costs the forward nothing.
    """

    name: str  # GGUF ``general.architecture``
    hf_classes: tuple[str, ...]  # transformers' ``architectures`` entries loaded as this family
    # llama.cpp rotates adjacent pairs where its converter permuted the Q/K rows (llama), else the two halves of each
    # head ("neox")
    rope_interleaved: bool = False
    qkv_bias: bool = False
    out_bias: bool = False  # a bias on attention's output projection
    attn_sinks: bool = False  # a learned logit per head in each attention row's softmax (GPT-OSS)
    qk_norm: str | None = None  # RMSNorm of queries and keys: "head" over each head, "projection" over all heads
    pre_norms: bool = True  # RMSNorm of the residual stream before attention and the MLP (OLMo 2 has none)
    post_norms: bool = False  # RMSNorm of attention's and the MLP's outputs before they join the residual stream
    # the norm multiplies by (norm_offset + w): Gemma's Hugging Face weights store w - 1 (llama.cpp's converter adds 1)
    norm_offset: float = 0.0
    embed_scale: bool = False  # embeddings times sqrt(d_model)
    activation: str = "silu"  # of the MLP's gate: "silu" or "gelu_tanh"
    # the config.json key transformers' MLP reads its activation from (None: the family's is fixed, GPT-OSS's)
    hf_activation_key: str | None = "hidden_act"
    # tensors stored fused in the GGUF: its name -> the LayerWeights fields whose rows it stacks, in order
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Hugging Face tensor names that differ from llama's (suffix after ``model.layers.{i}.`` -> GGUF suffix)
    hf_tensors: Mapping[str, str] = field(default_factory=dict)
    # GGUF names that differ from LAYER_TENSORS: LayerWeights field -> suffix
    gguf_tensors: Mapping[str, str] = field(default_factory=dict)
    # Mixture of experts: the MoEConfig settings llama.cpp fixes for the family rather than reading them from the GGUF,
    # whether its router and experts have biases, and how its Hugging Face folder stores the experts ("split": gate and
    # up apart or stacked halves, [out, in]; "interleaved": [in, out] with gate and up in alternate columns)
    moe: Mapping[str, object] = field(default_factory=dict)
    moe_biases: bool = False
    hf_expert_layout: str = "split"
    # Sliding windows in llama.cpp: the layout when the GGUF names none (every n-th layer global; 0: all slide), the
    # window when it names none, whether llama.cpp honours the GGUF's window at all (it disables Phi-3's), and the
    # sliding layers' rope base when the GGUF names none (None: the global one)
    swa_period: int = 0
    default_window: int | None = None
    gguf_window: bool = True
    local_rope_base: float | None = None
    # whether, with a sliding window, llama.cpp rotates the sliding layers at the GGUF's swa base or else the global
    # one, without the global rope's scaling (OLMo 3's, written as olmo2)
    unscaled_local_rope: bool = False
    # the soft caps the family applies, by their config.json and GGUF key ("attn_logit_softcapping",
    # "final_logit_softcapping"; transformers and llama.cpp ignore the others), with llama.cpp's cap where a GGUF names
    # none (None: no cap)
    softcaps: Mapping[str, float | None] = field(default_factory=dict)
    # Sliding windows in transformers: whether only a config.json that says ``use_sliding_window`` has one (Qwen), and
    # which layers slide where it names no ``layer_types`` (Gemma 2's and Gemma 3's on the Hub): "all", "period" (every
    # swa_period-th layer global, or every ``sliding_window_pattern``-th), "from_max_window_layers" or
    # "even_below_max_window_layers"
    hf_sliding_switch: bool = False
    hf_sliding: str = "all"
    # llama.cpp scales queries by 1/sqrt(d_model / n_heads) instead of 1/sqrt(d_head) for a model of this depth (Gemma's
    # 27B, after gemma_pytorch)
    wide_query_scale_layers: int | None = None
    # the divisor of attention scores whatever the head size (Gemma 4: 1, its q/k norms set the scale)
    attn_scale: float | None = None
    v_norm: bool = False  # RMSNorm without a weight over each value head (Gemma 4)
    # a layer may store no value projection: its values are its keys' projection (Gemma 4's global layers)
    values_from_keys: bool = False
    features: tuple[Feature, ...] = ()  # what ``workbench info`` lists as special

    def model_features(self, config: ModelConfig, weights: ModelWeights) -> list[str]:
        """The features a loaded model of the family has."""
        return [f if isinstance(f, str) else f[0] for f in self.features if isinstance(f, str) or f[1](config, weights)]

    @property
    def hf_layer_tensors(self) -> dict[str, str]:
        return {**HF_LAYER_TENSORS, **self.hf_tensors}

    @property
    def layer_tensors(self) -> dict[str, str]:
        return {**LAYER_TENSORS, **self.gguf_tensors}

    def gguf_attn_scale(self, n_layers: int, d_model: int, n_heads: int) -> float | None:
        """The divisor of attention scores llama.cpp uses (None: sqrt(d_head))."""
        if self.attn_scale is not None:
            return self.attn_scale
        return math.sqrt(d_model / n_heads) if n_layers == self.wide_query_scale_layers else None

    def config_flags(self) -> dict[str, bool]:
        """The ModelConfig fields this family fixes."""
        return dict(qkv_bias=self.qkv_bias, qk_norm=self.qk_norm is not None, rope_interleaved=self.rope_interleaved)


def _sliding(c: ModelConfig, w: ModelWeights) -> bool:
    return any(c.is_sliding(i) for i in range(c.n_layers))


def _has(name: str) -> Callable[[ModelConfig, ModelWeights], bool]:
    """Whether the checkpoint sets ModelConfig field ``name`` (to other than None)."""
    return lambda c, w: getattr(c, name) is not None


def _rope_factors(c: ModelConfig, w: ModelWeights) -> bool:
    return w.rope_freq_factors is not None


_SLIDING = ("sliding-window and global layers", _sliding)
_FINAL_SOFTCAP = ("final-logit soft-capping", _has("final_softcap"))
_GEMMA_FEATURES = ("(1+w) RMSNorm", "norms after attention and MLP", "embeddings x sqrt(d_model)", "GeGLU (tanh GELU)",
                   ("query pre-attention scale", _has("attn_scale")), _SLIDING,
                   ("attention-logit soft-capping", _has("attn_softcap")), _FINAL_SOFTCAP)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"), rope_interleaved=True,
                 features=(("sliding window (Mistral)", _has("sliding_window")),
                           ("rope frequency factors", _rope_factors))),
    Architecture("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, hf_sliding_switch=True,
                 hf_sliding="from_max_window_layers", features=("q/k/v biases",)),
    Architecture("qwen3", ("Qwen3ForCausalLM",), qk_norm="head", hf_sliding_switch=True,
                 hf_sliding="from_max_window_layers", features=("per-head q/k RMSNorm",)),
    # their mixture of experts is in ModelConfig.moe (workbench.moe), which ``workbench info`` describes
    Architecture("qwen2moe", ("Qwen2MoeForCausalLM",), qkv_bias=True, hf_sliding_switch=True,
                 hf_sliding="even_below_max_window_layers", features=("q/k/v biases",)),
    Architecture("qwen3moe", ("Qwen3MoeForCausalLM",), qk_norm="head", hf_sliding_switch=True,
                 features=("per-head q/k RMSNorm",)),
    Architecture("gemma2", ("Gemma2ForCausalLM",), post_norms=True, norm_offset=1.0, embed_scale=True,
                 activation="gelu_tanh", hf_activation_key="hidden_activation", hf_tensors=_POST_NORM_HF,
                 swa_period=2, hf_sliding="period", default_window=4096, wide_query_scale_layers=46,
                 softcaps={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                 features=_GEMMA_FEATURES),
    Architecture("gemma3", ("Gemma3ForCausalLM",), qk_norm="head", post_norms=True, norm_offset=1.0,
                 embed_scale=True, activation="gelu_tanh", hf_activation_key="hidden_activation",
                 hf_tensors=_POST_NORM_HF, swa_period=6, hf_sliding="period", local_rope_base=10000.0,
                 softcaps={"final_logit_softcapping": None},
                 wide_query_scale_layers=62,
                 features=_GEMMA_FEATURES + ("per-head q/k RMSNorm", ("local and global rope bases",
                                                                         _has("rope_base_local")))),
    # norms multiply by w (no offset); global layers have heads of their own size and count, a "proportional" rope
    # (llama.cpp's rope_freqs) and may take values from the keys' projection; the 26B-A4B's experts run beside the
    # dense MLP (ModelConfig.moe)
    Architecture("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), qk_norm="head",
                 post_norms=True, embed_scale=True, activation="gelu_tanh", hf_activation_key="hidden_activation",
                 attn_scale=1.0, v_norm=True, values_from_keys=True, softcaps={"final_logit_softcapping": 30.0},
                 hf_tensors={**_POST_NORM_HF, "layer_scalar": "layer_output_scale.weight",
                             "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
                             "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
                             "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
                             "per_layer_input_gate.weight": "inp_gate.weight",
                             "per_layer_projection.weight": "proj.weight",
                             "post_per_layer_input_norm.weight": "post_norm.weight"},
                 features=("norms after attention and MLP", "embeddings x sqrt(d_model)", "GeGLU (tanh GELU)",
                           "per-head q/k RMSNorm and value RMSNorm, attention scale 1", _SLIDING,
                           ("global layers with their own head size or key/value heads",
                            lambda c, w: c.d_head_global is not None or c.n_kv_heads_global is not None),
                           ("local and global rope bases", _has("rope_base_local")),
                           ("proportional (partial) rope on global layers", _rope_factors),
                           ("values from the key projection", lambda c, w: any(layer.values_are_keys
                                                                               for layer in w.layers)),
                           ("per-layer output scale", lambda c, w: any(layer.out_scale is not None
                                                                       for layer in w.layers)),
                           ("per-layer embeddings", _has("d_per_layer")),
                           ("layers reusing an earlier layer's keys and values", _has("kv_shared_layers")),
                           _FINAL_SOFTCAP)),
    Architecture("phi3", ("Phi3ForCausalLM",), gguf_window=False,
                 fused={"attn_qkv.weight": ("wq", "wk", "wv"), "ffn_up.weight": ("w_gate", "w_up")},
                 hf_tensors={"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
                 features=("fused qkv and gate/up matrices", ("partial rotary", _has("d_rotary")),
                           ("long-context rope (LongRoPE)", _has("rope_long")))),
    # llama.cpp's "openai-moe": the norm before the MLP is stored as post_attention_norm; routing, the clamped SwiGLU
    # and its constants are fixed in llama.cpp's graph (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT, swiglu_oai)
    Architecture("gpt-oss", ("GptOssForCausalLM",), qkv_bias=True, out_bias=True, attn_sinks=True, swa_period=2,
                 hf_sliding="period", hf_activation_key=None,
                 hf_tensors={"post_attention_layernorm.weight": "post_attention_norm.weight"},
                 gguf_tensors={"mlp_norm": "post_attention_norm.weight"},
                 moe=dict(gating="softmax_weight", normalize_weights=False, swiglu_limit=7.0, swiglu_alpha=1.702),
                 moe_biases=True, hf_expert_layout="interleaved",
                 features=("q/k/v and output biases", "attention sinks", _SLIDING, ("YaRN rope", _has("rope_yarn")))),
    # OLMo 3 adds sliding layers (every 4th global) whose rope is unscaled
    Architecture("olmo2", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), qk_norm="projection", pre_norms=False,
                 post_norms=True, swa_period=4, hf_sliding="period", unscaled_local_rope=True,
                 hf_tensors={"post_attention_layernorm.weight": "post_attention_norm.weight",
                             "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
                 features=("norms after attention and MLP only", "q/k RMSNorm over the whole projection", _SLIDING)),
)}
# The config.json values transformers' config classes assume where the file names none, where they differ from the
# loader's own assumptions (rope_theta 10000, rms_norm_eps 1e-6, head_dim hidden_size / heads, no sliding window or soft
# caps, a query scale of sqrt(head_dim)): a config.json trimmed to what differs loads as transformers builds it.
HF_DEFAULTS: dict[str, dict[str, object]] = {
    "MistralForCausalLM": {"sliding_window": 4096},
    "MixtralForCausalLM": {"rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "Gemma2ForCausalLM": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1e6,
                          "rope_local_base_freq": 10000.0},
    "Phi3ForCausalLM": {"rms_norm_eps": 1e-5},
    "Olmo2ForCausalLM": {"rms_norm_eps": 1e-5},
    "Olmo3ForCausalLM": {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "sliding_window": 4096},
    # (rope settings under rope_scaling, which a file's rope_parameters or rope_scaling replace)
    "GptOssForCausalLM": {"head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128,
                          "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 4096}},
}
# transformers' names (ACT2FN) of each MLP activation
HF_ACTIVATIONS: dict[str, tuple[str, ...]] = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_new")}
HF_CLASSES: dict[str, str] = {cls: a.name for a in ARCHITECTURES.values() for cls in a.hf_classes}


def architecture(name: str) -> Architecture:
    return ARCHITECTURES[name]
