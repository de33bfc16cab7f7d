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
redelivered in order). Faust's committed offsets thereby become a hint.

A hole at the *end* of a partition has no later record to reveal it: a worker that
dropped a record with the guard (which Faust then acknowledges, so the commit moves past
the hole) and was killed before re-reading, leaves its successor starting at the end of
the partition with the table's watermark behind it; nothing arrives, the groups stay half
assembled (seen in CI: a kill -9 test lost every group of one partition). ``sweep``,
run on a timer, closes that case: once the agent has been idle for ``stall_after_s``,
every record the consumer has handed to Faust has reached the agent, so a partition
whose consumer position is past the watermark + 1 has a hole; when a read_committed
consumer finds a record in it (not just a transaction marker), the partition is sought
back to the watermark + 1.

Records re-read after a seek lie below the offset Faust has committed. Faust commits a
transaction only when newly acknowledged offsets move forward, so their effects would
sit in an open transaction until a later record came; ``rereading`` tells the agent to
commit them at once (``streams.faust.txn.EffectWriter.apply``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

from core.topic_reader import whole_topic
from streams.faust.start import read_start_offsets
from streams.groups import offset_key
from streams.processor import Message

log = logging.getLogger(__name__)

RESEEK_AFTER_S = 2.0
"""Seek again if records keep arriving past the hole this long after the last seek."""

STALL_AFTER_S = 10.0
"""``sweep`` acts after the agent has been idle this long."""

GAP_SWEEP_INTERVAL_S = 2.5
"""How often the worker runs ``sweep``."""

LOOKUP_TIMEOUT_S = 10.0
"""How long the side consumer looks for a record before the answer is "unknown"."""

UNKNOWN = "unknown"
"""``_real_from``'s answer when the side consumer saw neither a record nor the
partition's end in time (a slow broker): never cached, asked again next time."""


class GapGuard:
    """Admits a raw record only if every record before it has been applied."""

    def __init__(
        self,
        table: Mapping[bytes, bytes],
        client_config: Mapping[str, str],
        topic: str,
        seek: Callable[[int, int], Awaitable[None]],
        start_topic: str | None = None,
        stall_after_s: float = STALL_AFTER_S,
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
        restore: Callable[[int], Awaitable[object]] | None = None,
    ) -> None:
        """``start_topic``: the control topic whose recorded offset, when there is one, is
        where a partition without a watermark starts (``first_start = "committed"``,
        ``streams.faust.start``). ``restore``: rebuilds a partition's table state from the
        changelog (``streams.faust.restore``); asked once per assignment, before the partition's
        first record or tick."""
        self.table = table
        self.restore = restore
        self._restored: set[int] = set()  # restored since assigned: once per assignment
        self._revocations = 0
        self.start_topic = start_topic
        self._start_offsets: dict[int, int] | None = None
        self.stall_after_s = stall_after_s
        self.lookup_timeout_s = lookup_timeout_s
        self.client_config = dict(client_config)
        self.topic = topic
        self.seek = seek
        self._log_start: dict[int, int] = {}
        self._next_real: dict[tuple[int, int], int | None] = {}
        self._sought: dict[int, tuple[int, float]] = {}
        self._reread_until: dict[int, int] = {}  # partition -> first offset not re-read
        self._busy = 0
        self._idle_since = time.monotonic()
        self._checked: dict[int, tuple[int, int]] = {}  # (expected, position) found sound
        self._side: Any = None
        self._side_lock = asyncio.Lock()  # admit and sweep share the side consumer
        self._restore_lock = asyncio.Lock()

    async def admit(self, msg: Message) -> bool:
        """True: process ``msg`` (replays included; the processor skips those). False:
        drop it, records before it are missing and are being fetched again."""
        if msg.topic != self.topic:  # a tick: it reads the partition's groups
            await self.ensure_restored(msg.partition)
            return True
        expected = await self._expected(msg.partition)
        if msg.offset <= expected:
            return True
        key = (msg.partition, expected)
        real = self._next_real.get(key, UNKNOWN)
        if real == UNKNOWN:
            real = await self._real_from(msg.partition, expected)
            if real != UNKNOWN:  # a timeout is asked again when the record comes back
                self._next_real[key] = real
        if isinstance(real, int) and real >= msg.offset:
            return True  # nothing between: a legitimate jump
        # A real hole, or unknown (slow broker): drop it and re-read from the watermark,
        # which is safe either way (the records come again and are judged again).
        self._mark_reread(msg.partition, msg.offset + 1)  # Faust acknowledges what it drops
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

    def revoked(self, partitions: Iterable[int]) -> None:
        """``partitions`` left this worker (at a rebalance, every one: Faust's is eager):
        each is rebuilt from the changelog again before it is processed."""
        self._restored.difference_update(partitions)
        self._revocations += 1

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Wrap the agent's handling of one event. ``sweep`` acts only once the agent has
        been idle for ``stall_after_s``: records waiting in Faust's buffer behind a long
        step (old logits on a CPU) are then known not to be waiting any more."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self._idle_since = time.monotonic()

    async def sweep(
        self, partitions: Iterable[int], position: Callable[[int], Awaitable[int | None]]
    ) -> list[int]:
        """Seek back each of ``partitions`` (ours, assigned) whose consumer ``position`` is
        past records the table never applied, once the agent has been idle for
        ``stall_after_s`` (so they are not on their way); returns the partitions sought."""
        if self._busy or time.monotonic() - self._idle_since < self.stall_after_s:
            return []
        sought = []
        for partition in partitions:
            expected = await self._expected(partition)
            at = await position(partition)
            if at is None or at <= expected or self._checked.get(partition) == (expected, at):
                continue
            real = await self._real_from(partition, expected)
            if real == UNKNOWN:
                log.info("%s-%d: no answer from the broker; next sweep", self.topic, partition)
                continue  # not cached: the next sweep asks again
            if real is None or real >= at:  # only markers in between, or nothing readable
                self._checked[partition] = (expected, at)
                continue
            log.warning(
                "%s-%d: consumer at %d, the table has applied up to %d, and the agent has "
                "been idle for %.0fs; seeking back",
                self.topic,
                partition,
                at,
                expected - 1,
                time.monotonic() - self._idle_since,
            )
            await self.seek(partition, expected)
            self._sought[partition] = (expected, time.monotonic())
            self._mark_reread(partition, at)
            sought.append(partition)
        if sought:
            self._idle_since = time.monotonic()  # give the re-fetched records time to come
        return sought

    def rereading(self, msg: Message) -> bool:
        """``msg`` comes again after a seek back, from below where Faust's consumer had
        been (and may have committed): Faust, which commits a transaction only when
        newly acknowledged offsets move forward, will not commit this one's effects by
        itself, so the caller commits them (``EffectWriter.apply(commit=True)``)."""
        return msg.topic == self.topic and msg.offset < self._reread_until.get(msg.partition, 0)

    def _mark_reread(self, partition: int, until: int) -> None:
        self._reread_until[partition] = max(self._reread_until.get(partition, 0), until)

    async def _expected(self, partition: int) -> int:
        """The next offset the table needs from ``partition`` (rebuilt from the changelog
        first, once per assignment); a partition without a watermark starts at its start
        offset."""
        await self.ensure_restored(partition)
        raw = self.table.get(offset_key(self.topic, partition))
        if raw is not None:
            return int(raw) + 1
        return await self._start_of(partition)

    async def ensure_restored(self, partition: int) -> None:
        """Rebuild the partition's table state from its committed changelog
        (``streams.faust.restore``) once per assignment, before anything reads it: neither
        Faust's recovery nor memory that held aborted steps is taken as the state."""
        if self.restore is None or partition in self._restored:
            return
        async with self._restore_lock:  # admit, sweep and ticks: one rebuild at a time
            if partition in self._restored:
                return
            revocations = self._revocations
            await self.restore(partition)
            if revocations != self._revocations:
                return  # revoked while it was read: rebuilt again when next needed
            self._restored.add(partition)
            raw = self.table.get(offset_key(self.topic, partition))
            log.info(
                "%s-%d: table rebuilt from the changelog, applied up to %s",
                self.topic,
                partition,
                "nothing yet" if raw is None else int(raw),
            )

    async def _start_of(self, partition: int) -> int:
        """First offset of a partition this app never applied anything from."""
        if partition not in self._log_start:
            async with self._side_lock:
                start = await asyncio.to_thread(self._low_watermark, partition)
            if self.start_topic is not None:
                committed = await asyncio.to_thread(self._start_offset, partition)
                if committed is not None:
                    start = max(start, committed)
            self._log_start[partition] = start
        return self._log_start[partition]

    def _start_offset(self, partition: int) -> int | None:
        """The start offset ``start_topic`` records for the partition (None: none). Read
        once: ``rollstream up`` writes it before the run's first worker starts."""
        if self._start_offsets is None:
            assert self.start_topic is not None
            self._start_offsets = read_start_offsets(
                self.client_config, self.start_topic, self.topic
            )
        return self._start_offsets.get(partition)

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
                    "enable.partition.eof": True,
                }
            )
        return self._side

    def _low_watermark(self, partition: int) -> int:
        low, _high = whole_topic(self._consumer(), self.topic, [partition])[partition]
        return low

    async def _real_from(self, partition: int, offset: int) -> int | str | None:
        async with self._side_lock:
            return await asyncio.to_thread(self._first_offset_from, partition, offset)

    def _first_offset_from(self, partition: int, offset: int) -> int | str | None:
        """Offset of the first committed record at or after ``offset`` (None: the
        partition ends, for a read_committed reader, before one; ``UNKNOWN``: neither
        seen within ``lookup_timeout_s``)."""
        from confluent_kafka import KafkaError, TopicPartition

        consumer = self._consumer()
        consumer.assign([TopicPartition(self.topic, partition, offset)])
        try:
            deadline = time.monotonic() + self.lookup_timeout_s
            while time.monotonic() < deadline:
                msg = consumer.poll(min(0.5, self.lookup_timeout_s))
                if msg is None or msg.partition() != partition or msg.offset() < offset:
                    continue  # nothing yet, or left over from an earlier assignment
                if msg.error() is None:
                    return msg.offset()
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return None
            return UNKNOWN  # a slow broker is not the end of the partition
        finally:
            consumer.unassign()
