"""Tool calls in a model's text, one parser per model family, and the agent's tool
messages as that family's chat template takes them back.

Each parser reads the text its family's chat template teaches the model to write (and
renders the agent's ``tool_calls`` back as), and returns OpenAI tool calls:

- ``hermes`` (alias ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, the text before the first one is the content (Hermes 2/3, Qwen2.5/Qwen3,
  SmolLM3 templates).
- ``llama3``: the whole answer is ``{"name": ..., "parameters": {...}}`` (Llama 3.1/3.2
  JSON tool calling), optionally after ``<|python_tag|>``; several calls are separated
  by ``;``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` after the
  content (Mistral 7B v0.3, Nemo, Small), or the newer ``[TOOL_CALLS]name[ARGS]{...}``.

Text that has a family's marker but not a well-formed call is returned whole as the
content: the agent sees what the model wrote, and the record keeps the tokens either way.
``auto`` picks the family whose markers the model's chat template holds.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


class NoToolFamily(ValueError):
    """``auto`` found no known tool-call format in a chat template that takes tools."""


@dataclass(frozen=True)
class ParsedText:
    """The model's text split into what the agent reads as content and as tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def _openai_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _mistral_id() -> str:
    """Mistral's templates refuse any call id but 9 letters or digits."""
    return uuid.uuid4().hex[:9]


def _call(name: Any, arguments: Any, new_id: Callable[[], str]) -> dict[str, Any] | None:
    """One OpenAI tool call, or None when ``name`` is not a string or ``arguments`` is
    neither an object nor a JSON string."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        return None
    return {"id": new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _calls(found: list[Any], new_id: Callable[[], str]) -> list[dict[str, Any]] | None:
    """Each ``{"name", "arguments"}`` object as a tool call; None if any is not one."""
    calls = []
    for item in found:
        call = (
            _call(item.get("name"), item.get("arguments", {}), new_id)
            if isinstance(item, dict)
            else None
        )
        if call is None:
            return None
        calls.append(call)
    return calls


def parse_hermes(text: str) -> ParsedText:
    """``<tool_call>`` JSON blocks of ``text`` as tool calls."""
    blocks = list(TOOL_CALL_BLOCK.finditer(text))
    if not blocks:
        return ParsedText(text, [])
    try:
        found = [json.loads(block.group(1)) for block in blocks]
    except ValueError:
        return ParsedText(text, [])
    calls = _calls(found, _openai_id)
    if calls is None:
        return ParsedText(text, [])
    return ParsedText(text[: blocks[0].start()].strip() or None, calls)


def parse_llama3(text: str) -> ParsedText:
    """A Llama 3.1/3.2 answer that is JSON calls (``parameters`` or ``arguments``), after
    an optional ``<|python_tag|>``; anything else is content."""
    at = text.find(PYTHON_TAG)
    content, body = None, text
    if at >= 0:
        content, body = text[:at].strip() or None, text[at + len(PYTHON_TAG) :]
    body = body.strip()
    if not body.startswith("{"):
        return ParsedText(text, [])
    decoder, calls, index = json.JSONDecoder(), [], 0
    while index < len(body):
        try:
            found, index = decoder.raw_decode(body, index)
        except ValueError:
            return ParsedText(text, [])
        if not isinstance(found, dict):
            return ParsedText(text, [])
        arguments = found.get("parameters", found.get("arguments", {}))
        call = _call(found.get("name"), arguments, _openai_id)
        if call is None:
            return ParsedText(text, [])
        calls.append(call)
        while index < len(body) and body[index] in " \t\n;":
            index += 1
    return ParsedText(content, calls)


def parse_mistral(text: str) -> ParsedText:
    """``[TOOL_CALLS]`` and a JSON list of calls (or one call) after the content, or the
    ``[TOOL_CALLS]name[ARGS]{...}`` form, one marker per call."""
    at = text.find(TOOL_CALLS)
    if at < 0:
        return ParsedText(text, [])
    content, body = text[:at].strip() or None, text[at + len(TOOL_CALLS) :].strip()
    if ARGS in body:
        found: Any = []
        for part in body.split(TOOL_CALLS):
            name, _, arguments = part.partition(ARGS)
            try:
                found.append({"name": name.strip(), "arguments": json.loads(arguments)})
            except ValueError:
                return ParsedText(text, [])
    else:
        try:
            found = json.loads(body)
        except ValueError:
            return ParsedText(text, [])
    found = [found] if isinstance(found, dict) else found
    if not isinstance(found, list) or not found:
        return ParsedText(text, [])
    calls = _calls(found, _mistral_id)
    if calls is None:
        return ParsedText(text, [])
    return ParsedText(content, calls)


def _mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's templates take it (9 letters or digits): the last nine of
    its letters and digits (``toolu_`` + a Mistral id gives that id back), else a digest."""
    if MISTRAL_ID.fullmatch(call_id):
        return call_id
    letters = re.sub(r"[^A-Za-z0-9]", "", call_id)
    return letters[-9:] if len(letters) >= 9 else hashlib.sha1(call_id.encode()).hexdigest()[:9]


