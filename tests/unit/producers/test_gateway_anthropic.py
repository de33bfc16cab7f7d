"""The Messages API's requests and answers, without a server: a conversation with tools
becomes the chat messages the template renders, the model's parsed calls become
``tool_use`` blocks (whole and as stream events), and garbage is refused naming the field.
The served path, with the real ``anthropic`` client: tests/integration/producers/test_gateway.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from producers.gateway.answers import Answer, Envelope
from producers.gateway.anthropic import (
    MAX_BLOCKS,
    MAX_NAME_CHARS,
    MAX_TOOLS,
    MessageAnswer,
    messages_request,
)
from producers.gateway.requests import MAX_MESSAGES, BadRequest
from producers.gateway.tool_parsers import HERMES, ToolReader
from producers.rollout.generation import Sample

pytestmark = pytest.mark.unit

LIMIT = 64
WEATHER = {"name": "weather", "description": "today's weather", "input_schema": {"type": "object"}}
WEATHER_AS_OPENAI = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object"},
        "description": "today's weather",
    },
}
"""The Messages API's weather tool as the chat template receives it."""


def _request(**body: Any) -> Any:
    return messages_request({"max_tokens": 8, **body}, LIMIT)


def test_a_tool_conversation_becomes_the_chat_templates_messages() -> None:
    call = _request(
        system=[{"type": "text", "text": "be brief"}],
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "checking"},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
        stop_sequences=["\n\n"],
        temperature=0.3,  # the run's sampling wins: accepted, ignored
    )
    assert call.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    assert call.tools == [WEATHER_AS_OPENAI]
    assert call.parse_tools and call.stop == ["\n\n"] and call.max_tokens == 8
    only_results = _request(
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
    )
    assert only_results.messages == [{"role": "tool", "tool_call_id": "t", "content": ""}]
    assert not only_results.parse_tools  # tool_choice none: the answer's text is not parsed


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"max_tokens": None}, "'max_tokens' must be a positive integer"),
        ({"max_tokens": 0}, "'max_tokens' must be a positive integer"),
        ({"max_tokens": True}, "'max_tokens' must be a positive integer"),
        ({"max_tokens": LIMIT + 1}, "per-call limit"),
        ({"messages": []}, "'messages' must be a list"),
        ({"messages": "hi"}, "'messages' must be a list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "'user' or 'assistant'"),
        ({"messages": ["hi"]}, "'user' or 'assistant'"),
        ({"messages": [{"role": "user", "content": 7}]}, "a string or a list of content blocks"),
        ({"messages": [{"role": "user", "content": [7]}]}, "an object with a 'type'"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a string 'text'"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "'image' blocks"),
        ({"messages": [*USER, {"role": "assistant", "content": "x"}]}, "the last message"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}
                ]
            },
            "'tool_use' blocks are not served on /v1/messages in a user message",
        ),
        (
            {
                "messages": [*USER, {"role": "assistant", "content": [{"type": "tool_result"}]}],
            },
            "in a assistant message",
        ),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": [{"type": "tool_use", "name": "b"}]},
                    *USER,
                ]
            },
            "needs a string 'id' and 'name'",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "a", "name": "b", "input": [1]}],
                    },
                    *USER,
                ]
            },
            "'input' must be an object",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 3}]}
                ]
            },
            "a string 'tool_use_id'",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "a",
                                "content": [{"type": "image"}],
                            }
                        ],
                    }
                ]
            },
            "'image' blocks are not served here",
        ),
        ({"system": 5}, "'system' must be a string or a list"),
        ({"tools": "weather"}, "'tools' must be a list"),
        ({"tools": [{"name": "weather"}]}, "an 'input_schema' object"),
        ({"tools": [WEATHER], "tool_choice": {"type": "any"}}, "a forced call"),
        ({"tool_choice": "auto"}, "'tool_choice' must be"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "extended thinking"),
        ({"stop_sequences": "\n"}, "'stop_sequences' must be up to 4"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "'stop_sequences' must be up to 4"),
        ({"stop_sequences": [""]}, "'stop_sequences' must be up to 4"),
        ({"stream": "yes"}, "'stream' must be a boolean"),
    ],
)
def test_garbage_is_refused_naming_the_field(body: dict[str, Any], why: str) -> None:
    with pytest.raises(BadRequest, match=why.replace("(", r"\(").replace(")", r"\)")):
        messages_request({"max_tokens": 8, "messages": USER, **body}, LIMIT)


