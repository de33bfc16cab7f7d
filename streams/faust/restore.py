"""Rebuild one partition of the group table from its committed changelog.

The gap guard (``streams.faust.gaps``) asks for this once per assignment, before a partition's
first record or tick is processed; the committed changelog is the table's only truth.
Faust-streaming 0.15.3's own table recovery with ``exactly_once`` could not be taken as
the state: it read nothing for a partition that came back to a worker (its highwater is
the last stable offset of the *previous fetch*), and for a partition a worker kept through
a rebalance it replayed the committed changelog over memory that held the steps of a
still-open transaction. So Faust's table is declared with a changelog nothing writes
(``streams.faust.topics.MEMORY_TABLE_NAME``), a rebalance aborts the open transactions
(``streams.faust.txn.EffectWriter.abort_open_transactions``), and this rebuild decides.

``read_changelog_partition`` reads the partition's committed changelog records in order
with a side consumer (``read_committed``: aborted transactions are invisible);
``streams.faust.txn.replace_partition`` makes the partition's memory exactly what they leave,
dropping keys no committed step wrote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from core.topic_reader import ReadStalled, read_range, reader_config, whole_topic

log = logging.getLogger(__name__)

RESTORE_ATTEMPTS = 3


def read_changelog_partition(
    client_config: Mapping[str, str], topic: str, partition: int, idle_timeout_s: float = 20.0
) -> tuple[list[tuple[bytes | None, bytes | None]], int]:
    """Every committed (key, value) of ``topic``'s ``partition`` in offset order, and the
    end offset read to. A transaction still open at the end (a killed worker's, until the
    broker aborts it) stalls the read: it is tried again, then raised."""
    from confluent_kafka import Consumer

    for attempt in range(1, RESTORE_ATTEMPTS + 1):
        consumer = Consumer(reader_config(client_config, "table-restore"))
        try:
            plan = whole_topic(consumer, topic, [partition])
            writes = [
                (msg.key(), msg.value())
                for msg in read_range(consumer, topic, plan, idle_timeout_s=idle_timeout_s)
            ]
            return writes, plan[partition][1]
        except ReadStalled:
            if attempt == RESTORE_ATTEMPTS:
                raise
            log.warning("%s-%d: restore stalled on an open transaction; again", topic, partition)
            time.sleep(1.0)
        finally:
            consumer.close()
    raise AssertionError("unreachable")
