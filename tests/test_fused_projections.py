"""q/k/v and gate/up stacked into one matrix each (the CUDA default): same model, same hook points."""
from __future__ import annotations

import pytest
import torch

from workbench.kernels import QuantTensor
from workbench.runner import Transformer

POINTS = ("blocks.1.attn.hook_q", "blocks.1.attn.hook_k", "blocks.1.attn.hook_v", "blocks.0.mlp.hook_pre",
          "blocks.0.mlp.hook_pre_linear", "blocks.1.hook_resid_post")


@pytest.fixture()
def runners(tiny_checkpoint):
    """``runners(arch, fmt)``: a random model's runner with separate projections and one with stacked ones."""
    def make(arch: str = "qwen2", fmt: str = "Q4_K"):
        checkpoint = tiny_checkpoint(arch, fmt, d_model=256, n_heads=4, n_kv_heads=2, d_mlp=512)
        return (Transformer(checkpoint.config, checkpoint.weights, fuse_projections=False),
                Transformer(checkpoint.config, checkpoint.weights, fuse_projections=True))

    return make


def record(runner: Transformer, ids: torch.Tensor, cache=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    seen = {}
    hooks = {name: [lambda x, ctx: seen.__setitem__(ctx.name, x.clone())] for name in POINTS}
    return runner.forward(ids, cache=cache, hooks=hooks), seen


def test_fused_forward_and_hooks_match_separate_matmuls(runners):
    separate, fused = runners()
    assert all(l.wqkv is not None and l.w_gate_up is not None for l in fused.weights.layers)
    assert all(l.wqkv is None and l.w_gate_up is None for l in separate.weights.layers)
    ids = torch.tensor([3, 17, 5, 40, 2, 9])
    logits, seen = record(separate, ids)
    fused_logits, fused_seen = record(fused, ids)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-5, atol=1e-5)
    for name in POINTS:
        torch.testing.assert_close(fused_seen[name], seen[name], rtol=1e-5, atol=1e-5)
    # one token at a time through a cache: the decode shape
    caches = separate.new_cache(), fused.new_cache()
    for token in ids:
        step, _ = record(separate, token.view(1), caches[0])
        fused_step, _ = record(fused, token.view(1), caches[1])
        torch.testing.assert_close(fused_step, step, rtol=1e-5, atol=1e-5)


def test_hook_edit_on_a_fused_part_acts_like_on_a_separate_one(runners):
    separate, fused = runners("llama")
    ids = torch.tensor([3, 17, 5, 40])
    hooks = {"blocks.0.attn.hook_v": [lambda v, ctx: v * 0], "blocks.1.mlp.hook_pre_linear": [lambda u, ctx: u + 1]}
    torch.testing.assert_close(fused.forward(ids, hooks=hooks), separate.forward(ids, hooks=hooks),
                               rtol=1e-5, atol=1e-5)


def test_parts_are_views_of_the_stacked_matrix(runners):
    separate, fused = runners()
    layer = fused.weights.layers[0]
    storage = layer.wqkv.data.untyped_storage().data_ptr()
    assert all(w.data.untyped_storage().data_ptr() == storage for w in (layer.wq, layer.wk, layer.wv))
    assert layer.wk.data.data_ptr() == layer.wqkv.data[layer.wq.shape[0]].data_ptr()
    assert fused.weights.nbytes == separate.weights.nbytes  # stacked matrices are not counted twice
    assert [n for n, _ in fused.weights.named_matrices()] == [n for n, _ in separate.weights.named_matrices()]
    for (_, a), (_, b) in zip(fused.weights.named_matrices(), separate.weights.named_matrices()):
        assert torch.equal(a.data, b.data) and a.shape == b.shape


def test_parts_of_different_formats_stay_apart(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama", "Q4_K", d_model=256, d_mlp=512, cached=False)  # edited
    for layer in checkpoint.weights.layers:  # as in Q4_K_M, where some layers keep wv in Q6_K
        layer.wv = QuantTensor.quantize(layer.wv.dequantize(), "Q6_K")
    separate = Transformer(checkpoint.config, checkpoint.weights, fuse_projections=False)
    fused = Transformer(checkpoint.config, checkpoint.weights, fuse_projections=True)
    assert all(l.wqkv is None and l.w_gate_up is not None for l in fused.weights.layers)
    ids = torch.tensor([1, 2, 3, 4])
    torch.testing.assert_close(fused.forward(ids), separate.forward(ids), rtol=1e-5, atol=1e-5)


def test_kernel_report_names_the_kernel_of_the_stacked_matrix(tiny_model):
    model = tiny_model("llama", "Q8_0", d_model=256, d_mlp=512, device="cpu", cached=False)  # edited
    model.runner.weights.layers[0].fuse_projections()
    report = model.kernel_report(1)
    assert {"blocks.0.wq", "blocks.0.wk", "blocks.0.wv", "blocks.0.w_gate", "blocks.0.w_up"} <= set(report)
    assert "blocks.0.wqkv" not in report and report["blocks.0.wq"] == report["blocks.1.wq"]
