"""The OpenAI-compatible gateway against the real broker and an in-process engine, driven by
the real ``openai`` client: multi-turn episodes recorded token for token, rewards, history
edits split or refused, abandoned episodes in the ledger, closed episodes a stop cut short
published or dead-lettered (and counted by the audit), and garbage of every kind.

The model is the tiny chat model (``rollstream.cli.starter.save_chat_model``); the agent's
"tool" is the test's own: it answers the model's turn with a user message the chat
template renders.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from support.paths import REPO
from support.producer_runs import make_topic, read_topic, recompute, rs_config
from support.step_gate import StepGate
from support.streams import create_stream_topics, wait_until

from core.models import BOS_ID, SEP_ID
from core.process import free_port
from producers.app import run_producer
from producers.config import EngineConfig, GatewayConfig, ProducersConfig, RolloutConfig
from producers.rollout.ledger import ledger_dir, read_ledger
from rollstream.cli.starter import CHAT_VOCAB as VOCAB
from rollstream.cli.starter import save_chat_model
from rollstream.runs.audit import audit
from rollstream.runs.reads import AuditSources
from schemas.codec import decode
from schemas.control import DeadLetter
from schemas.trajectory import Trajectory, TurnKind

torch.set_num_threads(1)

pytestmark = pytest.mark.integration

SYSTEM = "copy the first digit twice"
KEY = "gateway-test-key"
INFLIGHT = "rollstream_producer_inflight_groups"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("gateway-model") / "model", seed=3)


@dataclass
class GatewayRun:
    """A producer serving the gateway from a thread; ``url`` is its base."""

    url: str
    topic: str
    run_id: str
    ledger: Path
    worker: dict[str, Any] = field(default_factory=dict)
    report: Any = None

    def client(self, episode_id: str, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/episodes/{episode_id}/v1", api_key=KEY, max_retries=0, **options
        )

    def post(self, path: str, body: Any = None, **options: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **options.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **options)

    def open(self) -> dict[str, Any]:
        answer = self.post("/v1/episodes")
        assert answer.status_code == 201, answer.text
        return answer.json()

    def close(self, episode_id: str, reward: Any) -> httpx.Response:
        return self.post(f"/v1/episodes/{episode_id}/close", {"reward": reward})

    def records(self, kafka_config: Any) -> list[Trajectory]:
        records = [decode(m.value()) for m in read_topic(kafka_config, self.topic)]
        return [r for r in records if r.run_id == self.run_id]


@contextlib.contextmanager
def gateway_run(
    kafka_config: Any,
    unique_name: Any,
    tmp_path: Path,
    model: Path | str,
    *,
    groups: int,
    group_size: int = 2,
    inflight: int = 1,
    task: dict[str, Any] | None = None,
    **gateway: Any,
) -> Iterator[GatewayRun]:
    """A gateway producer that delivers ``groups`` groups, ``inflight`` at a time (or is
    stopped on exit); its
    task is the chat dataset unless ``task`` gives ``task`` and ``task_options``. Its
    calls may name the model ``policy``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    topic = make_topic(kafka_config, unique_name, partitions=1)
    config = rs_config(kafka_config, tmp_path)
    port = free_port()
    task = task or {
        "task": "file",
        "task_options": {
            "path": str(_dataset(tmp_path)),
            "system_prompt": SYSTEM,
            "max_new_tokens": 2,
        },
    }
    rollout = RolloutConfig(
        topic=topic,
        **task,
        group_size=group_size,
        groups=groups,
        max_inflight_groups=inflight,
        seed=1,
        progress=False,
        producer_id="gateway-a",
        ledger_fsync=False,
        follow_weights=False,
        gateway=GatewayConfig(
            enabled=True,
            port=port,
            api_key=KEY,
            **{"claim_wait_s": 5.0, "served_model_names": ["policy"], **gateway},
        ),
    )
    settings = ProducersConfig(engine=EngineConfig(model=str(model), seed=7), rollout=rollout)
    run = GatewayRun(
        f"http://127.0.0.1:{port}",
        topic,
        config.run_id,
        ledger_dir(config.state_dir, config.run_id, "gateway-a") / "ledger.jsonl",
    )

    def serve() -> None:
        run.report = asyncio.run(
            run_producer(
                config, settings, install_signals=False, on_worker=lambda w: run.worker.update(w=w)
            )
        )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(run.url + "/health", timeout=1).status_code == 200:
                break
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.2)
    try:
        yield run
        thread.join(120)
        assert not thread.is_alive(), "the gateway did not finish its groups"
    finally:
        if thread.is_alive() and "w" in run.worker:
            run.worker["w"].request_stop_threadsafe()
            thread.join(60)


def _dataset(tmp_path: Path) -> Path:
    rng = random.Random(5)
    rows = []
    for _ in range(20):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        row = {"messages": [{"role": "user", "content": digits}], "answer": digits[0] * 2}
        rows.append(json.dumps(row))
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _messages(opened: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        *opened["prompt"]["metadata"]["example"]["messages"],
    ]


