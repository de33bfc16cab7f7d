"""Back-off for S3 and broker outages (tenacity), shared by the trainer's I/O paths.

An outage never skips work: publishing, DLQ flushes and checkpoint-side I/O are retried
with exponential back-off and jitter (``RetryConfig``) until they succeed, or until
``give_up_after_s`` when configured. Every retry is logged with what was being attempted.
"""

from __future__ import annotations

import logging

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
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
) -> Retrying:
    """A tenacity ``Retrying`` for ``exceptions``; ``quick``: three attempts at most."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning(
            "%s failed (attempt %d): %s; retrying in %.1fs", what, state.attempt_number, exc, delay
        )

    if quick:
        stop = stop_after_attempt(3)
    elif config.give_up_after_s is not None:
        stop = stop_after_delay(config.give_up_after_s)
    else:
        stop = stop_never
    return Retrying(
        retry=retry_if_exception_type(exceptions),
        wait=wait_exponential_jitter(multiplier=config.initial_s, max=config.max_s),
        stop=stop,
        before_sleep=before_sleep,
        reraise=True,
    )
