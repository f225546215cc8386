"""The `workbench` command on the embedded model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import workbench
from workbench import cli, generation


@pytest.fixture(autouse=True)
def reuse_loaded_model(monkeypatch, model):
    """Every command loads the embedded model; hand them the session's copy instead of reloading."""
    monkeypatch.setattr(workbench, "load", lambda *args, **kwargs: model)


def run_json(capsys, *argv) -> dict:
    assert cli.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_run_json_matches_forward(capsys, model):
    out = run_json(capsys, "run", "The capital of France is", "--top-k", "5", "--json")
    assert out["ids"] == model.tokenize("The capital of France is")
    logprobs = model.forward(out["ids"])[-1].double().log_softmax(-1)  # the results layer's float64
    assert [row["id"] for row in out["top_k"]] == logprobs.topk(5).indices.tolist()
    assert out["top_k"][0]["token"] == " Paris"
    assert out["top_k"][0]["logprob"] == pytest.approx(logprobs.max().item(), abs=1e-5)


def test_json_output_is_strict_json_where_logits_overflow(capsys, monkeypatch, tiny_model):
    """NaN logits (a model whose weights overflow) print as null, as the MCP server writes them, not as bare NaN."""
    broken = tiny_model(cached=False)
    broken.runner.weights.final_norm.fill_(float("nan"))
    monkeypatch.setattr(workbench, "load", lambda *args, **kwargs: broken)
    assert cli.main(["run", "hi", "--top-k", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"bare {name} in the output"))
    assert [row["logprob"] for row in out["top_k"]] == [None, None]
    assert cli.json_line({"a": [float("inf"), 1.5, {"b": -float("inf")}]}) == '{"a": [null, 1.5, {"b": null}]}'


def test_run_in_llamacpp_numerics(capsys, model):
    exact = run_json(capsys, "run", "The capital of France is", "--top-k", "5", "--json")
    emulated = run_json(capsys, "run", "The capital of France is", "--top-k", "5", "--numerics", "llamacpp", "--json")
    with workbench.kernels.numerics("llamacpp"):
        logprobs = model.forward(emulated["ids"])[-1].double().log_softmax(-1)
    assert emulated["top_k"][0]["logprob"] == pytest.approx(logprobs.max().item(), abs=1e-5)
    assert emulated["top_k"][0]["logprob"] != pytest.approx(exact["top_k"][0]["logprob"], abs=1e-5)
    assert workbench.kernels.get_numerics() == "exact"  # the mode lasts for the command only
    info = run_json(capsys, "info", "--numerics", "llamacpp", "--json")
    assert info["kernels"]["blocks.0.wq"]["decode"] == "cpu-gguf-llamacpp"


def test_generate_json_is_greedy_continuation(capsys, model):
    out = run_json(capsys, "generate", "The capital of France is", "--max-new-tokens", "4", "--json")
    assert len(out["ids"]) == 4
    ids = model.tokenize("The capital of France is")
    for token in out["ids"]:
        assert token == int(model.forward(ids)[-1].argmax())
        ids.append(token)
    assert out["text"] == model.tokenizer.decode(out["ids"])


