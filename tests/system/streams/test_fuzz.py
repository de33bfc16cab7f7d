"""Malformed input through a real stream worker on the real broker: every record ends in
exactly one of scored / stale / DLQ, and the worker stays up.

Several hundred records of every kind the stream refuses: bytes that are no record, every
validator defect (negative ids, ids outside the model's vocabulary, sequences longer than
its context, bad lengths, NaN, ...), another run's records, wrong keys, duplicates,
conflicting groups, late samples, versions never published, routing headers that
contradict the body, stale records, groups that time out with too few samples, and
complete groups with exactly one bad sample each (out-of-vocabulary id, future version,
lying header, stale) whose other samples must still be scored with exact old logits.

The run starts the way ``rollstream up`` starts a new one (``first_start = "committed"``
after ``start_groups_at_end``): an earlier run's records on the raw topic are not read.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer
from support.streams import (
    WorkerProcess,
    create_stream_topics,
    read_topic,
    stream_topics,
    synthetic,
    worker_config,
)

from core.config import KafkaConfig
from rollstream.config.settings import RollstreamConfig
from rollstream.up.plan import start_groups_at_end
from schemas.codec import encode, routing_headers
from schemas.control import DeadLetter, StaleRecord, VersionAnnouncement
from schemas.group import decode_group
from schemas.trajectory import Trajectory
from weights.announce import Announcer

pytestmark = pytest.mark.system

RUN = "run-fuzz"
TRAINER = 10  # the newest announced version
MAX_STALENESS = 4
Record = tuple[bytes | None, bytes, list[tuple[str, bytes]]]


def traj(group: str, index: int = 0, size: int = 4, **kw: Any) -> Trajectory:
    kw.setdefault("versions", (TRAINER - 1, TRAINER))
    return synthetic(
        run_id=RUN,
        group_id=group,
        group_size=size,
        sample_index=index,
        seed=zlib.crc32(group.encode()) + index,
        **kw,
    )


def sent(t: Trajectory, headers: list[tuple[str, bytes]] | None = None) -> Record:
    return t.group_id.encode(), encode(t), routing_headers(t) if headers is None else headers


def with_ids(t: Trajectory, position: int, value: int) -> Trajectory:
    ids = t.response_ids.copy()
    ids[position] = value
    return dataclasses.replace(t, response_ids=ids)


def lie(t: Trajectory, header: str, value: bytes) -> Record:
    return sent(t, [(k, value if k == header else v) for k, v in routing_headers(t)])


def bad_single(n: int) -> list[Record]:
    """One refused record of each kind, ``n`` times (each in a group of its own)."""
    records: list[Record] = []
    for i in range(n):
        g = f"single-{i}"
        good = traj(g, size=1)
        value = encode(good)
        records += [
            (g.encode(), b"", []),  # empty
            (g.encode(), b"\x00\x01 no record \xff" * (i + 1), []),  # bad magic
            (g.encode(), value[: len(value) // 2], []),  # truncated
            (g.encode(), value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:], []),  # checksum
            (g.encode(), value[:4] + bytes([9]) + value[5:], []),  # unknown schema version
            (g.encode(), value + b"tail", []),  # trailing bytes
            sent(dataclasses.replace(good, logp_infer=good.logp_infer[:-2])),  # length
            sent(dataclasses.replace(good, logp_infer=good.logp_infer * np.nan)),  # NaN
            sent(dataclasses.replace(good, logp_infer=-good.logp_infer + 1)),  # positive
            sent(with_ids(good, 0, -1)),  # negative id
            sent(with_ids(good, 1, 16)),  # outside the tiny model's vocabulary
            sent(with_ids(good, 2, 2**31 - 1)),
            sent(traj(g, size=1, prompt_len=40, response_len=30)),  # past its context (64)
            sent(dataclasses.replace(good, segment_lengths=good.segment_lengths[:1])),
            sent(dataclasses.replace(good, reward=float("inf"))),
            sent(dataclasses.replace(good, sample_index=3)),  # index outside the group
            sent(traj(g, size=1, versions=(TRAINER + 2,))),  # never published
            sent(traj(g, size=1, versions=(TRAINER, 10**9))),
            sent(traj(g, size=1, versions=(2,))),  # stale
            sent(dataclasses.replace(good, run_id="another-run")),  # foreign run
            (b"not-the-group", value, routing_headers(good)),  # key mismatch
            (None, value, routing_headers(good)),
            lie(good, "rs-run-id", b"another-run"),
            lie(good, "rs-group-id", b"elsewhere"),
            lie(good, "rs-min-version", b"0"),
            lie(good, "rs-trajectory-id", b"\xff\xfe"),
            sent(good, [*routing_headers(good), ("rs-region", b"twice")]),
        ]
    return records


def assembly(n: int) -> list[Record]:
    """Conflicts met while assembling groups, ``n`` of each."""
    records: list[Record] = []
    for i in range(n):
        g = f"asm-{i}"
        first = [traj(g, k) for k in range(4)]
        records += [sent(first[0]), sent(first[0])]  # duplicate
        records.append(sent(dataclasses.replace(traj(g, 0), trajectory_id=f"{g}-x")))
        records.append(sent(traj(g, 1, size=5)))  # group size disagrees
        records += [sent(t) for t in first[1:]]  # the group completes
        records.append(sent(dataclasses.replace(traj(g, 3), trajectory_id=f"{g}-late")))  # late
        records.append(sent(traj(f"lonely-{i}", 0)))  # times out alone: dead-lettered
    return records


def one_bad_sample(n: int) -> list[Record]:
    """Complete groups of 4 with exactly one bad sample of each kind; the other three
    must be scored."""
    records: list[Record] = []
    for i in range(n):
        for kind in ("vocab", "future", "header", "stale", "context"):
            g = f"{kind}-{i}"
            samples = [traj(g, k) for k in range(4)]
            bad = i % 4
            group = [sent(t) for t in samples]
            t = samples[bad]
            if kind == "vocab":
                group[bad] = sent(with_ids(t, 0, 16 + i))
            elif kind == "future":
                versions = np.array([TRAINER, TRAINER + 5])
                group[bad] = sent(dataclasses.replace(t, segment_versions=versions))
            elif kind == "header":
                group[bad] = lie(t, "rs-run-id", b"someone-else")
            elif kind == "stale":
                group[bad] = sent(traj(g, bad, versions=(1, 2)))
            else:
                group[bad] = sent(traj(g, bad, prompt_len=60, response_len=8))
            records += group
    return records


def good_groups(n: int) -> list[Record]:
    return [sent(traj(f"good-{i}", k)) for i in range(n) for k in range(4)]


def produce(kafka: KafkaConfig, topic: str, records: list[Record]) -> dict[tuple[int, int], int]:
    """Produce in order (idempotent: no reordering within a partition); returns each
    record's index by (partition, offset)."""
    producer = Producer({**kafka.client_config(), "enable.idempotence": True, "linger.ms": 5})
    where: dict[tuple[int, int], int] = {}

    def delivered(index: int):
        def report(err, msg) -> None:
            assert err is None, err
            where[(msg.partition(), msg.offset())] = index

        return report

    for index, (key, value, headers) in enumerate(records):
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered(index))
        producer.poll(0)
    assert producer.flush(60) == 0
    assert len(where) == len(records)
    return where


