"""The gateway's Anthropic Messages API (``POST /v1/messages``): the request checked and
turned into the same ``CallRequest`` as a chat completion, the answer in the Messages
shapes, whole or as its stream of events.

An agent written against the ``anthropic`` client trains as one written against
``openai``: the same episode, the same chat template, the same record. What the Messages
API has and this gateway does not serve yet is refused with a 400 naming it: ``tools``,
content blocks other than text (``tool_use``, ``tool_result``, images, documents) and
extended ``thinking``. As for chat completions, sampling belongs to the run:
``temperature``, ``top_p``, ``top_k`` and ``metadata`` are accepted and ignored.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from producers.gateway_answers import Answer
from producers.gateway_requests import (
    MAX_MESSAGES,
    BadRequest,
    CallRequest,
    checked_max_tokens,
    checked_stop,
    checked_stream,
)

ROLES = frozenset({"user", "assistant"})
REFUSED_KEYS = {
    "tools": "tools are not served on /v1/messages yet: use /v1/chat/completions",
    "tool_choice": "tools are not served on /v1/messages yet: use /v1/chat/completions",
    "thinking": "extended thinking is not served by this gateway",
}
MAX_BLOCKS = 4096


def _text_of(content: Any, where: str) -> str:
    """A message's (or the system prompt's) content as text: a string, or text blocks
    joined; any other block is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or len(content) > MAX_BLOCKS:
        raise BadRequest(f"{where} must be a string or a list of content blocks")
    texts = []
    for block in content:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{where}: a content block must be an object with a 'type'")
        if block["type"] != "text":
            raise BadRequest(
                f"{where}: {block['type']!r:.40} blocks are not served on /v1/messages yet "
                "(text only)"
            )
        if not isinstance(block.get("text"), str):
            raise BadRequest(f"{where}: a text block needs a string 'text'")
        texts.append(block["text"])
    return "".join(texts)


def messages_request(body: dict[str, Any], max_call_tokens: int) -> CallRequest:
    """A Messages API body as a chat call, or ``BadRequest`` naming the field."""
    for key, why in REFUSED_KEYS.items():
        if body.get(key) is not None:
            raise BadRequest(why)
    max_tokens = checked_max_tokens(body.get("max_tokens"), max_call_tokens)  # required here
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_MESSAGES:
        raise BadRequest(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "'system'")})
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"{where} must be an object whose 'role' is 'user' or 'assistant'")
        text = _text_of(message.get("content"), f"{where}.content")
        messages.append({"role": message["role"], "content": text})
    if messages[-1]["role"] != "user":
        raise BadRequest(
            "the last message must be the user's: a prefilled assistant turn is not served"
        )
    stop = checked_stop(body.get("stop_sequences") or [], "stop_sequences")
    return CallRequest(
        messages=messages, max_tokens=max_tokens, stop=stop, stream=checked_stream(body)
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
        self.model = model
        self.id = message_id
        self.usage = answer.usage
        self.rollstream = answer.rollstream
        self.stop_sequence = next((s for s in stop if self.text.endswith(s)), None)
        if answer.finish == "length":
            self.stop_reason = "max_tokens"
        elif self.stop_sequence is not None:
            self.stop_reason = "stop_sequence"
        else:
            self.stop_reason = "end_turn"

    def whole(self) -> dict[str, Any]:
        return {
            **opening(self.id, self.model, self.usage["prompt_tokens"])["message"],
            "content": [{"type": "text", "text": self.text}],
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": {
                "input_tokens": self.usage["prompt_tokens"],
                "output_tokens": self.usage["completion_tokens"],
            },
            "rollstream": self.rollstream,
        }

    def events(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The events after ``opening``'s: the text, the block's end, the message's end."""
        delta = {"type": "text_delta", "text": self.text}
        yield "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": 0}
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": {"output_tokens": self.usage["completion_tokens"]},
            },
        )
        yield "message_stop", {"type": "message_stop"}


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
