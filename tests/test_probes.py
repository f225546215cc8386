"""Datasets, activation collection, probes (save/load, depth sweeps) on real numbers."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import workbench
from workbench import probes


@pytest.fixture(scope="module")
def small(tiny_model):
    return tiny_model("llama", n_layers=3, device="cpu")


@pytest.fixture(scope="module")
def ending_dataset():
    """Label = the prompt's last word: a random model separates it from its last-token residual."""
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "mat", "in", "an", "hot", "sun", "tea"]
    records = []
    for i in range(40):
        label = "cat" if i % 2 else "sun"
        prefix = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
        records.append({"text": f"{prefix} {label}", "label": label})
    return probes.make_dataset("endings", records)


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------- datasets

def test_import_datasets_at_the_repository_root_never_finds_our_folder():
    """The top-level datasets/ folder (installed as workbench.datasets) has no __init__.py: ``python -c "import
    datasets"`` run from the repository root, which puts the root first on sys.path, imports Hugging Face's package
    (a dependency of transformer-lens), or fails where it is missing, and never imports the folder."""
    root = Path(__file__).resolve().parents[1]
    folder = root / "datasets"
    assert folder.is_dir() and not (folder / "__init__.py").exists()
    code = "import datasets; print(getattr(datasets, '__file__', None)); print(list(getattr(datasets, '__path__', [])))"
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    if result.returncode:
        assert "ModuleNotFoundError: No module named 'datasets'" in result.stderr, result.stderr[-2000:]
    else:
        file, path = result.stdout.splitlines()[-2:]
        assert file != "None" and not Path(file).resolve().is_relative_to(root), result.stdout
        assert str(folder) not in path, result.stdout
    assert str(probes.data.SHIPPED) == str(folder.resolve())  # this checkout's files are the ones shipped


def test_shipped_datasets():
    assert set(probes.list_datasets()) >= {"sentiment", "facts", "capitals", "happy_sad"}
    for name in ("sentiment", "facts"):
        data = probes.load_dataset(name)
        counts = [data.labels.count(c) for c in data.classes]
        assert data.kind == "classification" and len(data) >= 60 and len(counts) == 2 and counts[0] == counts[1]
    capitals = probes.load_dataset("capitals")
    assert capitals.kind == "completion" and len(capitals) >= 40
    assert all(answer.startswith(" ") for answer in capitals.labels)
    pairs = probes.load_dataset("happy_sad")
    assert pairs.kind == "pairs" and len(pairs) >= 30
    positives, negatives = pairs.contrast()
    assert len(positives) == len(negatives) == len(pairs)
    sentiment = probes.load_dataset("sentiment")
    assert len(set(sentiment.prompts)) == len(sentiment)
    # twins written as pairs share a group, so splits never test a probe on a training sentence's twin
    assert sentiment.groups[:4] == ["0", "0", "1", "1"] and pairs.groups[0] == pairs.groups[len(pairs)]
    ioi = probes.load_dataset("ioi")
    prompts, answers = ioi.patching()
    assert ioi.kind == "patching" and len(prompts) == len(answers) == len(ioi) == 32
    # the clean answer is the indirect object, named first; the corrupt prompt has three other names
    clean, corrupt = prompts[0]
    assert clean.startswith("When" + answers[0][0] + " and" + answers[0][1])
    assert clean.count(answers[0][1]) == 2 and answers[0][0] not in corrupt and answers[0][1] not in corrupt
    assert ioi.contrast() == ([c for c, _ in prompts], [x for _, x in prompts]) and ioi.labels[-1] == "corrupt"
    with pytest.raises(workbench.WorkbenchError, match="'happy_sad' is a pairs dataset; patching takes"):
        pairs.patching()


