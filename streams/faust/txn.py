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

A rebalance (eager in Faust: every partition is revoked, the kept ones included) ends
every open transaction: ``abort_open_transactions``, run once Faust has waited for the
step in progress, aborts each of them, and a step begun before that is dropped
(``apply``'s ``epoch``). Faust itself leaves the kept partitions' transactions open and
replays their committed changelog over the table's memory: the table then held a
committed watermark beside the group markers of uncommitted steps, and records of such a
group, re-read from the committed offset, were dead-lettered as late although the open
transaction, committed later, had emitted it (a joining worker caused it). After the
abort the committed log is all there is, and ``streams.faust.restore`` rebuilds each
partition's memory from it before the partition is processed again.

A step whose records cannot all be sent is never left half in a transaction: each step
waits, still holding the lock, until the broker has acknowledged every one of its records
(a record the broker refuses fails only its own batch in aiokafka, and the transaction
would commit without it). Any failure other than losing the partition (fenced, producer
stopped: its transaction can no longer commit) aborts the partition's transaction and
ends the worker (``STEP_FAILED_EXIT``): the memory holding the earlier steps of that
transaction is gone with it, and a restart resumes from what was committed, so the step
is replayed whole or not at all. A restart only helps a failure that can pass (a topic
shrunk under the worker, a broker away): a record that no replay could send, a scored
group over its topic's declared size, is refused earlier, by ``streams.processor``, and
dead-lettered as ``group_too_large``. ``FAILPOINT_ENV`` lets crash tests fail or kill a step
at chosen points.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from aiokafka.errors import ProducerClosed, ProducerFenced
from aiokafka.structs import TopicPartition

from streams.processor import Step

log = logging.getLogger(__name__)

FAILPOINT_ENV = "ROLLSTREAM_STREAMS_FAILPOINT"
"""Crash tests only: ``after_produce:N`` SIGKILLs the worker once the N-th step with
outputs has all its records acknowledged in the open transaction, before any commit;
``send_fails:N`` makes the last record of that step (a table write, after its outputs)
fail to send, as a refused or oversize record would."""

STEP_FAILED_EXIT = 75
"""The worker's exit code after a step failed and its transaction was aborted: the
supervisor (``rollstream stream``) restarts it from committed state."""

ABORT_TIMEOUT_S = 10.0

LOST_PARTITION = (ProducerFenced, ProducerClosed)
"""Send failures meaning the partition is no longer ours: its transaction cannot commit."""


@dataclass(frozen=True)
class Failpoint:
    """Where a crash test wants a step to fail (``FAILPOINT_ENV``)."""

    name: str
    step: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Failpoint | None:
        """The failpoint ``env`` names; None when unset. A malformed one is refused."""
        text = env.get(FAILPOINT_ENV)
        if not text:
            return None
        name, _, step = text.partition(":")
        if name not in ("after_produce", "send_fails") or not step.isdigit() or int(step) < 1:
            raise ValueError(
                f"{FAILPOINT_ENV}={text!r}: expected after_produce:N or send_fails:N, N >= 1"
            )
        return cls(name, int(step))


class StepFailed(RuntimeError):
    """A step's records could not all be sent: its transaction must not commit."""


def stop_worker(reason: str) -> NoReturn:
    """End the worker at once, without Faust's shutdown (which would commit the open
    transaction's offsets): a restart recovers from what was committed."""
    log.critical("%s: stopping the worker (exit %d)", reason, STEP_FAILED_EXIT)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STEP_FAILED_EXIT)


def check_faust_internals(producer: Any, store: Any) -> None:
    """Raise if Faust's producer or the table's memory store lacks what ``EffectWriter``
    and ``replace_partition`` rely on."""
    for owner, name in (
        (producer, "_transaction_producers"),
        (producer, "_trn_locks"),
        (store, "_key_partition"),
    ):
        if not hasattr(owner, name):
            raise RuntimeError(
                f"faust {type(owner).__name__} has no {name}: streams.faust.txn is written for "
                "faust-streaming 0.15.3; check its transaction handling before upgrading"
            )


