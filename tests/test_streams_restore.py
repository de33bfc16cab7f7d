"""Rebuilding a group-table partition from its changelog (``streams.restore``) on the real
broker: committed records in order, an aborted transaction's records never, deletes
applied; the gap guard asks for it once per assignment before starting a partition over."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from types import SimpleNamespace

from confluent_kafka import Producer

from core.config import KafkaConfig
from infra.topics import ensure_topics
from schemas.topics import TopicSpec
from streams.gaps import GapGuard
from streams.groups import offset_key
from streams.restore import read_changelog_partition
from streams.txn import mirror_writes


def _transactional(kafka: dict[str, str]) -> Producer:
    producer = Producer({**kafka, "transactional.id": f"t-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    return producer


def test_restore_reads_committed_changelog_records_only(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    kafka = kafka_config.client_config()
    topic = unique_name("groups-changelog")
    ensure_topics(kafka, [TopicSpec(topic, partitions=2, cleanup_policy="compact")])
    producer = _transactional(kafka)
    watermark = offset_key("rollouts.raw", 1)
    for committed, writes in (
        (True, [(b"g1", b"a"), (watermark, b"10")]),
        (False, [(b"g1", b"lost"), (b"g2", b"lost"), (watermark, b"99")]),  # aborted
        (True, [(b"g2", b"b"), (b"g1", None), (watermark, b"12")]),  # g1 deleted
    ):
        producer.begin_transaction()
        for key, value in writes:
            producer.produce(topic, key=key, value=value, partition=1)
        if committed:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    plain = Producer(kafka)
    plain.produce(topic, key=b"other", value=b"x", partition=0)  # another partition
    plain.flush(10)
    writes, end = read_changelog_partition(kafka, topic, 1)
    assert [k for k, _ in writes] == [b"g1", watermark, b"g2", b"g1", watermark]
    assert end > len(writes)  # transaction markers and aborted records occupy offsets

    store = SimpleNamespace(data={b"stale": b"1"}, _key_partition={b"stale": 1})
    table = SimpleNamespace(data=store)
    mirror_writes(table, 1, writes)
    assert store.data == {b"stale": b"1", b"g2": b"b", watermark: b"12"}
    assert store._key_partition == {b"stale": 1, b"g2": 1, watermark: 1}


def test_gap_guard_rebuilds_a_lost_partition_once_per_assignment() -> None:
    table: dict[bytes, bytes] = {}
    restored: list[int] = []

    async def restore(partition: int) -> None:
        restored.append(partition)
        if partition == 3:  # the changelog knew this partition up to offset 41
            table[offset_key("raw", 3)] = b"41"

    async def seek(_partition: int, _offset: int) -> None:
        raise AssertionError("no seek expected")

    guard = GapGuard(table, {}, "raw", seek, restore=restore)
    guard._log_start = {5: 0}  # a partition never processed starts at the log's start

    async def scenario() -> list[int]:
        expected = [await guard._expected(3), await guard._expected(3)]
        expected.append(await guard._expected(5))
        expected.append(await guard._expected(5))
        guard.revoked([5])
        expected.append(await guard._expected(5))
        return expected

    assert asyncio.run(scenario()) == [42, 42, 0, 0, 0]
    assert restored == [3, 5, 5]  # once per assignment, again after a revocation
