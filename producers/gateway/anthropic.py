"""The gateway's Anthropic Messages API (``POST /v1/messages``): the request checked and
turned into the same ``CallRequest`` as a chat completion, the answer in the Messages
shapes, whole or as its stream of events.

An agent written against the ``anthropic`` client trains as one written against
``openai``: the same episode, the same chat template, the same record. Tools map onto the
chat template's: a tool's ``input_schema`` is its ``parameters``, an assistant's
``tool_use`` blocks are its ``tool_calls``, a user's ``tool_result`` blocks are ``tool``
messages (before the user's text); the model's calls, parsed as for chat completions
(``tool_call_parser``), come back as ``tool_use`` blocks with ``stop_reason`` ``tool_use``.
What the Messages API has and this gateway does not serve is refused with a 400 naming it:
images and documents, extended ``thinking``, and a ``tool_choice`` that forces a call
(``any``, ``tool``: the policy's own choice is what is trained). As for chat completions,
sampling belongs to the run: ``temperature``, ``top_p``, ``top_k`` and ``metadata`` are
accepted and ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

from producers.engine.request_checks import Flag, refused
from producers.gateway.answers import Answer
from producers.gateway.requests import (
    BadRequest,
    CallRequest,
    MaxTokens,
    Messages,
    StopSequences,
    parse,
)

ROLES = frozenset({"user", "assistant"})
MAX_BLOCKS = 4096
MAX_TOOLS = 256


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A content (a string, or a list of blocks) as blocks, each an object with a type."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or len(content) > MAX_BLOCKS:
        raise BadRequest(f"{where} must be a string or a list of content blocks")
    for block in content:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{where}: a content block must be an object with a 'type'")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise BadRequest(f"{where}: a text block needs a string 'text'")
    return block["text"]


def _text_of(content: Any, where: str) -> str:
    """Text blocks joined (the system prompt, a tool result); any other block refused."""
    texts = []
    for block in _blocks(content, where):
        if block["type"] != "text":
            raise BadRequest(f"{where}: {block['type']!r:.40} blocks are not served here")
        texts.append(_text(block, where))
    return "".join(texts)


def _chat_messages(message: Any, where: str) -> list[dict[str, Any]]:
    """One Messages API message as the chat messages the template renders: an assistant's
    text and ``tool_calls``; a user's ``tool`` results, then its text."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise BadRequest(f"{where} must be an object whose 'role' is 'user' or 'assistant'")
    role, texts, calls, results = message["role"], [], [], []
    for block in _blocks(message.get("content"), f"{where}.content"):
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise BadRequest(f"{where}: a tool_use block needs a string 'id' and 'name'")
            if not isinstance(block.get("input", {}), dict):
                raise BadRequest(f"{where}: a tool_use block's 'input' must be an object")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise BadRequest(f"{where}: a tool_result block needs a string 'tool_use_id'")
            content = _text_of(block.get("content", ""), f"{where} tool_result")
            results.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
            )
        else:
            raise BadRequest(
                f"{where}: {kind!r:.40} blocks are not served on /v1/messages"
                + (f" in a {role} message" if kind in ("tool_use", "tool_result") else "")
            )
    said = "".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": said or None, "tool_calls": calls} if calls
                else {"role": "assistant", "content": said}]  # fmt: skip
    return [*results, {"role": "user", "content": said}] if said or not results else results


def _tools(tools: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, bool]:
    """The request's tools in the chat template's shape, and whether the answer is parsed
    for calls (not with ``tool_choice`` ``none``)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "none"):
        raise BadRequest(
            '\'tool_choice\' must be {"type": "auto"} or {"type": "none"}: a forced call '
            "('any', 'tool') is not the policy's own choice, which is what is trained"
        )
    if tools is None:
        return None, False
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools")
    functions = []
    for index, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or not isinstance(tool.get("name"), str)
            or not isinstance(tool.get("input_schema"), dict)
        ):
            raise BadRequest(f"tools[{index}] needs a string 'name' and an 'input_schema' object")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    return functions or None, bool(functions) and kind != "none"


def _no_thinking(value: Any) -> Any:
    if value is not None:
        raise refused("is not served by this gateway (extended thinking)")
    return value


class MessagesBody(BaseModel):
    """A Messages API body; its messages, system prompt and tools are read by
    ``_chat_messages``, ``_text_of`` and ``_tools``. Other fields (``temperature``,
    ``metadata``, ...) are accepted and ignored: sampling is the run's."""

    model_config = ConfigDict(extra="allow")

    thinking: Annotated[Any, AfterValidator(_no_thinking)] = None
    tools: Any = None
    tool_choice: Any = None
    max_tokens: MaxTokens
    messages: Messages
    system: Any = None
    stop_sequences: StopSequences = []
    stream: Flag = False


