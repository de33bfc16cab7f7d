"""Async client for an engine speaking SGLang's native HTTP API (ours or SGLang itself).

Every response is checked before it is trusted: a missing field, log-probs that do not
line up with the output ids, a non-finite or positive log-prob, or a batch of the wrong
size raises ``EngineResponseError`` saying exactly what was wrong, so a misbehaving
engine never turns into a silently corrupt trajectory.

Transient failures (connection refused or reset, any HTTP 5xx: the engine's trouble, not
the request's) are retried with exponential backoff and jitter (tenacity); a 503 that
carries ``Retry-After`` (an engine whose queue is full) is retried after that delay instead
(at most ``retry_after_max_s``); after ``retries`` attempts the call raises
``EngineUnavailable``, which the rollout worker rides out. A 4xx is this client's own bug
(a bad sampling parameter, a request over the engine's token budget): it is never
retried and raises ``EngineRequestError`` with the engine's message, which names the
field, and the worker stops on it. A ``/generate`` that timed out while reading is not
retried: the engine may still be working on it.
With ``api_key`` every request carries ``Authorization: Bearer <key>`` (SGLang's
``--api-key``); a wrong or missing key is a 401, never retried.
``check_model`` compares ``get_model_info`` with the model a run expects and raises
``EngineModelMismatch`` naming both. ``generate_stream`` reads SGLang's streamed
``/generate`` (``StreamedAnswer``), telling its caller of the tokens as they come.

The transport is aiohttp: a producer keeps a hundred or more requests in flight, and
aiohttp's connection pool costs about 0.3 ms of CPU per request there against 7 ms for
httpx's, whose pool scans every connection on every request (``bench/engine_client.py``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from producers.engine.streaming import TokenProgress

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # requests in flight to one engine; more wait for a free connection

FINISH_TYPES = frozenset({"stop", "length", "abort"})
_LOGPROB_EPSILON = 1e-4


class EngineError(RuntimeError):
    """Base class of the client's errors."""


class EngineUnavailable(EngineError):
    """The engine could not be reached (after all retries)."""


