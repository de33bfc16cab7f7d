"""The tool-using agent of the gateway's learning test (``support.tool_agent``) and its
model's template (``support.tool_models``): only answering with the tool's result earns
the reward, so a policy that has the format but not the content stays far below the
test's bar; and the model's call is parsed by the gateway's ``auto`` reader and renders
back as the very tokens the model wrote (the episode stays one record)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage
from support.tool_agent import BLIND_REWARD, CONTENT_BAR, DIGITS, play
from support.tool_models import (
    LOOKUP_CALL,
    LOOKUP_CALL_WORDS,
    TOOL_AGENT_TEMPLATE,
    TOOL_AGENT_VOCAB,
    template_ids,
)
from transformers import AutoTokenizer

from producers.gateway.tool_parsers import template_messages, tool_reader
from rollstream.cli.starter import save_chat_model

Policy = Callable[[list[dict[str, Any]], random.Random], ChatCompletionMessage]


def _answer(text: str) -> ChatCompletionMessage:
    return ChatCompletionMessage(role="assistant", content=text)


def _call() -> ChatCompletionMessage:
    call = {**LOOKUP_CALL, "function": {"name": "lookup", "arguments": "{}"}}
    return ChatCompletionMessage(role="assistant", content=None, tool_calls=[call])


class ScriptedClient:
    """``client.chat.completions.create`` answered by ``policy`` (messages -> message)."""

    def __init__(self, policy: Policy, rng: random.Random) -> None:
        self.policy, self.rng = policy, rng
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, *, model: str, messages: list[dict[str, Any]], **_: Any) -> Any:
        message = self.policy(messages, self.rng)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def _never_calls(messages: list[dict[str, Any]], rng: random.Random) -> ChatCompletionMessage:
    return _answer(rng.choice(DIGITS))  # the format, always right


def _calls_then_guesses(messages: list[dict[str, Any]], rng: random.Random) -> Any:
    return _answer(rng.choice(DIGITS)) if messages[-1]["role"] == "tool" else _call()


def _calls_then_repeats_the_question(messages: list[dict[str, Any]], _: random.Random) -> Any:
    return _answer(messages[0]["content"][0]) if messages[-1]["role"] == "tool" else _call()


def _calls_then_reads(messages: list[dict[str, Any]], _: random.Random) -> Any:
    return _answer(messages[-1]["content"]) if messages[-1]["role"] == "tool" else _call()


def _mean_reward(policy: Policy, episodes: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    client = ScriptedClient(policy, random.Random(1))
    played = [play(client, "m", f"{rng.randrange(1000):03d}", rng) for _ in range(episodes)]
    return sum(e.reward for e in played) / episodes, sum(e.called for e in played) / episodes


@pytest.mark.parametrize(
    "policy", [_never_calls, _calls_then_guesses, _calls_then_repeats_the_question]
)
def test_a_policy_that_does_not_answer_with_the_tools_result_fails_the_bar(policy: Policy) -> None:
    reward, _ = _mean_reward(policy)
    assert reward == pytest.approx(BLIND_REWARD, abs=0.03)
    assert reward < CONTENT_BAR / 3


def test_only_answering_with_the_tools_result_earns_the_reward() -> None:
    assert _mean_reward(_calls_then_reads) == (1.0, 1.0)


def test_the_models_call_parses_and_renders_back_as_the_tokens_it_wrote(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(
        save_chat_model(tmp_path, vocab=TOOL_AGENT_VOCAB, template=TOOL_AGENT_TEMPLATE)
    )
    reader = tool_reader("auto", tokenizer)
    assert reader is not None and reader.family.name == "hermes"

    question = [{"role": "user", "content": "341"}]
    written = tokenizer.convert_tokens_to_ids(
        ["<tool_call>", *LOOKUP_CALL_WORDS, "</tool_call>", "<|im_end|>"]
    )
    parsed = reader.read(written, tokenizer.decode)
    assert parsed is not None and parsed.content is None
    (call,) = parsed.tool_calls
    assert call["function"] == {"name": "lookup", "arguments": "{}"}
    sent_back = [  # as the openai client sends them: arguments a JSON string
        *question,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "7"},
    ]
    context = template_ids(tokenizer, question, add_generation_prompt=True) + written
    next_prompt = template_ids(
        tokenizer, template_messages(sent_back, reader.family), add_generation_prompt=True
    )
    assert next_prompt[: len(context)] == context
    assert tokenizer.convert_ids_to_tokens(next_prompt[len(context) :]) == [
        "<|im_start|>", "tool", "7", "<|im_end|>", "<|im_start|>", "assistant",
    ]  # fmt: skip
