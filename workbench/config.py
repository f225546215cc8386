"""The architecture of a loaded model, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from workbench.errors import ModelLoadError


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

    def __post_init__(self):
        """Refuse hyperparameters no forward can use (zero heads, a NaN epsilon...) here, where they are read, instead
        of as a ZeroDivisionError or NaN outputs later."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ModelLoadError(f"{self.name or 'model'}: {f.name} must be a positive integer, got {value!r}")
            if f.type == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value) or value <= 0):
                raise ModelLoadError(f"{self.name or 'model'}: {f.name} must be a positive finite number, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"{self.name or 'model'}: {self.n_heads} attention heads do not split into "
                                 f"{self.n_kv_heads} key/value groups")
        if self.d_head % 2:
            raise ModelLoadError(f"{self.name or 'model'}: rotary embeddings need an even head size, got {self.d_head}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_params(self) -> int:
        d, h = self.d_model, self.d_head
        attn = d * h * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * d * self.d_mlp
        embed = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return self.n_layers * (attn + mlp) + embed
