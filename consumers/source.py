"""Reading scored groups from Kafka: consumer-group membership, seeks, DLQ, commits.

Offset discipline (confluent-kafka, no auto commit, no auto offset store):

- Positions come from the trainer, not from Kafka: ``ScoredSource(start_offsets=...)``
  receives the offsets saved in the last checkpoint, and every partition assignment seeks
  to the position the trainer knows (the next offset it has not yet taken into a batch,
  which is the checkpoint's offset right after start). A partition the trainer has never
  read starts at the group's committed offset, else at the earliest one.
- ``commit(offsets)`` is called by the trainer with the offsets of a checkpoint once it is
  durable (and after the DLQ producer is flushed), synchronously.
- Undecodable or untrainable records go to the DLQ topic (value and headers unchanged, a
  ``DeadLetter`` header with reason and source offset) and still advance the offsets of
  the micro-batch they fall in: they are "processed", never silently lost.

One trainer process per consumer group: a rebalance inside the process (for example after
``max.poll.interval.ms`` was exceeded) re-seeks to the in-memory positions, so nothing is
read twice; a second trainer in the same group is not supported.

Fairness across partitions. librdkafka hands out prefetched records in fetch order, a
whole partition's chunk at a time: under a backlog one partition was drained for hundreds
of groups while another's offset stood still. So records go first into a small buffer
per partition, and the batch assembler is fed **oldest first across partitions** (the
buffered head with the smallest timestamp). A partition whose buffer is full is paused
(librdkafka drops what it prefetched for it and fetches again from the next offset once
it is resumed), so the records of the other partitions come through. A new assignment
first waits (``SETTLE_S`` at most) until every partition has had a fetch answer: librdkafka
may resolve one partition's start offset before the others', and oldest-first cannot rank
records not yet fetched, so without the wait that partition was drained alone. ``lag`` reports
each partition's backlog (high watermark minus the trainer's position) for the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from consumers.batching import (
    BatchAssembler,
    ConsumedGroup,
    MicroBatch,
    StaleGroup,
)
from consumers.batching import TopicPartition as TP
from consumers.config import BatchConfig, TopicsConfig
from core.config import RetryConfig
from core.retry import retrying
from schemas.codec import MIN_VERSION_HEADER, DecodeError
from schemas.control import DeadLetter, StaleRecord
from schemas.group import decode_group
from schemas.topics import ROLLOUTS_DLQ, ROLLOUTS_STALE, TopicSpec, producer_limits
from schemas.trainable import check_trainable_group
from schemas.validation import ValidationLimits

SETTLE_S = 1.0  # the longest a new assignment waits for every partition's first fetch answer

log = logging.getLogger(__name__)

#: Called with the reason of every record sent to the DLQ (metrics).
DlqHook = Callable[[str], None]
#: A routed record as produced: key, value, headers.
_Record = tuple[bytes | None, bytes | None, list]


class _SideProducer:
    """Idempotent producer of routed records to one topic (``spec``, renamed ``topic``).

    A record whose delivery fails is kept and produced again by the next ``flush``, which
    raises the failure first: a retried flush only returns once every record sent is
    acknowledged, so no checkpoint or commit goes past a record that is not written.
    """

    def __init__(self, client_config: Mapping[str, str], spec: TopicSpec, topic: str) -> None:
        self.topic = topic
        self._config = {
            **client_config,
            **producer_limits(spec),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
        }
        self._producer = Producer(self._config)
        self._failed: list[tuple[_Record, KafkaError]] = []
        self.sent = 0

    def _produce(self, key: bytes | None, value: bytes | None, headers: list) -> None:
        record = (key, value, list(headers))

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._failed.append((record, err))

        while True:
            try:
                self._producer.produce(
                    self.topic, key=key, value=value, headers=headers, on_delivery=delivered
                )
                break
            except BufferError:  # local queue full: serve callbacks and try again
                self._producer.poll(0.5)
        self._producer.poll(0)

    def send_record(self, key: bytes | None, value: bytes | None, headers: list) -> None:
        self._produce(key, value, headers)
        self.sent += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        """Send again what failed before, wait for every record to be acknowledged, and
        raise the first failure (its records are sent again by the next call)."""
        failed, self._failed = self._failed, []
        if failed and any(err.fatal() for _, err in failed):
            # a fatal error (idempotence) ends this producer: resend through a new one
            self._producer.flush(0)
            self._producer = Producer(self._config)
        for (key, value, headers), _err in failed:
            self._produce(key, value, headers)
        remaining = self._producer.flush(timeout_s)
        if self._failed:
            err = self._failed[0][1]
            log.warning(
                "%d record(s) to %s not delivered (sent again on the next flush): %s",
                len(self._failed),
                self.topic,
                err,
            )
            raise KafkaException(err)
        if remaining:
            raise KafkaException(
                KafkaError(
                    KafkaError._MSG_TIMED_OUT, f"{remaining} records to {self.topic} not acked"
                )
            )


class DeadLetterProducer(_SideProducer):
    """The DLQ: the original value and headers plus a ``DeadLetter`` header."""

    def send(self, msg: Message, reason: str, detail: str) -> None:
        letter = DeadLetter(
            reason=reason,
            detail=detail[:2000],
            source_topic=msg.topic() or "",
            partition=max(msg.partition() or 0, 0),
            offset=max(msg.offset() or 0, 0),
        )
        headers = [(k, v) for k, v in (msg.headers() or []) if k != letter.header()[0]] + [
            letter.header()
        ]
        self.send_record(msg.key(), msg.value(), headers)


class StaleRouter(_SideProducer):
    """``rollouts.stale`` for groups too stale to train: the scored record unchanged plus
    a ``StaleRecord`` header (``stage = "trainer"``)."""

    def send(self, group: StaleGroup) -> None:
        record = StaleRecord(
            trajectory_id=group.group_id,
            staleness=group.staleness,
            trainer_version=group.trainer_version,
            max_staleness=group.max_staleness,
            stage="trainer",
        )
        name, value = record.header()
        headers = [(k, v) for k, v in group.headers if k != name] + [(name, value)]
        self.send_record(group.key, group.value, headers)


def min_version(msg: Message) -> int | None:
    """The oldest policy version of a scored group, from its ``rs-min-version`` header
    (None without one, or when it is not an integer)."""
    for key, value in msg.headers() or ():
        if key == MIN_VERSION_HEADER and value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class TrainableRecords:
    """Which scored records a trainer takes: its run's, its policy's (a multi-policy run's
    trainer trains its own policy only), and those its model can hold (token ids below
    ``vocab_size``, at most ``max_length`` tokens). Another run's groups are skipped; the
    rest that do not fit go to the DLQ."""

    run_id: str
    vocab_size: int
    max_length: int
    policy: str = ""

    @property
    def limits(self) -> ValidationLimits:
        """The trainer's limits on a record (``schemas.trainable``'s profile)."""
        return ValidationLimits(vocab_size=self.vocab_size, max_total_tokens=self.max_length)


class ScoredSource:
    """Micro-batches of scored groups from one topic (see the module doc)."""

    def __init__(
        self,
        client_config: Mapping[str, str],
        topics: TopicsConfig,
        batch: BatchConfig,
        retry: RetryConfig,
        *,
        accepts: TrainableRecords,
        start_offsets: Mapping[TP, int] | None = None,
        on_dead_letter: DlqHook | None = None,
    ) -> None:
        self.topics = topics
        self.accepts = accepts
        self.batch_config = batch
        self.retry = retry
        self._on_dead_letter = on_dead_letter
        self.positions: dict[TP, int] = {
            k: v for k, v in (start_offsets or {}).items() if k[0] == topics.scored
        }
        self.assigned: set[TP] = set()
        # fetched, not yet handed to the assembler (see "Fairness" in the module doc)
        self.buffers: dict[TP, deque[Message]] = {}
        self.buffer_limit = max(4 * batch.max_groups, 32)
        self.paused: set[TP] = set()
        self.settle_until = 0.0  # set by an assignment; see "Fairness" in the module doc
        self.assembler = BatchAssembler(batch.max_groups, batch.max_tokens, batch.max_wait_s)
        self.dlq = DeadLetterProducer(client_config, ROLLOUTS_DLQ, topics.dlq)
        self.stale = StaleRouter(client_config, ROLLOUTS_STALE, topics.stale)
        self.foreign = 0
        static = {"group.instance.id": topics.group_instance_id} if topics.group_instance_id else {}
        self._consumer = Consumer(
            {
                **client_config,
                **static,
                "group.id": topics.group_id,
                "session.timeout.ms": topics.session_timeout_ms,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "enable.partition.eof": False,
                "max.poll.interval.ms": topics.max_poll_interval_ms,
                "fetch.max.bytes": 64 * 1024 * 1024,
            }
        )
        self._consumer.subscribe(
            [topics.scored], on_assign=self._on_assign, on_revoke=self._on_revoke
        )

    # --- rebalance callbacks ------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.paused.clear()  # an assignment starts unpaused
        self.settle_until = time.monotonic() + SETTLE_S
        for tp in partitions:
            known = self.positions.get((tp.topic, tp.partition))
            if known is not None:
                tp.offset = known  # resume exactly where the trained (or taken) data ends
            self.assigned.add((tp.topic, tp.partition))
        log.info(
            "assigned %s",
            ", ".join(
                f"{tp.topic}[{tp.partition}]@{tp.offset if tp.offset >= 0 else 'committed'}"
                for tp in partitions
            ),
        )
        consumer.assign(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self.assigned.discard(key)
            self.buffers.pop(key, None)  # re-read from ``positions`` if assigned again
            self.paused.discard(key)
        log.info("revoked %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions))
        consumer.unassign()

    # --- reading ------------------------------------------------------------------------

    def next_micro_batch(self, stop: threading.Event) -> MicroBatch | None:
        """Poll until a micro-batch closes (group count, token budget, or the wait limit
        after its first group); None when ``stop`` is set first."""
        while not stop.is_set():
            ready = self.assembler.take()
            if ready is not None:
                return ready
            arrived = self._fetch(0.0)
            if (arrived or any(self.buffers.values())) and self._settled():
                self._handle(self._oldest())
                continue
            left = self.assembler.seconds_left()
            timeout = self.batch_config.poll_timeout_s
            if left is not None:
                timeout = min(timeout, max(left, 0.001))
            self._fetch(timeout)
        return None

    def _fetch(self, timeout_s: float) -> int:
        """Move what librdkafka has (waiting up to ``timeout_s`` for a first record) into
        the per-partition buffers; pause partitions whose buffer is full. Returns how
        many records arrived."""
        first = self._consumer.poll(timeout_s)
        if first is None:
            return 0
        arrived = 0
        for msg in [first, *self._consumer.consume(num_messages=500, timeout=0)]:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise KafkaException(err)
                log.warning("consumer error (retried by librdkafka): %s", err)
                continue
            key = (msg.topic() or "", msg.partition() or 0)
            if key not in self.assigned:
                continue  # fetched before a revocation: read again from ``positions``
            buffer = self.buffers.setdefault(key, deque())
            offset = msg.offset() or 0
            last = buffer[-1].offset() or 0 if buffer else self.positions.get(key, 0) - 1
            if offset <= last:
                continue  # delivered again after a resume
            buffer.append(msg)
            arrived += 1
            if len(buffer) >= self.buffer_limit and key not in self.paused:
                self._consumer.pause([TopicPartition(*key)])
                self.paused.add(key)
        return arrived

    def _settled(self) -> bool:
        """Every assigned partition has had a fetch answer (a buffered record, or a high
        watermark librdkafka learnt from a fetch), or the assignment's settle time is over."""
        if time.monotonic() >= self.settle_until:
            return True
        for key in self.assigned:
            if self.buffers.get(key):
                continue
            try:
                _low, high = self._consumer.get_watermark_offsets(TopicPartition(*key), cached=True)
            except KafkaException:
                return False
            if high is None or high < 0:
                return False
        self.settle_until = 0.0
        return True

    def _oldest(self) -> Message:
        """Take the next buffered partition head: with ``batch.order = "deadline"`` the one
        with the oldest policy version, else (and on ties) the oldest timestamp, then the
        lowest partition; resume its partition once its buffer has room again."""
        deadline = self.batch_config.order == "deadline"

        def rank(k: TP) -> tuple[float, int, int]:
            head = self.buffers[k][0]
            version = min_version(head) if deadline else None
            return (
                float("inf") if version is None else float(version),
                head.timestamp()[1],
                k[1],
            )

        key = min((k for k, b in self.buffers.items() if b), key=rank)
        buffer = self.buffers[key]
        msg = buffer.popleft()
        if key in self.paused and len(buffer) <= self.buffer_limit // 2:
            self._consumer.resume([TopicPartition(*key)])
            self.paused.discard(key)
        return msg

    def lag(self, trained: Mapping[TP, int]) -> dict[int, int]:
        """Records of each assigned partition not trained yet: the high watermark last
        seen by the consumer minus the trained offset (the checkpointable position, else
        the read position). Partitions whose watermark is not known yet are left out."""
        out: dict[int, int] = {}
        for key in sorted(self.assigned):
            try:
                _low, high = self._consumer.get_watermark_offsets(TopicPartition(*key), cached=True)
            except KafkaException:
                continue
            if high is None or high < 0:
                continue
            done = trained.get(key, self.positions.get(key))
            if done is None:
                continue
            out[key[1]] = max(0, high - done)
        return out

    def _handle(self, msg: Message) -> None:
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        assert topic is not None and partition is not None and offset is not None
        self.positions[(topic, partition)] = offset + 1
        try:
            group = decode_group(msg.value() or b"")
        except DecodeError as exc:
            self._dead_letter(msg, str(exc.reason), exc.message)
            return
        accepts = self.accepts
        if group.run_id != accepts.run_id:
            self.foreign += 1
            if self.foreign == 1 or self.foreign % 1000 == 0:
                log.warning(
                    "skipping group %s of run %r (training run %r); %d such records so far",
                    group.group_id,
                    group.run_id,
                    accepts.run_id,
                    self.foreign,
                )
            self.assembler.add_skipped(topic, partition, offset)
            return
        refused = check_trainable_group(group, accepts.limits, accepts.policy)
        if refused is not None:
            self._dead_letter(msg, refused.reason, refused.detail)
            return
        self.assembler.add_group(
            ConsumedGroup(
                topic=topic,
                partition=partition,
                offset=offset,
                group_id=group.group_id,
                trajectories=group.samples,
                key=msg.key(),
                value=msg.value() or b"",
                headers=tuple((k, v) for k, v in (msg.headers() or []) if v is not None),
            )
        )

    def _dead_letter(self, msg: Message, reason: str, detail: str) -> None:
        log.error(
            "dead-lettering %s[%s]@%s: %s: %s",
            msg.topic(),
            msg.partition(),
            msg.offset(),
            reason,
            detail,
        )
        self.dlq.send(msg, reason, detail)
        self.assembler.add_skipped(msg.topic() or "", msg.partition() or 0, msg.offset() or 0)
        if self._on_dead_letter is not None:
            self._on_dead_letter(reason)

    # --- committing ---------------------------------------------------------------------

    def flush_dead_letters(self) -> None:
        """Every dead letter acknowledged (retried with back-off while the broker is away)."""
        for attempt in retrying(self.retry, (KafkaException,), "flush the DLQ"):
            with attempt:
                self.dlq.flush()

    def route_stale(self, groups: list[StaleGroup]) -> None:
        """Send ``groups`` to the stale topic and wait until every one is acknowledged
        (retried with back-off while the broker is away)."""
        for group in groups:
            self.stale.send(group)
        for attempt in retrying(self.retry, (KafkaException,), "flush the stale topic"):
            with attempt:
                self.stale.flush()

    def commit(self, offsets: Mapping[TP, int]) -> bool:
        """Commit checkpointed ``offsets`` to the group synchronously. A failure is logged
        and returns False: the checkpoint, not Kafka, is the source of truth on restart."""
        mine = [TopicPartition(t, p, o) for (t, p), o in offsets.items() if t == self.topics.scored]
        if not mine:
            return True
        try:
            for attempt in retrying(self.retry, (KafkaException,), "commit offsets", quick=True):
                with attempt:
                    self._consumer.commit(offsets=mine, asynchronous=False)
        except KafkaException as exc:
            log.warning("offset commit failed (the checkpoint has them): %s", exc)
            return False
        return True

    def close(self) -> None:
        try:
            self.dlq.flush()
            self.stale.flush()
        finally:
            self._consumer.close()