def test_dataset_validation(tmp_path):
    cases = {
        "one class": [{"text": "a", "label": "x"}, {"text": "b", "label": "x"}],
        "mismatched pair counts": [{"positive": "a", "negative": "b"}, {"positive": "c"}],
        "a patching record needs 'clean', 'corrupt', 'clean_answer' and": [{"clean": "a", "corrupt": "b"}],
        "line 2: 'corrupt_answer' must be a string": [
            {"clean": "a", "corrupt": "b", "clean_answer": " x", "corrupt_answer": " y"},
            {"clean": "a", "corrupt": "b", "clean_answer": " x", "corrupt_answer": 3}],
        "empty 'text'": [{"text": "a", "label": "x"}, {"text": "  ", "label": "y"}],
        "unknown record": [{"prompt": "a"}],
        "fewer than 2": [{"text": "a", "label": "x"}, {"text": "b", "label": "x"}, {"text": "c", "label": "y"}],
    }
    for message, records in cases.items():
        with pytest.raises(workbench.WorkbenchError, match=message):
            probes.load_dataset(write_jsonl(tmp_path / "bad.jsonl", records))
    (tmp_path / "junk.jsonl").write_text('{"text": "a", "label": "x"}\n{not json', encoding="utf-8")
    with pytest.raises(workbench.WorkbenchError, match="line 2: not valid JSON"):
        probes.load_dataset(tmp_path / "junk.jsonl")
    for content, message in ((b'{"text": "a\xff", "label": "x"}', "not UTF-8 text"),
                             (b"[" * 100000 + b"]" * 100000, "line 1: nests too deeply"),
                             (b'{"text": "a", "label": ' + b"1" * 5000 + b"}", "line 1: not valid JSON")):
        (tmp_path / "junk.jsonl").write_bytes(content)
        with pytest.raises(workbench.WorkbenchError, match=message):
            probes.load_dataset(tmp_path / "junk.jsonl")
    with pytest.raises(workbench.WorkbenchError, match="not a shipped name"):
        probes.load_dataset("no_such_dataset")
    with pytest.raises(workbench.WorkbenchError, match="mismatched pair counts"):
        probes.pairs_dataset(["a", "b"], ["c"])
    records = cases["fewer than 2"] + [{"text": "d", "label": "y"}]
    good = probes.load_dataset(write_jsonl(tmp_path / "mine.jsonl", records))
    assert good.name == "mine" and good.classes == ["x", "y"]


def test_groups_too_few_for_the_folds_are_refused_before_any_forward(small, monkeypatch):
    """A dataset's 'group' keys can leave fewer groups than folds, or a class inside one group: a one-line error
    before any forward, not sklearn's ValueError (after the forwards, for train_probe)."""
    def records(group_of):
        return [{"text": f"{word} {i}", "label": word, "group": group_of(word, i)}
                for i in range(4) for word in ("cat", "num")]

    monkeypatch.setattr(probes.probing, "collect_activations", lambda *a, **k: pytest.fail("a forward ran"))
    two_groups = probes.make_dataset("two", records(lambda word, i: word))
    with pytest.raises(workbench.WorkbenchError, match="4 folds need at least 4 groups of examples; .* make 2"):
        probes.depth_sweep(small, two_groups, layers=[1], folds=4)
    with pytest.raises(workbench.WorkbenchError, match="4 groups of examples"):
        probes.train_probe(small, two_groups, "blocks.1.hook_resid_post")
    one_class_one_group = probes.make_dataset("lopsided", records(lambda word, i: f"{word}{i}" if word == "cat"
                                                                  else "all"))
    with pytest.raises(workbench.WorkbenchError, match="class 'num' lies in too few of the dataset's groups"):
        probes.depth_sweep(small, one_class_one_group, layers=[1], folds=2)
    with pytest.raises(workbench.WorkbenchError, match="class 'num' lies in too few"):
        probes.train_probe(small, one_class_one_group, "blocks.1.hook_resid_post", test_size=0.5)


def test_wilson_interval_and_depth_fractions():
    low, high = probes.wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert probes.wilson_interval(20, 20)[1] == 1.0
    assert [probes.layer_at_fraction(30, f) for f in (0, 0.25, 0.5, 1)] == [0, 7, 15, 29]
    assert probes.layer_at_fraction(2, 0.5) == 1
    assert probes.layer_at_fraction(26, 0.58) == 15 and probes.layer_at_fraction(46, 0.7) == 32  # decimal halves
    for bad in (-0.1, 1.5, float("nan"), "half"):
        with pytest.raises(workbench.WorkbenchError, match=r"in \[0, 1\]"):
            probes.layer_at_fraction(30, bad)


# ------------------------------------------------------------------------------------------ collection

def test_collect_activations_pools_the_trace(small):
    prompts = ["the cat sat", "on the mat in the sun"]
    calls = []
    acts = probes.collect_activations(small, prompts, ["blocks.1.hook_resid_post", "blocks.0.attn.hook_z"],
                                      pooling="mean", progress=lambda done, total: calls.append((done, total)))
    assert calls == [(2, 2)]  # both prompts in one batched forward
    trace = small.run(prompts[1], record=["blocks.1.hook_resid_post", "blocks.0.attn.hook_z"])
    expected = trace.activations["blocks.1.hook_resid_post"].mean(0)
    torch.testing.assert_close(acts["blocks.1.hook_resid_post"][1], expected, atol=1e-4, rtol=1e-4)
    assert acts["blocks.0.attn.hook_z"].shape == (2, small.config.n_heads * small.config.d_head)
    with pytest.raises(workbench.HookError, match="token-major"):
        probes.collect_activations(small, prompts, ["blocks.0.attn.hook_pattern"])
    with pytest.raises(workbench.WorkbenchError, match="prompt 1 is empty"):
        probes.collect_activations(small, ["the cat", ""], ["blocks.0.hook_resid_post"])


