"""The engine's HTTP API behind an API key, over real HTTP on 127.0.0.1: every endpoint
but ``/health`` answers 401 without the right ``Authorization: Bearer`` key, a
non-loopback bind without a key is refused at start, and ``/update_weights_from_disk``
loads only from the weights directory and only the file whose sha256 the caller names."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx
import pytest
import torch

from core.models import BOS_ID, SEP_ID, TinyTokenizer, build_tiny_llama
from producers.engine.backends import HttpBackend
from producers.engine.client import EngineClient, EngineRequestError
from producers.engine.engine import Engine
from producers.engine.server import ServerThread
from producers.engine.weights import save_weights

torch.set_num_threads(1)

KEY = "s3cret-engine-key"
PROMPT = [BOS_ID, 5, 6, 7, SEP_ID]
ENDPOINTS = [
    ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}),
    ("PUT", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "9"}),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/server_info", None),
    ("POST", "/flush_cache", None),
    ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"}),
    ("POST", "/unload_lora_adapter", {"lora_name": "a"}),
    ("GET", "/health_generate", None),
]


def _engine() -> Engine:
    return Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer(), seed=0)


@pytest.fixture()
def keyed(tmp_path):
    with ServerThread(_engine(), api_key=KEY, weights_dir=tmp_path / "weights") as srv:
        yield srv


def _sha(directory: Path) -> str:
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def test_every_endpoint_but_health_needs_the_key(keyed):
    for method, path, body in ENDPOINTS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            reply = httpx.request(method, keyed.url + path, json=body, headers=headers)
            assert reply.status_code == 401, (method, path, headers, reply.text)
            assert "api key" in reply.json()["message"]
        assert keyed.engine.weight_version == "0"  # nothing happened
    assert httpx.get(keyed.url + "/health").status_code == 200  # liveness stays open
    right = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/model_info", headers=right).json()["weight_version"] == "0"
    reply = httpx.post(keyed.url + "/generate", json=ENDPOINTS[0][2], headers=right)
    assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 1


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "engine.example"])
def test_a_non_loopback_bind_without_a_key_is_refused_at_start(host):
    with pytest.raises(ValueError, match=rf"{host}.*api_key"):
        ServerThread(_engine(), host=host)


def test_weights_from_outside_the_weights_directory_are_refused(keyed, tmp_path):
    outside = tmp_path / "evil"
    save_weights(build_tiny_llama(seed=5).state_dict(), outside)
    escape = tmp_path / "weights"
    escape.mkdir(parents=True, exist_ok=True)
    right = {"Authorization": f"Bearer {KEY}"}
    for path in (outside, escape / ".." / "evil"):
        body = {"model_path": str(path), "weight_version": "999", "weights_sha256": _sha(outside)}
        reply = httpx.post(keyed.url + "/update_weights_from_disk", json=body, headers=right)
        assert reply.status_code == 403, reply.text
        message = reply.json()["message"]
        assert str(path) in message and "outside the weights directory" in message
    assert keyed.engine.weight_version == "0"


def test_a_wrong_sha256_is_refused_and_the_old_weights_kept(keyed, tmp_path):
    inside = tmp_path / "weights" / "v1"
    save_weights(build_tiny_llama(seed=5).state_dict(), inside)
    before = {k: v.clone() for k, v in keyed.engine.model.state_dict().items()}

    async def go(sha: str | None) -> dict:
        async with EngineClient(keyed.url, api_key=KEY) as client:
            return await client.update_weights_from_disk(str(inside), "1", sha256=sha)

    with pytest.raises(EngineRequestError, match="sha256"):
        run(go("0" * 64))
    with pytest.raises(EngineRequestError, match="weights_sha256 is required"):
        run(go(None))
    assert keyed.engine.weight_version == "0"
    after = keyed.engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert run(go(_sha(inside)))["success"] is True  # the right file, the right hash
    assert keyed.engine.weight_version == "1"


def test_the_producer_client_sends_the_key_and_the_hash(keyed, tmp_path):
    """``HttpBackend`` (the producer's engine) writes a version into the weights
    directory and loads it through the keyed API; without the key it is refused."""

    async def go(key: str | None) -> str:
        client = EngineClient(keyed.url, api_key=key, retries=1)
        backend = HttpBackend(client, tmp_path / "weights" / "producer-0")
        try:
            await backend.load_version(3, build_tiny_llama(seed=7).state_dict())
            return (await backend.model_info())["weight_version"]
        finally:
            await backend.aclose()

    with pytest.raises(EngineRequestError, match="HTTP 401"):
        run(go(None))
    assert run(go(KEY)) == "3"


def run(coro):
    return asyncio.run(coro)


def test_serve_refuses_a_public_host_without_a_key_before_loading_anything(tmp_path):
    from click.testing import CliRunner

    from rollstream.cli.main import main

    result = CliRunner().invoke(
        main, ["--state-dir", str(tmp_path), "serve", "--host", "0.0.0.0", "--port", "0"]
    )
    assert result.exit_code == 2, result.output  # a usage error, before the model loads
    assert "refusing to serve the engine on '0.0.0.0' without an API key" in result.output
