"""Rebuild one partition of the group table from its changelog when Faust did not.

Faust-streaming 0.15.3 with ``exactly_once`` and the in-memory store loses a partition's
table state when the partition leaves a worker and later comes back: on revocation the
store drops the partition's keys, and on the new assignment the recovery asks for the
changelog's highwater with the last stable offset of the *previous fetch*, which a
partition not fetched since is missing, so it reads nothing. Observed when a joined
stream worker was killed: its partitions returned to the first worker with an empty
table, whose gap guard then re-read the raw partition from the run's start.

``read_changelog_partition`` reads the partition's committed changelog records in order
with a side consumer (``read_committed``: the aborted transactions of a killed worker
are invisible); ``streams.txn.mirror_writes`` applies them as Faust's recovery would. The
gap guard calls this when a partition it processes has no watermark in the table.
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
