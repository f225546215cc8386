"""Write tests/fixtures/sae/: small random SAEs of each architecture saved by SAELens itself, with SAELens' own
encodings and outputs of fixed inputs, so that tests/test_sae.py checks the workbench's math against SAELens' without
needing it.

SAELens 6.x pins transformer-lens < 4 while the workbench runs 4.x, so run this in a throwaway venv of its own:

    python -m venv /tmp/saelens-venv
    /tmp/saelens-venv/bin/pip install sae-lens torch
    /tmp/saelens-venv/bin/python scripts/make_sae_fixtures.py

It imports nothing of the workbench.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import sae_lens
import torch
from safetensors.torch import save_file
from sae_lens.saes import (GatedSAE, GatedSAEConfig, JumpReLUSAE, JumpReLUSAEConfig, JumpReLUTranscoder,
                           JumpReLUTranscoderConfig, SkipTranscoder, SkipTranscoderConfig, StandardSAE,
                           StandardSAEConfig, TopKSAE, TopKSAEConfig, Transcoder, TranscoderConfig)
from sae_lens.saes.sae import SAEMetadata

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "sae"
D_IN, D_SAE, D_OUT, N_TOKENS = 16, 64, 12, 10
SAE_HOOK = "blocks.1.hook_resid_post"
TRANSCODER_HOOKS = ("blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out")

# name -> (SAE class, config class, config options)
CASES = {
    "standard": (StandardSAE, StandardSAEConfig, {}),
    "standard_no_b_dec_in": (StandardSAE, StandardSAEConfig, {"apply_b_dec_to_input": False}),
    "standard_constant_norm": (StandardSAE, StandardSAEConfig, {"normalize_activations": "constant_norm_rescale"}),
    "standard_layer_norm": (StandardSAE, StandardSAEConfig, {"normalize_activations": "layer_norm"}),
    "standard_expected_average": (StandardSAE, StandardSAEConfig,
                                  {"normalize_activations": "expected_average_only_in"}),
    "topk": (TopKSAE, TopKSAEConfig, {"k": 8}),
    "topk_rescaled": (TopKSAE, TopKSAEConfig, {"k": 8, "rescale_acts_by_decoder_norm": True}),
    "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig, {}),
    "gated": (GatedSAE, GatedSAEConfig, {}),
    # what SAELens' Gemma Scope loader builds from a params.npz: a JumpReLU SAE that reads the raw activation
    "gemma_scope": (JumpReLUSAE, JumpReLUSAEConfig, {"apply_b_dec_to_input": False}),
    "transcoder": (Transcoder, TranscoderConfig, {"d_out": D_OUT, "apply_b_dec_to_input": False}),
    "skip_transcoder": (SkipTranscoder, SkipTranscoderConfig, {"d_out": D_OUT, "apply_b_dec_to_input": False}),
    "jumprelu_transcoder": (JumpReLUTranscoder, JumpReLUTranscoderConfig,
                            {"d_out": D_OUT, "apply_b_dec_to_input": False}),
}


def build(name: str, sae_cls, cfg_cls, options: dict, seed: int):
    transcoder = "d_out" in options
    hook, hook_out = TRANSCODER_HOOKS if transcoder else (SAE_HOOK, None)
    metadata = SAEMetadata(hook_name=hook, model_name="tiny-random", **({"hook_name_out": hook_out} if transcoder
                                                                        else {}))
    sae = sae_cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, metadata=metadata, **options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in sae.named_parameters():
            scale = 0.3 if param.dim() == 2 else 0.2
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
            if param_name == "threshold":  # thresholds are positive: about half the features pass
                param.copy_(param.abs() * 2)
    return sae.eval()


def main() -> None:
    warnings.simplefilter("ignore")
    if FIXTURES.exists():
        shutil.rmtree(FIXTURES)
    FIXTURES.mkdir(parents=True)
    inputs = torch.randn(N_TOKENS, D_IN, generator=torch.Generator().manual_seed(1234))
    manifest = {"sae_lens_version": sae_lens.__version__, "torch_version": torch.__version__, "cases": {}}
    for seed, (name, (sae_cls, cfg_cls, options)) in enumerate(CASES.items()):
        sae = build(name, sae_cls, cfg_cls, options, seed)
        folder = FIXTURES / name
        sae.save_model(folder)
        if name == "gemma_scope":  # Gemma Scope's own layout: params.npz in a folder naming the layer
            import numpy as np

            npz_folder = FIXTURES / name / "layer_1" / "width_64" / "average_l0_30"
            npz_folder.mkdir(parents=True)
            np.savez(npz_folder / "params.npz", **{k: v.detach().numpy() for k, v in sae.state_dict().items()})
        with torch.no_grad():
            acts = sae.encode(inputs)
            decoded = sae.decode(acts)  # uses the normalization state encode left, as SAELens does
            output = sae(inputs)
        save_file({"input": inputs, "acts": acts, "decoded": decoded, "output": output},
                  str(folder / "expected.safetensors"))
        manifest["cases"][name] = {"architecture": sae.cfg.architecture(), **{k: v for k, v in options.items()}}
        print(f"{name}: {sae.cfg.architecture()}, {int((acts != 0).sum())} active of {acts.numel()}")
    (FIXTURES / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
