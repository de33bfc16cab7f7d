"""The gateway's answers in the OpenAI shapes: whole or as stream chunks, with the
sampled tokens' log-probs when asked, and tool calls parsed out of the text.

Tool calls: with ``tool_call_parser = "hermes"`` and ``tools`` in the request, every
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of the model's text
becomes an entry of ``message.tool_calls`` (the format of the Qwen2.5/Qwen3, Hermes and
SmolLM3 chat templates, which render the agent's ``tool_calls`` back the same way). Text
with a block that is not such an object is returned whole as ``content``: the agent sees
what the model wrote. The record keeps the tokens either way.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from producers.rollout.generation import Sample

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedText:
    """The model's text split into what the agent reads as content and as tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_hermes_tool_calls(text: str) -> ParsedText:
    """``<tool_call>`` JSON blocks of ``text`` as OpenAI tool calls; ``text`` whole as
    content when it has none or any block is not a ``{"name", "arguments"}`` object."""
    blocks = list(TOOL_CALL_BLOCK.finditer(text))
    if not blocks:
        return ParsedText(text, [])
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.group(1))
        except ValueError:
            return ParsedText(text, [])
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedText(text, [])
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            arguments_json = arguments
        elif isinstance(arguments, dict):
            arguments_json = json.dumps(arguments, ensure_ascii=False)
        else:
            return ParsedText(text, [])
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments_json},
            }
        )
    content = text[: blocks[0].start()].strip()
    return ParsedText(content or None, calls)


class Envelope:
    """What every object of one answer shares (id, time, model, kind). A stream's opening
    chunk is sent from it before the turn exists: the client then holds an open stream,
    and one that leaves while the turn is generated is seen to leave."""

    def __init__(self, *, model: str, chat: bool) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def opening(self) -> dict[str, Any] | None:
        """The stream's first chunk, sent before generation: the chat role (completions
        have none)."""
        return self.chunk({"role": "assistant", "content": ""}, None) if self.chat else None

    def chunk(self, delta: Any, finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        return self.frame("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def frame(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """An answer object or stream chunk of ``kind`` around ``choices``."""
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


class Answer:
    """One call's answer, whole (``whole``) or as stream chunks (``chunks``)."""

    def __init__(
        self,
        turn: Sample,
        decode: Callable[..., str],
        *,
        envelope: Envelope,
        prompt_tokens: int,
        episode_id: str,
        logprobs: bool = False,
        parse_tools: bool = False,
    ) -> None:
        self.envelope = envelope
        self.chat = envelope.chat
        self.decode = decode
        self.turn = turn
        self.logprobs = logprobs
        self.usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(turn.response_ids),
            "total_tokens": prompt_tokens + len(turn.response_ids),
        }
        self.rollstream = {"episode_id": episode_id, "versions": [v for v, _ in turn.segments]}
        text = self._text(turn.response_ids)
        self.parsed = parse_hermes_tool_calls(text) if parse_tools else ParsedText(text, [])
        if self.parsed.tool_calls:
            self.finish = "tool_calls"
        else:
            self.finish = "length" if turn.finish_type == "length" else "stop"

    def _text(self, ids: list[int]) -> str:
        return self.decode(ids, skip_special_tokens=True)

    def whole(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish, "logprobs": None}
        tokens = self._tokens() if self.logprobs else []
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": self.parsed.content}
            if self.parsed.tool_calls:
                message["tool_calls"] = self.parsed.tool_calls
            choice["message"] = message
            if self.logprobs:
                choice["logprobs"] = {"content": [_chat_logprob(t, lp) for t, lp in tokens]}
        else:
            choice["text"] = self.parsed.content or ""
            if self.logprobs:
                choice["logprobs"] = _completion_logprobs(tokens)
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            **self.envelope.frame(kind, [choice]),
            "usage": self.usage,
            "rollstream": self.rollstream,
        }

    def chunks(self, usage: bool) -> Iterator[dict[str, Any]]:
        """The stream's chunks after the envelope's opening one: the text token by token
        (with each token's log-prob when asked), the tool calls, the finish."""
        if self.parsed.tool_calls:
            if self.parsed.content:
                yield self.envelope.chunk({"content": self.parsed.content}, None)
            calls = [{"index": i, **call} for i, call in enumerate(self.parsed.tool_calls)]
            yield self.envelope.chunk({"tool_calls": calls}, None)
        else:
            offset = 0  # a completion token's text_offset counts from the answer's start
            for piece, token in self._pieces():
                chunk = self.envelope.chunk({"content": piece} if self.chat else piece, None)
                if self.logprobs and token is not None:
                    chunk["choices"][0]["logprobs"] = (
                        {"content": [_chat_logprob(*token)]}
                        if self.chat
                        else _completion_logprobs([token], offset)
                    )
                    offset += len(token[0])
                yield chunk
        yield self.envelope.chunk({} if self.chat else "", self.finish)
        if usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield {**self.envelope.frame(kind, []), "usage": self.usage}

    def _tokens(self) -> list[tuple[str, float]]:
        """Each sampled token's text and log-prob."""
        ids, logprobs = self.turn.response_ids, self.turn.logprobs
        return [
            (self.decode([t], skip_special_tokens=False), lp)
            for t, lp in zip(ids, logprobs, strict=True)
        ]

    def _pieces(self) -> Iterator[tuple[str, tuple[str, float] | None]]:
        """The text token by token: what each token adds to the decoded text (with the
        token's text and log-prob); a token that adds nothing yet is sent only when its
        log-prob was asked for."""
        ids, shown = self.turn.response_ids, ""
        tokens = self._tokens() if self.logprobs else []
        for end in range(1, len(ids) + 1):
            text = self._text(ids[:end])
            piece = ""
            if text.startswith(shown) and len(text) > len(shown):
                piece, shown = text[len(shown) :], text
            token = tokens[end - 1] if end <= len(tokens) else None
            if piece or token is not None:
                yield piece, token
        final = self._text(ids)
        if final != shown and final.startswith(shown):
            yield final[len(shown) :], None


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8")),
        "top_logprobs": [],
    }


def _completion_logprobs(tokens: list[tuple[str, float]], start: int = 0) -> dict[str, Any]:
    offsets, at = [], start
    for token, _ in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": [t for t, _ in tokens],
        "token_logprobs": [lp for _, lp in tokens],
        "top_logprobs": None,
        "text_offset": offsets,
    }
