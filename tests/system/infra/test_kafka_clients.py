"""The Python clients rollstream uses all work against the embedded Kafka 4.x broker.

Kafka 4 removed old protocol versions (KIP-896); these tests are why the broker is 4.1
rather than 3.9: confluent-kafka, aiokafka and Faust (exactly-once, with a changelogged
table) all run against it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from core.config import KafkaConfig
from infra.topics import ensure_topics
from schemas.topics import TopicSpec

FAUST_APP = textwrap.dedent(
    """
    import os
    import faust

    app = faust.App(
        os.environ["APP_ID"],
        broker="kafka://" + os.environ["BOOTSTRAP"],
        store="memory://",
        topic_replication_factor=1,
        topic_partitions=2,
        processing_guarantee="exactly_once",
        web_enabled=False,
    )
    source = app.topic(os.environ["SRC"], value_serializer="raw", key_serializer="raw")
    sink = app.topic(os.environ["DST"], value_serializer="raw", key_serializer="raw")
    counts = app.Table("counts", default=int, partitions=2)

    @app.agent(source)
    async def count(stream):
        async for event in stream.events():
            counts[event.key] += 1
            await sink.send(key=event.key, value=b"%d" % counts[event.key])

    if __name__ == "__main__":
        app.main()
    """
)


def test_aiokafka_round_trip(kafka_config: KafkaConfig, unique_name) -> None:
    topic = unique_name("aio")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, partitions=1)])

    async def round_trip() -> list[bytes]:
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_config.bootstrap_servers, enable_idempotence=True
        )
        await producer.start()
        try:
            for i in range(5):
                await producer.send_and_wait(topic, b"m%d" % i, key=b"k")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=kafka_config.bootstrap_servers,
            auto_offset_reset="earliest",
            group_id=unique_name("g"),
        )
        await consumer.start()
        try:
            batches = await consumer.getmany(timeout_ms=10_000, max_records=5)
            return [m.value for msgs in batches.values() for m in msgs]
        finally:
            await consumer.stop()

    assert asyncio.run(round_trip()) == [b"m0", b"m1", b"m2", b"m3", b"m4"]


@pytest.mark.parametrize("codec", ["gzip", "lz4", "zstd", "snappy"])
def test_aiokafka_reads_every_compression_librdkafka_writes(
    kafka_config: KafkaConfig, unique_name, codec: str
) -> None:
    """Stream workers read with aiokafka (under Faust): a producer anywhere may compress
    with any codec, and a batch the worker cannot decode would stop it (cramjam gives
    aiokafka lz4, zstd and snappy)."""
    topic = unique_name(f"codec-{codec}")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, partitions=1)])
    producer = Producer(kafka_config.client_config() | {"compression.type": codec})
    for i in range(3):
        producer.produce(topic, key=b"k", value=b"compressible %d " % i * 50)
    assert producer.flush(30) == 0

    async def read() -> list[bytes]:
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=kafka_config.bootstrap_servers,
            auto_offset_reset="earliest",
            group_id=unique_name("g"),
        )
        await consumer.start()
        try:
            batches = await consumer.getmany(timeout_ms=10_000, max_records=3)
            return [m.value for msgs in batches.values() for m in msgs]
        finally:
            await consumer.stop()

    assert asyncio.run(read()) == [b"compressible %d " % i * 50 for i in range(3)]


@pytest.mark.system
def test_faust_exactly_once_with_changelogged_table(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    src, dst, app_id = unique_name("fsrc"), unique_name("fdst"), unique_name("fapp")
    ensure_topics(
        kafka_config.client_config(),
        [TopicSpec(src, partitions=2), TopicSpec(dst, partitions=2)],
    )
    producer = Producer(kafka_config.client_config())
    for i in range(9):
        producer.produce(src, key=b"k%d" % (i % 3), value=b"x")
    assert producer.flush(30) == 0

    app_file = tmp_path / "count_app.py"
    app_file.write_text(FAUST_APP)
    env = dict(
        os.environ, APP_ID=app_id, BOOTSTRAP=kafka_config.bootstrap_servers, SRC=src, DST=dst
    )
    worker = subprocess.Popen(
        [sys.executable, str(app_file), f"--datadir={tmp_path}/d", "worker", "-l", "warn"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    consumer = Consumer(
        kafka_config.client_config()
        | {
            "group.id": unique_name("check"),
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([dst])
    seen: list[tuple[bytes, bytes]] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(seen) < 9:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                seen.append((msg.key(), msg.value()))
            assert worker.poll() is None, worker.stdout.read().decode() if worker.stdout else ""
    finally:
        consumer.close()
        worker.terminate()
        worker.wait(timeout=60)
    per_key = {k: sorted(v for kk, v in seen if kk == k) for k in (b"k0", b"k1", b"k2")}
    assert per_key == {k: [b"1", b"2", b"3"] for k in per_key}, seen
    topics = AdminClient(kafka_config.client_config()).list_topics(timeout=10).topics
    assert f"{app_id}-counts-changelog" in topics
