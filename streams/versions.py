"""Reads ``policy.versions`` into a ``VersionTracker``, and says when it has caught up.

The staleness filter must not judge records before it knows the trainer's version: a
worker that starts (or restarts) would otherwise admit everything it reads in its first
seconds. ``VersionReader`` reads every partition of the (compacted) topic from the start,
without a consumer group, and sets ``caught_up`` once it has read up to the end offsets
it saw when it started; the stream waits for that before processing its first record.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from schemas.control import VersionAnnouncement
from streams.staleness import VersionTracker

log = logging.getLogger(__name__)


class VersionReader:
    """A daemon thread feeding ``tracker`` with the announced versions of ``run``."""

    def __init__(
        self,
        client_config: Mapping[str, str],
        topic: str,
        run: str,
        tracker: VersionTracker,
        on_version: Callable[[int], None] | None = None,
    ) -> None:
        self.client_config = dict(client_config)
        self.topic = topic
        self.run = run
        self.tracker = tracker
        self.on_version = on_version
        self.caught_up = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> VersionReader:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="version-reader", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer(
            {
                **self.client_config,
                "group.id": f"rollstream-streams-versions-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        try:
            ends = self._end_offsets(consumer)
            tps = [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in ends]
            ends = {p: end for p, end in ends.items() if end is not None}
            consumer.assign(tps)
            while not self._stop.is_set():
                for msg in consumer.consume(num_messages=500, timeout=0.5):
                    if msg.error():
                        log.warning("%s: %s", self.topic, msg.error())
                        continue
                    self._apply(msg.key(), msg.value())
                if not self.caught_up.is_set():
                    # position() skips compacted gaps and transaction markers
                    positions = {tp.partition: tp.offset for tp in consumer.position(tps)}
                    if all(positions[p] >= end for p, end in ends.items()):
                        self.caught_up.set()
        except Exception:
            log.exception("version reader stopped")
            self.caught_up.set()  # do not hold the stream hostage; staleness admits all
        finally:
            consumer.close()

    def _end_offsets(self, consumer: Any, attempts: int = 20) -> dict[int, int | None]:
        """End offset of each partition (None: empty), retried while the topic's leaders
        are not known yet (a topic created a moment ago)."""
        from confluent_kafka import KafkaException, TopicPartition

        for attempt in range(attempts):
            try:
                topic = consumer.list_topics(self.topic, timeout=30).topics[self.topic]
                if topic.error is not None:
                    raise KafkaException(topic.error)
                ends: dict[int, int | None] = {}
                for p in topic.partitions:
                    low, high = consumer.get_watermark_offsets(
                        TopicPartition(self.topic, p), timeout=30
                    )
                    ends[p] = high if high > low else None
                return ends
            except KafkaException as err:
                if attempt == attempts - 1 or self._stop.wait(min(0.1 * 2**attempt, 2.0)):
                    raise
                log.info("%s not ready (%s); retrying", self.topic, err)
        raise AssertionError("unreachable")

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if key != self.run.encode() or value is None:
            return
        try:
            announcement = VersionAnnouncement.from_json(value)
        except ValueError as err:
            log.warning("ignoring a malformed announcement: %s", err)
            return
        if self.tracker.observe(announcement.version) and self.on_version is not None:
            self.on_version(announcement.version)
