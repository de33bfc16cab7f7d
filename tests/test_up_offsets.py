"""A new ``rollstream up`` run starts at the end of the shared topics (not re-reading
earlier runs), and a resumed run keeps its offsets: ``start_groups_at_end`` on the real
broker."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from infra.topics import ensure_topics
from rollstream.config import RollstreamConfig
from rollstream.up import start_groups_at_end
from schemas.topics import TopicSpec


def _produce(kafka_config, topic: str, count: int) -> None:
    producer = Producer(kafka_config.client_config())
    for i in range(count):
        producer.produce(topic, key=b"k", value=b"old run %d" % i, partition=i % 2)
    assert producer.flush(30) == 0


def _committed(kafka_config, group: str, topic: str) -> list[int]:
    consumer = Consumer({**kafka_config.client_config(), "group.id": group})
    try:
        parts = [TopicPartition(topic, p) for p in (0, 1)]
        return [tp.offset for tp in consumer.committed(parts, timeout=30)]
    finally:
        consumer.close()


def test_a_new_run_starts_at_the_end_and_a_resumed_one_keeps_its_offsets(
    kafka_config, unique_name, tmp_path: Path
) -> None:
    raw, scored = unique_name("rollouts.raw"), unique_name("rollouts.scored")
    ensure_topics(kafka_config.client_config(), [TopicSpec(raw, 2), TopicSpec(scored, 2)])
    _produce(kafka_config, raw, 6)
    _produce(kafka_config, scored, 4)
    app = unique_name("rollstream-streams")
    config = RollstreamConfig.model_validate(
        {
            "state_dir": str(tmp_path),
            "kafka": {"bootstrap_servers": kafka_config.bootstrap_servers},
            "streams": {"app_id": app, "first_start": "committed", "topics": {"raw": raw}},
            "trainer": {"topics": {"scored": scored, "group_id": unique_name("trainer")}},
        }
    )
    done = start_groups_at_end(config)
    assert set(done) == {config.trainer.topics.group_id, app, f"{app}-start"}
    assert _committed(kafka_config, app, raw) == [3, 3]
    assert _committed(kafka_config, f"{app}-start", raw) == [3, 3]
    assert _committed(kafka_config, config.trainer.topics.group_id, scored) == [2, 2]

    _produce(kafka_config, raw, 4)  # this run's records
    assert start_groups_at_end(config) == {}  # resumed: nothing moves past them
    assert _committed(kafka_config, f"{app}-start", raw) == [3, 3]

    earliest = config.model_copy(
        update={"streams": config.streams.model_copy(update={"first_start": "earliest"})}
    )
    fresh = earliest.model_copy(
        update={"streams": earliest.streams.model_copy(update={"app_id": unique_name("app")})}
    )
    assert set(start_groups_at_end(fresh)) == set()  # earliest: the stream reads everything
