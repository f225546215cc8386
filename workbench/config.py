"""The architecture of a loaded model, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from workbench.architectures import ARCHITECTURES, Architecture
from workbench.errors import ModelLoadError, integer, real_number

if TYPE_CHECKING:
    from workbench.weights import ModelWeights


_FEATURE_SETTINGS = ("sliding_window", "rope_base_local", "rope_scale", "rope_yarn", "rope_long", "d_rotary", "attn_scale",
                     "attn_softcap", "final_softcap", "d_head_global", "n_kv_heads_global", "d_per_layer",
                     "kv_shared_layers")
_GATINGS = ("softmax", "sigmoid", "softmax_weight")
# The longest context whose rope tables a model builds at load (2^24 positions, past every released model's): a header
# that claims more would have the tables take terabytes.
MAX_CONTEXT = 1 << 24


def config_int(value: Any) -> int:
    """A config's integer, strictly (``errors.integer``): a string, a bool or 64.9 is refused, not coerced."""
    return integer(value, "a hyperparameter", ModelLoadError)


def config_float(value: Any) -> float:
    """A config's real number, strictly (``errors.real_number``): a string or a bool is refused, not converted; NaN
    and infinities are left to the config's own checks, which name the field."""
    return real_number(value, "a hyperparameter", ModelLoadError, finite=False)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: a router picks ``n_experts_used`` of ``n_experts`` SwiGLU experts for each token."""

    n_experts: int
    n_experts_used: int
    d_expert: int  # each expert's hidden width
    # router logits to weights: "softmax" over all experts or "sigmoid", then the top ones; "softmax_weight" (GPT-OSS):
    # the top logits, then a softmax over the chosen
    gating: str = "softmax"
    normalize_weights: bool = False  # the chosen experts' probabilities divided by their sum (Mixtral, Qwen3-MoE)
    weights_scale: float = 1.0
    d_shared_expert: int = 0  # Qwen2-MoE: a SwiGLU every token goes through, gated by sigmoid(w . x)
    # Gemma 4: the block's dense MLP runs beside the experts, each branch with its own norms; the router reads the
    # residual stream (RMS-normalized, times a learned scale) and each expert's weight has a learned scale too
    dense_mlp: bool = False
    # GPT-OSS's clamped SwiGLU: min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, +-limit) + 1)
    # (None: silu(gate) * up)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.n_experts, int) and isinstance(self.n_experts_used, int)
                and 1 <= self.n_experts_used <= self.n_experts and self.d_expert >= 1):
            raise ModelLoadError(f"a mixture of experts needs 1 to {self.n_experts} experts per token and experts of "
                                 f"a positive width, got {self.n_experts_used} of {self.n_experts} of {self.d_expert}")
        if self.gating not in _GATINGS:
            raise ModelLoadError(f"expert gating must be one of {', '.join(_GATINGS)}, got {self.gating!r}")

    def describe(self) -> str:
        """One line naming the features (``workbench info``)."""
        weights = "normalized" if self.normalize_weights else "as routed"
        scale = f" x {self.weights_scale:g}" if self.weights_scale != 1.0 else ""
        shared = f", a shared expert of {self.d_shared_expert} gated by sigmoid" if self.d_shared_expert else ""
        dense = ", beside the dense MLP" if self.dense_mlp else ""
        clamped = (f", SwiGLU clamped at {self.swiglu_limit:g} (alpha {self.swiglu_alpha:g}, up + 1)"
                   if self.swiglu_limit is not None else "")
        routing = "top-k logits then softmax" if self.gating == "softmax_weight" else self.gating
        return (f"mixture of experts: {self.n_experts} experts of {self.d_expert}, {self.n_experts_used} per token by "
                f"{routing} routing, weights {weights}{scale}{shared}{dense}{clamped}")


@dataclass(frozen=True)
class YaRN:
    """YaRN rope scaling: each frequency between interpolated (divided by ``factor``) and extrapolated (as trained)
    along a linear ramp over the rotary dimensions ``beta_fast`` and ``beta_slow`` rotations set within
    ``original_context``; cos and sin multiplied by ``attn_factor``."""

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded outward to whole dimensions (llama.cpp always; transformers may)
    attn_factor: float | None = None  # None: 0.1 ln(factor) + 1

    def __post_init__(self) -> None:
        positive = {"factor": self.factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                    **({} if self.attn_factor is None else {"attention factor": self.attn_factor})}
        for name, value in positive.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ModelLoadError(f"yarn: the {name} must be a positive finite number, got {value!r}")
        if isinstance(self.original_context, bool) or not isinstance(self.original_context, int) or (
                self.original_context < 1):
            raise ModelLoadError(f"yarn: the original context must be a positive integer, got "
                                 f"{self.original_context!r}")

    @property
    def mscale(self) -> float:
        return self.attn_factor if self.attn_factor is not None else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class LongRoPE:
    """Phi-3's long-context rope ("longrope"): frequency divisors per rotary pair, the short ones (the weights'
    ``rope_freq_factors``) for positions below ``original_context`` and the long ones (``rope_long_factors``) from
    there on; cos and sin multiplied by ``attn_factor``. Below the original context this is what transformers and
    llama.cpp (in a context no longer than that) compute; past it, what transformers' cached decoding does, each position
    rotated as it was when it was new."""

    original_context: int
    attn_factor: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.original_context, bool) or not isinstance(self.original_context, int) or (
                self.original_context < 1):
            raise ModelLoadError(f"longrope: the original context must be a positive integer, got "
                                 f"{self.original_context!r}")
        if not isinstance(self.attn_factor, (int, float)) or not math.isfinite(self.attn_factor) or (
                self.attn_factor <= 0):
            raise ModelLoadError(f"longrope: the attention factor must be a positive finite number, got "
                                 f"{self.attn_factor!r}")


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
    rope_yarn: YaRN | None = None  # YaRN rope scaling of the global table (GPT-OSS: of every layer, one table)
    rope_long: LongRoPE | None = None  # Phi-3's long-context rope (its factors are weights)
    d_rotary: int | None = None  # values of each head the rope rotates, the first ones (None: all d_head)
    attn_scale: float | None = None  # attention scores are divided by it (None: sqrt(d_head)), as TransformerLens names it
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # the global (not sliding) layers' head size and key/value heads where they differ from d_head and n_kv_heads
    # (Gemma 4)
    d_head_global: int | None = None
    n_kv_heads_global: int | None = None
    # Gemma 4 E2B/E4B: per-layer embeddings of this width added in every block, the last this many layers attending
    # over the keys and values of the last earlier layer of their kind, and each layer's MLP width where they differ
    d_per_layer: int | None = None
    kv_shared_layers: int | None = None
    d_mlp_layers: tuple[int, ...] = ()

    moe: MoEConfig | None = None  # every block's MLP is a mixture of experts

    def __post_init__(self) -> None:
        """Refuse hyperparameters no forward can use (zero heads, a NaN epsilon...) here, where they are read, instead
        of as a ZeroDivisionError or NaN outputs later."""
        if not isinstance(self.sliding_layers, tuple):  # a JSON round trip (trace fingerprints) gives a list
            object.__setattr__(self, "sliding_layers", tuple(bool(s) for s in self.sliding_layers))
        if not isinstance(self.d_mlp_layers, tuple):
            object.__setattr__(self, "d_mlp_layers", tuple(int(d) for d in self.d_mlp_layers))
        if isinstance(self.moe, dict):  # from ``to_dict`` (a trace's fingerprint)
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.rope_yarn, dict):
            object.__setattr__(self, "rope_yarn", YaRN(**self.rope_yarn))
        if isinstance(self.rope_long, dict):
            object.__setattr__(self, "rope_long", LongRoPE(**self.rope_long))
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
        if self.n_ctx > MAX_CONTEXT:
            raise ModelLoadError(f"{where}: a context of {self.n_ctx:,} positions is past the {MAX_CONTEXT:,} this "
                                 "workbench builds rope tables for")
        for n_kv in {self.n_kv_heads, self.n_kv_heads_global or self.n_kv_heads}:
            if self.n_heads % n_kv:
                raise ModelLoadError(f"{where}: {self.n_heads} attention heads do not split into {n_kv} "
                                     "key/value groups")
        d_head = min(self.d_head, self.d_head_global or self.d_head)
        rotary = self.d_rotary or d_head
        if rotary % 2 or rotary > d_head:
            raise ModelLoadError(f"{where}: rotary embeddings need an even size of at most the head size "
                                 f"{d_head}, got {rotary}")
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ModelLoadError(f"{where}: {len(self.sliding_layers)} sliding-window flags for {self.n_layers} layers")
        if self.d_mlp_layers and len(self.d_mlp_layers) != self.n_layers:
            raise ModelLoadError(f"{where}: {len(self.d_mlp_layers)} MLP widths for {self.n_layers} layers")
        if self.kv_shared_layers:
            missing = {self.is_sliding(i) for i in range(self.n_layers)} - {
                self.is_sliding(i) for i in range(self.n_layers - self.kv_shared_layers)}
            if missing:
                raise ModelLoadError(f"{where}: the last {self.kv_shared_layers} layers reuse keys and values that no "
                                     "earlier layer of their kind computes")

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and bool(self.sliding_layers) and self.sliding_layers[layer]

    def layer_heads(self, layer: int) -> tuple[int, int]:
        """``(n_kv_heads, d_head)`` of one layer: a global layer's own where the checkpoint sets them."""
        if self.is_sliding(layer):
            return self.n_kv_heads, self.d_head
        return self.n_kv_heads_global or self.n_kv_heads, self.d_head_global or self.d_head

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values ``layer`` attends over: its own, or for the last ``kv_shared_layers``, the
        last earlier layer of the same kind (sliding or global), as transformers' ``kv_sharing_modes``."""
        first_shared = self.n_layers - (self.kv_shared_layers or 0)
        if layer < first_shared:
            return layer
        return max(i for i in range(first_shared) if self.is_sliding(i) == self.is_sliding(layer))

    def layer_d_mlp(self, layer: int) -> int:
        return self.d_mlp_layers[layer] if self.d_mlp_layers else self.d_mlp

    @property
    def heads_vary(self) -> bool:
        return len({self.layer_heads(i) for i in range(self.n_layers)}) > 1

    def family(self, weights: ModelWeights) -> dict:
        """The family's special features this model has (what ``workbench info`` lists, from this config and the
        loaded ``weights``) and the settings this checkpoint gives them."""
        settings = {name: value for name in _FEATURE_SETTINGS
                    if (value := getattr(self, name)) is not None and not (name == "rope_scale" and value == 1.0)}
        for name in ("rope_yarn", "rope_long"):
            if name in settings:
                settings[name] = asdict(settings[name])
        if self.sliding_window:
            settings["sliding_layers"] = [i for i in range(self.n_layers) if self.is_sliding(i)]
        moe = [self.moe.describe()] if self.moe is not None else []
        return {"name": self.architecture, "features": self.arch.model_features(self, weights) + moe, **settings}

    def to_dict(self) -> dict:
        """The fields as JSON keeps them (lists for tuples), so a saved fingerprint compares equal."""
        return {**asdict(self), "sliding_layers": list(self.sliding_layers), "d_mlp_layers": list(self.d_mlp_layers)}

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
