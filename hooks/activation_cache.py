"""Traces as ``transformer_lens.ActivationCache``, so TransformerLens utilities run on our activations.

The conversion adds the batch dimension of 1 TransformerLens expects; every activation is passed as recorded, under
the same name, since each hook point already holds TransformerLens' value (``*.hook_scale`` the divisor
``sqrt(mean(x^2) + eps)``, ``attn.hook_q``/``hook_k`` in Hugging Face's per-head order).

The cache's ``model`` is a stand-in that follows TransformerLens' folded-LayerNorm convention
(``fold_ln=True``): ``cfg.normalization_type`` is "RMSPre", ``ln_final`` normalizes without a weight and
``W_U`` is the unembedding with the final norm weight folded in, so ``ln_final(resid) @ W_U`` gives the
logits (before the final soft cap of Gemma 2 and 4, as TransformerLens leaves ``logit_attrs`` linear). With the
workbench Model it also has each block's ``attn.W_O`` and ``mlp.W_out`` (dequantized on first use).

Tested: indexing by full name or shorthand (``cache["resid_pre", 3]``), ``stack_activation``,
``accumulated_resid`` (``apply_ln`` included), ``decompose_resid``, ``apply_ln_to_stack``,
``stack_head_results`` (from a recorded ``hook_result``, or from ``hook_z`` and ``W_O``), ``logit_attrs``,
``remove_batch_dim``. Without the model only the weight-free ones work. Not supported:
``get_full_resid_decomposition`` (needs ``accumulated_bias``) and helpers that re-run the model; ``decompose_resid``
is refused where the stream is no sum of the embedding and the blocks' outputs (Gemma 4 scales each block's output,
and its E2B/E4B layout adds per-layer inputs).
"""
from __future__ import annotations

import functools
from functools import cached_property
from typing import Any

import torch

from workbench.architectures import LAYER_TENSORS
from workbench.config import ModelConfig
from workbench.errors import WorkbenchError


class _Attention:
    def __init__(self, layer_weights, config: ModelConfig):
        self._wo, self._config = layer_weights.wo, config

    @cached_property
    def W_O(self) -> torch.Tensor:  # [n_heads, d_head, d_model]
        c = self._config
        return self._wo.dequantize(torch.float32).cpu().T.reshape(c.n_heads, -1, c.d_model)  # a layer's own d_head


class _MLP:
    def __init__(self, layer_weights):
        self._w_down = layer_weights.w_down

    @cached_property
    def W_out(self) -> torch.Tensor:  # [d_mlp, d_model]
        if self._w_down is None:
            raise WorkbenchError("a mixture-of-experts block has no single W_out (its experts' outputs are recorded at "
                                 "mlp.hook_expert_out)")
        return self._w_down.dequantize(torch.float32).cpu().T


class _Block:
    def __init__(self, layer_weights, config: ModelConfig):
        self.attn, self.mlp = _Attention(layer_weights, config), _MLP(layer_weights)


class ModelView:
    """What ActivationCache asks of a model: ``cfg``, and with weights ``blocks``, ``W_U``, ``ln_final``."""

    def __init__(self, config: ModelConfig, model: Any = None):
        c = config
        settings = dict(
            d_model=c.d_model, d_head=c.d_head, n_layers=c.n_layers, n_ctx=c.n_ctx, n_heads=c.n_heads, d_mlp=c.d_mlp,
            d_vocab=c.vocab_size, device="cpu", positional_embedding_type="rotary", n_key_value_heads=c.n_kv_heads,
            normalization_type="RMSPre", final_rms=True, eps=c.rms_eps, act_fn="silu", gated_mlp=True,
        )
        try:  # TransformerLens 3 and later
            from transformer_lens.config import TransformerLensConfig

            self.cfg = TransformerLensConfig(**settings, uses_rms_norm=True)
        except ImportError:  # TransformerLens 2
            from transformer_lens import HookedTransformerConfig

            self.cfg = HookedTransformerConfig(**settings)
        self._config, self._model, self.architecture = config, model, config.architecture
        if model is not None:
            layers = model.runner.weights.layers
            self.blocks = [_Block(layer, config) for layer in layers]
            self.additive_stream = all(layer.out_scale is None and layer.per_layer_gate is None for layer in layers)
        else:  # the family alone says whether its blocks may scale their output: its folders name such a tensor
            self.additive_stream = (config.d_per_layer is None
                                    and LAYER_TENSORS["out_scale"] not in config.arch.hf_tensors.values())

    def ln_final(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm without its weight (folded into ``W_U``)."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._config.rms_eps)

    @cached_property
    def W_U(self) -> torch.Tensor:  # [d_model, vocab], final norm weight folded in
        weights = self._require_model().runner.weights
        return weights.final_norm.float().cpu()[:, None] * weights.unembed.dequantize(torch.float32).cpu().T

    def tokens_to_residual_directions(self, tokens: int | str | torch.Tensor) -> torch.Tensor:
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, torch.Tensor) and tokens.dim() > 0:
            return self.W_U[:, tokens].movedim(0, -1)
        return self.W_U[:, int(tokens)]

    def to_single_token(self, text: str) -> int:
        ids = self._require_model().tokenize(text, add_bos=False)
        if len(ids) != 1:
            raise WorkbenchError(f"{text!r} is {len(ids)} tokens, not one")
        return ids[0]

    def _require_model(self):
        if self._model is None:
            raise WorkbenchError("this needs the model's weights: call trace.to_activation_cache(model)")
        return self._model


@functools.cache
def _cache_class() -> type:
    """TransformerLens' ActivationCache (imported on first use), refusing a decomposition that would not add up."""
    from transformer_lens import ActivationCache

    class SummedStreamCache(ActivationCache):
        def decompose_resid(self, *args: Any, **kwargs: Any):
            if not self.model.additive_stream:
                raise WorkbenchError(f"decompose_resid splits the residual stream into the embedding and each block's "
                                     f"attention and MLP outputs; {self.model.architecture} scales each block's output "
                                     f"or adds per-layer inputs, so they do not add up to the stream")
            return super().decompose_resid(*args, **kwargs)

    return SummedStreamCache


def to_activation_cache(trace: Any, model: Any = None):
    """A ``transformer_lens.ActivationCache`` (batch dim 1) of the trace's recorded activations."""
    from .trace import model_mismatch

    if not trace.activations:
        raise WorkbenchError("the trace recorded no activations (run with record=[...])")
    if trace.reduce is not None:
        raise WorkbenchError(f"the trace kept one row per point (reduce={trace.reduce!r}); an ActivationCache holds "
                             "every position's: record without reduce")
    if model is not None:
        mismatch = model_mismatch(trace.fingerprint, model)
        if mismatch:
            raise WorkbenchError(f"the trace was recorded on another model: {mismatch}")
        config = model.config
    else:
        config = ModelConfig(**trace.fingerprint["config"])
    cache = {name: t.unsqueeze(0) for name, t in trace.activations.items()}
    return _cache_class()(cache, ModelView(config, model), has_batch_dim=True)