def messages_request(body: dict[str, Any], max_call_tokens: int) -> CallRequest:
    """A Messages API body as a chat call, or ``BadRequest`` naming the field."""
    call = parse(MessagesBody, body, max_call_tokens)
    tools, parse_tools = _tools(call.tools, call.tool_choice)
    messages: list[dict[str, Any]] = []
    if call.system is not None:
        messages.append({"role": "system", "content": _text_of(call.system, "'system'")})
    for index, message in enumerate(call.messages):
        messages += _chat_messages(message, f"messages[{index}]")
    if messages[-1]["role"] not in ("user", "tool"):
        raise BadRequest(
            "the last message must be the user's: a prefilled assistant turn is not served"
        )
    return CallRequest(
        messages=messages,
        tools=tools,
        parse_tools=parse_tools,
        max_tokens=call.max_tokens,
        stop=call.stop_sequences,
        stream=call.stream,
    )


def error_body(message: str, status: int) -> dict[str, Any]:
    """An error as the Messages API writes one."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        409: "invalid_request_error",
        429: "rate_limit_error",
        503: "overloaded_error",
    }
    return {"type": "error", "error": {"type": kinds.get(status, "api_error"), "message": message}}


class MessageAnswer:
    """One call's answer as a Messages API ``message``, whole or as stream events. The
    text, its end and the token counts are the chat answer's (``Answer``)."""

    def __init__(self, answer: Answer, model: str, stop: list[str], message_id: str) -> None:
        self.text = answer.parsed.content or ""
        self.tool_uses = [
            {
                "type": "tool_use",
                "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": call["function"]["name"],
                "input": _input_of(call["function"]["arguments"]),
            }
            for call in answer.parsed.tool_calls
        ]
        self.model = model
        self.id = message_id
        self.usage = answer.usage
        self.rollstream = answer.rollstream
        self.stop_sequence = next((s for s in stop if self.text.endswith(s)), None)
        if self.tool_uses:
            self.stop_reason = "tool_use"
        elif answer.finish == "length":
            self.stop_reason = "max_tokens"
        elif self.stop_sequence is not None:
            self.stop_reason = "stop_sequence"
        else:
            self.stop_reason = "end_turn"

    def whole(self) -> dict[str, Any]:
        return {
            **opening(self.id, self.model, self.usage["prompt_tokens"])["message"],
            "content": [{"type": "text", "text": self.text}, *self.tool_uses],
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": {
                "input_tokens": self.usage["prompt_tokens"],
                "output_tokens": self.usage["completion_tokens"],
            },
            "rollstream": self.rollstream,
        }

    def events(self, pieces: list[str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """The events after ``opening``'s: the text (``pieces`` of it: what a stream has not
        sent yet), its block's end, each tool call as a block of its own, the message's
        end."""
        for piece in [self.text] if pieces is None else pieces:
            yield text_delta(piece)
        yield "content_block_stop", {"type": "content_block_stop", "index": 0}
        for index, use in enumerate(self.tool_uses, start=1):
            start = {**use, "input": {}}
            yield (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": start,
                },
            )
            partial = {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": partial,
                },
            )
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": {"output_tokens": self.usage["completion_tokens"]},
            },
        )
        yield "message_stop", {"type": "message_stop"}


def text_delta(piece: str) -> tuple[str, dict[str, Any]]:
    """A ``content_block_delta`` event of the answer's text block."""
    delta = {"type": "text_delta", "text": piece}
    return "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}


def _input_of(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments as a ``tool_use`` block's ``input`` object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def opening(message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The ``message_start`` event: the message before its content."""
    return {
        "type": "message_start",
        "message": {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        },
    }


def block_start() -> dict[str, Any]:
    """The ``content_block_start`` event of the answer's one text block."""
    return {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