class EngineRequestError(EngineError):
    """The engine refused a request as malformed (HTTP 4xx): a bug of the caller, which
    sending it again cannot fix."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine answered HTTP {status} (request refused, not retried): {message}")
        self.status = status


class EngineResponseError(EngineError):
    """The engine answered something that is not a valid SGLang response."""


class EngineModelMismatch(EngineError):
    """The engine serves another model than the run expects."""


class _NotSent(Exception):
    """The request never reached an engine that answered: safe to send again."""


class _Transient(Exception):
    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after_s = retry_after_s


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds: delay-seconds or an HTTP date; None when
    absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class GenerateOutput:
    """One generated sequence, checked."""

    rid: str
    output_ids: list[int]
    logprobs: list[float] | None
    finish_type: str  # "stop" | "length" | "abort"
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: str | None
    text: str

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"


def parse_generate_response(data: Any, expected: int, want_logprob: bool) -> list[GenerateOutput]:
    """Check and convert a batch ``/generate`` answer (a list of ``expected`` objects)."""
    if isinstance(data, dict) and expected == 1 and "meta_info" in data:
        data = [data]
    if not isinstance(data, list):
        raise EngineResponseError(f"expected a list of {expected} results, got {_kind(data)}")
    if len(data) != expected:
        raise EngineResponseError(f"expected {expected} results, got {len(data)}")
    return [_parse_one(item, i, want_logprob) for i, item in enumerate(data)]


def _parse_one(item: Any, index: int, want_logprob: bool) -> GenerateOutput:
    where = f"result {index}"
    if not isinstance(item, dict):
        raise EngineResponseError(f"{where}: expected an object, got {_kind(item)}")
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineResponseError(f"{where}: meta_info missing or not an object")
    ids = item.get("output_ids")
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise EngineResponseError(f"{where}: output_ids missing or not a list of integers")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise EngineResponseError(
            f"{where}: finish_reason {finish!r} is not an object with type in "
            f"{sorted(FINISH_TYPES)}"
        )
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(ids):
        raise EngineResponseError(
            f"{where}: completion_tokens={completion} but {len(ids)} output_ids"
        )
    logprobs = None
    if want_logprob:
        logprobs = _parse_logprobs(meta.get("output_token_logprobs"), ids, where)
    version = meta.get("weight_version")
    return GenerateOutput(
        rid=str(meta.get("id", "")),
        output_ids=[int(t) for t in ids],
        logprobs=logprobs,
        finish_type=finish["type"],
        finish_reason=finish,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        weight_version=None if version is None else str(version),
        text=str(item.get("text") or ""),
    )


class StreamedAnswer:
    """SGLang's streamed ``/generate`` events for one prompt, read into one answer:
    ``on_tokens`` is told of the ids and log-probs so far each time an event brings more.
    An event holds everything so far (SGLang's default) or only what is new (an SGLang
    started with ``--incremental-streaming-output``): its ``completion_tokens`` tells which.
    Each event is checked as a whole answer is; the last (its ``finish_reason`` set) is
    returned as ``generate_one``'s answer."""

    def __init__(self, on_tokens: TokenProgress) -> None:
        self.on_tokens = on_tokens
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.entries: list[Any] = []  # output_token_logprobs, as the engine wrote them
        self.text = ""
        self.events = 0

    def add(self, event: Any) -> GenerateOutput | None:
        """One event's object; the answer once it is the last."""
        where = f"stream event {self.events}"
        self.events += 1
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            raise EngineRequestError(400, str(event["error"].get("message", event["error"])))
        if not isinstance(event, dict) or not isinstance(event.get("meta_info"), dict):
            raise EngineResponseError(f"{where}: expected an object with meta_info")
        meta, ids = event["meta_info"], event.get("output_ids")
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise EngineResponseError(f"{where}: output_ids missing or not a list of integers")
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise EngineResponseError(f"{where}: output_token_logprobs missing (return_logprob)")
        held = len(self.ids)
        completion = meta.get("completion_tokens")
        if completion is not None and completion != len(ids):  # only what is new
            if completion != held + len(ids) or len(entries) != len(ids):
                raise EngineResponseError(
                    f"{where}: completion_tokens={completion} after {held} tokens and "
                    f"{len(ids)} new output_ids, {len(entries)} output_token_logprobs"
                )
            new_ids, new_entries = ids, entries
            self.text += str(event.get("text") or "")
        else:  # everything so far
            if ids[:held] != self.ids or len(ids) < held:
                raise EngineResponseError(f"{where}: output_ids do not extend the previous event's")
            new_ids, new_entries = ids[held:], entries[held:]
            self.text = str(event.get("text") or "")
        self.logprobs += _parse_logprobs(new_entries, new_ids, where)
        self.ids += [int(t) for t in new_ids]
        self.entries += new_entries
        if meta.get("finish_reason") is not None:
            whole = {"output_ids": self.ids, "text": self.text}
            whole["meta_info"] = {
                **meta,
                "completion_tokens": len(self.ids),
                "output_token_logprobs": self.entries,
            }
            return _parse_one(whole, 0, True)
        if new_ids:
            self.on_tokens(list(self.ids), list(self.logprobs))
        return None

    async def read(self, content: aiohttp.StreamReader) -> GenerateOutput:
        """The answer of a stream's ``data:`` lines (an event may exceed any line limit)."""
        buffer = b""
        async for piece in content.iter_any():
            buffer += piece
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                data = line.strip()
                if not data.startswith(b"data:"):
                    continue  # blank lines, comments, event names
                data = data[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError as exc:
                    raise EngineResponseError(
                        f"stream event {self.events} is not JSON: {data[:200]!r}"
                    ) from exc
                answer = self.add(event)
                if answer is not None:
                    return answer
        raise EngineResponseError(
            f"the stream ended after {self.events} events without a finished answer"
        )


def _parse_logprobs(entries: Any, ids: list[int], where: str) -> list[float]:
    if not isinstance(entries, list):
        raise EngineResponseError(f"{where}: output_token_logprobs missing (return_logprob)")
    if len(entries) != len(ids):
        raise EngineResponseError(
            f"{where}: {len(entries)} output_token_logprobs for {len(ids)} output_ids"
        )
    values = []
    for i, (entry, token) in enumerate(zip(entries, ids, strict=True)):
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise EngineResponseError(
                f"{where}: output_token_logprobs[{i}] = {entry!r}, expected [logprob, id, text]"
            )
        value, entry_token = entry[0], entry[1]
        if entry_token != token:
            raise EngineResponseError(
                f"{where}: output_token_logprobs[{i}] is for token {entry_token}, "
                f"output_ids[{i}] is {token}"
            )
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise EngineResponseError(f"{where}: output_token_logprobs[{i}] = {value!r}")
        if not math.isfinite(value) or value > _LOGPROB_EPSILON:
            raise EngineResponseError(
                f"{where}: output_token_logprobs[{i}] = {value} is not a log-probability"
            )
        values.append(float(min(value, 0.0)))
    return values


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return type(value).__name__


def same_model(expected: str, served: str) -> bool:
    """Whether ``served`` names ``expected``: equal, or equal last path component
    (case-insensitive), so ``HuggingFaceTB/SmolLM2-135M-Instruct`` matches
    ``smollm2-135m-instruct`` and a checkpoint mounted elsewhere still matches."""
    a, b = expected.rstrip("/"), served.rstrip("/")
    return a == b or a.rsplit("/", 1)[-1].lower() == b.rsplit("/", 1)[-1].lower()


class EngineClient:
    """One engine at ``url``. Use as ``async with EngineClient(url) as client: ...``."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 5.0,
        request_timeout: float = 600.0,
        retries: int = 5,
        retry_max_wait: float = 10.0,
        retry_after_max_s: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.retry_max_wait = retry_max_wait
        self.retry_after_max_s = retry_after_max_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, connect=connect_timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        """The session, made on first use: aiohttp binds it to the running event loop."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS),
                timeout=self._timeout,
                headers=self._headers,
            )
        return self._session

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- API ---------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
        lora_path: str | None = None,
    ) -> list[GenerateOutput]:
        """Generate for a batch of prompts (one request, sent in SGLang's batch form),
        with the loaded LoRA adapter named ``lora_path`` if given."""
        body: dict[str, Any] = {
            "input_ids": [list(map(int, ids)) for ids in input_ids],
            "sampling_params": (
                sampling_params if isinstance(sampling_params, dict) else list(sampling_params)
            ),
            "return_logprob": return_logprob,
        }
        if rids is not None:
            body["rid"] = list(rids)
        if lora_path is not None:
            body["lora_path"] = lora_path
        data = await self._request("POST", "/generate", body, retry_reads=False)
        return parse_generate_response(data, len(body["input_ids"]), return_logprob)

    async def generate_one(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        lora_path: str | None = None,
    ) -> GenerateOutput:
        """Generate for one prompt, in SGLang's single form (what a router forwards)."""
        body = _single_body(input_ids, sampling_params, return_logprob, rid, lora_path)
        data = await self._request("POST", "/generate", body, retry_reads=False)
        return parse_generate_response(data, 1, return_logprob)[0]

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        on_tokens: TokenProgress,
        *,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateOutput:
        """``generate_one`` with log-probs, streamed (SGLang's ``"stream": true``):
        ``on_tokens`` is told of the ids and log-probs so far as the engine draws them
        (``StreamedAnswer``); returns the whole answer. An engine that answers at once
        (JSON) is read as ``generate_one``'s. A stream cut once it began is
        ``EngineUnavailable``, never sent again."""
        body = {**_single_body(input_ids, sampling_params, True, rid, lora_path), "stream": True}
        data = await self._request(
            "POST", "/generate", body, retry_reads=False, stream=StreamedAnswer(on_tokens)
        )
        if isinstance(data, GenerateOutput):
            return data
        return parse_generate_response(data, 1, True)[0]

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort one request by rid, or every request (``abort_all``)."""
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        sha256: str | None = None,
    ) -> dict[str, Any]:
        """Ask the engine to load a checkpoint directory, whose safetensors bytes have
        ``sha256`` (our engine requires it; sent only when given); raises
        ``EngineRequestError`` when it reports failure (it then keeps its old weights)."""
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if sha256 is not None:
            body["weights_sha256"] = sha256
        data = await self._request("POST", "/update_weights_from_disk", body, retry_reads=False)
        if not isinstance(data, dict) or data.get("success") is not True:
            raise EngineRequestError(400, f"update_weights_from_disk failed: {data!r}")
        return data

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, sha256: str | None = None
    ) -> dict[str, Any]:
        """Ask the engine to load the PEFT adapter directory ``lora_path`` as
        ``lora_name`` (SGLang's dynamic LoRA API; ``sha256`` of its safetensors bytes, which
        our engine requires); raises ``EngineRequestError`` when it reports failure."""
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
        if sha256 is not None:
            body["weights_sha256"] = sha256
        return self._lora_result(
            "load_lora_adapter",
            await self._request("POST", "/load_lora_adapter", body, retry_reads=False),
        )

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Ask the engine to forget the adapter ``lora_name``."""
        body = {"lora_name": lora_name}
        return self._lora_result(
            "unload_lora_adapter",
            await self._request("POST", "/unload_lora_adapter", body, retry_reads=False),
        )

    @staticmethod
    def _lora_result(what: str, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict) or data.get("success") is not True:
            raise EngineRequestError(400, f"{what} failed: {data!r}")
        return data

    async def get(self, path: str) -> Any:
        """The JSON answer of a ``GET`` (retried like every read)."""
        return await self._request("GET", path)

    async def model_info(self) -> dict[str, Any]:
        data = await self.get("/get_model_info")
        if not isinstance(data, dict) or not isinstance(data.get("model_path"), str):
            raise EngineResponseError(f"get_model_info answered {data!r}, no model_path")
        return data

    async def health(self) -> bool:
        """True if ``/health`` answers 200 right now (no retries)."""
        try:
            timeout = aiohttp.ClientTimeout(total=5.0)
            async with self._http().get(self.url + "/health", timeout=timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def check_model(self, expected: str) -> dict[str, Any]:
        """``get_model_info``, after checking that the engine serves ``expected``."""
        info = await self.model_info()
        if not same_model(expected, info["model_path"]):
            raise EngineModelMismatch(
                f"engine at {self.url} serves model {info['model_path']!r} "
                f"(get_model_info.model_path) but this run expects {expected!r}: point "
                "rollout.engine_url at the right engine or fix rollout.expected_model"
            )
        return info

    # --- transport ---------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        retry_reads: bool = True,
        stream: StreamedAnswer | None = None,
    ) -> Any:
        def transient(exc: BaseException) -> bool:
            if isinstance(exc, _Transient | _NotSent):
                return True
            return retry_reads and isinstance(exc, aiohttp.ClientError | TimeoutError)

        backoff = wait_exponential_jitter(multiplier=0.1, max=self.retry_max_wait, jitter=0.1)

        def wait(state: RetryCallState) -> float:
            """The engine's ``Retry-After`` when it sent one, else exponential back-off."""
            exc = state.outcome.exception() if state.outcome is not None else None
            if isinstance(exc, _Transient) and exc.retry_after_s is not None:
                delay = min(exc.retry_after_s, self.retry_after_max_s)
                log.info(
                    "engine at %s busy (HTTP %d) for %s %s; retrying in %.1fs (Retry-After)",
                    self.url,
                    exc.status,
                    method,
                    path,
                    delay,
                )
                return delay
            return backoff(state)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retries),
            wait=wait,
            retry=retry_if_exception(transient),
            reraise=False,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._once(method, path, body, stream)
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            raise EngineUnavailable(
                f"engine at {self.url} unavailable for {method} {path} after "
                f"{self.retries} attempts: {cause!r}"
            ) from cause
        except (aiohttp.ClientError, TimeoutError) as exc:
            # not retried here: a connection cut mid-request (the engine died during a
            # generate or a weight load); the caller redoes the work
            raise EngineUnavailable(
                f"engine at {self.url} failed during {method} {path}: {exc!r}"
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _once(
        self, method: str, path: str, body: Any, stream: StreamedAnswer | None = None
    ) -> Any:
        try:
            async with self._http().request(method, self.url + path, json=body) as response:
                status, retry_after = response.status, response.headers.get("Retry-After")
                if stream is not None and status == 200 and _is_event_stream(response):
                    return await self._read_stream(stream, response)
                content = await response.read()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise _NotSent(f"could not connect: {exc!r}") from exc
        except aiohttp.ServerDisconnectedError as exc:
            # closed before any answer (a kept-alive connection the engine had dropped, or
            # an engine that restarted): the request never ran to an answer, send it again
            raise _NotSent(f"disconnected before answering: {exc!r}") from exc
        text = content.decode("utf-8", errors="replace")
        if status >= 500:
            raise _Transient(status, text[:200], retry_after_seconds(retry_after))
        if status >= 400:
            raise EngineRequestError(status, _error_message(text))
        if not content:
            return None
        try:
            return json.loads(content)
        except ValueError as exc:
            raise EngineResponseError(f"{method} {path} answered non-JSON: {text[:200]!r}") from exc

    async def _read_stream(
        self, stream: StreamedAnswer, response: aiohttp.ClientResponse
    ) -> GenerateOutput:
        """A begun stream's answer; cut short, it is ``EngineUnavailable`` (not a retry:
        its tokens were already told)."""
        try:
            return await stream.read(response.content)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(
                f"engine at {self.url}: the /generate stream broke after {stream.events} "
                f"events: {exc!r}"
            ) from exc


def _is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return response.content_type == "text/event-stream"


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
    return str(data)[:500]


def _single_body(
    input_ids: Sequence[int],
    sampling_params: dict[str, Any],
    return_logprob: bool,
    rid: str | None,
    lora_path: str | None,
) -> dict[str, Any]:
    """A ``/generate`` body for one prompt, in SGLang's single form."""
    body: dict[str, Any] = {
        "input_ids": list(map(int, input_ids)),
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
    }
    if rid is not None:
        body["rid"] = rid
    if lora_path is not None:
        body["lora_path"] = lora_path
    return body
