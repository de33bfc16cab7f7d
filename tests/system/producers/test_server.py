"""Engine server + client over real HTTP on 127.0.0.1: SGLang's field names, batching,
abort, weight updates, model checks, and clear errors for bad or absent engines."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import httpx
import pytest
import torch
from support.canned_engine import FakeEngine, free_port, good_reply
from support.paths import REPO
from support.producer_runs import recompute
from support.step_gate import StepGate

from core.models import BOS_ID, SEP_ID, TinyTokenizer, build_tiny_llama
from producers.engine.backends import HttpBackend, LocalBackend
from producers.engine.client import (
    EngineClient,
    EngineModelMismatch,
    EngineRequestError,
    EngineResponseError,
    EngineUnavailable,
    parse_generate_response,
    same_model,
)
from producers.engine.engine import Engine
from producers.engine.requests import SamplingParams
from producers.engine.server import ServerThread
from producers.engine.weights import save_weights, weights_sha256

torch.set_num_threads(1)

PROMPT = [BOS_ID, 5, 6, 7, SEP_ID]
LONG = {"max_new_tokens": 50, "ignore_eos": True}


@pytest.fixture()
def server():
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer(), seed=0)
    with ServerThread(engine) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


def test_generate_speaks_sglang(server):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True},
        "return_logprob": True,
        "rid": "req-1",
    }
    data = httpx.post(server.url + "/generate", json=body).json()
    assert set(data) == {"text", "output_ids", "meta_info"}
    meta = data["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (5, 6)
    assert meta["weight_version"] == "0"
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == data["output_ids"]
    assert all(e[2] is None for e in entries)
    assert data["text"] == TinyTokenizer().decode(data["output_ids"], skip_special_tokens=True)
    expected = recompute(server.engine.model, PROMPT, data["output_ids"])
    assert [e[0] for e in entries] == pytest.approx(expected, abs=1e-5)
    # A batch in, a list out; no logprobs unless asked.
    batch = httpx.post(
        server.url + "/generate",
        json={"input_ids": [PROMPT, [BOS_ID, 9, SEP_ID]], "sampling_params": {"max_new_tokens": 2}},
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert "output_token_logprobs" not in batch[0]["meta_info"]


def test_model_info_health_and_server_info(server):
    info = httpx.get(server.url + "/get_model_info").json()
    assert info == {
        "model_path": "tiny",
        "tokenizer_path": None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "0",
    }
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate").status_code == 200
    assert httpx.get(server.url + "/model_info").json() == info  # SGLang's newer name
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    server_info = httpx.get(server.url + "/get_server_info").json()
    assert "SGLang v0.5.23" in server_info["version"]
    assert server_info["busy_s"] > 0.0  # /health_generate computed one token


def test_client_round_trip_and_log_probs(server):
    async def go():
        async with EngineClient(server.url) as client:
            info = await client.check_model("tiny")
            outs = await client.generate(
                [PROMPT, PROMPT],
                {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True},
                rids=["a", "b"],
            )
            return info, outs

    info, outs = run(go())
    assert info["weight_version"] == "0"
    assert [o.rid for o in outs] == ["a", "b"]
    for out in outs:
        assert out.finish_type == "length" and len(out.output_ids) == 12
        assert out.logprobs == pytest.approx(
            recompute(server.engine.model, PROMPT, out.output_ids), abs=1e-5
        )


def test_concurrent_requests_are_batched(server):
    server.engine.batch_wait_s = 0.1

    async def go():
        async with EngineClient(server.url) as client:
            return await asyncio.gather(
                *(
                    client.generate([PROMPT], {"max_new_tokens": 3}, rids=[f"r{i}"])
                    for i in range(8)
                )
            )

    results = run(go())
    assert len(results) == 8
    stats = server.engine.stats
    assert stats.requests == 8
    assert stats.batches < 8
    assert stats.max_batch_seen > 1


def test_abort_request_returns_partial_output(server):
    server.engine.step_delay_s = 0.01

    async def go():
        async with EngineClient(server.url) as client:
            call = asyncio.create_task(client.generate([PROMPT], LONG, rids=["victim"]))
            while server.engine.stats.tokens_generated < 2:
                await asyncio.sleep(0.005)
            await client.abort("victim")
            return await call

    (out,) = run(go())
    assert out.aborted and out.finish_reason["type"] == "abort"
    assert 2 <= len(out.output_ids) < 50
    assert out.logprobs == pytest.approx(
        recompute(server.engine.model, PROMPT, out.output_ids), abs=1e-5
    )


def test_abort_all_and_disconnect_free_the_engine(server):
    server.engine.step_delay_s = 0.01

    async def go():
        async with EngineClient(server.url) as client:
            calls = [
                asyncio.create_task(client.generate([PROMPT], LONG, rids=[f"x{i}"]))
                for i in range(3)
            ]
            while server.engine.stats.tokens_generated < 1:
                await asyncio.sleep(0.005)
            await client.abort(abort_all=True)
            return await asyncio.gather(*calls)

    assert all(out.aborted for (out,) in run(go()))
    # A client that hangs up: the server aborts its request instead of computing on.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/generate",
            json={"input_ids": PROMPT, "sampling_params": LONG, "rid": "gone"},
            timeout=0.1,
        )
    deadline = time.monotonic() + 10
    while server.engine._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.engine._pending


def test_update_weights_from_disk(tmp_path):
    other = build_tiny_llama(seed=5)
    save_weights(other.state_dict(), tmp_path / "v1")
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer(), seed=0)

    async def go():
        async with EngineClient(server.url) as client:
            sha = weights_sha256(tmp_path / "v1")
            reply = await client.update_weights_from_disk(
                str(tmp_path / "v1"), weight_version="1", sha256=sha
            )
            info = await client.model_info()
            outs = await client.generate([PROMPT], {"max_new_tokens": 5, "ignore_eos": True})
            with pytest.raises(EngineRequestError, match=r"no \*\.safetensors"):
                await client.update_weights_from_disk(str(tmp_path / "missing"), "2", sha256=sha)
            return reply, info, outs[0], await client.model_info()

    with ServerThread(engine, weights_dir=tmp_path) as server:
        reply, info, out, after_failure = run(go())
    assert reply["success"] is True and "Weight version updated to 1" in reply["message"]
    assert info["weight_version"] == "1" and out.weight_version == "1"
    assert out.logprobs == pytest.approx(recompute(other, PROMPT, out.output_ids), abs=1e-5)
    assert after_failure["weight_version"] == "1"  # a failed update keeps the old weights


def test_unsupported_requests_get_a_clear_400(server):
    async def go(body_params):
        async with EngineClient(server.url) as client:
            await client.generate([PROMPT], body_params)

    with pytest.raises(EngineRequestError, match=r"HTTP 400.*n=3 is not supported"):
        run(go({"n": 3}))
    with pytest.raises(EngineRequestError, match="outside the vocabulary"):
        run(_bad_ids(server))
    for body, message in [
        ({"text": "hello"}, "text prompts"),
        ({"input_ids": PROMPT, "stream": "yes"}, "stream must be true or false"),
        ({"input_ids": PROMPT, "stream": 1}, "stream must be true or false"),
        ({"input_ids": [PROMPT, PROMPT], "stream": True}, "stream=true takes one prompt"),
        ({"input_ids": PROMPT, "bogus": 1}, "bogus"),
        ({"input_ids": [PROMPT, PROMPT], "rid": ["a"]}, "rid has 1 entries"),
        ({"input_ids": PROMPT, "logprob_start_len": 0}, "input-token"),
        ({"input_ids": PROMPT, "return_hidden_states": True}, "return_hidden_states=True"),
        ({"input_ids": PROMPT, "model": "other"}, "model='other' is not supported"),
        ({"input_ids": PROMPT, "return_entropy": "yes"}, "return_entropy='yes'"),
    ]:
        reply = httpx.post(server.url + "/generate", json=body)
        assert reply.status_code == 400
        assert message in reply.json()["message"]


async def _bad_ids(server):
    async with EngineClient(server.url) as client:
        await client.generate([[BOS_ID, 99]], {"max_new_tokens": 2})


def test_model_mismatch_is_a_clear_error(server):
    async def go():
        async with EngineClient(server.url) as client:
            await client.check_model("smollm2-135m-instruct")

    with pytest.raises(EngineModelMismatch, match=r"serves model 'tiny'.*expects"):
        run(go())
    assert same_model("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert same_model("/models/ckpt/", "/mnt/other/ckpt")
    assert not same_model("tiny", "smollm2-135m-instruct")


def test_absent_engine_raises_engine_unavailable_after_retries():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with EngineClient(url, retries=3, retry_max_wait=0.05) as client:
            assert not await client.health()
            await client.generate([PROMPT], {})

    with pytest.raises(EngineUnavailable, match="after 3 attempts"):
        run(go())


def test_transient_503_is_retried_then_succeeds():
    fake = FakeEngine([(503, "warming up"), (503, "warming up"), (200, [good_reply()])])
    try:

        async def go():
            async with EngineClient(fake.url, retries=4, retry_max_wait=0.05) as client:
                return await client.generate([PROMPT], {})

        (out,) = run(go())
    finally:
        fake.close()
    assert fake.calls == 3
    assert (out.output_ids, out.logprobs, out.weight_version) == ([7, 8], [-0.5, -1.0], "3")


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ("not json", "non-JSON"),
        ({"output_ids": [1]}, "expected a list of 1 results"),
        ([good_reply(), good_reply()], "expected 1 results, got 2"),
        ([{"output_ids": [1]}], "meta_info missing"),
        ([{**good_reply(), "output_ids": "7 8"}], "output_ids missing or not a list"),
        (
            [{**good_reply(), "meta_info": {**good_reply()["meta_info"], "finish_reason": "stop"}}],
            "finish_reason 'stop' is not an object",
        ),
        (
            [
                {
                    **good_reply(),
                    "meta_info": {**good_reply()["meta_info"], "output_token_logprobs": None},
                }
            ],
            "output_token_logprobs missing",
        ),
        (
            [good_reply(ids=(7, 8, 9), logprobs=(-1, -1, -1)) | {"output_ids": [7, 8]}],
            "completion_tokens=3",
        ),
        (
            [
                {
                    **good_reply(),
                    "meta_info": {
                        **good_reply()["meta_info"],
                        "output_token_logprobs": [[-0.5, 7, None]],
                    },
                }
            ],
            "1 output_token_logprobs for 2 output_ids",
        ),
        (
            [
                {
                    **good_reply(),
                    "meta_info": {
                        **good_reply()["meta_info"],
                        "output_token_logprobs": [[-0.5, 7, None], [-1.0, 9, None]],
                    },
                }
            ],
            "is for token 9, output_ids\\[1\\] is 8",
        ),
        ([good_reply(logprobs=(-0.5, 0.7))], "0.7 is not a log-probability"),
        ([good_reply(logprobs=(-0.5, float("nan")))], "non-JSON|not a log-probability"),
    ],
)
def test_bad_engine_responses_are_clear_errors(reply, message):
    fake = FakeEngine([(200, reply)])
    try:

        async def go():
            async with EngineClient(fake.url, retries=1) as client:
                await client.generate([PROMPT], {})

        with pytest.raises(EngineResponseError, match=message):
            run(go())
    finally:
        fake.close()


def test_parse_accepts_a_single_object_for_one_prompt():
    (out,) = parse_generate_response(good_reply(), 1, True)
    assert out.finish_type == "length" and out.prompt_tokens == 5
    (no_lp,) = parse_generate_response([good_reply()], 1, False)
    assert no_lp.logprobs is None


def _sse(*events: object, done: bool = True) -> bytes:
    """A stream's bytes: each event a ``data:`` line (a dict as JSON, bytes as they are)."""
    lines = [
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    ]
    return b"".join(lines) + (b"data: [DONE]\n\n" if done else b"")


