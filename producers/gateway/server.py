"""The OpenAI-compatible gateway: agents written against the OpenAI API play the worker's
groups, and every episode they close becomes a record in the raw topic.

An agent changes three things: its ``base_url`` (the gateway, with the episode in the path
or in the ``X-Rollstream-Episode`` header), opening an episode first, and reporting the
reward at the end. Endpoints (JSON; errors use OpenAI's ``{"error": {...}}`` body):

- ``POST /v1/episodes``: open an episode, i.e. claim a slot of a group the worker admitted.
  201 with ``episode_id``, ``group_id``, ``index``, ``group_size``, ``base_url_path`` and
  the task's prompt (``prompt.text``, ``prompt.ids``, ``metadata``). 429 with
  ``Retry-After`` when no group is open within ``claim_wait_s`` (the trainer's credit or
  the staleness window holds generation back), 503 while the producer stops.
- ``POST /v1/chat/completions``, ``POST /v1/completions`` (header ``X-Rollstream-Episode``)
  or ``POST /episodes/{id}/v1/chat/completions`` and ``.../v1/completions``: one call of
  the episode, non-streaming or streaming (server-sent events: the stream opens before
  generation, then the text is sent as the engine draws it, ``producers.gateway.relay``;
  a call whose text is parsed for tool calls, or a run whose ``version_policy`` is
  ``abort``, which may discard tokens, gets it once the turn is whole). Messages are
  rendered with the model's chat template, the engine generates with log-probs under the
  run's sampling, and the episode keeps the exact tokens (``producers.gateway.desk``).
- ``POST /v1/episodes/{id}/close``: ``{"reward": 1.0}`` or ``{"reward": {"name": 0.5,
  ...}}`` (components summed), optional ``details``; ends the episode. The answer says
  the records are not published yet (``published: false``): they wait for the rest of
  the group (``state`` ``waiting_for_group``, ``group_open`` episodes still open) or the
  group is being published (``publishing``). A second close is answered 409, an unknown
  episode 404.
- ``GET /v1/episodes/{id}``: what became of it (``EPISODE_STATES``): ``published``
  only once Kafka acknowledged its group.
- ``POST /v1/episodes/{id}/abort``: the agent gives the episode up (never published).
- ``POST /v1/messages`` (or ``/episodes/{id}/v1/messages``): the same call in the
  Anthropic Messages API, for agents written against the ``anthropic`` client, whose
  ``base_url`` is the gateway or ``/episodes/{id}`` and whose ``x-api-key`` is the
  gateway's key (``producers.gateway.anthropic``: what it serves and refuses; its errors
  use that API's ``{"type": "error", ...}`` body).
- ``GET /v1/models`` (the names a call's ``model`` may give), ``GET /health``.

A client that is gone before its answer is written leaves a turn its agent never saw: a
retry of the call gets it (``producers.gateway.retries``), else the episode is abandoned,
not trained; a stream closed during generation abandons it at once. Opening the stream
first is what makes a streaming client's leaving visible.
With an ``api_key`` every endpoint but ``/health`` needs ``Authorization: Bearer <key>``
(or ``x-api-key: <key>``, as the ``anthropic`` client sends it); without one the gateway
binds only loopback.

Answers (``producers.gateway.answers``) carry the sampled tokens' log-probs when asked
(``logprobs``; no top alternatives) and, with a ``tool_call_parser``, structured
``tool_calls`` in the served model's family's format (``producers.gateway.tool_parsers``;
``auto`` picks it from the chat template when the gateway starts).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import web

from producers.config import GATEWAY_KEY_SETTING, GatewayConfig
from producers.engine.auth import AccessRefused, check_bind, check_key
from producers.engine.client import EngineError, EngineUnavailable
from producers.engine.request_checks import json_object
from producers.gateway.answers import Answer, Envelope, TextStream
from producers.gateway.anthropic import (
    MessageAnswer,
    block_start,
    messages_request,
    new_message_id,
    opening,
    text_delta,
)
from producers.gateway.anthropic import error_body as anthropic_error_body
from producers.gateway.desk import (
    LEFT_BEFORE_ANSWER,
    EpisodeDesk,
    EpisodeEnded,
    EpisodeRefused,
    GatewayEpisode,
    HistoryRefused,
    parse_reward,
)
from producers.gateway.relay import Relay, Render
from producers.gateway.requests import (
    BadRequest,
    CallRequest,
    chat_request,
    completion_request,
)
from producers.gateway.retries import BadRetryHeader, CallMemo, Failure, call_key, is_retry
from producers.gateway.tool_parsers import ToolReader, template_messages, tool_reader
from producers.rollout.generation import GroupGenerator, Sample
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.versions import Stopped

logger = logging.getLogger(__name__)

EPISODE_HEADER = "X-Rollstream-Episode"
EPISODE_STATES = (
    "active",  # opened, not yet closed
    "abandoned",  # ended without a reward (``reason``): never published
    "waiting_for_group",  # closed; its group has episodes still open
    "publishing",  # closed; its group complete, handed to Kafka, not yet acknowledged
    "published",  # acknowledged in the raw topic: durable
    "dead_lettering",  # closed; the producer stopped too early for its group to train
    "dead_lettered",  # acknowledged in the dead-letter topic
)
EXPOSURE = (
    "the gateway",
    f"could write episodes and rewards into the run; set {GATEWAY_KEY_SETTING} "
    "(or `rollstream gateway --api-key`)",
)
MAX_BODY_BYTES = 16 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CallApi = Literal["chat", "completion", "messages"]
CALL_PARSERS: dict[str, Callable[[dict[str, Any], int], CallRequest]] = {
    "chat": chat_request,
    "completion": completion_request,
    "messages": messages_request,
}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error_body(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body; ``code`` where OpenAI names one (else the status)."""
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "code": code or status}}


