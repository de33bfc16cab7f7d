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
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from producers.engine.request_checks import Flag, field_name, refused

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 4


_Body = TypeVar("_Body", bound=BaseModel)


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


_PHRASES = {
    "bool_type": "must be a boolean",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}


def _refusal(exc: ValidationError) -> BadRequest:
    """The first error of ``exc`` as the gateway words it: ``'field' must be ...``."""
    error = exc.errors(include_url=False)[0]
    where = field_name(error["loc"])
    phrase = _PHRASES.get(error["type"])
    if error["type"] == "missing":
        return BadRequest(f"'{where}' is required")
    if error["type"] == "refused":
        return BadRequest(f"'{where}' {error['msg']}" if where else error["msg"])
    if phrase is None:
        phrase = f"is refused: {error['msg'][0].lower()}{error['msg'][1:]}"
    return BadRequest(f"'{where}' {phrase}, got {error['input']!r:.40}")


def _within_limit(value: int | None, info: ValidationInfo) -> int | None:
    limit = info.context["max_call_tokens"] if info.context else None
    if value is not None and limit is not None and value > limit:
        raise refused(
            "{value} exceeds this gateway's per-call limit {limit}: [producers.rollout.gateway] "
            "max_call_tokens raises it (unset, it is the task's max_new_tokens)",
            value=value,
            limit=limit,
        )
    return value


def _one(value: Any) -> Any:
    if value != 1:
        raise refused("must be 1: an episode is one sequence of calls")
    return value


def worded(message: str, items_speak: bool = False) -> WrapValidator:
    """The field's declared type and limits, refused in the gateway's own words (with
    ``items_speak``, a list item's own error is left naming the item)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            if items_speak and any(e["loc"] and isinstance(e["loc"][0], int) for e in exc.errors()):
                raise  # a list item's own error: it names the item
            raise refused(message, value=repr(value)[:40]) from None

    return WrapValidator(check)


PositiveInt = Annotated[int, Strict(), Field(ge=1)]
MaxTokens = Annotated[
    PositiveInt,
    worded("must be a positive integer, got {value}"),
    AfterValidator(_within_limit),
]
"""A call's ``max_tokens``: required by the Messages API, optional (``OptionalMaxTokens``)
in OpenAI's."""
OptionalMaxTokens = Annotated[
    PositiveInt | None,
    worded("must be a positive integer, got {value}"),
    AfterValidator(_within_limit),
]


def stop_strings(shape: str = "", one: bool = False) -> Any:
    """Up to ``MAX_STOP_STRINGS`` non-empty stop strings (``one``: a lone string is one)."""
    return Annotated[
        list[Annotated[str, Strict(), Field(min_length=1)]],
        Field(max_length=MAX_STOP_STRINGS),
        worded(f"must be {shape}up to {MAX_STOP_STRINGS} non-empty strings"),
        BeforeValidator(lambda v: [v] if one and isinstance(v, str) else v or []),
    ]


ChatStop = stop_strings("a string or ", one=True)
StopSequences = stop_strings()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: Flag = False