# -------------------------------------------------------------------------------------------- probes

def test_probe_fits_saves_and_loads(small, ending_dataset, tmp_path, tiny_model):
    probe = probes.probe_at_depth_fraction(small, ending_dataset, 1.0)
    assert probe.hook == "blocks.2.hook_resid_post"
    assert probe.accuracy >= 0.9 and probe.ci[0] <= probe.accuracy <= probe.ci[1]
    assert (probe.n_train, probe.n_test) == (30, 10)
    new_prompts = ["on the hot mat cat", "tea in the sun"]
    assert probe.predict(small, new_prompts) == ["cat", "sun"]

    safetensors_file, json_file = probe.save(tmp_path / "ending")
    assert safetensors_file.suffix == ".safetensors" and json.loads(json_file.read_text())["hook"] == probe.hook
    loaded = probes.Probe.load(tmp_path / "ending.safetensors", small)
    assert loaded.classes == probe.classes and loaded.accuracy == probe.accuracy
    torch.testing.assert_close(loaded.predict_proba(small, new_prompts), probe.predict_proba(small, new_prompts))
    ids = [small.to_ids(p) for p in new_prompts]  # token ids, as the MCP server passes its checked prompts
    assert torch.equal(probe.predict_proba(small, ids), probe.predict_proba(small, new_prompts))
    with pytest.raises(workbench.WorkbenchError, match="prompt 1: token ids out of range"):
        probe.predict(small, [ids[0], [10**9]])
    with pytest.raises(workbench.WorkbenchError, match="prompt 1 is empty or neither"):
        probe.predict(small, [ids[0], "  "])

    wider = tiny_model("llama", n_layers=3, d_model=128, device="cpu")
    with pytest.raises(workbench.WorkbenchError, match="d_model 64"):
        probes.Probe.load(tmp_path / "ending", wider)
    shallower = tiny_model("llama", n_layers=2, device="cpu")
    with pytest.raises(workbench.WorkbenchError, match="does not have"):
        loaded.predict(shallower, new_prompts)
    with pytest.raises(workbench.WorkbenchError, match="not found"):
        probes.Probe.load(tmp_path / "missing")
    for text, message in (("{not json", "not valid JSON"), ("[1]", "is not a workbench probe"),
                          ("[" * 100000 + "]" * 100000, "nests too deeply")):
        json_file.write_text(text)
        with pytest.raises(workbench.WorkbenchError, match=message):
            probes.Probe.load(tmp_path / "ending", small)


def test_activations_collected_elsewhere_fit_the_probe_train_probe_fits(small, ending_dataset):
    """docs/scaling.md: features from ``distributed.collect_activations`` go to ``probes.fit_probe``, which gives the
    probe ``train_probe`` gives on the same point."""
    from workbench import distributed

    hook = "blocks.2.hook_resid_post"
    features = distributed.collect_activations(small, ending_dataset.prompts, [hook], "last")
    probe = probes.fit_probe(features[hook], ending_dataset.labels, hook=hook, pooling="last",
                             signature=probes.model_signature(small, hook), groups=ending_dataset.groups)
    trained = probes.train_probe(small, ending_dataset, hook)
    assert (probe.accuracy, probe.n_train, probe.n_test) == (trained.accuracy, trained.n_train, trained.n_test)
    new_prompts = ["on the hot mat cat", "tea in the sun"]
    torch.testing.assert_close(probe.predict_proba(small, new_prompts), trained.predict_proba(small, new_prompts))


def test_depth_sweep_on_a_small_model(small, ending_dataset):
    seen = []
    sweep = probes.depth_sweep(small, ending_dataset, fractions=[0.0, 0.5, 1.0], folds=4,
                               progress=lambda done, total: seen.append(done))
    assert seen[-1] == len(ending_dataset)  # one forward per prompt for all layers
    assert sweep.layers == [0, 1, 2] and set(sweep.accuracy) == {0, 1, 2}
    for layer in sweep.layers:
        low, high = sweep.ci[layer]
        assert low <= sweep.accuracy[layer] <= high
    assert sweep.accuracy[sweep.peak_layer] == max(sweep.accuracy.values()) >= 0.9
    assert sweep.first_reaching(0.0) == 0 and sweep.first_reaching(1.0) <= sweep.peak_layer
    probe = sweep.probe(2)
    assert probe.predict(small, ["the mat cat"]) == ["cat"]
    assert len(sweep.figure().data) == 2
    with pytest.raises(workbench.WorkbenchError, match=r"in \[0, 1\]"):
        probes.depth_sweep(small, ending_dataset, fractions=[0.5, 1.2])
    with pytest.raises(workbench.WorkbenchError, match="not both"):
        probes.depth_sweep(small, ending_dataset, fractions=[0.5], layers=[1])


