"""Errors no retry can cure fail fast, with their cause (``core.retry.permanent``).

Wrong S3 credentials, a missing topic or a refused authorization used to be retried with
back-off for ever: the trainer (or a follower) looked alive and did nothing. Outages,
timeouts and 5xx answers are still retried.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch
from botocore.exceptions import ClientError, EndpointConnectionError
from confluent_kafka import KafkaError, KafkaException

from consumers.config import PublishConfig
from consumers.weight_publisher import Publisher
from core.config import KafkaConfig, RetryConfig, S3Config
from core.models import build_tiny_llama
from core.retry import permanent, retrying
from weights.announce import Announcer
from weights.follower import WeightFollower
from weights.store import WeightStore
from weights.writer import DeltaWriter

#: Long enough for a few quick attempts, far shorter than retrying for ever.
FAST_S = 30.0


def wrong_secret(s3: S3Config) -> S3Config:
    key = s3.access_key_id or os.environ["AWS_ACCESS_KEY_ID"]  # a store given by the env
    return S3Config(
        **{**s3.model_dump(), "access_key_id": key, "secret_access_key": "not-the-secret"}
    )


def finishes(fn: Callable[[], object], within_s: float = FAST_S) -> BaseException:
    """Run ``fn`` in a thread; return what it raised, failing the test if it does not end
    within ``within_s`` (it would be retrying for ever)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"still retrying after {time.monotonic() - started:.0f}s"
    assert raised, "returned instead of failing"
    return raised[0]


def state() -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in build_tiny_llama(seed=1).state_dict().items()}


def client_error(code: str, status: int) -> ClientError:
    response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")  # type: ignore[arg-type]


def test_permanent_tells_refusals_from_outages() -> None:
    assert permanent(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
    assert permanent(KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)))
    assert permanent(KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)))
    assert permanent(KafkaException(KafkaError(KafkaError._FENCED, fatal=True)))
    assert not permanent(KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT)))
    assert not permanent(KafkaException(KafkaError(KafkaError._TRANSPORT)))
    assert not permanent(KafkaException(KafkaError(KafkaError.NOT_ENOUGH_REPLICAS)))
    assert permanent(client_error("AccessDenied", 403))
    assert permanent(client_error("SignatureDoesNotMatch", 403))
    assert not permanent(client_error("SlowDown", 503))
    assert not permanent(client_error("InternalError", 500))
    assert not permanent(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))

    calls = []

    def denied() -> None:
        calls.append(1)
        raise client_error("AccessDenied", 403)

    with pytest.raises(ClientError, match="AccessDenied"):
        for attempt in retrying(RetryConfig(initial_s=0.01), (ClientError,), "put"):
            with attempt:
                denied()
    assert len(calls) == 1


def test_publisher_and_follower_with_wrong_s3_credentials_fail_fast(s3_config: S3Config) -> None:
    store = WeightStore.from_config(wrong_secret(s3_config), "run-denied")
    publisher = Publisher(DeltaWriter(store), PublishConfig(), RetryConfig(max_s=1.0))
    weights = state()
    err = finishes(lambda: publisher.publish(0, weights))
    assert "SignatureDoesNotMatch" in str(err)  # boto3 wraps the upload's ClientError

    follower = WeightFollower(store, retry_max_s=1.0)
    err = finishes(lambda: follower.sync_with_retry())
    assert isinstance(err, ClientError) and "SignatureDoesNotMatch" in str(err)


def test_a_follower_of_a_missing_bucket_fails_fast(s3_config: S3Config) -> None:
    # (SeaweedFS creates a bucket on a first upload, so only a reader can meet this here)
    missing = s3_config.model_copy(update={"bucket": f"{s3_config.bucket}-misspelt"})
    follower = WeightFollower(WeightStore.from_config(missing, "run-no-bucket"), retry_max_s=1.0)
    err = finishes(lambda: follower.sync_with_retry())
    assert isinstance(err, ClientError) and "NoSuchBucket" in str(err)


def test_announcing_to_a_missing_topic_fails_fast(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name: Callable[[str], str]
) -> None:
    # librdkafka waits this long for a topic to appear before it reports it unknown
    client = {**kafka_config.client_config(), "topic.metadata.propagation.max.ms": "2000"}
    announcer = Announcer(client, topic=unique_name("no-such-topic"), timeout_s=10)
    store = WeightStore.from_config(s3_config, "run-missing-topic")
    publisher = Publisher(
        DeltaWriter(store), PublishConfig(), RetryConfig(max_s=1.0), announcer=announcer
    )
    weights = state()
    err = finishes(lambda: publisher.publish(0, weights))
    assert isinstance(err, KafkaException) and "UNKNOWN_TOPIC" in str(err)
