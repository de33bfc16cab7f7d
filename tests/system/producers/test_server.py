"""Engine server + client over real HTTP on 127.0.0.1: SGLang's field names, batching,
abort, weight updates, model checks, and clear errors for bad or absent engines."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from support.canned_engine import FakeEngine, free_port, good_reply
from support.paths import REPO
from support.producer_runs import recompute

from core.models import BOS_ID, SEP_ID, TinyTokenizer, build_tiny_llama
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
        ({"input_ids": PROMPT, "stream": True}, "stream"),
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