@dataclass(frozen=True)
class ToolFamily:
    """A model family's tool-call format: its parser, the marker tokens its calls are
    written with (kept when the answer is decoded for parsing, though a tokenizer may hold
    them as special tokens, which the content's decoding drops), the text its chat
    template holds (what ``auto`` looks for) and how its template wants call ids."""

    name: str
    parse: Callable[[str], ParsedText]
    markers: tuple[str, ...]
    template_signs: tuple[str, ...]
    call_id: Callable[[str], str] = lambda call_id: call_id


HERMES = ToolFamily("hermes", parse_hermes, ("<tool_call>", "</tool_call>"), ("<tool_call>",))
LLAMA3 = ToolFamily("llama3", parse_llama3, (PYTHON_TAG,), (PYTHON_TAG, "<|eom_id|>"))
MISTRAL = ToolFamily(
    "mistral", parse_mistral, (TOOL_CALLS, ARGS), (TOOL_CALLS,), call_id=_mistral_call_id
)
FAMILIES = {"hermes": HERMES, "qwen": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}
"""The ``tool_call_parser`` names; ``auto`` looks for these families' template signs in
this order (Mistral first: its templates may mention the others' words, not its marker)."""
AUTO_ORDER = (MISTRAL, HERMES, LLAMA3)


def family_of_template(template: str | dict[str, str] | None) -> ToolFamily | None:
    """The family whose markers ``template`` holds; None for a template that takes no
    tools; ``NoToolFamily`` for one that takes tools in no known format."""
    if isinstance(template, dict):  # named templates (default, tool_use, ...)
        template = "\n".join(template.values())
    if not template:
        return None
    for family in AUTO_ORDER:
        if any(sign in template for sign in family.template_signs):
            return family
    if "tools" in template:
        raise NoToolFamily(
            "tool_call_parser = 'auto': the model's chat template takes tools but holds "
            "none of the known formats' markers ("
            + ", ".join(f"{f.name}: {' '.join(f.template_signs)}" for f in AUTO_ORDER)
            + "): set [producers.rollout.gateway] tool_call_parser to the model's family, "
            "or 'none' to answer with the text"
        )
    return None


@dataclass(frozen=True)
class ToolReader:
    """A family's parser bound to the served tokenizer: ``kept`` are the ids of its marker
    tokens that decoding without special tokens would drop, and their text."""

    family: ToolFamily
    kept: dict[int, str]

    def read(self, ids: list[int], decode: Callable[..., str]) -> ParsedText | None:
        """The tool calls of an answer's tokens, or None when it has none."""
        parts, start = [], 0
        for at, token in enumerate(ids):
            if token in self.kept:
                parts += [decode(ids[start:at], skip_special_tokens=True), self.kept[token]]
                start = at + 1
        parts.append(decode(ids[start:], skip_special_tokens=True))
        parsed = self.family.parse("".join(parts))
        return parsed if parsed.tool_calls else None


def tool_reader(setting: str, tokenizer: Any) -> ToolReader | None:
    """The reader ``tool_call_parser`` names for ``tokenizer`` (``auto``: by its chat
    template); None for ``none`` or a template without tools."""
    if setting == "none":
        return None
    if setting == "auto":
        family = family_of_template(getattr(tokenizer, "chat_template", None))
        if family is None:
            return None
    else:
        family = FAMILIES[setting]
    kept = {}
    vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for marker in family.markers:
        token = vocabulary.get(marker)
        if token is not None and not tokenizer.decode([token], skip_special_tokens=True):
            kept[token] = marker
    return ToolReader(family, kept)


def template_messages(
    messages: list[dict[str, Any]], family: ToolFamily | None
) -> list[dict[str, Any]]:
    """The chat messages as chat templates take them: an assistant call's ``arguments``
    as an object (the templates write it with ``tojson``; the API sends a JSON string),
    and call ids as the family's template accepts them."""
    shaped = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [_template_call(call, family) for call in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        elif message["role"] == "tool" and family is not None and "tool_call_id" in message:
            message = {**message, "tool_call_id": family.call_id(message["tool_call_id"])}
        shaped.append(message)
    return shaped


def _template_call(call: dict[str, Any], family: ToolFamily | None) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            call = {**call, "function": {**function, "arguments": arguments}}
    if family is not None and isinstance(call.get("id"), str):
        call = {**call, "id": family.call_id(call["id"])}
    return call