def _error(
    message: str,
    status: int,
    retry_after_s: int | None = None,
    code: str | None = None,
    *,
    anthropic: bool = False,
) -> web.Response:
    """The error in OpenAI's shape, or the Messages API's (``anthropic``)."""
    body = (
        anthropic_error_body(message, status) if anthropic else _error_body(message, status, code)
    )
    response = _json(body, status)
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _event(data: Any, name: str | None = None) -> bytes:
    """A server-sent event; ``name``: its ``event:`` line (the Messages API's)."""
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _messages_path(request: web.Request) -> bool:
    """Whether ``request`` is a Messages API call (its errors in that API's shape)."""
    return request.path.endswith("/v1/messages")


async def _fail(
    stream: web.StreamResponse | None,
    message: str,
    status: int,
    retry_after_s: int | None = None,
    *,
    anthropic: bool = False,
) -> web.StreamResponse:
    """The error as a response or, on a stream already open (its status sent), as the
    stream's last event (the ``openai`` and ``anthropic`` clients raise it)."""
    if stream is None:
        return _error(message, status, retry_after_s, anthropic=anthropic)
    with contextlib.suppress(ConnectionError):
        if anthropic:
            await stream.write(_event(anthropic_error_body(message, status), "error"))
        else:
            await stream.write(_event(_error_body(message, status)))
        await stream.write_eof()
    return stream


def _renderer(text: TextStream, anthropic: bool) -> Render:
    """What a call's tokens so far add to its stream, as the API's events."""

    def openai_chunks(ids: list[int], logprobs: list[float]) -> list[bytes]:
        return [_event(chunk) for chunk in text.chunks(ids, logprobs)]

    def messages_deltas(ids: list[int], logprobs: list[float]) -> list[bytes]:
        pieces = [piece for piece, _ in text.feed(ids, logprobs) if piece]
        return [_event(data, name) for name, data in map(text_delta, pieces)]

    return messages_deltas if anthropic else openai_chunks


def _rest(text: TextStream, turn: Sample) -> list[str]:
    """The text of a finished turn that its stream has not sent yet."""
    pieces = [piece for piece, _ in text.feed(turn.response_ids, turn.logprobs) if piece]
    rest = text.rest()
    return [*pieces, rest] if rest else pieces


@dataclass(frozen=True)
class ServedPolicy:
    """The policy the gateway serves: its name (``/v1/models``), the tokenizer messages are
    rendered with, its vocabulary (None: the tokenizer's) and the worker's group size."""

    model_name: str
    tokenizer: Any
    group_size: int
    vocab_size: int | None = None


@dataclass(frozen=True)
class PlacedCall:
    """A call the gateway answers: what was asked, in which API, of which episode, and the
    episode's memo of it (``producers.gateway.retries``)."""

    call: CallRequest
    api: CallApi
    episode: GatewayEpisode
    memo: CallMemo

    @property
    def anthropic(self) -> bool:
        return self.api == "messages"