def _turn(*blocks: Any, role: str = "user") -> dict[str, Any]:
    """A body whose one turn (after a user's, for an assistant's) holds ``blocks``."""
    turns = [{"role": role, "content": list(blocks)}]
    return {"messages": turns if role == "user" else [*USER, *turns, *USER]}


LONG = "x" * (MAX_NAME_CHARS + 1)
CALL = {"type": "tool_use", "id": "toolu_1", "name": "f"}
BLOCK_GARBAGE: list[tuple[dict[str, Any], str]] = [
    (_turn(True), r"'messages\[0\].content\[0\]' must be an object with a 'type'"),
    (_turn({"text": "hi"}), r"content\[0\]' must be an object with a 'type'"),
    (_turn({"type": 3, "text": "hi"}), r"content\[0\]' must be an object with a 'type'"),
    (_turn({"type": "text", "text": 5}), r"content\[0\]' is refused: a text block needs"),
    (_turn({"type": "text", "text": None}), "a text block needs a string 'text'"),
    (_turn({"type": "text", "text": ["a"]}), "a text block needs a string 'text'"),
    (_turn({"type": "document", "source": {}}), "'document' blocks are not served"),
    (_turn({"type": "thinking", "thinking": "hm"}, role="assistant"), "'thinking' blocks"),
    (_turn({"type": "x" * 100}), "'" + "x" * 39 + " blocks"),  # its repr cut at 40
    (_turn({"type": "server_tool_use"}, role="assistant"), "'server_tool_use' blocks"),
    (_turn({**CALL, "id": True}, role="assistant"), "needs a string 'id' and 'name'"),
    (_turn({**CALL, "name": 7}, role="assistant"), "needs a string 'id' and 'name'"),
    (_turn({**CALL, "id": LONG}, role="assistant"), f"up to {MAX_NAME_CHARS} characters"),
    (_turn({**CALL, "input": '{"a": 1}'}, role="assistant"), "'input' must be an object"),
    (_turn({**CALL, "input": None}, role="assistant"), "'input' must be an object"),
    (_turn({"type": "tool_result"}), "a string 'tool_use_id'"),
    (_turn({"type": "tool_result", "tool_use_id": LONG}), "a string 'tool_use_id'"),
    (
        _turn({"type": "tool_result", "tool_use_id": "t", "content": {"text": "4"}}),
        r"content\[0\].content' must be a string or a list of text blocks",
    ),
    (
        _turn({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]}),
        r"content\[0\].content\[0\]' is refused: a text block needs",
    ),
    (
        _turn({"type": "tool_result", "tool_use_id": "t", "content": [CALL]}),
        "'tool_use' blocks are not served here",
    ),
    (_turn(*[{"type": "text", "text": "a"}] * (MAX_BLOCKS + 1)), "list of content blocks"),
    ({"messages": [{"role": "user"}]}, r"'messages\[0\].content' is required"),
    ({"messages": [{"role": "user", "content": None}]}, "a string or a list of content blocks"),
    ({"messages": [{"role": True, "content": "hi"}]}, "'user' or 'assistant'"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "'user' or 'assistant'"),
    ({"messages": [USER[0]] * (MAX_MESSAGES + 1)}, "'messages' must be a list of 1 to"),
    ({"system": [{"type": "image", "source": {}}]}, r"'system\[0\]' is refused: 'image' blocks"),
    ({"system": [{"type": "text", "text": 1}]}, r"'system\[0\]' is refused: a text block"),
    ({"system": {"type": "text", "text": "hi"}}, "'system' must be a string or a list"),
    ({"system": [{"type": "text", "text": "a"}] * (MAX_BLOCKS + 1)}, "'system' must be"),
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, f"at most {MAX_TOOLS} tools"),
    ({"tools": [7]}, r"'tools\[0\]' must be an object, got 7"),
    ({"tools": [{**WEATHER, "name": LONG}]}, r"'tools\[0\]' needs a string 'name'"),
    ({"tools": [{**WEATHER, "name": False}]}, r"'tools\[0\]' needs a string 'name'"),
    ({"tools": [{**WEATHER, "input_schema": "{}"}]}, "an 'input_schema' object"),
    ({"tools": [{**WEATHER, "description": 3}]}, r"'tools\[0\].description'"),
    ({"tools": {"name": "weather"}}, "'tools' must be a list"),
    ({"tool_choice": {"type": "tool", "name": "weather"}}, "a forced call"),
    ({"tool_choice": {}}, "'tool_choice' must be"),
    ({"tool_choice": ["auto"]}, "'tool_choice' must be"),
]


