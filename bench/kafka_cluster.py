"""Kafka cluster benchmark: one embedded broker against a cluster of three, side by side.

Run from the repository root: ``python -m bench.kafka_cluster [--rounds N] [--steps N]``.

Each round starts a fresh embedded broker (``kafka.brokers = 1``: replication 1) and a
fresh cluster (``kafka.brokers = 3``: replication 3, ``min.insync.replicas`` 2, the
internal topics too), one after the other, and measures on each:

1. **Produce records/s**: ``--records`` records of ``--record-kb`` KiB (about a scored
   group of the tiny model) with the producers' settings (idempotent, ``acks=all``), to a
   topic of 4 partitions created by ``infra.topics`` with the cluster's replication.
2. **Transactional records/s**: the same records read back and written to a second topic
   in transactions of 50 that commit the consumer's offsets, as the stream worker does.
3. **Trainer steps/s**: ``rollstream up`` on the tiny model (every role its own process)
   for ``--steps`` trainer steps, first to last step.

Reported per broker count: the median over rounds of each figure, and the ratio of the
cluster's to the single broker's. Nothing here is a timed assertion: on a shared 2-core
machine three JVMs take CPU from the roles, which is part of what is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from bench.e2e import RunSpec, run_up, steps_per_s
from infra.services import Services
from infra.topics import ensure_topics
from rollstream.config.settings import load_config
from schemas.topics import ROLLOUTS_RAW

BROKER_COUNTS = (1, 3)
TXN_BATCH = 50


def produce_rate(client: dict[str, str], topic: str, records: int, size: int) -> float:
    """Records/s of an idempotent ``acks=all`` producer, first send to last ack."""
    producer = Producer({**client, "enable.idempotence": True, "acks": "all", "linger.ms": 5})
    payload = os.urandom(size)
    began = time.perf_counter()
    for i in range(records):
        while True:
            try:
                producer.produce(topic, key=str(i).encode(), value=payload)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(120) != 0:
        raise SystemExit("the producer did not deliver every record within 120 s")
    return records / (time.perf_counter() - began)


def transactional_rate(client: dict[str, str], source: str, sink: str, records: int) -> float:
    """Records/s read from ``source`` and written to ``sink`` in transactions of
    ``TXN_BATCH`` that also commit the consumer's offsets (read_committed)."""
    group = f"bench-{uuid.uuid4().hex[:8]}"
    consumer = Consumer(
        {
            **client,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([source])
    producer = Producer({**client, "transactional.id": group})
    producer.init_transactions(30)
    done, began = 0, 0.0
    try:
        while done < records:
            batch = consumer.consume(num_messages=TXN_BATCH, timeout=10)
            batch = [m for m in batch if m.error() is None]
            if not batch:
                raise SystemExit(f"no records from {source} after {done} of {records}")
            began = began or time.perf_counter()
            producer.begin_transaction()
            for msg in batch:
                producer.produce(sink, key=msg.key(), value=msg.value())
            offsets = [TopicPartition(m.topic(), m.partition(), m.offset() + 1) for m in batch]
            producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
            producer.commit_transaction(30)
            done += len(batch)
    finally:
        consumer.close()
    return done / (time.perf_counter() - began)


def one_round(brokers: int, tmp: Path, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """The three figures on a fresh embedded cluster of ``brokers``."""
    state = tmp / f"b{brokers}-s{seed}"
    services = Services(load_config(None, state_dir=state, kafka={"brokers": brokers}))
    started = services.up().seconds
    try:
        config = services.resolved()
        client = config.kafka.client_config()
        topics = [dataclasses.replace(ROLLOUTS_RAW, name=f"bench-{n}") for n in ("in", "out")]
        ensure_topics(client, topics, config.kafka)
        figures = {"start_s": started}
        figures["produce_rps"] = produce_rate(
            client, topics[0].name, args.records, args.record_kb * 1024
        )
        source, sink = topics[0].name, topics[1].name
        figures["txn_rps"] = transactional_rate(client, source, sink, args.records)
        spec = RunSpec("async", args.steps, seed, settings={"kafka": {"brokers": brokers}})
        run = run_up(state, tmp, spec)
        figures["steps_per_s"] = steps_per_s(run.rows)
        return figures
    finally:
        services.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each on 1 then 3")
    parser.add_argument("--records", type=int, default=2000, help="records per throughput run")
    parser.add_argument("--record-kb", type=int, default=16, help="size of each record, KiB")
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per up run")
    args = parser.parse_args()
    for name in ("rounds", "records", "record_kb", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    results: dict[int, list[dict[str, float]]] = {n: [] for n in BROKER_COUNTS}
    with tempfile.TemporaryDirectory(prefix="bench-kafka-cluster-") as tmp:
        for seed in range(args.rounds):
            for brokers in BROKER_COUNTS:
                figures = one_round(brokers, Path(tmp), args, seed)
                print(f"round {seed}, {brokers} broker(s): {figures}", flush=True)
                results[brokers].append(figures)
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, medians:")
    print("| figure | 1 broker | 3 brokers | 3 / 1 |")
    print("|---|---|---|---|")
    for key in ("start_s", "produce_rps", "txn_rps", "steps_per_s"):
        one, three = (statistics.median(r[key] for r in results[n]) for n in BROKER_COUNTS)
        print(f"| {key} | {one:.2f} | {three:.2f} | {three / one:.2f} |")


if __name__ == "__main__":
    main()
