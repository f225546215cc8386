"""A model split over devices in layer ranges computes what it computes on one device, bit for bit.

On the CPU the ranges are ``["cpu", "cpu", ...]``: the forward still hands the residual stream over at every range
boundary (the unfused residual sum, the next range's hook points and inputs), so these tests run the split code
without a GPU. The ``cuda`` tests at the end compare 2 GPUs with 1 and check that each hook fires on its layer's GPU.
"""
from __future__ import annotations

import json

import pytest
import torch

import workbench
from workbench.devices import split_layers
from workbench.errors import WorkbenchError
from workbench.hooks import Patch, Steer, ZeroAblate
from workbench.synthetic import write_gguf

LAYERS = 4
SPLITS = ([1, 3], [2, 2], [1, 1, 2])


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "olmo2"])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param, "Q8_0", n_layers=LAYERS, tied_embeddings=request.param != "qwen2")


@pytest.fixture(scope="module")
def whole(checkpoint):
    return workbench.Model(checkpoint, "cpu")


@pytest.fixture(scope="module")
def untied(tiny_checkpoint):
    """A Qwen2 model (biases, untied unembedding): the one the slower tests run on."""
    checkpoint = tiny_checkpoint("qwen2", "Q8_0", n_layers=LAYERS, tied_embeddings=False)
    return checkpoint, workbench.Model(checkpoint, "cpu")


def split_model(checkpoint, split):
    return workbench.Model(checkpoint, devices=["cpu"] * len(split), split=split)


PROMPT = list(range(5, 29))


@pytest.mark.parametrize("split", SPLITS)
def test_split_logits_and_every_activation_are_bit_identical(checkpoint, whole, split):
    model = split_model(checkpoint, split)
    assert [r.stop - r.start for _, r in model.devices] == split
    ref, out = whole.run(PROMPT, record=["*"]), model.run(PROMPT, record=["*"])
    assert torch.equal(ref.logits, out.logits)
    assert ref.activations.keys() == out.activations.keys() and len(out.activations) == len(whole.hook_points())
    for name, value in ref.activations.items():
        assert torch.equal(value, out.activations[name]), name


def test_interventions_at_a_boundary_act_as_on_one_device(checkpoint, whole):
    model = split_model(checkpoint, [2, 2])  # blocks.2.hook_resid_pre is the first point of the second range
    vector = torch.randn(checkpoint.config.d_model, generator=torch.Generator().manual_seed(0))
    donor = list(range(40, 64))
    edits = [Steer("blocks.2.hook_resid_pre", vector, scale=3.0, positions=[3, 4]),
             ZeroAblate("blocks.1.hook_resid_post", positions=[5]),
             Patch("blocks.3.attn.hook_z", donor=donor, heads=[1]),
             ZeroAblate("blocks.2.attn.hook_q", positions=[7])]
    for edit in edits:
        ref = whole.run(PROMPT, interventions=[edit], record=["blocks.3.hook_resid_post"])
        out = model.run(PROMPT, interventions=[edit], record=["blocks.3.hook_resid_post"])
        assert not torch.equal(ref.logits, whole.run(PROMPT).logits)  # the edit changes something
        assert torch.equal(ref.logits, out.logits)
        assert torch.equal(ref.activations["blocks.3.hook_resid_post"], out.activations["blocks.3.hook_resid_post"])

    seen = []
    hook = lambda x, ctx: seen.append((ctx.name, ctx.layer, ctx.positions.tolist()))  # noqa: E731
    with model.hooks([("blocks.2.hook_resid_pre", hook), ("blocks.1.hook_resid_post", hook)]):
        model.forward(PROMPT)
    assert seen == [("blocks.1.hook_resid_post", 1, list(range(len(PROMPT)))),
                    ("blocks.2.hook_resid_pre", 2, list(range(len(PROMPT))))]