class Gateway:
    """The HTTP side of the gateway; the worker's ``EpisodeDesk`` holds the episodes."""

    def __init__(
        self,
        config: GatewayConfig,
        desk: EpisodeDesk,
        generator: GroupGenerator,
        metrics: ProducerMetrics,
        served: ServedPolicy,
        *,
        settled: Callable[[str], str | None] = lambda group_id: None,
    ) -> None:
        check_bind(
            config.host, config.api_key.get_secret_value() if config.api_key else None, EXPOSURE
        )
        if served.tokenizer is None:
            raise ValueError("the gateway renders messages with the model's tokenizer: none loaded")
        self.config = config
        self.desk = desk
        self.generator = generator
        self.tokenizer = served.tokenizer
        self.metrics = metrics
        self.model_name = served.model_name
        self.model_names = list(dict.fromkeys([served.model_name, *config.served_model_names]))
        self.group_size = served.group_size
        self.vocab_size = served.vocab_size or len(served.tokenizer)
        self.tools = tool_reader(config.tool_call_parser, served.tokenizer)
        self.max_call_tokens = config.max_call_tokens or generator.task.max_new_tokens
        self.settled = settled  # a group's acknowledged fate: published, dead_lettered, None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # --- serving -------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._count, self._require_key]
        )
        app.router.add_post("/v1/episodes", self.open_episode)
        app.router.add_get("/v1/episodes/{episode}", self.episode_state)
        app.router.add_post("/v1/episodes/{episode}/close", self.close_episode)
        app.router.add_post("/v1/episodes/{episode}/abort", self.abort_episode)
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_post(prefix + "/chat/completions", self.chat_completions)
            app.router.add_post(prefix + "/completions", self.completions)
            app.router.add_post(prefix + "/messages", self.messages)
            app.router.add_get(prefix + "/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def start(self) -> str:
        """Serve on the configured host and port; returns the base URL."""
        self._runner = web.AppRunner(self.make_app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        logger.info("gateway serving http://%s:%d/v1", self.config.host, self.port)
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _require_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.config.api_key.get_secret_value() if self.config.api_key else None
        authorization = request.headers.get("Authorization")
        if authorization is None and "x-api-key" in request.headers:  # the anthropic client's
            authorization = "Bearer " + request.headers["x-api-key"]
        try:
            check_key(request.path, authorization, key, GATEWAY_KEY_SETTING)
        except AccessRefused as exc:
            return _error(str(exc), exc.status, anthropic=_messages_path(request))
        return await handler(request)

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unknown"
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            self.metrics.gateway_calls.labels(endpoint=endpoint, status=str(exc.status)).inc()
            raise
        self.metrics.gateway_calls.labels(endpoint=endpoint, status=str(response.status)).inc()
        return response

    # --- episodes ------------------------------------------------------------------------

    async def open_episode(self, request: web.Request) -> web.Response:
        if self.desk.stopping:
            return _error("the producer is stopping: no new episodes", 503, retry_after_s=5)
        episode = await self.desk.claim()
        if episode is None:
            return _error(
                "no group is open: generation is held back (the trainer's credit or the "
                "staleness window); retry later",
                429,
                retry_after_s=1,
            )
        prompt = episode.prompt
        return _json(
            {
                "episode_id": episode.episode_id,
                "group_id": episode.group_id,
                "index": episode.index,
                "group_size": self.group_size,
                "base_url_path": f"/episodes/{episode.episode_id}/v1",
                "prompt": {
                    "text": prompt.text,
                    "ids": prompt.ids,
                    "metadata": _jsonable(prompt.meta),
                },
            },
            201,
        )

    async def close_episode(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            reward, details = parse_reward(body)
            episode = self.desk.episode(request.match_info["episode"])
            receipt = self.desk.close(episode, reward, details)
        except (EpisodeRefused, BadRequest) as exc:
            return _error(str(exc), getattr(exc, "status", 400))
        return _json(
            {
                "episode_id": episode.episode_id,
                "reward": reward,
                "records": receipt.records,
                "published": False,
                "state": "waiting_for_group" if receipt.group_open else "publishing",
                "group_open": receipt.group_open,
            }
        )

    async def episode_state(self, request: web.Request) -> web.Response:
        try:
            episode = self.desk.known(request.match_info["episode"])
        except EpisodeEnded as exc:  # by an earlier run of this producer
            answer = {"episode_id": request.match_info["episode"], "state": "abandoned"}
            return _json({**answer, "published": False, "reason": exc.reason})
        except EpisodeRefused as exc:
            return _error(str(exc), exc.status)
        state = episode.state
        if state == "closed":
            state = episode.fate or "waiting_for_group"
            state = self.settled(episode.group_id) or state
        answer = {
            "episode_id": episode.episode_id,
            "group_id": episode.group_id,
            "state": state,
            "published": state == "published",
        }
        if episode.reason:
            answer["reason"] = episode.reason
        return _json(answer)

    async def abort_episode(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            episode = self.desk.episode(request.match_info["episode"])
        except (EpisodeRefused, BadRequest) as exc:
            return _error(str(exc), getattr(exc, "status", 400))
        reason = body.get("reason")
        self.desk.abandon(episode, "aborted", f"the agent aborted it: {reason!s:.200}")
        return _json({"episode_id": episode.episode_id, "state": episode.state})

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "rollstream"}
            for name in self.model_names
        ]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return _json({"ok": True})

    # --- calls ---------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "completion")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "messages")

    async def _call(self, request: web.Request, api: CallApi) -> web.StreamResponse:
        """One model call of an episode, in any of the three APIs: checked, rendered,
        placed in the episode, generated, answered in the API's shape; a retry of the
        episode's last call is answered with its turn (``producers.gateway.retries``)."""
        anthropic = api == "messages"
        try:
            raw = await request.read()
            body = json_object(raw, BadRequest)
            unserved = self._unserved(body.get("model"), anthropic)
            if unserved is not None:
                return unserved
            call = CALL_PARSERS[api](body, self.max_call_tokens)
            key, retry = call_key(request.headers, request.path, raw), is_retry(request.headers)
            episode = self.desk.episode(_episode_id(request))
            memo = episode.last_call
            if retry and memo is not None and memo.key == key:
                return await self._replay(request, PlacedCall(call, api, episode, memo))
            if episode.busy:
                raise EpisodeRefused("a call of this episode is still in flight")
            if memo is not None and memo.undelivered:  # its agent moved on without it
                self.desk.abandon(episode, "client_left", LEFT_BEFORE_ANSWER)
                episode.check_open()
            ids, text = self._render(call)
            mismatches = episode.mismatches
            history, room = episode.place(ids, text, self._retokenize)
        except (EpisodeRefused, BadRequest, BadRetryHeader) as exc:
            if isinstance(exc, HistoryRefused):
                self.metrics.gateway_mismatches.labels(action="refuse").inc()
            return _error(str(exc), getattr(exc, "status", 400), anthropic=anthropic)
        if episode.mismatches > mismatches:
            self.metrics.gateway_mismatches.labels(action="split").inc()
        episode.tool_messages = max(episode.tool_messages, _tool_messages(call.messages))
        envelope = Envelope(model=self.model_name, chat=api != "completion")
        memo = CallMemo(key, envelope, new_message_id(), len(history))
        episode.last_call = memo
        max_new = min(call.max_tokens or self.max_call_tokens, room)
        try:
            return await self._generate(
                request, PlacedCall(call, api, episode, memo), history, max_new
            )
        finally:
            if not memo.done.is_set():  # ended by an error: a retry is told so, not held
                memo.finish(Failure("the call failed", 500), delivered=False)

    async def _generate(
        self, request: web.Request, placed: PlacedCall, history: list[int], max_new: int
    ) -> web.StreamResponse:
        """The policy's turn of a placed call, relayed as it comes on a stream, then
        answered; a client gone before its answer leaves the turn for a retry."""
        call, episode, memo, anthropic = placed.call, placed.episode, placed.memo, placed.anthropic
        stream = relay = text = None
        if call.stream:
            stream = await self._open_call_stream(request, placed)
            if self._tool_reader(call) is None:  # calls are parsed out of the whole text:
                # with them it is sent once whole
                text = TextStream(
                    self.tokenizer.decode, logprobs=call.logprobs, envelope=memo.envelope
                )
                relay = Relay(stream, _renderer(text, anthropic))
        turn = await self._turn(episode, history, max_new, call.stop, relay)
        if isinstance(turn, Failure):
            memo.finish(turn, delivered=False)
            return await _fail(
                stream, turn.message, turn.status, turn.retry_after_s, anthropic=anthropic
            )
        if episode.state != "active":
            ended = Failure(f"episode {episode.episode_id} ended during the call", 409)
            memo.finish(ended, delivered=False)
            return await _fail(stream, ended.message, ended.status, anthropic=anthropic)
        if stream is not None and (_client_gone(request) or (relay is not None and relay.left)):
            memo.finish(turn, delivered=False)
            self.desk.abandon(episode, "client_left", "the client left during the stream")
            return stream
        if _client_gone(request):
            memo.finish(turn, delivered=False)
            episode.last_activity = time.monotonic()  # a retry has the idle timeout to come
            return web.Response(status=499)
        await self.desk.commit_call(episode, turn, memo.prompt_tokens)  # a retry waits for it
        memo.finish(turn, delivered=True)
        return await self._answer(request, placed, stream, text)

    async def _replay(self, request: web.Request, placed: PlacedCall) -> web.StreamResponse:
        """A retry of the episode's last call: its turn once it is over (delivered into
        the episode now if its first client left), or its failure; never a second turn."""
        episode, memo, anthropic = placed.episode, placed.memo, placed.anthropic
        await memo.done.wait()
        self.metrics.gateway_retries.labels(
            outcome="failure" if isinstance(memo.outcome, Failure) else
            "delivered_late" if memo.undelivered else "answered_again"
        ).inc()  # fmt: skip
        outcome = memo.outcome
        if isinstance(outcome, Failure) or outcome is None:
            failure = outcome or Failure("the call failed", 500)
            return _error(
                failure.message, failure.status, failure.retry_after_s, anthropic=anthropic
            )
        if episode.state != "active" and not memo.delivered:
            return _error(
                f"episode {episode.episode_id} is {episode.state}", 409, anthropic=anthropic
            )
        if not memo.delivered:
            memo.delivered = True
            await self.desk.commit_call(episode, outcome, memo.prompt_tokens)
        stream = await self._open_call_stream(request, placed) if placed.call.stream else None
        return await self._answer(request, placed, stream, None)

    def _tool_reader(self, call: CallRequest) -> ToolReader | None:
        """What parses the call's answer for tool calls: None when the call offers no tools
        or the gateway parses none."""
        return self.tools if call.parse_tools else None

    async def _open_call_stream(
        self, request: web.Request, placed: PlacedCall
    ) -> web.StreamResponse:
        """The call's stream, opened (Messages: ``message_start`` and the text block's
        start, with the memo's id)."""
        memo = placed.memo
        first = [opening(memo.message_id, self.model_name, memo.prompt_tokens), block_start()]
        return await self._open_stream(request, memo.envelope, first if placed.anthropic else None)

    async def _answer(
        self,
        request: web.Request,
        placed: PlacedCall,
        stream: web.StreamResponse | None,
        text: TextStream | None,
    ) -> web.StreamResponse:
        """The call's answer in its API's shape: whole, or the rest of its stream (all of
        it when ``text`` sent nothing yet)."""
        call, episode, memo = placed.call, placed.episode, placed.memo
        turn = memo.outcome
        assert isinstance(turn, Sample)
        answer = Answer(
            turn,
            self.tokenizer.decode,
            envelope=memo.envelope,
            prompt_tokens=memo.prompt_tokens,
            episode_id=episode.episode_id,
            logprobs=call.logprobs,
            tools=self._tool_reader(call),
        )
        if placed.anthropic:
            message = MessageAnswer(answer, self.model_name, call.stop, memo.message_id)
            if stream is None:
                return _json(message.whole())
            pieces = None if text is None else _rest(text, turn)
            events = [_event(data, name) for name, data in message.events(pieces)]
            return await self._finish_stream(request, stream, episode, events)
        if stream is None:
            return _json(answer.whole())
        events = [_event(chunk) for chunk in answer.chunks(call.include_usage, text)]
        return await self._finish_stream(request, stream, episode, [*events, b"data: [DONE]\n\n"])

    async def _turn(
        self,
        episode: GatewayEpisode,
        history: list[int],
        max_new: int,
        stop: list[str],
        relay: Relay | None,
    ) -> Sample | Failure:
        """The policy's turn of the call (its text relayed as it comes, on a stream), or
        why there is none."""
        episode.busy = True
        try:
            return await self.generator.turn(
                history,
                max_new,
                f"{episode.episode_id}-c{episode.calls}",
                stop or None,
                None if relay is None else relay.on_tokens,
            )
        except EngineUnavailable as exc:
            return Failure(f"the engine is unavailable: {exc}", 503, 2)
        except EngineError as exc:
            return Failure(f"the engine refused the call: {exc}", 502)
        except Stopped:
            return Failure("the producer is stopping", 503, 5)
        finally:
            episode.busy = False
            if relay is not None:
                await relay.close()

    def _unserved(self, model: object, anthropic: bool) -> web.Response | None:
        """The answer to a call naming a model this gateway does not serve, or None."""
        if model is None or model in self.model_names:
            return None
        return _error(
            f"the model {model!r:.100} is not served here: this gateway serves "
            f"{', '.join(map(repr, self.model_names))} ([producers.rollout.gateway] "
            "served_model_names adds names)",
            404,
            code="model_not_found",
            anthropic=anthropic,
        )

    async def _open_stream(
        self,
        request: web.Request,
        envelope: Envelope,
        messages_opening: list[dict[str, Any]] | None = None,
    ) -> web.StreamResponse:
        """Send the stream's headers and opening (the chat role chunk, a comment for
        completions, the Messages API's ``message_start`` and ``content_block_start``)
        before the turn is generated."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        first = envelope.opening()
        with contextlib.suppress(ConnectionError):
            if messages_opening is not None:
                await response.write(b"".join(_event(e, e["type"]) for e in messages_opening))
            else:
                await response.write(_event(first) if first else b": generating\n\n")
        return response

    async def _finish_stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        episode: GatewayEpisode,
        events: list[bytes],
    ) -> web.StreamResponse:
        """Write the answer's events; a client that left is the episode's end."""
        try:
            for event in events:
                if _client_gone(request):
                    raise ConnectionResetError("client gone")
                await response.write(event)
            await response.write_eof()
        except ConnectionError:
            self.desk.abandon(episode, "client_left", "the client left during the stream")
        return response

    def _render(self, call: CallRequest) -> tuple[list[int], str]:
        """The call's prompt as token ids and text."""
        tokenizer = self.tokenizer
        if call.prompt_ids is not None:
            bad = [t for t in call.prompt_ids if t >= self.vocab_size]
            if bad:
                raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary")
            return call.prompt_ids, tokenizer.decode(call.prompt_ids, skip_special_tokens=False)
        if call.prompt_text is not None:
            return self._tokenize(call.prompt_text, add_special_tokens=True), call.prompt_text
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("the model's tokenizer has no chat template: use /v1/completions")
        try:
            messages = template_messages(call.messages or [], self.tools and self.tools.family)
            text = tokenizer.apply_chat_template(
                messages, tools=call.tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # the template is the model's code: any error is the input's
            raise BadRequest(f"the chat template cannot render these messages: {exc}") from exc
        return self._tokenize(text, add_special_tokens=False), text

    def _tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids of ``text``; text the vocabulary cannot hold (the tiny model's digits
        and ``+``) is the input's error."""
        try:
            found = self.tokenizer(text, add_special_tokens=add_special_tokens)
        except ValueError as exc:
            raise BadRequest(f"the model's tokenizer cannot encode the prompt: {exc}") from exc
        return list(found["input_ids"])

    def _retokenize(self, context: list[int], text: str) -> list[int] | None:
        """``context`` and the tokens of ``text`` past the context's own text, when
        ``text`` begins with it (a re-rendered history whose earlier turns tokenize
        differently than the engine produced them)."""
        prefix = self.tokenizer.decode(context, skip_special_tokens=False)
        if not text.startswith(prefix):
            return None
        return context + self._tokenize(text[len(prefix) :], add_special_tokens=False)


def _tool_messages(messages: list[dict[str, Any]] | None) -> int:
    """How many tool results a call's messages hold (0 for a completion)."""
    return sum(1 for m in messages or () if m["role"] == "tool")


async def _body(request: web.Request) -> dict[str, Any]:
    return json_object(await request.read(), BadRequest)


def _episode_id(request: web.Request) -> str:
    episode = request.match_info.get("episode") or request.headers.get(EPISODE_HEADER)
    if not episode:
        raise BadRequest(
            f"no episode: open one (POST /v1/episodes) and send its id in the {EPISODE_HEADER} "
            "header or use its base_url_path"
        )
    return episode


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can carry it (what JSON cannot is given as its text)."""
    return orjson.loads(orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS))
