"""The shared read-to-the-end loop (``core.topic_reader``) on the real broker, with
transactions in every state the stream worker leaves them: committed (the last offset is
a commit marker), aborted (a killed worker) and open (a worker that hangs); and the tests'
own reader (``support.streams.read_topic``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer

from core.config import KafkaConfig
from core.topic_reader import ReadStalled, read_range, reader_config, whole_topic
from infra.topics import ensure_topics
from schemas.topics import TopicSpec


def _transactional(kafka: KafkaConfig) -> Producer:
    producer = Producer({**kafka.client_config(), "transactional.id": f"t-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    return producer


def _send(producer: Producer, topic: str, values: list[bytes], *, commit: bool) -> None:
    producer.begin_transaction()
    for value in values:
        producer.produce(topic, value=value, partition=0)
    producer.flush(30)
    if commit:
        producer.commit_transaction(30)
    else:
        producer.abort_transaction(30)


def _read(kafka: KafkaConfig, topic: str, idle_timeout_s: float) -> list[bytes]:
    consumer = Consumer(reader_config(kafka.client_config(), "test"))
    try:
        plan = whole_topic(consumer, topic)
        return [m.value() for m in read_range(consumer, topic, plan, idle_timeout_s)]
    finally:
        consumer.close()


def test_reads_committed_records_to_the_end_past_markers(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("reader")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, partitions=2)])
    producer = _transactional(kafka_config)
    _send(producer, topic, [b"a", b"b"], commit=True)
    _send(producer, topic, [b"dead"], commit=False)  # a killed worker's transaction
    _send(producer, topic, [b"c"], commit=True)  # the last offset is a commit marker

    started = time.monotonic()
    values = _read(kafka_config, topic, idle_timeout_s=20.0)

    assert values == [b"a", b"b", b"c"]
    assert time.monotonic() - started < 10, "the end behind a marker must not wait out the timeout"


def test_an_open_transaction_ends_the_plan_and_stalls_a_read_past_it(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    """``read_committed`` watermarks stop at the last stable offset, so a whole-topic read
    ends before an open transaction at once; a plan that reaches into it (explicit end
    offsets) stalls and says which partitions are short."""
    topic = unique_name("reader-open")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, partitions=1)])
    producer = _transactional(kafka_config)
    _send(producer, topic, [b"a"], commit=True)
    producer.begin_transaction()
    producer.produce(topic, value=b"pending", partition=0)
    producer.flush(30)
    try:
        started = time.monotonic()
        assert _read(kafka_config, topic, idle_timeout_s=20.0) == [b"a"]
        assert time.monotonic() - started < 10

        consumer = Consumer(reader_config(kafka_config.client_config(), "test"))
        try:
            stable_end = whole_topic(consumer, topic)[0][1]
            past_it = {0: (0, stable_end + 1)}  # the pending record's offset included
            seen: list[bytes] = []
            with pytest.raises(ReadStalled) as stalled:
                for msg in read_range(consumer, topic, past_it, idle_timeout_s=2.0):
                    seen.append(msg.value())
        finally:
            consumer.close()
        assert seen == [b"a"], "records before the open transaction are read"
        assert stalled.value.short == {0: stable_end + 1}
        assert "did not reach their end offsets" in str(stalled.value)
    finally:
        producer.abort_transaction(30)


def test_the_tests_own_reader_raises_rather_than_return_short(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    """``support.streams.read_topic``, which tests wait with for an output or a kill point:
    a condition never met raises (it returned what it had), and a read to the end finishes
    past empty partitions and an aborted transaction."""
    from support.streams import read_topic

    topic = unique_name("reader-support")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, partitions=3)])
    producer = _transactional(kafka_config)
    _send(producer, topic, [b"a", b"b"], commit=True)
    _send(producer, topic, [b"dead"], commit=False)

    found = read_topic(kafka_config.client_config(), [topic], timeout=30)
    assert [m.value() for m in found] == [b"a", b"b"]
    with pytest.raises(TimeoutError, match="condition not met"):
        read_topic(kafka_config.client_config(), [topic], until=lambda m: len(m) >= 3, timeout=3)
