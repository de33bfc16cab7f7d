"""Bad requests over real HTTP against the real engine server: a garbage sampling parameter
is answered 400 naming the field and never reaches the batch other clients share; a request
over the engine's token budget is refused with the numbers; the producer's client stops on
a 4xx (its own bug) and retries a 5xx/503 (the engine's trouble)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from support.canned_engine import FakeEngine, good_reply

from core.models import BOS_ID, SEP_ID, TinyTokenizer, build_tiny_llama
from producers.config import EngineConfig
from producers.engine.client import EngineClient, EngineRequestError
from producers.engine.engine import Engine
from producers.engine.server import ServerThread

torch.set_num_threads(1)

PROMPT = [BOS_ID, 5, 6, 7, SEP_ID]
LONG = {"max_new_tokens": 40, "ignore_eos": True}


def _engine() -> Engine:
    return Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer(), seed=0)


@pytest.fixture(scope="module")
def server():
    with ServerThread(_engine(), max_request_tokens=1000) as srv:
        yield srv


GARBAGE = [
    ("temperature", "nan"),
    ("temperature", "inf"),
    ("temperature", "0.7"),
    ("temperature", [1.0]),
    ("temperature", {"x": 1}),
    ("temperature", True),
    ("temperature", -1.0),
    ("top_p", "nan"),
    ("top_p", "-inf"),
    ("top_p", 0.0),
    ("min_p", "nan"),
    ("min_p", -0.5),
    ("top_k", 1e30),
    ("top_k", 2**63),
    ("top_k", -(2**70)),
    ("top_k", 2.5),
    ("top_k", "5"),
    ("top_k", 0),
    ("max_new_tokens", -1),
    ("max_new_tokens", 1e30),
    ("max_new_tokens", "12"),
    ("max_new_tokens", None),
    ("stop_token_ids", [1e30]),
    ("stop_token_ids", [2**64]),
    ("stop_token_ids", "abc"),
    ("stop_token_ids", [-3]),
    ("stop_token_ids", list(range(10_000))),
    ("ignore_eos", "false"),
    ("ignore_eos", 1),
    ("stop", [1, 2]),
]


@pytest.mark.parametrize(("field", "value"), GARBAGE, ids=[f"{f}={v!r}"[:40] for f, v in GARBAGE])
def test_garbage_sampling_param_is_a_400_naming_it(server, field, value):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, field: value}}
    reply = httpx.post(server.url + "/generate", json=body)
    assert reply.status_code == 400, reply.text
    assert f"sampling_params.{field}" in reply.json()["message"]


def test_a_bad_request_does_not_fail_the_good_one_batched_with_it(server):
    """The good request decodes while garbage arrives: it finishes whole, and every
    garbage request is refused on its own."""
    server.engine.step_delay_s = 0.01
    try:

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                good = asyncio.create_task(
                    http.post("/generate", json={"input_ids": PROMPT, "sampling_params": LONG})
                )
                while server.engine.stats.tokens_generated < 1:
                    await asyncio.sleep(0.005)
                bad = await asyncio.gather(
                    *(
                        http.post(
                            "/generate",
                            json={"input_ids": PROMPT, "sampling_params": {**LONG, f: v}},
                        )
                        for f, v in GARBAGE
                    )
                )
                return await good, bad

        good, bad = asyncio.run(go())
    finally:
        server.engine.step_delay_s = 0.0
    assert [r.status_code for r in bad] == [400] * len(GARBAGE)
    assert good.status_code == 200, good.text
    assert len(good.json()["output_ids"]) == LONG["max_new_tokens"]


def test_a_request_over_the_token_budget_is_refused_with_the_numbers(server):
    # 20 prompts x (5 prompt + 50 new) = 1100 tokens, over the budget of 1000.
    body = {"input_ids": [PROMPT] * 20, "sampling_params": {"max_new_tokens": 50}}
    reply = httpx.post(server.url + "/generate", json=body)
    assert reply.status_code == 413, reply.text
    message = reply.json()["message"]
    assert "1100 tokens" in message and "max_request_tokens of 1000" in message
    # max_new_tokens counts only up to the context (64): 20 x 64 = 1280, refused too.
    body["sampling_params"] = {"max_new_tokens": 10**9}
    assert "1280 tokens" in httpx.post(server.url + "/generate", json=body).json()["message"]
    # The same prompts asking for fewer tokens fit: 20 x (5 + 45) = 1000.
    body["sampling_params"] = {"max_new_tokens": 45}
    assert httpx.post(server.url + "/generate", json=body).status_code == 200

    async def go():
        async with EngineClient(server.url, retries=3, retry_max_wait=0.05) as client:
            await client.generate([PROMPT] * 20, {"max_new_tokens": 50})

    with pytest.raises(EngineRequestError, match=r"HTTP 413.*1100 tokens"):
        asyncio.run(go())


def test_abort_with_a_bad_rid_is_a_400(server):
    for rid in ([1, 2], {"a": 1}, 7):
        reply = httpx.post(server.url + "/abort_request", json={"rid": rid})
        assert reply.status_code == 400 and "rid" in reply.json()["message"]


SHA = "0" * 64
CONTROL_GARBAGE = [
    ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/abort_request", {"rid": "r" * 300}, "rid"),
    ("/update_weights_from_disk", {}, "model_path is required"),
    ("/update_weights_from_disk", {"model_path": True, "weights_sha256": SHA}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/w", "weights_sha256": "x"}, "weights_sha256"),
    ("/update_weights_from_disk", {"model_path": "/w" * 3000, "weights_sha256": SHA}, "model_path"),
    (
        "/update_weights_from_disk",
        {"model_path": "/w", "weights_sha256": SHA, "weight_version": 1.5},
        "weight_version",
    ),
    ("/load_lora_adapter", {"lora_name": "a"}, "lora_path is required"),
    ("/load_lora_adapter", {"lora_name": 1, "lora_path": "/w", "weights_sha256": SHA}, "lora_name"),
    ("/unload_lora_adapter", {"lora_name": ""}, "lora_name"),
    ("/unload_lora_adapter", {"lora_name": ["a"] * 10_000}, "lora_name"),
]


@pytest.mark.parametrize(
    ("path", "body", "why"), CONTROL_GARBAGE, ids=[f"{p}-{w}" for p, _, w in CONTROL_GARBAGE]
)
def test_control_garbage_is_a_400_naming_the_field(server, path, body, why):
    reply = httpx.post(server.url + path, json=body)
    assert reply.status_code == 400, reply.text
    assert why in reply.json()["message"]


@pytest.mark.parametrize(
    "path",
    ["/abort_request", "/update_weights_from_disk", "/load_lora_adapter", "/unload_lora_adapter"],
)
def test_a_control_body_not_a_json_object_is_a_400(server, path):
    for raw in (b"{not json", b"[1, 2]", b'"rid"', b"null", b"7", b"\xff\xfe"):
        reply = httpx.post(
            server.url + path, content=raw, headers={"Content-Type": "application/json"}
        )
        assert reply.status_code == 400, (raw, reply.text)
        assert reply.json()["object"] == "error"
    assert server.engine.weight_version == "0" and server.engine.alive


@pytest.mark.parametrize("value", [0, -5, "lots", 1.5])
def test_engine_token_budget_setting_is_validated(value):
    with pytest.raises(ValueError, match="max_request_tokens"):
        EngineConfig(max_request_tokens=value)


def test_client_raises_a_clear_error_on_400_without_retrying():
    fake = FakeEngine([(400, {"message": "sampling_params.temperature must be finite"})])
    try:

        async def go():
            async with EngineClient(fake.url, retries=4, retry_max_wait=0.05) as client:
                await client.generate([PROMPT], {"temperature": "nan"})

        with pytest.raises(EngineRequestError, match=r"HTTP 400.*sampling_params\.temperature"):
            asyncio.run(go())
    finally:
        fake.close()
    assert fake.calls == 1


@pytest.mark.parametrize("status", [500, 503])
def test_client_retries_an_engine_error(status):
    fake = FakeEngine([(status, "engine batch failed"), (200, [good_reply()])])
    try:

        async def go():
            async with EngineClient(fake.url, retries=3, retry_max_wait=0.05) as client:
                return await client.generate([PROMPT], {})

        (out,) = asyncio.run(go())
    finally:
        fake.close()
    assert fake.calls == 2 and out.output_ids == [7, 8]