def test_generation_and_kv_cache_surgery_match(untied):
    checkpoint, whole = untied
    model = split_model(checkpoint, [1, 1, 2])
    assert model.generate(PROMPT, 8) == whole.generate(PROMPT, 8)
    sampled = dict(temperature=0.9, top_k=20, seed=3)
    assert model.generate(PROMPT, 8, **sampled) == whole.generate(PROMPT, 8, **sampled)
    steer = [Steer("blocks.2.hook_resid_pre", torch.ones(checkpoint.config.d_model), scale=2.0)]
    assert model.generate(PROMPT, 6, interventions=steer) == whole.generate(PROMPT, 6, interventions=steer)

    caches = []
    for m in (whole, model):
        cache = m.new_cache()
        m.forward(PROMPT, cache=cache)
        cache.delete_positions([3, 4])
        cache.clear(2)
        edited = cache.clone()
        edited.set(3, *[t * 0.5 for t in cache.get(3)])
        caches.append((m.forward([7, 8, 9], cache=edited), edited))
    (ref, ref_cache), (out, out_cache) = caches
    assert torch.equal(ref, out)
    assert [k.device for k in out_cache._keys] == model.runner.devices
    for layer in range(LAYERS):
        assert all(torch.equal(a, b) for a, b in zip(ref_cache.get(layer), out_cache.get(layer)))


def test_batches_match(untied):
    checkpoint, whole = untied
    model = split_model(checkpoint, [2, 2])
    prompts = [PROMPT, list(range(30, 40)), [3] * 20 + list(range(50, 60)), [3] * 20 + list(range(60, 66))]
    per_prompt = [[], [ZeroAblate("blocks.2.hook_resid_pre", positions=[1])], [], [Steer(
        "blocks.1.hook_mlp_out", torch.ones(checkpoint.config.d_model))]]
    kwargs = dict(record=["blocks.*.hook_resid_post", "blocks.2.attn.hook_pattern"], per_prompt_interventions=per_prompt)
    for ref, out in zip(whole.run_batch(prompts, **kwargs), model.run_batch(prompts, **kwargs)):
        assert torch.equal(ref.logits, out.logits)
        for name in ref.activations:
            assert torch.equal(ref.activations[name], out.activations[name]), name
    # a prefix the prompts share is computed once (no interventions), its cache rows on each layer's device
    shared = [[3] * 20 + list(range(50, 60)), [3] * 20 + list(range(60, 66))]
    for ref, out in zip(whole.run_batch(shared, reduce="mean", record=["blocks.3.hook_resid_post"]),
                        model.run_batch(shared, reduce="mean", record=["blocks.3.hook_resid_post"])):
        assert torch.equal(ref.logits, out.logits)
        assert torch.equal(ref.activations["blocks.3.hook_resid_post"], out.activations["blocks.3.hook_resid_post"])
    assert model.generate_batch(prompts, 4) == whole.generate_batch(prompts, 4)


def test_automatic_split_follows_free_memory(tiny_checkpoint):
    weights = tiny_checkpoint("llama", "Q8_0", n_layers=8).weights
    assert split_layers(weights, ["cpu", "cpu"], free=[1 << 30] * 2) == [4, 4]
    assert split_layers(weights, ["cpu", "cpu"], free=[3 << 30, 1 << 30]) == [6, 2]
    assert split_layers(weights, ["cpu"] * 3, free=[1 << 30] * 3) in ([3, 3, 2], [3, 2, 3], [2, 3, 3])
    model = workbench.Model(tiny_checkpoint("llama", "Q8_0", n_layers=8), devices=["cpu", "cpu"])
    assert [(d, r.stop - r.start) for d, r in model.devices] == [("cpu", 4), ("cpu", 4)]
    assert model.info()["devices"] == [{"device": "cpu", "layers": [0, 3]}, {"device": "cpu", "layers": [4, 7]}]


@pytest.mark.parametrize("kwargs, message", [
    (dict(devices=["cuda:7", "cpu"]), "cuda"),
    (dict(devices=["tpu:0"]), "device"),
    (dict(devices="cpu"), "list"),
    (dict(devices=[]), "list"),
    (dict(devices=["cpu"] * 5), "at most one per layer"),
    (dict(devices=["cpu", "cpu"], split=[1, 2]), "4 in all"),
    (dict(devices=["cpu", "cpu"], split=[0, 4]), "at least one layer"),
    (dict(device="cpu", devices=["cpu"]), "not both"),
    (dict(split=[2, 2]), "devices"),
])
def test_bad_devices_are_clear_errors(tiny_checkpoint, kwargs, message):
    if "cuda:7" in str(kwargs) and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(WorkbenchError, match=message):
        workbench.Model(tiny_checkpoint("llama", "Q8_0", n_layers=LAYERS), **kwargs)


