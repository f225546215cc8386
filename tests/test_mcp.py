"""The MCP server through the SDK's own client: stdio (a `workbench mcp` subprocess) and streamable HTTP
(the same server in this process on 127.0.0.1), numbers checked against the Python API."""
from __future__ import annotations

import functools
import json
import math
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Iterator

import anyio
import pytest
import torch
from anyio.from_thread import start_blocking_portal
from mcp.client import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

import workbench
from workbench import hooks, probes
from workbench.errors import WorkbenchError
from workbench.mcp_server import TOOLS, Limits, Workbench, build_server, http_app
from workbench.mcp_server.state import Session, Sessions
from workbench.synthetic import write_gguf

PROMPT = "The capital of France is"


class Client:
    """A blocking facade over one ClientSession running in a background event loop."""

    def __init__(self, portal, session: ClientSession):
        self.portal, self.session = portal, session

    def result(self, name: str, /, **arguments: Any):
        return self.portal.call(self.session.call_tool, name, arguments)

    def call(self, name: str, /, **arguments: Any) -> dict:
        result = self.result(name, **arguments)
        assert not result.is_error, result.content[0].text
        return result.structured_content

    def error(self, name: str, /, **arguments: Any) -> str:
        result = self.result(name, **arguments)
        assert result.is_error, f"{name} should have failed: {str(result.structured_content)[:300]}"
        return result.content[0].text


@asynccontextmanager
async def _session(transport):
    async with transport as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@contextmanager
def connect(transport) -> Iterator[Client]:
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(_session(transport)) as session:
        yield Client(portal, session)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="module")
