"""Prompts given as conversations (lists of {"role", "content"} messages) on every surface, rendered as transformers'
apply_chat_template renders them, on the embedded SmolLM2 and on Llama 3, Gemma and Qwen2 template strings."""
from __future__ import annotations

import copy
import json
import re
import threading

import anyio
import pytest
import torch

import workbench
from workbench import cli, hooks, probes
from workbench.errors import WorkbenchError
from workbench.hooks.trace import MANIFEST_FILE, TraceError, manifest_sha256
from workbench.mcp_server import Workbench, build_server
from workbench.mcp_server.tools import Call
from workbench.replay import replay

transformers = pytest.importorskip("transformers")

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
          "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if "
          "loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
          "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
         "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
         "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>"
         "assistant\n' }}{% endif %}")

SYSTEM = {"role": "system", "content": "Answer in one word."}
USER = {"role": "user", "content": "What is the capital of France?"}
ANSWER = {"role": "assistant", "content": "Paris."}
FOLLOW_UP = {"role": "user", "content": "And of Italy?"}
PREFILL = {"role": "assistant", "content": "Sure, here is "}  # trailing space: kept, or trimmed with the template's
CONVERSATIONS = {
    "system and user": [SYSTEM, USER],
    "multi-turn": [USER, ANSWER, FOLLOW_UP],
    "prefilled answer": [USER, ANSWER, FOLLOW_UP, PREFILL],
}


@pytest.fixture()
def with_template(model, monkeypatch):
    """The embedded model with another chat template (None: its own)."""
    def use(template: str | None) -> workbench.Model:
        if template is not None:
            tokenizer = copy.copy(model.tokenizer)
            tokenizer.chat_template = template
            tokenizer.__dict__.pop("_compiled_chat_template", None)
            monkeypatch.setattr(model, "tokenizer", tokenizer)
        return model
    return use


def transformers_ids(model: workbench.Model, messages: list[dict]) -> list[int]:
    """transformers' apply_chat_template on the model's own vocabulary and template: the generation prompt, or the
    last message continued when it is the assistant's."""
    tok = model.tokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._backend, bos_token=tok.token_text(tok.bos_id),
                                              eos_token=tok.token_text(tok.eos_id))
    prefilled = messages[-1]["role"] == "assistant"
    return hf.apply_chat_template(messages, chat_template=tok.chat_template, tokenize=True, return_dict=False,
                                  add_generation_prompt=not prefilled, continue_final_message=prefilled)


@pytest.mark.parametrize("template", [None, LLAMA3, GEMMA, QWEN2], ids=["smollm2", "llama3", "gemma", "qwen2"])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_a_conversation_gives_transformers_ids(with_template, template, case):
    messages = CONVERSATIONS[case]
    if template == GEMMA and messages[0]["role"] == "system":
        messages = messages[1:]  # Gemma refuses a system message
    model = with_template(template)
    assert model.to_ids(messages) == transformers_ids(model, messages)
    assert model.to_ids(messages, chat=True) == model.to_ids(messages)  # a conversation is always rendered
    rendered = model.render_messages(messages)
    if case == "prefilled answer":
        # the answer is left open: no end of turn after it (the space survives where the template does not trim)
        assert rendered.endswith("Sure, here is" if template in (LLAMA3, GEMMA) else "Sure, here is ")


def test_a_conversation_runs_as_its_rendered_ids(model):
    messages = [SYSTEM, USER, PREFILL]
    ids = transformers_ids(model, messages)
    trace = model.run(messages)
    assert trace.ids == ids and trace.chat and trace.prompt == messages
    assert torch.equal(trace.logits, model.run(ids).logits)
    assert torch.equal(model.forward(messages), trace.logits)
    assert model.generate(messages, 6) == model.generate(ids, 6)
    # a text with chat=True stays one user message; chat_prompt's system message is a conversation's
    assert model.to_ids(USER["content"], chat=True) == model.to_ids([USER])
    assert model.to_ids(model.chat_prompt(USER["content"], SYSTEM["content"])) == model.to_ids([SYSTEM, USER])


def test_a_batch_of_conversations_equals_each_prompt(model):
    prompts = [[SYSTEM, USER], "The capital of France is", [USER, PREFILL]]
    traces = model.run_batch(prompts)
    for prompt, trace in zip(prompts, traces):
        alone = model.run(prompt)
        assert trace.ids == alone.ids and trace.prompt == alone.prompt and trace.chat == alone.chat
        torch.testing.assert_close(trace.logits, alone.logits, atol=1e-4, rtol=1e-4)
    last = model.forward_batch(prompts, last_only=True)
    torch.testing.assert_close(torch.stack([t[-1] for t in last]), torch.stack([t.logits[-1] for t in traces]),
                               atol=1e-4, rtol=1e-4)
    assert model.generate_batch(prompts, 4) == [model.generate(p, 4) for p in prompts]


