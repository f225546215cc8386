"""The tensors of a llama-family model, as the runner consumes them."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator

import torch

from workbench.kernels import QuantTensor


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # float32 [d_model]
    wq: QuantTensor  # [n_heads * d_head, d_model]
    wk: QuantTensor  # [n_kv_heads * d_head, d_model]
    wv: QuantTensor
    wo: QuantTensor  # [d_model, n_heads * d_head]
    mlp_norm: torch.Tensor
    w_gate: QuantTensor  # [d_mlp, d_model]
    w_up: QuantTensor
    w_down: QuantTensor  # [d_model, d_mlp]
    bq: torch.Tensor | None = None  # Qwen2 projection biases
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3 per-head RMSNorm weights [d_head]
    k_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: QuantTensor  # [vocab, d_model]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    unembed: QuantTensor  # the same object as ``embed`` when embeddings are tied
    rope_freq_factors: torch.Tensor | None = None  # Llama-3.1 style per-frequency divisors

    def named_matrices(self) -> Iterator[tuple[str, QuantTensor]]:
        """Every quantized matrix with a readable name, each shared one once."""
        yield "embed", self.embed
        for i, layer in enumerate(self.layers):
            for f in fields(layer):
                value = getattr(layer, f.name)
                if isinstance(value, QuantTensor):
                    yield f"blocks.{i}.{f.name}", value
        if self.unembed is not self.embed:
            yield "unembed", self.unembed

    def map(self, fn_matrix, fn_vector) -> "ModelWeights":
        """A copy with ``fn_matrix`` applied to every QuantTensor and ``fn_vector`` to every float tensor."""

        def convert(value):
            if isinstance(value, QuantTensor):
                return fn_matrix(value)
            if isinstance(value, torch.Tensor):
                return fn_vector(value)
            return value

        layers = [LayerWeights(**{f.name: convert(getattr(l, f.name)) for f in fields(l)}) for l in self.layers]
        embed = fn_matrix(self.embed)
        unembed = embed if self.unembed is self.embed else fn_matrix(self.unembed)
        return ModelWeights(embed, layers, convert(self.final_norm), unembed, convert(self.rope_freq_factors))

    @property
    def nbytes(self) -> int:
        matrices = sum(w.nbytes for _, w in self.named_matrices())
        vectors = self.final_norm.numel() * self.final_norm.element_size()
        for layer in self.layers:
            for f in fields(layer):
                value = getattr(layer, f.name)
                if isinstance(value, torch.Tensor):
                    vectors += value.numel() * value.element_size()
        return matrices + vectors
