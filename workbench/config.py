"""The architecture of a loaded model, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_params(self) -> int:
        d, h = self.d_model, self.d_head
        attn = d * h * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * d * self.d_mlp
        embed = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return self.n_layers * (attn + mlp) + embed
