"""TransformerLens names with TransformerLens meanings: every hook point against TransformerLens 4.3's
TransformerBridge over the same tiny random transformers checkpoint, value by value, and edits at the points whose
order or meaning we convert (q/k per-head order, the norm's divisor) acting as they do in TransformerLens."""
from __future__ import annotations

import pytest
import torch

import workbench
from workbench.synthetic import random_hf_checkpoint

from test_loading import write_hf_tokenizer

IDS = [5, 77, 120, 3, 250, 9, 14, 200]
# Points TransformerLens' bridge does not have: per-head results unless asked for, the logits (the model's output),
# and Phi-3's rotated q/k (its bridge splits the fused projection but hooks no rope)
NOT_IN_BRIDGE = ("attn.hook_result", "hook_logits")
NOT_IN_BRIDGE_OF = {"phi3": ("attn.hook_rot_q", "attn.hook_rot_k")}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``pair(family)``: our model and TransformerLens' bridge over one checkpoint of the family, built once each."""
    transformers = pytest.importorskip("transformers")
    bridges = pytest.importorskip("transformer_lens.model_bridge")
    built = {}

    def make(family: str):
        if family not in built:
            path = tmp_path_factory.mktemp(family)
            hf = random_hf_checkpoint(family, path, n_layers=2)
            write_hf_tokenizer(path)
            tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
            bridge = bridges.TransformerBridge.boot_transformers(str(path), hf_model=hf, tokenizer=tokenizer,
                                                                 device="cpu", dtype=torch.float32)
            built[family] = workbench.load(path, device="cpu"), bridge.eval()
        return built[family]

    return make


def as_ours(name: str, value: torch.Tensor, family: str) -> torch.Tensor:
    """A bridge activation without its batch axis, in our layout: the bridge's q/k norms see HF's [heads, T, d_head]
    (OLMo 2's the whole projection); ours keep [T, heads, d_head] like hook_q."""
    value = value[0]
    if ".q_norm." in name or ".k_norm." in name:
        if family == "olmo2":
            return value.unsqueeze(-1) if name.endswith("hook_scale") else value
        return value.transpose(0, 1)
    return value


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"])
def test_every_hook_point_matches_transformerlens(family, pair):
    ours, bridge = pair(family)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(torch.tensor([IDS]))
    trace = ours.run(IDS, record=["*"])
    assert (trace.logits - logits[0]).abs().max().item() < 1e-5
    skipped = NOT_IN_BRIDGE + NOT_IN_BRIDGE_OF.get(family, ())
    for name, ours_value in trace.activations.items():
        if name.endswith(skipped):
            continue
        theirs = as_ours(name, cache[name], family)
        if ours_value.shape != theirs.shape:  # OLMo 2's q/k norms: the same values, heads apart in ours
            theirs = theirs.reshape(ours_value.shape)
        if name.endswith("hook_attn_scores"):  # masked entries: -inf in ours, a large negative or -inf in theirs
            masked = ~torch.isfinite(ours_value)
            assert torch.equal(masked, theirs < -1e30), name
            ours_value, theirs = ours_value[~masked], theirs[~masked]
        error = ((ours_value - theirs).abs().max() / theirs.abs().max()).item()
        assert error < 1e-5, (name, error)


@pytest.mark.parametrize("family, point", [("llama", "attn.hook_q"), ("llama", "attn.hook_rot_k"),
                                           ("llama", "ln1.hook_scale"), ("gemma2", "ln1_post.hook_scale"),
                                           ("gemma3", "attn.k_norm.hook_normalized")])
def test_edits_act_as_in_transformerlens(family, point, pair):
    """The same edit at the same hook point (adding one tensor, in TransformerLens' order and meaning) moves our logits
    as it moves the bridge's: llama's q/k come back to llama.cpp's order, the divisor to the norm's multiplier."""
    ours, bridge = pair(family)
    name = f"blocks.1.{point}"
    activation = ours.run(IDS, record=[name]).activations[name]
    torch.manual_seed(0)
    delta = 0.5 * torch.randn(activation.shape) * activation.abs().mean()  # one per position: a key's matters

    def ours_edit(x, ctx):
        return x + delta

    def bridge_edit(x, hook):
        edit = delta.transpose(0, 1) if ".k_norm." in point else delta  # [heads, T, d_head] there
        return x + edit

    with torch.no_grad():
        expected = bridge.run_with_hooks(torch.tensor([IDS]), fwd_hooks=[(name, bridge_edit)])[0]
    got = ours.forward(IDS, interventions=[(name, ours_edit)])
    assert (got - ours.forward(IDS)).abs().max().item() > 1e-3  # the edit matters
    assert (got - expected).abs().max().item() < 1e-4
