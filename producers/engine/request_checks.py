"""Checks of what an HTTP client sends the engine: typed sampling parameters and a token
budget per request.

Why at the boundary: the scheduler batches requests from many clients, so a value that
only fails inside a batch (a NaN temperature, a ``top_k`` that overflows a tensor) would
fail every request sharing it. Each value is refused here instead, with HTTP 400 naming
``sampling_params.<field>``; a request too large for the engine is refused whole with
HTTP 413 and its numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

MAX_TOP_K = 1 << 30
"""SGLang's "all tokens" top-k; larger values mean the same and would overflow a tensor."""
MAX_TOKEN_ID = 2**31 - 1
MAX_NEW_TOKENS = 2**31 - 1
MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_REQUEST_TOKENS = 262_144


class RequestRefused(ValueError):
    """A request the engine will not serve; ``status`` is the HTTP answer (400 or 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _name(key: str) -> str:
    return f"sampling_params.{key}"


def number(values: Mapping[str, Any], key: str, default: float) -> float:
    """A finite JSON number (not a string, bool or container)."""
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestRefused(f"{_name(key)} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise RequestRefused(f"{_name(key)} must be finite, got {value!r}")
    return float(value)


def integer(values: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    """A JSON integer in ``[low, high]`` (a float only when it is a whole number)."""
    value = values.get(key, default)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRefused(f"{_name(key)} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise RequestRefused(f"{_name(key)} must be in [{low}, {high}], got {value}")
    return value


def flag(values: Mapping[str, Any], key: str, default: bool) -> bool:
    """A JSON boolean: ``"false"`` or ``1`` is refused rather than read as true."""
    value = values.get(key, default)
    if not isinstance(value, bool):
        raise RequestRefused(f"{_name(key)} must be true or false, got {value!r}")
    return value


def token_ids(values: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """A list of at most ``MAX_STOP_TOKEN_IDS`` token ids (absent or null: none)."""
    value = values.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
        raise RequestRefused(
            f"{_name(key)} must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, "
            f"got {_short(value)}"
        )
    return tuple(integer({key: t}, key, 0, 0, MAX_TOKEN_ID) for t in value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def request_tokens(
    prompt_lengths: Sequence[int], max_new_tokens: Sequence[int], context: int
) -> int:
    """Tokens a request may hold at once: each prompt plus what it may generate (the
    context caps generation)."""
    return sum(
        n + max(0, min(new, context - n))
        for n, new in zip(prompt_lengths, max_new_tokens, strict=True)
    )


def check_budget(
    prompt_lengths: Sequence[int], max_new_tokens: Sequence[int], context: int, limit: int
) -> None:
    """Refuse (HTTP 413) a request whose tokens exceed the engine's ``max_request_tokens``."""
    total = request_tokens(prompt_lengths, max_new_tokens, context)
    if total > limit:
        raise RequestRefused(
            f"request needs {total} tokens ({len(prompt_lengths)} prompt(s) of "
            f"{sum(prompt_lengths)} tokens in all, plus max_new_tokens each), over the "
            f"engine's max_request_tokens of {limit}: send fewer prompts or ask for fewer "
            "new tokens",
            status=413,
        )


def json_object(raw: bytes, error: type[ValueError]) -> dict[str, Any]:
    """A request body as a JSON object (an empty body: ``{}``), or ``error`` saying why it
    is not one; the engine and the gateway each answer it with their own 400."""
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise error(f"body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise error("body must be a JSON object")
    return data