def _play(
    run: GatewayRun,
    opened: dict[str, Any],
    *,
    stream: bool,
    logprobs: list[float] | None = None,
) -> list[str]:
    """A two-call agent: answer, hear from the tool, answer again. Returns the answers;
    with ``logprobs`` it asks for them and appends every answer's."""
    client = run.client(opened["episode_id"])
    messages = _messages(opened)
    answers = []
    asks = {"logprobs": True} if logprobs is not None else {}
    for turn in range(2):
        if stream:
            pieces = list(
                client.chat.completions.create(
                    model="policy", messages=messages, stream=True, max_tokens=2, **asks
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
            for chunk in pieces:
                if logprobs is not None and chunk.choices and chunk.choices[0].logprobs:
                    logprobs += [t.logprob for t in chunk.choices[0].logprobs.content]
        else:
            answer = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=2, **asks
            )
            text = answer.choices[0].message.content
            assert answer.usage.completion_tokens >= 1
            if logprobs is not None:
                logprobs += [t.logprob for t in answer.choices[0].logprobs.content]
        answers.append(text)
        messages = [*messages, {"role": "assistant", "content": text}]
        if turn == 0:  # the test's tool: a fixed reply the template renders as user tokens
            messages.append({"role": "user", "content": "copy the first digit twice"})
    return answers


def _check_policy_logprobs(traj: Trajectory, model: Any) -> None:
    expected = recompute(model, traj.prompt_ids, traj.response_ids)
    mask = traj.loss_mask
    got = [lp for lp, m in zip(traj.logp_infer, mask, strict=True) if m]
    want = [lp for lp, m in zip(expected, mask, strict=True) if m]
    assert got == pytest.approx(want, abs=1e-4)


def test_openai_agents_play_a_group_recorded_token_for_token(
    kafka_config, unique_name, tmp_path, chat_model
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    with gateway_run(kafka_config, unique_name, tmp_path, chat_model, groups=1) as run:
        first, second = run.open(), run.open()
        assert first["group_id"] == second["group_id"] and {first["index"], second["index"]} == {
            0,
            1,
        }
        logprobs: dict[str, list[float]] = {first["episode_id"]: [], second["episode_id"]: []}
        answers = {
            opened["episode_id"]: _play(
                run, opened, stream=stream, logprobs=logprobs[opened["episode_id"]]
            )
            for opened, stream in ((first, False), (second, True))
        }
        assert run.close(first["episode_id"], 1.0).json()["records"] == 1
        assert run.close(second["episode_id"], {"answer": 0.5, "format": 0.25}).status_code == 200
    records = {t.reward_details["gateway"]["episode_id"]: t for t in run.records(kafka_config)}
    assert set(records) == set(answers)
    model = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    for episode_id, traj in records.items():
        assert traj.group_size == 2 and traj.group_id == first["group_id"]
        assert list(traj.turn_kinds) == [TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY]
        # the record's prompt is the first call's rendering; its env turn is exactly the
        # tokens the second call's rendering added after the first answer
        opened = first if episode_id == first["episode_id"] else second
        messages = _messages(opened)
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert list(traj.prompt_ids) == list(rendered.get("input_ids", rendered))
        turns = _split_turns(traj)
        assert [
            tokenizer.decode(turns[0], skip_special_tokens=True),
            tokenizer.decode(turns[2], skip_special_tokens=True),
        ] == answers[episode_id]
        assert [VOCAB[t] for t in turns[1]][-2:] == ["<|im_start|>", "assistant"]
        assert all(
            lp == 0.0 for lp in traj.logp_infer[len(turns[0]) : len(turns[0]) + len(turns[1])]
        )
        _check_policy_logprobs(traj, model)
        # the answers' log-probs are the record's, token for token
        policy = [lp for lp, m in zip(traj.logp_infer, traj.loss_mask, strict=True) if m]
        assert logprobs[episode_id] == pytest.approx(policy, abs=1e-6)
    assert records[first["episode_id"]].reward == 1.0
    assert records[second["episode_id"]].reward == 0.75
    assert records[second["episode_id"]].reward_details["rewards"] == {
        "answer": 0.5,
        "format": 0.25,
    }
    state = read_ledger(run.ledger)
    assert list(state.delivered) == [first["group_id"]] and state.abandoned == {}


def _play_anthropic(
    run: GatewayRun, opened: dict[str, Any], *, stream: bool, served: str
) -> list[str]:
    """The two-call agent of ``_play``, written against the ``anthropic`` client;
    ``served``: the model name the gateway answers with."""
    client = anthropic.Anthropic(
        base_url=run.url + f"/episodes/{opened['episode_id']}", api_key=KEY, max_retries=0
    )
    messages: list[dict[str, Any]] = [
        {"role": m["role"], "content": m["content"]} for m in _messages(opened)[1:]
    ]
    answers = []
    for turn in range(2):
        asks = {"model": "policy", "max_tokens": 2, "system": SYSTEM, "messages": messages}
        if stream:
            with client.messages.stream(**asks) as events:
                text = "".join(events.text_stream)
                message = events.get_final_message()
            assert message.content[0].text == text
        else:
            message = client.messages.create(**asks)
            text = message.content[0].text
        assert message.type == "message" and message.role == "assistant"
        assert (message.id.startswith("msg_") and message.model == "policy") or "tiny"
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert 1 <= message.usage.output_tokens <= 2 and message.usage.input_tokens > 5
        answers.append(text)
        said = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
        messages = [*messages, {"role": "assistant", "content": [said]}]  # cache_control ignored
        if turn == 0:  # the tool's answer, as the user's next message
            messages.append({"role": "user", "content": messages[0]["content"]})
    return answers


def test_anthropic_agents_play_a_group_recorded_as_openai_agents_are(
    kafka_config, unique_name, tmp_path, chat_model
):
    """The Messages API beside the OpenAI one: the real ``anthropic`` client, whole and
    streamed, through the episode path with its ``x-api-key``; the records hold what the
    agent was told, token for token, as for an OpenAI agent; what the API has and the
    gateway does not serve, and garbage, are refused in that API's error shape (every
    refusal: tests/unit/producers/test_gateway_anthropic.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    with gateway_run(kafka_config, unique_name, tmp_path, chat_model, groups=1) as run:
        first, second = run.open(), run.open()
        served = run.client(first["episode_id"]).models.list().data[0].id
        answers = {
            opened["episode_id"]: _play_anthropic(run, opened, stream=stream, served=served)
            for opened, stream in ((first, False), (second, True))
        }
        refused = anthropic.Anthropic(
            base_url=run.url + f"/episodes/{first['episode_id']}", api_key=KEY, max_retries=0
        )
        user = [{"role": "user", "content": "123"}]
        for asks, why in (
            (
                {
                    "tools": [{"name": "calc", "input_schema": {"type": "object"}}],
                    "tool_choice": {"type": "any"},
                },
                "a forced call",
            ),
            ({"max_tokens": 999}, "per-call limit"),
            ({"messages": [{"role": "robot", "content": "1"}]}, "'user' or 'assistant'"),
            ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "'image'"),
            ({"messages": [*user, {"role": "assistant", "content": "1"}]}, "last message"),
            (
                {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
                "'document' blocks are not served",
            ),
            ({"system": [{"type": "text", "text": 5}]}, "a text block needs a string 'text'"),
            (
                {"tools": [{"name": "c" * 300, "input_schema": {"type": "object"}}]},
                r"'tools\[0\]' needs a string 'name'",
            ),
        ):
            call = {"model": "policy", "max_tokens": 2, "messages": user, **asks}
            with pytest.raises(anthropic.BadRequestError, match=why) as error:
                refused.messages.create(**call)
            assert error.value.body["type"] == "error"
        with pytest.raises(anthropic.NotFoundError, match="served_model_names"):
            refused.messages.create(model="claude-x", max_tokens=2, messages=user)
        wrong_key = anthropic.Anthropic(base_url=run.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            wrong_key.messages.create(model="policy", max_tokens=2, messages=user)
        assert run.close(first["episode_id"], 1.0).status_code == 200
        assert run.close(second["episode_id"], 0.5).status_code == 200
    records = {t.reward_details["gateway"]["episode_id"]: t for t in run.records(kafka_config)}
    assert set(records) == set(answers)
    for episode_id, traj in records.items():
        opened = first if episode_id == first["episode_id"] else second
        rendered = tokenizer.apply_chat_template(_messages(opened), add_generation_prompt=True)
        assert list(traj.prompt_ids) == list(rendered.get("input_ids", rendered))
        assert list(traj.turn_kinds) == [TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY]
        turns = _split_turns(traj)
        told = [tokenizer.decode(turns[i], skip_special_tokens=True) for i in (0, 2)]
        assert told == answers[episode_id]
    assert {t.reward for t in records.values()} == {1.0, 0.5}


STREAM_TOKENS = 6


@dataclass
class Heard:
    """What a streaming agent saw: each call's text and streamed log-probs; and for each
    streamed call, how many tokens the engine had drawn when it was held (once it had
    text) until the agent read its first text, None if it never was (the text came with
    the last token)."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # each call's completion tokens
    held_at: list[int | None] = field(default_factory=list)


@contextlib.contextmanager
def _first_text_gate(run: GatewayRun, heard: Heard) -> Iterator[Any]:
    """Hold the engine once the call has text, until the agent reads its first text (the
    callable given)."""
    gate = StepGate(run.worker["w"].backend.engine)
    try:
        yield gate.open
    finally:
        gate.remove()
    assert not gate.timed_out, "the engine was held, and the agent read no text meanwhile"
    heard.held_at.append(gate.held_at)


def _openai_agent(run: GatewayRun, opened: dict[str, Any], *, stream: bool) -> Heard:
    """Two calls with log-probs, whole or streamed (the engine held at each streamed call's
    first text)."""
    client = run.client(opened["episode_id"])
    messages: list[Any] = _messages(opened)
    heard = Heard()
    for _ in range(2):
        asks = {"model": "policy", "messages": messages, "max_tokens": STREAM_TOKENS}
        if stream:
            pieces = []
            with _first_text_gate(run, heard) as first_text:
                for chunk in client.chat.completions.create(
                    **asks, stream=True, logprobs=True, stream_options={"include_usage": True}
                ):
                    if chunk.usage is not None:
                        heard.tokens.append(chunk.usage.completion_tokens)
                    delta = chunk.choices[0].delta.content if chunk.choices else None
                    if delta:
                        first_text()
                    pieces.append(delta or "")
                    if chunk.choices and chunk.choices[0].logprobs:
                        heard.logprobs += [t.logprob for t in chunk.choices[0].logprobs.content]
            text = "".join(pieces)
        else:
            answer = client.chat.completions.create(**asks, logprobs=True)
            text = answer.choices[0].message.content or ""
            heard.logprobs += [t.logprob for t in answer.choices[0].logprobs.content]
        heard.texts.append(text)
        messages = [*messages, {"role": "assistant", "content": text}]
        messages.append({"role": "user", "content": "copy the first digit twice"})
    return heard


def _anthropic_agent(run: GatewayRun, opened: dict[str, Any], *, stream: bool) -> Heard:
    client = anthropic.Anthropic(
        base_url=run.url + f"/episodes/{opened['episode_id']}", api_key=KEY, max_retries=0
    )
    messages: list[Any] = [{"role": "user", "content": _messages(opened)[1]["content"]}]
    heard = Heard()
    for _ in range(2):
        asks = {"model": "policy", "max_tokens": STREAM_TOKENS, "system": SYSTEM}
        if stream:
            pieces = []
            with (
                _first_text_gate(run, heard) as first_text,
                client.messages.stream(**asks, messages=messages) as events,
            ):
                for piece in events.text_stream:
                    if piece:
                        first_text()
                    pieces.append(piece)
                final = events.get_final_message()
            heard.tokens.append(final.usage.output_tokens)
            text = "".join(pieces)
            assert final.content[0].text == text
        else:
            text = client.messages.create(**asks, messages=messages).content[0].text
        heard.texts.append(text)
        messages = [*messages, {"role": "assistant", "content": text}]
        messages.append({"role": "user", "content": "copy the first digit twice"})
    return heard


def test_streamed_calls_send_text_as_it_is_drawn_and_record_what_whole_calls_do(
    kafka_config, unique_name, tmp_path, chat_model
):
    """The same group played twice with the same seeds, once whole and once streamed, by an
    ``openai`` agent and an ``anthropic`` one: each streamed call's first text reaches the
    agent while the engine is held before the call's second token; the streamed text is
    the whole answer's, and the records are the same, token for token."""
    played: dict[bool, tuple[Heard, Heard, list[Trajectory]]] = {}
    for stream in (False, True):
        (tmp_path / str(stream)).mkdir()
        task = {
            "task": "file",
            "task_options": {
                "path": str(_dataset(tmp_path / str(stream))),
                "system_prompt": SYSTEM,
                "max_new_tokens": STREAM_TOKENS,
            },
        }
        with gateway_run(
            kafka_config, unique_name, tmp_path / str(stream), chat_model, groups=1, task=task
        ) as run:
            first, second = sorted((run.open(), run.open()), key=lambda o: o["index"])
            chat = _openai_agent(run, first, stream=stream)
            messages = _anthropic_agent(run, second, stream=stream)
            assert run.close(first["episode_id"], 1.0).status_code == 200
            assert run.close(second["episode_id"], 0.5).status_code == 200
        records = sorted(
            run.records(kafka_config),
            key=lambda r: (r.reward_details["gateway"]["episode_id"] != first["episode_id"],
                           r.reward_details["gateway"].get("part", [1])[0]),
        )  # fmt: skip
        played[stream] = (chat, messages, records)
    (chat, messages, whole_records), (s_chat, s_messages, streamed_records) = (
        played[False],
        played[True],
    )
    assert s_chat.texts == chat.texts and s_messages.texts == messages.texts
    assert s_chat.logprobs == chat.logprobs
    # each streamed call's first text reached its agent while the engine was held with fewer
    # tokens drawn than the call's answer has: it was sent before the answer was whole
    for heard in (s_chat, s_messages):
        held = [(at, n) for at, n in zip(heard.held_at, heard.tokens, strict=True) if at]
        assert held and all(at < n for at, n in held), (heard.held_at, heard.tokens)
    assert len(streamed_records) == len(whole_records) >= 2
    for streamed, whole in zip(streamed_records, whole_records, strict=True):
        for name in ("prompt_ids", "response_ids", "logp_infer", "loss_mask", "turn_kinds"):
            got, want = (getattr(r, name) for r in (streamed, whole))
            assert (None if got is None else list(got)) == (None if want is None else list(want))
        assert (streamed.reward, streamed.group_size) == (whole.reward, whole.group_size)


def _example() -> Any:
    """``examples/gateway_agent.py`` as a module."""
    path = REPO / "examples" / "gateway_agent.py"
    spec = importlib.util.spec_from_file_location("gateway_agent", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_agent_plays_the_default_task_on_the_tiny_model(
    kafka_config, unique_name, tmp_path
):
    """What a new user runs first: no model download, the default task, the example as
    written; a call naming a model the gateway does not serve is 404, as OpenAI's is."""
    default = {"task": "copy-first-digit-twice", "task_options": {}}
    agent = _example()
    with gateway_run(kafka_config, unique_name, tmp_path, "tiny", groups=1, task=default) as run:
        client = openai.OpenAI(base_url=run.url + "/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny", "policy"]
        messages = [{"role": "user", "content": "123"}]
        for call in (
            lambda: client.chat.completions.create(model="gpt-4o", messages=messages),
            lambda: client.completions.create(model="gpt-4o", prompt="123"),
        ):
            with pytest.raises(openai.NotFoundError, match="served_model_names") as refused:
                call()
            assert refused.value.code == "model_not_found"
        with httpx.Client(timeout=60) as http:
            rewards = [agent.play_episode(http, run.url, KEY, SYSTEM, 30.0) for _ in range(2)]
    records = run.records(kafka_config)  # an answer with a special token splits its episode
    assert len({r.reward_details["gateway"]["episode_id"] for r in records}) == 2
    assert {r.reward for r in records} == set(rewards)
    firsts = [r for r in records if r.reward_details["gateway"].get("part", [1])[0] == 1]
    assert len(firsts) == 2
    for record in firsts:  # the chat prompt is the task's own: BOS d1 d2 d3 SEP
        ids = list(record.prompt_ids)
        assert len(ids) == 5 and (ids[0], ids[-1]) == (BOS_ID, SEP_ID), ids


def _split_turns(traj: Trajectory) -> list[list[int]]:
    turns, start = [], 0
    for length in traj.turn_lengths:
        turns.append([int(t) for t in traj.response_ids[start : start + length]])
        start += length
    return turns


def test_garbage_is_refused_with_a_reason_and_the_group_still_lands(
    kafka_config, unique_name, tmp_path, chat_model
):
    with gateway_run(kafka_config, unique_name, tmp_path, chat_model, groups=1) as run:
        opened = run.open()
        episode = opened["episode_id"]
        chat = f"/episodes/{episode}/v1/chat/completions"
        good = {"model": "policy", "messages": _messages(opened)}
        messages = f"/episodes/{episode}/v1/messages"
        anthropic_good = {"model": "policy", "max_tokens": 2, "messages": _messages(opened)[1:]}
        refusals = {
            "no key": (httpx.post(run.url + chat, json=good, timeout=30), 401),
            "wrong key": (run.post(chat, good, headers={"Authorization": "Bearer nope"}), 401),
            "unknown episode": (run.post("/episodes/nope/v1/chat/completions", good), 404),
            "no episode": (run.post("/v1/chat/completions", good), 400),
            "not json": (
                run.post(chat, content=b"{not json", headers={"Content-Type": "application/json"}),
                400,
            ),
            "a list body": (run.post(chat, [1, 2]), 400),
            "no messages": (run.post(chat, {"model": "policy"}), 400),
            "empty messages": (run.post(chat, {**good, "messages": []}), 400),
            "a bad role": (
                run.post(chat, {**good, "messages": [{"role": "wizard", "content": "1"}]}),
                400,
            ),
            "content a number": (
                run.post(chat, {**good, "messages": [{"role": "user", "content": 7}]}),
                400,
            ),
            "an image part": (
                run.post(
                    chat,
                    {**good, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                ),
                400,
            ),
            "a huge max_tokens": (run.post(chat, {**good, "max_tokens": 10**9}), 400),
            "max_tokens text": (run.post(chat, {**good, "max_tokens": "2"}), 400),
            "n = 2": (run.post(chat, {**good, "n": 2}), 400),
            "stop a number": (run.post(chat, {**good, "stop": 3}), 400),
            "logprobs text": (run.post(chat, {**good, "logprobs": "yes"}), 400),
            "top_logprobs": (run.post(chat, {**good, "logprobs": True, "top_logprobs": 3}), 400),
            "completion logprobs 2": (
                run.post(f"/episodes/{episode}/v1/completions", {"prompt": "1", "logprobs": 2}),
                400,
            ),
            "tool_calls on a user": (
                run.post(
                    chat,
                    {**good, "messages": [{"role": "user", "content": "1", "tool_calls": [{}]}]},
                ),
                400,
            ),
            "prompt ids outside the vocabulary": (
                run.post(f"/episodes/{episode}/v1/completions", {"prompt": [1, 10**6]}),
                400,
            ),
            "an empty prompt": (
                run.post(f"/episodes/{episode}/v1/completions", {"prompt": ""}),
                400,
            ),
            "reward for a slot never opened": (
                run.post("/v1/episodes/0123abcd/close", {"reward": 1}),
                404,
            ),
            "reward before any call": (
                run.post(f"/v1/episodes/{episode}/close", {"reward": "high"}),
                400,
            ),
            "reward NaN": (
                run.post(
                    f"/v1/episodes/{episode}/close",
                    content=b'{"reward": NaN}',
                    headers={"Content-Type": "application/json"},
                ),
                400,
            ),
            "reward a bool": (run.post(f"/v1/episodes/{episode}/close", {"reward": True}), 400),
            "an empty Idempotency-Key": (
                run.post(chat, good, headers={"Idempotency-Key": ""}),
                400,
            ),
            "a 300-character Idempotency-Key": (
                run.post(chat, good, headers={"Idempotency-Key": "k" * 300}),
                400,
            ),
            "a retry count in words": (
                run.post(chat, good, headers={"x-stainless-retry-count": "two"}),
                400,
            ),
            "reward components not numbers": (
                run.post(f"/v1/episodes/{episode}/close", {"reward": {"a": "x"}}),
                400,
            ),
            "an unknown field": (
                run.post(f"/v1/episodes/{episode}/close", {"reward": 1, "bonus": 2}),
                400,
            ),
            "a messages body a list": (run.post(messages, [good]), 400),
            "a content block a bool": (
                run.post(
                    messages, {**anthropic_good, "messages": [{"role": "user", "content": [True]}]}
                ),
                400,
            ),
            "a tool_use id a number": (
                run.post(
                    messages,
                    {
                        **anthropic_good,
                        "messages": [
                            {"role": "user", "content": "1"},
                            {
                                "role": "assistant",
                                "content": [{"type": "tool_use", "id": 1, "name": "f"}],
                            },
                            {"role": "user", "content": "2"},
                        ],
                    },
                ),
                400,
            ),
            "a tool_result past the blocks limit": (
                run.post(
                    messages,
                    {
                        **anthropic_good,
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {
                                        "type": "tool_result",
                                        "tool_use_id": "t",
                                        "content": [{"type": "text", "text": "1"}] * 5000,
                                    }
                                ],
                            }
                        ],
                    },
                ),
                400,
            ),
        }
        for name, (answer, status) in refusals.items():
            assert answer.status_code == status, (name, answer.status_code, answer.text)
            assert answer.json()["error"]["message"], name
        # the refusals name what to do: the gateway's own key, the limit and its setting
        no_key = refusals["no key"][0].json()["error"]["message"]
        assert "Bearer <[producers.rollout.gateway] api_key>" in no_key
        huge = refusals["a huge max_tokens"][0].json()["error"]["message"]
        assert "per-call limit 2: [producers.rollout.gateway] max_call_tokens raises it" in huge
        # none of it touched the episode: it plays and closes as if nothing happened
        _play(run, opened, stream=False)
        assert run.close(episode, 1.0).status_code == 200
        again = run.close(episode, 1.0)
        assert again.status_code == 409 and "closed" in again.json()["error"]["message"]
        other = run.open()
        _play(run, other, stream=False)
        assert run.close(other["episode_id"], 0.0).status_code == 200
    assert len(run.records(kafka_config)) == 2


def test_an_edited_history_splits_the_episode_or_is_refused(
    kafka_config, unique_name, tmp_path, chat_model
):
    with gateway_run(
        kafka_config, unique_name, tmp_path, chat_model, groups=1, group_size=1
    ) as run:
        opened = run.open()
        client = run.client(opened["episode_id"])
        messages = _messages(opened)
        first = client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
        edited = [
            *messages,
            {"role": "assistant", "content": "9" + first.choices[0].message.content},
        ]
        client.chat.completions.create(
            model="policy", messages=[*edited, {"role": "user", "content": "copy"}], max_tokens=2
        )
        assert run.close(opened["episode_id"], 0.5).status_code == 200
    records = sorted(run.records(kafka_config), key=lambda t: t.sample_index)
    assert [t.reward_details["gateway"]["part"] for t in records] == [[1, 2], [2, 2]]
    assert all(t.group_size == 2 and t.reward == 0.5 for t in records)
    assert all(t.turn_kinds is None for t in records)  # one policy turn each
    assert list(records[1].prompt_ids[: len(records[0].prompt_ids)]) == list(records[0].prompt_ids)

    with gateway_run(
        kafka_config, unique_name, tmp_path / "refuse", chat_model, groups=1, group_size=1,
        history_mismatch="refuse",
    ) as run:  # fmt: skip
        opened = run.open()
        client = run.client(opened["episode_id"])
        messages = _messages(opened)
        client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
        with pytest.raises(openai.ConflictError, match="do not extend"):
            client.chat.completions.create(
                model="policy",
                messages=[*messages, {"role": "assistant", "content": "99999"}],
                max_tokens=2,
            )
        assert run.close(opened["episode_id"], 0.5).status_code == 200
    (record,) = run.records(kafka_config)
    assert record.turn_kinds is None and "part" not in record.reward_details["gateway"]


def test_abandoned_episodes_are_never_published_and_the_ledger_says_why(
    kafka_config, unique_name, tmp_path, chat_model
):
    # the idle timeout runs for every open episode, ``kept`` and ``idle`` too, from their
    # opening until their calls below: long enough for the script before them on two loaded
    # cores (at 3 s, ``kept`` once went idle before its turn)
    with gateway_run(
        kafka_config, unique_name, tmp_path, chat_model, groups=1, group_size=4,
        idle_timeout_s=10.0, claim_wait_s=0.5,
    ) as run:  # fmt: skip
        # the opens below wait only claim_wait_s (0.5 s) for slots, and ``/health`` answers
        # before the worker starts its group, which loaded cores can take seconds to do
        wait_until(
            lambda: (
                "w" in run.worker
                and bool(run.worker["w"].metrics.registry.get_sample_value(INFLIGHT))
            ),
            60,
            "the producer's first group",
        )
        kept, left, dropped, idle = run.open(), run.open(), run.open(), run.open()
        late = run.post("/v1/episodes")  # the group is all claimed; no other may start
        assert late.status_code == 429 and late.headers["Retry-After"] == "1"
        # a client that gives up before its answer: the engine is slowed so it does
        run.worker["w"].backend.engine.step_delay_s = 1.0
        with pytest.raises(openai.APITimeoutError):
            run.client(left["episode_id"], timeout=0.3).chat.completions.create(
                model="policy", messages=_messages(left), max_tokens=2
            )
        # a streaming client that reads the stream's opening chunk, then leaves mid-stream
        stream = run.client(dropped["episode_id"]).chat.completions.create(
            model="policy", messages=_messages(dropped), max_tokens=2, stream=True
        )
        assert next(iter(stream)).choices[0].delta.role == "assistant"
        stream.close()
        sample = run.worker["w"].metrics.registry.get_sample_value
        name, labels = "rollstream_producer_gateway_abandoned_total", {"reason": "client_left"}
        engine = run.worker["w"].backend.engine
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # both answers are generated, find their clients gone
            # the stream's episode ends then; the other's turn waits for a retry that
            # never comes: the next call (not a retry) ends it
            if sample(name, labels) == 1 and not engine._pending:
                break
            time.sleep(0.1)
        engine.step_delay_s = 0.0
        for gone in (left, dropped):
            with pytest.raises(openai.ConflictError, match="client left"):
                run.client(gone["episode_id"]).chat.completions.create(
                    model="policy", messages=_messages(gone), max_tokens=2
                )
        run.client(idle["episode_id"]).chat.completions.create(
            model="policy", messages=_messages(idle), max_tokens=2
        )  # then nothing more: it goes idle
        _play(run, kept, stream=False)
        assert run.close(kept["episode_id"], 1.0).status_code == 200
    records = run.records(kafka_config)  # the kept episode (in parts if the history split)
    assert {r.reward_details["gateway"]["episode_id"] for r in records} == {kept["episode_id"]}
    assert {r.group_size for r in records} == {len(records)}
    (reasons,) = read_ledger(run.ledger).abandoned.values()
    assert reasons == {
        left["episode_id"]: "the client left before its answer",
        dropped["episode_id"]: "the client left during the stream",
        idle["episode_id"]: "no call or reward for 10s",
    }
    assert run.report.groups_delivered == 1


def test_a_retried_call_is_answered_with_its_first_turn_never_a_second(
    kafka_config, unique_name, tmp_path, chat_model
):
    with gateway_run(
        kafka_config, unique_name, tmp_path, chat_model, groups=1, group_size=2,
        idle_timeout_s=30.0,
    ) as run:  # fmt: skip
        first, second = run.open(), run.open()
        # the openai client's own retries (max_retries, x-stainless-retry-count): its first
        # try gives up while the slowed engine generates; a retry waits for that turn or
        # fetches it once generated, and is answered with it
        engine = run.worker["w"].backend.engine
        engine.step_delay_s = 0.4
        impatient = openai.OpenAI(
            base_url=f"{run.url}/episodes/{first['episode_id']}/v1",
            api_key=KEY,
            timeout=0.3,
            max_retries=8,
        )
        messages = _messages(first)
        answer = impatient.chat.completions.create(model="policy", messages=messages, max_tokens=2)
        engine.step_delay_s = 0.0
        outcomes = {
            outcome: run.worker["w"].metrics.registry.get_sample_value(
                "rollstream_producer_gateway_retries_total", {"outcome": outcome}
            )
            or 0.0
            for outcome in ("answered_again", "delivered_late", "failure")
        }
        assert outcomes["failure"] == 0 and sum(outcomes.values()) >= 1, outcomes
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "copy the first digit twice"},
        ]
        run.client(first["episode_id"]).chat.completions.create(
            model="policy", messages=messages, max_tokens=2
        )
        assert run.close(first["episode_id"], 1.0).status_code == 200
        # a call named by an Idempotency-Key and sent twice: the first answer, twice
        call = f"/episodes/{second['episode_id']}/v1/chat/completions"
        body = {"model": "policy", "messages": _messages(second), "max_tokens": 2}
        once, twice = (run.post(call, body, headers={"Idempotency-Key": "call-1"}) for _ in "ab")
        assert once.status_code == twice.status_code == 200 and once.json() == twice.json()
        assert run.close(second["episode_id"], 0.5).status_code == 200
    gateway = {
        r.reward_details["gateway"]["episode_id"]: r.reward_details["gateway"]
        for r in run.records(kafka_config)
    }
    # one turn per call the agent made, however often its client sent them
    assert gateway == {
        first["episode_id"]: {"episode_id": first["episode_id"], "calls": 2},
        second["episode_id"]: {"episode_id": second["episode_id"], "calls": 1},
    }


