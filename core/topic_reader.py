"""Read a topic's partitions from planned start offsets up to planned end offsets: the one
loop behind ``rollstream replay``, ``inspect`` and ``audit``, with the queries a reader
plans by (partitions, watermarks, a group's committed offsets).

A reader joins no consumer group and commits nothing (``assign``, auto-commit and offset
store off), so reading a topic never moves anyone's offsets. It reads ``read_committed``,
as the trainer does: records of aborted transactions (a killed stream worker) are never
seen. A partition is done when a record at or past its end arrives, at an end-of-partition
at or past its end (an earlier one is the last stable offset of an open transaction), or
when its position passes the end without a record: transaction markers occupy offsets
and are never delivered, so a partition whose last offset is a commit marker ends that way.

A ``read_committed`` consumer's high watermark is the last stable offset, so a
whole-topic plan (``whole_topic``) ends before a transaction that is still open. A plan
with explicit ends can reach into one, and an open transaction keeps every later record
invisible: after ``idle_timeout_s`` without progress the read stops with ``ReadStalled``
naming the partitions still short of their ends; the caller decides whether that is an
error (``audit`` raises, ``replay`` warns and keeps what it read).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.process import ServiceError

if TYPE_CHECKING:
    from confluent_kafka import Consumer, Message, TopicPartition


class ReadStalled(TimeoutError):
    """Partitions made no progress towards their end offsets for ``idle_timeout_s``."""

    def __init__(self, topic: str, short: Mapping[int, int], idle_timeout_s: float) -> None:
        self.topic = topic
        self.short = dict(short)  # partition -> planned end offset
        super().__init__(
            f"{topic}: partitions {sorted(short)} did not reach their end offsets "
            f"{[short[p] for p in sorted(short)]} in {idle_timeout_s:.0f}s "
            "(a transaction left open?)"
        )


def reader_config(client_config: Mapping[str, str], purpose: str) -> dict[str, Any]:
    """librdkafka settings of a reader that joins no group and commits nothing."""
    return {
        **client_config,
        # A group id is mandatory for a confluent-kafka Consumer; assign() never uses it to
        # join a group, and with commits off nothing is ever stored under it.
        "group.id": f"rollstream-{purpose}-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    }


def topic_partitions(consumer: Consumer, topic: str) -> list[int]:
    """The partitions of ``topic``; ``KafkaException`` when it is missing or unreadable."""
    from confluent_kafka import KafkaException

    meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
    if meta is None or meta.error is not None:
        raise KafkaException(meta.error if meta is not None else f"topic {topic} not found")
    return sorted(meta.partitions)


def whole_topic(
    consumer: Consumer, topic: str, partitions: Iterable[int] | None = None
) -> dict[int, tuple[int, int]]:
    """``partition -> (low, high)`` watermarks of ``partitions`` (default: all): every
    record the topic holds now."""
    from confluent_kafka import TopicPartition

    wanted = topic_partitions(consumer, topic) if partitions is None else partitions
    return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30) for p in wanted}


_TRANSIENT = frozenset(
    {"NOT_LEADER_FOR_PARTITION", "LEADER_NOT_AVAILABLE", "UNKNOWN_TOPIC_OR_PART", "_TRANSPORT"}
)


def end_offsets(
    client_config: Mapping[str, str], topic: str, timeout: float = 10.0
) -> dict[int, int]:
    """High watermark of every partition of ``topic``, with a consumer of its own
    (transient errors such as a leader election on a fresh topic are retried until
    ``timeout``; a missing topic is a ``ServiceError`` that says how to create it: a
    command shows it as one line)."""
    from confluent_kafka import Consumer, KafkaException

    consumer = Consumer(reader_config(client_config, "end-offsets"))
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                metadata = consumer.list_topics(topic, timeout=timeout)
                info = metadata.topics.get(topic)
                if info is None or info.error is not None:
                    error = info.error if info is not None else "missing"
                    raise ServiceError(
                        f"topic {topic!r} not found ({error}): create it first "
                        "(rollstream infra up / rollstream topics ensure)"
                    )
                ends = whole_topic(consumer, topic, sorted(info.partitions))
                return {p: high for p, (_low, high) in ends.items()}
            except KafkaException as exc:
                if not exc.args[0].retriable() and exc.args[0].name() not in _TRANSIENT:
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        consumer.close()


def committed_offsets(
    consumer: Consumer, partitions: list[TopicPartition], timeout_s: float = 60.0
) -> list[TopicPartition]:
    """``consumer.committed`` for its group, retried while a fresh broker still creates
    its offsets topic or the group's coordinator moves (it answers NOT_COORDINATOR /
    COORDINATOR_NOT_AVAILABLE / COORDINATOR_LOAD_IN_PROGRESS meanwhile)."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(consumer.committed(partitions, timeout=30))
        except KafkaException as err:
            if not err.args[0].retriable() and "COORDINATOR" not in err.args[0].name():
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class _Remaining:
    """The planned end offset of each partition not read to its end yet; a partition
    that is done is paused, so the consumer fetches nothing more for it."""

    def __init__(self, consumer: Consumer, topic: str, ends: Mapping[int, int]) -> None:
        self.consumer = consumer
        self.topic = topic
        self.ends = dict(ends)

    def finish(self, partition: int) -> None:
        from confluent_kafka import TopicPartition

        if self.ends.pop(partition, None) is not None:
            self.consumer.pause([TopicPartition(self.topic, partition)])

    def wanted(self, msg: Message) -> bool:
        """Whether ``msg`` is a record to hand out; an end-of-partition or a record at or
        past its partition's end finishes the partition instead."""
        partition, offset = msg.partition(), msg.offset()
        assert partition is not None and offset is not None
        err = msg.error()
        if err is not None:
            from confluent_kafka import KafkaError, KafkaException

            if err.code() != KafkaError._PARTITION_EOF:
                raise KafkaException(err)
            if offset >= self.ends.get(partition, 0):  # not short of the end: done
                self.finish(partition)
            return False
        if partition not in self.ends:
            return False
        if offset >= self.ends[partition]:
            self.finish(partition)
            return False
        return True

    def handed_out(self, msg: Message) -> None:
        """``msg`` was handed out: its partition is done if it was the last one planned."""
        partition, offset = msg.partition(), msg.offset()
        assert partition is not None and offset is not None
        if offset + 1 >= self.ends.get(partition, 0):
            self.finish(partition)

    def finish_passed(self) -> None:
        """Finish the partitions whose position passed their end without a record (the
        last offsets were transaction markers)."""
        from confluent_kafka import TopicPartition

        positions = self.consumer.position([TopicPartition(self.topic, p) for p in self.ends])
        for tp in positions:
            if tp.offset >= 0 and tp.offset >= self.ends[tp.partition]:
                self.finish(tp.partition)


