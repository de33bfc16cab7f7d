"""Data operators in a real stream worker on the real broker: the chain a user configures
(a built-in and a user operator by dotted path) filters groups to ``rollouts.filtered``
with their original bytes and reasons; the others are scored; nothing is lost or doubled.
"""

from __future__ import annotations

import dataclasses
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
    synthetic_group,
    worker_config,
)

from core.config import KafkaConfig
from schemas.codec import decode
from schemas.control import FilteredGroup
from schemas.group import decode_group

pytestmark = pytest.mark.system

RUN = "run-operators"


def group(name: str, rewards: list[float]) -> list:
    return synthetic_group(RUN, name, rewards)


def test_a_chain_of_operators_in_the_worker(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    """Every built-in and a user operator, in one chain: rewards clipped and penalised per
    token, a truncated sample and a duplicate response taken out, flat and low groups
    filtered."""
    client = kafka_config.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics)
    flat = [group(f"flat-{i}", [1.0] * 4) for i in range(2)]
    low = [group(f"low-{i}", [0.0, 0.0, 0.0, 1.0]) for i in range(2)]
    good = [group(f"good-{i}", [0.0, 1.0, 1.0, 1.0]) for i in range(2)]
    clipped = group("clipped", [5.0, -3.0, 1.0, 0.5])  # clipped to [0, 1] first
    long = group("long", [0.0, 1.0, 1.0, 0.0])
    long[3] = dataclasses.replace(long[3], finish_reason="length")  # taken out by overlong
    dup = group("dup", [1.0, 0.0, 1.0, 0.0])
    dup[1] = dataclasses.replace(dup[1], response_ids=dup[0].response_ids.copy())
    groups = flat + low + good + [clipped, long, dup]
    records = [t for g in groups for t in g]
    produce(client, topics["raw"], [keyed(t) for t in records])
    worker = WorkerProcess(
        worker_config(
            kafka_config.bootstrap_servers,
            topics,
            unique_name("app"),
            run_id=RUN,
            old_logits={"mode": "exact", "source": "seeded", "model": "tiny"},
            operators=[
                {"name": "reward_clip", "options": {"low": 0.0, "high": 1.0}},
                {"name": "length_penalty", "options": {"coef": 0.01}},
                {"name": "overlong"},
                {"name": "duplicate_responses"},
                {"name": "zero_variance"},
                {"name": "support.user_operators:DropLowMean", "options": {"threshold": 0.3}},
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
    scored = {g.group_id: g for g in (decode_group(m.value()) for m in msgs
                                      if m.topic() == topics["scored"])}  # fmt: skip
    assert sorted(scored) == ["clipped", "dup", "good-0", "good-1", "long"]
    assert all(s.old_logits_status == "exact" for g in scored.values() for s in g.samples)
    penalty = 0.01 * 6  # every response has 6 tokens
    assert [s.reward for s in scored["clipped"].samples] == pytest.approx(
        [1.0 - penalty, 0.0 - penalty, 1.0 - penalty, 0.5 - penalty]
    )
    assert [s.sample_index for s in scored["long"].samples] == [0, 1, 2]
    assert [s.sample_index for s in scored["dup"].samples] == [0, 2, 3]
    assert not scored["long"].complete and scored["good-0"].complete
    filtered = [m for m in msgs if m.topic() == topics["filtered"]]
    notes = Counter(
        (n.group_id.split("-")[0], n.operator, n.reason)
        for n in (FilteredGroup.from_headers(m.headers()) for m in filtered)
    )
    assert notes == {
        ("flat", "zero_variance", "zero_variance"): 8,
        ("low", "drop_low_mean", "low_mean"): 8,
        ("long", "overlong", "removed"): 1,
        ("dup", "duplicate_responses", "removed"): 1,
    }
    sent = {t.trajectory_id: t for t in records}
    back = [decode(m.value()) for m in filtered]  # the original records, bytes intact
    assert all(t == sent[t.trajectory_id] for t in back)
    ids = [t.trajectory_id for t in back]
    ids += [s.trajectory_id for g in scored.values() for s in g.samples]
    assert sorted(ids) == sorted(sent)  # every record in exactly one place
