"""Lenses, attribution and probes: turn traces into answers.

- ``logit_lens`` (``logit_lens_batch`` for many prompts): every layer's residual read through the final norm and
  unembedding
  (``train_tuned_lens``: per-layer affine translators for a tuned lens).
- ``direct_logit_attribution`` (``_batch`` for many prompts): the logit split over embedding, attention heads and
  MLPs.
- ``depth_sweep`` / ``probe_at_depth_fraction`` / ``train_probe``: linear probes across depth.
- ``steering_vector`` / ``steering_sweep``: contrastive directions, applied with ``hooks.Steer``;
  llama.cpp control-vector GGUF export and import.
- ``compare_models``: base against a LoRA adapter on the same prompts (residual differences, lens of the difference,
  KL, attribution of the change, the "adapter minus base" steering vector).
- ``load_dataset`` / ``list_datasets``: the labelled prompt sets of ``workbench.datasets`` or your own JSONL.
"""
from .activations import collect_activations
from .data import Dataset, list_datasets, load_dataset, make_dataset, pairs_dataset
from .dla import Attribution, direct_logit_attribution, direct_logit_attribution_batch
from .model_diff import ModelDiff, compare_models
from .lens import LogitLens, TokenTrack, logit_lens, logit_lens_batch
from .probing import (DepthSweep, Probe, depth_sweep, layer_at_fraction, probe_at_depth_fraction, train_probe,
                      wilson_interval)
from .steering import SteeringSweep, SteeringVector, steering_sweep, steering_vector
from .tuned_lens import TunedLens, train_tuned_lens

__all__ = [
    "logit_lens", "logit_lens_batch", "LogitLens", "TokenTrack", "train_tuned_lens", "TunedLens",
    "direct_logit_attribution", "direct_logit_attribution_batch", "Attribution",
    "collect_activations", "train_probe", "probe_at_depth_fraction", "depth_sweep", "layer_at_fraction",
    "wilson_interval", "Probe", "DepthSweep",
    "steering_vector", "steering_sweep", "SteeringVector", "SteeringSweep",
    "load_dataset", "list_datasets", "make_dataset", "pairs_dataset", "Dataset", "compare_models", "ModelDiff",
]
