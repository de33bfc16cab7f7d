"""Kill -9 stream workers holding half-assembled groups: every group is emitted exactly once.

Real broker, real Faust workers, exactly-once processing: the scored topic is read with
``read_committed`` (as the trainer reads it) from the start, after the app's table says
all input has been applied (its committed watermarks; Faust's committed offsets can run
ahead of them, see ``streams.faust.gaps``). No mocks.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from support.streams import (
    WorkerProcess,
    all_applied,
    applied_offsets,
    committed_offsets,
    create_stream_topics,
    keyed,
    produce,
    read_topic,
    stream_topics,
    synthetic,
    wait_until,
    worker_config,
)

from core.config import KafkaConfig
from core.topic_reader import end_offsets
from schemas.control import DeadLetter
from schemas.group import decode_group

RUN = "run-crash"

pytestmark = pytest.mark.system

GROUPS = 24
SIZE = 4


def alive(worker: WorkerProcess):
    def check() -> None:
        assert worker.alive(), worker.log()[-5000:]

    return check


def samples(group: int, indices) -> list:
    return [
        synthetic(
            run_id=RUN,
            group_id=f"grp-{group:02d}",
            group_size=SIZE,
            sample_index=i,
            versions=(i % 3,) if i != 3 else (1, 2),  # one partial rollout per group
            seed=group * 10 + i,
        )
        for i in indices
    ]


def crash_setup(
    kafka_config: KafkaConfig, unique_name, raw_partitions: int, **overrides
) -> tuple[dict, dict, str, dict]:
    """Fresh topics and app id, and a worker config that keeps every group open (long
    group timeout, wide staleness) and computes exact old logits: ``(client, topics,
    app_id, config)``."""
    client = kafka_config.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics, raw_partitions=raw_partitions)
    app_id = unique_name("app")
    config = worker_config(
        kafka_config.bootstrap_servers,
        topics,
        app_id,
        run_id=RUN,
        session_timeout_s=8.0,
        groups={"timeout_s": 600},
        staleness={"max_staleness": 100},
        old_logits={"mode": "exact", "source": "seeded", "model": "tiny"},
        **overrides,
    )
    return client, topics, app_id, config


def assert_every_group_once(
    msgs: list, dead: list, groups: int, explain: Callable[[set[str]], str] | None = None
) -> None:
    """Nothing dead-lettered (replays were recognised, not taken for duplicates), and each
    of ``groups`` groups scored exactly once, complete, with exact old logits.
    ``explain(missing)`` describes groups missing from the output."""
    assert [DeadLetter.from_headers(m.headers()) for m in dead] == []
    counts = Counter(decode_group(m.value()).group_id for m in msgs)
    expected = Counter({f"grp-{g:02d}": 1 for g in range(groups)})
    missing = set(expected) - set(counts)
    assert counts == expected, explain(missing) if explain is not None else missing
    for m in msgs:
        group = decode_group(m.value())
        assert group.complete and [s.sample_index for s in group.samples] == [0, 1, 2, 3]
        assert all(s.old_logits_status == "exact" for s in group.samples)


def test_kill_9_then_restart_emits_every_group_exactly_once(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    """Four workers in turn on one app id: w1 is killed -9 as soon as anything is visible
    downstream (mid-stream); w2 is killed once all of phase 1 is committed (it then holds
    the 18 half-assembled groups); phase 2 arrives; w3 is killed mid-stream; w4 finishes.
    Every group must come out once, complete, and nothing may be dead-lettered as a
    duplicate. (A kill once phase 1 is committed is w2's; a variant killing w1 there too
    repeated it and was dropped to keep the suite short.)"""
    client, topics, app_id, config = crash_setup(kafka_config, unique_name, raw_partitions=4)

    started: list[WorkerProcess] = []

    def worker(n: int) -> WorkerProcess:
        started.append(WorkerProcess(config, tmp_path / f"w{n}", name=f"w{n}").start())
        return started[-1]

    def scored_groups() -> Counter:
        msgs = read_topic(client, [topics["scored"]], timeout=30)
        return Counter(decode_group(m.value()).group_id for m in msgs)

    def applied() -> bool:
        return all_applied(client, app_id, topics["raw"])

    try:
        # Phase 1: half of every group, and all of the first six.
        first = [s for g in range(GROUPS) for s in samples(g, (0, 1))]
        first += [s for g in range(6) for s in samples(g, (2, 3))]
        produce(client, topics["raw"], [keyed(t) for t in first])

        w1 = worker(1)
        read_topic(
            client, [topics["scored"]], until=lambda m: len(m) >= 1, timeout=120, check=alive(w1)
        )
        w1.kill()

        w2 = worker(2)
        wait_until(applied, 180, "phase 1 applied", check=alive(w2))
        assert set(scored_groups()) == {f"grp-{g:02d}" for g in range(6)}
        w2.kill()

        # Phase 2: the other halves.
        second = [s for g in range(6, GROUPS) for s in samples(g, (2, 3))]
        produce(client, topics["raw"], [keyed(t) for t in second])
        seen_before = sum(scored_groups().values())
        w3 = worker(3)  # killed mid-stream again
        read_topic(
            client,
            [topics["scored"]],
            until=lambda m: len(m) > seen_before,
            timeout=120,
            check=alive(w3),
        )
        w3.kill()

        w4 = worker(4)
        wait_until(applied, 180, "phase 2 applied", check=alive(w4))
        msgs = read_topic(client, [topics["scored"]], timeout=60)
        dead = read_topic(client, [topics["dlq"]], timeout=30)

    finally:
        for w in started:
            w.kill()  # a no-op for those already killed; never leave a worker behind

    assert_every_group_once(
        msgs, dead, GROUPS, lambda missing: diagnose(client, topics, app_id, missing)
    )


def test_a_commit_past_the_table_at_the_end_of_a_partition_is_repaired(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    """The CI failure, made deterministic: the app's committed offsets stand at the end of
    raw while its table has applied only the first halves of the groups (a worker
    dropped a record with the gap guard, Faust committed past the hole, the worker died
    before re-reading). No later record arrives to reveal the hole; the next worker finds
    it once idle (``GapGuard.sweep``) and every group comes out once."""
    from confluent_kafka import Consumer, TopicPartition

    client, topics, app_id, config = crash_setup(kafka_config, unique_name, raw_partitions=2)
    groups = 6

    def applied() -> bool:
        return all_applied(client, app_id, topics["raw"])

    produce(client, topics["raw"], [keyed(t) for g in range(groups) for t in samples(g, (0, 1))])
    first = WorkerProcess(config, tmp_path / "w1", name="w1").start()
    try:
        wait_until(applied, 180, "the first halves applied", check=alive(first))
    finally:
        first.stop()  # leaves the consumer group: it is empty, and takes outside commits
    produce(client, topics["raw"], [keyed(t) for g in range(groups) for t in samples(g, (2, 3))])
    ends = end_offsets(client, topics["raw"])
    committer = Consumer({**client, "group.id": app_id, "enable.auto.commit": False})
    try:
        committer.commit(
            offsets=[TopicPartition(topics["raw"], p, end) for p, end in ends.items()],
            asynchronous=False,
        )
    finally:
        committer.close()
    assert committed_offsets(client, app_id, topics["raw"]) == ends
    assert not applied()

    second = WorkerProcess(config, tmp_path / "w2", name="w2").start()
    try:
        wait_until(applied, 180, "the second halves applied", check=alive(second))
        msgs = read_topic(client, [topics["scored"]], timeout=60)
        dead = read_topic(client, [topics["dlq"]], timeout=30)
    finally:
        second.kill()

    assert "seeking back" in second.log()
    assert_every_group_once(msgs, dead, groups)


def diagnose(client: dict, topics: dict, app_id: str, missing: set[str]) -> str:
    """What the topics hold about groups missing from the committed output."""
    from confluent_kafka import Consumer

    uncommitted = []
    consumer = Consumer(
        {
            **client,
            "group.id": f"diag-{app_id}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_uncommitted",
        }
    )
    consumer.subscribe([topics["scored"], f"{app_id}-groups-changelog"])
    deadline = time.monotonic() + 20
    changelog: list[str] = []
    while time.monotonic() < deadline:
        for m in consumer.consume(500, timeout=0.5):
            if m.error():
                continue
            if m.topic() == topics["scored"]:
                uncommitted.append((m.offset(), decode_group(m.value()).group_id))
            elif m.key() and (
                any(g.encode() in m.key() for g in missing) or m.key().startswith(b"o:")
            ):
                value = m.value()[:60] if m.value() else None
                changelog.append(f"  p{m.partition()}@{m.offset()} {m.key()!r} = {value!r}")
    consumer.close()
    # The summary goes last: CI shows the tail of a failure.
    lines = ["changelog (uncommitted too):", *changelog]
    lines.append(f"scored read_uncommitted: {uncommitted}")
    lines.append(f"raw ends {end_offsets(client, topics['raw'])}")
    lines.append(f"committed {committed_offsets(client, app_id, topics['raw'])}")
    lines.append(f"applied {applied_offsets(client, app_id, topics['raw'])}")
    lines.append(f"missing {sorted(missing)}")
    return "\n".join(lines)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def test_rollstream_stream_restarts_a_crashed_worker_and_loses_nothing(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    """``rollstream stream`` supervises its worker: the worker process dies (SIGKILL, as
    after an unrecoverable transaction error) while it holds half-assembled groups; the
    supervisor starts it again, it recovers its table and offsets, and every group comes
    out once."""
    client, topics, app_id, config = crash_setup(
        kafka_config, unique_name, raw_partitions=2, restart={"backoff_s": 0.5}
    )
    groups = 8

    def applied() -> bool:
        return all_applied(client, app_id, topics["raw"])

    supervised = WorkerProcess(config, tmp_path / "sup", name="sup", supervised=True).start()
    try:
        first = [keyed(t) for g in range(groups) for t in samples(g, (0, 1))]
        produce(client, topics["raw"], first)
        wait_until(applied, 180, "the first halves applied", check=alive(supervised))
        (worker,) = children(supervised.process.pid)  # type: ignore[union-attr]
        os.kill(worker, signal.SIGKILL)
        wait_until(
            lambda: any(c != worker for c in children(supervised.process.pid)),  # type: ignore[union-attr]
            60,
            "the supervisor to start a new worker",
            check=alive(supervised),
        )
        second = [keyed(t) for g in range(groups) for t in samples(g, (2, 3))]
        produce(client, topics["raw"], second)
        wait_until(applied, 180, "the second halves applied", check=alive(supervised))
        msgs = read_topic(client, [topics["scored"]], timeout=60)
        dead = read_topic(client, [topics["dlq"]], timeout=30)
        supervised.stop()
        assert supervised.process is not None and supervised.process.returncode == 0
    finally:
        supervised.kill()

    assert "restart 1 of 5" in supervised.log()
    assert_every_group_once(msgs, dead, groups)


@pytest.mark.parametrize("failpoint", ["after_produce:3", "send_fails:3"])
def test_a_step_killed_or_failed_before_its_commit_is_replayed_whole(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path, failpoint: str
) -> None:
    """The first worker dies inside a step, its records in the open transaction: killed
    -9 once the 3rd step with outputs has them all acknowledged (``after_produce``), or
    that step's last record fails to send (``send_fails``, as a refused or oversize record
    would), which must abort the transaction and stop the worker, not leave the step's
    outputs to be committed. A second worker finishes from committed state: every scored
    group, filtered sample, stale record and prompt statistic comes out exactly once."""
    from schemas.codec import decode
    from schemas.control import PromptStats, VersionAnnouncement
    from streams.faust.txn import FAILPOINT_ENV, STEP_FAILED_EXIT
    from weights.announce import Announcer

    client = kafka_config.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics, raw_partitions=2)
    announcer = Announcer(client, topics["versions"])
    announcer.announce(VersionAnnouncement(RUN, 10, "s3://b/v10/", None, 10, "0" * 64, 1, 1))
    announcer.close()
    app_id = unique_name("app")
    config = worker_config(
        kafka_config.bootstrap_servers,
        topics,
        app_id,
        run_id=RUN,
        session_timeout_s=8.0,
        groups={"timeout_s": 600},
        staleness={"max_staleness": 4},
        old_logits={"mode": "off"},
        operators=[{"name": "support.user_operators.DropLowMean", "options": {"threshold": 0.5}}],
    )
    groups = 12
    kept = {f"grp-{g:02d}" for g in range(0, groups, 2)}  # the odd groups are filtered

    def sample(g: int, i: int):  # staleness 1 or 2: admitted
        return synthetic(
            run_id=RUN, group_id=f"grp-{g:02d}", group_size=SIZE, sample_index=i,
            versions=(8 + i % 3,), reward=0.9 if g % 2 == 0 else 0.1, seed=g * 10 + i,
        )  # fmt: skip

    records = [sample(g, i) for g in range(groups) for i in range(SIZE)]
    stale = [
        synthetic(run_id=RUN, group_id=f"old-{k}", group_size=SIZE, versions=(2, 3), seed=k)
        for k in range(4)
    ]  # staleness 8: each routed to rollouts.stale
    mixed = [r for pair in zip(records[:4], stale, strict=True) for r in pair] + records[4:]
    produce(client, topics["raw"], [keyed(t) for t in mixed])

    def applied() -> bool:
        return all_applied(client, app_id, topics["raw"])

    first = WorkerProcess(config, tmp_path / "w1", name="w1", env={FAILPOINT_ENV: failpoint})
    second = WorkerProcess(config, tmp_path / "w2", name="w2")
    try:
        first.start()
        wait_until(lambda: not first.alive() or applied(), 180, "w1 to reach its failpoint")
        left_work = not applied()
        first.kill()
        second.start()
        wait_until(applied, 180, "w2 applies everything", check=alive(second))
        out = {
            name: read_topic(client, [topics[name]], timeout=60)
            for name in ("scored", "filtered", "stale", "prompt_stats", "dlq")
        }
    finally:
        first.kill()
        second.kill()

    scored = Counter(decode_group(m.value()).group_id for m in out["scored"])
    assert scored == Counter(dict.fromkeys(kept, 1))
    filtered = Counter(decode(m.value()).trajectory_id for m in out["filtered"])
    assert filtered == Counter({t.trajectory_id: 1 for t in records if t.group_id not in kept})
    assert Counter(decode(m.value()).trajectory_id for m in out["stale"]) == Counter(
        {t.trajectory_id: 1 for t in stale}
    )
    stats = [PromptStats.from_json(m.value()) for m in out["prompt_stats"]]
    latest = {s.key: s for s in stats}  # cumulative per key: the last one is the total
    assert len(stats) == groups  # one update per closed group (filtered ones too), none twice
    assert sum(s.samples for s in latest.values()) == SIZE * groups
    assert [DeadLetter.from_headers(m.headers()) for m in out["dlq"]] == []
    # the failpoint was hit, and left work for the second worker
    log = first.log()
    assert f"failpoint {failpoint}" in log, log[-5000:]
    expected_exit = -signal.SIGKILL if failpoint.startswith("after_produce") else STEP_FAILED_EXIT
    assert first.process is not None and first.process.returncode == expected_exit, log[-5000:]
    assert left_work
