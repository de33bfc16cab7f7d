"""HTTP server for ``Engine``: the subset of SGLang's native API that RL rollouts need.

Followed release: **SGLang v0.5.23** (``python/sglang/srt/entrypoints/http_server.py`` and
``managers/io_struct.py``). Field names are SGLang's, so a real SGLang server on a GPU is
a drop-in for the same client:

- ``POST /generate`` (also PUT): ``input_ids`` (one list, or a batch of lists), ``rid``
  (str or list), ``sampling_params`` (object, or one per input), ``return_logprob`` (bool
  or list). Answers one object, or a list for a batch: ``{"text", "output_ids",
  "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "weight_version", "e2e_latency", "output_token_logprobs"}}`` where
  ``output_token_logprobs`` is ``[[logprob, token_id, null], ...]`` and ``finish_reason``
  is ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message": ...}``. With ``"stream": true`` (one prompt) the answer
  is SGLang's server-sent events: a ``data: {...}`` object each time tokens were drawn,
  holding the text, ``output_ids`` and ``output_token_logprobs`` so far (cumulative, as
  SGLang sends them unless started with ``--incremental-streaming-output``) and
  ``finish_reason`` null, the whole answer last, then ``data: [DONE]``.
- ``POST /abort_request``: ``{"rid": ..., "abort_all": false}``; answers 200, empty body.
  The aborted ``/generate`` returns what it generated so far, finish type ``abort``.
- ``POST /update_weights_from_disk``: ``{"model_path", "load_format", "abort_all_requests",
  "weight_version", "weights_sha256"}``; answers ``{"success", "message",
  "num_paused_requests"}`` (400 when it fails; the engine keeps its old weights). Runs
  between batches. ``weights_sha256`` (ours, not SGLang's; required) is the sha256 of the
  directory's safetensors bytes: the engine loads only the file its caller wrote. A
  ``model_path`` outside the engine's weights directory is answered **403**.
- ``GET /model_info`` (and the older ``/get_model_info``): ``{"model_path",
  "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version"}``.
- ``GET /health`` and ``/health_generate``: 200 while the scheduler runs (the latter
  generates one token), 503 otherwise. ``GET /server_info`` (and ``/get_server_info``):
  engine settings and counters (not SGLang's fields; ``busy_s``: seconds spent computing
  batches and weight updates).
- ``POST /flush_cache``: forgets the prefix cache between batches.
- ``POST /load_lora_adapter``: ``{"lora_name", "lora_path", "pinned", "weights_sha256"}``
  and ``POST /unload_lora_adapter``: ``{"lora_name"}``; both answer ``{"success",
  "error_message", "loaded_adapters"}`` (400 when they fail). ``/generate`` names the
  adapter in ``lora_path`` (one for the whole body). An engine with a LoRA slot only
  (``producers.engine.adapters``: one adapter served at a time, the last one loaded); the
  path and hash rules are those of ``/update_weights_from_disk``.

SGLang's router (``sglang-router``) forwards ``/generate`` with ``model``,
``return_hidden_states``, ``background``, ``no_logs``, ``return_bytes`` and
``return_entropy`` set to their defaults: accepted at those values, 400 at any other.

Every body is read by its pydantic model (``producers.engine.requests``), strict types
and limits declared: garbage is a 400 naming the field. The control bodies ignore fields
they do not know, as SGLang's do. Every sampling parameter is checked by type and range
before the request is queued (400 naming ``sampling_params.<field>``), so a bad value
never fails the batch other clients share; a ``/generate`` whose prompts plus
``max_new_tokens`` exceed ``max_request_tokens`` tokens is answered **413** with the
numbers.

When the engine already holds ``max_pending`` requests (queued or running), ``/generate``
answers **503** with a ``Retry-After`` header (whole seconds) and queues nothing; the
client retries after that delay. ``/health_generate`` answers 503 then too.

With an API key (``api_key``, SGLang's ``--api-key``) every endpoint but ``/health``
answers **401** unless the request carries ``Authorization: Bearer <key>``; without one
the server refuses to bind anything but loopback (``producers.engine.auth``).

Not implemented (answered 400, never silently ignored): text prompts, a streamed batch, top
log-probs, input-token log-probs, penalties, constrained decoding, ``n`` > 1.
Errors use SGLang's body ``{"object": "error", "message", "type", "code"}``.

The model runs in the engine's scheduler thread; handlers only await its futures, so the
event loop stays responsive while a batch computes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from producers.engine.adapters import AdapterRefused
from producers.engine.auth import AccessRefused, check_bind, check_key, weights_path
from producers.engine.engine import Engine
from producers.engine.request_checks import (
    DEFAULT_MAX_REQUEST_TOKENS,
    RequestRefused,
    check_budget,
    json_object,
    refusal,
)
from producers.engine.requests import (
    AbortBody,
    EngineBusy,
    GenerateBody,
    LoadLoraBody,
    RequestError,
    SamplingParams,
    UnloadLoraBody,
    UpdateWeightsBody,
    control_body,
)
from producers.engine.streaming import TokenFeed

logger = logging.getLogger(__name__)

SGLANG_RELEASE = "v0.5.23"
"""The SGLang release whose native HTTP API this server follows."""

_ENGINE_KEY = web.AppKey("engine", Engine)
_BUDGET_KEY = web.AppKey("max_request_tokens", int)
_API_KEY = web.AppKey("api_key", str)
_WEIGHTS_DIR = web.AppKey("weights_dir", Path)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


_ERROR_TYPES = {401: "Unauthorized", 403: "Forbidden"}


def _error(message: str, status: int = 400) -> web.Response:
    kind = _ERROR_TYPES.get(status, "BadRequest")
    body = {"object": "error", "message": message, "type": kind, "code": status}
    response = _json(body, status)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


@web.middleware
async def _require_key(request: web.Request, handler: Any) -> web.StreamResponse:
    """401 before any handler runs unless the request carries the API key."""
    try:
        check_key(request.path, request.headers.get("Authorization"), request.app.get(_API_KEY))
    except AccessRefused as exc:
        return _error(str(exc), exc.status)
    response: web.StreamResponse = await handler(request)
    return response


def _busy(exc: EngineBusy) -> web.Response:
    """503 with ``Retry-After`` in whole seconds (the HTTP form), at least 1."""
    body = {"object": "error", "message": str(exc), "type": "ServiceUnavailable", "code": 503}
    response = _json(body, 503)
    response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return response


async def _body(request: web.Request) -> dict[str, Any]:
    return json_object(await request.read(), RequestError)


@dataclass(frozen=True)
class _Item:
    input_ids: list[int]
    rid: str | None
    params: SamplingParams
    return_logprob: bool


@dataclass(frozen=True)
class GenerateCall:
    """A ``/generate`` body, checked: its requests, whether it was a batch, the LoRA
    adapter they name (``lora_path``: one for the whole body, as this engine serves one),
    and whether the answer is streamed."""

    items: list[_Item]
    batch: bool
    adapter: str | None
    stream: bool = False


def parse_generate(body: dict[str, Any]) -> GenerateCall:
    """The checked form of a ``/generate`` body, or ``RequestError`` naming the field."""
    try:
        call = GenerateBody.model_validate(body)
    except ValidationError as exc:
        raise RequestError(refusal(exc)) from exc
    rids = call.per_input("rid")
    if len(set(r for r in rids if r is not None)) < sum(r is not None for r in rids):
        raise RequestError("rid values must be unique")
    adapters = set(call.per_input("lora_path"))
    if len(adapters) > 1:
        raise RequestError(
            f"lora_path names {len(adapters)} adapters: this engine serves one at a time"
        )
    prompts = call.input_ids if call.batch else [call.input_ids]
    items = [
        _Item(prompt, rid, SamplingParams.from_dict(p), bool(lp))
        for prompt, rid, p, lp in zip(
            prompts, rids, call.per_input("sampling_params"), call.per_input("return_logprob"),
            strict=True,
        )
    ]  # fmt: skip
    return GenerateCall(items, call.batch, adapters.pop(), call.stream)


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[_ENGINE_KEY]
    try:
        call = parse_generate(await _body(request))
        items = call.items
        check_budget(
            [len(i.input_ids) for i in items],
            [i.params.max_new_tokens for i in items],
            engine.context_length,
            request.app[_BUDGET_KEY],
        )
        rids = [item.rid or uuid.uuid4().hex for item in items]
        feed = TokenFeed() if call.stream else None
        futures = engine.submit_many(
            [
                (i.input_ids, i.params, rid, i.return_logprob)
                for i, rid in zip(items, rids, strict=True)
            ],
            call.adapter,
            listeners=None if feed is None else [feed],
        )
    except RequestError as exc:
        return _error(str(exc))
    except RequestRefused as exc:
        return _error(str(exc), exc.status)
    except EngineBusy as exc:
        return _busy(exc)
    if feed is not None:
        return await _stream(request, items[0], rids[0], futures[0], feed)
    try:
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except asyncio.CancelledError:  # the client went away: free the engine
        for rid in rids:
            engine.abort(rid)
        raise
    out = [r.to_sglang(engine.decode(r.output_ids)) for r in results]
    return _json(out if call.batch else out[0])


def _event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _stream(
    request: web.Request, item: _Item, rid: str, future: Future, feed: TokenFeed
) -> web.StreamResponse:
    """SGLang's stream: a ``data:`` event each time tokens were drawn, with the text, ids
    and log-probs so far (SGLang's default, cumulative), ``finish_reason`` null; the last
    one is the whole answer; then ``data: [DONE]``. A client that leaves aborts it."""
    engine = request.app[_ENGINE_KEY]
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        async for ids, logprobs in feed.updates(future):
            meta: dict[str, Any] = {
                "id": rid,
                "finish_reason": None,
                "prompt_tokens": len(item.input_ids),
                "completion_tokens": len(ids),
                "weight_version": engine.weight_version,
            }
            if item.return_logprob:
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(logprobs, ids, strict=True)
                ]
            await response.write(
                _event({"text": engine.decode(ids), "output_ids": ids, "meta_info": meta})
            )
        try:
            result = future.result()
        except Exception as exc:  # the batch failed: SGLang's error event
            await response.write(_event({"error": {"message": str(exc)}}))
        else:
            await response.write(_event(result.to_sglang(engine.decode(result.output_ids))))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:  # the client went away: free the engine
        engine.abort(rid)
    except asyncio.CancelledError:
        engine.abort(rid)
        raise
    return response


async def abort_request(request: web.Request) -> web.Response:
    try:
        body = control_body(AbortBody, await _body(request))
    except RequestError as exc:
        return _error(str(exc))
    request.app[_ENGINE_KEY].abort(body.rid or None, abort_all=body.abort_all)
    return web.Response(status=200)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    try:
        body = control_body(UpdateWeightsBody, await _body(request))
        path = weights_path(body.model_path, request.app.get(_WEIGHTS_DIR))
    except RequestError as exc:
        return _error(str(exc))
    except AccessRefused as exc:
        logger.warning("update_weights_from_disk refused: %s", exc)
        return _error(str(exc), exc.status)
    version, model_path = body.weight_version, body.model_path
    future = engine.update_weights_from_disk(
        path, version, abort_all_requests=body.abort_all_requests, sha256=body.weights_sha256
    )
    try:
        paused = await asyncio.wrap_future(future)
    except Exception as exc:  # reported to the caller; the old weights stay
        logger.warning("update_weights_from_disk(%s) failed: %s", model_path, exc)
        content = {"success": False, "message": f"Failed to update weights: {exc}"}
        return _json({**content, "num_paused_requests": 0}, 400)
    message = "Succeeded to update model weights."
    if version is not None:
        message += f" Weight version updated to {version}."
    return _json({"success": True, "message": message, "num_paused_requests": paused})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Read, check and serve a named adapter (its directory below the weights
    directory, its bytes those of ``weights_sha256``); the old one stays on failure."""
    engine = request.app[_ENGINE_KEY]
    try:
        body = control_body(LoadLoraBody, await _body(request))
        name, path, sha256 = body.lora_name, body.lora_path, body.weights_sha256
        directory = weights_path(path, request.app.get(_WEIGHTS_DIR))
        tensors = await asyncio.to_thread(engine.adapter_slot().read, directory, sha256)
        await asyncio.wrap_future(engine.load_adapter(name, directory, tensors))
    except RequestError as exc:
        return _error(str(exc))
    except AccessRefused as exc:
        logger.warning("load_lora_adapter refused: %s", exc)
        return _error(str(exc), exc.status)
    except AdapterRefused as exc:
        return _lora_answer(engine, str(exc))
    return _lora_answer(engine)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    try:
        body = control_body(UnloadLoraBody, await _body(request))
        await asyncio.wrap_future(engine.unload_adapter(body.lora_name))
    except RequestError as exc:
        return _error(str(exc))
    except AdapterRefused as exc:
        return _lora_answer(engine, str(exc))
    return _lora_answer(engine)


def _lora_answer(engine: Engine, error: str | None = None) -> web.Response:
    """SGLang's answer to a LoRA load or unload (400 with ``success`` false on failure)."""
    loaded = dict(engine.adapters.loaded) if engine.adapters is not None else {}
    body = {"success": error is None, "error_message": error, "loaded_adapters": loaded}
    return _json(body, 200 if error is None else 400)


async def get_model_info(request: web.Request) -> web.Response:
    return _json(request.app[_ENGINE_KEY].model_info())


async def get_server_info(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    stats = engine.stats
    return _json(
        {
            "version": f"rollstream-engine (SGLang {SGLANG_RELEASE} API subset)",
            "model_path": engine.model_path,
            "max_batch_size": engine.max_batch_size,
            "batch_wait_s": engine.batch_wait_s,
            "context_length": engine.context_length,
            "requests": stats.requests,
            "batches": stats.batches,
            "tokens_generated": stats.tokens_generated,
            "aborted": stats.aborted,
            "max_batch_seen": stats.max_batch_seen,
            "max_pending": engine.max_pending,
            "max_request_tokens": request.app[_BUDGET_KEY],
            "rejected_busy": stats.rejected_busy,
            "busy_s": stats.busy_s,
        }
    )


async def flush_cache(request: web.Request) -> web.Response:
    """Drop the prefix cache (SGLang's answer: 200 and a line of text)."""
    await asyncio.wrap_future(request.app[_ENGINE_KEY].flush_cache())
    return web.Response(text="Cache flushed.\n")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[_ENGINE_KEY].alive else 503)


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    if not engine.alive:
        return web.Response(status=503)
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    try:
        future = engine.submit([0], params, adapter=engine.serving_adapter)
    except EngineBusy:
        return web.Response(status=503)
    try:
        await asyncio.wait_for(asyncio.wrap_future(future), timeout=20)
    except TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


def make_app(
    engine: Engine,
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
    *,
    api_key: str | None = None,
    weights_dir: Path | None = None,
) -> web.Application:
    """The aiohttp application serving ``engine`` (which must be started); a
    ``/generate`` whose prompts plus ``max_new_tokens`` exceed ``max_request_tokens`` is
    answered 413. With ``api_key`` every endpoint but ``/health`` needs it; weights load
    only from below ``weights_dir`` (None: from nowhere)."""
    if max_request_tokens < 1:
        raise ValueError(f"max_request_tokens must be >= 1, got {max_request_tokens}")
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_require_key])
    app[_ENGINE_KEY] = engine
    app[_BUDGET_KEY] = max_request_tokens
    if api_key:
        app[_API_KEY] = api_key
    if weights_dir is not None:
        app[_WEIGHTS_DIR] = Path(weights_dir)
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
    # SGLang's current names and the older /get_* ones (the router asks for both)
    for name, handler in (("model_info", get_model_info), ("server_info", get_server_info)):
        app.router.add_get(f"/{name}", handler)
        app.router.add_get(f"/get_{name}", handler)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    return app


