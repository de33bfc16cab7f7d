"""SGLang's own router (``sglang-router``, its real binary) in front of two CPU engines,
reached by a producer's backend through ``RouterClient``: generation spread over both,
every version loaded on every engine, aborts that find the engine holding the request,
and clear errors when the URL is no router or an engine refuses a version."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner
from support.producer_runs import recompute

from core.config import LoraConfig
from core.models import BOS_ID, SEP_ID, TinyTokenizer, add_lora, build_tiny_llama
from core.process import free_port, tail
from producers.config import EngineConfig, RolloutConfig
from producers.engine.backends import http_backend
from producers.engine.client import EngineRequestError
from producers.engine.engine import Engine
from producers.engine.router import RouterClient
from producers.engine.server import ServerThread
from rollstream.cli.main import main

pytestmark = pytest.mark.integration

KEY = "router-test-key"
LORA = LoraConfig(rank=4, alpha=8.0)
PROMPTS = [
    [BOS_ID, 5, 6, 7, SEP_ID],
    [BOS_ID, 1, 2, SEP_ID],
    [BOS_ID, 9, SEP_ID],
    [BOS_ID, 4, SEP_ID],
]


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-weights")


@pytest.fixture(scope="module")
def engines(weights_dir: Path) -> Iterator[list[ServerThread]]:
    servers = [
        ServerThread(
            Engine(
                add_lora(build_tiny_llama(seed=0), LORA),  # a LoRA slot serves plain weights too
                model_path="tiny",
                tokenizer=TinyTokenizer(),
                seed=i,
            ),
            api_key=KEY,
            weights_dir=weights_dir,
        )
        for i in range(2)
    ]
    for server in servers:
        server.__enter__()
    yield servers
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def router_url(
    engines: list[ServerThread], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``rollstream router`` (which becomes SGLang's router) over both engines."""
    port, log = free_port(), tmp_path_factory.mktemp("router") / "router.log"
    argv = [sys.executable, "-m", "rollstream", "router", "--port", str(port)]
    argv += ["--metrics-port", str(free_port()), "--api-key", KEY]
    for server in engines:
        argv += ["--engine-url", server.url]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            ready = httpx.get(url + "/readiness", headers={"Authorization": f"Bearer {KEY}"})
            if ready.status_code == 200 and ready.json()["healthy_workers"] == 2:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"router not ready (exit {proc.poll()}):\n{tail(log)}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_the_router_needs_its_key(router_url: str) -> None:
    assert httpx.post(router_url + "/generate", json={"input_ids": [1]}).status_code == 401


def test_generation_is_spread_over_both_engines_and_exact(
    engines: list[ServerThread], router_url: str
) -> None:
    before = [s.engine.stats.requests for s in engines]
    sampling = {"max_new_tokens": 4, "ignore_eos": True}

    async def go():  # type: ignore[no-untyped-def]
        async with RouterClient(router_url, api_key=KEY) as client:
            rids = [f"spread-{i}" for i in range(len(PROMPTS))]
            return await client.generate(PROMPTS, sampling, rids=rids)

    outs = run(go())
    assert [o.rid for o in outs] == [f"spread-{i}" for i in range(len(PROMPTS))]
    assert all(s.engine.stats.requests > b for s, b in zip(engines, before, strict=True))
    model = engines[0].engine.model
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert len(out.output_ids) == 4
        assert out.logprobs == pytest.approx(recompute(model, prompt, out.output_ids), abs=1e-5)


def test_a_version_reaches_every_engine(
    engines: list[ServerThread], router_url: str, weights_dir: Path, tmp_path: Path
) -> None:
    rollout = RolloutConfig(engine_url=router_url, engine_router=True)
    engine_config = EngineConfig(model="tiny", api_key=KEY)
    new = build_tiny_llama(seed=7).state_dict()

    async def go():  # type: ignore[no-untyped-def]
        backend = await http_backend(rollout, engine_config, weights_dir, tmp_path / "cache")
        try:
            assert isinstance(backend.client, RouterClient)
            await backend.load_version(3, new)
            sampling = [{"max_new_tokens": 3, "ignore_eos": True}] * 4
            return await backend.generate(PROMPTS, sampling, [f"v3-{i}" for i in range(4)])
        finally:
            await backend.aclose()

    outs = run(go())
    assert [s.engine.weight_version for s in engines] == ["3", "3"]
    assert {o.weight_version for o in outs} == {"3"}
    reference = build_tiny_llama(seed=7)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.logprobs == pytest.approx(recompute(reference, prompt, out.output_ids), abs=1e-5)


