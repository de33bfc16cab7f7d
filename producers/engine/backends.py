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

  In a LoRA run (``lora``) a version goes through SGLang's dynamic LoRA API instead: its
  adapter is written as PEFT saves one (``<weights_dir>/v<version>-adapter``), loaded with
  ``/load_lora_adapter`` as ``v<version>`` (with its sha256) and named by every request
  (``lora_path``); the adapter before it is unloaded. The base goes through
  ``/update_weights_from_disk`` (plain names, tagged ``base-v<version>``) only when it
  changed: the first version, a writer that had to publish a new base, or an engine that
  lost its adapters (a restart: a request it refuses, and a tag that is not ours, makes
  the backend load base and adapter again and retry once). Since loading an adapter leaves
  an engine's ``weight_version`` as it was, answers tagged with the base's tag are tagged
  with the adapter's version instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from core.config import LoraConfig
from producers.engine.client import (
    EngineClient,
    EngineRequestError,
    GenerateOutput,
    parse_generate_response,
)
from producers.engine.config import EngineConfig, EngineConnection
from producers.engine.router import RouterClient
from producers.engine.streaming import TokenFeed, TokenProgress
from producers.engine.weights import AppliedTensors

logger = logging.getLogger(__name__)

#: Where ``http_backend`` keeps the model's non-weight files, below the weights directory.
MODEL_FILES_DIR = "model-files"


class Backend(Protocol):
    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[dict[str, Any]],
        rids: Sequence[str],
        *,
        on_tokens: TokenProgress | None = None,
    ) -> list[GenerateOutput]:
        """The answers; with ``on_tokens`` (one prompt) it is told of the tokens so far as
        the engine draws them, the last ones left to the answer."""
        ...

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
        *,
        on_tokens: TokenProgress | None = None,
    ) -> list[GenerateOutput]:
        from producers.engine.requests import SamplingParams

        items = [
            (list(p), SamplingParams.from_dict(s), rid, True)
            for p, s, rid in zip(prompts, sampling, rids, strict=True)
        ]
        if on_tokens is None:
            futures = self.engine.submit_many(items)
        else:
            _one_prompt(prompts)
            feed = TokenFeed()
            futures = self.engine.submit_many(items, listeners=[feed])
            async for ids, logprobs in feed.updates(futures[0]):
                on_tokens(ids, logprobs)
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
        lora: LoraConfig | None = None,
        base_model: str = "",
    ) -> None:
        self.client = client
        self.weights_dir = Path(weights_dir)
        self.template_dir = template_dir
        self.tokenizer = tokenizer  # the served model's, for tasks that render prompts
        self.keep_versions = keep_versions
        self.lora = lora
        self.base_model = base_model  # what an adapter's config names as its base
        self.adapter: LoadedAdapter | None = None  # the one requests name
        self._base = AppliedTensors()  # the base tensors the engine was given
        self._reloading = asyncio.Lock()

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[dict[str, Any]],
        rids: Sequence[str],
        *,
        on_tokens: TokenProgress | None = None,
    ) -> list[GenerateOutput]:
        adapter = self.adapter
        if on_tokens is not None:
            _one_prompt(prompts)
        if adapter is None:
            if on_tokens is not None:
                return [
                    await self.client.generate_stream(
                        prompts[0], sampling[0], on_tokens, rid=rids[0]
                    )
                ]
            return await self.client.generate(
                prompts, list(sampling), rids=rids, return_logprob=True
            )
        try:
            outputs = await self._generate_with(adapter, prompts, sampling, rids, on_tokens)
        except EngineRequestError:
            async with self._reloading:
                if self.adapter is adapter and not await self._lost(adapter):
                    raise
                if self.adapter is adapter:  # no other call has loaded it again yet
                    logger.warning(
                        "engine lost LoRA adapter %s (restarted?): loading it again",
                        adapter.name,
                    )
                    await self._load_adapter_version(adapter.version, adapter.state, again=True)
            adapter = self.adapter
            outputs = await self._generate_with(adapter, prompts, sampling, rids, on_tokens)
        return outputs

    async def _generate_with(
        self,
        adapter: LoadedAdapter,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[dict[str, Any]],
        rids: Sequence[str],
        on_tokens: TokenProgress | None = None,
    ) -> list[GenerateOutput]:
        if on_tokens is not None:
            outputs = [
                await self.client.generate_stream(
                    prompts[0], sampling[0], on_tokens, rid=rids[0], lora_path=adapter.name
                )
            ]
        else:
            outputs = await self.client.generate(
                prompts, list(sampling), rids=rids, return_logprob=True, lora_path=adapter.name
            )
        return [
            dataclasses.replace(out, weight_version=str(adapter.version))
            if out.weight_version == adapter.base_tag
            else out
            for out in outputs
        ]

    async def _lost(self, adapter: LoadedAdapter) -> bool:
        """Whether the engine no longer serves the base it was given (a restart)."""
        info = await self.client.model_info()
        return str(info.get("weight_version")) != adapter.base_tag

    async def abort(self, rids: Sequence[str]) -> None:
        await asyncio.gather(*(self.client.abort(rid) for rid in rids))

    async def load_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        if self.lora is not None:
            await self._load_adapter_version(version, state_dict)
            return
        directory = self.weights_dir / f"v{version}"
        sha256 = await asyncio.to_thread(self._write, state_dict, directory)
        await self.client.update_weights_from_disk(
            str(directory), weight_version=str(version), sha256=sha256
        )
        await asyncio.to_thread(self._prune, version)

    async def _load_adapter_version(
        self, version: int, state_dict: Mapping[str, Any], *, again: bool = False
    ) -> None:
        """Load a LoRA version: its base if the engine lacks it, then its adapter."""
        from core.models import is_adapter_tensor, plain_names

        assert self.lora is not None
        previous = self.adapter
        base = {n: t for n, t in state_dict.items() if not is_adapter_tensor(n)}
        again = again or (previous is not None and previous.version == version)
        if again:
            self._base.forget()
        base_tag = previous.base_tag if previous is not None else ""
        if self._base.changed(base):
            base_tag = f"base-v{version}"
            directory = self.weights_dir / f"v{version}"
            sha256 = await asyncio.to_thread(self._write, plain_names(base), directory)
            await self.client.update_weights_from_disk(
                str(directory), weight_version=base_tag, sha256=sha256
            )
            self._base.record(base)
        name = f"v{version}"
        directory = self.weights_dir / f"v{version}-adapter"
        sha256 = await asyncio.to_thread(self._write_adapter, state_dict, directory)
        if again:  # it may still be loaded (a reload the worker asked for)
            await self._unload(name)
        await self.client.load_lora_adapter(name, str(directory), sha256=sha256)
        self.adapter = LoadedAdapter(name, version, base_tag, state_dict)
        if previous is not None and previous.name != name:
            await self._unload(previous.name)
        await asyncio.to_thread(self._prune, version)

    async def _unload(self, name: str) -> None:
        try:
            await self.client.unload_lora_adapter(name)
        except EngineRequestError as exc:  # not loaded (any more): nothing to free
            logger.info("LoRA adapter %s not unloaded: %s", name, exc)

    def _write(self, state_dict: Mapping[str, Any], directory: Path) -> str:
        """Write the version; its sha256 (computed from the written bytes)."""
        from producers.engine.weights import save_weights, weights_sha256

        save_weights(state_dict, directory)
        if self.template_dir is not None:
            for item in Path(self.template_dir).iterdir():
                if item.is_file() and item.suffix != ".safetensors":
                    shutil.copy2(item, directory / item.name)
        return weights_sha256(directory)

    def _write_adapter(self, state_dict: Mapping[str, Any], directory: Path) -> str:
        """Write a LoRA version's adapter as PEFT saves one; its safetensors' sha256."""
        from core.models import save_adapter
        from producers.engine.weights import weights_sha256

        assert self.lora is not None
        save_adapter(state_dict, self.lora, directory, self.base_model)
        return weights_sha256(directory)

    def _prune(self, current: int) -> None:
        """Remove the directories (checkpoints, adapters) of versions older than the last
        ``keep_versions``: the engine has loaded them; a reload writes them again."""
        versions = sorted(
            {
                int(p.name[1:].removesuffix("-adapter"))
                for p in self.weights_dir.glob("v*")
                if p.is_dir() and p.name[1:].removesuffix("-adapter").isdigit()
            }
        )
        for old in versions:
            if old < current and old not in versions[-self.keep_versions :]:
                shutil.rmtree(self.weights_dir / f"v{old}", ignore_errors=True)
                shutil.rmtree(self.weights_dir / f"v{old}-adapter", ignore_errors=True)

    async def model_info(self) -> dict[str, Any]:
        return await self.client.model_info()

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclasses.dataclass(frozen=True)
class LoadedAdapter:
    """A LoRA version the engine holds: its adapter's name there, the tag of the base it
    runs on, and its state (to load both again into an engine that lost them)."""

    name: str
    version: int
    base_tag: str
    state: Mapping[str, Any]


