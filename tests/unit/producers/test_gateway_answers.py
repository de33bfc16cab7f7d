"""The gateway's answers, read back by the ``openai`` package's own models and stream
accumulator: tool calls parsed out of the text, log-probs token for token, and text that
only looks like a tool call returned whole.

The answers are built from a ``Sample`` as the engine returns it; a character-level decode
(one token id = one character) stands in for the model's tokenizer, so any text can be a
model's answer without a trained model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from producers.gateway.answers import Answer, Envelope, TextStream
from producers.gateway.requests import BadRequest, chat_request
from producers.gateway.tool_parsers import HERMES, ToolReader
from producers.gateway.tool_parsers import parse_hermes as parse_hermes_tool_calls
from producers.rollout.generation import Sample

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return "".join(chr(i) for i in ids)


def sample(text: str) -> Sample:
    ids = [ord(c) for c in text]
    logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
    return Sample(ids, logprobs, [[3, len(ids)]], "stop", 0)


def answer(text: str, chat: bool = True, **options) -> Answer:
    envelope = Envelope(model="policy", chat=chat)
    return Answer(
        sample(text), decode, envelope=envelope, prompt_tokens=5, episode_id="e1", **options
    )


def stream(reply: Answer, usage: bool = False) -> Iterator[dict]:
    """The chunks a client reads: the envelope's opening one (sent before generation),
    then the answer's."""
    opening = reply.envelope.opening()
    if opening is not None:
        yield opening
    yield from reply.chunks(usage)


def test_hermes_blocks_become_tool_calls_and_the_text_before_them_the_content() -> None:
    parsed = parse_hermes_tool_calls(
        "Let me add." + CALL + '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
    )
    assert parsed.content == "Let me add."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["add", "now"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert parsed.tool_calls[1]["function"]["arguments"] == "{}"
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    assert parse_hermes_tool_calls(CALL).content is None


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        "<tool_call>{not json}</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 7}</tool_call>',
        '<tool_call>{"name": "add", "arguments": 5}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}',  # never closed
        CALL + "<tool_call>oops</tool_call>",  # one bad block: all of it is text
    ],
)
def test_text_that_is_not_a_well_formed_call_is_returned_whole(text: str) -> None:
    parsed = parse_hermes_tool_calls(text)
    assert parsed.tool_calls == [] and parsed.content == text
    whole = ChatCompletion.model_validate(answer(text, tools=ToolReader(HERMES, {})).whole())
    assert whole.choices[0].message.content == text and not whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "stop"


def test_a_tool_call_answer_reads_back_in_the_openai_client_whole_and_streamed() -> None:
    reply = answer("Adding." + CALL, tools=ToolReader(HERMES, {}))
    whole = ChatCompletion.model_validate(reply.whole())
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == "Adding."
    assert message.tool_calls[0].function.name == "add"
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}

    state = ChatCompletionStreamState()
    for chunk in stream(reply, usage=True):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Adding."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]


def test_without_tools_or_with_tool_choice_none_the_call_stays_text() -> None:
    whole = ChatCompletion.model_validate(answer(CALL).whole())
    assert whole.choices[0].message.content == CALL and not whole.choices[0].message.tool_calls
    body = {"messages": [{"role": "user", "content": "2+3"}]}
    tools = [{"type": "function", "function": {"name": "add"}}]
    assert not chat_request(body, 8).parse_tools
    assert chat_request({**body, "tools": tools}, 8).parse_tools
    assert not chat_request({**body, "tools": tools, "tool_choice": "none"}, 8).parse_tools


def test_logprobs_are_the_sampled_tokens_whole_streamed_and_in_completions() -> None:
    text = "12 34"
    want = sample(text).logprobs
    whole = ChatCompletion.model_validate(answer(text, logprobs=True).whole())
    content = whole.choices[0].logprobs.content
    assert [t.token for t in content] == list(text) and [t.logprob for t in content] == want

    streamed, pieces = [], []
    for chunk in stream(answer(text, logprobs=True)):
        parsed = ChatCompletionChunk.model_validate(chunk)
        if parsed.choices and parsed.choices[0].logprobs:
            streamed += [t.logprob for t in parsed.choices[0].logprobs.content]
        if parsed.choices and parsed.choices[0].delta.content:
            pieces.append(parsed.choices[0].delta.content)
    assert streamed == want and "".join(pieces) == text

    completion = Completion.model_validate(answer(text, chat=False, logprobs=True).whole())
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == list(text) and logprobs.token_logprobs == want
    assert logprobs.text_offset == list(range(len(text)))
    offsets = []
    for chunk in stream(answer(text, chat=False, logprobs=True)):
        if chunk["choices"] and chunk["choices"][0]["logprobs"]:
            offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    assert offsets == list(range(len(text)))  # from the answer's start, not each chunk's
    assert ChatCompletion.model_validate(answer(text).whole()).choices[0].logprobs is None


def utf8(ids: list[int], skip_special_tokens: bool = True) -> str:
    """A byte-level decode (one token id = one byte): a character may span tokens."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("steps", [[1] * 40, [3, 1, 5, 2, 40], [40]], ids=["1", "uneven", "all"])
def test_text_fed_as_its_tokens_come_is_the_whole_answers_text(steps: list[int]) -> None:
    """However the tokens come (one at a time, several at once, all at the end), the pieces
    a stream sends join into the whole answer's text, the log-probs are each token's once,
    and a character split over tokens is never sent half (no U+FFFD)."""
    text = "héllo 🙂 wörld, ça va?"
    ids = list(text.encode())
    logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
    turn = Sample(ids, logprobs, [[3, len(ids)]], "stop", 0)
    envelope = Envelope(model="policy", chat=True)
    reply = Answer(turn, utf8, envelope=envelope, prompt_tokens=5, episode_id="e", logprobs=True)
    fed = TextStream(utf8, logprobs=True, envelope=envelope)
    chunks, held = [envelope.opening()], 0
    for step in steps:  # what the engine has drawn so far, each time more arrived
        held = min(len(ids), held + step)
        chunks += fed.chunks(ids[:held], logprobs[:held])
    chunks += list(reply.chunks(usage=True, streamed=fed))
    state, told = ChatCompletionStreamState(), []
    for chunk in chunks:
        parsed = ChatCompletionChunk.model_validate(chunk)
        state.handle_chunk(parsed)
        if parsed.choices:
            assert "\ufffd" not in (parsed.choices[0].delta.content or "")
            if parsed.choices[0].logprobs:
                told += [t.logprob for t in parsed.choices[0].logprobs.content]
    final = state.get_final_completion().choices[0]
    assert final.message.content == text == reply.whole()["choices"][0]["message"]["content"]
    assert told == logprobs and final.finish_reason == "stop"


def test_stream_options_garbage_is_refused() -> None:
    body = {"messages": [{"role": "user", "content": "2+3"}], "stream": True}
    assert chat_request({**body, "stream_options": {"include_usage": True}}, 8).include_usage
    for options, message in (
        ("yes", "'stream_options' must be an object"),
        ({"include_usage": "yes"}, "'stream_options.include_usage' must be a boolean"),
        ({"include_usage": 1}, "'stream_options.include_usage' must be a boolean"),
    ):
        with pytest.raises(BadRequest, match=message):
            chat_request({**body, "stream_options": options}, 8)
    with pytest.raises(BadRequest, match="'stream' must be a boolean"):
        chat_request({**body, "stream": "true"}, 8)