def read_range(
    consumer: Consumer,
    topic: str,
    plan: Mapping[int, tuple[int, int]],
    idle_timeout_s: float = 30.0,
) -> Iterator[Message]:
    """The records of ``topic`` with ``start <= offset < end`` per planned partition
    (``end`` exclusive), each partition in offset order, partitions interleaved. The
    caller owns (and closes) ``consumer``; raises ``ReadStalled`` (see the module doc)."""
    from confluent_kafka import TopicPartition

    remaining = _Remaining(
        consumer, topic, {p: end for p, (start, end) in plan.items() if start < end}
    )
    if not remaining.ends:
        return
    consumer.assign([TopicPartition(topic, p, plan[p][0]) for p in sorted(remaining.ends)])
    last_progress = time.monotonic()
    while remaining.ends:
        messages = consumer.consume(num_messages=500, timeout=0.1)  # waits this long if < 500 come
        for msg in messages:
            if not remaining.wanted(msg):
                continue
            last_progress = time.monotonic()
            yield msg
            remaining.handed_out(msg)
        if not messages and remaining.ends:
            remaining.finish_passed()
            if remaining.ends and time.monotonic() - last_progress > idle_timeout_s:
                raise ReadStalled(topic, remaining.ends, idle_timeout_s)


def read_whole_topic(
    client_config: Mapping[str, str], topic: str, purpose: str, idle_timeout_s: float = 60.0
) -> Iterator[Message]:
    """Every committed record of ``topic`` up to the end offsets seen at the start, read
    by a reader of its own (``purpose`` names it); ``ReadStalled`` as ``read_range``."""
    from confluent_kafka import Consumer

    consumer = Consumer(reader_config(client_config, purpose))
    try:
        yield from read_range(consumer, topic, whole_topic(consumer, topic), idle_timeout_s)
    finally:
        consumer.close()


@dataclass(frozen=True)
class MemberLag:
    """One consumer-group member's share of a topic: its partitions and how many records
    of them its group has not committed yet (high watermark minus committed offset)."""

    client_id: str
    host: str
    partitions: tuple[int, ...]
    lag: int


def group_lag(
    client_config: Mapping[str, str], group: str, topic: str, timeout_s: float = 10.0
) -> list[MemberLag]:
    """Lag per member of ``group`` on ``topic``, as Kafka's own group tooling shows it:
    who holds which partitions now, and the records past the group's committed offsets
    (a partition never committed counts from its low watermark). Members holding no
    partition of ``topic`` are listed with lag 0; an unknown group gives no members."""
    from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(dict(client_config))
    described = admin.describe_consumer_groups([group], request_timeout=timeout_s)
    members = described[group].result(timeout=timeout_s).members
    held = {
        m.member_id: sorted(
            tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic
        )
        for m in members
    }
    wanted = [TopicPartition(topic, p) for parts in held.values() for p in parts]
    committed: dict[int, int] = {}
    if wanted:
        request = [ConsumerGroupTopicPartitions(group, wanted)]
        answer = admin.list_consumer_group_offsets(request, request_timeout=timeout_s)
        for tp in answer[group].result(timeout=timeout_s).topic_partitions:
            committed[tp.partition] = tp.offset
    consumer = Consumer(reader_config(client_config, "group-lag"))
    try:
        marks = whole_topic(consumer, topic, [tp.partition for tp in wanted])
    finally:
        consumer.close()

    def lag(partition: int) -> int:
        low, high = marks[partition]
        start = committed.get(partition, -1)
        return max(0, high - (start if start >= 0 else low))

    return [
        MemberLag(m.client_id, m.host, tuple(held[m.member_id]), sum(map(lag, held[m.member_id])))
        for m in sorted(members, key=lambda m: m.client_id)
    ]


def member_of(members: list[MemberLag], client_id: str) -> MemberLag | None:
    """The member with ``client_id`` (one process's consumer), or None."""
    return next((m for m in members if m.client_id == client_id), None)