def test_generate_compile_builds_the_decode_step(capsys, monkeypatch, model):
    # The build itself is tested in test_generation.py; here the flag must reach it (the stub decodes eagerly).
    caches = []
    monkeypatch.setattr(generation, "build_decode_step", lambda runner, cache, lora=None: caches.append(cache))
    assert cli.main(["generate", "The capital of France is", "--max-new-tokens", "4", "--compile", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(caches) == 1 and caches[0].capacity == 256  # a static cache, as a built step needs
    assert json.loads(captured.out)["ids"] == run_json(capsys, "generate", "The capital of France is",
                                                       "--max-new-tokens", "4", "--json")["ids"]
    assert "compiling the decode step" in captured.err
    assert len(caches) == 1  # without --compile: no build on the CPU


def test_generate_chat_stops_at_end_of_turn(capsys, model):
    out = run_json(capsys, "generate", "Say hi.", "--chat", "--max-new-tokens", "40", "--json")
    assert out["ids"][-1] in model.tokenizer.stop_ids or len(out["ids"]) == 40
    assert "<|im_end|>" not in out["text"]


def test_info_json(capsys):
    out = run_json(capsys, "info", "--json")
    assert out["config"]["n_layers"] == 30
    assert out["tensor_formats"] == {"Q8_0": 1, "Q4_1": 210}
    assert out["weight_bytes"] <= out["file_bytes"]
    assert set(out["kernels"]["blocks.0.wq"]) == {"decode", "prefill", "format"}
    # float32 on the CPU: the glue is the C++ extension's (built for the matmuls), attention batched matmuls, or one
    # C++ call with the rope and the cache's write where no hook lies between them
    assert out["layer_ops"] == {"rms_norm": "cpu-cxx", "add_rms_norm": "cpu-cxx", "rope": "cpu-cxx",
                                "attention_scores": "torch-bmm", "attend": "torch-bmm", "swiglu": "cpu-cxx",
                                "rope_attention": "cpu-cxx", "blocks_exact": "cpu-cxx", "packed_attention": "padded ops"}


def test_errors_are_one_line_without_traceback(tmp_path):
    missing = tmp_path / "missing.gguf"
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "hi", "--model", str(missing)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"workbench: error: no model at {missing}"
    assert "Traceback" not in proc.stderr


def test_bad_ports_replay_numerics_messages_and_folders_are_one_line_errors(capsys, tmp_path):
    """Each a one-line error with exit status 2, before any server starts (argparse's own for a port)."""
    huge = tmp_path / "huge.json"
    huge.write_text('[{"role": "user", "content": "Hi", "x": ' + "9" * 5000 + "}]")
    cases = [
        (["mcp", "--http", "--port", "99999"], "a port is a number from 1 to 65535"),
        (["app", "--port", "-5"], "a port is a number from 1 to 65535"),
        (["replay", str(tmp_path), "--numerics", "llamacpp"], "--numerics does not apply"),
        (["generate", "--messages", str(huge)], "cannot read messages"),
        (["mcp", "--artifacts", str(huge)], "exists and is not a folder"),
        (["harvest", "--file", str(huge), "--hook", "hook_embed", "--out", ""], "out is an empty path"),
    ]
    for args, message in cases:
        if "--port" in args:
            with pytest.raises(SystemExit) as exited:
                cli.main(args)
            assert exited.value.code == 2
        else:
            assert cli.main(args) == 2
        assert message in capsys.readouterr().err, args
    with pytest.raises(workbench.WorkbenchError, match="the model path is empty"):  # `--model ""`
        workbench.loading.load_checkpoint("")


def test_run_file_prints_one_json_line_per_prompt(capsys, tmp_path, model):
    prompts = ["The capital of France is", "Hello", "Water boils at"]
    path = tmp_path / "prompts.txt"
    path.write_text(prompts[0] + "\n\n" + "\n".join(prompts[1:]) + "\n", encoding="utf-8")
    assert cli.main(["run", "--file", str(path), "--json", "--top-k", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert [line["line"] for line in lines] == [1, 3, 4]  # the file's lines, blank ones counted
    for prompt, line in zip(prompts, lines):
        logprobs = model.forward(prompt)[-1].double().log_softmax(-1)
        assert line["ids"] == model.tokenize(prompt)
        assert [row["id"] for row in line["top_k"]] == logprobs.topk(3).indices.tolist()
        assert line["top_k"][0]["logprob"] == pytest.approx(logprobs.max().item(), abs=2e-4)


@pytest.mark.parametrize("args, message", [
    (["run"], "give one prompt (or --messages), or --file"),
    (["run", "x", "--file", "p.txt"], "give one prompt (or --messages), or --file"),
    (["run", "--file", "/nonexistent/prompts.txt"], "prompt file not found"),
    (["run", "x", "--top-k", "0"], "--top-k must be at least 1"),
])
def test_run_file_errors_are_one_line(capsys, args, message):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_line_is_a_prompt_whatever_other_breaks_it_holds(tmp_path):
    path = tmp_path / "prompts.txt"
    # form feed, U+2028, NEL, a lone \r: str.splitlines() would end a line at each
    path.write_bytes("a\x0cb\u2028c\r\n\nWater boils at\nd\re\x85f\n".encode("utf-8"))
    assert cli.read_numbered_prompts(str(path)) == [(1, "a\x0cb\u2028c"), (3, "Water boils at"), (4, "d\re\x85f")]
    assert cli.read_prompts(str(path)) == ["a\x0cb\u2028c", "Water boils at", "d\re\x85f"]


def test_run_file_prints_each_result_as_its_forward_finishes(capsys, monkeypatch, tmp_path, model):
    path = tmp_path / "prompts.txt"
    path.write_text("One two three four five six seven\nThe capital of France is\n\nHello\n", encoding="utf-8")
    iter_batch, printed = model.iter_batch, []

    def watched(*args, **kwargs):
        for index, trace in iter_batch(*args, **kwargs):
            yield index, trace
            # the command has taken this result: what has it printed since the last?
            printed.append((index, tuple(trace.logits.shape), [json.loads(x)["line"] for x in
                                                               capsys.readouterr().out.splitlines()]))

    monkeypatch.setattr(model, "iter_batch", watched)
    assert cli.main(["run", "--file", str(path), "--json", "--top-k", "2", "--batch-size", "1"]) == 0
    vocab = model.config.vocab_size
    assert printed == [(0, (1, vocab), [1]), (1, (1, vocab), [2]), (2, (1, vocab), [4])]


def test_run_file_keeps_the_file_order_when_shorter_prompts_finish_last(capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Hi\nOne two three four five six seven\nThe capital of France is\n", encoding="utf-8")
    assert cli.main(["run", "--file", str(path), "--json", "--batch-size", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["index"], x["line"]) for x in lines] == [(0, 1), (1, 2), (2, 3)]


def test_run_file_errors_name_the_prompts_line(capsys, tmp_path, model):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello\n\n" + "a " * (model.config.n_ctx + 10) + "\n", encoding="utf-8")
    assert cli.main(["run", "--file", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("workbench: error: prompt 1 (line 3): the prompt has") and not captured.out


def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    path = tmp_path / "many.txt"
    # far more output than a pipe buffers, so the command is still writing when its reader leaves
    path.write_text("\n".join(f"Number {i}" for i in range(100)), encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", "--file", str(path), "--json", "--top-k",
                             "50", "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141
    assert first["index"] == 0
    assert "Traceback" not in err and "BrokenPipeError" not in err
