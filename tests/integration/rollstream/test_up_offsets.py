"""A new ``rollstream up`` run starts at the end of the shared topics (not re-reading
earlier runs), and a resumed run keeps its offsets: ``start_groups_at_end`` on the real
broker."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from infra.topics import ensure_topics
from rollstream.config.settings import RollstreamConfig
from rollstream.up.plan import start_groups_at_end
from schemas.topics import TopicSpec
from streams.faust.start import read_start_offsets


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
    start_topic = config.streams.start_topic
    assert set(done) == {config.trainer.topics.group_id, app, start_topic}
    assert _committed(kafka_config, app, raw) == [3, 3]
    assert read_start_offsets(kafka_config.client_config(), start_topic, raw) == {0: 3, 1: 3}
    assert _committed(kafka_config, config.trainer.topics.group_id, scored) == [2, 2]

    _produce(kafka_config, raw, 4)  # this run's records
    assert start_groups_at_end(config) == {}  # resumed: nothing moves past them
    assert read_start_offsets(kafka_config.client_config(), start_topic, raw) == {0: 3, 1: 3}

    earliest = config.model_copy(
        update={"streams": config.streams.model_copy(update={"first_start": "earliest"})}
    )
    fresh = earliest.model_copy(
        update={"streams": earliest.streams.model_copy(update={"app_id": unique_name("app")})}
    )
    assert set(start_groups_at_end(fresh)) == set()  # earliest: the stream reads everything


def _groups(kafka_config) -> set[str]:
    admin = AdminClient(kafka_config.client_config())
    listed = admin.list_consumer_groups(request_timeout=30).result()
    return {g.group_id for g in listed.valid}


def test_a_new_run_leaves_no_marker_group_behind(kafka_config, unique_name, tmp_path: Path) -> None:
    """Kafka's consumer-group tooling lists only the groups that really consume: the start
    offsets live in a compacted topic, not in a marker group lagging by the whole topic."""
    raw = unique_name("rollouts.raw")
    ensure_topics(kafka_config.client_config(), [TopicSpec(raw, 2)])
    _produce(kafka_config, raw, 6)
    app = unique_name("rollstream-streams")
    trainer = unique_name("trainer")
    config = RollstreamConfig.model_validate(
        {
            "state_dir": str(tmp_path),
            "kafka": {"bootstrap_servers": kafka_config.bootstrap_servers},
            "streams": {"app_id": app, "first_start": "committed", "topics": {"raw": raw}},
            "trainer": {"topics": {"scored": unique_name("scored"), "group_id": trainer}},
        }
    )
    start_groups_at_end(config)
    ours = {g for g in _groups(kafka_config) if g.startswith(app)}
    assert ours == {app}  # the app's own group, which its workers consume with
