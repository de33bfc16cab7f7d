"""A CPU inference engine for RL rollouts: torch + transformers, batched, abortable.

The engine owns one causal LM and one scheduler thread. Requests (token ids + SGLang-style
sampling parameters) queue up; the scheduler collects them until none arrived for
``batch_wait_s`` (at most ``max_batch_wait_s``), prefills them together (left-padded) and
decodes with a KV cache. Requests that arrive while a batch runs **join it at the next
decode step**: they are prefilled on their own, and their KV cache is appended to the
running one, the shorter of the two left-padded and masked out. Rows leave the batch as
they finish, so a batch costs what its live rows cost, and a GRPO group arriving while
another one decodes does not wait for it (continuous batching, in its simplest form;
no paging). The KV of finished sequences is kept in a bounded ``PrefixCache``: a request
that extends one (the next turn of a multi-turn episode, or another sample of the same
prompt) prefills only its new tokens. Between decode steps the scheduler releases the GIL, so the
HTTP server's thread (or a worker's event loop) stays responsive during long batches.

Numerics, as SGLang's sampler defines them (``python/sglang/srt/layers/sampler.py``):
the returned log-prob of a sampled token is ``log softmax(logits / temperature)`` in
float32, taken *before* top-k / top-p / min-p filtering (those only change which token is
drawn). Temperature 0 means greedy, which SGLang implements as temperature 1 with
top_k = 1, so greedy log-probs are the raw ``log_softmax(logits)``. A trainer comparing
against these values must therefore divide its logits by the same temperature. (SGLang's
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` switches to the raw distribution; this engine has no
such switch: run at temperature 1 when raw and scaled must agree.)

Abort: ``abort(rid)`` marks a request; a queued one finishes at once with no tokens, a
running one finishes after the current decode step, keeping the tokens generated so far,
with ``finish_reason = {"type": "abort", ...}`` (how SGLang reports it). Weight updates
are control operations executed between batches, in submission order.

Back-pressure: at most ``max_pending`` requests are accepted and not finished (queued or
running). Beyond that ``submit_many`` raises ``EngineBusy`` (the HTTP server answers 503
with ``Retry-After``) and queues nothing, so a flood of clients cannot grow memory
without bound.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.models import load_model, load_tokenizer, model_directory, parse_model_spec
from producers import request_checks as checks
from producers.prefix_cache import PrefixCache, PrefixHit

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-6

# Sampling parameters this engine honours, with SGLang's defaults.
_SUPPORTED = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "max_new_tokens": 128,
    "stop_token_ids": None,
    "stop": None,
    "ignore_eos": False,
}
# Accepted and ignored: they only shape the detokenized text, never the tokens.
_TEXT_ONLY = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})
# Accepted only at their neutral value: anything else would change the sampled tokens.
_NEUTRAL = {
    "n": (1,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None,),
    "custom_params": (None,),
}


class RequestError(ValueError):
    """A request the engine cannot serve (answered with HTTP 400)."""


class EngineBusy(RuntimeError):
    """The engine holds ``max_pending`` requests already: try again after
    ``retry_after_s`` (answered with HTTP 503 and ``Retry-After``)."""

    def __init__(self, pending: int, limit: int, retry_after_s: float) -> None:
        super().__init__(
            f"engine busy: {pending} request(s) queued or running, limit {limit}; "
            f"retry after {retry_after_s:g}s"
        )
        self.retry_after_s = retry_after_s


MAX_STOP_CHARS = 64


def _stop_strings(value: Any) -> tuple[str, ...]:
    """SGLang's ``stop``: one string or a list of them (empty: none)."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise TypeError(f"sampling_params.stop must be a string or a list of strings, got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The subset of SGLang's ``sampling_params`` that this engine implements."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the output text has one
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SamplingParams:
        """Parse an SGLang ``sampling_params`` object; unsupported settings raise
        ``RequestError`` naming them instead of being silently ignored."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(_SUPPORTED) - _TEXT_ONLY - set(_NEUTRAL))
        if unknown:
            raise RequestError(f"unsupported sampling_params: {unknown}")
        for key, neutral in _NEUTRAL.items():
            value = values.get(key)
            if value is not None and value not in neutral and value != []:
                raise RequestError(
                    f"sampling_params.{key}={value!r} is not supported by this engine "
                    f"(only {neutral[0]!r})"
                )
        try:
            params = cls(
                temperature=checks.number(values, "temperature", 1.0),
                top_p=checks.number(values, "top_p", 1.0),
                top_k=checks.integer(values, "top_k", -1, -1, checks.MAX_TOP_K),
                min_p=checks.number(values, "min_p", 0.0),
                max_new_tokens=checks.integer(
                    values, "max_new_tokens", 128, 0, checks.MAX_NEW_TOKENS
                ),
                stop_token_ids=checks.token_ids(values, "stop_token_ids"),
                stop=_stop_strings(values.get("stop")),
                ignore_eos=checks.flag(values, "ignore_eos", False),
            )
        except TypeError as exc:
            raise RequestError(f"bad sampling_params: {exc}") from exc
        except checks.RequestRefused as exc:
            raise RequestError(str(exc)) from exc
        params.check()
        return params

    def check(self) -> None:
        """Ranges, in the form NaN fails too (``not 0 <= nan``): a value that reached a
        batch would fail every request sharing it."""
        if not 0 <= self.temperature < math.inf:
            raise RequestError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or not -1 <= self.top_k <= checks.MAX_TOP_K:
            raise RequestError(
                f"sampling_params.top_k must be -1 or in [1, {checks.MAX_TOP_K}], got {self.top_k}"
            )
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"sampling_params.min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise RequestError(
                f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}"
            )
        if any(not s or len(s) > MAX_STOP_CHARS for s in self.stop) or len(self.stop) > 16:
            raise RequestError(
                f"sampling_params.stop must be at most 16 strings of 1 to {MAX_STOP_CHARS} "
                "characters"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS or self.top_k == 1


@dataclass
class GenerateResult:
    """One finished request: SGLang's response object is ``to_sglang()``."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: dict[str, Any]
    weight_version: str
    e2e_latency: float
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def to_sglang(self, text: str = "") -> dict[str, Any]:
        """The JSON object SGLang's ``/generate`` returns for one input."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "e2e_latency": self.e2e_latency,
        }
        if self.output_logprobs is not None:
            meta["output_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(self.output_logprobs, self.output_ids, strict=True)
            ]
        return {"text": text, "output_ids": self.output_ids, "meta_info": meta}


@dataclass(eq=False)
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    future: Future = field(default_factory=Future)
    created: float = field(default_factory=time.perf_counter)
    aborted: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0


@dataclass(eq=False)
class _Control:
    fn: Any
    future: Future = field(default_factory=Future)


@dataclass(frozen=True)
class _Knobs:
    """Per-row sampling settings as tensors (greedy = temperature 1 with top_k 1)."""

    temps: torch.Tensor  # [B, 1]
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B]
    min_ps: torch.Tensor  # [B]

    @classmethod
    def of(cls, live: list[_Request], vocab_size: int) -> _Knobs:
        temps, top_ps, top_ks, min_ps = [], [], [], []
        for request in live:
            p = request.params
            greedy = p.temperature < _SAMPLING_EPS
            temps.append(1.0 if greedy else p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(1 if greedy else (p.top_k if p.top_k > 0 else vocab_size))
            min_ps.append(p.min_p)
        return cls(
            torch.tensor(temps, dtype=torch.float32)[:, None],
            torch.tensor(top_ps, dtype=torch.float32),
            torch.tensor(top_ks, dtype=torch.long),
            torch.tensor(min_ps, dtype=torch.float32),
        )

    def filtered(self, vocab_size: int) -> bool:
        return bool(
            (self.top_ks < vocab_size).any() or (self.top_ps < 1).any() or (self.min_ps > 0).any()
        )

    def select(self, index: torch.Tensor) -> _Knobs:
        return _Knobs(self.temps[index], self.top_ps[index], self.top_ks[index], self.min_ps[index])

    def cat(self, other: _Knobs) -> _Knobs:
        return _Knobs(
            torch.cat([self.temps, other.temps]),
            torch.cat([self.top_ps, other.top_ps]),
            torch.cat([self.top_ks, other.top_ks]),
            torch.cat([self.min_ps, other.min_ps]),
        )


def _left_pad(states: torch.Tensor, pad: int) -> torch.Tensor:
    """Left-pad a [B, H, L, D] cache tensor by ``pad`` positions (none if ``pad <= 0``)."""
    return torch.nn.functional.pad(states, (0, 0, pad, 0)) if pad > 0 else states


def _left_pad_mask(mask: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (pad, 0)) if pad > 0 else mask


def _is_dynamic_layer(layer: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer


@dataclass
class EngineStats:
    """Counters, read by the server's ``/get_server_info`` and by tests."""

    requests: int = 0
    batches: int = 0
    tokens_generated: int = 0
    aborted: int = 0
    max_batch_seen: int = 0
    rejected_busy: int = 0  # requests refused because max_pending were in flight
    prefill_tokens: int = 0  # tokens run through a prefill forward pass
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead
    #: seconds spent computing (batches and weight updates, under the compute lock): the
    #: generation phase's busy time, which benchmarks divide by trainer steps
    busy_s: float = 0.0


