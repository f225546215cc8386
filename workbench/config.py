"""The architecture of a loaded model, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from workbench.architectures import ARCHITECTURES, Architecture
from workbench.errors import ModelLoadError


_FEATURE_SETTINGS = ("sliding_window", "rope_base_local", "rope_scale", "d_rotary", "attn_scale", "attn_softcap",
                     "final_softcap")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a family of ``workbench.architectures``: "llama" (also SmolLM, Mistral, Llama-3), "gemma2", ...
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
    # halves of each head for the others ("neox").
    rope_interleaved: bool = True
    name: str = ""
    # The numbers a family's checkpoint sets (None: the feature is off).
    sliding_window: int | None = None  # on sliding layers, keys this many positions or more behind the query are masked
    sliding_layers: tuple[bool, ...] = ()  # per layer, whether it slides (empty: none does)
    rope_base_local: float | None = None  # the sliding layers' rope base (None: rope_base)
    rope_scale: float = 1.0  # linear rope scaling of the global layers: positions divided by it
    d_rotary: int | None = None  # values of each head the rope rotates, the first ones (None: all d_head)
    attn_scale: float | None = None  # attention scores are divided by it (None: sqrt(d_head)), as TransformerLens names it
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        """Refuse hyperparameters no forward can use (zero heads, a NaN epsilon...) here, where they are read, instead
        of as a ZeroDivisionError or NaN outputs later."""
        if not isinstance(self.sliding_layers, tuple):  # a JSON round trip (trace fingerprints) gives a list
            object.__setattr__(self, "sliding_layers", tuple(bool(s) for s in self.sliding_layers))
        where = self.name or "model"
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.type.endswith("| None"):
                continue
            if f.type.startswith("int") and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ModelLoadError(f"{where}: {f.name} must be a positive integer, got {value!r}")
            if f.type.startswith("float") and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                               or not math.isfinite(value) or value <= 0):
                raise ModelLoadError(f"{where}: {f.name} must be a positive finite number, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"{where}: {self.n_heads} attention heads do not split into {self.n_kv_heads} "
                                 "key/value groups")
        rotary = self.d_rotary or self.d_head
        if rotary % 2 or rotary > self.d_head:
            raise ModelLoadError(f"{where}: rotary embeddings need an even size of at most the head size "
                                 f"{self.d_head}, got {rotary}")
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ModelLoadError(f"{where}: {len(self.sliding_layers)} sliding-window flags for {self.n_layers} layers")

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and bool(self.sliding_layers) and self.sliding_layers[layer]

    def family(self) -> dict:
        """The family's special features (what ``workbench info`` lists) and the settings this checkpoint gives them."""
        settings = {name: getattr(self, name) for name in _FEATURE_SETTINGS if getattr(self, name) not in (None, 1.0)}
        if self.sliding_window:
            settings["sliding_layers"] = [i for i in range(self.n_layers) if self.is_sliding(i)]
        return {"name": self.architecture, "features": list(self.arch.features), **settings}

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_params(self) -> int:
        d, h = self.d_model, self.d_head
        attn = d * h * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * d * self.d_mlp
        embed = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return self.n_layers * (attn + mlp) + embed