def test_abort_finds_the_engine_holding_the_request(
    engines: list[ServerThread], router_url: str
) -> None:
    for server in engines:
        server.engine.step_delay_s = 0.02

    async def go():  # type: ignore[no-untyped-def]
        async with RouterClient(router_url, api_key=KEY) as client:
            sampling = {"max_new_tokens": 400, "ignore_eos": True}
            task = asyncio.create_task(client.generate([PROMPTS[0]], sampling, rids=["long"]))
            while sum(s.engine.stats.tokens_generated for s in engines) < start + 2:
                await asyncio.sleep(0.01)
            await client.abort("long")
            return (await task)[0]

    start = sum(s.engine.stats.tokens_generated for s in engines)
    try:
        out = run(go())
    finally:
        for server in engines:
            server.engine.step_delay_s = 0.0
    assert out.aborted and 2 <= len(out.output_ids) < 400


def test_a_refused_version_names_the_engine_and_keeps_the_old_weights(
    engines: list[ServerThread], router_url: str, weights_dir: Path
) -> None:
    async def go():  # type: ignore[no-untyped-def]
        async with RouterClient(router_url, api_key=KEY) as client:
            await client.update_weights_from_disk(
                str(weights_dir / "nowhere"), weight_version="99", sha256="0" * 64
            )

    old = [s.engine.weight_version for s in engines]
    with pytest.raises(EngineRequestError, match=r"reached 0 of 2 engines") as refused:
        run(go())
    assert all(s.url in str(refused.value) for s in engines)
    assert [s.engine.weight_version for s in engines] == old


def test_an_engine_url_is_no_router(engines: list[ServerThread]) -> None:
    async def go():  # type: ignore[no-untyped-def]
        async with RouterClient(engines[0].url, api_key=KEY) as client:
            await client.abort("x")

    with pytest.raises(EngineRequestError, match="is it an SGLang router"):
        run(go())
    with pytest.raises(ValueError, match="2 prompts but 1 sampling_params"):
        run(RouterClient(engines[0].url).generate(PROMPTS[:2], [{}]))


def test_lora_versions_reach_every_engine_and_requests_name_them(
    engines: list[ServerThread], router_url: str, weights_dir: Path, tmp_path: Path
) -> None:
    """A LoRA run behind the router: the base and each adapter reach both engines (the
    router routes no loads), every request names the adapter through the router."""
    rollout = RolloutConfig(engine_url=router_url, engine_router=True)
    engine_config = EngineConfig(model="tiny", api_key=KEY)
    policy = add_lora(build_tiny_llama(seed=9), LORA)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    state = {name: tensor.clone() for name, tensor in policy.state_dict().items()}

    async def go():  # type: ignore[no-untyped-def]
        backend = await http_backend(
            rollout, engine_config, weights_dir, tmp_path / "cache", lora=LORA
        )
        try:
            await backend.load_version(4, state)
            sampling = [{"max_new_tokens": 3, "ignore_eos": True}] * 4
            return await backend.generate(PROMPTS, sampling, [f"lora-{i}" for i in range(4)])
        finally:
            await backend.aclose()

    try:
        outs = run(go())
        assert [s.engine.weight_version for s in engines] == ["base-v4", "base-v4"]
        assert [s.engine.serving_adapter for s in engines] == ["v4", "v4"]
    finally:  # the other tests send requests that name no adapter
        for server in engines:
            if server.engine.serving_adapter is not None:
                server.engine.unload_adapter(server.engine.serving_adapter).result()
    assert {o.weight_version for o in outs} == {"4"}
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.logprobs == pytest.approx(recompute(policy, prompt, out.output_ids), abs=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["router", "--engine-url", "engine-a:30000"], "must start with http://"),
        (["router", "--engine-url", "http://10.0.0.2:30000", "--host", "0.0.0.0"], "router"),
        (["router"], "Missing option '--engine-url'"),
        (["serve", "--engine", "sglang", "--model", "tiny"], "runs only on --engine cpu"),
        (["serve", "--engine-arg=--tp-size=2"], "--engine-arg is for --engine sglang"),
        (["serve", "--engine", "vllm"], "'vllm' is not one of 'cpu', 'sglang'"),
    ],
)
def test_bad_engine_commands_are_refused_before_anything_starts(
    args: list[str], message: str
) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and message in result.output, result.output
