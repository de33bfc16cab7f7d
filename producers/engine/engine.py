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

This module is the scheduler and the public API. The rest lives beside it, one concern a
module: running one batch (``engine_batch``) and its KV-cache layout (``engine_kv``);
sampling numerics, SGLang's log-probs of ``softmax(logits / temperature)`` taken before
top-k / top-p / min-p filtering (``engine_sampling``); what a request may ask for and its
result (``engine_requests``); weights on disk (``engine_weights``).

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
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.config import LoraConfig
from core.models import (
    base_layer_names,
    is_adapter_tensor,
    load_model,
    load_tokenizer,
    model_directory,
    parse_model_spec,
)
from producers.engine.adapters import AdapterRefused, NamedAdapters, check_no_adapter
from producers.engine.batch import BatchRunner, EngineStats
from producers.engine.config import EngineConfig
from producers.engine.prefix_cache import PrefixCache
from producers.engine.requests import (
    EngineBusy,
    GenerateResult,
    Request,
    RequestError,
    SamplingParams,
    TokenListener,
    new_request,
)
from producers.engine.weights import AppliedTensors, load_state_dict_checked, read_weights

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Control:
    """A control operation (a weight update): run by the scheduler between batches."""

    fn: Any
    future: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Scheduling:
    """How the scheduler batches requests and how many it holds: ``[producers.engine]``'s
    batching and back-pressure settings, in seconds."""

    max_batch_size: int = 64
    batch_wait_s: float = 0.0005
    max_batch_wait_s: float = 0.005
    max_pending: int = 1024
    busy_retry_after_s: float = 1.0
    prefix_cache_tokens: int = 0
    num_threads: int | None = None
    step_delay_s: float = 0.0  # pause per decode step: a pacing knob for tests, no setting