def _read_events(reply: httpx.Response, first: Any = None) -> list[Any]:
    """The ``data:`` objects of a streamed answer up to ``[DONE]``; ``first`` is called
    with the first one as soon as it arrives."""
    events: list[Any] = []
    for line in reply.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line[6:]))
        if len(events) == 1 and first is not None:
            first(events[0])
    raise AssertionError("the stream ended without data: [DONE]")


def test_generate_streams_the_tokens_as_the_engine_draws_them(server):
    """SGLang's stream: an event as tokens are drawn (the first one while the engine is
    held), everything so far in each, the whole answer last, and the same tokens and
    log-probs as an engine of the same seed answers whole."""
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
    body = {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True, "rid": "s"}
    twin = Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer(), seed=0)
    (result,) = twin.generate([PROMPT], SamplingParams.from_dict(params))
    whole = result.to_sglang(twin.decode(result.output_ids))
    gate = StepGate(server.engine)
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = _read_events(reply, lambda event: gate.open())
    gate.remove()
    # the first event came while the engine was held with held_at of the 6 tokens drawn
    assert not gate.timed_out and gate.held_at is not None and gate.held_at < 6
    assert len(events[0]["output_ids"]) <= gate.held_at
    assert events[0]["output_ids"] == whole["output_ids"][: len(events[0]["output_ids"])]
    assert events[0]["meta_info"]["finish_reason"] is None
    for before, after in itertools.pairwise(events):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        entries = after["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in entries] == after["output_ids"]
        assert after["meta_info"]["completion_tokens"] == len(after["output_ids"])
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


def test_a_client_that_leaves_a_stream_frees_the_engine(server):
    server.engine.step_delay_s = 0.01
    body = {"input_ids": PROMPT, "sampling_params": LONG, "rid": "leaver", "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body) as reply:
        next(line for line in reply.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 10
    while server.engine._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.engine._pending and server.engine.stats.aborted == 1
    assert server.engine.stats.tokens_generated < 50  # it stopped early


def test_the_client_is_told_the_streamed_tokens_before_the_answer_is_done(server):
    gate = StepGate(server.engine)
    told: list[tuple[list[int], list[float]]] = []

    def on_tokens(ids, logprobs):
        told.append((ids, logprobs))
        gate.open()

    async def go():
        async with EngineClient(server.url) as client:
            return await client.generate_stream(PROMPT, LONG | {"max_new_tokens": 8}, on_tokens)

    out = run(go())
    gate.remove()
    # told while the engine was held with held_at of the answer's 8 tokens drawn
    assert not gate.timed_out and gate.held_at is not None and gate.held_at < 8
    assert 1 <= len(told[0][0]) <= gate.held_at
    assert out.finish_type == "length" and len(out.output_ids) == 8
    for ids, logprobs in told:
        assert out.output_ids[: len(ids)] == ids and out.logprobs[: len(ids)] == logprobs
    assert out.logprobs == pytest.approx(
        recompute(server.engine.model, PROMPT, out.output_ids), abs=1e-5
    )


def test_both_backends_stream_a_turn_and_answer_what_they_told(tmp_path):
    """The worker's two backends, in process and over HTTP, streaming one prompt from
    engines of the same seed: the same tokens told as they come, the same answer; a batch
    is refused a stream."""
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}

    def engine() -> Engine:
        return Engine(
            build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer(), seed=0
        )

    async def go(backend):
        told = []
        try:
            (out,) = await backend.generate(
                [PROMPT], [params], ["r"], on_tokens=lambda ids, lps: told.append((ids, lps))
            )
            with pytest.raises(ValueError, match="one prompt"):
                await backend.generate([PROMPT, PROMPT], [params] * 2, ["a", "b"], on_tokens=print)
        finally:
            await backend.aclose()
        return told, out

    local_told, local = run(go(LocalBackend(engine())))
    with ServerThread(engine()) as server:
        http_told, remote = run(go(HttpBackend(EngineClient(server.url), tmp_path)))
    assert local.output_ids == remote.output_ids and local.logprobs == remote.logprobs
    for told in (local_told, http_told):
        assert told and all(1 <= len(ids) <= 8 for ids, _ in told)
        for ids, lps in told:
            assert local.output_ids[: len(ids)] == ids and local.logprobs[: len(ids)] == lps


def _event(ids, logprobs, finish=None, completion=None, text="") -> dict:
    meta = {
        "id": "r",
        "finish_reason": finish,
        "prompt_tokens": 5,
        "completion_tokens": len(ids) if completion is None else completion,
        "weight_version": "3",
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
    }
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


LENGTH_3 = {"type": "length", "length": 3}
CUMULATIVE = _sse(
    _event([7], [-0.5], text="a"),
    _event([7, 8], [-0.5, -1.0], text="ab"),
    _event([7, 8, 9], [-0.5, -1.0, -0.25], LENGTH_3, text="abc"),
)
INCREMENTAL = _sse(  # SGLang with --incremental-streaming-output: each event what is new
    _event([7], [-0.5], text="a"),
    _event([8], [-1.0], completion=2, text="b"),
    _event([9], [-0.25], LENGTH_3, completion=3, text="c"),
)


@pytest.mark.parametrize("stream", [CUMULATIVE, INCREMENTAL], ids=["cumulative", "incremental"])
def test_a_streamed_answer_is_read_whether_its_events_hold_all_or_what_is_new(stream):
    fake = FakeEngine([(200, stream)])
    told = []
    try:

        async def go():
            async with EngineClient(fake.url, retries=1) as client:
                return await client.generate_stream(
                    PROMPT, {}, lambda ids, lps: told.append((ids, lps))
                )

        out = run(go())
    finally:
        fake.close()
    assert told == [([7], [-0.5]), ([7, 8], [-0.5, -1.0])]
    assert (out.output_ids, out.logprobs, out.text) == ([7, 8, 9], [-0.5, -1.0, -0.25], "abc")
    assert (out.finish_type, out.weight_version, out.rid) == ("length", "3", "r")


@pytest.mark.parametrize(
    ("stream", "error", "message"),
    [
        (_sse(b"{not json"), EngineResponseError, "stream event 0 is not JSON"),
        (_sse(_event([7], [-0.5]), _event([8, 9], [-1.0, -1.0])), EngineResponseError,
         "do not extend"),
        (_sse(_event([7], [-0.5]), _event([9], [-1.0], completion=5)), EngineResponseError,
         "completion_tokens=5 after 1 tokens"),
        (_sse({**_event([7], [-0.5]), "output_ids": "7"}), EngineResponseError,
         "output_ids missing"),
        (_sse({"output_ids": [7]}), EngineResponseError, "expected an object with meta_info"),
        (_sse(_event([7], [0.5])), EngineResponseError, "not a log-probability"),
        (_sse(_event([7], [-0.5]) | {"output_ids": [8]}), EngineResponseError, "is for token 7"),
        (_sse(_event([7], [-0.5])), EngineResponseError, "without a finished answer"),
        (_sse({"error": {"message": "prompt too long"}}), EngineRequestError, "prompt too long"),
        (_sse(_event([7], [-0.5]), done=False), EngineUnavailable, "stream broke after 1"),
    ],
)  # fmt: skip
def test_bad_streams_are_clear_errors_and_a_cut_one_is_never_sent_again(stream, error, message):
    fake = FakeEngine([(200, stream)])
    try:

        async def go():
            async with EngineClient(fake.url, retries=3, retry_max_wait=0.01) as client:
                await client.generate_stream(PROMPT, {}, lambda ids, lps: None)

        with pytest.raises(error, match=message):
            run(go())
    finally:
        fake.close()
    assert fake.calls == 1


@pytest.mark.system
def test_serve_command_runs_until_sigterm(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    settings = tmp_path / "rollstream.toml"
    settings.write_text('[producers.engine]\nmodel = "tiny"\nport = 0\ntorch_threads = 1\n')
    repo = REPO
    process = subprocess.Popen(
        [sys.executable, "-m", "producers", "serve", "--config", str(settings)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), "ROLLSTREAM_STATE_DIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert "serves SGLang v0.5.23's API at http://127.0.0.1:" in line, line
        url = line.rsplit(" at ", 1)[1].strip()
        assert httpx.get(url + "/get_model_info").json()["model_path"] == "tiny"
        reply = httpx.post(url + "/generate", json={"input_ids": PROMPT, "return_logprob": True})
        assert reply.status_code == 200 and reply.json()["meta_info"]["output_token_logprobs"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
