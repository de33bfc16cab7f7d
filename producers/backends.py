"""How the rollout worker reaches its engine: in-process, or over SGLang's HTTP API.

Both backends return the same checked ``GenerateOutput`` (the in-process one builds the
exact JSON object the server would send and parses it with the client's checks), so the
worker has one code path. New policy versions arrive as ``(version, state_dict)``:

- ``LocalBackend`` hot-swaps the state dict into the engine between batches.
- ``HttpBackend`` writes ``<weights_dir>/v<version>/model.safetensors`` and asks the
  engine to ``/update_weights_from_disk`` it with ``weight_version=str(version)`` and the
  file's sha256 (the engine loads nothing else); the engine must see ``weights_dir``
  (same host or a shared volume) below its own ``[producers.engine] weights_dir``. The
  model's other files (config, generation config, tokenizer: ``core.model_files``) are
  copied next to the weights from ``template_dir``, so each version directory is a
  complete Hugging Face checkpoint, as a real SGLang server needs.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from producers.client import EngineClient, GenerateOutput, parse_generate_response
from producers.config import EngineConfig, RolloutConfig
from producers.router import RouterClient

#: Where ``http_backend`` keeps the model's non-weight files, below the weights directory.
MODEL_FILES_DIR = "model-files"


class Backend(Protocol):
    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[dict[str, Any]],
        rids: Sequence[str],
    ) -> list[GenerateOutput]: ...

    async def abort(self, rids: Sequence[str]) -> None: ...

    async def load_version(self, version: int, state_dict: Mapping[str, Any]) -> None: ...

    async def model_info(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


class LocalBackend:
    """An ``Engine`` in this process (its scheduler thread does the compute)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine.start()

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[dict[str, Any]],
        rids: Sequence[str],
    ) -> list[GenerateOutput]:
        from producers.engine_requests import SamplingParams

        items = [
            (list(p), SamplingParams.from_dict(s), rid, True)
            for p, s, rid in zip(prompts, sampling, rids, strict=True)
        ]
        futures = self.engine.submit_many(items)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        data = [r.to_sglang(self.engine.decode(r.output_ids)) for r in results]
        return parse_generate_response(data, len(items), True)

    async def abort(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    async def load_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        await asyncio.wrap_future(self.engine.update_weights(state_dict, str(version)))

    async def model_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


class HttpBackend:
    """An engine behind SGLang's native HTTP API (``EngineClient``)."""

    def __init__(
        self,
        client: EngineClient | RouterClient,
        weights_dir: Path,
        *,
        template_dir: Path | None = None,
        tokenizer: Any = None,
        keep_versions: int = 2,
    ) -> None:
        self.client = client
        self.weights_dir = Path(weights_dir)
        self.template_dir = template_dir
        self.tokenizer = tokenizer  # the served model's, for tasks that render prompts
        self.keep_versions = keep_versions

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[dict[str, Any]],
        rids: Sequence[str],
    ) -> list[GenerateOutput]:
        return await self.client.generate(prompts, list(sampling), rids=rids, return_logprob=True)

    async def abort(self, rids: Sequence[str]) -> None:
        await asyncio.gather(*(self.client.abort(rid) for rid in rids))

    async def load_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        directory = self.weights_dir / f"v{version}"
        sha256 = await asyncio.to_thread(self._write, state_dict, directory)
        await self.client.update_weights_from_disk(
            str(directory), weight_version=str(version), sha256=sha256
        )
        await asyncio.to_thread(self._prune, version)

    def _write(self, state_dict: Mapping[str, Any], directory: Path) -> str:
        """Write the version; its sha256 (computed from the written bytes)."""
        from producers.engine_weights import save_weights, weights_sha256

        save_weights(state_dict, directory)
        if self.template_dir is not None:
            for item in Path(self.template_dir).iterdir():
                if item.is_file() and item.suffix != ".safetensors":
                    shutil.copy2(item, directory / item.name)
        return weights_sha256(directory)

    def _prune(self, current: int) -> None:
        versions = sorted(
            int(p.name[1:])
            for p in self.weights_dir.glob("v*")
            if p.is_dir() and p.name[1:].isdigit()
        )
        for old in versions:
            if old < current and old not in versions[-self.keep_versions :]:
                shutil.rmtree(self.weights_dir / f"v{old}", ignore_errors=True)

    async def model_info(self) -> dict[str, Any]:
        return await self.client.model_info()

    async def aclose(self) -> None:
        await self.client.aclose()


async def local_backend(
    engine_config: EngineConfig, cache_dir: Path, initial_version: int
) -> LocalBackend:
    """An engine in this process (built off the loop: loading a model takes a while),
    serving ``initial_version``."""
    from producers.inference_engine import engine_from_config

    engine = await asyncio.to_thread(engine_from_config, engine_config, cache_dir)
    engine.weight_version = str(initial_version)
    return LocalBackend(engine)


async def http_backend(
    rollout: RolloutConfig, engine: EngineConfig, weights_dir: Path, cache_dir: Path
) -> HttpBackend:
    """The engine (or router: ``rollout.engine_router``) at ``rollout.engine_url``,
    checked to serve ``engine.model`` (or ``rollout.expected_model``) and called with
    ``engine.api_key``; new versions go through ``weights_dir``, each with the model's
    files from ``weights_dir/model-files``; ``tokenizer`` is that model's, resolved from
    the same spec as its files."""
    from core.model_files import write_model_files
    from core.models import load_tokenizer

    key = engine.api_key.get_secret_value() if engine.api_key is not None else None
    settings: dict[str, Any] = {
        "connect_timeout": rollout.connect_timeout_s,
        "request_timeout": rollout.request_timeout_s,
        "retries": rollout.retries,
        "retry_max_wait": rollout.retry_max_wait_s,
        "api_key": key,
    }
    url = rollout.engine_url or ""
    client = (
        RouterClient(url, **settings) if rollout.engine_router else EngineClient(url, **settings)
    )
    await client.check_model(rollout.expected_model or engine.model)
    template = Path(weights_dir) / MODEL_FILES_DIR
    await asyncio.to_thread(write_model_files, engine.model, template, cache_dir)
    tokenizer = await asyncio.to_thread(load_tokenizer, engine.model, cache_dir)
    return HttpBackend(client, weights_dir, template_dir=template, tokenizer=tokenizer)