class ServerThread:
    """``engine`` served on ``host:port`` from a background thread (tests, benchmarks,
    notebooks). ``port=0`` picks a free port; ``url`` tells which. A non-loopback
    ``host`` without ``api_key`` is refused (``ValueError``) before anything starts."""

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
        api_key: str | None = None,
        weights_dir: Path | None = None,
    ) -> None:
        check_bind(host, api_key)
        self.api_key = api_key
        self.weights_dir = weights_dir
        self.engine = engine.start()
        self.host = host
        self.port = port
        self.max_request_tokens = max_request_tokens
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"engine server failed to start: {self._error}") from self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # handed to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
        self._loop.close()

    async def _start(self) -> None:
        app = make_app(
            self.engine,
            self.max_request_tokens,
            api_key=self.api_key,
            weights_dir=self.weights_dir,
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]

    def stop(self, shutdown_engine: bool = True) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if shutdown_engine:
            self.engine.shutdown()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    engine: Engine,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None = None,
    *,
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
    api_key: str | None = None,
    weights_dir: Path | None = None,
) -> None:
    """Serve in the calling thread until SIGINT/SIGTERM; ``on_ready`` gets the URL (with
    the real port when ``port`` is 0). A non-loopback ``host`` needs ``api_key``."""
    check_bind(host, api_key)
    engine.start()
    app = make_app(engine, max_request_tokens, api_key=api_key, weights_dir=weights_dir)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        if on_ready is not None:
            on_ready(f"http://{host}:{runner.addresses[0][1]}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
