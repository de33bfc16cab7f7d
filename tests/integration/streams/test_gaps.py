"""``GapGuard.sweep``: a hole at the end of a partition (the consumer already past records
the table never applied, and no later record to reveal it) is sought back; a partition
still receiving records, or one whose only gap is a transaction marker, is left alone.

The guard's side consumer reads the real broker. The worker's consumer is a test double
(``FakeConsumer``: the positions it is shown and the seeks it is asked for, never applied
to a real consumer), and ``FakeSlowBroker`` stands in for a broker too slow to answer.

The situation comes from CI: a worker dropped a record with the guard, Faust committed
past the hole, the worker was killed before re-reading, and its successor started at the
end of the partition with the table's watermark behind it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from confluent_kafka import Producer

from core.config import KafkaConfig
from infra.topics import ensure_topics
from schemas.topics import TopicSpec
from streams.faust.gaps import GapGuard
from streams.groups import offset_key
from streams.processor import Message


def _produce(kafka: KafkaConfig, topic: str, counts: dict[int, int]) -> None:
    producer = Producer({**kafka.client_config(), "enable.idempotence": True})
    for partition, count in counts.items():
        for i in range(count):
            producer.produce(topic, value=b"%d" % i, key=b"g", partition=partition)
    assert producer.flush(30) == 0


class FakeConsumer:
    """Stands in for the worker's consumer: the seeks a guard asks for, and the positions
    it is shown."""

    def __init__(self, positions: dict[int, int]) -> None:
        self.positions = positions
        self.seeks: list[tuple[int, int]] = []

    async def seek(self, partition: int, offset: int) -> None:
        self.seeks.append((partition, offset))

    async def position(self, partition: int) -> int | None:
        return self.positions.get(partition)


def test_sweep_seeks_back_a_hole_at_the_end_of_a_partition(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("raw")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 3)])
    _produce(kafka_config, topic, {0: 10, 1: 3, 2: 5})
    # p0: applied up to 3, consumer at the end (10): 4..9 were never applied.
    # p1: applied up to 2, consumer at 3: caught up. p2: nothing applied, consumer at 0.
    table = {offset_key(topic, 0): b"3", offset_key(topic, 1): b"2"}
    seen = FakeConsumer({0: 10, 1: 3, 2: 0})
    guard = GapGuard(table, kafka_config.client_config(), topic, seen.seek, stall_after_s=0)

    assert asyncio.run(guard.sweep([0, 1, 2], seen.position)) == [0]
    assert seen.seeks == [(0, 4)]


def test_sweep_waits_until_the_agent_has_been_idle_for_the_stall_time(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    """Records behind a long step are still on their way: no seek while the agent works,
    nor until it has been idle for ``stall_after_s``."""
    topic = unique_name("raw")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 1)])
    _produce(kafka_config, topic, {0: 10})
    table = {offset_key(topic, 0): b"3"}
    seen = FakeConsumer({0: 10})
    # seconds, not tenths: a loaded core may wake a sleeper late, never early
    guard = GapGuard(table, kafka_config.client_config(), topic, seen.seek, stall_after_s=2.0)

    async def scenario() -> list[list[int]]:
        swept = [await guard.sweep([0], seen.position)]  # just started
        await asyncio.sleep(2.2)
        with guard.busy():  # the agent handles an event (of this partition or another)
            assert await guard.admit(Message(topic, 0, 4, b"g", b"4"))
            swept.append(await guard.sweep([0], seen.position))
        await asyncio.sleep(0.5)
        swept.append(await guard.sweep([0], seen.position))  # idle 0.5 s: too soon
        await asyncio.sleep(1.8)
        swept.append(await guard.sweep([0], seen.position))  # idle 2.3 s: a hole
        return swept

    assert asyncio.run(scenario()) == [[], [], [], [0]]
    assert seen.seeks == [(0, 4)]


def test_sweep_leaves_a_jump_over_a_transaction_marker_alone(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("raw")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 1)])
    producer = Producer(
        {**kafka_config.client_config(), "transactional.id": f"t-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=b"%d" % i, key=b"g", partition=0)
    producer.commit_transaction(30)
    # Records 0..2 applied; offset 3 is the commit marker; the consumer is at 4.
    table = {offset_key(topic, 0): b"2"}
    seen = FakeConsumer({0: 4})
    guard = GapGuard(table, kafka_config.client_config(), topic, seen.seek, stall_after_s=0)

    async def twice() -> list[list[int]]:
        return [await guard.sweep([0], seen.position) for _ in range(2)]

    assert asyncio.run(twice()) == [[], []]
    assert seen.seeks == []


class FakeSlowBroker:
    """The guard's side consumer behind a broker too slow to answer: while ``slow``, a
    poll returns nothing (as a real poll does until its timeout); the rest is the real
    consumer."""

    def __init__(self, consumer) -> None:
        self.consumer = consumer
        self.slow = True

    def poll(self, timeout: float):
        if self.slow:
            return None
        return self.consumer.poll(timeout)

    def __getattr__(self, name: str):
        return getattr(self.consumer, name)


def _slow_guard(guard: GapGuard) -> FakeSlowBroker:
    slow = FakeSlowBroker(guard._consumer())
    guard._side = slow
    return slow


def test_a_sweep_that_gets_no_answer_in_time_tries_again_next_sweep(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    """A timeout is "unknown", not "the partition ends here": the hole behind it is
    repaired by the next sweep once the broker answers."""
    topic = unique_name("raw")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 1)])
    _produce(kafka_config, topic, {0: 10})
    table = {offset_key(topic, 0): b"3"}
    seen = FakeConsumer({0: 10})
    guard = GapGuard(
        table, kafka_config.client_config(), topic, seen.seek, stall_after_s=0, lookup_timeout_s=0.3
    )
    slow = _slow_guard(guard)

    async def sweeps() -> list[list[int]]:
        first = await guard.sweep([0], seen.position)
        slow.slow = False
        guard.lookup_timeout_s = 30.0  # the real broker answers, however loaded the cores
        return [first, await guard.sweep([0], seen.position)]

    assert asyncio.run(sweeps()) == [[], [0]]
    assert seen.seeks == [(0, 4)]


def test_admit_does_not_cache_a_lookup_that_timed_out(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    """A legitimate jump (over a transaction marker) checked while the broker is slow is
    re-read, not taken for a hole forever: once the broker answers, the record is
    admitted."""
    topic = unique_name("raw")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 1)])
    producer = Producer(
        {**kafka_config.client_config(), "transactional.id": f"t-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(30)
    for _ in range(2):  # records 0..2, marker 3, records 4..6, marker 7
        producer.begin_transaction()
        for i in range(3):
            producer.produce(topic, value=b"%d" % i, key=b"g", partition=0)
        producer.commit_transaction(30)
    table = {offset_key(topic, 0): b"2"}
    seen = FakeConsumer({})
    guard = GapGuard(table, kafka_config.client_config(), topic, seen.seek, lookup_timeout_s=0.3)
    slow = _slow_guard(guard)
    msg = Message(topic, 0, 4, b"g", b"0")

    async def admits() -> list[bool]:
        first = await guard.admit(msg)  # unknown: re-read from the watermark, to be safe
        slow.slow = False
        guard.lookup_timeout_s = 30.0  # the real broker answers, however loaded the cores
        return [first, await guard.admit(msg)]

    assert asyncio.run(admits()) == [False, True]