def test_depth_sweep_on_the_embedded_model(model):
    subset = probes.load_dataset("sentiment").sample(24, seed=1)
    sweep = probes.depth_sweep(model, subset, fractions=[0.0, 0.5, 0.9], folds=3)
    assert sweep.layers == [0, 15, 26]
    # sentiment is not readable from the first token embedding of the last word alone but is mid-depth
    assert sweep.accuracy[15] >= 0.75 and sweep.accuracy[15] > sweep.accuracy[0]
    assert np.isclose(sum(sweep.ci[15]) / 2, sweep.accuracy[15], atol=0.15)


def test_bad_probe_requests_are_refused_before_any_forward(small, ending_dataset, monkeypatch):
    three = probes.make_dataset("three", [{"text": f"good thing {i}", "label": "pos"} for i in range(3)]
                                + [{"text": f"bad thing {i}", "label": "neg"} for i in range(3)])
    calls = []
    monkeypatch.setattr(small, "run_batch", lambda *a, **k: calls.append(1))
    cases = [
        (lambda: probes.train_probe(small, ending_dataset, "blocks.*.hook_resid_post"), "matches 3 hook points"),
        (lambda: probes.train_probe(small, three, "blocks.1.hook_resid_post"), "4 folds need at least 4"),
        (lambda: probes.train_probe(small, three, "blocks.1.hook_resid_post", test_size=0.9), "test_size"),
        (lambda: probes.train_probe(small, three, "blocks.1.hook_resid_post", test_size=float("nan")), "finite"),
        (lambda: probes.train_probe(small, three, "blocks.1.hook_resid_post", 0.5, n_components=0), "n_components"),
        (lambda: probes.depth_sweep(small, three, layers=[1], folds=3, n_components=0), "n_components"),
        (lambda: probes.depth_sweep(small, three, layers=[1], folds=4), "4 folds need at least 4"),
        (lambda: probes.depth_sweep(small, three, layers=[1], folds=1), "folds must be an integer of at least 2"),
        (lambda: probes.steering_vector(small, probes.load_dataset("happy_sad"), layers=[1], positive="sad"),
         "its positive side is its 'positive' column"),
        (lambda: probes.train_sae(small, ["a b c"], "blocks.1.attn.hook_pattern", d_sae=8, k=2, tokens=10),
         "has no fixed width"),
        (lambda: probes.depth_sweep(small, three, layers="12", folds=3), "list of integers"),
        (lambda: probes.depth_sweep(small, three, layers=[1.7], folds=3), "list of integers"),
        (lambda: probes.depth_sweep(small, three, fractions=0.5, folds=3), "list of numbers"),
        (lambda: probes.depth_sweep(small, None), "a dataset must be"),
        (lambda: probes.load_dataset(5), "a dataset must be"),
    ]
    for call, message in cases:
        with pytest.raises(workbench.WorkbenchError, match=message):
            call()
    assert calls == []


def test_numpy_and_torch_numbers_and_checked_counts():
    for fraction in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), 0.5):
        assert probes.layer_at_fraction(30, fraction) == 15
    for bad in (True, torch.tensor([0.5, 0.5])):
        with pytest.raises(workbench.WorkbenchError, match=r"in \[0, 1\]"):
            probes.layer_at_fraction(30, bad)
    with pytest.raises(workbench.WorkbenchError, match="correct must be in 0..total"):
        probes.wilson_interval(5, 3)


def test_a_dataset_built_directly_is_validated():
    with pytest.raises(workbench.WorkbenchError, match="only one class"):
        probes.Dataset("d", "classification", ({"text": "a", "label": "x"}, {"text": "b", "label": "x"}))
    with pytest.raises(workbench.WorkbenchError, match="record 2: empty 'positive'"):
        probes.Dataset("d", "pairs", ({"positive": "a", "negative": "b"}, {"positive": " ", "negative": "b"}))
    with pytest.raises(workbench.WorkbenchError, match="kind must be one of"):
        probes.Dataset("d", "regression", ({"text": "a", "label": "x"},))
