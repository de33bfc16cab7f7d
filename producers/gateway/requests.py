"""The gateway's requests, checked: the OpenAI Chat Completions and Completions bodies it
takes, turned into one ``CallRequest`` or refused with a message naming the field.

Sampling belongs to the run, not to the agent: the log-probs the trainer corrects with must
come from the run's sampling settings, so ``temperature``, ``top_p`` and the like are
accepted and ignored. What a call may choose: ``max_tokens`` (or
``max_completion_tokens``) up to the gateway's per-call limit, ``stop`` strings,
``stream`` (and ``stream_options.include_usage``), ``logprobs`` (the sampled tokens' own;
top alternatives are refused), and ``tools`` (passed to the chat template; ``tool_choice``
"none" keeps the answer's text unparsed). ``n`` > 1 is refused: one episode is one
sequence of calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MESSAGE_KEYS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal"}
)
MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 4


class BadRequest(ValueError):
    """A request the gateway answers 400, before any generation."""


@dataclass(frozen=True)
class CallRequest:
    """One call, checked: the chat messages (or a completion prompt) and its options."""

    messages: list[dict[str, Any]] | None = None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    parse_tools: bool = False


def checked_max_tokens(max_tokens: Any, max_call_tokens: int) -> int:
    """A call's ``max_tokens``: a positive integer within the gateway's per-call limit."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {max_tokens!r:.40}")
    if max_tokens > max_call_tokens:
        raise BadRequest(
            f"'max_tokens' {max_tokens} exceeds this gateway's per-call limit "
            f"{max_call_tokens}: [producers.rollout.gateway] max_call_tokens raises it "
            "(unset, it is the task's max_new_tokens)"
        )
    return max_tokens


def checked_stop(stop: Any, name: str, shape: str = "") -> list[str]:
    """A call's stop strings (field ``name``, which may also take ``shape``): up to
    ``MAX_STOP_STRINGS`` non-empty ones."""
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequest(f"'{name}' must be {shape}up to {MAX_STOP_STRINGS} non-empty strings")
    return stop


def checked_stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    return stream


def _options(body: dict[str, Any], max_call_tokens: int) -> dict[str, Any]:
    """What chat and completion requests share."""
    if body.get("n", 1) != 1:
        raise BadRequest("'n' must be 1: an episode is one sequence of calls")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = checked_max_tokens(max_tokens, max_call_tokens)
    stop = body.get("stop")
    stop = checked_stop([stop] if isinstance(stop, str) else stop or [], "stop", "a string or ")
    stream = checked_stream(body)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object")
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean")
    return {
        "max_tokens": max_tokens,
        "stop": stop,
        "stream": stream,
        "include_usage": include_usage,
    }


def chat_request(body: dict[str, Any], max_call_tokens: int) -> CallRequest:
    """A Chat Completions body, checked."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise BadRequest("'tools' must be a list of objects")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise BadRequest("'logprobs' must be a boolean")
    if body.get("top_logprobs"):
        raise BadRequest("'top_logprobs' is not supported: the sampled token's log-prob only")
    return CallRequest(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=tools or None,
        logprobs=logprobs,
        parse_tools=bool(tools) and body.get("tool_choice") != "none",
        **_options(body, max_call_tokens),
    )


def _message(message: Any, index: int) -> dict[str, Any]:
    """One chat message as the template gets it: known keys only, content as text."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {sorted(ROLES)}, got {role!r:.40}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(f"{where}.content: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content: a text part without text")
            texts.append(part["text"])
        content = "".join(texts)
    if content is not None and not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string, a list of text parts or null")
    if content is None and not message.get("tool_calls"):
        content = ""
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and (
        role != "assistant"
        or not isinstance(tool_calls, list)
        or not all(isinstance(c, dict) for c in tool_calls)
    ):
        raise BadRequest(f"{where}.tool_calls must be a list of objects, on an assistant message")
    for key in ("name", "tool_call_id"):
        if key in message and not isinstance(message[key], str):
            raise BadRequest(f"{where}.{key} must be a string")
    return {k: (content if k == "content" else v) for k, v in message.items() if k in MESSAGE_KEYS}


def completion_request(body: dict[str, Any], max_call_tokens: int) -> CallRequest:
    """A (legacy) Completions body, checked: ``prompt`` is text or token ids."""
    prompt = body.get("prompt")
    options = _options(body, max_call_tokens)
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs != 0
    ):
        raise BadRequest(
            f"'logprobs' must be 0 (the sampled tokens' log-probs; no top alternatives), "
            f"got {logprobs!r:.40}"
        )
    options["logprobs"] = logprobs == 0
    if isinstance(prompt, str) and prompt:
        return CallRequest(prompt_text=prompt, **options)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return CallRequest(prompt_ids=list(prompt), **options)
    raise BadRequest("'prompt' must be a non-empty string or a list of token ids")
