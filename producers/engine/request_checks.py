"""Checks of what an HTTP client sends: the strict JSON field types the engine's and the
gateway's body models declare their limits with, a pydantic refusal as one line naming
the field, and the engine's token budget per request.

Why at the boundary: the scheduler batches requests from many clients, so a value that
only fails inside a batch (a NaN temperature, a ``top_k`` that overflows a tensor) would
fail every request sharing it. Each value is refused here instead, with HTTP 400 naming
``sampling_params.<field>``; a request too large for the engine is refused whole with
HTTP 413 and its numbers. Types are strict as JSON is: ``"2"`` is not a number, ``true``
is not 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

import orjson
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BeforeValidator,
    Field,
    Strict,
    Tag,
    ValidationError,
)
from pydantic_core import PydanticCustomError

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


def _whole(value: Any) -> Any:
    """JSON has one number type: a whole float (``5.0``) is the integer 5; ``5.5`` is not."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_whole), Strict()]
"""A JSON integer: not a string, a bool or a fractional number."""
Number = Annotated[float, Strict(), AllowInfNan(False)]
"""A finite JSON number: not a string, a bool or a container."""
Flag = Annotated[bool, Strict()]
"""A JSON boolean: ``"false"`` or ``1`` is refused rather than read as true."""
TokenId = Annotated[Integer, Field(ge=0, le=MAX_TOKEN_ID)]


def refused(message: str, **context: Any) -> PydanticCustomError:
    """A refusal a model's validator raises; ``refusal`` prints it after the field's name."""
    return PydanticCustomError("refused", message, context)


def only(*values: Any, absent: bool = True) -> AfterValidator:
    """A field accepted only at these values (and, with ``absent``, null or ``[]``):
    anything else asks for something this server does not do."""

    def check(value: Any) -> Any:
        if value not in values and not (absent and (value is None or value == [])):
            raise PydanticCustomError(
                "not_supported", "is not supported by this engine (only {only})",
                {"only": repr(values[0])},
            )  # fmt: skip
        return value

    return AfterValidator(check)


def tag_of(name: str) -> str:
    """A discriminated union member's tag, as its discriminator returns it: pydantic puts
    it in an error's location, where ``field_name`` knows it by its brackets and leaves it
    out."""
    return f"<{name}>"


def tag(name: str) -> Tag:
    """The member's ``Tag`` (``tag_of``)."""
    return Tag(tag_of(name))


def field_name(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """A pydantic error's location as a client writes it: ``sampling_params.stop[3]``."""
    where = prefix
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        elif not part.startswith("<"):
            where += f"{'.' if where else ''}{part}"
    return where


def refusal(exc: ValidationError, prefix: str = "") -> str:
    """The first error of ``exc`` as one line naming the field (``prefix`` then its
    location, ``stop_token_ids[3]``) and the problem, with the value it got."""
    error = exc.errors(include_url=False)[0]
    where = field_name(error["loc"], prefix)
    kind, message, value = error["type"], error["msg"], error["input"]
    if kind == "not_supported":
        return f"{where}={_short(value)} {message}"
    if kind == "bool_type":
        return f"{where} must be true or false, got {_short(value)}"
    if kind == "extra_forbidden":
        return f"{where} is not supported (an unknown field)"
    if kind == "missing":
        return f"{where} is required"
    if kind == "refused":
        return f"{where} {message}" if where else message
    return f"{where}: {message[0].lower()}{message[1:]}, got {_short(value)}"


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
