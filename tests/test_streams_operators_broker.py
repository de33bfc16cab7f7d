"""Data operators in a real stream worker on the real broker: the chain a user configures
(a built-in and a user operator by dotted path) filters groups to ``rollouts.filtered``
with their original bytes and reasons; the others are scored; nothing is lost or doubled.
"""

from __future__ import annotations

import zlib
from collections import Counter
from pathlib import Path

import pytest
from support.streams import (
    WorkerProcess,
    create_stream_topics,
    keyed,
    produce,
    read_topic,
    stream_topics,
    synthetic,
    worker_config,
)

from core.config import KafkaConfig
from schemas.codec import decode
from schemas.control import FilteredGroup
from schemas.group import decode_group

pytestmark = pytest.mark.slow

RUN = "run-operators"


def group(name: str, rewards: list[float]) -> list:
    return [
        synthetic(
            run_id=RUN,
            group_id=name,
            group_size=len(rewards),
            sample_index=i,
            reward=r,
            seed=zlib.crc32(name.encode()) + i,
        )
        for i, r in enumerate(rewards)
    ]


def test_a_chain_of_operators_in_the_worker(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    client = kafka_config.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics)
    flat = [group(f"flat-{i}", [1.0] * 4) for i in range(3)]
    low = [group(f"low-{i}", [0.0, 0.0, 0.0, 1.0]) for i in range(3)]
    good = [group(f"good-{i}", [0.0, 1.0, 1.0, 1.0]) for i in range(3)]
    records = [t for g in flat + low + good for t in g]
    produce(client, topics["raw"], [keyed(t) for t in records])
    worker = WorkerProcess(
        worker_config(
            kafka_config.bootstrap_servers,
            topics,
            unique_name("app"),
            run_id=RUN,
            old_logits={"mode": "exact", "source": "seeded", "model": "tiny"},
            operators=[
                {"name": "zero_variance"},
                {
                    "name": "support.user_operators:DropLowMean",
                    "options": {"threshold": 0.5},
                },
            ],
        ),
        tmp_path,
    ).start()
    try:

        def check() -> None:
            assert worker.alive(), worker.log()[-5000:]

        def done(msgs: list) -> bool:
            scored = sum(len(decode_group(m.value()).samples) for m in msgs
                         if m.topic() == topics["scored"])  # fmt: skip
            return scored + sum(m.topic() != topics["scored"] for m in msgs) >= len(records)

        outputs = [topics["scored"], topics["filtered"], topics["dlq"], topics["stale"]]
        msgs = read_topic(client, outputs, until=done, timeout=240, check=check)
    finally:
        worker.stop()
    by_topic = Counter(m.topic() for m in msgs)
    assert by_topic[topics["dlq"]] == 0 and by_topic[topics["stale"]] == 0
    scored = [decode_group(m.value()) for m in msgs if m.topic() == topics["scored"]]
    assert sorted(g.group_id for g in scored) == [f"good-{i}" for i in range(3)]
    assert all(s.old_logits_status == "exact" for g in scored for s in g.samples)
    filtered = [m for m in msgs if m.topic() == topics["filtered"]]
    notes = Counter(
        (
            FilteredGroup.from_headers(m.headers()).operator,
            FilteredGroup.from_headers(m.headers()).reason,
        )
        for m in filtered
    )
    assert notes == {("zero_variance", "zero_variance"): 12, ("drop_low_mean", "low_mean"): 12}
    sent = {t.trajectory_id: t for t in records}
    back = [decode(m.value()) for m in filtered]  # the original records, bytes intact
    assert all(t == sent[t.trajectory_id] for t in back)
    ids = [t.trajectory_id for t in back] + [s.trajectory_id for g in scored for s in g.samples]
    assert sorted(ids) == sorted(sent)  # every record in exactly one place