class EffectWriter:
    """Sends a step's records and updates the table's memory, atomically per partition."""

    def __init__(
        self,
        app: Any,
        table: Any,
        changelog: str,
        *,
        exactly_once: bool,
        failpoint: Failpoint | None = None,
        on_failure: Callable[[str], NoReturn] = stop_worker,
    ) -> None:
        """``table``: the Faust table holding the worker's memory of the group table;
        ``changelog``: the group table's changelog topic, whose partition ``P`` gets the
        writes of source partition ``P``'s steps. ``on_failure(reason)``: called, after
        the transaction was aborted, when a step failed; it must not return (by default
        it ends the process)."""
        self.app = app
        self.table = table
        self.changelog = changelog
        self.exactly_once = exactly_once
        self.failpoint = failpoint
        self.on_failure = on_failure
        self.steps_with_outputs = 0  # counted for the failpoint
        self.epoch = 0  # transactions aborted at rebalances so far

    def transactional_id(self, topic: str, partition: int) -> str:
        """Faust's transactional id for a source topic partition."""
        group = self.app.assignor.group_for_topic(topic)
        return f"{self.app.conf.id}-{group}-{partition}"

    async def apply(self, step: Step, *, commit: bool = False, epoch: int | None = None) -> bool:
        """Produce everything ``step`` holds and update the table. False if the source
        partition is no longer ours (revoked mid-step): its new owner replays it; or if
        ``epoch`` (``self.epoch`` when the step began) is older than the last
        ``abort_open_transactions``: the step read a table that is being rebuilt, and its
        record is read again from the committed offset.

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
            if epoch is not None and epoch != self.epoch:
                log.info(
                    "step of %s-%d@%d began before a rebalance; dropped (read again)",
                    msg.topic,
                    msg.partition,
                    msg.offset,
                )
                return False
            failing = self._failpoint_hit(step, "send_fails")
            try:
                acks = []
                for n, (topic, key, value, partition, headers) in enumerate(records, 1):
                    if failing and n == len(records):
                        raise StepFailed(f"failpoint send_fails:{self.steps_with_outputs}")
                    acks.append(
                        await txp.send(topic, value, key=key, partition=partition, headers=headers)
                    )
                # Every record acknowledged before a commit can take the lock: a record
                # the broker refuses must not leave the rest of its step to be committed.
                await asyncio.gather(*acks)
            except LOST_PARTITION:
                # Fenced or stopped (rebalance): the transaction cannot commit, and the
                # message is redelivered to the partition's new owner.
                log.warning("partition of %s lost mid-step; step dropped", tid, exc_info=True)
                return False
            except Exception as err:
                await self._abort(txp, tid)
                self.on_failure(
                    f"step of {msg.topic}-{msg.partition}@{msg.offset} failed "
                    f"({type(err).__name__}: {err}); transaction {tid} aborted"
                )
            self._update_memory(step)
            if self._failpoint_hit(step, "after_produce"):
                log.warning(
                    "failpoint after_produce:%d: killing this process", self.steps_with_outputs
                )
                os.kill(os.getpid(), signal.SIGKILL)
        if commit:
            source = TopicPartition(msg.topic, msg.partition)  # what aiokafka's commit takes
            try:
                await self.app.consumer.transactions.commit({source: msg.offset + 1})
            except Exception:  # Faust's commit timer or the next re-read commits it
                log.exception("committing re-read %s-%d@%d", msg.topic, msg.partition, msg.offset)
        return True

    async def abort_open_transactions(self) -> None:
        """Abort every open transaction of this worker (at a rebalance, after Faust has
        waited for the step in progress; Faust begins new ones for the partitions it
        assigns); steps begun before are dropped. With ``at_least_once`` only the epoch
        moves."""
        self.epoch += 1
        if not self.exactly_once:
            return
        producer = self.app.producer
        for tid, txp in list(producer._transaction_producers.items()):
            lock = producer._trn_locks.get(tid)
            if lock is None:
                continue
            async with lock:
                if not txp._txn_manager.is_in_transaction():
                    continue
                await self._abort(txp, tid)  # Faust begins the next when it assigns
        log.info("rebalance: open transactions aborted (epoch %d)", self.epoch)

    def _failpoint_hit(self, step: Step, name: str) -> bool:
        """Whether ``step`` is where the failpoint ``name`` strikes (steps with outputs
        are counted once, by the first check)."""
        if self.failpoint is None or not step.sends:
            return False
        if name == "send_fails":  # the first check of each step
            self.steps_with_outputs += 1
        return self.failpoint.name == name and self.failpoint.step == self.steps_with_outputs

    async def _abort(self, txp: Any, tid: str) -> None:
        """Abort ``tid``'s open transaction (we hold its lock), so read_committed readers
        need not wait for the broker's timeout; a failure here changes nothing (the
        transaction is aborted when the restarted worker's producer claims ``tid``)."""
        try:
            await asyncio.wait_for(txp.abort_transaction(), ABORT_TIMEOUT_S)
        except Exception:
            log.exception("aborting transaction %s failed", tid)

    def _records(self, step: Step) -> list[tuple[str, bytes | None, bytes | None, int | None, Any]]:
        changelog = self.changelog
        records: list[tuple[str, bytes | None, bytes | None, int | None, Any]] = [
            (send.topic, send.key, send.value, None, list(send.headers)) for send in step.sends
        ]
        records.extend((changelog, key, value, step.partition, None) for key, value in step.writes)
        return records

    def _update_memory(self, step: Step) -> None:
        mirror_writes(self.table, step.partition, step.writes)


def replace_partition(
    table: Any, partition: int, writes: Iterable[tuple[bytes | None, bytes | None]]
) -> int:
    """Make the table's memory of ``partition`` exactly what ``writes`` (its whole committed
    changelog, in order) leave: keys of the partition that no committed record wrote go
    (an aborted step's). Returns how many keys were dropped that way."""
    store = table.data
    key_partition = store._key_partition
    dropped = [key for key, owner in key_partition.items() if owner == partition]
    for key in dropped:
        store.data.pop(key, None)
        key_partition.pop(key, None)
    mirror_writes(table, partition, writes)
    return sum(1 for key in dropped if key not in store.data)


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
