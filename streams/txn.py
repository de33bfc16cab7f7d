"""Applying a ``Step`` atomically: outputs, table changes and offsets in one transaction.

Why not just ``topic.send()`` and ``table[key] = value`` under Faust's
``processing_guarantee="exactly_once"``? Measured on faust-streaming 0.15.3 (and
reported upstream: faust-streaming/faust#177, #517):

1. A send to a topic the app does not consume (``rollouts.scored``, ``.stale``, ``.dlq``)
   goes through the *non-transactional* producer: ``TransactionManager.send`` derives the
   transactional id from the destination partition, which the consumer's metadata does
   not know, and silently falls back (the sink partitions show no transaction markers).
   A crash then duplicates whatever was sent after the last commit.
2. Table writes are buffered and published by a background task into *whichever*
   transaction is open at that moment, and offsets are committed by a timer that does not
   wait for the event in progress. An event's effects can thus straddle two transactions,
   or be committed without the event's offset.

What this module does instead, per source partition ``P`` (``rollouts.raw`` and its
co-partitioned ticks topic share Faust's transactional producer for ``P``):

- every record a step produces — outputs *and* the table's changelog records, written
  by hand with the table's own key/value bytes and partition ``P`` — is sent through
  ``P``'s transactional producer while holding the lock Faust's committer takes for that
  producer (``Producer._trn_locks[tid]``), so a commit happens before or after a whole
  step, never inside one; the in-memory table is updated in the same critical section;
- each step also writes the source offset's **watermark** into the table
  (``streams.groups.offset_key``). Faust commits offsets only for acknowledged events, so
  a commit can land after a step's records but before its offset; after a crash that
  message is redelivered, finds its offset at or below the watermark, and is skipped.

Together: a step's records and watermark commit atomically with (or before) its offset,
aborted transactions are invisible to ``read_committed`` readers (the table's recovery,
the trainer), and replays are idempotent — each group reaches ``rollouts.scored`` once.

This reaches into two private attributes of Faust's aiokafka producer (pinned at
faust-streaming==0.15.3); ``check_faust_internals`` fails fast if they change. With
``at_least_once`` the same records go through the plain producer, each step waits for its
acknowledgements, and the watermark still makes replays of whole steps idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

from aiokafka.structs import TopicPartition

from streams.processor import Step

log = logging.getLogger(__name__)


def check_faust_internals(producer: Any) -> None:
    """Raise if Faust's producer lacks what ``EffectWriter`` relies on."""
    for name in ("_transaction_producers", "_trn_locks"):
        if not hasattr(producer, name):
            raise RuntimeError(
                f"faust producer has no {name}: streams.txn is written for faust-streaming "
                "0.15.3; check its transaction handling before upgrading"
            )


class EffectWriter:
    """Sends a step's records and updates the table's memory, atomically per partition."""

    def __init__(self, app: Any, table: Any, *, exactly_once: bool) -> None:
        self.app = app
        self.table = table
        self.exactly_once = exactly_once

    def transactional_id(self, topic: str, partition: int) -> str:
        """Faust's transactional id for a source topic partition."""
        group = self.app.assignor.group_for_topic(topic)
        return f"{self.app.conf.id}-{group}-{partition}"

    async def apply(self, step: Step, *, commit: bool = False) -> bool:
        """Produce everything ``step`` holds and update the table. False if the source
        partition is no longer ours (revoked mid-step): its new owner replays it.

        ``commit``: commit the partition's transaction now, with the step's source offset
        + 1 as the consumer offset, instead of leaving that to Faust's commit timer. For a
        record re-read after a gap (``GapGuard.rereading``): Faust has already committed
        past it and commits again only when a later record is acknowledged, so at the
        end of a partition the step's outputs would stay in an open transaction, unseen
        by read_committed readers. The offset moves the group's committed offset back to
        what the table has really applied."""
        if step.skipped:
            return True
        records = self._records(step)
        msg = step.message
        producer = self.app.producer
        if not self.exactly_once:
            pending = [
                await producer.send(topic, key, value, partition, None, headers)
                for topic, key, value, partition, headers in records
            ]
            await asyncio.gather(*pending)
            self._update_memory(step)
            return True
        tid = self.transactional_id(msg.topic, msg.partition)
        txp = producer._transaction_producers.get(tid)
        lock = producer._trn_locks.get(tid)
        if txp is None or lock is None:
            log.warning(
                "partition %s-%d no longer assigned; step dropped", msg.topic, msg.partition
            )
            return False
        async with lock:
            if producer._transaction_producers.get(tid) is not txp:
                log.warning("transaction %s replaced while waiting; step dropped", tid)
                return False
            try:
                for topic, key, value, partition, headers in records:
                    fut = await txp.send(
                        topic, value, key=key, partition=partition, headers=headers
                    )
                    fut.add_done_callback(_log_failure)
            except Exception:
                # Fenced or stopped (rebalance): the transaction will be aborted and the
                # message redelivered to the partition's new owner.
                log.exception("transactional send failed for %s; step dropped", tid)
                return False
            self._update_memory(step)
        if commit:
            source = TopicPartition(msg.topic, msg.partition)  # what aiokafka's commit takes
            try:
                await self.app.consumer.transactions.commit({source: msg.offset + 1})
            except Exception:  # Faust's commit timer or the next re-read commits it
                log.exception("committing re-read %s-%d@%d", msg.topic, msg.partition, msg.offset)
        return True

    def _records(self, step: Step) -> list[tuple[str, bytes | None, bytes | None, int | None, Any]]:
        changelog = self.table.changelog_topic.get_topic_name()
        records: list[tuple[str, bytes | None, bytes | None, int | None, Any]] = [
            (send.topic, send.key, send.value, None, list(send.headers)) for send in step.sends
        ]
        records.extend((changelog, key, value, step.partition, None) for key, value in step.writes)
        return records

    def _update_memory(self, step: Step) -> None:
        mirror_writes(self.table, step.partition, step.writes)


def mirror_writes(
    table: Any, partition: int, writes: Iterable[tuple[bytes | None, bytes | None]]
) -> None:
    """Apply changelog records of ``partition`` to the table's in-memory store, the way
    Faust's recovery would (including the key → partition map it uses on revocation)."""
    store = table.data
    data = store.data
    key_partition = getattr(store, "_key_partition", None)
    for key, value in writes:
        if key is None:
            continue
        if value is None:
            data.pop(key, None)
            if key_partition is not None:
                key_partition.pop(key, None)
        else:
            data[key] = value
            if key_partition is not None:
                key_partition[key] = partition


def _log_failure(fut: Awaitable[Any]) -> None:
    future = fut  # an asyncio future from aiokafka
    if not future.cancelled() and future.exception() is not None:  # type: ignore[attr-defined]
        log.error("transactional record failed: %r", future.exception())  # type: ignore[attr-defined]