class Engine(BatchRunner):
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
        seed: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        scheduling: Scheduling | None = None,
    ) -> None:
        scheduling = scheduling or Scheduling()
        if scheduling.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {scheduling.max_pending}")
        self.model = model.eval()
        self.max_pending = scheduling.max_pending
        self.busy_retry_after_s = scheduling.busy_retry_after_s
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.weight_version = weight_version
        self.applied = AppliedTensors()  # what update_weights loaded last
        self.adapters = NamedAdapters.of(self.model)  # None: no LoRA slot
        self.max_batch_size = scheduling.max_batch_size
        self.batch_wait_s = scheduling.batch_wait_s
        self.max_batch_wait_s = scheduling.max_batch_wait_s
        self.step_delay_s = scheduling.step_delay_s
        self.num_threads = scheduling.num_threads
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
        cache_tokens = scheduling.prefix_cache_tokens
        self.prefix_cache = PrefixCache(cache_tokens) if cache_tokens > 0 else None
        self._queue: collections.deque[Request | _Control] = collections.deque()
        self._pending: dict[str, Request] = {}  # queued or running, by rid
        self._cv = threading.Condition()
        self._compute = threading.RLock()
        self._running: list[Request] = []
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
        adapter: str | None = None,
        on_token: TokenListener | None = None,
    ) -> Future:
        """Queue one request; the future resolves to a ``GenerateResult``; ``on_token`` is
        told of each token as it is drawn (in the scheduler thread: it must be quick)."""
        item = (input_ids, params, rid, return_logprob)
        return self.submit_many([item], adapter, listeners=[on_token])[0]

    def submit_many(
        self,
        items: Sequence[tuple[Sequence[int], SamplingParams, str | None, bool]],
        adapter: str | None = None,
        *,
        listeners: Sequence[TokenListener | None] | None = None,
    ) -> list[Future]:
        """Queue ``(input_ids, params, rid, return_logprob)`` requests, all or none: any
        invalid one raises ``RequestError`` before anything is queued, and ``EngineBusy``
        when they would take the engine past ``max_pending`` requests in flight.
        ``adapter`` names the LoRA adapter they run with (``load_adapter``); ``listeners``,
        one per item, are told of their tokens as they are drawn (``submit``)."""
        requests = [self._make_request(ids, p, rid, lp) for ids, p, rid, lp in items]
        for request, listener in zip(requests, listeners or [None] * len(requests), strict=True):
            request.on_token = listener
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
            if self.adapters is None:
                check_no_adapter(adapter)
            else:
                self.adapters.check_request(adapter)
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
    ) -> Request:
        return new_request(
            input_ids,
            params,
            rid,
            logprob,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            tokenizer=self.tokenizer,
        )

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

        if any(is_adapter_tensor(name) for name in state_dict):
            self._forget_named_adapters()

        def load() -> None:
            copied = load_state_dict_checked(self.model, state_dict, self.applied)
            logger.debug("weights %s: %d tensors copied", weight_version, copied)

        return self._load_between_batches(load, weight_version, abort_all_requests)

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        sha256: str | None = None,
    ) -> Future:
        """Load the safetensors files of a checkpoint directory (SGLang's
        ``/update_weights_from_disk``), only if their bytes have ``sha256`` when given;
        the future resolves to the aborted count."""

        def load() -> None:
            self.applied.forget()
            load_state_dict_checked(
                self.model, self._as_model_state(read_weights(Path(model_path), sha256))
            )

        return self._load_between_batches(load, weight_version, abort_all_requests)

    def _load_between_batches(
        self, load: Callable[[], None], weight_version: str | None, abort_all_requests: bool
    ) -> Future:
        """Run ``load`` between batches, then serve ``weight_version`` with no cached
        prefix of the old weights; the future resolves to the requests aborted first."""

        def apply() -> int:
            load()
            self._forget_prefixes()
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return aborted

        aborted = self.abort(abort_all=True) if abort_all_requests else 0
        return self._control(apply)

    def _as_model_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors for this model: with a LoRA slot, a plain checkpoint (the
        base alone, as SGLang loads one) goes under the slot's names and keeps the adapter
        served; one that carries an adapter replaces it (named adapters are forgotten)."""
        if self.adapters is None:
            return state
        if any(is_adapter_tensor(name) for name in state):
            self._forget_named_adapters()
            return state
        own = self.model.state_dict()
        kept = {name: tensor for name, tensor in own.items() if is_adapter_tensor(name)}
        return {**base_layer_names(state, own), **kept}

    # --- named LoRA adapters (SGLang's dynamic LoRA API) -------------------------------

    def load_adapter(
        self, name: str, directory: Path, tensors: Mapping[str, torch.Tensor]
    ) -> Future:
        """Serve adapter ``name`` (``tensors``, read by ``adapters.read``) from the next
        batch on; requests must name it from now (``submit``'s ``adapter``)."""
        adapters = self.adapter_slot()
        with self._cv:
            if name in adapters.loaded:
                raise AdapterRefused(f"LoRA adapter {name!r} is already loaded")
            adapters.loaded[name] = str(directory)
            adapters.serving = name
            return self._control(lambda: self._copy_adapter(tensors))

    def unload_adapter(self, name: str) -> Future:
        """Forget adapter ``name``; if it is the one served, serve the base model (from
        the next batch on)."""
        adapters = self.adapter_slot()
        with self._cv:
            if name not in adapters.loaded:
                raise AdapterRefused(f"LoRA adapter {name!r} is not loaded")
            del adapters.loaded[name]
            if adapters.serving != name:
                done: Future = Future()
                done.set_result(0)
                return done
            adapters.serving = None
            return self._control(lambda: self._copy_adapter(adapters.zeros()))

    @property
    def serving_adapter(self) -> str | None:
        """The adapter a request queued now must name (None: none)."""
        return self.adapters.serving if self.adapters is not None else None

    def adapter_slot(self) -> NamedAdapters:
        """The named adapters; ``AdapterRefused`` when the model has no LoRA slot."""
        if self.adapters is None:
            raise AdapterRefused(
                "this engine has no LoRA slot: start it with the run's [lora] table "
                "(as SGLang needs --enable-lora)"
            )
        return self.adapters

    def _copy_adapter(self, tensors: Mapping[str, torch.Tensor]) -> int:
        self.applied.forget()
        with torch.no_grad():
            self.model.load_state_dict(dict(tensors), strict=False)
        self._forget_prefixes()
        return 0

    def _forget_named_adapters(self) -> None:
        """Weights that carry their own adapter replace whatever was loaded by name."""
        if self.adapters is not None:
            with self._cv:
                self.adapters.loaded.clear()
                self.adapters.serving = None

    def flush_cache(self) -> Future:
        """Forget every cached prefix, between batches (``/flush_cache``)."""
        return self._control(self._forget_prefixes)

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
                    batch: list[Request] = []
                    while (
                        self._queue
                        and len(batch) < self.max_batch_size
                        and isinstance(self._queue[0], Request)
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

    def _take_queued(self, room: int) -> list[Request]:
        """Queued requests from the front, up to ``room``, never past a control op."""
        taken: list[Request] = []
        with self._cv:
            while (
                self._queue
                and len(taken) < room
                and not self._stopped
                and isinstance(self._queue[0], Request)
            ):
                taken.append(self._queue.popleft())  # type: ignore[arg-type]
        return taken

    # --- busy time ---------------------------------------------------------------------

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

    # --- results -----------------------------------------------------------------------

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
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

    def _fail(self, request: Request, exc: BaseException) -> None:
        with self._cv:
            self._pending.pop(request.rid, None)
        request.future.set_exception(exc)


# --- from config ----------------------------------------------------------------------


def engine_from_config(
    config: EngineConfig, cache_dir: Path, lora: LoraConfig | None = None
) -> Engine:
    """An ``Engine`` (not started) for an ``EngineConfig``: its model spec loaded by
    ``core.models.load_model`` (the loader the old-logit service and the trainer use, with
    the run's LoRA adapter if it has one), with the spec's tokenizer; ``model_path`` is the
    spec's canonical name."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    spec = parse_model_spec(config.model)
    directory = model_directory(spec, cache_dir)
    return Engine(
        load_model(spec, config.dtype, cache_dir=cache_dir, lora=lora),
        model_path=spec.name,
        tokenizer=load_tokenizer(spec, cache_dir),
        tokenizer_path=None if directory is None else str(directory),
        seed=config.seed,
        scheduling=Scheduling(
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000.0,
            max_batch_wait_s=config.max_batch_wait_ms / 1000.0,
            max_pending=config.max_pending_requests,
            busy_retry_after_s=config.busy_retry_after_s,
            prefix_cache_tokens=config.prefix_cache_tokens,
            num_threads=config.torch_threads,
        ),
    )
