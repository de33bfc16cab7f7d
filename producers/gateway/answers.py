"""The gateway's answers in the OpenAI shapes: whole or as stream chunks, with the
sampled tokens' log-probs when asked, and tool calls parsed out of the text.

Tool calls: with a ``tool_call_parser`` and ``tools`` in the request, the calls the model's
family writes (``producers.gateway.tool_parsers``) become ``message.tool_calls``; text
without a well-formed call is returned whole as ``content``. The record keeps the tokens
either way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from producers.gateway.tool_parsers import ParsedText, ToolReader
from producers.rollout.generation import Sample


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


Piece = tuple[str, tuple[str, float] | None]
"""What one token adds to an answer's text, and the token's own text and log-prob (when
they were asked for)."""


class TextStream:
    """A turn's text as its tokens come, for a stream: each new token's piece, the text it
    adds to the decoded text so far. A token that ends inside a character (the text then
    ends in U+FFFD) adds nothing until a later one completes it, so the pieces joined are
    the whole answer's text. Fed the tokens so far, again and again (``feed``), then what
    is left (``rest``); ``chunks`` gives the same as OpenAI stream chunks."""

    def __init__(
        self, decode: Callable[..., str], *, logprobs: bool, envelope: Envelope | None = None
    ) -> None:
        self.decode = decode
        self.logprobs = logprobs
        self.envelope = envelope
        self.ids: list[int] = []  # the tokens fed so far
        self.shown = ""  # the text their pieces hold
        self.offset = 0  # a completion token's text_offset counts from the answer's start

    def feed(self, ids: list[int], logprobs: list[float]) -> list[Piece]:
        """The pieces of the tokens of ``ids`` past those fed before (which ``ids`` must
        extend: tokens that do not are left to ``rest``); a token that adds no text is a
        piece only when its log-prob was asked for."""
        held = len(self.ids)
        if ids[:held] != self.ids:
            return []
        pieces: list[Piece] = []
        for end in range(held + 1, len(ids) + 1):
            text = self.decode(ids[:end], skip_special_tokens=True)
            piece = ""
            if (
                len(text) > len(self.shown)
                and text.startswith(self.shown)
                and not text.endswith("\ufffd")
            ):
                piece, self.shown = text[len(self.shown) :], text
            token = None
            if self.logprobs:
                token = (self.decode([ids[end - 1]], skip_special_tokens=False), logprobs[end - 1])
            if piece or token is not None:
                pieces.append((piece, token))
        self.ids = list(ids)
        return pieces

    def rest(self) -> str:
        """The text of every token fed past what the pieces gave (a character left
        incomplete at the end)."""
        final = self.decode(self.ids, skip_special_tokens=True)
        if final == self.shown or not final.startswith(self.shown):
            return ""
        rest, self.shown = final[len(self.shown) :], final
        return rest

    def chunks(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        """``feed``'s pieces as the envelope's stream chunks, with their log-probs."""
        return [self._chunk(piece, token) for piece, token in self.feed(ids, logprobs)]

    def rest_chunks(self) -> list[dict[str, Any]]:
        rest = self.rest()
        return [self._chunk(rest, None)] if rest else []

    def _chunk(self, piece: str, token: tuple[str, float] | None) -> dict[str, Any]:
        envelope = self.envelope
        assert envelope is not None, "chunks need the answer's envelope"
        chunk = envelope.chunk({"content": piece} if envelope.chat else piece, None)
        if token is not None:
            chunk["choices"][0]["logprobs"] = (
                {"content": [_chat_logprob(*token)]}
                if envelope.chat
                else _completion_logprobs([token], self.offset)
            )
            self.offset += len(token[0])
        return chunk


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
        tools: ToolReader | None = None,
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
        parsed = None if tools is None else tools.read(turn.response_ids, decode)
        self.parsed = parsed or ParsedText(text, [])
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

    def chunks(self, usage: bool, streamed: TextStream | None = None) -> Iterator[dict[str, Any]]:
        """The stream's chunks after the envelope's opening one: the text token by token
        (with each token's log-prob when asked) past what ``streamed`` already sent while
        the turn was generated, the tool calls, the finish."""
        if self.parsed.tool_calls:
            if self.parsed.content:
                yield self.envelope.chunk({"content": self.parsed.content}, None)
            calls = [{"index": i, **call} for i, call in enumerate(self.parsed.tool_calls)]
            yield self.envelope.chunk({"tool_calls": calls}, None)
        else:
            text = streamed or TextStream(
                self.decode, logprobs=self.logprobs, envelope=self.envelope
            )
            yield from text.chunks(self.turn.response_ids, self.turn.logprobs)
            yield from text.rest_chunks()
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
