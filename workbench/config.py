"""The architecture of a loaded model, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: a router picks ``n_experts_used`` of ``n_experts`` SwiGLU experts for each token."""

    n_experts: int
    n_experts_used: int
    d_expert: int  # each expert's hidden width
    gating: str = "softmax"  # router logits to probabilities: "softmax" over all experts, or "sigmoid"
    normalize_weights: bool = False  # the chosen experts' probabilities divided by their sum (Mixtral, Qwen3-MoE)
    weights_scale: float = 1.0
    d_shared_expert: int = 0  # Qwen2-MoE: a SwiGLU every token goes through, gated by sigmoid(w . x)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" (also SmolLM, Mistral, Llama-3), "qwen2", "qwen3"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    vocab_size: int
    n_ctx: int
    rope_base: float
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # llama.cpp rotates adjacent pairs for llama (its converter permutes Q/K rows to match) and the two
    # halves of each head for Qwen ("neox").
    rope_interleaved: bool = True
    name: str = ""
    moe: MoEConfig | None = None  # every block's MLP is a mixture of experts

    def __post_init__(self):
        if isinstance(self.moe, dict):  # from ``to_dict`` (a trace's fingerprint)
            object.__setattr__(self, "moe", MoEConfig(**self.moe))

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_params(self) -> int:
        d, h = self.d_model, self.d_head
        attn = d * h * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * d * self.d_mlp
        if self.moe is not None:
            m = self.moe
            mlp = d * m.n_experts + 3 * d * m.d_expert * m.n_experts + (3 * d * m.d_shared_expert + d
                                                                         if m.d_shared_expert else 0)
        embed = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return self.n_layers * (attn + mlp) + embed
