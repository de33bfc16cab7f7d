"""Tool calls per model family, round trip through both APIs: the model's text (as its
family writes a call) becomes tool calls, the agent sends them back with the tool's result
(OpenAI ``tool_calls`` and ``tool`` messages, Anthropic ``tool_use`` and ``tool_result``
blocks), and the family's chat template renders the call and the result into the next
prompt. Then the same served: the gateway on loopback with ``auto``, a scripted policy, the
real ``openai`` and ``anthropic`` clients. Tokenizers and templates:
tests/support/tool_models.py (built here)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import anthropic
import openai
import pytest
from pydantic import ValidationError
from support.tool_models import HERMES_TEMPLATE, family_tokenizer

from producers.config import GatewayConfig
from producers.gateway.answers import Answer, Envelope
from producers.gateway.anthropic import MessageAnswer, messages_request
from producers.gateway.desk import GatewayEpisode
from producers.gateway.requests import BadRequest, CallRequest, chat_request
from producers.gateway.server import Gateway, ServedPolicy
from producers.gateway.tool_parsers import (
    NoToolFamily,
    family_of_template,
    parse_hermes,
    parse_llama3,
    parse_mistral,
    template_messages,
    tool_reader,
)
from producers.rollout.generation import Sample
from producers.rollout.metrics import ProducerMetrics
from producers.tasks.base import Prompt
from producers.tasks.environments import EpisodeLimits

pytestmark = pytest.mark.unit

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
RESULT = "the sum is 5"
CASES = {
    # family: (what the model writes, how its template renders the call, and the result)
    "hermes": (
        'Adding.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n",
    ),
    "llama3": (
        '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": '
        '{"a": 2, "b": 3}}<|eot_id|>',
        f"<|start_header_id|>ipython<|end_header_id|>\n\n{RESULT}<|eot_id|>",
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}]',
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "{id}"}]</s>',
        f'[TOOL_RESULTS] {{"content": "{RESULT}", "call_id": "{{id}}"}}[/TOOL_RESULTS]',
    ),
}


def _answer(tokenizer: Any, text: str, family: str = "auto") -> Answer:
    """The model's answer ``text`` (its end-of-turn token after it) as the gateway answers."""
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    turn = Sample(ids, [-0.1] * len(ids), [[0, len(ids)]], "stop", 0)
    return Answer(
        turn,
        tokenizer.decode,
        envelope=Envelope(model="policy", chat=True),
        prompt_tokens=3,
        episode_id="e1",
        tools=tool_reader(family, tokenizer),
    )


def _prompt(tokenizer: Any, call: CallRequest, family: str = "auto") -> str:
    """The next call's prompt as the gateway renders it."""
    reader = tool_reader(family, tokenizer)
    messages = template_messages(call.messages or [], reader and reader.family)
    return tokenizer.apply_chat_template(
        messages, tools=call.tools, add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_call_goes_round_trip_through_the_openai_api(family: str) -> None:
    tokenizer = family_tokenizer(family)
    written, rendered_call, rendered_result = CASES[family]
    whole = _answer(tokenizer, written).whole()
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert message["content"] == ("Adding." if family == "hermes" else None)
    body = {
        "tools": [ADD],
        "messages": [
            {"role": "user", "content": "add 2 and 3"},
            message,
            {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
        ],
    }
    prompt = _prompt(tokenizer, chat_request(body, 64))
    assert rendered_call.replace("{id}", call["id"]) in prompt
    assert rendered_result.replace("{id}", call["id"]) in prompt
    assert prompt.index(rendered_call[:12]) < prompt.index(RESULT)


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_call_goes_round_trip_through_the_messages_api(family: str) -> None:
    tokenizer = family_tokenizer(family)
    written, rendered_call, rendered_result = CASES[family]
    reply = MessageAnswer(_answer(tokenizer, written), "policy", [], "msg_1").whole()
    assert reply["stop_reason"] == "tool_use"
    use = reply["content"][-1]
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "add", {"a": 2, "b": 3})
    body = {
        "max_tokens": 8,
        "tools": [{"name": "add", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "add 2 and 3"},
            {"role": "assistant", "content": reply["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": RESULT}],
            },
        ],
    }
    prompt = _prompt(tokenizer, messages_request(body, 64))
    call_id = use["id"][-9:] if family == "mistral" else ""  # its templates take 9 characters
    assert rendered_call.replace("{id}", call_id) in prompt
    assert rendered_result.replace("{id}", call_id) in prompt


