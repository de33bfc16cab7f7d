"""Rebuilding a group-table partition from its changelog (``streams.faust.restore``) on the real
broker: committed records in order, an aborted transaction's records never, deletes
applied, keys no committed record wrote dropped; the gap guard asks for it once per
assignment, before a partition's first record or tick. A rebalance aborts the worker's
open transactions and drops the step in flight (``streams.faust.txn``).

The situation comes from CI: a stream worker joining a run made the first worker keep
partitions whose open transaction Faust left open while it replayed the committed
changelog over memory; the table then held the group markers of uncommitted steps beside
an older watermark, and a group the open transaction (committed later) had emitted was
dead-lettered as late when its records were read again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from types import SimpleNamespace

from aiokafka import AIOKafkaProducer
from confluent_kafka import Producer
from support.streams import read_topic

from core.config import KafkaConfig
from infra.topics import ensure_topics
from schemas.topics import TopicSpec
from streams.faust.gaps import GapGuard
from streams.faust.restore import read_changelog_partition
from streams.faust.txn import EffectWriter, mirror_writes, replace_partition
from streams.groups import offset_key
from streams.processor import Message, Send, Step


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
        # delivered first: the aborted records are then in the log, and librdkafka's abort
        # right after a produce can fail as INVALID_TXN_STATE (its issue #4849)
        producer.flush(30)
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


def test_the_gap_guard_rebuilds_each_partition_once_per_assignment() -> None:
    table: dict[bytes, bytes] = {offset_key("raw", 3): b"50"}  # what a replay left in memory
    restored: list[int] = []

    async def restore(partition: int) -> None:
        await asyncio.sleep(0.01)  # a read of the changelog: others wait for it
        restored.append(partition)
        if partition == 3:  # the committed changelog knew this partition up to offset 41
            table[offset_key("raw", 3)] = b"41"

    async def seek(_partition: int, _offset: int) -> None:
        raise AssertionError("no seek expected")

    guard = GapGuard(table, {}, "raw", seek, restore=restore)
    guard._log_start = {5: 0}  # a partition never processed starts at the log's start
    tick = Message("ticks", 7, 0, b"", b"")

    async def scenario() -> list[int]:
        expected = list(await asyncio.gather(guard._expected(3), guard._expected(3)))
        expected.append(await guard._expected(5))
        assert await guard.admit(tick)  # a tick reads its partition's groups: rebuilt first
        expected.append(await guard._expected(5))
        guard.revoked([3, 5, 7])  # a rebalance: every partition again
        expected.append(await guard._expected(5))
        assert await guard.admit(tick)
        return expected

    assert asyncio.run(scenario()) == [42, 42, 0, 0, 0]
    assert restored == [3, 5, 7, 5, 7]  # once per assignment, a watermark or not


def test_a_rebalance_aborts_the_open_transaction_and_drops_the_step_in_flight(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    kafka = kafka_config.client_config()
    scored, changelog, app_id = unique_name("scored"), unique_name("changelog"), unique_name("app")
    ensure_topics(
        kafka,
        [TopicSpec(scored, partitions=1), TopicSpec(changelog, 2, cleanup_policy="compact")],
    )
    watermark = offset_key("raw", 1)

    def step(offset: int, key: bytes) -> Step:
        message = Message("raw", 1, offset, b"g", b"sample")
        return Step(
            message,
            sends=[Send(scored, b"g", b"group %d" % offset)],
            writes=[(key, b"closed"), (watermark, str(offset).encode())],
        )

    async def scenario() -> tuple[list[bytes], EffectWriter, SimpleNamespace]:
        tid = f"{app_id}-0-1"  # Faust's transactional id for raw partition 1
        txp = AIOKafkaProducer(
            bootstrap_servers=kafka_config.bootstrap_servers, transactional_id=tid
        )
        await txp.start()
        await txp.begin_transaction()
        producer = SimpleNamespace(
            _transaction_producers={tid: txp}, _trn_locks={tid: asyncio.Lock()}
        )
        app = SimpleNamespace(
            producer=producer,
            conf=SimpleNamespace(id=app_id),
            assignor=SimpleNamespace(group_for_topic=lambda _topic: 0),
        )
        store = SimpleNamespace(data={}, _key_partition={})
        table = SimpleNamespace(data=store)
        writer = EffectWriter(app, table, changelog, exactly_once=True)
        try:
            assert await writer.apply(step(5, b"g-early"), epoch=writer.epoch)  # left open
            began = writer.epoch
            await writer.abort_open_transactions()
            assert not await writer.apply(step(6, b"g-in-flight"), epoch=began)  # dropped
            await txp.begin_transaction()  # Faust's, when it assigns the partition again
            assert await writer.apply(step(7, b"g-late"), epoch=writer.epoch)
            await txp.commit_transaction()
        finally:
            await txp.stop()
        return [m.value() for m in read_topic(kafka, [scored])], writer, store

    outputs, writer, store = asyncio.run(scenario())
    assert outputs == [b"group 7"]  # the aborted step's output never reaches a reader
    assert writer.epoch == 1
    assert store.data == {b"g-early": b"closed", watermark: b"7", b"g-late": b"closed"}
    writes, _end = read_changelog_partition(kafka, changelog, 1)
    assert writes == [(b"g-late", b"closed"), (watermark, b"7")]
    assert replace_partition(SimpleNamespace(data=store), 1, writes) == 1  # g-early
    assert store.data == {b"g-late": b"closed", watermark: b"7"}
