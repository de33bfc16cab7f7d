"""The trainer's side topics (dead letters, stale groups) on the real broker.

A scored group may be as large as its topic allows (megabytes for long responses); the
trainer must be able to dead-letter it or route it stale, or it stops after a checkpoint
and fails the same way on every restart. A record whose delivery fails is sent again
until it is acknowledged: the trainer never goes past (checkpoints, commits) a dead letter
or stale group that is not in its topic.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource
from support.synthetic import scored_group, synthetic_groups
from support.trainer_runs import produce, read_all

from consumers.batching import StaleGroup
from consumers.config import BatchConfig, TopicsConfig
from consumers.source import ScoredSource, TrainableRecords
from core.config import KafkaConfig, RetryConfig
from infra.topics import ensure_topics
from schemas.control import DeadLetter, StaleRecord
from schemas.group import encode_group
from schemas.topics import MIB, ROLLOUTS_DLQ, ROLLOUTS_SCORED, ROLLOUTS_STALE

RUN = "side-topics"


def side_topics(
    kafka: KafkaConfig, unique_name: Callable[[str], str], **extra: str
) -> TopicsConfig:
    """Scored, DLQ and stale topics of their own; ``extra`` topic configs on the side ones."""
    topics = TopicsConfig(
        scored=unique_name("rollouts.scored"),
        dlq=unique_name("rollouts.dlq"),
        stale=unique_name("rollouts.stale"),
        group_id=unique_name("trainer"),
    )
    specs = [dataclasses.replace(ROLLOUTS_SCORED, name=topics.scored)] + [
        dataclasses.replace(spec, name=name, extra_configs={**spec.extra_configs, **extra})
        for spec, name in ((ROLLOUTS_DLQ, topics.dlq), (ROLLOUTS_STALE, topics.stale))
    ]
    ensure_topics(kafka.client_config(), specs)
    return topics


def source_for(kafka: dict[str, str], topics: TopicsConfig, **batch: object) -> ScoredSource:
    return ScoredSource(
        kafka,
        topics,
        BatchConfig(max_groups=1, max_wait_s=0.5, **batch),  # type: ignore[arg-type]
        RetryConfig(initial_s=0.2, max_s=1.0),
        accepts=TrainableRecords(run_id=RUN, vocab_size=16, max_length=1_000_000),
    )


def dead_letter_all(source: ScoredSource, count: int, timeout_s: float = 60) -> None:
    """Let ``source`` read until it has dead-lettered ``count`` records (a micro-batch of
    dead letters alone never closes, so the read is stopped from here)."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def read() -> None:
        try:
            source.next_micro_batch(stop)
        except BaseException as exc:
            failed.append(exc)
            raise

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while source.dlq.sent < count and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.1)
    stop.set()
    thread.join(30)
    if failed:
        raise failed[0]
    assert source.dlq.sent == count


def big_group(seed: int, megabytes: float, *, untrainable: bool = False) -> tuple[str, bytes]:
    """A scored group of about ``megabytes`` MB (long responses), encoded; ``untrainable``:
    a token out of the source's vocabulary (16), so the trainer dead-letters it."""
    length = int(megabytes * 1e6 / 4 / 12)  # ~12 bytes a response token, 4 samples
    [group] = synthetic_groups(1, seed=seed, run_id=RUN, response_len=length, vary_lengths=False)
    if untrainable:
        group[0] = dataclasses.replace(group[0], response_ids=group[0].response_ids + 40)
    value = encode_group(scored_group(group))
    assert 2e6 <= len(value) <= 4 * MIB, len(value)
    return group[0].group_id, value


def stale(group_id: str, value: bytes) -> StaleGroup:
    return StaleGroup(
        step=1,
        group_id=group_id,
        trajectory_ids=(),
        staleness=9,
        trainer_version=9,
        max_staleness=2,
        key=group_id.encode(),
        value=value,
        headers=(),
        topic="rollouts.scored",
        partition=0,
        offset=0,
    )


def test_groups_of_several_megabytes_are_dead_lettered_and_routed_stale(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    topics = side_topics(kafka_config, unique_name)
    dead_id, dead = big_group(1, 3.0, untrainable=True)
    stale_id, stale_value = big_group(2, 2.5)
    producer = Producer(
        {**kafka_config.client_config(), "message.max.bytes": ROLLOUTS_SCORED.max_message_bytes}
    )
    producer.produce(topics.scored, key=dead_id.encode(), value=dead)
    assert producer.flush(30) == 0

    source = source_for(kafka_config.client_config(), topics)
    try:
        dead_letter_all(source, 1)
        source.flush_dead_letters()
        source.route_stale([stale(stale_id, stale_value)])
    finally:
        source.close()

    [letter] = read_all(kafka_config, topics.dlq, expected=1)
    assert letter.value() == dead  # the original bytes
    assert DeadLetter.from_headers(letter.headers()).reason == "token_out_of_range"
    [routed] = read_all(kafka_config, topics.stale, expected=1)
    assert routed.value() == stale_value
    assert StaleRecord.from_headers(routed.headers()).trajectory_id == stale_id


def set_topic_config(kafka: KafkaConfig, names: list[str], key: str, value: str) -> None:
    admin = AdminClient(kafka.client_config())
    for name in names:
        resource = ConfigResource(
            "topic",
            name,
            incremental_configs=[
                ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)
            ],
        )
        for future in admin.incremental_alter_configs([resource]).values():
            future.result(30)


def test_a_failed_side_delivery_stops_the_trainer_and_is_sent_again(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    # the side topics refuse every record (the broker answers MSG_SIZE_TOO_LARGE) until
    # their limit is restored
    topics = side_topics(kafka_config, unique_name, **{"max.message.bytes": "200"})
    groups = synthetic_groups(6, seed=3, run_id=RUN, vocab_size=99, prompt_len=1)
    records = [(g[0].group_id.encode(), encode_group(scored_group(g))) for g in groups]
    produce(kafka_config, topics.scored, records[:3])  # vocab 99 > 16: dead-lettered
    source = source_for(kafka_config.client_config(), topics)
    try:
        dead_letter_all(source, 3)
        # the trainer flushes its dead letters before a checkpoint, routes stale groups
        # before it commits: either must raise (the trainer stops short of both) ...
        with pytest.raises(KafkaException, match="MSG_SIZE_TOO_LARGE"):
            source.flush_dead_letters()
        with pytest.raises(KafkaException, match="MSG_SIZE_TOO_LARGE"):
            source.route_stale([stale(key.decode(), value) for key, value in records[3:]])
        # ... and every refused record goes out again once the topic takes it
        set_topic_config(kafka_config, [topics.dlq, topics.stale], "max.message.bytes", "1048576")
        source.flush_dead_letters()
        source.route_stale([])
    finally:
        source.close()

    letters = read_all(kafka_config, topics.dlq, expected=3)
    assert sorted(m.value() for m in letters) == sorted(v for _, v in records[:3])
    routed = read_all(kafka_config, topics.stale, expected=3)
    assert sorted(m.value() for m in routed) == sorted(v for _, v in records[3:])