def _one_prompt(prompts: Sequence[Sequence[int]]) -> None:
    if len(prompts) != 1:
        raise ValueError(f"a streamed generation takes one prompt, got {len(prompts)}")


async def local_backend(
    engine_config: EngineConfig, cache_dir: Path, initial_version: int
) -> LocalBackend:
    """An engine in this process (built off the loop: loading a model takes a while),
    serving ``initial_version``."""
    from producers.engine.engine import engine_from_config

    engine = await asyncio.to_thread(engine_from_config, engine_config, cache_dir)
    engine.weight_version = str(initial_version)
    return LocalBackend(engine)


async def http_backend(
    rollout: EngineConnection,
    engine: EngineConfig,
    weights_dir: Path,
    cache_dir: Path,
    lora: LoraConfig | None = None,
) -> HttpBackend:
    """The engine (or router: ``rollout.engine_router``) at ``rollout.engine_url``,
    checked to serve ``engine.model`` (or ``rollout.expected_model``) and called with
    ``engine.api_key``; new versions go through ``weights_dir``, each with the model's
    files from ``weights_dir/model-files``, as adapters in a LoRA run (``lora``);
    ``tokenizer`` is that model's, resolved from the same spec as its files."""
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
    return HttpBackend(
        client,
        weights_dir,
        template_dir=template,
        tokenizer=tokenizer,
        lora=lora,
        base_model=rollout.expected_model or engine.model,
    )
