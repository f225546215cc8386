"""The tensors of a llama-family model, as the runner consumes them."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator, Sequence

import torch

from workbench.kernels import QuantTensor
from workbench.moe import MoEWeights


# Stacked matrix -> the parts whose rows it holds, in order (see LayerWeights.fuse_projections).
STACKS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor | None  # float32 [d_model]; None where a family has no norm before attention (OLMo 2)
    wq: QuantTensor  # [n_heads * d_head, d_model]
    wk: QuantTensor  # [n_kv_heads * d_head, d_model]
    wv: QuantTensor
    wo: QuantTensor  # [d_model, n_heads * d_head]
    mlp_norm: torch.Tensor | None
    w_gate: QuantTensor | None  # [d_mlp, d_model]; None in an MoE block
    w_up: QuantTensor | None
    w_down: QuantTensor | None  # [d_model, d_mlp]
    bq: torch.Tensor | None = None  # Qwen2 projection biases
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # attention output bias (GPT-OSS)
    sinks: torch.Tensor | None = None  # a learned logit per head in each attention softmax [n_heads] (GPT-OSS)
    q_norm: torch.Tensor | None = None  # q/k RMSNorm weights: [d_head] per head (Qwen3, Gemma 3), or whole (OLMo 2)
    k_norm: torch.Tensor | None = None
    attn_post_norm: torch.Tensor | None = None  # norms of attention's and the MLP's outputs (Gemma 2/3, OLMo 2)
    mlp_post_norm: torch.Tensor | None = None
    moe: MoEWeights | None = None  # the experts that replace w_gate/w_up/w_down in an MoE block
    v_norm: torch.Tensor | None = None  # ones [d_head]: the value norm has no weight (Gemma 4)
    out_scale: torch.Tensor | None = None  # [1]: the block's output is multiplied by it (Gemma 4)
    # Gemma 4's MoE block: the experts' input norm, and the dense and expert branches' output norms
    experts_norm: torch.Tensor | None = None
    dense_post_norm: torch.Tensor | None = None
    experts_post_norm: torch.Tensor | None = None
    # Gemma 4 E2B/E4B's per-layer embedding input: gate [d_per_layer, d_model], projection [d_model, d_per_layer], norm
    per_layer_gate: QuantTensor | None = None
    per_layer_proj: QuantTensor | None = None
    per_layer_post_norm: torch.Tensor | None = None
    # After ``fuse_projections``: wq/wk/wv (and w_gate/w_up) as row ranges of one matrix, one matmul each.
    wqkv: QuantTensor | None = None
    w_gate_up: QuantTensor | None = None

    @property
    def values_are_keys(self) -> bool:
        """Whether the layer stored no value projection, its values being its keys' projection (compared by value:
        placing and fusing the weights make copies and views)."""
        k, v = self.wk, self.wv
        return (k is not None and v is not None and (k.fmt, k.shape) == (v.fmt, v.shape)
                and torch.equal(k.data, v.data))

    def fuse_projections(self) -> None:
        """Stack the rows of wq, wk, wv and of w_gate, w_up into one packed matrix each, the parts becoming
        views of it (no extra memory): decode then streams one larger matrix instead of several small ones,
        which keeps more of the GPU busy. Parts of different formats (Q4_K_M's Q6_K wv) stay apart."""
        for stacked, parts in STACKS.items():
            setattr(self, stacked, self._stack(parts))

    def _stack(self, names: tuple[str, ...]) -> QuantTensor | None:
        parts = [getattr(self, name) for name in names]
        if None in parts or len({(w.fmt.name, w.shape[1], w.device) for w in parts}) != 1:
            return None
        stacked = QuantTensor(torch.cat([w.data for w in parts]), parts[0].fmt,
                              (sum(w.shape[0] for w in parts), parts[0].shape[1]))
        start = 0
        for name, w in zip(names, parts):
            setattr(self, name, QuantTensor(stacked.data[start:start + w.shape[0]], w.fmt, w.shape))
            start += w.shape[0]
        return stacked

    def block_weights(self) -> tuple[QuantTensor, ...]:
        """A plain block's matrices in the order it multiplies them: wq, wk, wv, wo, w_gate, w_up, w_down."""
        return self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down

    def serving(self, name: str) -> QuantTensor:
        """The matrix the forward multiplies for the part ``name`` (its stacked matrix once fused)."""
        stacked = next((getattr(self, s) for s, parts in STACKS.items() if name in parts), None)
        return stacked if stacked is not None else getattr(self, name)


@dataclass
class ModelWeights:
    embed: QuantTensor  # [vocab, d_model]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    unembed: QuantTensor  # the same object as ``embed`` when embeddings are tied
    rope_freq_factors: torch.Tensor | None = None  # Llama-3.1 style per-frequency divisors
    # Gemma 4 E2B/E4B: the per-layer embeddings [vocab, n_layers * d_per_layer], the projection of the embedding that
    # joins them [n_layers * d_per_layer, d_model], and its norm [d_per_layer]
    per_layer_embed: QuantTensor | None = None
    per_layer_model_proj: QuantTensor | None = None
    per_layer_proj_norm: torch.Tensor | None = None
    rope_long_factors: torch.Tensor | None = None  # Phi-3's long-context divisors (config.rope_long)

    def named_matrices(self, served: bool = False) -> Iterator[tuple[str, QuantTensor]]:
        """Every quantized matrix of the checkpoint with a readable name, each shared one once (fused
        projections appear as their parts; with ``served``, each part as the stacked matrix that the
        forward multiplies for it)."""
        yield "embed", self.embed
        for name in ("per_layer_embed", "per_layer_model_proj"):
            if getattr(self, name) is not None:
                yield name, getattr(self, name)
        for i, layer in enumerate(self.layers):
            for f in fields(layer):
                value = getattr(layer, f.name)
                if isinstance(value, QuantTensor) and f.name not in STACKS:
                    yield f"blocks.{i}.{f.name}", layer.serving(f.name) if served else value
            if layer.moe is not None:
                for name, w in layer.moe.matrices():
                    yield f"blocks.{i}.moe.{name}", w
        if self.unembed is not self.embed:
            yield "unembed", self.unembed

    def placed(self, layer_devices: Sequence[torch.device], dtype: torch.dtype) -> "ModelWeights":
        """A copy with each layer's tensors on its device (``layer_devices``, one per layer), the embedding on the
        first layer's, the final norm and an untied unembedding on the last layer's, and the float vectors in
        ``dtype`` (unfused: moving a stacked matrix and its parts apart would not keep the parts views of it)."""

        def place(value, device: torch.device):
            if isinstance(value, QuantTensor):
                return value.to(device)
            if isinstance(value, torch.Tensor):
                return value.to(device, dtype)
            if isinstance(value, MoEWeights):
                return value.map(lambda w: w.to(device), lambda v: v.to(device))
            return value

        layers = [LayerWeights(**{f.name: place(getattr(l, f.name), device) for f in fields(l) if f.name not in STACKS})
                  for l, device in zip(self.layers, layer_devices)]
        first, last = layer_devices[0], layer_devices[-1]
        embed = self.embed.to(first)
        unembed = embed if self.unembed is self.embed else self.unembed.to(last)
        return ModelWeights(embed, layers, place(self.final_norm, last), unembed, place(self.rope_freq_factors, first),
                            place(self.per_layer_embed, first), place(self.per_layer_model_proj, first),
                            place(self.per_layer_proj_norm, first), place(self.rope_long_factors, first))

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
