"""Several engines behind SGLang's router (``sglang-router``), reached as one.

The router balances ``/generate`` over its engines but forwards only the single-prompt
form (it refuses SGLang's batch form), and it does not route ``/update_weights_from_disk``,
LoRA loads or ``/abort_request`` at all. ``RouterClient`` therefore sends one
``/generate`` a prompt through the router, all at once, and sends weight updates, adapter
loads and aborts to every engine the router lists (``GET /workers``), asked again at each
call so an engine added to the router gets the next version. A version counts as loaded
only when every engine loaded it; an engine that fails keeps its old weights, and the
error names it. Records stay truthful either way: each answer carries the weight version
of the engine that generated it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from producers.engine.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    EngineResponseError,
    GenerateOutput,
)
from producers.engine.streaming import TokenProgress


class RouterClient:
    """The router at ``url`` and the engines behind it, with one set of client settings
    (timeouts, retries, API key: the router passes the caller's key on to its engines)."""

    def __init__(self, url: str, **settings: Any) -> None:
        self.router = EngineClient(url, **settings)
        self.url = self.router.url
        self._settings = settings
        self._engines: dict[str, EngineClient] = {}

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.router.aclose()
        await asyncio.gather(*(engine.aclose() for engine in self._engines.values()))
        self._engines.clear()

    async def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
        lora_path: str | None = None,
    ) -> list[GenerateOutput]:
        """One ``/generate`` a prompt through the router, in the prompts' order."""
        n = len(input_ids)
        params = [sampling_params] * n if isinstance(sampling_params, dict) else sampling_params
        names = [None] * n if rids is None else list(rids)
        if len(params) != n or len(names) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling_params, {len(names)} rids")
        return list(
            await asyncio.gather(
                *(
                    self.router.generate_one(
                        ids, p, rid=rid, return_logprob=return_logprob, lora_path=lora_path
                    )
                    for ids, p, rid in zip(input_ids, params, names, strict=True)
                )
            )
        )

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        on_tokens: TokenProgress,
        *,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateOutput:
        """One streamed ``/generate`` through the router (which passes the stream on)."""
        return await self.router.generate_stream(
            input_ids, sampling_params, on_tokens, rid=rid, lora_path=lora_path
        )

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort on every engine (the router does not know which one holds ``rid``)."""
        engines = await self.engines()
        await asyncio.gather(*(e.abort(rid, abort_all=abort_all) for e in engines))

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        sha256: str | None = None,
    ) -> dict[str, Any]:
        """Every engine loads ``model_path`` (which each must see: the same host or a
        shared volume); raises ``EngineRequestError`` naming those that did not."""
        return await self._on_every_engine(
            "update_weights_from_disk",
            lambda e: e.update_weights_from_disk(
                model_path, weight_version, abort_all_requests=abort_all_requests, sha256=sha256
            ),
        )

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, sha256: str | None = None
    ) -> dict[str, Any]:
        """Every engine loads the adapter (the router does not route LoRA loads)."""
        return await self._on_every_engine(
            "load_lora_adapter", lambda e: e.load_lora_adapter(lora_name, lora_path, sha256=sha256)
        )

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self._on_every_engine(
            "unload_lora_adapter", lambda e: e.unload_lora_adapter(lora_name)
        )

    async def _on_every_engine(
        self, what: str, call: Callable[[EngineClient], Awaitable[Any]]
    ) -> dict[str, Any]:
        engines = await self.engines()
        results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
        failed = [
            f"{e.url}: {r}"
            for e, r in zip(engines, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            raise EngineRequestError(
                400,
                f"{what} reached {len(engines) - len(failed)} of {len(engines)} engines "
                f"behind {self.url}; failed: {'; '.join(failed)}",
            )
        return {"success": True, "engines": len(engines)}

    async def model_info(self) -> dict[str, Any]:
        return await self.router.model_info()

    async def check_model(self, expected: str) -> dict[str, Any]:
        """``get_model_info`` after checking that every engine serves ``expected``."""
        for engine in await self.engines():
            await engine.check_model(expected)
        return await self.router.model_info()

    async def health(self) -> bool:
        return await self.router.health()

    async def engines(self) -> list[EngineClient]:
        """A client for each engine the router lists now."""
        try:
            data = await self.router.get("/workers")
        except EngineRequestError as exc:
            raise EngineRequestError(
                exc.status, f"{self.url}/workers: {exc}; is it an SGLang router?"
            ) from exc
        workers = data.get("workers") if isinstance(data, dict) else None
        if not isinstance(workers, list) or not all(
            isinstance(w, dict) and isinstance(w.get("url"), str) for w in workers
        ):
            raise EngineResponseError(
                f"{self.url}/workers answered {str(data)[:200]!r}: is it an SGLang router?"
            )
        if not workers:
            raise EngineError(f"the router at {self.url} lists no engines")
        urls = [w["url"].rstrip("/") for w in workers]
        for url in urls:
            if url not in self._engines:
                self._engines[url] = EngineClient(url, **self._settings)
        return [self._engines[url] for url in urls]
