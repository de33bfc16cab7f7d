"""The trainer's Kafka source on the real broker: fair service of partitions under a
backlog, and the per-partition lag it reports."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import Counter
from collections.abc import Callable

from confluent_kafka import Producer
from support.synthetic import scored_group, synthetic_groups

from consumers.config import BatchConfig, TopicsConfig
from consumers.source import ScoredSource, TrainableRecords
from core.config import KafkaConfig, RetryConfig
from infra.topics import ensure_topics
from schemas.group import encode_group
from schemas.topics import ROLLOUTS_DLQ, ROLLOUTS_SCORED

RUN = "source-test"
PARTITIONS = ROLLOUTS_SCORED.partitions


def backlog(kafka: KafkaConfig, topic: str, per_partition: int) -> None:
    """``per_partition`` groups in every partition, produced round-robin (so the oldest
    record of the topic alternates between partitions)."""
    groups = synthetic_groups(
        per_partition * PARTITIONS, group_size=8, response_len=50, run_id=RUN, vary_lengths=False
    )
    producer = Producer({**kafka.client_config(), "enable.idempotence": True, "linger.ms": 5})
    for i, group in enumerate(groups):
        producer.produce(
            topic,
            key=group[0].group_id.encode(),
            value=encode_group(scored_group(group)),
            partition=i % PARTITIONS,
        )
        producer.poll(0)
    assert producer.flush(30) == 0


def source_for(kafka: KafkaConfig, unique_name: Callable[[str], str]) -> ScoredSource:
    scored, dlq = unique_name("rollouts.scored"), unique_name("rollouts.dlq")
    ensure_topics(
        kafka.client_config(),
        [
            dataclasses.replace(ROLLOUTS_SCORED, name=scored),
            dataclasses.replace(ROLLOUTS_DLQ, name=dlq),
        ],
    )
    return ScoredSource(
        kafka.client_config(),
        TopicsConfig(scored=scored, dlq=dlq, group_id=f"trainer-{scored}", group_instance_id=None),
        BatchConfig(max_groups=16, max_wait_s=30.0),
        RetryConfig(),
        accepts=TrainableRecords(run_id=RUN, vocab_size=16, max_length=10_000),
    )


def test_a_backlog_is_served_fairly_across_partitions_and_lag_is_reported(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    per_partition = 100
    source = source_for(kafka_config, unique_name)
    try:
        backlog(kafka_config, source.topics.scored, per_partition)
        stop = threading.Event()
        taken: Counter[int] = Counter()
        windows = []
        # half of the backlog, four micro-batches (64 groups) at a time
        for _ in range(per_partition * PARTITIONS // 2 // 64):
            window: Counter[int] = Counter()
            for _ in range(4):
                micro = source.next_micro_batch(stop)
                assert micro is not None
                window.update(g.partition for g in micro.groups)
            windows.append(window)
            taken.update(window)
        # librdkafka alone hands out one partition's whole prefetched chunk first: the
        # other partitions stood still for hundreds of groups
        fair = sum(taken.values()) / PARTITIONS
        assert all(0.75 * fair <= taken[p] <= 1.25 * fair for p in range(PARTITIONS)), taken
        # after the first window no partition stands still: a partition served ahead of
        # the others while they were still being fetched may rightly wait one window
        # (oldest first), but not longer
        for earlier, later in itertools.pairwise(windows[1:]):
            assert set(earlier) | set(later) == set(range(PARTITIONS)), windows

        lag = source.lag({})  # nothing trained: the lag counts from the read positions
        topic = source.topics.scored
        assert set(lag) == set(range(PARTITIONS))
        for p in range(PARTITIONS):
            assert lag[p] == per_partition - source.positions[(topic, p)], (lag, source.positions)
        trained = {(topic, p): 0 for p in range(PARTITIONS)}
        assert source.lag(trained) == {p: per_partition for p in range(PARTITIONS)}
    finally:
        source.close()


def test_deadline_order_takes_the_oldest_version_first(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    """Partition 0 holds groups of version 5 produced first, partition 1 groups of version
    1 produced after: arrival order serves partition 0 first, deadline order partition 1
    (nearest to expiry); within a partition the log's order is kept either way."""
    for order, first_partition in (("arrival", 0), ("deadline", 1)):
        source = source_for(kafka_config, lambda base, o=order: unique_name(f"{base}-{o}"))
        source.batch_config = BatchConfig(max_groups=8, max_wait_s=30.0, order=order)
        source.assembler.max_groups = 8
        try:
            groups = synthetic_groups(16, group_size=2, run_id=RUN, vary_lengths=False)
            producer = Producer(kafka_config.client_config())
            for i, group in enumerate(groups):
                partition, version = (0, 5) if i < 8 else (1, 1)
                producer.produce(
                    source.topics.scored,
                    key=group[0].group_id.encode(),
                    value=encode_group(scored_group(group)),
                    partition=partition,
                    headers=[("rs-min-version", str(version).encode())],
                )
            assert producer.flush(30) == 0
            for _ in range(200):  # both partitions buffered before anything is taken
                source._fetch(0.2)
                if sum(len(b) for b in source.buffers.values()) == 16:
                    break
            buffered = {k[1]: len(b) for k, b in source.buffers.items()}
            assert buffered == {0: 8, 1: 8}, (order, buffered)
            micro = source.next_micro_batch(threading.Event())
            assert micro is not None
            assert [g.partition for g in micro.groups] == [first_partition] * 8, order
            offsets = [g.offset for g in micro.groups]
            assert offsets == sorted(offsets)
        finally:
            source.close()