def test_a_conversation_trace_round_trips_and_replays(model, tmp_path):
    messages = [SYSTEM, USER, PREFILL]
    path = model.run(messages, record=["blocks.0.hook_resid_post"]).save(tmp_path / "chat")
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["prompt"] == messages and manifest["chat"] is True
    loaded = workbench.load_trace(path)
    assert loaded.prompt == messages and loaded.chat
    assert replay(loaded, model).verdict == "identical"
    assert cli.main(["replay", str(path)]) == 0


def _forged(path, edit) -> None:
    """The manifest edited, and its own hash made to agree (as a careful forger would)."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    edit(manifest)
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["prompt"][1].update(content=3), "message 1: 'content' must be a string"),
    (lambda m: m["prompt"][0].update(name="x"), "message 0 has the unknown key 'name'"),
    (lambda m: m["prompt"].append(7), "message 3 is 7"),
    (lambda m: m.update(chat=False), "'chat' must be true"),
])
def test_a_manifest_with_a_malformed_conversation_is_refused(model, tmp_path, edit, message):
    path = model.run([SYSTEM, USER, PREFILL]).save(tmp_path / "chat")
    _forged(path, edit)
    with pytest.raises(TraceError, match=message):
        workbench.load_trace(path)


def test_a_manifest_whose_conversation_does_not_render_to_its_ids_does_not_replay(model, tmp_path):
    path = model.run([SYSTEM, USER]).save(tmp_path / "chat")
    _forged(path, lambda m: m["prompt"][1].update(content="What is the capital of Spain?"))
    report = replay(workbench.load_trace(path), model)
    assert report.verdict == "different" and "renders" in report.reason


def test_an_old_text_trace_still_loads(model, tmp_path):
    path = model.run("Hello", chat=True).save(tmp_path / "text")
    loaded = workbench.load_trace(path)
    assert loaded.prompt == "Hello" and loaded.chat and replay(loaded, model).ok


@pytest.mark.parametrize("prompt, message", [
    ([USER, {"role": "user", "content": 3}], "message 1: 'content' must be a string, got 3"),
    ([{"role": 1, "content": "hi"}], "message 0: 'role' must be a string"),
    ([{"content": "hi"}], "message 0 lacks 'role'"),
    ([USER, "hi"], "message 1 is 'hi', not a"),
    ([{**USER, "name": "bob"}], "message 0 has the unknown key 'name'"),
    ([{"role": " ", "content": "hi"}], "message 0 has an empty role"),
    ([], "the prompt is empty"),
    ({"role": "user"}, "a prompt is a text, a list of integer token ids or a list of messages"),
])
def test_a_bad_conversation_is_one_line_naming_the_message(model, prompt, message):
    with pytest.raises(WorkbenchError, match=message) as err:
        model.run(prompt)
    assert "\n" not in str(err.value)
    with pytest.raises(WorkbenchError, match=f"prompt 1: {message}"):
        model.run_batch(["Hello", prompt])


def test_a_batch_given_one_conversation_says_to_wrap_it(model):
    with pytest.raises(WorkbenchError, match="one conversation .* wrap it in a list"):
        model.run_batch([SYSTEM, USER])


def test_a_template_that_drops_the_answer_to_continue_is_refused(with_template):
    model = with_template("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                          "{% endfor %}")
    with pytest.raises(WorkbenchError, match="message 1: the chat template drops the text of the message to continue"):
        model.run([USER, PREFILL])
    with pytest.raises(ValueError, match="does not appear"):  # transformers refuses it as well
        transformers_ids(model, [USER, PREFILL])


def test_patching_and_steering_take_conversations(model):
    opening = {"role": "assistant", "content": "The capital is"}
    clean, corrupt = [USER, opening], [{"role": "user", "content": "What is the capital of Italy?"}, opening]
    assert len(model.to_ids(clean)) == len(model.to_ids(corrupt))
    sweep = dict(layers=[0, 5], positions=[-1, -2], progress=False)
    by_messages = hooks.patching_sweep(model, clean, corrupt, **sweep)
    by_ids = hooks.patching_sweep(model, model.to_ids(clean), model.to_ids(corrupt), **sweep)
    assert torch.equal(by_messages.grid, by_ids.grid) and by_messages.clean_metric != by_messages.corrupt_metric
    patched = model.run(corrupt, interventions=[hooks.Patch("blocks.3.hook_resid_post", donor=clean)])
    assert torch.equal(patched.logits, model.run(corrupt, interventions=[
        hooks.Patch("blocks.3.hook_resid_post", donor=model.to_ids(clean))]).logits)
    assert patched.interventions[0]["donor"] == clean  # the spec keeps the conversation
    positive, negative = [[USER, {"role": "assistant", "content": "I love it!"}]], [
        [USER, {"role": "assistant", "content": "I hate it!"}]]
    vector = probes.steering_vector(model, (positive, negative), layers=[3])
    run = model.run_batch(positive + negative, record=["blocks.3.hook_resid_post"], reduce="mean")
    expected = run[0].activations["blocks.3.hook_resid_post"] - run[1].activations["blocks.3.hook_resid_post"]
    torch.testing.assert_close(vector.directions[3], expected.flatten(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ surfaces


@pytest.fixture()
def reuse_loaded_model(monkeypatch, model):
    monkeypatch.setattr(workbench, "load", lambda *args, **kwargs: model)


def test_cli_messages_file_and_system(reuse_loaded_model, model, tmp_path, capsys):
    messages = [SYSTEM, USER, PREFILL]
    (tmp_path / "chat.json").write_text(json.dumps(messages))
    assert cli.main(["run", "--messages", str(tmp_path / "chat.json"), "--json", "--top-k", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ids"] == transformers_ids(model, messages)
    assert out["top_k"][0]["id"] == model.forward(out["ids"])[-1].argmax().item()
    assert cli.main(["generate", USER["content"], "--system", SYSTEM["content"], "--max-new-tokens", "4",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == [SYSTEM, USER] and out["text"] == model.generate([SYSTEM, USER], 4)
    (tmp_path / "prompts.txt").write_text("Hi\nHello\n")
    assert cli.main(["run", "--file", str(tmp_path / "prompts.txt"), "--system", "Be kind.", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["ids"] for r in rows] == [model.to_ids([{"role": "system", "content": "Be kind."},
                                                      {"role": "user", "content": t}]) for t in ("Hi", "Hello")]


@pytest.mark.parametrize("argv, message", [
    (["run", "Hi", "--messages", "chat.json"], "give no prompt or --system with it"),
    (["generate", "--messages", "missing.json"], "messages file not found"),
    (["generate", "--messages", "bad.json"], r"bad.json: message 0 lacks 'content'"),
    (["generate", "--messages", "text.json"], "not valid JSON|JSONDecodeError"),
    (["generate"], "give a prompt, or --messages"),
])
def test_cli_bad_messages_are_one_line(reuse_loaded_model, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.json").write_text(json.dumps([USER]))
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "user"}]))
    (tmp_path / "text.json").write_text("hello")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err


def test_mcp_tools_take_conversations(model, tmp_path):
    bench = Workbench(model, tmp_path / "artifacts")
    messages = [SYSTEM, USER, PREFILL]
    ids = transformers_ids(model, messages)
    with bench.sessions.using("test") as session:
        call = Call(session, threading.Event())
        assert bench.tokenize(call, text=messages).ids == ids
        result = bench.run(call, prompt=messages, top_k=3)
        trace = session.get("trace", result.trace_id)
        assert trace.prompt == messages and trace.chat and trace.ids == ids
        assert bench.trace_summary(call, result.trace_id).prompt == messages
        assert result.next_token.top[0].id == model.forward(ids)[-1].argmax().item()
        batch = bench.run_batch(call, prompts=[messages, "Hello"], top_k=1)
        assert [r.tokens for r in batch.results] == [model.token_texts(ids), model.token_texts(model.to_ids("Hello"))]
        assert bench.generate(call, prompt=messages, max_new_tokens=3).text == model.generate(messages, 3)
        with pytest.raises(WorkbenchError, match="prompt 1: message 0 lacks 'content'"):
            bench.run_batch(call, prompts=["Hi", [{"role": "user"}]])
    # through the server, as a client calls it: the schema takes a conversation
    server = build_server(bench)
    tools = {tool.name: tool for tool in anyio.run(server.list_tools)}
    assert "conversation" in json.dumps(tools["run"].input_schema["properties"]["prompt"])
    assert "conversation" in json.dumps(tools["generate_batch"].input_schema["properties"]["prompts"])
    arguments = server._tool_manager.get_tool("run").fn_metadata.arg_model.model_validate({"prompt": messages})
    assert arguments.prompt == messages  # validated as the conversation it is, not coerced
