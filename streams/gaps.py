"""Input completeness: where a partition resumes is decided by the table, not by Faust.

Faust 0.15.3 can acknowledge records it never hands to the agent: ``Consumer.getmany``
drops the rest of a fetched batch when flow control or the consumer generation changes
mid-batch (around rebalances and recovery), aiokafka's position has already moved past
them, and the fetcher then marks the hole as a *gap*, which counts as acknowledged and
is committed. Observed here as a kill -9 test losing a contiguous run of raw records
(committed offset past them, no effect of theirs anywhere in the changelog).

``GapGuard`` makes the table's per-partition watermark (``streams.groups.offset_key``,
written atomically with each step's effects) the source of truth. A raw record whose
offset is past ``watermark + 1`` means records were skipped: the guard checks with a
side consumer (``read_committed``) whether a record really exists before it — a real hole
— or the log legitimately jumps (transaction markers, retention), and for a real hole
seeks the Faust consumer back to ``watermark + 1`` and drops the record (it will be
redelivered in order). Faust's committed offsets thereby become a hint: a commit past the
watermark is corrected on the next start.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from streams.groups import offset_key
from streams.processor import Message

log = logging.getLogger(__name__)

RESEEK_AFTER_S = 2.0
"""Seek again if records keep arriving past the hole this long after the last seek."""


class GapGuard:
    """Admits a raw record only if every record before it has been applied."""

    def __init__(
        self,
        table: Mapping[bytes, bytes],
        client_config: Mapping[str, str],
        topic: str,
        seek: Callable[[int, int], Awaitable[None]],
        start_group: str | None = None,
    ) -> None:
        """``start_group``: a consumer group whose committed offset, when there is one, is
        where a partition without a watermark starts (``first_start = "committed"``)."""
        self.table = table
        self.start_group = start_group
        self.client_config = dict(client_config)
        self.topic = topic
        self.seek = seek
        self._log_start: dict[int, int] = {}
        self._next_real: dict[tuple[int, int], int | None] = {}
        self._sought: dict[int, tuple[int, float]] = {}
        self._side: Any = None

    async def admit(self, msg: Message) -> bool:
        """True: process ``msg`` (replays included; the processor skips those). False:
        drop it, records before it are missing and are being fetched again."""
        if msg.topic != self.topic:
            return True
        raw = self.table.get(offset_key(msg.topic, msg.partition))
        if raw is not None:
            expected = int(raw) + 1
        else:
            expected = await self._start_of(msg.partition)
        if msg.offset <= expected:
            return True
        key = (msg.partition, expected)
        if key not in self._next_real:
            self._next_real[key] = await asyncio.to_thread(
                self._first_offset_from, msg.partition, expected
            )
        real = self._next_real[key]
        if real is not None and real >= msg.offset:
            return True  # nothing between: a legitimate jump
        last = self._sought.get(msg.partition)
        now = time.monotonic()
        if last is None or last[0] != expected or now - last[1] > RESEEK_AFTER_S:
            log.warning(
                "%s-%d: got offset %d but the table has applied up to %d; seeking back",
                msg.topic,
                msg.partition,
                msg.offset,
                expected - 1,
            )
            await self.seek(msg.partition, expected)
            self._sought[msg.partition] = (expected, now)
        return False

    async def _start_of(self, partition: int) -> int:
        """First offset of a partition this app never applied anything from."""
        if partition not in self._log_start:
            start = await asyncio.to_thread(self._low_watermark, partition)
            if self.start_group is not None:
                committed = await asyncio.to_thread(self._committed_offset, partition)
                if committed is not None:
                    start = max(start, committed)
            self._log_start[partition] = start
        return self._log_start[partition]

    def _committed_offset(self, partition: int) -> int | None:
        """``start_group``'s committed offset of the partition (None: it has none)."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(
            {**self.client_config, "group.id": self.start_group, "enable.auto.commit": False}
        )
        try:
            (found,) = consumer.committed([TopicPartition(self.topic, partition)], timeout=30)
        finally:
            consumer.close()
        return found.offset if found.offset >= 0 else None

    def _consumer(self) -> Any:
        if self._side is None:
            from confluent_kafka import Consumer

            self._side = Consumer(
                {
                    **self.client_config,
                    "group.id": f"rollstream-streams-gaps-{uuid.uuid4().hex[:12]}",
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    "auto.offset.reset": "earliest",
                }
            )
        return self._side

    def _low_watermark(self, partition: int) -> int:
        from confluent_kafka import TopicPartition

        low, _high = self._consumer().get_watermark_offsets(
            TopicPartition(self.topic, partition), timeout=30
        )
        return low

    def _first_offset_from(self, partition: int, offset: int) -> int | None:
        """Offset of the first committed record at or after ``offset`` (None: none seen)."""
        from confluent_kafka import TopicPartition

        consumer = self._consumer()
        consumer.assign([TopicPartition(self.topic, partition, offset)])
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is not None and msg.error() is None:
                    return msg.offset()
            return None
        finally:
            consumer.unassign()