def test_a_split_that_does_not_fit_says_what_is_missing(tiny_checkpoint):
    weights = tiny_checkpoint("llama", "Q8_0", n_layers=LAYERS).weights
    with pytest.raises(WorkbenchError, match=r"does not fit: cpu would hold .* GiB .* add devices"):
        split_layers(weights, ["cpu", "cpu"], free=[10_000, 10_000])


def test_cli_devices(tmp_path, capsys, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama", "Q8_0", n_layers=LAYERS)
    path = write_gguf(tmp_path / "tiny.gguf", checkpoint.config, checkpoint.weights)
    from workbench.cli import main

    assert main(["info", "--model", str(path), "--devices", "cpu,cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == [{"device": "cpu", "layers": [0, 1]},
                                                              {"device": "cpu", "layers": [2, 3]}]
    assert main(["run", "abc", "--model", str(path), "--devices", "cpu,cpu", "--json", "--top-k", "3"]) == 0
    split_top = json.loads(capsys.readouterr().out)["top_k"]
    assert main(["run", "abc", "--model", str(path), "--device", "cpu", "--json", "--top-k", "3"]) == 0
    assert split_top == json.loads(capsys.readouterr().out)["top_k"]
    assert main(["run", "abc", "--model", str(path), "--devices", "cuda:9,cpu"]) == 2
    assert "cuda" in capsys.readouterr().err


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K"])
def test_two_gpus_equal_one_gpu(tiny_checkpoint, fmt):
    checkpoint = tiny_checkpoint("llama", fmt, n_layers=LAYERS, d_model=256, d_mlp=512, n_heads=8, n_kv_heads=4)
    one = workbench.Model(checkpoint, "cuda:0")
    two = workbench.Model(checkpoint, devices=["cuda:0", "cuda:1"])
    assert [d for d, _ in two.devices] == ["cuda:0", "cuda:1"]
    ref, out = one.run(PROMPT, record=["*"]), two.run(PROMPT, record=["*"])
    assert torch.equal(ref.logits, out.logits)
    for name in ref.activations:
        assert torch.equal(ref.activations[name], out.activations[name]), name
    edits = [Steer("blocks.2.hook_resid_pre", torch.ones(256), positions=[3]), Patch("blocks.3.attn.hook_z", list(
        range(40, 64)), heads=[1]), ZeroAblate("blocks.1.hook_resid_post", positions=[2])]
    assert torch.equal(one.forward(PROMPT, interventions=edits), two.forward(PROMPT, interventions=edits))
    assert one.generate(PROMPT, 16, compiled=False) == two.generate(PROMPT, 16)  # a split decodes eagerly
    prompts = [PROMPT, list(range(30, 40)), [3] * 20 + list(range(50, 60))]
    assert one.generate_batch(prompts, 8) == two.generate_batch(prompts, 8)
    for a, b in zip(one.run_batch(prompts, record=["blocks.3.hook_resid_post"]),
                    two.run_batch(prompts, record=["blocks.3.hook_resid_post"])):
        assert torch.equal(a.logits, b.logits)
    from workbench.probes import logit_lens
    assert torch.equal(logit_lens(one, PROMPT).normed["resid_post"].cpu(),
                       logit_lens(two, PROMPT).normed["resid_post"].cpu())

    where = {}
    record = lambda x, ctx: where.setdefault(ctx.name, (x.device, ctx.positions.device)) and None  # noqa: E731
    with two.hooks([(name, record) for name in two.hook_points()]):
        two.forward(PROMPT)
    assert len(where) == len(two.hook_points())
    for name, devices in where.items():
        assert devices == (two.point_device(name),) * 2, name
    assert {k.device for k in two.new_cache()._keys} == {torch.device("cuda:0"), torch.device("cuda:1")}
