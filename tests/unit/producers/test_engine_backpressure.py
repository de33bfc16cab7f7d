"""Back-pressure of the engine over real HTTP: a bounded number of requests in flight,
503 with Retry-After beyond it, and a client that waits that long and retries."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
import torch

from core.models import BOS_ID, SEP_ID, TinyTokenizer, build_tiny_llama
from producers.config import EngineConfig
from producers.engine.client import EngineClient, retry_after_seconds
from producers.engine.engine import Engine, Scheduling
from producers.engine.requests import EngineBusy, SamplingParams
from producers.engine.server import ServerThread

torch.set_num_threads(1)

PROMPT = [BOS_ID, 5, 6, 7, SEP_ID]
# runs until aborted: the tiny model's 64 positions at 0.5 s a step last ~30 s, far longer
# than the test's calls need on loaded cores (at 10 ms a step they ended by themselves)
LONG = {"max_new_tokens": 10_000, "ignore_eos": True}


def busy_server(limit: int, retry_after_s: float) -> ServerThread:
    engine = Engine(
        build_tiny_llama(seed=0),
        model_path="tiny",
        tokenizer=TinyTokenizer(),
        seed=0,
        scheduling=Scheduling(
            step_delay_s=0.5, max_pending=limit, busy_retry_after_s=retry_after_s
        ),
    )
    return ServerThread(engine)


def fill(server: ServerThread, count: int) -> list:
    """``count`` long requests in flight (accepted: the engine holds them)."""
    futures = [
        server.engine.submit(PROMPT, SamplingParams.from_dict(LONG), rid=f"long-{i}")
        for i in range(count)
    ]
    assert len(server.engine._pending) == count
    return futures


def test_a_full_engine_answers_503_with_retry_after_and_queues_nothing() -> None:
    with busy_server(limit=3, retry_after_s=2.5) as server:
        held = fill(server, 3)
        response = httpx.post(
            server.url + "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "rid": "late"},
        )
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "3"  # whole seconds, rounded up
        assert response.json()["type"] == "ServiceUnavailable"
        assert "late" not in server.engine._pending and len(server.engine._pending) == 3
        assert httpx.get(server.url + "/health_generate").status_code == 503
        info = httpx.get(server.url + "/get_server_info").json()
        assert (info["max_pending"], info["rejected_busy"]) == (3, 2)  # generate + health
        # a batch that could never fit is a clear 400, not an endless 503
        too_big = httpx.post(
            server.url + "/generate",
            json={"input_ids": [PROMPT] * 4, "sampling_params": {"max_new_tokens": 2}},
        )
        assert too_big.status_code == 400 and "split it" in too_big.json()["message"]

        server.engine.abort(abort_all=True)
        for future in held:
            assert future.result(30).finish_reason["type"] == "abort"
        ok = httpx.post(
            server.url + "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "rid": "late"},
        )
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_the_client_waits_retry_after_then_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="producers.engine.client")
    with busy_server(limit=2, retry_after_s=1.0) as server:
        fill(server, 2)

        async def go():
            async with EngineClient(server.url, retries=10, retry_max_wait=0.01) as client:
                call = asyncio.create_task(client.generate([PROMPT], {"max_new_tokens": 3}))
                deadline = time.monotonic() + 30
                while server.engine.stats.rejected_busy < 1:
                    assert time.monotonic() < deadline, "the client was never told busy"
                    await asyncio.sleep(0.01)
                server.engine.abort(abort_all=True)  # room again
                return await call

        (out,) = asyncio.run(go())
    assert len(out.output_ids) == 3 and out.finish_type == "length"
    assert "retrying in 1.0s (Retry-After)" in caplog.text


def test_engine_config_bounds_the_engine(tmp_path) -> None:
    from producers.engine.engine import engine_from_config

    engine = engine_from_config(
        EngineConfig(max_pending_requests=1, busy_retry_after_s=4), tmp_path
    )
    engine.submit(PROMPT, SamplingParams.from_dict(LONG), rid="one")  # not started: stays
    with pytest.raises(EngineBusy) as busy:
        engine.submit(PROMPT, SamplingParams.from_dict(LONG), rid="two")
    assert busy.value.retry_after_s == 4
    engine.shutdown()


def test_retry_after_forms() -> None:
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
