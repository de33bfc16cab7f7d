"""Back-off for S3 and broker outages (tenacity), shared by the trainer's I/O paths.

An outage never skips work: publishing, DLQ flushes and checkpoint-side I/O are retried
with exponential back-off and jitter (``RetryConfig``) until they succeed, or until
``give_up_after_s`` when configured. Every retry is logged with what was being attempted.
"""

from __future__ import annotations

import logging
import threading
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

from core.config import RetryConfig

log = logging.getLogger(__name__)


def retrying(
    config: RetryConfig,
    exceptions: tuple[type[BaseException], ...],
    what: str,
    *,
    quick: bool = False,
    stop_event: threading.Event | None = None,
    on_retry: Callable[[BaseException | None], None] | None = None,
) -> Retrying:
    """A tenacity ``Retrying`` for ``exceptions``; ``quick``: three attempts at most.

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

    if quick:
        stop = stop_after_attempt(3)
    elif config.give_up_after_s is not None:
        stop = stop_after_delay(config.give_up_after_s)
    else:
        stop = stop_never
    if stop_event is not None:
        return Retrying(
            retry=retry_if_exception_type(exceptions),
            wait=wait_exponential_jitter(multiplier=config.initial_s, max=config.max_s),
            stop=stop | stop_when_event_set(stop_event),
            sleep=stop_event.wait,
            before_sleep=before_sleep,
            reraise=True,
        )
    return Retrying(
        retry=retry_if_exception_type(exceptions),
        wait=wait_exponential_jitter(multiplier=config.initial_s, max=config.max_s),
        stop=stop,
        before_sleep=before_sleep,
        reraise=True,
    )
