"""A call its client retries gets the first call's answer, not a second turn.

The ``openai`` and ``anthropic`` clients retry a call that timed out or was answered 409,
429 or 5xx: they send the same body again, with ``x-stainless-retry-count`` counting the
retries. Any client may name a call with an ``Idempotency-Key`` header instead. The gateway
keeps each episode's last call (``CallMemo``); a retry of it (the same key, sent as a
retry) waits for it while it generates and is answered with its turn, which enters the
episode once, when it is first delivered. A client that left before its answer leaves the
turn undelivered: a retry delivers it; any other call, or the idle timeout, ends the
episode as abandoned (its agent never saw that turn, so it is not trained).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from producers.gateway.answers import Envelope
from producers.rollout.generation import Sample

IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_COUNT_HEADER = "x-stainless-retry-count"
MAX_KEY_CHARS = 255


class BadRetryHeader(ValueError):
    """An ``Idempotency-Key`` or ``x-stainless-retry-count`` the gateway cannot use."""


@dataclass(frozen=True)
class Failure:
    """Why a call has no turn: the error its client is answered."""

    message: str
    status: int
    retry_after_s: int | None = None


@dataclass
class CallMemo:
    """An episode's last call: its key, and once it is over, its turn or its failure and
    whether a client has received the turn."""

    key: str
    envelope: Envelope  # the answer's id and time, the same in every answer to a retry
    message_id: str  # the Messages API's id
    prompt_tokens: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Sample | Failure | None = None
    delivered: bool = False

    def finish(self, outcome: Sample | Failure, *, delivered: bool) -> None:
        self.outcome, self.delivered = outcome, delivered
        self.done.set()

    @property
    def undelivered(self) -> bool:
        """A turn was generated and its client left before receiving it."""
        return self.done.is_set() and isinstance(self.outcome, Sample) and not self.delivered


def call_key(headers: Mapping[str, str], path: str, body: bytes) -> str:
    """The call's ``Idempotency-Key``, or else a digest of its path and body (a client's
    retry sends both unchanged)."""
    given = headers.get(IDEMPOTENCY_HEADER)
    if given is not None:
        if not 0 < len(given) <= MAX_KEY_CHARS or not given.isascii() or not given.isprintable():
            raise BadRetryHeader(
                f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_KEY_CHARS} printable ASCII characters"
            )
        return "key:" + given
    return "body:" + hashlib.sha256(path.encode() + b"\0" + body).hexdigest()


def is_retry(headers: Mapping[str, str]) -> bool:
    """Whether the call says it repeats an earlier one: an ``Idempotency-Key``, or a
    retry count of 1 or more."""
    if IDEMPOTENCY_HEADER in headers:
        return True
    count = headers.get(RETRY_COUNT_HEADER)
    if count is None:
        return False
    if not count.isascii() or not count.isdigit() or len(count) > 6:
        raise BadRetryHeader(
            f"{RETRY_COUNT_HEADER} must be a non-negative integer, got {count!r:.40}"
        )
    return int(count) > 0
