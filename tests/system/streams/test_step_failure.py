"""A record the broker refuses fails its whole step: nothing of it is committed, nothing lost.

Real broker, real Faust worker, exactly-once processing. The scored topic refuses records
over a few hundred bytes (``max.message.bytes``), so each group's record passes the
producer's own size check and fails only in the broker's answer: an asynchronous,
per-record failure, which must not let the step's other records (its table writes and
watermark) commit without it. The worker aborts the transaction and stops; once the topic
takes the records again, a new worker emits every group exactly once. A group too large
for the topic's declared size is another matter: the broker would refuse it at every
replay, so the stream dead-letters it before the transaction and goes on.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)
from support.streams import (
    FILLING,
    WorkerProcess,
    all_applied,
    create_stream_topics,
    filling_tokens,
    keyed,
    produce,
    read_topic,
    stream_topics,
    synthetic,
    wait_until,
    worker_config,
)
from support.streams import RUN as FILLING_RUN

from core.config import KafkaConfig
from schemas.control import DeadLetter
from schemas.group import decode_group
from schemas.topics import ROLLOUTS_RAW, ROLLOUTS_SCORED, producer_limits
from streams.faust.txn import STEP_FAILED_EXIT

pytestmark = pytest.mark.system

RUN = "run-step-failure"
GROUPS = 4
SIZE = 4


def set_max_message_bytes(client: dict, topic: str, size: int) -> None:
    admin = AdminClient(client)
    entry = ConfigEntry("max.message.bytes", str(size), incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[entry])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)


def setup(
    kafka_config: KafkaConfig, unique_name: Any, raw_partitions: int, **streams: Any
) -> tuple[dict[str, str], dict[str, str], str, dict[str, Any]]:
    """Client config, the test's topics (created), its app id and the worker's config: no
    group times out, no old logits, and ``streams`` on top."""
    client = kafka_config.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics, raw_partitions=raw_partitions)
    app_id = unique_name("app")
    config = worker_config(
        kafka_config.bootstrap_servers,
        topics,
        app_id,
        groups={"timeout_s": 600},
        old_logits={"mode": "off"},
        **streams,
    )
    return client, topics, app_id, config


def test_a_record_the_broker_refuses_aborts_its_step_and_stops_the_worker(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    client, topics, app_id, config = setup(
        kafka_config,
        unique_name,
        2,
        run_id=RUN,
        session_timeout_s=8.0,
        staleness={"max_staleness": 100},
    )
    samples = [
        synthetic(run_id=RUN, group_id=f"grp-{g}", group_size=SIZE, sample_index=i, seed=g * 10 + i)
        for g in range(GROUPS)
        for i in range(SIZE)
    ]

    def applied() -> bool:
        return all_applied(client, app_id, topics["raw"])

    first = WorkerProcess(config, tmp_path / "w1", name="w1").start()
    try:
        # shrunk once the worker has checked its topics' sizes at start (it would refuse
        # a topic declared smaller than its spec), then the records come
        wait_until(lambda: "Ready" in first.log() or not first.alive(), 180, "w1 to start")
        assert first.alive(), first.log()[-3000:]
        set_max_message_bytes(client, topics["scored"], 256)
        produce(client, topics["raw"], [keyed(t) for t in samples])
        wait_until(lambda: not first.alive() or applied(), 180, "w1 to stop on the refused record")
        left_work = not applied()  # the failed step's table writes were not committed either
        scored_before = read_topic(client, [topics["scored"]], timeout=30)
    finally:
        first.kill()

    set_max_message_bytes(client, topics["scored"], ROLLOUTS_SCORED.max_message_bytes)
    second = WorkerProcess(config, tmp_path / "w2", name="w2").start()
    try:
        wait_until(applied, 180, "w2 applies everything")
        scored = read_topic(client, [topics["scored"]], timeout=60)
        dead = read_topic(client, [topics["dlq"]], timeout=30)
    finally:
        second.kill()
    assert [DeadLetter.from_headers(m.headers()) for m in dead] == []
    assert Counter(decode_group(m.value()).group_id for m in scored) == Counter(
        {f"grp-{g}": 1 for g in range(GROUPS)}
    )  # none lost with the refused record, none doubled
    log = first.log()
    assert first.process is not None and first.process.returncode == STEP_FAILED_EXIT, log[-5000:]
    assert "stopping the worker" in log and "TooLarge" in log, log[-5000:]
    assert left_work and scored_before == []


def test_a_group_its_topic_would_refuse_is_dead_lettered_and_the_worker_goes_on(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    """The group's value fits the scored topic's 16 MiB, its record (key, headers, batch
    framing) would not: the broker would refuse it at every replay of the step, and the
    worker would crash-loop on it. It is dead-lettered before the transaction instead."""
    from confluent_kafka import Producer

    client, topics, app_id, config = setup(
        kafka_config, unique_name, 1, run_id=FILLING_RUN, **FILLING
    )
    tokens, _ = filling_tokens("huge")
    huge = [
        synthetic(
            run_id=FILLING_RUN, group_id="huge", group_size=5, sample_index=i, response_len=tokens
        )
        for i in range(5)
    ]
    small = [synthetic(run_id=FILLING_RUN, group_id="next", sample_index=i) for i in range(4)]
    producer = Producer({**client, **producer_limits(ROLLOUTS_RAW)})
    for key, value, headers in map(keyed, [*huge, *small]):
        producer.produce(topics["raw"], key=key, value=value, headers=headers)
    assert producer.flush(60) == 0
    worker = WorkerProcess(config, tmp_path / "w", name="w").start()
    try:
        wait_until(
            lambda: not worker.alive() or all_applied(client, app_id, topics["raw"]),
            240,
            "the worker to apply every record",
        )
        assert worker.alive(), worker.log()[-5000:]
        scored = read_topic(client, [topics["scored"]], timeout=30)
        dead = read_topic(client, [topics["dlq"]], timeout=30)
    finally:
        worker.kill()
    assert [decode_group(m.value()).group_id for m in scored] == ["next"]
    letters = [DeadLetter.from_headers(m.headers()) for m in dead]
    assert [d.reason for d in letters] == ["group_too_large"] * 5
    assert sorted(m.value() for m in dead) == sorted(keyed(t)[1] for t in huge)