def test_every_malformed_record_ends_in_exactly_one_place(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    client = kafka_config.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics)
    announcer = Announcer(client, topics["versions"])
    announcer.announce(
        VersionAnnouncement(RUN, TRAINER, "s3://b/v/", None, TRAINER, "0" * 64, 1, 1)
    )
    announcer.close()
    app = unique_name("app")
    # An earlier run's records, then a new run starts at the end of raw, as `up` does.
    produce(kafka_config, topics["raw"], [sent(traj(f"old-{i}", size=1)) for i in range(20)])
    up_config = RollstreamConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "kafka": {"bootstrap_servers": kafka_config.bootstrap_servers},
            "streams": {"app_id": app, "first_start": "committed", "topics": topics},
            "trainer": {"topics": {"scored": topics["scored"], "group_id": unique_name("t")}},
        }
    )
    assert app in start_groups_at_end(up_config)

    records = bad_single(8) + assembly(6) + one_bad_sample(6) + good_groups(6)
    where = produce(kafka_config, topics["raw"], records)
    worker = WorkerProcess(
        worker_config(
            kafka_config.bootstrap_servers,
            topics,
            app,
            run_id=RUN,
            first_start="committed",
            old_logits={"mode": "exact", "source": "seeded", "model": "tiny"},
            staleness={"max_staleness": MAX_STALENESS, "future_allowance": 1},
            # 10 s: only a group left incomplete closes partial, not one whose samples a
            # loaded core processed seconds apart
            groups={"timeout_s": 10, "tick_interval_s": 0.5},
        ),
        tmp_path,
    ).start()

    def check() -> None:
        assert worker.alive(), worker.log()[-5000:]

    outputs = [topics["scored"], topics["stale"], topics["dlq"]]

    def outcomes(msgs: list) -> int:
        scored = sum(len(decode_group(m.value()).samples) for m in msgs if m.topic() == outputs[0])
        return scored + sum(1 for m in msgs if m.topic() != outputs[0])

    try:
        found = read_topic(
            client, outputs, until=lambda m: outcomes(m) >= len(records), timeout=110, check=check
        )
        check()
    finally:
        worker.stop()

    dlq = [m for m in found if m.topic() == topics["dlq"]]
    stale = [m for m in found if m.topic() == topics["stale"]]
    groups = [decode_group(m.value()) for m in found if m.topic() == topics["scored"]]
    assert outcomes(found) == len(records), Counter(
        DeadLetter.from_headers(m.headers()).reason for m in dlq
    )

    # Each record exactly once: dead letters name their source offset; scored and stale
    # samples their trajectory id, which names one record not dead-lettered.
    letters = [DeadLetter.from_headers(m.headers()) for m in dlq]
    assert {letter.source_topic for letter in letters} == {topics["raw"]}
    dead = Counter((letter.partition, letter.offset) for letter in letters)
    assert max(dead.values()) == 1
    for m, letter in zip(dlq, letters, strict=True):
        assert m.value() == records[where[(letter.partition, letter.offset)]][1]
    kept = Counter(
        [s.trajectory_id for g in groups for s in g.samples]
        + [StaleRecord.from_headers(m.headers()).trajectory_id for m in stale]
    )
    assert max(kept.values()) == 1
    assert len(dead) + sum(kept.values()) == len(records)
    assert not any(t.startswith("old-") for t in kept)  # the earlier run was not read

    reasons = Counter(letter.reason for letter in letters)
    for reason in (
        "empty",
        "bad_magic",
        "truncated",
        "checksum_mismatch",
        "unknown_schema_version",
        "trailing_bytes",
        "length_mismatch",
        "nonfinite_logprob",
        "positive_logprob",
        "token_out_of_range",
        "too_long",
        "segment_mismatch",
        "bad_reward",
        "bad_field",
        "future_version",
        "foreign_run",
        "key_mismatch",
        "header_mismatch",
        "duplicate_sample",
        "duplicate_sample_index",
        "group_size_mismatch",
        "late_sample",
        "incomplete_group",
    ):
        assert reasons[reason] > 0, (reason, reasons)
    assert "group_failed" not in reasons and "processing_error" not in reasons

    # Groups with one bad sample: the other three scored, with exact old logits, and
    # the stale windows hold at emission.
    by_id = {g.group_id: g for g in groups}
    for i in range(6):
        for kind in ("vocab", "future", "header", "stale", "context"):
            group = by_id[f"{kind}-{i}"]
            assert len(group.samples) == 3 and not group.complete
            assert i % 4 not in [s.sample_index for s in group.samples]
            assert all(s.old_logits_status == "exact" for s in group.samples)
    for group in groups:
        assert group.trainer_version_seen == TRAINER
        assert all(0 <= d.staleness <= MAX_STALENESS for d in group.diagnostics)
