"""Where a new run's stream starts on ``rollouts.raw``: start offsets in a control topic.

``rollstream up`` runs each new run's stream from the end of the shared raw topic, so
earlier runs' records are not re-read (they would only be dead-lettered as
``foreign_run``). It writes the raw topic's end offsets, before any producer of the run
starts, to a small compacted topic ``<app_id>-start`` (``StreamsConfig.start_topic``):
one record per raw partition, key ``<raw topic>:<partition>``, value the offset in
decimal. A stream worker with ``first_start = "committed"`` reads it when a partition
has no watermark in its table yet (``streams.faust.gaps.GapGuard``).

Why a topic and not a consumer group's committed offsets: a marker group nobody
consumes with shows in Kafka's stock tooling (``kafka-consumer-groups --describe``) as
lagging by the whole topic, for ever, and fires standard lag alerts. A compacted topic
leaves no group behind and keeps only the newest offset per partition; a resumed run
finds its start offsets there and keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping

from core.config import KafkaConfig
from core.topic_reader import read_range, reader_config, whole_topic
from schemas.topics import MIB, TopicSpec, producer_limits


def start_topic_spec(name: str) -> TopicSpec:
    """The control topic: one partition, compacted, kept for ever."""
    return TopicSpec(
        name,
        partitions=1,
        cleanup_policy="compact",
        max_message_bytes=1 * MIB,
        extra_configs={"min.compaction.lag.ms": "0"},
    )


def _key(raw_topic: str, partition: int) -> bytes:
    return f"{raw_topic}:{partition}".encode()


def read_start_offsets(
    client_config: Mapping[str, str], topic: str, raw_topic: str
) -> dict[int, int]:
    """``partition -> start offset`` of ``raw_topic`` recorded in ``topic`` (empty when
    the topic does not exist or holds none)."""
    from confluent_kafka import Consumer, KafkaException

    prefix = f"{raw_topic}:".encode()
    found: dict[int, int] = {}
    consumer = Consumer(reader_config(client_config, "start-offsets"))
    try:
        try:
            plan = whole_topic(consumer, topic)
        except KafkaException:
            return found  # never written: no run has recorded a start
        for msg in read_range(consumer, topic, plan):
            key, value = msg.key(), msg.value()
            if key is None or not key.startswith(prefix) or value is None:
                continue
            try:
                found[int(key[len(prefix) :])] = int(value)
            except ValueError:
                continue  # not ours: ignored
    finally:
        consumer.close()
    return found


def write_start_offsets(
    client_config: Mapping[str, str],
    topic: str,
    raw_topic: str,
    offsets: Mapping[int, int],
    kafka: KafkaConfig | None = None,
) -> None:
    """Record ``offsets`` (partition -> offset) of ``raw_topic`` in ``topic`` (created if
    missing) and wait for the broker's acknowledgement."""
    from confluent_kafka import Producer

    from infra.topics import ensure_topics

    spec = start_topic_spec(topic)
    ensure_topics(client_config, [spec], kafka)
    producer = Producer({**client_config, **producer_limits(spec), "enable.idempotence": True})
    for partition, offset in sorted(offsets.items()):
        producer.produce(topic, key=_key(raw_topic, partition), value=str(offset).encode())
    if producer.flush(30) != 0:
        raise RuntimeError(f"{topic}: start offsets not acknowledged within 30 s")