def test_a_stop_publishes_or_dead_letters_every_closed_episode_and_the_audit_counts_them(
    kafka_config, unique_name, tmp_path, chat_model
):
    dlq, stale = unique_name("rollouts.dlq"), unique_name("rollouts.stale")
    create_stream_topics(kafka_config.client_config(), {"dlq": dlq, "stale": stale})
    with gateway_run(
        kafka_config, unique_name, tmp_path, chat_model, groups=5, group_size=3, inflight=2,
        dead_letter_topic=dlq,
    ) as run:  # fmt: skip
        # group A, whole: each close says its records wait for the group, until it is
        # acknowledged in the raw topic
        a = [run.open() for _ in range(3)]
        assert len({o["group_id"] for o in a}) == 1
        for opened in a:
            _play(run, opened, stream=False)
        answers = [run.close(opened["episode_id"], 1.0).json() for opened in a]
        assert [(x["published"], x["state"], x["group_open"]) for x in answers] == [
            (False, "waiting_for_group", 2),
            (False, "waiting_for_group", 1),
            (False, "publishing", 0),
        ]
        episode_url = f"{run.url}/v1/episodes/{a[0]['episode_id']}"
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_until(
            lambda: httpx.get(episode_url, headers=auth).json()["state"] == "published",
            30,
            "group A acknowledged",
        )
        assert httpx.get(episode_url, headers=auth).json()["published"] is True
        # groups B and C: two of B's episodes closed, one of C's, then the producer stops
        b, c = [run.open() for _ in range(3)], run.open()
        assert len({o["group_id"] for o in b}) == 1 and c["group_id"] != b[0]["group_id"]
        for opened in (*b[:2], c):
            _play(run, opened, stream=False)
        told = {o["episode_id"]: run.close(o["episode_id"], 0.5).json() for o in (*b[:2], c)}
        assert [(x["published"], x["state"]) for x in told.values()] == [
            (False, "waiting_for_group")
        ] * 3
        assert [x["group_open"] for x in told.values()] == [2, 1, 2]
        c_url = f"{run.url}/v1/episodes/{c['episode_id']}"
        assert httpx.get(c_url, headers=auth).json()["state"] == "waiting_for_group"
        run.worker["w"].request_stop_threadsafe()
    # B is published as a group of its two closed episodes' records (an episode whose
    # history split makes two); C's go to the DLQ
    by_group: dict[str, list[Trajectory]] = {}
    for record in run.records(kafka_config):
        by_group.setdefault(record.group_id, []).append(record)
    episodes = {
        g: {r.reward_details["gateway"]["episode_id"] for r in records}
        for g, records in by_group.items()
    }
    assert episodes == {
        a[0]["group_id"]: {o["episode_id"] for o in a},
        b[0]["group_id"]: {o["episode_id"] for o in b[:2]},
    }
    assert {r.group_size for r in by_group[b[0]["group_id"]]} == {len(by_group[b[0]["group_id"]])}
    letters = read_topic(kafka_config, dlq)
    dead = [decode(letter.value()) for letter in letters]
    assert {(d.group_id, d.reward, d.reward_details["gateway"]["episode_id"]) for d in dead} == {
        (c["group_id"], 0.5, c["episode_id"])
    }
    for letter in letters:
        reason = DeadLetter.from_headers(letter.headers())
        assert reason.reason == "gateway_stopped_incomplete_group"
        assert "1 of the group's 3 episodes closed" in reason.detail
    ledger = read_ledger(run.ledger)
    assert ledger.dead_lettered == {c["group_id"]: sorted(d.trajectory_id for d in dead)}
    assert ledger.abandoned[b[0]["group_id"]] == {b[2]["episode_id"]: "the producer stopped"}
    # the audit expects every closed episode somewhere: A and B delivered (no stream ran,
    # so not trained: missing), C dead-lettered by the producer and found in the DLQ
    report = audit(
        AuditSources(
            run_id=run.run_id,
            client_config=kafka_config.client_config(),
            producers_dir=run.ledger.parent.parent,
            trainer_ledger=tmp_path / "no-trainer.jsonl",
            raw=run.topic,
            scored=run.topic,
            stales=(stale,),
            dlqs=(dlq,),
            filtered=None,
            stream_app_id="none",
            trainer_group="none",
        ),
        diagnose=False,
    )
    counts = report.counts()
    published = {r.trajectory_id for records in by_group.values() for r in records}
    assert (counts["delivered"], counts["dead_lettered_by_producers"], counts["dlq"]) == (
        len(published),
        len(dead),
        len(dead),
    )
    assert report.missing == published
    assert report.unknown_dead_letters == set()
