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
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from producers.engine.request_checks import Flag, refused, tag, tag_of
from producers.gateway.answers import Answer
from producers.gateway.requests import (
    MAX_MESSAGES,
    BadRequest,
    CallRequest,
    MaxTokens,
    StopSequences,
    parse,
    worded,
)

ROLES = frozenset({"user", "assistant"})
MAX_BLOCKS = 4096
MAX_TOOLS = 256
MAX_NAME_CHARS = 256
"""Of a tool's name, a tool call's id and the id a result answers."""

Name = Annotated[str, Strict(), Field(max_length=MAX_NAME_CHARS)]
NAME_LIMIT = f"up to {MAX_NAME_CHARS} characters"


class Part(BaseModel):
    """A content block or a tool. Fields the gateway does not read (``cache_control``,
    ``citations``, ``is_error``, ...) are accepted and ignored, as the Messages API does. A
    field's failure is worded by ``why`` as the part's, naming what the part needs."""

    model_config = ConfigDict(extra="ignore")

    why: ClassVar[dict[str, str]] = {}

    @model_validator(mode="wrap")
    @classmethod
    def _worded(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            loc = exc.errors()[0]["loc"]
            why = cls.why.get(str(loc[0])) if loc else None
            if why is None:
                raise  # a nested block's own error: it names that block
            raise refused(why) from None


class TextBlock(Part):
    why: ClassVar[dict[str, str]] = {"text": "is refused: a text block needs a string 'text'"}

    type: Literal["text"]
    text: Annotated[str, Strict()]


def _content(
    kinds: dict[str, type[Part]], unserved: str, role: str = "", shape: str = "content blocks"
) -> Any:
    """A content as a list of blocks of these ``kinds`` (a string: one text block), each
    told apart by its ``type``; a block of any other type is refused as not served
    ``unserved`` (with ``role``: in a message of that role)."""

    def kind(block: Any) -> str | None:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            return None
        return tag_of(block["type"] if block["type"] in kinds else "other")

    def refuse(block: dict[str, Any]) -> Any:
        here = (
            f" in a {role} message" if role and block["type"] in ("tool_use", "tool_result") else ""
        )
        raise refused(
            "is refused: {kind} blocks are not served {unserved}{here}",
            kind=f"{block['type']!r:.40}", unserved=unserved, here=here,
        )  # fmt: skip

    members = [Annotated[model, tag(name)] for name, model in kinds.items()]
    other = Annotated[dict[str, Any], AfterValidator(refuse), tag("other")]
    block = Annotated[
        Union[tuple([*members, other])],  # noqa: UP007 (built from the kinds)
        Discriminator(
            kind,
            custom_error_type="refused",
            custom_error_message="must be an object with a 'type'",
        ),
    ]
    return Annotated[
        list[block],
        Field(max_length=MAX_BLOCKS),
        BeforeValidator(lambda v: [{"type": "text", "text": v}] if isinstance(v, str) else v),
        worded(f"must be a string or a list of {shape} (at most {MAX_BLOCKS})", items_speak=True),
    ]


def _said(blocks: list[Part]) -> str:
    """A content's text blocks, joined."""
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


Text = Annotated[
    _content({"text": TextBlock}, "here", shape="text blocks"),
    AfterValidator(_said),
]
"""A content of text blocks only, joined: a system prompt, a tool's result."""


class ToolUseBlock(Part):
    """An assistant's call of a tool: one of its ``tool_calls``."""

    why: ClassVar[dict[str, str]] = {
        "id": f"is refused: a tool_use block needs a string 'id' and 'name' ({NAME_LIMIT})",
        "name": f"is refused: a tool_use block needs a string 'id' and 'name' ({NAME_LIMIT})",
        "input": "is refused: a tool_use block's 'input' must be an object",
    }

    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any] = Field(default_factory=dict)

    def call(self) -> dict[str, Any]:
        arguments = json.dumps(self.input, ensure_ascii=False)
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