class CallOptions(BaseModel):
    """What chat and completion bodies share. Other fields (``temperature``, ``user``, ...)
    are the run's to choose or the client's own: accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    n: Annotated[Any, AfterValidator(_one)] = 1
    max_tokens: OptionalMaxTokens = None
    max_completion_tokens: OptionalMaxTokens = None
    stop: ChatStop = []
    stream: Flag = False
    stream_options: Annotated[StreamOptions, BeforeValidator(lambda v: v or {})] = StreamOptions()

    def options(self) -> dict[str, Any]:
        chosen = "max_completion_tokens" in self.model_fields_set
        return {
            "max_tokens": self.max_completion_tokens if chosen else self.max_tokens,
            "stop": self.stop,
            "stream": self.stream,
            "include_usage": self.stream_options.include_usage,
        }


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Annotated[str, Strict()]


def _joined(content: str | list[TextPart] | None) -> str | None:
    return "".join(p.text for p in content) if isinstance(content, list) else content


class ChatMessage(BaseModel):
    """One chat message as the template gets it: known keys only (others dropped),
    content as text, ``tool_calls`` only on an assistant's."""

    model_config = ConfigDict(extra="ignore")

    role: Annotated[
        Literal["system", "developer", "user", "assistant", "tool"],
        worded(f"must be one of {sorted(ROLES)}, got {{value}}"),
    ]
    content: Annotated[
        Annotated[str, Strict()] | list[TextPart] | None,
        worded("must be a string, a list of text parts or null"),
        AfterValidator(_joined),
    ] = None
    name: Annotated[str, Strict()] = ""
    tool_calls: Annotated[
        list[dict[str, Any]] | None,
        worded("must be a list of objects, on an assistant message"),
    ] = None
    tool_call_id: Annotated[str, Strict()] = ""
    reasoning_content: Any = None
    refusal: Any = None

    @model_validator(mode="after")
    def _calls_are_the_assistants(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise refused("has tool_calls: only an assistant message may call tools")
        return self

    def for_template(self) -> dict[str, Any]:
        """The fields the client sent; a null content is ``""`` unless the message calls
        tools."""
        sent = {k: getattr(self, k) for k in self.model_fields_set}
        if "content" in sent and sent["content"] is None and not self.tool_calls:
            sent["content"] = ""
        return sent


class ChatBody(CallOptions):
    """A Chat Completions body; each message is checked by ``_message``."""

    messages: Annotated[
        list[ChatMessage],
        Field(min_length=1, max_length=MAX_MESSAGES),
        worded(f"must be a list of 1 to {MAX_MESSAGES} messages", items_speak=True),
    ]
    tools: Annotated[list[dict[str, Any]] | None, worded("must be a list of objects")] = None
    tool_choice: Any = None
    logprobs: Annotated[Flag, BeforeValidator(lambda v: v or False)] = False
    top_logprobs: Annotated[
        Any,
        AfterValidator(
            lambda v: _none_of(v, "is not supported: the sampled token's log-prob only")
        ),
    ] = None


def _none_of(value: Any, why: str) -> Any:
    if value:
        raise refused(why)
    return value


def _prompt(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise refused("must be a non-empty string or a list of token ids") from None


class CompletionBody(CallOptions):
    """A (legacy) Completions body: ``prompt`` is text or token ids; ``logprobs`` 0 asks
    for the sampled tokens' own (no top alternatives)."""

    prompt: Annotated[
        Annotated[str, Strict(), Field(min_length=1)]
        | Annotated[list[Annotated[int, Strict(), Field(ge=0)]], Field(min_length=1)],
        WrapValidator(_prompt),
    ] = Field(None, validate_default=True)
    logprobs: Annotated[int, Strict(), Field(ge=0, le=0)] | None = None


def parse(model: type[_Body], body: dict[str, Any], max_call_tokens: int) -> _Body:
    """``body`` as ``model``, its ``max_tokens`` within ``max_call_tokens``; or
    ``BadRequest`` naming the field."""
    try:
        return model.model_validate(body, context={"max_call_tokens": max_call_tokens})
    except ValidationError as exc:
        raise _refusal(exc) from exc


def chat_request(body: dict[str, Any], max_call_tokens: int) -> CallRequest:
    """A Chat Completions body, checked."""
    chat = parse(ChatBody, body, max_call_tokens)
    return CallRequest(
        messages=[m.for_template() for m in chat.messages],
        tools=chat.tools or None,
        logprobs=chat.logprobs,
        parse_tools=bool(chat.tools) and chat.tool_choice != "none",
        **chat.options(),
    )


def completion_request(body: dict[str, Any], max_call_tokens: int) -> CallRequest:
    """A (legacy) Completions body, checked: ``prompt`` is text or token ids."""
    call = parse(CompletionBody, body, max_call_tokens)
    prompt = call.prompt
    return CallRequest(
        prompt_text=prompt if isinstance(prompt, str) else None,
        prompt_ids=None if isinstance(prompt, str) else list(prompt),
        logprobs=call.logprobs == 0,
        **call.options(),
    )