def test_auto_picks_the_family_from_the_chat_template_and_refuses_an_unknown_one() -> None:
    for family in CASES:
        reader = tool_reader("auto", family_tokenizer(family))
        assert reader is not None and reader.family.name == family
    no_tools = family_tokenizer("hermes", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tool_reader("auto", no_tools) is None
    unknown = HERMES_TEMPLATE.replace("<tool_call>", "<function>")
    with pytest.raises(NoToolFamily, match="takes tools but holds none"):
        tool_reader("auto", family_tokenizer("hermes", unknown))
    assert family_of_template({"default": "x", "tool_use": "[TOOL_CALLS]"}).name == "mistral"
    assert tool_reader("qwen", family_tokenizer("hermes")).family.name == "hermes"
    assert tool_reader("none", family_tokenizer("hermes")) is None


def test_an_unknown_parser_name_is_refused_at_config_load() -> None:
    with pytest.raises(ValidationError, match="'auto'"):
        GatewayConfig(tool_call_parser="pythonic")
    assert GatewayConfig(tool_call_parser="mistral").tool_call_parser == "mistral"


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_hermes, "<tool_call>{not json}</tool_call>"),
        (parse_hermes, '<tool_call>{"name": "add", "arguments": 5}</tool_call>'),
        (parse_llama3, '{"name": "add", "parameters": {"a": 2}'),  # never closed
        (parse_llama3, '{"name": "add", "parameters": [2]}'),
        (parse_llama3, '{"title": "not a call"}'),
        (parse_llama3, '<|python_tag|>{"name": "add", "parameters": {}}; oops'),
        (parse_llama3, "<|python_tag|>print(1)"),
        (parse_mistral, "[TOOL_CALLS] [{broken"),
        (parse_mistral, '[TOOL_CALLS] [{"arguments": {}}]'),
        (parse_mistral, "[TOOL_CALLS] []"),
        (parse_mistral, '[TOOL_CALLS] ["add"]'),
        (parse_mistral, "[TOOL_CALLS]add[ARGS]{oops"),
    ],
)
def test_a_malformed_call_is_the_text_whole(parse: Any, text: str) -> None:
    parsed = parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_a_malformed_call_reaches_the_agent_as_the_decoded_text() -> None:
    """Special marker tokens are kept for parsing, but the content the agent reads is
    the text as decoded without them, as for any answer."""
    tokenizer = family_tokenizer("mistral")
    whole = _answer(tokenizer, "[TOOL_CALLS] [{broken").whole()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": " [{broken"}
    assert whole["choices"][0]["finish_reason"] == "stop"


def test_each_format_reads_several_calls_and_the_content_before_them() -> None:
    llama = parse_llama3('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [c["function"]["name"] for c in llama.tool_calls] == ["a", "b"]
    mistral = parse_mistral('Sure.[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b"}]')
    assert mistral.content == "Sure." and [c["function"]["name"] for c in mistral.tool_calls] == [
        "a",
        "b",
    ]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in mistral.tool_calls)
    newer = parse_mistral('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in newer.tool_calls] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]


@pytest.mark.parametrize(
    "content",
    [{"sum": 5}, 5, [{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text"}]],
)
def test_a_tool_result_that_is_not_text_is_refused(content: Any) -> None:
    openai = {"messages": [{"role": "tool", "tool_call_id": "c1", "content": content}]}
    with pytest.raises(BadRequest, match=r"messages\[0\]\.content"):
        chat_request(openai, 64)
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
    anthropic = {"max_tokens": 8, "messages": [{"role": "user", "content": [result]}]}
    with pytest.raises(BadRequest):
        messages_request(anthropic, 64)


class _Desk:
    """The one episode the served test's calls go to."""

    def __init__(self) -> None:
        self.the_episode = GatewayEpisode(
            "ep1", "g1", 0, Prompt([]), EpisodeLimits(), "split", state="active"
        )

    def episode(self, episode_id: str) -> GatewayEpisode:
        return self.the_episode

    def abandon(self, episode: GatewayEpisode, kind: str, reason: str) -> None:
        raise AssertionError(f"abandoned: {kind} {reason}")

    async def commit_call(self, episode: GatewayEpisode, turn: Sample, prompt_tokens: int) -> None:
        episode.add_turn(turn)  # no ledger here


class _Model:
    """The policy's turns, scripted: each call's answer is the next text, then the
    end-of-turn token."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.task = SimpleNamespace(max_new_tokens=256)
        self.histories: list[list[int]] = []

    async def turn(self, history: list[int], max_new: int, rid: str, *_: Any) -> Sample:
        self.histories.append(list(history))
        text = self.texts.pop(0)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return Sample(ids, [-0.1] * len(ids), [[0, len(ids)]], "stop", 0)


SERVED = {  # what the model writes as its call, and how often the next prompt split the record
    "hermes": (CASES["hermes"][1], 0),  # as Qwen writes it: the call on a line of its own
    "llama3": ('{"name": "add", "parameters": {"a": 2, "b": 3}}', 0),
    "mistral": (CASES["mistral"][0], 1),  # its template writes the call's id: other tokens
}


@pytest.mark.parametrize("family", sorted(SERVED))
@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_served_agent_calls_a_tool_and_the_model_hears_its_result(family: str, api: str) -> None:
    """The gateway with ``auto``, each API's own client: the call comes back parsed, the
    agent's call and result are rendered into the next turn's prompt, which extends the
    episode's tokens (one record) where the template writes the call as the model did."""
    tokenizer = family_tokenizer(family)
    written, splits = SERVED[family]
    model, desk = _Model(tokenizer, [written, "It is 5."]), _Desk()
    served = ServedPolicy("policy", tokenizer, group_size=1)
    config = GatewayConfig(port=0, tool_call_parser="auto")
    gateway = Gateway(config, desk, model, ProducerMetrics(), served)  # type: ignore[arg-type]

    async def play() -> str:
        base = await gateway.start() + "/episodes/ep1"
        try:
            if api == "openai":
                async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="-") as client:
                    return await _play_openai(client)
            async with anthropic.AsyncAnthropic(base_url=base, api_key="-") as messages:
                return await _play_anthropic(messages)
        finally:
            await gateway.close()

    assert asyncio.run(play()) == "It is 5."
    prompt = tokenizer.decode(model.histories[1], skip_special_tokens=False)
    assert RESULT in prompt and '"a": 2, "b": 3' in prompt[: prompt.index(RESULT)]
    assert desk.the_episode.mismatches == splits


async def _play_openai(client: openai.AsyncOpenAI) -> str:
    messages: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    (call,) = first.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    stream = await client.chat.completions.create(
        model="policy", messages=messages, tools=[ADD], stream=True
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def _play_anthropic(client: anthropic.AsyncAnthropic) -> str:
    tools: Any = [{"name": "add", "input_schema": {"type": "object"}}]
    messages: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
    first = await client.messages.create(
        model="policy", max_tokens=64, messages=messages, tools=tools
    )
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.input == {"a": 2, "b": 3}
    result = {"type": "tool_result", "tool_use_id": use.id, "content": RESULT}
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    async with client.messages.stream(
        model="policy", max_tokens=64, messages=messages, tools=tools
    ) as stream:
        return "".join([text async for text in stream.text_stream])