class Engine:
    """A batched, abortable generator around one ``PreTrainedModel`` on the CPU.

    ``start()`` launches the scheduler thread that serves ``submit``; ``generate`` runs a
    batch synchronously in the caller's thread instead (the in-process baseline of the
    benchmark). Both take the compute lock, so they never overlap.
    """

    def __init__(
        self,
        model: Any,
        *,
        model_path: str,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
        weight_version: str = "0",
        max_batch_size: int = 64,
        batch_wait_s: float = 0.0005,
        max_batch_wait_s: float = 0.005,
        seed: int | None = None,
        step_delay_s: float = 0.0,  # pause per decode step: a pacing knob for tests, no setting
        eos_token_ids: Iterable[int] | None = None,
        num_threads: int | None = None,
        max_pending: int = 1024,
        busy_retry_after_s: float = 1.0,
        prefix_cache_tokens: int = 0,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.model = model.eval()
        self.max_pending = max_pending
        self.busy_retry_after_s = busy_retry_after_s
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.weight_version = weight_version
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max_batch_wait_s
        self.step_delay_s = step_delay_s
        self.num_threads = num_threads
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        if eos_token_ids is None:
            eos = config.eos_token_id
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else torch.seed() & (2**63 - 1))
        self.stats = EngineStats()
        self._busy_since: float | None = None  # start of the busy time not yet counted
        self._busy_thread: int | None = None  # the thread that runs the busy block
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self._queue: collections.deque[_Request | _Control] = collections.deque()
        self._pending: dict[str, _Request] = {}  # queued or running, by rid
        self._cv = threading.Condition()
        self._compute = threading.RLock()
        self._running: list[_Request] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the scheduler thread."""
        self.abort(abort_all=True)
        with self._cv:
            self._stopped = True
            leftovers = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for item in leftovers:
            if isinstance(item, _Control):
                item.future.set_exception(RuntimeError("engine shut down"))
        if self._thread is not None:
            self._thread.join(timeout)

    # --- requests ----------------------------------------------------------------------

    def submit(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
    ) -> Future:
        """Queue one request; the future resolves to a ``GenerateResult``."""
        return self.submit_many([(input_ids, params, rid, return_logprob)])[0]

    def submit_many(
        self, items: Sequence[tuple[Sequence[int], SamplingParams, str | None, bool]]
    ) -> list[Future]:
        """Queue ``(input_ids, params, rid, return_logprob)`` requests, all or none: any
        invalid one raises ``RequestError`` before anything is queued, and ``EngineBusy``
        when they would take the engine past ``max_pending`` requests in flight."""
        requests = [self._make_request(ids, p, rid, lp) for ids, p, rid, lp in items]
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise RequestError("rid values must be unique")
        if len(requests) > self.max_pending:
            raise RequestError(
                f"a batch of {len(requests)} requests exceeds the engine's limit of "
                f"{self.max_pending} in flight: split it"
            )
        with self._cv:
            if self._stopped:
                raise RuntimeError("engine is shut down")
            busy = [rid for rid in rids if rid in self._pending]
            if busy:
                raise RequestError(f"rid {busy[0]!r} is already in flight")
            if len(self._pending) + len(requests) > self.max_pending:
                self.stats.rejected_busy += len(requests)
                raise EngineBusy(len(self._pending), self.max_pending, self.busy_retry_after_s)
            for request in requests:
                self._pending[request.rid] = request
                self._queue.append(request)
            self.stats.requests += len(requests)
            self._cv.notify_all()
        return [r.future for r in requests]

    def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        return_logprob: bool = True,
    ) -> list[GenerateResult]:
        """Run one batch now, in this thread (no queue, no batching window)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(input_ids)
        requests = [
            self._make_request(ids, p, None, return_logprob)
            for ids, p in zip(input_ids, params, strict=True)
        ]
        self._run_batch(requests)
        return [r.future.result() for r in requests]

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort one request (by rid) or all; returns how many were marked."""
        with self._cv:
            targets = list(self._pending.values()) if abort_all else []
            if rid is not None and rid in self._pending:
                targets.append(self._pending[rid])
            queued = []
            for request in targets:
                if not request.aborted:
                    request.aborted = True
                    self.stats.aborted += 1
                if request in self._queue:
                    self._queue.remove(request)
                    queued.append(request)
        for request in queued:  # never started: finish now, without tokens
            self._finish(request, {"type": "abort", "message": "Abort before prefill"})
        return len(targets)

    def _make_request(
        self, input_ids: Sequence[int], params: SamplingParams, rid: str | None, logprob: bool
    ) -> _Request:
        ids = [int(t) for t in input_ids]
        if not ids:
            raise RequestError("input_ids is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"input_ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise RequestError(
                f"prompt of {len(ids)} tokens leaves no room in the context of "
                f"{self.context_length} tokens"
            )
        params.check()
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the engine's tokenizer; this engine has none")
        return _Request(rid or uuid.uuid4().hex, ids, params, bool(logprob))

    # --- weights -----------------------------------------------------------------------

    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> Future:
        """Load ``state_dict`` between batches; the future resolves to the number of
        requests aborted first (``abort_all_requests``)."""

        def apply() -> int:
            load_state_dict_checked(self.model, state_dict)
            self._forget_prefixes()
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return aborted

        aborted = self.abort(abort_all=True) if abort_all_requests else 0
        return self._control(apply)

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> Future:
        """Load the safetensors files of a checkpoint directory (SGLang's
        ``/update_weights_from_disk``); the future resolves to the aborted count."""

        def apply() -> int:
            load_state_dict_checked(self.model, read_weights(Path(model_path)))
            self._forget_prefixes()
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return aborted

        aborted = self.abort(abort_all=True) if abort_all_requests else 0
        return self._control(apply)

    def _forget_prefixes(self) -> None:
        """Cached KV was computed by the old weights: never reuse it with new ones."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _control(self, fn: Any) -> Future:
        item = _Control(fn)
        if self._thread is None:  # no scheduler: run now, under the compute lock
            with self._compute:
                self._run_control(item)
            return item.future
        with self._cv:
            if self._stopped:
                raise RuntimeError("engine is shut down")
            self._queue.append(item)
            self._cv.notify_all()
        return item.future

    def _run_control(self, item: _Control) -> None:
        with self._busy():
            try:
                result = item.fn()
            except Exception as exc:  # handed to the caller through the future
                self._count_busy(stop=self._idle())
                item.future.set_exception(exc)
            else:
                self._count_busy(stop=self._idle())
                item.future.set_result(result)

    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info`` object."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # --- scheduler ---------------------------------------------------------------------

    def _loop(self) -> None:
        if self.num_threads:  # torch's intra-op thread count is per calling thread
            torch.set_num_threads(self.num_threads)
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                head = self._queue[0]
                if isinstance(head, _Control):
                    self._queue.popleft()
                else:
                    # Collect until no request arrived for batch_wait_s (a quiet gap), at
                    # most max_batch_wait_s: concurrent clients whose requests trickle in
                    # over a few ms still share one batch, a lone request waits one gap.
                    cap = time.monotonic() + max(self.max_batch_wait_s, self.batch_wait_s)
                    quiet = time.monotonic() + self.batch_wait_s
                    seen = len(self._queue)
                    while (
                        len(self._queue) < self.max_batch_size
                        and not any(isinstance(i, _Control) for i in self._queue)
                        and not self._stopped
                    ):
                        left = min(quiet, cap) - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(left)
                        if len(self._queue) != seen:
                            seen = len(self._queue)
                            quiet = time.monotonic() + self.batch_wait_s
                    batch: list[_Request] = []
                    while (
                        self._queue
                        and len(batch) < self.max_batch_size
                        and isinstance(self._queue[0], _Request)
                    ):
                        batch.append(self._queue.popleft())  # type: ignore[arg-type]
            if isinstance(head, _Control):
                with self._compute:
                    self._run_control(head)
                continue
            if batch:
                try:
                    self._run_batch(batch, join=True)
                except Exception as exc:  # fail the batch's requests, keep serving
                    logger.exception("engine batch failed")
                    for request in self._running:
                        if not request.future.done():
                            self._fail(request, exc)

    # --- compute -----------------------------------------------------------------------

    def _run_batch(self, requests: list[_Request], *, join: bool = False) -> None:
        """Prefill ``requests`` together, then decode until every row has finished. With
        ``join``, queued requests join the running batch at step boundaries."""
        self._running = list(requests)  # everything this batch owns, joiners included
        live = self._startable(requests)
        if not live:
            return
        with self._compute, torch.inference_mode(), self._busy():
            self.stats.batches += 1
            cache, logits, mask, last = self._prefill(live)
            knobs = _Knobs.of(live, self.vocab_size)
            self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(live))
            join = join and all(_is_dynamic_layer(layer) for layer in cache.layers)
            while True:
                tokens, keep = self._sample_step(live, logits, knobs)
                self._keep_prefixes(live, keep, cache, mask)
                if len(keep) < len(live):
                    if not keep:
                        return
                    index = torch.tensor(keep)
                    cache.batch_select_indices(index)
                    live = [live[i] for i in keep]
                    tokens, mask, last, knobs = (
                        tokens[index],
                        mask[index],
                        last[index],
                        knobs.select(index),
                    )
                if join and len(live) < self.max_batch_size:
                    taken = self._take_queued(self.max_batch_size - len(live))
                    self._running += taken
                    joiners = self._startable(taken)
                    if joiners:
                        live, tokens, mask, last, knobs = self._join(
                            joiners, cache, live, tokens, mask, last, knobs
                        )
                self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(live))
                # Hand the GIL over between steps (sleep(0) releases it), so that threads
                # serving HTTP or the worker's event loop are not starved by a long batch.
                time.sleep(self.step_delay_s)
                mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
                last = last + 1
                out = self.model(
                    input_ids=tokens[:, None],
                    attention_mask=mask,
                    position_ids=last[:, None],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                logits = out.logits[:, -1, :].float()

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Add the block's wall-clock seconds to ``stats.busy_s``."""
        self._busy_thread = threading.get_ident()
        self._busy_since = time.perf_counter()
        try:
            yield
        finally:
            self._count_busy(stop=True)

    def _count_busy(self, *, stop: bool = False) -> None:
        """Count the busy time so far: done before a result is handed out, so a caller
        that has its result also sees the compute that made it in ``stats.busy_s``.

        With ``stop``, the clock stops here: after the last result is handed out, what the
        busy block still does is bookkeeping, and counting it would make ``busy_s`` grow
        while a caller that holds every result sees the engine idle."""
        if self._busy_since is not None:
            now = time.perf_counter()
            self.stats.busy_s += now - self._busy_since
            self._busy_since = None if stop else now

    def _idle(self) -> bool:
        """Whether the busy block runs on this thread and no request is left in flight."""
        with self._cv:
            return not self._pending and self._busy_thread == threading.get_ident()

    def _startable(self, requests: list[_Request]) -> list[_Request]:
        """The requests that still need compute; the others are finished here."""
        live = []
        for request in requests:
            if request.aborted:
                if not request.future.done():
                    self._finish(request, {"type": "abort", "message": "Abort before prefill"})
            elif request.params.max_new_tokens == 0:
                self._finish(request, {"type": "length", "length": 0})
            else:
                live.append(request)
        return live

    def _take_queued(self, room: int) -> list[_Request]:
        """Queued requests from the front, up to ``room``, never past a control op."""
        taken: list[_Request] = []
        with self._cv:
            while (
                self._queue
                and len(taken) < room
                and not self._stopped
                and isinstance(self._queue[0], _Request)
            ):
                taken.append(self._queue.popleft())  # type: ignore[arg-type]
        return taken

    def _prefill(
        self, live: list[_Request]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prefill: the KV cache, last logits, attention mask, last positions."""
        from transformers import DynamicCache

        hits = [self._cached_prefix(r.input_ids) for r in live]
        if any(hit is not None for hit in hits):
            return self._prefill_after_prefixes(live, hits)
        self.stats.prefill_tokens += sum(len(r.input_ids) for r in live)
        width = max(len(r.input_ids) for r in live)
        ids = torch.full((len(live), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(live), width), dtype=torch.long)
        for row, request in enumerate(live):
            n = len(request.input_ids)
            ids[row, width - n :] = torch.tensor(request.input_ids)
            mask[row, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache, out.logits[:, -1, :].float(), mask, positions[:, -1]

    def _cached_prefix(self, ids: list[int]) -> PrefixHit | None:
        return None if self.prefix_cache is None else self.prefix_cache.lookup(ids)

    def _prefill_after_prefixes(
        self, live: list[_Request], hits: list[PrefixHit | None]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill only what follows each row's cached prefix. The cache starts as the
        prefixes, left-padded to the longest; the new tokens follow, left-padded too, so
        a row's padding may sit between its prefix and its new tokens: the attention mask
        hides it and positions count only real tokens, as the prefix was computed."""
        from transformers import DynamicCache

        reused = [0 if hit is None else hit.length for hit in hits]
        prefix = max(reused)
        width = max(len(r.input_ids) - n for r, n in zip(live, reused, strict=True))
        rows = len(live)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, prefix + width), dtype=torch.long)
        for row, (request, n) in enumerate(zip(live, reused, strict=True)):
            request.cached_tokens = n
            new = request.input_ids[n:]
            ids[row, width - len(new) :] = torch.tensor(new)
            mask[row, prefix - n : prefix] = 1
            mask[row, prefix + width - len(new) :] = 1
        cache = DynamicCache(config=self.model.config)
        template = next(hit for hit in hits if hit is not None)
        for layer, (keys, values) in enumerate(template.layers):
            heads, _, dim = keys.shape
            all_keys = keys.new_zeros((rows, heads, prefix, dim))
            all_values = values.new_zeros((rows, heads, prefix, values.shape[-1]))
            for row, hit in enumerate(hits):
                if hit is not None:
                    all_keys[row, :, prefix - hit.length :] = hit.layers[layer][0]
                    all_values[row, :, prefix - hit.length :] = hit.layers[layer][1]
            cache.update(all_keys, all_values, layer)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions[:, prefix:],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.reused_tokens += sum(reused)
        self.stats.prefill_tokens += sum(len(r.input_ids) for r in live) - sum(reused)
        return cache, out.logits[:, -1, :].float(), mask, positions[:, -1]

    def _keep_prefixes(
        self, rows: list[_Request], keep: list[int], cache: Any, mask: torch.Tensor
    ) -> None:
        """Store the KV of the rows that just finished: every token fed so far (the
        prompt and all output but the last sampled token, which was never fed)."""
        if self.prefix_cache is None or len(keep) == len(rows):
            return
        kept = set(keep)
        for row, request in enumerate(rows):
            if row in kept:
                continue
            valid = mask[row].bool()
            fed = request.input_ids + request.output_ids[:-1]
            if int(valid.sum()) != len(fed):
                continue  # not the layout this row was prefilled with: never guess
            layers = [
                (layer.keys[row][:, valid].clone(), layer.values[row][:, valid].clone())
                for layer in cache.layers
            ]
            self.prefix_cache.store(fed, layers)

    def _sample_step(
        self, live: list[_Request], logits: torch.Tensor, knobs: _Knobs
    ) -> tuple[torch.Tensor, list[int]]:
        """Draw one token per row, record it, finish rows that stop; returns the tokens
        and the rows that go on."""
        tokens, logps = self._sample(logits, knobs)
        keep: list[int] = []
        for row, request in enumerate(live):
            token = int(tokens[row])
            request.output_ids.append(token)
            request.logprobs.append(float(logps[row]))
            reason = self._stop_reason(request, token)
            if reason is None and request.aborted:
                reason = {"type": "abort", "message": "Aborted by abort_request"}
            if reason is None:
                keep.append(row)
            else:
                self._finish(request, reason)
        self.stats.tokens_generated += len(live)
        return tokens, keep

    def _join(
        self,
        joiners: list[_Request],
        cache: Any,
        live: list[_Request],
        tokens: torch.Tensor,
        mask: torch.Tensor,
        last: torch.Tensor,
        knobs: _Knobs,
    ) -> tuple[list[_Request], torch.Tensor, torch.Tensor, torch.Tensor, _Knobs]:
        """Prefill ``joiners``, draw their first token, and append them to the running
        batch: the shorter KV cache is left-padded (masked out) to the longer one."""
        new_cache, new_logits, new_mask, new_last = self._prefill(joiners)
        new_knobs = _Knobs.of(joiners, self.vocab_size)
        new_tokens, keep = self._sample_step(joiners, new_logits, new_knobs)
        self._keep_prefixes(joiners, keep, new_cache, new_mask)
        if not keep:
            return live, tokens, mask, last, knobs
        if len(keep) < len(joiners):
            index = torch.tensor(keep)
            new_cache.batch_select_indices(index)
            joiners = [joiners[i] for i in keep]
            new_tokens, new_mask, new_last = new_tokens[index], new_mask[index], new_last[index]
            new_knobs = new_knobs.select(index)
        gap = mask.shape[1] - new_mask.shape[1]
        for old, new in zip(cache.layers, new_cache.layers, strict=True):
            old_keys, new_keys = _left_pad(old.keys, -gap), _left_pad(new.keys, gap)
            old_values, new_values = _left_pad(old.values, -gap), _left_pad(new.values, gap)
            old.keys = torch.cat([old_keys, new_keys], dim=0)
            old.values = torch.cat([old_values, new_values], dim=0)
        mask = torch.cat([_left_pad_mask(mask, -gap), _left_pad_mask(new_mask, gap)], dim=0)
        return (
            live + joiners,
            torch.cat([tokens, new_tokens]),
            mask,
            torch.cat([last, new_last]),
            knobs.cat(new_knobs),
        )

    def _sample(self, logits: torch.Tensor, knobs: _Knobs) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return it with its log-prob under softmax(logits / T)."""
        logp = torch.log_softmax(logits / knobs.temps, dim=-1)
        probs = logp.exp()
        if not knobs.filtered(self.vocab_size):
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        else:
            # Filter on the sorted distribution (top-k, top-p, min-p), renormalise, draw.
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
            ranks = torch.arange(sorted_probs.shape[-1])[None, :]
            drop = (cumulative - sorted_probs) > knobs.top_ps[:, None]
            drop |= ranks >= knobs.top_ks[:, None]
            drop |= sorted_probs < (sorted_probs[:, :1] * knobs.min_ps[:, None])
            drop[:, 0] = False  # the most likely token always survives
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            picked = torch.multinomial(sorted_probs, 1, generator=self.generator)
            tokens = order.gather(1, picked).squeeze(1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        return tokens, chosen.clamp(min=torch.finfo(chosen.dtype).min)

    def _stop_reason(self, request: _Request, token: int) -> dict[str, Any] | None:
        params = request.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return {"type": "stop", "matched": token}
        if params.stop:
            # a stop string spans at most its length in tokens, plus one partly decoded
            window = max(len(s) for s in params.stop) + 1
            tail = self.tokenizer.decode(request.output_ids[-window:])
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(request.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if len(request.input_ids) + len(request.output_ids) >= self.context_length:
            return {"type": "length", "length": len(request.output_ids)}
        return None

    def _finish(self, request: _Request, reason: dict[str, Any]) -> None:
        with self._cv:
            self._pending.pop(request.rid, None)
        self._count_busy(stop=self._idle())
        result = GenerateResult(
            rid=request.rid,
            prompt_tokens=len(request.input_ids),
            output_ids=list(request.output_ids),
            output_logprobs=list(request.logprobs) if request.return_logprob else None,
            finish_reason=reason,
            weight_version=self.weight_version,
            e2e_latency=time.perf_counter() - request.created,
            cached_tokens=request.cached_tokens,
        )
        if not request.future.done():
            request.future.set_result(result)

    def _fail(self, request: _Request, exc: BaseException) -> None:
        with self._cv:
            self._pending.pop(request.rid, None)
        request.future.set_exception(exc)


# --- weights on disk ------------------------------------------------------------------


def save_weights(state_dict: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write ``state_dict`` as ``directory/model.safetensors`` (atomically: temp + rename).

    Tensors sharing storage (tied embeddings) are written once, under the first name, as
    Hugging Face checkpoints do; ``load_state_dict_checked`` accepts the missing alias.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    target = directory / "model.safetensors"
    staging = directory / f".model.safetensors.{uuid.uuid4().hex}.tmp"
    save_file(tensors, str(staging), metadata={"format": "pt"})
    staging.replace(target)
    return target


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in a checkpoint directory."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def load_state_dict_checked(model: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict`` that tolerates only missing aliases of tied tensors."""
    own = model.state_dict()
    unexpected = sorted(set(state_dict) - set(own))
    if unexpected:
        raise ValueError(f"weights have tensors the model lacks: {unexpected[:5]}")
    by_storage: dict[int, list[str]] = collections.defaultdict(list)
    for name, tensor in own.items():
        by_storage[tensor.untyped_storage().data_ptr()].append(name)
    missing = []
    for name in set(own) - set(state_dict):
        aliases = by_storage[own[name].untyped_storage().data_ptr()]
        if not any(alias in state_dict for alias in aliases):
            missing.append(name)
    if missing:
        raise ValueError(f"weights lack tensors of the model: {sorted(missing)[:5]}")
    with torch.no_grad():
        model.load_state_dict(dict(state_dict), strict=False)


# --- from config ----------------------------------------------------------------------


def engine_from_config(config: Any, cache_dir: Path) -> Engine:
    """An ``Engine`` (not started) for an ``EngineConfig``: its model spec loaded by
    ``core.models.load_model`` (the loader the old-logit service and the trainer use),
    with the spec's tokenizer; ``model_path`` is the spec's canonical name."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    spec = parse_model_spec(config.model)
    directory = model_directory(spec, cache_dir)
    return Engine(
        load_model(spec, config.dtype, cache_dir=cache_dir),
        model_path=spec.name,
        tokenizer=load_tokenizer(spec, cache_dir),
        tokenizer_path=None if directory is None else str(directory),
        max_batch_size=config.max_batch_size,
        batch_wait_s=config.batch_wait_ms / 1000.0,
        max_batch_wait_s=config.max_batch_wait_ms / 1000.0,
        seed=config.seed,
        num_threads=config.torch_threads,
        max_pending=config.max_pending_requests,
        busy_retry_after_s=config.busy_retry_after_s,
        prefix_cache_tokens=config.prefix_cache_tokens,
    )