def stdio(artifacts) -> Iterator[Client]:
    """`python -m workbench.cli mcp` as a subprocess, stopped when the client closes its stdin."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "workbench.cli", "mcp", "--artifacts",
                                                                  str(artifacts)])
    with connect(stdio_client(params)) as client:
        yield client


@pytest.fixture(scope="module")
def http_server(model, artifacts) -> Iterator[tuple[str, Workbench]]:
    """The server on 127.0.0.1 (a free port) in a thread of this process, sharing the session's model."""
    import uvicorn

    bench = Workbench(model, artifacts)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(http_app(build_server(bench), bench), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "HTTP server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/mcp", bench
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def http(http_server) -> Iterator[Client]:
    with connect(streamable_http_client(http_server[0])) as client:
        yield client


@pytest.fixture(params=["stdio", "http"])
def client(request) -> Client:
    return request.getfixturevalue(request.param)


def next_token_logprobs(model, prompt: str, **kwargs) -> torch.Tensor:
    """In float64, as workbench.results computes them (float32's log-softmax is off by ~1e-5 over this vocabulary)."""
    return model.forward(model.tokenize(prompt), **kwargs)[-1].double().log_softmax(-1)


@functools.cache
def baseline_logprobs(model) -> torch.Tensor:
    return next_token_logprobs(model, PROMPT)


# ------------------------------------------------------------------------------------------------ listing


def test_lists_every_tool_with_schemas(client):
    tools = {t.name: t for t in client.portal.call(client.session.list_tools).tools}
    assert set(tools) == set(TOOLS)
    assert tools["run"].input_schema["required"] == ["prompt"]
    assert "trace_id" in tools["run"].output_schema["properties"]
    assert all(t.description and t.output_schema for t in tools.values())


# ------------------------------------------------------------------------------------------- model tools


def test_model_tools(stdio, model):
    info = stdio.call("model_info")
    assert (info["n_layers"], info["d_model"], info["vocab_size"]) == (30, 576, 49152)
    assert info["tensor_formats"] == {"Q8_0": 1, "Q4_1": 210}
    listing = stdio.call("list_models")
    assert listing["current"] == "embedded" and listing["models"][0]["loaded"]
    points = stdio.call("list_hook_points", pattern="blocks.3.attn.hook_*")
    assert points["block_points"]["hook_resid_post"] == "[T, 576]"
    assert "blocks.3.attn.hook_pattern" in points["matching"]
    tokens = stdio.call("tokenize", text=PROMPT)
    assert tokens["ids"] == model.tokenize(PROMPT)
    assert "".join(tokens["tokens"]) == PROMPT


def test_run_batch_and_generate_batch(stdio, model):
    prompts = [PROMPT, "Hello", "Water boils at"]
    out = stdio.call("run_batch", prompts=prompts, top_k=3)
    for prompt, result in zip(prompts, out["results"]):
        logprobs = next_token_logprobs(model, prompt)
        assert result["tokens"] == model.token_texts(model.tokenize(prompt))
        assert [t["id"] for t in result["next_token"]["top"]] == logprobs.topk(3).indices.tolist()
        assert result["next_token"]["top"][0]["logprob"] == pytest.approx(logprobs.max().item(), abs=2e-4)
    generated = stdio.call("generate_batch", prompts=prompts, max_new_tokens=6)["generations"]
    assert [g["text"] for g in generated] == [model.generate(p, 6) for p in prompts]
    too_many = [PROMPT] * (Limits().max_batch + 1)
    assert "prompts must be between 1 and" in stdio.error("run_batch", prompts=too_many)
    assert "prompts must be between 1 and" in stdio.error("generate_batch", prompts=[])
    assert "this server takes at most" in stdio.error("run_batch", prompts=["a " * 600])


def test_load_model_switches_this_session_only(http_server, http, artifacts, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama", n_layers=2)
    config = checkpoint.config
    (artifacts / "models").mkdir()
    write_gguf(artifacts / "models" / "tiny.gguf", config, checkpoint.weights)
    tiny = {"name": "models/tiny.gguf", "path": "models/tiny.gguf", "loaded": False}
    assert tiny in http.call("list_models")["models"]
    with connect(streamable_http_client(http_server[0])) as other:
        info = other.call("load_model", path="models/tiny.gguf")
        assert (info["name"], info["n_layers"], info["d_model"]) == ("models/tiny.gguf", 2, config.d_model)
        assert other.call("list_models")["current"] == "models/tiny.gguf"
        assert other.call("run", prompt="the cat")["tokens"] == ["t", "he", " c", "at"]
        assert http.call("model_info")["n_layers"] == 30  # the other session still has the embedded model
        assert other.call("load_model", path="embedded")["n_layers"] == 30


def test_load_model_quantizes_a_checkpoint(http_server, artifacts, tiny_checkpoint):
    """A Hugging Face checkpoint in the artifacts folder, loaded as llama.cpp's Q4_K_M mix. Its rows of 64 and 96
    values take the mix's fallbacks: Q5_0 for Q4_K, and Q8_0 for the Q6_K of the output and of the last layer's value
    and down projections."""
    from test_loading import hf_model

    hf_model("llama", artifacts / "hf-tiny", tie=False)
    with connect(streamable_http_client(http_server[0])) as other:
        info = other.call("load_model", path="hf-tiny", quantize="q4_k_m")
        assert info["name"] == "hf-tiny@Q4_K_M" and info["n_layers"] == 2
        assert info["tensor_formats"] == {"Q5_0": 13, "Q8_0": 3}
        assert other.call("list_models")["current"] == "hf-tiny@Q4_K_M"
        assert "unknown quantization 'Q9_K'" in other.error("load_model", path="hf-tiny", quantize="Q9_K")
        quantized = tiny_checkpoint("llama", n_layers=1)
        write_gguf(artifacts / "quantized.gguf", quantized.config, quantized.weights)
        assert "applies to float checkpoints" in other.error("load_model", path="quantized.gguf", quantize="Q8_0")
        assert other.call("model_info")["name"] == "hf-tiny@Q4_K_M"  # a refused load leaves the session's model


def test_a_model_another_session_uses_stays(http_server, artifacts, tiny_checkpoint):
    """Two sessions on one model: when one of them moves on, the other keeps it (here the move is refused, since the
    shared model cannot make room under the limit of two resident models)."""
    checkpoint = tiny_checkpoint("llama", n_layers=1)
    for name in ("shared.gguf", "next.gguf"):
        write_gguf(artifacts / name, checkpoint.config, checkpoint.weights)
    with connect(streamable_http_client(http_server[0])) as first, \
            connect(streamable_http_client(http_server[0])) as second:
        assert first.call("load_model", path="shared.gguf")["name"] == second.call("load_model", path="shared.gguf")["name"]
        assert "resident (the limit)" in first.error("load_model", path="next.gguf")
        assert second.call("run", prompt="the cat")["tokens"] == ["t", "he", " c", "at"]
        assert first.call("model_info")["name"] == "shared.gguf"


def test_numerics_are_per_session(http_server, http, model):
    """One session switches to llama.cpp numerics: its runs match the Python API under them, its traces replay
    under them; the other session still computes exactly."""
    assert http.call("model_info")["numerics"] == "exact"
    with workbench.kernels.numerics("llamacpp"):
        expected = next_token_logprobs(model, PROMPT)
    with connect(streamable_http_client(http_server[0])) as other:
        assert other.call("set_numerics", mode="llamacpp")["numerics"] == "llamacpp"
        run = other.call("run", prompt=PROMPT, top_k=1)
        assert run["next_token"]["top"][0]["logprob"] == pytest.approx(expected.max().item(), abs=1e-5)
        exact_run = http.call("run", prompt=PROMPT, top_k=1)
        exact = exact_run["next_token"]["top"][0]["logprob"]
        assert exact == pytest.approx(baseline_logprobs(model).max().item(), abs=1e-5)
        assert exact != pytest.approx(expected.max().item(), abs=1e-5)
        # each trace replays under the numerics it was recorded in, whichever session's mode replays it
        assert other.call("replay_trace", trace_id=run["trace_id"])["verdict"] == "identical"
        assert http.call("replay_trace", trace_id=exact_run["trace_id"])["verdict"] == "identical"
        assert "llamacpp" in other.error("set_numerics", mode="ggml")
    assert workbench.kernels.get_numerics() == "exact"


# ------------------------------------------------------------------------------------------ run and read


def test_run_matches_forward_and_keeps_a_trace(client, model):
    out = client.call("run", prompt=PROMPT, record=["blocks.*.hook_resid_post"], top_k=5)
    logprobs = baseline_logprobs(model)
    top = out["next_token"]["top"]
    assert [t["id"] for t in top] == logprobs.topk(5).indices.tolist()
    assert top[0]["token"] == " Paris"
    assert top[0]["logprob"] == pytest.approx(float(logprobs.max()), abs=1e-4)
    assert len(out["recorded"]) == 30 and out["recorded"][29]["shape"] == [len(out["tokens"]), 576]

    trace = model.run(PROMPT, record=["blocks.20.hook_resid_post"])
    expected = trace.activations["blocks.20.hook_resid_post"]
    summary = out["recorded"][20]
    assert summary["position_norms"] == pytest.approx(expected.norm(dim=1).tolist(), rel=1e-4)
    piece = client.call("get_activation", trace_id=out["trace_id"], hook="blocks.20.hook_resid_post",
                        positions=[-1], feature_start=10, feature_stop=20)
    assert piece["shape"] == [1, 10]
    assert piece["values"] == pytest.approx(expected[-1, 10:20].tolist(), abs=1e-4)


def test_attention_pattern(stdio, model):
    out = stdio.call("attention_pattern", prompt=PROMPT, layer=4, heads=[0, 5])
    pattern = model.run(PROMPT, record=["blocks.4.attn.hook_pattern"]).activations["blocks.4.attn.hook_pattern"]
    assert out["query_positions"] == [len(out["tokens"]) - 1]
    assert torch.tensor(out["pattern"]) == pytest.approx(pattern[[0, 5]][:, -1:], abs=1e-5)


def test_lens_track_and_attribution(http, model):
    lens = http.call("logit_lens", prompt=PROMPT, k=3)
    expected = probes.logit_lens(model, PROMPT, k=3)
    assert [r["layer"] for r in lens["rows"]] == list(range(30)) and lens["positions"] == [4]
    for row in lens["rows"]:
        assert [t["id"] for t in row["top"]] == expected.top_tokens(row["layer"], -1)
        assert [t["prob"] for t in row["top"]] == pytest.approx(expected.probs[row["layer"], -1].tolist(), abs=1e-5)

    track = http.call("track_token", prompt=PROMPT, tokens=[" Paris", " London"])
    race = expected.track_race([" Paris", " London"])
    paris = track["series"][0]
    assert paris["token"] == " Paris" and paris["ranks"] == race.ranks[0, :, -1].tolist()
    assert paris["probs"] == pytest.approx(race.probs[0, :, -1].tolist(), rel=1e-4, abs=1e-9)
    assert paris["ranks"][paris["first_top1_layer"]] == 0 and 0 not in paris["ranks"][:paris["first_top1_layer"]]

    dla = http.call("direct_logit_attribution", prompt=PROMPT, target=" Paris", baseline=" London", top=5)
    reference = probes.direct_logit_attribution(model, PROMPT, " Paris", " London")
    assert dla["logit"] == pytest.approx(reference.logit, abs=1e-4) and dla["error"] < 1e-3
    assert [(c["label"], c["contribution"]) for c in dla["top"]] == [
        (label, pytest.approx(value, abs=1e-4)) for label, value in reference.top(5)]
    layer_sums = [r["attn"] + r["mlp"] for r in dla["by_layer"]]
    assert dla["embed"] + sum(layer_sums) == pytest.approx(dla["total"], abs=1e-4)


# ------------------------------------------------------------------------------------------------- edits


def _check_edit(out: dict, model, interventions: list) -> None:
    """An edit tool's baseline and edited distributions equal Model.forward without and with the interventions."""
    before, after = baseline_logprobs(model), next_token_logprobs(model, PROMPT, interventions=interventions)
    for key, logprobs in (("baseline", before), ("edited", after)):
        top = out[key]["top"]
        expected = logprobs.topk(len(top))
        assert [t["id"] for t in top] == expected.indices.tolist()
        assert [t["logprob"] for t in top] == pytest.approx(expected.values.tolist(), abs=1e-4)
    assert out["kl"] == pytest.approx(float((before.exp() * (before - after)).sum()), abs=1e-4)


def test_steer_ablate_patch_and_combinations(stdio, model):
    vector = torch.randn(576, generator=torch.Generator().manual_seed(0)).tolist()
    steer = {"type": "steer", "hook": "blocks.10.hook_resid_post", "vector": vector, "scale": 8.0}
    out = stdio.call("steer", prompt=PROMPT, hook="blocks.10.hook_resid_post", vector=vector, scale=8.0,
                     targets=[" Paris"], top_k=5)
    _check_edit(out, model, [steer])
    assert out["targets"][0]["token"] == " Paris" and out["interventions"][0]["vector"]["size"] == 576

    out = stdio.call("ablate", prompt=PROMPT, hook="blocks.8.attn.hook_z", heads=[1, 2], top_k=5)
    _check_edit(out, model, [{"type": "zero_ablate", "hook": "blocks.8.attn.hook_z", "heads": [1, 2]}])

    out = stdio.call("patch", prompt=PROMPT, hook="blocks.12.hook_resid_post", donor="The capital of Italy is",
                     top_k=5)
    patch = {"type": "patch", "hook": "blocks.12.hook_resid_post", "donor": "The capital of Italy is"}
    _check_edit(out, model, [patch])
    assert out["edited"]["top"][0]["token"] == " Rome" and out["top1_changed"]

    combined = [{"type": "scale", "hook": "blocks.3.mlp.hook_post", "factor": 0.5},
                {"type": "zero_ablate", "hook": "blocks.5.hook_attn_out", "positions": [1]}]
    out = stdio.call("run_with_interventions", prompt=PROMPT, interventions=combined, top_k=5)
    _check_edit(out, model, combined)


def test_mean_ablation_over_reference_prompts(http, model):
    """Reference prompts are texts or conversations (rendered through the chat template)."""
    conversation = [{"role": "user", "content": "Name a capital."}]
    hook, references = "blocks.6.hook_mlp_out", ["The capital of Spain is", "A cat sat on the mat", conversation]
    out = http.call("ablate", prompt=PROMPT, hook=hook, method="mean", reference_prompts=references, top_k=5)
    traces = [model.run(p, record=[hook]) for p in references]
    assert len(traces[2].tokens) > 10  # the template's tokens around the message
    _check_edit(out, model, [hooks.MeanAblate.from_traces(hook, traces)])


def test_generate_with_and_without_interventions(http, model):
    plain = http.call("generate", prompt=PROMPT, max_new_tokens=4)
    assert plain["text"] == model.generate(PROMPT, 4)
    ablate = [{"type": "zero_ablate", "hook": "blocks.*.hook_mlp_out", "positions": "generated"}]
    edited = http.call("generate", prompt=PROMPT, max_new_tokens=4, interventions=ablate)
    assert edited["ids"] == [t for t, _ in model.stream(PROMPT, 4, interventions=ablate)]
    assert edited["ids"][0] == plain["ids"][0] and edited["ids"] != plain["ids"]


# ---------------------------------------------------------------------------------------------- KV cache


def test_kv_cache_surgery(http, model):
    created = http.call("kv_create", prompt=PROMPT, top_k=3)
    cache = model.new_cache()
    logprobs = model.forward(model.tokenize(PROMPT), cache=cache)[-1].double().log_softmax(-1)
    assert created["next_token"]["top"][0]["logprob"] == pytest.approx(float(logprobs.max()), abs=1e-5)
    assert created["length"] == cache.length and created["positions"] == cache.positions.tolist()
    cache_id = created["cache_id"]

    layer = http.call("kv_get_layer", cache_id=cache_id, layer=7, start=1, stop=3)
    keys, values = cache.get(7)
    assert layer["shape"] == [3, 2, 64]
    assert layer["keys"] == pytest.approx(keys[:, 1:3].flatten().tolist(), abs=1e-6)
    assert layer["values"] == pytest.approx(values[:, 1:3].flatten().tolist(), abs=1e-6)

    clone = http.call("kv_clone", cache_id=cache_id)["cache_id"]
    continued = http.call("kv_generate", cache_id=clone, prompt=" and", max_new_tokens=3)
    reference = cache.clone()
    expected = [t for t, _ in model.stream(model.tokenize(" and", add_bos=False), 3, cache=reference)]
    assert continued["generation"]["ids"] == expected and continued["length"] == reference.length
    assert http.call("kv_get_layer", cache_id=cache_id, layer=0)["shape"][1] == cache.length  # original untouched

    cleared = http.call("kv_clone", cache_id=cache_id)["cache_id"]
    http.call("kv_clear_layer", cache_id=cleared, layer=7)
    assert not any(http.call("kv_get_layer", cache_id=cleared, layer=7)["keys"])
    http.call("kv_set_layer", cache_id=cleared, layer=7, source_cache_id=cache_id)
    assert http.call("kv_get_layer", cache_id=cleared, layer=7)["keys"] == pytest.approx(keys.flatten().tolist())

    n = cache.length
    head = http.call("kv_clone_positions", cache_id=cache_id, start=0, stop=n - 1)
    assert head["length"] == n - 1 and head["tokens"] == created["tokens"][:-1]
    assert http.call("kv_truncate", cache_id=cleared, length=2)["length"] == 2
    deleted = http.call("kv_delete_positions", cache_id=cache_id, slots=[1])
    assert deleted["positions"] == [0] + list(range(2, n))
    http.call("kv_set_layer", cache_id=head["cache_id"], layer=0, keys=[0.5] * (3 * (n - 1) * 64),
              values=[0.0] * (3 * (n - 1) * 64))
    assert set(http.call("kv_get_layer", cache_id=head["cache_id"], layer=0)["keys"]) == {0.5}
    for released in (cache_id, clone, cleared, head["cache_id"]):
        assert http.call("kv_release", cache_id=released)["released"] == [released]
    assert "unknown cache id" in http.error("kv_get_layer", cache_id=cache_id, layer=0)


# ---------------------------------------------------------------------------------------------- bad input


def test_invalid_arguments_are_tool_errors_and_the_server_keeps_serving(client):
    vector = [0.0] * 576
    assert "layer 99" in client.error("run", prompt=PROMPT, record=["blocks.99.hook_resid_post"])
    assert "did you mean" in client.error("steer", prompt=PROMPT, hook="blocks.3.hook_resid_pots", vector=vector)
    assert "shape (576,)" in client.error("steer", prompt=PROMPT, hook="blocks.3.hook_resid_post", vector=[1.0] * 5)
    assert "finite" in client.error("steer", prompt=PROMPT, hook="blocks.3.hook_resid_post", vector=vector,
                                    scale="NaN")
    assert client.error("steer", prompt=PROMPT, hook="blocks.3.hook_resid_post", vector=[math.nan] * 576)
    assert "unknown intervention type" in client.error("run_with_interventions", prompt=PROMPT,
                                                       interventions=[{"type": "explode", "hook": "hook_embed"}])
    assert "unknown trace id 'trace-nope'" in client.error("get_activation", trace_id="trace-nope", hook="hook_embed")
    assert "unknown cache id" in client.error("kv_truncate", cache_id="cache-nope", length=1)
    assert "takes at most 512" in client.error("run", prompt="word " * 600)
    assert "max_new_tokens must be between 1 and 256" in client.error("generate", prompt=PROMPT,
                                                                       max_new_tokens=100_000)
    assert "top_k must be between 1 and 50" in client.error("run", prompt=PROMPT, top_k=10_000)
    assert client.error("run", prompt=PROMPT, top_k="many")  # fails the input schema
    assert client.error("no_such_tool")
    assert client.call("tokenize", text="still serving")["tokens"] == ["still", " serving"]


def test_non_finite_results_are_null_and_fit_the_output_schema(http):
    """A steer at 1e308 overflows the residual: the distributions' numbers become NaN or infinite, which travel as
    null, and the client (which validates structured content against the output schema) accepts the result."""
    vector = [1.0] * 576
    out = http.call("steer", prompt=PROMPT, hook="blocks.3.hook_resid_post", vector=vector, scale=1e308,
                    targets=[" Paris"])
    numbers = [out["kl"], out["edited"]["entropy"], *(t["logprob"] for t in out["edited"]["top"]),
               *(c["edited_logprob"] for c in out["targets"])]
    assert None in numbers


def test_unknown_arguments_are_refused_and_bad_ones_explained_in_one_line(http):
    """A misspelt argument is refused, not dropped (ablate would otherwise ablate every position), and a value of the
    wrong type is one line naming the field, without pydantic's documentation link."""
    tools = {t.name: t for t in http.portal.call(http.session.list_tools).tools}
    assert all(t.input_schema.get("additionalProperties") is False for t in tools.values())
    message = http.error("ablate", prompt=PROMPT, hook="blocks.3.hook_resid_post", positons=[0])
    assert "no argument 'positons'" in message and "positions" in message
    message = http.error("run", prompt=PROMPT, top_k="many")
    assert "top_k: " in message and "\n" not in message and "errors.pydantic.dev" not in message
    message = http.error("run")
    assert "prompt: Field required" in message and "\n" not in message


def test_paths_outside_the_artifacts_folder_are_refused(client, artifacts, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.gguf").write_bytes(b"GGUF")
    (artifacts / "escape").unlink(missing_ok=True)
    (artifacts / "escape").symlink_to(outside)
    for path in ("../outside/model.gguf", str(outside / "model.gguf"), "escape/model.gguf", "a/../../x.gguf"):
        assert "outside the artifacts folder" in client.error("load_model", path=path)


def test_results_are_size_bounded(http):
    trace = http.call("run", prompt="The capital of France is Paris.",
                      record=["blocks.0.mlp.hook_post", "blocks.0.attn.hook_pattern"])
    assert trace["recorded"][0]["shape"] == [7, 1536]
    message = http.error("get_activation", trace_id=trace["trace_id"], hook="blocks.0.mlp.hook_post")
    assert "at most 8,192 are returned" in message
    piece = http.call("get_activation", trace_id=trace["trace_id"], hook="blocks.0.mlp.hook_post", positions=[0, -1])
    assert piece["shape"] == [2, 1536] and piece["positions"] == [0, 6]
    pattern = http.call("get_activation", trace_id=trace["trace_id"], hook="blocks.0.attn.hook_pattern", heads=[0])
    assert pattern["shape"] == [1, 7, 7] and pattern["values"][1] == 0.0  # causal mask
    assert "more than the 8,192 numbers" in http.error("track_token", prompt=PROMPT, tokens=[" a"] * 50,
                                                       positions=[0, 1, 2, 3, 4])
    assert "at most 8,192 are returned" in http.error("attention_pattern", prompt="word " * 300, layer=0,
                                                      query_positions=list(range(10)))


# ------------------------------------------------------------------------------------- probes and vectors


def test_datasets_probes_and_depth_sweep(http, artifacts, model):
    records = [{"text": t, "label": l} for t, l in [
        ("I loved this film.", "pos"), ("I hated this film.", "neg"), ("What a wonderful day.", "pos"),
        ("What a dreadful day.", "neg"), ("The food was delicious.", "pos"), ("The food was disgusting.", "neg"),
        ("She is a brilliant friend.", "pos"), ("She is a terrible friend.", "neg")]]
    (artifacts / "mood.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    listed = {d["name"]: d for d in http.call("list_datasets")["datasets"]}
    assert set(probes.list_datasets()) < set(listed) and listed["mood.jsonl"]["n_prompts"] == 8
    assert listed["happy_sad"]["kind"] == "pairs"

    dataset = probes.load_dataset(artifacts / "mood.jsonl")
    probe = http.call("probe_train", dataset="mood.jsonl", hook="blocks.12.hook_resid_post", test_size=0.5)
    reference = probes.train_probe(model, dataset, "blocks.12.hook_resid_post", test_size=0.5)
    assert (probe["accuracy"], probe["ci"], probe["n_test"]) == (reference.accuracy, list(reference.ci), 4)
    prompts = ["A lovely, happy evening.", "A miserable, awful evening.",
               [{"role": "user", "content": "What a lovely, happy evening!"}]]
    applied = http.call("probe_apply", probe_id=probe["probe_id"], prompts=prompts)
    expected = reference.predict_proba(model, prompts)
    assert [prediction["prompt"] for prediction in applied["predictions"]] == prompts
    for prediction, row in zip(applied["predictions"], expected):
        assert [prediction["probs"][c] for c in reference.classes] == pytest.approx(row.tolist(), abs=1e-6)

    sweep = http.call("depth_sweep", dataset="mood.jsonl", layers=[2, 12, 25], folds=2)
    expected_sweep = probes.depth_sweep(model, dataset, layers=[2, 12, 25], folds=2)
    assert [l["accuracy"] for l in sweep["layers"]] == [expected_sweep.accuracy[l] for l in (2, 12, 25)]
    assert sweep["peak_layer"] == expected_sweep.peak_layer
    assert "between 1 and 128" in http.error("probe_apply", probe_id=probe["probe_id"], prompts=["Hi."] * 129)
    assert "outside the artifacts folder" in http.error("probe_train", dataset="../mood.jsonl", hook="hook_embed")


def test_steering_vectors_and_control_vector_files(http, artifacts, model):
    vector = http.call("steering_vector_from_dataset", dataset="happy_sad", layers=[8, 11], sample=4)
    reference = probes.steering_vector(model, probes.load_dataset("happy_sad").sample(4), [8, 11])
    assert vector["hooks"] == ["blocks.8.hook_resid_post", "blocks.11.hook_resid_post"]
    assert vector["norms"] == pytest.approx(list(reference.norms().values()), rel=1e-5)

    exported = http.call("export_control_vector", vector_id=vector["vector_id"], path="vectors/happy.gguf", scale=2.0)
    on_disk = probes.SteeringVector.from_control_vector(artifacts / "vectors" / "happy.gguf", model)
    assert exported["path"] == "vectors/happy.gguf" and on_disk.layers == [8, 11]
    assert torch.equal(on_disk.directions[11], 2.0 * reference.directions[11])
    imported = http.call("import_control_vector", path="vectors/happy.gguf")
    assert imported["norms"] == pytest.approx([2 * n for n in vector["norms"]], rel=1e-5)

    out = http.call("steer", prompt="Today I feel so", vector_id=imported["vector_id"], scale=0.5, top_k=5)
    applied = [{"type": "steer", "hook": h, "vector": on_disk.directions[l], "scale": 0.5}
               for h, l in zip(imported["hooks"], (8, 11))]
    before = next_token_logprobs(model, "Today I feel so")
    after = next_token_logprobs(model, "Today I feel so", interventions=applied)
    assert [t["id"] for t in out["edited"]["top"]] == after.topk(5).indices.tolist()
    assert out["kl"] == pytest.approx(float((before.exp() * (before - after)).sum()), abs=1e-4)
    message = http.error("generate", prompt="Today I feel so", interventions=[
        {"type": "steer", "hook": "blocks.3.hook_resid_post", "vector": {"id": vector["vector_id"]}}])
    assert "not 'blocks.3.hook_resid_post'" in message
    assert "outside the artifacts folder" in http.error("export_control_vector", vector_id=vector["vector_id"],
                                                        path="../happy.gguf")


# --------------------------------------------------------------------------------------------- artifacts


def test_save_load_replay_compare_and_resources(http, artifacts, model):
    steer = [{"type": "scale", "hook": "blocks.9.hook_resid_post", "factor": 1.5}]
    edited = http.call("run_with_interventions", prompt=PROMPT, interventions=steer,
                       record=["blocks.20.hook_resid_post"])
    saved = http.call("save_trace", trace_id=edited["trace_id"], path="runs/scaled")
    assert saved["path"] == "runs/scaled" and saved["bytes"] > 0
    on_disk = hooks.load_trace(artifacts / "runs" / "scaled")
    assert on_disk.interventions == model.run(PROMPT, interventions=steer).interventions
    assert torch.equal(on_disk.logits, model.run(PROMPT, interventions=steer).logits)

    loaded = http.call("load_trace", path="runs/scaled")
    assert loaded["path"] == "runs/scaled" and loaded["recorded"] == {"blocks.20.hook_resid_post": [5, 576]}
    replayed = http.call("replay_trace", trace_id=loaded["trace_id"])
    assert replayed["verdict"] == "identical" and replayed["tensors_compared"] == 2

    comparison = http.call("compare_traces", a=edited["baseline_trace_id"], b=loaded["trace_id"])
    assert comparison["kl"] == pytest.approx(edited["kl"], abs=1e-5)
    assert comparison["activations"][0]["hook"] == "blocks.20.hook_resid_post"
    assert comparison["activations"][0]["max_abs_diff"] > 0

    listed = {t["trace_id"]: t for t in http.call("list_traces")["traces"]}
    assert listed[loaded["trace_id"]]["interventions"] == steer
    resource = http.portal.call(http.session.read_resource, listed[loaded["trace_id"]]["uri"])
    assert json.loads(resource.contents[0].text)["prompt"] == PROMPT
    assert http.call("release", ids=[loaded["trace_id"]])["released"] == [loaded["trace_id"]]
    assert "unknown trace id" in http.error("replay_trace", trace_id=loaded["trace_id"])
    for path in ("../escaped", "/tmp/escaped", "runs/../../escaped"):
        assert "outside the artifacts folder" in http.error("save_trace", trace_id=edited["trace_id"], path=path)
        assert "outside the artifacts folder" in http.error("load_trace", path=path)
    assert "not a trace artifact" in http.error("load_trace", path="runs")


def test_patching_sweep(http, model):
    clean, corrupt = "The capital of Italy is", PROMPT
    out = http.call("patching_sweep", clean=clean, corrupt=corrupt, layers=[0, 15, 29], positions=[-2, -1],
                    answers=[" Rome", " Paris"])
    expected = hooks.patching_sweep(model, clean, corrupt, layers=[0, 15, 29], positions=[-2, -1],
                                    answers=(" Rome", " Paris"), progress=False)
    assert out["labels"] == expected.labels
    assert torch.tensor(out["grid"]) == pytest.approx(expected.grid, abs=1e-4)
    assert "the limit is 256" in http.error("patching_sweep", clean=clean, corrupt=corrupt, over=["layers", "heads"])
    # attribution patching estimates every cell from one backward: no cell limit
    out = http.call("patching_sweep", clean=clean, corrupt=corrupt, over=["layers", "heads"], method="attribution")
    expected = hooks.attribution_patching(model, clean, corrupt, over=("layers", "heads"))
    assert out["method"] == "attribution patching" and len(out["grid"]) * len(out["grid"][0]) > 256
    assert torch.tensor(out["grid"]) == pytest.approx(expected.grid, abs=1e-4)
    out = http.call("patching_sweep", clean=clean, corrupt=corrupt, layers=[0, 29], method="attribution", steps=3)
    expected = hooks.attribution_patching(model, clean, corrupt, layers=[0, 29], steps=3)
    assert out["method"] == "attribution patching, integrated gradients (3 steps)"
    assert torch.tensor(out["grid"]) == pytest.approx(expected.grid, abs=1e-4)
    assert "steps applies to method='attribution'" in http.error("patching_sweep", clean=clean, corrupt=corrupt,
                                                                 layers=[0], steps=3)
    out = http.call("patching_sweep", clean=clean, corrupt=corrupt, layers=[0, 29], method="attribution", verify=2)
    expected = hooks.attribution_patching(model, clean, corrupt, layers=[0, 29], verify=2)
    assert [cell["index"] for cell in out["verified"]] == [cell["index"] for cell in expected.verified()]
    assert [cell["patched"] for cell in out["verified"]] == pytest.approx(
        [cell["patched"] for cell in expected.verified()], abs=1e-4)
    assert "verify applies to method='attribution'" in http.error("patching_sweep", clean=clean, corrupt=corrupt,
                                                                  layers=[0], verify=1)
    assert "verify patches 300 cells" in http.error("patching_sweep", clean=clean, corrupt=corrupt,
                                                    method="attribution", verify=300)


def test_dataset_patching(http, model):
    """The shipped ioi pairs by name (a sample) or pairs given inline: the grid dataset_patching gives."""
    out = http.call("dataset_patching", dataset="ioi", sample=3, over=["layers", "heads"], layers=[0, 9])
    sampled = probes.load_dataset("ioi").sample(3)
    prompts, answers = sampled.patching()
    expected = hooks.dataset_patching(model, prompts, method="attribution", over=("layers", "heads"), layers=[0, 9],
                                      answers=answers, progress=False)
    assert out["pairs"] == 3 and out["method"] == "attribution patching" and out["labels"] == expected.labels
    assert torch.tensor(out["grid"]) == pytest.approx(expected.grid, abs=1e-4)
    pairs = [{"clean": c, "corrupt": x, "answers": list(a)} for (c, x), a in zip(prompts[:2], answers[:2])]
    out = http.call("dataset_patching", pairs=pairs, method="activation", layers=[0], positions=[-4, -1])
    expected = hooks.dataset_patching(model, prompts[:2], layers=[0], positions=[-4, -1], answers=answers[:2],
                                      progress=False)
    assert out["method"] == "activation patching" and out["pairs"] == 2
    assert torch.tensor(out["grid"]) == pytest.approx(expected.grid, abs=1e-4)
    for args, message in [
        (dict(), "give a dataset or pairs"),
        (dict(dataset="ioi", pairs=pairs), "give a dataset or pairs"),
        (dict(dataset="happy_sad"), "is a pairs dataset; patching takes"),
        (dict(pairs=pairs, sample=2), "sample applies to a dataset"),
        (dict(pairs=[pairs[0], {"clean": prompts[1][0], "corrupt": prompts[1][1]}]), "pair 1: give answers for every"),
        (dict(pairs=[{**pairs[0], "answer": [" a", " b"]}]), "answer"),
        (dict(pairs=[pairs[0], {**pairs[1], "corrupt": "Paris"}]), "pair 1: clean and corrupt prompts must have"),
        (dict(dataset="ioi", sample=3, method="activation"), "runs 1260 forwards; the limit is 256"),
        (dict(dataset="ioi", sample=8, steps=40), "runs 320 forwards; the limit is 256"),
        (dict(dataset="ioi", sample=8, steps=2, verify=31), "runs 264 forwards; the limit is 256"),
    ]:
        assert message in http.error("dataset_patching", **args), args


# ---------------------------------------------------------------------------------- sessions, concurrency


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if not k.endswith("_id")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def test_concurrent_clients_get_the_sequential_results(http_server, http):
    url = http_server[0]
    vector = torch.randn(576, generator=torch.Generator().manual_seed(1)).tolist()
    calls = {
        "a": [("run", {"prompt": PROMPT, "record": ["blocks.5.hook_resid_post"], "top_k": 5}),
              ("steer", {"prompt": PROMPT, "hook": "blocks.5.hook_resid_post", "vector": vector, "scale": 4.0}),
              ("generate", {"prompt": PROMPT, "max_new_tokens": 3})],
        "b": [("run", {"prompt": "The capital of Italy is", "top_k": 5}),
              ("ablate", {"prompt": "The capital of Italy is", "hook": "blocks.2.attn.hook_z", "heads": [0]}),
              ("kv_create", {"prompt": "Once upon a time"})],
    }
    sequential = {name: [_without_ids(http.call(tool, **args)) for tool, args in sequence]
                  for name, sequence in calls.items()}

    async def concurrently() -> dict:
        results: dict = {}

        async def client(name: str) -> None:
            async with _session(streamable_http_client(url)) as session:
                results[name] = [_without_ids((await session.call_tool(tool, args)).structured_content)
                                 for tool, args in calls[name]]

        async with anyio.create_task_group() as tasks:
            for name in calls:
                tasks.start_soon(client, name)
        return results

    assert http.portal.call(concurrently) == sequential


def test_sessions_are_isolated_and_released_on_disconnect(http_server, http):
    url, bench = http_server
    http.call("tokenize", text="hello")
    before = set(bench.sessions.keys())
    with connect(streamable_http_client(url)) as other:
        trace_id = other.call("run", prompt="Hello there")["trace_id"]
        (key,) = set(bench.sessions.keys()) - before
        assert "unknown trace id" in http.error("get_activation", trace_id=trace_id, hook="hook_embed")
        assert other.call("list_traces")["traces"][0]["trace_id"] == trace_id
    assert key not in bench.sessions.keys() and before <= set(bench.sessions.keys())


def test_cancelled_generation_stops_at_the_next_token(http):
    created = http.call("kv_create", prompt=PROMPT)

    async def cancel_after(seconds: float) -> None:
        with anyio.move_on_after(seconds) as scope:
            await http.session.call_tool("kv_generate", {"cache_id": created["cache_id"], "prompt": " and",
                                                         "max_new_tokens": 256})
        assert scope.cancelled_caught

    http.portal.call(cancel_after, 2.0)
    length = http.call("kv_clone", cache_id=created["cache_id"])["length"]
    assert created["length"] < length < created["length"] + 256  # it stopped early, between tokens
    assert http.call("tokenize", text="still serving")["tokens"] == ["still", " serving"]


def test_idle_sessions_are_released(tiny_model):
    from mcp.client import Client as InProcessClient

    model = tiny_model("llama", n_layers=2)
    bench = Workbench(model, "artifacts-unused", Limits(idle_seconds=1.0))

    async def scenario() -> None:
        async with InProcessClient(build_server(bench), mode="legacy") as client:
            trace_id = (await client.call_tool("run", {"prompt": "the cat"})).structured_content["trace_id"]
            assert len(bench.sessions.keys()) == 1
            await anyio.sleep(2.5)  # the sweep runs once a second
            assert bench.sessions.keys() == []
            result = await client.call_tool("get_activation", {"trace_id": trace_id, "hook": "hook_embed"})
            assert result.is_error and "unknown trace id" in result.content[0].text

    anyio.run(scenario)


def test_a_busy_session_is_never_idle():
    sessions = Sessions(Limits(idle_seconds=1.0), "model", "exact")
    with sessions.using("a") as session:
        session.put("trace", object())
        assert sessions.expire_idle(now=time.monotonic() + 60) == []  # a call longer than the idle limit
    assert sessions.expire_idle(now=time.monotonic() + 0.5) == []  # the idle clock starts when the call ends
    with sessions.using("a") as again:
        assert again is session and len(again.entries) == 1
    assert sessions.expire_idle(now=time.monotonic() + 60) == ["a"] and sessions.keys() == []


def test_a_new_session_starts_in_the_servers_numerics_whatever_block_it_is_made_in():
    """Sessions are made as a request arrives: a new one starts in the server's numerics, whatever numerics block the
    code that makes it runs in."""
    sessions = Sessions(Limits(), "model", "exact")
    with workbench.kernels.numerics("llamacpp"):
        with sessions.using("new") as session:
            assert session.numerics == "exact" and session.model_name == "model"


def test_a_call_waiting_for_the_model_past_the_idle_limit_keeps_its_session(tiny_model):
    """A session with a trace makes a second call while another session's long call holds the model. The call waits
    three idle limits (and sweeps), then runs: the first trace is still there, beside the second."""
    from mcp.client import Client as InProcessClient

    model = tiny_model("llama", n_layers=2)
    # an idle limit well above the moment between the two calls, which a loaded machine can stretch past 0.3 s
    bench = Workbench(model, "artifacts-unused", Limits(idle_seconds=1.0))
    answers = {}

    async def run(client, name: str) -> None:
        answers[name] = (await client.call_tool("run", {"prompt": "the cat"})).structured_content["trace_id"]

    async def scenario() -> None:
        async with InProcessClient(build_server(bench), mode="legacy") as client:
            await run(client, "first")
            bench.lock.acquire()
            released = False
            try:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(run, client, "second")
                    await anyio.sleep(3.5)
                    bench.lock.release()
                    released = True
            finally:
                if not released:
                    bench.lock.release()
            listed = (await client.call_tool("list_traces", {})).structured_content["traces"]
            answers["listed"] = {t["trace_id"] for t in listed}

    anyio.run(scenario)
    assert answers["listed"] == {answers["first"], answers["second"]}


# ------------------------------------------------------------------------------------------ worked example


def test_full_experiment_through_tools_alone(stdio, artifacts):
    """The worked example of docs/mcp.md: lens -> find a layer -> steer -> verify -> save an artifact -> replay."""
    prompt = "Today I feel so"
    # 1. lens: where does the model start considering " happy" for the next token?
    track = stdio.call("track_token", prompt=prompt, tokens=[" happy", " sad"])
    happy = track["series"][0]
    layer = next(l for l, rank in enumerate(happy["ranks"]) if rank < 1000)
    assert 5 <= layer <= 20  # mid-depth, well before the last layers decide the word
    # 2. steer there with a happy-minus-sad direction from the shipped pairs
    vector = stdio.call("steering_vector_from_dataset", dataset="happy_sad", layers=[layer], sample=8)
    steered = stdio.call("steer", prompt=prompt, vector_id=vector["vector_id"], scale=4.0,
                         targets=[" happy", " sad"])
    # 3. verify: the happy-vs-sad logit gap widens, and the generated text changes
    up, down = steered["targets"]
    assert up["delta"] - down["delta"] > 1.0 and steered["kl"] > 0.1
    plain = stdio.call("generate", prompt=prompt, max_new_tokens=6)
    edited = stdio.call("generate", prompt=prompt, max_new_tokens=6,
                        interventions=[{"type": "steer", "vector": {"id": vector["vector_id"]}, "scale": 4.0}])
    assert edited["text"] != plain["text"]
    # 4. save the steered run as an artifact, 5. load it back and replay it
    saved = stdio.call("save_trace", trace_id=steered["trace_id"], path=f"experiments/happy-L{layer}")
    assert (artifacts / saved["path"] / "manifest.json").is_file()
    loaded = stdio.call("load_trace", path=saved["path"])
    assert loaded["interventions"][0]["hook"] == f"blocks.{layer}.hook_resid_post"
    replay = stdio.call("replay_trace", trace_id=loaded["trace_id"])
    assert replay["verdict"] == "identical" and replay["max_abs_deviation"] == 0.0


def test_session_memory_and_object_limits():
    session = Session("key", Limits(max_session_bytes=6000, max_objects=3), "embedded")
    trace = hooks.Trace(prompt="x", ids=[1], tokens=["x"], logits=torch.zeros(1, 1000))  # 4000 bytes of logits
    first = session.put("trace", trace)
    with pytest.raises(WorkbenchError, match="free some"):
        session.put("trace", trace)
    session.release(first)
    ids = [session.put("vector", object()) for _ in range(3)]
    assert len(set(ids)) == 3 and all(i.startswith("vector-") for i in ids)
    with pytest.raises(WorkbenchError, match="limits are 3 objects"):
        session.put("vector", object())
    with pytest.raises(WorkbenchError, match="unknown trace id"):
        session.get("trace", ids[0])  # an id of another kind


def test_sae_tools(http, artifacts, model):
    sae = probes.init_sae("topk", 576, 512, "blocks.6.hook_resid_post", k=16, seed=4)
    sae.save(artifacts / "saes" / "l6")
    info = http.call("sae_load", path="saes/l6")
    assert (info["architecture"], info["hook"], info["d_sae"], info["k"]) == ("topk", "blocks.6.hook_resid_post", 512,
                                                                               16)
    assert info["path"] == "saes/l6"
    features = http.call("sae_features", prompt=PROMPT, sae_id=info["sae_id"], top_k=3)["tokens"]
    expected = probes.top_features(model, sae, PROMPT, 3)
    assert [[f for f, _ in t["features"]] for t in features] == [[f for f, _ in r["features"]] for r in expected]
    feature = int(features[-1]["features"][0][0])

    prompts = ["The capital of Spain is", "A cat sat on the mat", PROMPT,
               [{"role": "user", "content": "The capital of France is?"}]]
    examples = http.call("feature_top_examples", sae_id=info["sae_id"], feature=feature, prompts=prompts, n=3)
    stats = probes.feature_stats(model, sae, [model.to_ids(p) for p in prompts], 3)
    assert examples["density"] == pytest.approx(float(stats.density[feature]))
    assert [e["activation"] for e in examples["examples"]] == pytest.approx(
        [e["activation"] for e in stats.examples(model, feature)], abs=1e-5)
    assert examples["promoted"][0][0] == probes.promoted_tokens(model, sae, feature)["promoted"][0][0]

    out = http.call("feature_steer", prompt=PROMPT, sae_id=info["sae_id"], feature=feature, scale=20.0, top_k=5)
    _check_edit(out, model, [probes.FeatureSteer(sae, feature, 20.0)])
    assert out["interventions"][0]["sae"].endswith("l6") and out["kl"] > 0
    by_path = [{"type": "feature_ablate", "sae": "saes/l6", "feature": feature}]
    out = http.call("run_with_interventions", prompt=PROMPT, interventions=by_path, top_k=5)
    _check_edit(out, model, [probes.FeatureAblate(sae, feature)])

    assert "out of range 0..511" in http.error("feature_steer", prompt=PROMPT, sae_id=info["sae_id"], feature=512)
    assert "artifacts folder" in http.error("sae_load", path="/etc")
    assert "max_seconds" in http.error("sae_train", hook="blocks.6.hook_resid_post", path="saes/new", max_seconds=1e6)
    trained = http.call("sae_train", hook="blocks.6.hook_resid_post", path="saes/new", d_sae=64, k=4,
                        prompts=prompts * 4, max_seconds=5, batch_tokens=16)
    assert trained["summary"]["steps"] >= 1 and (artifacts / "saes" / "new" / "cfg.json").is_file()
    assert trained["summary"]["heldout"]["tokens"] > 0


def test_adapter_tools(http, model, artifacts):
    """A llama.cpp LoRA adapter next to the shared model: loaded, listed, and compared against the base with the
    numbers of probes.compare_models."""
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).parent / "fixtures" / "llamacpp_lora_adapter.gguf", artifacts / "lora.gguf")
    try:
        info = http.call("load_adapter", path="lora.gguf", name="ft")
        assert (info["path"], info["format"], info["rank"], info["layers"]) == ("lora.gguf", "gguf", 4, [0, 14, 29])
        assert http.call("list_adapters")["adapters"] == [info]
        prompts = [PROMPT, "Water boils at"]
        out = http.call("compare_models", prompts=prompts, adapter="ft", top=3)
        expected = probes.compare_models(model, prompts, "ft", k=3)
        assert (out["a"], out["b"], out["prompts"]) == ("adapter 'ft'", "base", 2)
        assert out["mean_kl"] == pytest.approx(expected.mean_kl, rel=1e-4)
        assert out["resid_diff_norm"] == pytest.approx(expected.resid_norms.tolist(), rel=1e-4, abs=1e-5)
        assert [t["token"] for t in out["lens_promoted"][-1]] == [t for t, _ in expected.lens_promoted[-1]]
        assert out["steering"]["layers"] == list(range(30))
        steered = http.call("steer", prompt=PROMPT, vector_id=out["steering"]["vector_id"], scale=1.0)
        assert steered["kl"] > 0
        assert "unknown adapter 'nope'" in http.error("compare_models", prompts=prompts, adapter="nope")
        assert "no adapter" in http.error("load_adapter", path="missing.gguf")
        assert "already loaded" in http.error("load_adapter", path="lora.gguf", name="ft")
        assert "prompts must be between 1 and" in http.error("compare_models", prompts=[], adapter="ft")
    finally:
        model.adapters.pop("ft", None)