class ToolResultBlock(Part):
    """A user's answer to a call: a ``tool`` message."""

    why: ClassVar[dict[str, str]] = {
        "tool_use_id": (
            f"is refused: a tool_result block needs a string 'tool_use_id' ({NAME_LIMIT})"
        ),
    }

    type: Literal["tool_result"]
    tool_use_id: Name
    content: Text = ""

    def message(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.tool_use_id, "content": self.content}


class UserMessage(BaseModel):
    """A user's turn: its ``tool`` results, then its text."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["user"]
    content: _content(
        {"text": TextBlock, "tool_result": ToolResultBlock}, "on /v1/messages", "user"
    )

    def chat(self) -> list[dict[str, Any]]:
        said = _said(self.content)
        results = [b.message() for b in self.content if isinstance(b, ToolResultBlock)]
        return [*results, {"role": "user", "content": said}] if said or not results else results


class AssistantMessage(BaseModel):
    """An assistant's turn: its text and ``tool_calls``."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["assistant"]
    content: _content({"text": TextBlock, "tool_use": ToolUseBlock}, "on /v1/messages", "assistant")

    def chat(self) -> list[dict[str, Any]]:
        said = _said(self.content)
        calls = [b.call() for b in self.content if isinstance(b, ToolUseBlock)]
        if calls:
            return [{"role": "assistant", "content": said or None, "tool_calls": calls}]
        return [{"role": "assistant", "content": said}]


def _role(message: Any) -> str | None:
    role = message.get("role") if isinstance(message, dict) else None
    return tag_of(role) if role in ROLES else None


Message = Annotated[
    Annotated[UserMessage, tag("user")] | Annotated[AssistantMessage, tag("assistant")],
    Discriminator(
        _role,
        custom_error_type="refused",
        custom_error_message="must be an object whose 'role' is 'user' or 'assistant'",
    ),
]


class Tool(Part):
    """A tool the model may call, as the chat template's ``function``."""

    why: ClassVar[dict[str, str]] = dict.fromkeys(
        ("name", "input_schema"),
        f"needs a string 'name' ({NAME_LIMIT}) and an 'input_schema' object",
    )

    name: Name
    input_schema: dict[str, Any]
    description: Annotated[str, Strict()] | None = None

    def function(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    """``auto``, or ``none`` (the answer is not parsed for calls)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "none"]


def _no_thinking(value: Any) -> Any:
    if value is not None:
        raise refused("is not served by this gateway (extended thinking)")
    return value


class MessagesBody(BaseModel):
    """A Messages API body. Other fields (``temperature``, ``metadata``, ...) are accepted
    and ignored: sampling is the run's."""

    model_config = ConfigDict(extra="allow")

    thinking: Annotated[Any, AfterValidator(_no_thinking)] = None
    tools: Annotated[
        Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None,
        worded(f"must be a list of at most {MAX_TOOLS} tools", items_speak=True),
    ] = None
    tool_choice: Annotated[
        ToolChoice | None,
        worded(
            'must be {"type": "auto"} or {"type": "none"}: a forced call (\'any\', '
            "'tool') is not the policy's own choice, which is what is trained"
        ),
    ] = None
    max_tokens: MaxTokens
    messages: Annotated[
        list[Message],
        Field(min_length=1, max_length=MAX_MESSAGES),
        worded(f"must be a list of 1 to {MAX_MESSAGES} messages", items_speak=True),
    ]
    system: Text | None = None
    stop_sequences: StopSequences = []
    stream: Flag = False


def messages_request(body: dict[str, Any], max_call_tokens: int) -> CallRequest:
    """A Messages API body as a chat call, or ``BadRequest`` naming the field."""
    call = parse(MessagesBody, body, max_call_tokens)
    tools = [tool.function() for tool in call.tools or []] or None
    messages: list[dict[str, Any]] = []
    if call.system is not None:
        messages.append({"role": "system", "content": call.system})
    for message in call.messages:
        messages += message.chat()
    if messages[-1]["role"] not in ("user", "tool"):
        raise BadRequest(
            "the last message must be the user's: a prefilled assistant turn is not served"
        )
    return CallRequest(
        messages=messages,
        tools=tools,
        parse_tools=tools is not None and getattr(call.tool_choice, "type", None) != "none",
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
