"""Back-off for S3 and broker outages (tenacity), shared by the trainer's I/O paths.

An outage never skips work: publishing, DLQ flushes and checkpoint-side I/O are retried
with exponential back-off and jitter (``RetryConfig``) until they succeed, or until
``give_up_after_s`` when configured. Every retry is logged with what was being attempted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    stop_when_event_set,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from core.config import RetryConfig

log = logging.getLogger(__name__)


def retrying(
    config: RetryConfig,
    exceptions: tuple[type[BaseException], ...],
    what: str,
    *,
    quick: bool = False,
    max_attempts: int | None = None,
    stop_event: threading.Event | None = None,
    on_retry: Callable[[BaseException | None], None] | None = None,
) -> Retrying:
    """A tenacity ``Retrying`` for ``exceptions``; ``quick``: three attempts at most,
    ``max_attempts``: that many at most.

    ``stop_event``: back-off sleeps wake up and retrying ends (re-raising the last error)
    once it is set, so a thread that retries forever can still be stopped. ``on_retry``
    is called with each failure before its back-off (a metric, a state flag).
    """

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        if on_retry is not None:
            on_retry(exc)
        log.warning(
            "%s failed (attempt %d): %s; retrying in %.1fs", what, state.attempt_number, exc, delay
        )

    stop: stop_base = stop_after_attempt(3) if quick else stop_never
    if max_attempts is not None:
        stop = stop | stop_after_attempt(max_attempts)
    if config.give_up_after_s is not None:
        stop = stop | stop_after_delay(config.give_up_after_s)
    sleep: Callable[[float], object] = time.sleep
    if stop_event is not None:
        stop = stop | stop_when_event_set(stop_event)
        sleep = stop_event.wait
    return Retrying(
        retry=retry_if_exception_type(exceptions),
        # jitter of at most the first back-off: quick policies stay quick
        wait=wait_exponential_jitter(
            multiplier=config.initial_s, max=config.max_s, jitter=min(1.0, config.initial_s)
        ),
        stop=stop,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