@pytest.mark.parametrize(("body", "why"), BLOCK_GARBAGE, ids=[w[:48] for _, w in BLOCK_GARBAGE])
def test_block_garbage_is_refused_naming_the_block(body: dict[str, Any], why: str) -> None:
    """Every content block, system prompt and tool is a model with its limits: a wrong
    type, a bool, a missing field, a list or a name past its limit, an unknown block type
    is a ``BadRequest`` (a 400) naming where, never another exception (a 500)."""
    with pytest.raises(BadRequest, match=why):
        messages_request({"max_tokens": 8, "messages": USER, **body}, LIMIT)


def test_the_anthropic_clients_extra_fields_are_accepted_and_ignored() -> None:
    """What the Messages API takes beside what the gateway reads (``cache_control``,
    ``citations``, ``is_error``, a tool's ``type``, ``disable_parallel_tool_use``) is
    ignored, as the API ignores what it does not need."""
    cached = {"cache_control": {"type": "ephemeral"}}
    call = _request(
        system=[{"type": "text", "text": "be brief", **cached}],
        tools=[{**WEATHER, "type": "custom", **cached}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        metadata={"user_id": "u"},
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "citations": None}]},
            {"role": "assistant", "content": [{**CALL, "input": {}, **cached}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, **cached},
                    {"type": "text", "text": "go on", **cached},
                ],
            },
        ],
    )
    assert call.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": ""},
        {"role": "user", "content": "go on"},
    ]
    assert call.tools == [WEATHER_AS_OPENAI]
    assert call.parse_tools


WORDS = [
    "Sunny",
    " today",
    "<eos>",
    '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>',
]


def _answer(ids: list[int], finish: str = "stop", *, parse_tools: bool = False) -> Answer:
    def decode(tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            WORDS[t] for t in tokens if not (skip_special_tokens and WORDS[t] == "<eos>")
        )

    turn = Sample(ids, [-0.5] * len(ids), [[3, len(ids)]], finish, 0)
    envelope = Envelope(model="policy", chat=True)
    return Answer(
        turn,
        decode,
        envelope=envelope,
        prompt_tokens=11,
        episode_id="e1",
        tools=ToolReader(HERMES, {}) if parse_tools else None,
    )


def test_an_answer_is_a_message_and_its_event_stream() -> None:
    message = MessageAnswer(_answer([0, 1, 2]), "policy", [], "msg_1")
    whole = message.whole()
    assert whole["content"] == [{"type": "text", "text": "Sunny today"}]
    assert (whole["id"], whole["type"], whole["role"], whole["model"]) == (
        "msg_1",
        "message",
        "assistant",
        "policy",
    )
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("end_turn", None)
    assert whole["usage"] == {"input_tokens": 11, "output_tokens": 3}
    assert whole["rollstream"] == {"episode_id": "e1", "versions": [3]}
    names = [name for name, _ in message.events()]
    assert names == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert MessageAnswer(_answer([0, 1], "length"), "p", [], "m").stop_reason == "max_tokens"
    stopped = MessageAnswer(_answer([0, 1]), "p", ["day", "x"], "m")
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "day")


def test_a_parsed_tool_call_is_a_tool_use_block_whole_and_streamed() -> None:
    message = MessageAnswer(_answer([3], parse_tools=True), "policy", [], "msg_2")
    whole = message.whole()
    assert whole["stop_reason"] == "tool_use"
    text, use = whole["content"]
    assert text == {"type": "text", "text": ""}
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert (use["name"], use["input"]) == ("weather", {"city": "Paris"})
    events = list(message.events())
    starts = [data for name, data in events if name == "content_block_start"]
    assert starts == [
        {"type": "content_block_start", "index": 1, "content_block": {**use, "input": {}}}
    ]
    (partial,) = [d["delta"] for n, d in events if n == "content_block_delta" and d["index"] == 1]
    assert partial["type"] == "input_json_delta"
    assert json.loads(partial["partial_json"]) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    unparsed = MessageAnswer(_answer([3]), "policy", [], "msg_3")  # tool_choice none
    assert unparsed.stop_reason == "end_turn" and unparsed.whole()["content"][0]["text"] == WORDS[3]
