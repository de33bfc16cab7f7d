"""SGLang's dynamic LoRA API on the CPU engine, over real HTTP on 127.0.0.1: the producer's
backend loads each LoRA version as a named adapter (its base once), requests name it and
come back tagged with its version and scored as an in-process engine scores that version;
an engine that lost its adapters (a restart) gets base and adapter again; garbage loads
and requests are refused with a clear error and the served adapter kept."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch
from support.lora import LORA, trained

from core.config import LoraConfig
from core.models import BOS_ID, SEP_ID, is_adapter_tensor, load_model, save_adapter
from producers.engine.backends import HttpBackend
from producers.engine.client import EngineClient
from producers.engine.engine import Engine
from producers.engine.requests import SamplingParams
from producers.engine.server import ServerThread

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

PROMPTS = [[BOS_ID, 5, 6, 7, SEP_ID], [BOS_ID, 1, 2, SEP_ID]]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def lora_engine(seed: int = 0) -> Engine:
    return Engine(load_model("tiny", lora=LORA), model_path="tiny", seed=seed)


def reference_logprobs(state: dict[str, torch.Tensor], outputs: list[Any]) -> list[list[float]]:
    """What an in-process engine holding ``state`` gives the same greedy prompts."""
    engine = lora_engine()
    engine.update_weights(state).result()
    results = engine.generate(PROMPTS, SamplingParams.from_dict(GREEDY))
    assert [r.output_ids for r in results] == [o.output_ids for o in outputs]
    return [r.output_logprobs for r in results]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_producer_loads_each_version_as_a_named_adapter(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    v0 = trained(0)
    v1, v2 = trained(1, base=v0), trained(2, base=v0)
    v3 = trained(3)  # a writer that had to publish a new base: new base objects

    with ServerThread(lora_engine(), weights_dir=weights) as server:
        engine = server.engine

        async def go() -> dict[str, Any]:
            client = EngineClient(server.url, retries=2)
            backend = HttpBackend(client, weights / "producer", lora=LORA, base_model="tiny")
            seen: dict[str, Any] = {}
            rids = iter(range(1000))

            async def generate() -> list[Any]:
                return await backend.generate(
                    PROMPTS, [GREEDY] * 2, [f"r{next(rids)}" for _ in PROMPTS]
                )

            try:
                await backend.load_version(0, v0)
                seen["v0"] = (engine.weight_version, dict(engine.adapters.loaded), await generate())
                await backend.load_version(1, v1)
                seen["v1"] = (engine.weight_version, dict(engine.adapters.loaded), await generate())
                seen["v1 dirs"] = sorted(p.name for p in (weights / "producer").iterdir())
                # the engine restarts: its adapters are gone, it serves its start-up tag
                engine.unload_adapter("v1").result()
                engine.weight_version = "0"
                seen["restarted"] = (engine.weight_version, await generate())
                seen["after restart"] = (engine.weight_version, dict(engine.adapters.loaded))
                await backend.load_version(2, v2)
                await backend.load_version(3, v3)
                seen["v3"] = (engine.weight_version, dict(engine.adapters.loaded), await generate())
            finally:
                await backend.aclose()
            return seen

        seen = run(go())

    tag, loaded, outs = seen["v0"]
    assert tag == "base-v0" and list(loaded) == ["v0"]
    assert [o.weight_version for o in outs] == ["0", "0"]  # the adapter's version, not the tag
    assert [o.logprobs for o in outs] == reference_logprobs(v0, outs)

    tag, loaded, outs = seen["v1"]
    assert tag == "base-v0" and list(loaded) == ["v1"]  # the base kept, v0 unloaded
    assert [o.weight_version for o in outs] == ["1", "1"]
    assert [o.logprobs for o in outs] == reference_logprobs(v1, outs)
    assert [o.logprobs for o in outs] != [o.logprobs for o in seen["v0"][2]]
    assert seen["v1 dirs"] == ["v0", "v0-adapter", "v1-adapter"]  # no second base written

    tag, outs = seen["restarted"]
    assert [o.weight_version for o in outs] == ["1", "1"]
    assert [o.logprobs for o in outs] == reference_logprobs(v1, outs)
    assert seen["after restart"] == ("base-v1", {"v1": str(weights / "producer/v1-adapter")})

    tag, loaded, outs = seen["v3"]
    assert tag == "base-v3" and list(loaded) == ["v3"]
    assert [o.weight_version for o in outs] == ["3", "3"]
    assert [o.logprobs for o in outs] == reference_logprobs(v3, outs)


def _sha(directory: Path) -> str:
    return hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()


def _adapter(directory: Path, state: dict[str, torch.Tensor], lora: LoraConfig = LORA) -> dict:
    save_adapter(state, lora, directory, "tiny")
    return {
        "lora_name": directory.name,
        "lora_path": str(directory),
        "weights_sha256": _sha(directory),
    }


def _garbage_loads(weights: Path, tmp_path: Path) -> list[tuple[dict, int, str]]:
    """Load requests that must be refused: ``(body, status, words of the error)``."""
    good = _adapter(weights / "twin", trained(2))
    other_rank = _adapter(weights / "rank2", trained(0), LoraConfig(rank=2, alpha=8.0))
    bad_config = _adapter(weights / "badconfig", trained(2))
    (weights / "badconfig" / "adapter_config.json").write_bytes(b"\x00{not json")
    foreign = weights / "foreign"
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8.0}))
    safetensors.torch.save_file(
        {"model.embed_tokens.weight": torch.zeros(2, 2)}, foreign / "x.safetensors"
    )
    foreign_body = {"lora_name": "foreign", "lora_path": str(foreign)}
    foreign_body["weights_sha256"] = hashlib.sha256(
        (foreign / "x.safetensors").read_bytes()
    ).hexdigest()
    outside = _adapter(tmp_path / "outside", trained(2))
    return [
        (
            {"lora_path": good["lora_path"], "weights_sha256": good["weights_sha256"]},
            400,
            "lora_name",
        ),
        ({**good, "lora_name": 5}, 400, "lora_name"),
        ({**good, "lora_path": ["x"]}, 400, "lora_path"),
        ({**good, "pinned": "yes"}, 400, "pinned"),
        (
            {k: v for k, v in good.items() if k != "weights_sha256"},
            400,
            "weights_sha256 is required",
        ),
        ({**good, "weights_sha256": "0" * 64}, 400, "sha256"),
        ({**good, "lora_name": "loaded"}, 400, "already loaded"),
        (other_rank, 400, "rank 2"),
        (bad_config, 400, "adapter_config.json"),
        (foreign_body, 400, "not a LoRA adapter tensor"),
        ({**good, "lora_path": str(weights / "missing")}, 400, "adapter_config.json"),
        (outside, 403, "outside the weights directory"),
    ]


def test_garbage_is_refused_and_the_served_adapter_kept(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    served = trained(1)
    with ServerThread(lora_engine(), weights_dir=weights) as server:
        engine, url = server.engine, server.url
        loaded = _adapter(weights / "loaded", served)
        reply = httpx.post(url + "/load_lora_adapter", json=loaded)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {
            "success": True,
            "error_message": None,
            "loaded_adapters": {"loaded": str(weights / "loaded")},
        }
        for body, status, words in _garbage_loads(weights, tmp_path):
            reply = httpx.post(url + "/load_lora_adapter", json=body)
            assert reply.status_code == status, (body, reply.text)
            assert words in reply.text, (body, reply.text)
        assert dict(engine.adapters.loaded) == {"loaded": str(weights / "loaded")}
        assert engine.serving_adapter == "loaded"
        model = engine.model.state_dict()
        assert all(torch.equal(model[n], t) for n, t in served.items() if is_adapter_tensor(n))

        def generate(**fields: Any) -> httpx.Response:
            body = {"input_ids": PROMPTS, "sampling_params": GREEDY, **fields}
            return httpx.post(url + "/generate", json=body)

        for fields, words in [
            ({}, "serves LoRA adapter 'loaded'"),
            ({"lora_path": "nope"}, "'nope' is not loaded"),
            ({"lora_path": ["loaded", "nope"]}, "one at a time"),
            ({"lora_path": 7}, "lora_path must be a str"),
            ({"lora_path": ["loaded"]}, "lora_path has 1 entries for 2 inputs"),
        ]:
            reply = generate(**fields)
            assert reply.status_code == 400 and words in reply.text, (fields, reply.text)
        assert generate(lora_path="loaded").status_code == 200
        assert generate(lora_path=["loaded", "loaded"]).status_code == 200
        assert httpx.get(url + "/health_generate").status_code == 200

        for body, words in [({}, "lora_name is required"), ({"lora_name": "nope"}, "not loaded")]:
            reply = httpx.post(url + "/unload_lora_adapter", json=body)
            assert reply.status_code == 400 and words in reply.text, (body, reply.text)
        second = _adapter(weights / "second", trained(3))
        assert httpx.post(url + "/load_lora_adapter", json=second).status_code == 200
        reply = generate(lora_path="loaded")
        assert reply.status_code == 400 and "this engine serves 'second'" in reply.text
        reply = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "second"})
        assert reply.status_code == 200
        assert reply.json()["loaded_adapters"] == {"loaded": str(weights / "loaded")}
        # the served one unloaded: the base model again, bit for bit, naming no adapter
        base = generate().json()
        assert generate(lora_path="second").status_code == 400
        reply = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "loaded"})
        assert reply.status_code == 200 and reply.json()["loaded_adapters"] == {}
    reference = lora_engine().generate(PROMPTS, SamplingParams.from_dict(GREEDY))
    assert [b["output_ids"] for b in base] == [r.output_ids for r in reference]


def test_an_engine_without_a_lora_slot_says_so(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    plain = Engine(load_model("tiny"), model_path="tiny", seed=0)
    with ServerThread(plain, weights_dir=weights) as server:
        body = _adapter(weights / "a", trained(1))
        reply = httpx.post(server.url + "/load_lora_adapter", json=body)
        assert reply.status_code == 400 and "no LoRA slot" in reply.text
        reply = httpx.post(
            server.url + "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "a"},
        )
        assert reply.status_code == 400 and "no LoRA slot" in reply.text
