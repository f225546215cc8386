"""Lenses, attribution and probes: turn traces into answers.

- ``logit_lens`` (``logit_lens_batch`` for many prompts): every layer's residual read through the final norm and
  unembedding
  (``train_tuned_lens``: per-layer affine translators for a tuned lens).
- ``direct_logit_attribution`` (``_batch`` for many prompts): the logit split over embedding, attention heads and
  MLPs.
- ``depth_sweep`` / ``probe_at_depth_fraction`` / ``train_probe``: linear probes across depth (``fit_probe`` fits one
  on activations collected elsewhere, ``distributed.collect_activations``, with the model's ``model_signature``).
- ``steering_vector`` / ``steering_sweep``: contrastive directions, applied with ``hooks.Steer``;
  llama.cpp control-vector GGUF export and import.
- ``load_sae`` (SAELens folders, Gemma Scope params.npz), ``train_sae`` / ``evaluate_sae``, ``feature_stats``,
  ``promoted_tokens``, ``top_features``, ``feature_attribution``: sparse autoencoders and transcoders (docs/saes.md).
- ``compare_models``: base against a LoRA adapter on the same prompts (residual differences, lens of the difference,
  KL, attribution of the change, the "adapter minus base" steering vector).
- ``load_dataset`` / ``list_datasets``: the labelled prompt sets of ``workbench.datasets`` or your own JSONL.
"""
from .activations import collect_activations
from .data import Dataset, list_datasets, load_dataset, make_dataset, pairs_dataset
from .dla import Attribution, direct_logit_attribution, direct_logit_attribution_batch
from .model_diff import ModelDiff, compare_models
from .lens import LogitLens, TokenTrack, logit_lens, logit_lens_batch
from .probing import (DepthSweep, Probe, depth_sweep, fit_probe, layer_at_fraction, probe_at_depth_fraction,
                      train_probe, wilson_interval)
from .sae import (SAE, FeatureAblate, FeatureClamp, FeatureSteer, load_sae, register_sae, registered_saes,
                  resolve_sae, sae_paths_within)
from .sae_analysis import (FeatureAttribution, FeatureStats, feature_attribution, feature_stats, promoted_tokens,
                           top_features)
from .saving import model_signature
from .sae_train import (TrainResult, evaluate_sae, generated_corpus, init_sae, python_docs_corpus, train_sae)
from .steering import SteeringSweep, SteeringVector, steering_sweep, steering_vector
from .tuned_lens import TunedLens, train_tuned_lens

__all__ = [
    "logit_lens", "logit_lens_batch", "LogitLens", "TokenTrack", "train_tuned_lens", "TunedLens",
    "direct_logit_attribution", "direct_logit_attribution_batch", "Attribution",
    "collect_activations", "fit_probe", "model_signature", "train_probe", "probe_at_depth_fraction", "depth_sweep",
    "layer_at_fraction",
    "wilson_interval", "Probe", "DepthSweep",
    "steering_vector", "steering_sweep", "SteeringVector", "SteeringSweep",
    "load_dataset", "list_datasets", "make_dataset", "pairs_dataset", "Dataset", "compare_models", "ModelDiff",
    "SAE", "load_sae", "register_sae", "registered_saes", "resolve_sae", "sae_paths_within",
    "FeatureSteer", "FeatureAblate", "FeatureClamp",
    "train_sae", "evaluate_sae", "init_sae", "python_docs_corpus", "generated_corpus", "TrainResult",
    "feature_stats", "FeatureStats", "promoted_tokens", "top_features", "feature_attribution", "FeatureAttribution",
]
