"""Chat prompts given as a conversation: ``[{"role": ..., "content": ...}, ...]``, rendered through the model's chat
template wherever a prompt is taken (``Model.to_ids``)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from workbench.errors import WorkbenchError, shorten

MESSAGE_KEYS = ("role", "content")
# what a prompt may be: a text, token ids, or a conversation
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


def is_utf8(text: str) -> bool:
    """Whether a str encodes as UTF-8 (Python keeps undecodable command-line bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_messages(prompt: Any) -> bool:
    """Whether a prompt is a conversation: a list holding a dict (token ids are integers, a text is a str)."""
    return isinstance(prompt, (list, tuple)) and any(isinstance(message, Mapping) for message in prompt)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The conversation as plain ``{"role", "content"}`` dicts of strings, or a WorkbenchError naming the first bad
    message. Other keys are refused: a template could read them, and a trace could not record them faithfully."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise WorkbenchError(f"a conversation is a non-empty list of {{'role', 'content'}} dicts, got "
                             f"{shorten(messages)}")
    checked = []
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise WorkbenchError(f"message {n} is {shorten(message)}, not a {{'role', 'content'}} dict")
        unknown = [key for key in message if key not in MESSAGE_KEYS]
        if unknown:
            raise WorkbenchError(f"message {n} has the unknown key {shorten(unknown[0])}; a message holds 'role' "
                                 "and 'content'")
        for key in MESSAGE_KEYS:
            value = message.get(key)
            if key not in message:
                raise WorkbenchError(f"message {n} lacks {key!r}")
            if not isinstance(value, str):
                raise WorkbenchError(f"message {n}: {key!r} must be a string, got {shorten(value)}")
            if not is_utf8(value):
                raise WorkbenchError(f"message {n}: {key!r} is not valid UTF-8 text (it holds lone surrogates)")
        if not message["role"].strip():
            raise WorkbenchError(f"message {n} has an empty role")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def conversation(user: str, system: str | None = None) -> list[dict[str, str]]:
    """One user message, after a system prompt when ``system`` is given (an empty one included)."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}]


def continues_answer(messages: list[dict[str, str]]) -> bool:
    """Whether the rendering continues the last message (the assistant's answer begun: "Sure, here is") rather than
    ending with the generation prompt."""
    return messages[-1]["role"] == "assistant"
