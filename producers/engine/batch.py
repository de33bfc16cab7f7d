"""Running one batch to completion: prefill, then decode step by step, rows leaving as
they finish and queued requests joining at step boundaries (continuous batching).

``BatchRunner`` is the compute half of ``producers.engine.engine.Engine``: it works on
the engine's model, counters and prefix cache, and leaves to the engine (through the
abstract hooks) where joiners come from, how a finished request is handed out, and how
busy time is counted, which belong to the scheduler's locking.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from producers.engine.kv import (
    Prefill,
    append_rows,
    is_dynamic_layer,
    keep_prefixes,
    prefill,
    prefill_after_prefixes,
)
from producers.engine.prefix_cache import PrefixCache, PrefixHit
from producers.engine.requests import Request, stop_reason
from producers.engine.sampling import Knobs, sample


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


class BatchRunner(abc.ABC):
    """Prefill, sampling and decode of a batch, on the attributes an ``Engine`` sets."""

    model: Any
    tokenizer: Any
    vocab_size: int
    context_length: int
    pad_id: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator
    max_batch_size: int
    step_delay_s: float
    stats: EngineStats
    prefix_cache: PrefixCache | None
    _compute: threading.RLock
    _running: list[Request]  # everything the current batch owns, joiners included

    @abc.abstractmethod
    def _busy(self) -> contextlib.AbstractContextManager[None]:
        """A block whose wall-clock seconds count as busy time."""

    @abc.abstractmethod
    def _take_queued(self, room: int) -> list[Request]:
        """Queued requests that may join the running batch, up to ``room``."""

    @abc.abstractmethod
    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        """Hand out ``request``'s result, finished for ``reason``."""

    def _run_batch(self, requests: list[Request], *, join: bool = False) -> None:
        """Prefill ``requests`` together, then decode until every row has finished. With
        ``join``, queued requests join the running batch at step boundaries."""
        self._running = list(requests)  # everything this batch owns, joiners included
        live = self._startable(requests)
        if not live:
            return
        with self._compute, torch.inference_mode(), self._busy():
            self.stats.batches += 1
            cache, logits, mask, last = self._prefill(live)
            knobs = Knobs.of(live, self.vocab_size)
            self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(live))
            join = join and all(is_dynamic_layer(layer) for layer in cache.layers)
            while True:
                tokens, keep = self._sample_step(live, logits, knobs)
                keep_prefixes(self.prefix_cache, live, keep, cache, mask)
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

    def _startable(self, requests: list[Request]) -> list[Request]:
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

    def _prefill(self, live: list[Request]) -> Prefill:
        """Left-padded prefill of ``live``, after each row's cached prefix if it has one;
        counts the tokens computed and reused."""
        rows = [r.input_ids for r in live]
        hits = [self._cached_prefix(ids) for ids in rows]
        if any(hit is not None for hit in hits):
            reused = [0 if hit is None else hit.length for hit in hits]
            for request, n in zip(live, reused, strict=True):
                request.cached_tokens = n
            out = prefill_after_prefixes(self.model, self.pad_id, rows, hits)
            self.stats.reused_tokens += sum(reused)
            self.stats.prefill_tokens += sum(len(ids) for ids in rows) - sum(reused)
            return out
        self.stats.prefill_tokens += sum(len(ids) for ids in rows)
        return prefill(self.model, self.pad_id, rows)

    def _cached_prefix(self, ids: list[int]) -> PrefixHit | None:
        return None if self.prefix_cache is None else self.prefix_cache.lookup(ids)

    def _sample_step(
        self, live: list[Request], logits: torch.Tensor, knobs: Knobs
    ) -> tuple[torch.Tensor, list[int]]:
        """Draw one token per row, record it, finish rows that stop; returns the tokens
        and the rows that go on."""
        tokens, logps = sample(logits, knobs, self.vocab_size, self.generator)
        keep: list[int] = []
        for row, request in enumerate(live):
            token = int(tokens[row])
            request.output_ids.append(token)
            request.logprobs.append(float(logps[row]))
            if request.on_token is not None:
                request.on_token(token, request.logprobs[-1])
            reason = stop_reason(
                request,
                token,
                eos_token_ids=self.eos_token_ids,
                context_length=self.context_length,
                tokenizer=self.tokenizer,
            )
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
        joiners: list[Request],
        cache: Any,
        live: list[Request],
        tokens: torch.Tensor,
        mask: torch.Tensor,
        last: torch.Tensor,
        knobs: Knobs,
    ) -> tuple[list[Request], torch.Tensor, torch.Tensor, torch.Tensor, Knobs]:
        """Prefill ``joiners``, draw their first token, and append them to the running
        batch: the shorter KV cache is left-padded (masked out) to the longer one."""
        new_cache, new_logits, new_mask, new_last = self._prefill(joiners)
        new_knobs = Knobs.of(joiners, self.vocab_size)
        new_tokens, keep = self._sample_step(joiners, new_logits, new_knobs)
        keep_prefixes(self.prefix_cache, joiners, keep, new_cache, new_mask)
        if not keep:
            return live, tokens, mask, last, knobs
        if len(keep) < len(joiners):
            index = torch.tensor(keep)
            new_cache.batch_select_indices(index)
            joiners = [joiners[i] for i in keep]
            new_tokens, new_mask, new_last = new_tokens[index], new_mask[index], new_last[index]
            new_knobs = new_knobs.select(index)
        mask = append_rows(cache, mask, new_cache, new_mask)
        return (
            live + joiners,
            torch.cat([tokens, new_tokens]),
            mask,
            torch.cat([last, new_last]),
            knobs.cat(new_knobs),
        )
