"""Back-off for S3 and broker outages (tenacity), shared by the trainer's I/O paths.

An outage never skips work: publishing, DLQ flushes and checkpoint-side I/O are retried
with exponential back-off and jitter (``RetryConfig``) until they succeed, or until
``give_up_after_s`` when configured. Every retry is logged with what was being attempted.

An error that waiting cannot cure (``permanent``: denied credentials or authorization, a
missing topic or bucket, a record or config the broker refuses) is raised at once, with its cause,
instead of being retried for ever while the role looks alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from botocore.exceptions import (
    ClientError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
)
from confluent_kafka import KafkaError, KafkaException
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    stop_when_event_set,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from core.config import RetryConfig

log = logging.getLogger(__name__)

#: Kafka errors that mean "not allowed" or "never valid": retrying sends the same request.
PERMANENT_KAFKA = frozenset(
    {
        "TOPIC_AUTHORIZATION_FAILED",
        "GROUP_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
        "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
        "SASL_AUTHENTICATION_FAILED",
        "_AUTHENTICATION",
        "UNSUPPORTED_SASL_MECHANISM",
        "UNKNOWN_TOPIC_OR_PART",
        "_UNKNOWN_TOPIC",
        "_UNKNOWN_PARTITION",
        "TOPIC_EXCEPTION",
        "INVALID_CONFIG",
        "POLICY_VIOLATION",
        "INVALID_REPLICATION_FACTOR",
        "INVALID_PARTITIONS",
        "MSG_SIZE_TOO_LARGE",
        "_MSG_SIZE_TOO_LARGE",
        "RECORD_LIST_TOO_LARGE",
        "INVALID_RECORD",
        "_INVALID_ARG",
    }
)
#: S3 error codes of refused credentials or access, or of a bucket that is not there (any
#: 401/403 answer counts too).
PERMANENT_S3 = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidBucketName",
        "NoSuchBucket",  # a misspelt or deleted bucket: waiting never creates it
    }
)


def permanent(exc: BaseException) -> bool:
    """Whether ``exc`` is an error no retry can cure: a fatal or refused Kafka request
    (``PERMANENT_KAFKA``), an S3 request refused for its credentials or access, or no
    usable credentials at all. Outages, timeouts, throttling and 5xx answers are not.
    An error raised while handling another (boto3's upload errors wrap the S3 answer)
    is judged by that one too."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if _permanent(cause):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _permanent(exc: BaseException) -> bool:
    if isinstance(exc, KafkaException):
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError):
            return err.fatal() or err.name() in PERMANENT_KAFKA
        return False
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error.get("Code") in PERMANENT_S3 or status in (401, 403)
    return isinstance(exc, (NoCredentialsError, PartialCredentialsError, ParamValidationError))


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

    A ``permanent`` error is never retried: it is logged and raised as it is.
    """

    def retriable(exc: BaseException) -> bool:
        if not isinstance(exc, exceptions):
            return False
        if permanent(exc):
            log.error("%s failed with an error retrying cannot cure: %s", what, exc)
            return False
        return True

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
        retry=retry_if_exception(retriable),
        # jitter of at most the first back-off: quick policies stay quick
        wait=wait_exponential_jitter(
            multiplier=config.initial_s, max=config.max_s, jitter=min(1.0, config.initial_s)
        ),
        stop=stop,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
