"""Sweeps sharded over ranks give exactly what one process gives, a failed shard retried with no row lost or doubled.

Two local gloo processes run under ``torchrun`` (tests/distributed_job.py); the same job in this process is the
reference. The job kills one rank once (the job fails; run again, the harvest keeps its written shards) and makes one
shard raise once (it is retried on the other rank).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench import distributed
from workbench.errors import WorkbenchError
from workbench.synthetic import random_checkpoint, random_config, write_gguf

sys.path.insert(0, str(Path(__file__).parent))
import distributed_job  # noqa: E402

JOB = Path(__file__).with_name("distributed_job.py")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    checkpoint = random_checkpoint(random_config("llama", n_layers=2), "Q8_0")
    return write_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", checkpoint.config, checkpoint.weights)


def test_two_gloo_ranks_equal_one_process_through_a_crash_and_a_failed_shard(model_file, tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    reference = distributed_job.run(str(model_file), one)
    two = tmp_path / "two"
    two.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
               str(model_file), str(two), "--fail"]
    # the first launch loses a rank in the harvest to files: torchrun stops the other, and the job fails
    crashed = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert crashed.returncode != 0 and "exitcode: 3" in crashed.stderr and (two / "crashed-once").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in (two / "harvest").glob("shard-*.safetensors")}
    # the same command again: the harvest keeps the shards written before the crash, and a shard that raises is
    # retried on the other rank
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (two / "raised-once").exists()
    assert {name: (two / "harvest" / name).stat().st_mtime_ns for name in kept} == kept
    got = load_file(str(two / "results.safetensors"))
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got[name], value), name
    # every prompt once, in order: 11 prompts, their tokens' rows in one piece each
    offsets = got["tokens/offsets"]
    assert offsets.tolist() == [0, *torch.tensor([len(p) for p in distributed_job.PROMPTS]).cumsum(0).tolist()]
    assert got["squares"].tolist() == [n * n for n in range(7)]


def test_results_are_those_of_the_model_alone(model_file, tmp_path):
    import workbench

    model = workbench.load(str(model_file), device="cpu")
    prompts = distributed_job.PROMPTS
    mean = distributed.harvest(model, prompts, ["blocks.1.hook_mlp_out"], reduce="mean", shard_size=4)
    traces = model.run_batch(prompts, record=["blocks.1.hook_mlp_out"])
    expected = torch.stack([t.activations["blocks.1.hook_mlp_out"].mean(0) for t in traces])
    torch.testing.assert_close(mean["blocks.1.hook_mlp_out"], expected)
    manifest = distributed.harvest(model, prompts, ["blocks.1.hook_mlp_out"], reduce=None, shard_size=4,
                                   out=tmp_path / "h")
    tokens = distributed.read_harvest(manifest.parent)
    torch.testing.assert_close(tokens["blocks.1.hook_mlp_out"],
                               torch.cat([t.activations["blocks.1.hook_mlp_out"] for t in traces]))


def test_a_failing_shard_is_retried_then_reported():
    calls = []

    def flaky(shard):
        calls.append(shard.index)
        if shard.index == 1 and calls.count(1) == 1:
            raise RuntimeError("transient")
        return [x * 10 for x in shard.items]

    assert distributed.run_sharded(list(range(10)), flaky, shard_size=3) == [x * 10 for x in range(10)]
    assert sorted(calls) == [0, 1, 1, 2, 3]

    def broken(shard):
        raise RuntimeError("out of memory")

    with pytest.raises(WorkbenchError, match=r"shard 0 \(items 0..2\) failed 3 times; last error: RuntimeError: out of "
                                             r"memory \(3 more shards failed\)"):
        distributed.run_sharded(list(range(10)), broken, shard_size=3, retries=2)
    with pytest.raises(WorkbenchError, match="gave 1 results for 3 items"):
        distributed.run_sharded(list(range(3)), lambda shard: [0], shard_size=3, retries=0)
    with pytest.raises(WorkbenchError, match="shard_size"):
        distributed.sweep([1], lambda x: x, shard_size=0)
    with pytest.raises(WorkbenchError, match="no work items"):
        distributed.sweep([], lambda x: x)


def test_cli_harvest(model_file, tmp_path, capsys):
    import json

    import workbench
    from workbench.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\na dog barks\n\nthe end\n", encoding="utf-8")
    argv = ["harvest", "--file", str(prompts), "--hook", "blocks.1.hook_resid_post", "--hook", "hook_embed", "--out",
            str(tmp_path / "out"), "--model", str(model_file), "--device", "cpu", "--shard-size", "2", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["prompts"], summary["shards"], summary["ranks"]) == (3, 2, 1)
    got = distributed.read_harvest(tmp_path / "out")
    model = workbench.load(str(model_file), device="cpu")
    traces = model.run_batch(["the cat", "a dog barks", "the end"], record=["blocks.1.hook_resid_post", "hook_embed"])
    assert summary["rows"] == got["offsets"][-1] == sum(len(t.ids) for t in traces)
    for name in ("blocks.1.hook_resid_post", "hook_embed"):
        torch.testing.assert_close(got[name], torch.cat([t.activations[name] for t in traces]))
    with pytest.raises(SystemExit) as exit:  # refused in the CLI's words, before the model loads
        main(argv[:-1] + ["--reduce", "sideways"])
    assert exit.value.code == 2
    assert "argument --reduce: give none, last, mean or a position, not 'sideways'" in capsys.readouterr().err


def test_a_rerun_keeps_only_shards_of_the_same_harvest(model_file, tmp_path):
    import workbench

    model = workbench.load(str(model_file), device="cpu")
    prompts = distributed_job.PROMPTS[:5]
    folder = tmp_path / "h"
    distributed.harvest(model, prompts, ["hook_embed"], reduce=None, out=folder, shard_size=2)
    written = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*")}
    distributed.harvest(model, prompts, ["hook_embed"], reduce=None, out=folder, shard_size=2)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*")} == written  # kept, not recomputed
    distributed.harvest(model, prompts, ["hook_embed"], reduce="last", out=folder, shard_size=2)
    assert distributed.read_harvest(folder)["hook_embed"].shape[0] == 5  # recomputed: one row a prompt now


def test_a_rerun_recomputes_shards_of_other_numerics_dtypes_or_weights(model_file, tmp_path):
    """The shards an earlier run wrote are kept only for the same computation, not the same config and path alone."""
    import workbench
    from workbench.kernels import numerics

    model = workbench.load(str(model_file), device="cpu")
    prompts, hook = distributed_job.PROMPTS[:3], "blocks.1.hook_resid_post"

    def harvested(model: workbench.Model, folder: str) -> torch.Tensor:
        distributed.harvest(model, prompts, [hook], reduce=None, out=tmp_path / folder, shard_size=2)
        return distributed.read_harvest(tmp_path / folder)[hook]

    exact = harvested(model, "h")
    with numerics("llamacpp"):
        rerun, fresh = harvested(model, "h"), harvested(model, "fresh_llamacpp")
    assert torch.equal(rerun, fresh) and not torch.equal(fresh, exact)
    half = workbench.load(str(model_file), device="cpu", dtype="bfloat16")
    rerun, fresh = harvested(half, "h"), harvested(half, "fresh_bfloat16")
    assert torch.equal(rerun, fresh) and not torch.equal(fresh.float(), exact)
    # two random models of one config, both named <random-llama>: their weights tell them apart
    same, other = (workbench.Model(random_checkpoint(random_config("llama", n_layers=2), "Q8_0", seed=seed), "cpu",
                                   None) for seed in (0, 1))
    assert same.config == other.config and same.path == other.path
    first = harvested(same, "memory")
    rerun, fresh = harvested(other, "memory"), harvested(other, "fresh_other")
    assert torch.equal(rerun, fresh) and not torch.equal(fresh, first)
    with model.hooks([{"type": "zero_ablate", "hook": hook}]):
        rerun, fresh = harvested(model, "h"), harvested(model, "fresh_ablated")
    assert torch.equal(rerun, fresh) and not rerun.any()


def test_a_harvest_never_writes_through_a_link_planted_in_its_folder(model_file, tmp_path):
    """Links at the manifest's and a shard's names (and at the old fixed temporary name) are replaced as entries;
    the files they point to, outside the folder, stay as they were. Bad arguments and a bad manifest say so."""
    import workbench

    model = workbench.load(str(model_file), device="cpu")
    folder, victim = tmp_path / "h", tmp_path / "victim"
    folder.mkdir()
    victim.write_text("ORIGINAL")
    for name in ("manifest.json", "manifest.json.tmp", "shard-00000.safetensors"):
        (folder / name).symlink_to(victim)
    distributed.harvest(model, distributed_job.PROMPTS[:3], ["hook_embed"], out=folder, shard_size=2)
    assert victim.read_text() == "ORIGINAL"
    assert not (folder / "manifest.json").is_symlink() and not (folder / "shard-00000.safetensors").is_symlink()
    assert distributed.read_harvest(folder)["hook_embed"].shape[0] == 3
    with pytest.raises(workbench.WorkbenchError, match="lies outside them"):
        distributed.harvest(model, distributed_job.PROMPTS[:3], ["hook_embed"], reduce=99, out=folder)
    with pytest.raises(workbench.WorkbenchError, match="batch_size must be a positive integer"):
        distributed.harvest(model, distributed_job.PROMPTS[:3], ["hook_embed"], batch_size=0, out=folder)
    (folder / "manifest.json").write_text('{"format": 1}')
    with pytest.raises(workbench.WorkbenchError, match="is no harvest manifest"):
        distributed.read_harvest(folder)


def test_a_harvest_folder_that_lies_is_refused_in_one_line(model_file, tmp_path):
    """Manifests and shards written by hand: each lie a WorkbenchError naming it, not a TypeError, an IndexError from
    the offsets or rows joined silently past their prompts."""
    import json

    import workbench
    from safetensors.torch import save_file

    model = workbench.load(str(model_file), device="cpu")
    folder = tmp_path / "h"
    distributed.harvest(model, distributed_job.PROMPTS[:4], ["hook_embed"], reduce=None, out=folder, shard_size=2)
    manifest = json.loads((folder / "manifest.json").read_text())
    shard = folder / manifest["shards"][1]["file"]
    tensors = load_file(shard)

    def refused(match: str, meta: dict | str | None = None, **shard_tensors: torch.Tensor) -> None:
        (folder / "manifest.json").write_text(meta if isinstance(meta, str) else json.dumps(meta or manifest))
        save_file({**tensors, **shard_tensors}, str(shard))
        with pytest.raises(WorkbenchError, match=match):
            distributed.read_harvest(folder)

    refused("hooks must be a list of hook point names", {**manifest, "hooks": [{"a": 1}]})
    refused("nests too deeply", "[" * 100000 + "]" * 100000)
    refused("offsets do not count rows up from 0", offsets=torch.tensor(0))
    refused("offsets do not count rows up from 0", offsets=torch.zeros(0, dtype=torch.long))
    refused("offsets end at", offsets=torch.tensor([0, 10**12]))
    refused("unlike earlier shards'", hook_embed=tensors["hook_embed"][:, :5].contiguous())
