"""The Faust worker on the real broker (and real S3): routing, staleness, exact old logits.

Each test runs ``python -m streams.faust.app worker`` in a subprocess with its own topics and
app id, produces records with confluent-kafka and reads what the worker committed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support.streams import (
    RecordLabels,
    WorkerProcess,
    create_stream_topics,
    keyed,
    read_topic,
    rollout,
    stream_topics,
    synthetic,
    worker_config,
)
from support.streams import produce as produce_records

from core.config import KafkaConfig, S3Config
from core.logprobs import PADDED_BATCH_ATOL
from core.models import build_tiny_llama
from schemas.codec import encode
from schemas.control import DeadLetter, StaleRecord, VersionAnnouncement
from schemas.group import decode_group
from schemas.trajectory import NO_VERSION, Trajectory
from streams.staleness import VersionTracker
from streams.versions import VersionReader
from weights.announce import Announcer
from weights.store import WeightStore
from weights.writer import DeltaWriter

RUN = "run-streams"
pytestmark = pytest.mark.system


def record(traj: Trajectory) -> tuple[bytes, bytes, list]:
    return keyed(traj)


def produce(kafka: KafkaConfig, topic: str, records: list) -> None:
    produce_records(kafka.client_config(), topic, records)


def announce(kafka: KafkaConfig, topic: str, version: int) -> None:
    announcer = Announcer(kafka.client_config(), topic)
    announcer.announce(
        VersionAnnouncement(RUN, version, f"s3://b/v{version}/", None, version, "0" * 64, 1, 1)
    )
    announcer.close()


def alive(worker: WorkerProcess) -> Callable[[], None]:
    def check() -> None:
        assert worker.alive(), worker.log()[-5000:]

    return check


def test_bad_and_stale_records_are_routed_and_the_worker_keeps_going(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    topics = stream_topics(unique_name)
    create_stream_topics(kafka_config.client_config(), topics)
    announce(kafka_config, topics["versions"], 10)  # before the worker: it must wait for it
    good = synthetic(run_id=RUN, group_id="bad", group_size=2, versions=(9,))
    n = len(good.response_ids)
    bad = {
        "bad_magic": b"\x00\x01 garbage bytes \xff",
        "length_mismatch": encode(dataclasses.replace(good, logp_infer=good.logp_infer[:-2])),
        "nonfinite_logprob": encode(
            dataclasses.replace(good, logp_infer=np.full(n, np.nan, np.float32))
        ),
        "unknown_schema_version": encode(good)[:4] + bytes([9]) + encode(good)[5:],
    }
    stale = synthetic(run_id=RUN, group_id="s", group_size=2, versions=(2, 3))
    # two of three samples: closed by the timeout (a tick), emitted partial
    lonely = [
        synthetic(run_id=RUN, group_id="part", group_size=3, sample_index=i, versions=(10,))
        for i in range(2)
    ]
    fresh = [
        synthetic(run_id=RUN, group_id="ok", group_size=2, sample_index=i, versions=(8, 10))
        for i in range(2)
    ]
    produce(
        kafka_config,
        topics["raw"],
        [(b"bad", value, [("x-origin", b"test")]) for value in bad.values()]
        + [record(stale), *map(record, fresh), *map(record, lonely)],
    )

    worker = WorkerProcess(
        worker_config(
            kafka_config.bootstrap_servers,
            topics,
            unique_name("app"),
            run_id=RUN,
            old_logits={"mode": "off"},
            staleness={"max_staleness": 4},
            # 10 s: only a group left incomplete closes partial, not one whose samples a
            # loaded core processed seconds apart
            groups={"timeout_s": 10, "tick_interval_s": 0.5},
        ),
        tmp_path,
    ).start()
    try:
        check = alive(worker)
        scored = read_topic(
            kafka_config.client_config(),
            [topics["scored"]],
            check=check,
            until=lambda m: len(m) >= 1,
            timeout=120,
        )
        dlq = read_topic(
            kafka_config.client_config(),
            [topics["dlq"]],
            check=check,
            until=lambda m: len(m) >= 4,
            timeout=60,
        )
        stale_out = read_topic(
            kafka_config.client_config(),
            [topics["stale"]],
            check=check,
            until=lambda m: len(m) >= 1,
            timeout=60,
        )
        # The worker keeps going: one more group after all the bad input.
        later = [synthetic(run_id=RUN, group_id="later", group_size=1, versions=(10,), seed=5)]
        produce(kafka_config, topics["raw"], [record(t) for t in later])
        scored = read_topic(
            kafka_config.client_config(),
            [topics["scored"]],
            check=check,
            until=lambda m: len(m) >= 3,
            timeout=60,
        )
    finally:
        worker.stop()

    letters = {DeadLetter.from_headers(m.headers()).reason: m for m in dlq}
    assert set(letters) == set(bad)
    for reason, value in bad.items():
        msg = letters[reason]
        assert msg.value() == value and msg.key() == b"bad"
        assert ("x-origin", b"test") in msg.headers()
    sources = [DeadLetter.from_headers(letters[r].headers()) for r in bad]
    assert {(s.source_topic, s.partition) for s in sources} == {
        (topics["raw"], sources[0].partition)
    }
    assert [s.offset for s in sources] == [0, 1, 2, 3]  # one key, one partition, in order

    (stale_msg,) = stale_out
    info = StaleRecord.from_headers(stale_msg.headers())
    assert (info.staleness, info.trainer_version, info.max_staleness) == (8, 10, 4)
    assert stale_msg.value() == encode(stale)

    groups = {decode_group(m.value()).group_id: decode_group(m.value()) for m in scored}
    assert set(groups) == {"ok", "later", "part"}
    part = groups["part"]
    assert not part.complete and [s.sample_index for s in part.samples] == [0, 1]
    ok = groups["ok"]
    assert ok.complete and ok.trainer_version_seen == 10
    assert [d.staleness for d in ok.diagnostics] == [2, 2]
    assert all(s.old_logits_status == "off" for s in ok.samples)


def perturb(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: a sparse update of ~5% of the elements, tied tensors kept tied."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        key = tensor.untyped_storage().data_ptr()
        if key not in done:
            noise = torch.randn(tensor.shape, generator=gen) * 0.2
            mask = torch.rand(tensor.shape, generator=gen) < 0.05
            done[key] = torch.where(mask, tensor + noise, tensor)
        out[name] = done[key]
    return out


def direct_logp(
    state: dict[str, torch.Tensor], traj: Trajectory, start: int, end: int
) -> np.ndarray:
    model = build_tiny_llama(seed=0)
    model.load_state_dict(state)
    ids = torch.tensor([[*traj.prompt_ids.tolist(), *traj.response_ids.tolist()]])
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
    p = traj.num_prompt_tokens
    return np.array(
        [logp[p + j - 1, int(traj.response_ids[j])] for j in range(start, end)], np.float32
    )


def test_stream_attaches_exact_old_logits_per_segment_version(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    topics = stream_topics(unique_name)
    create_stream_topics(kafka_config.client_config(), topics)
    skeleton = build_tiny_llama(seed=0)
    states = {0: skeleton.state_dict()}
    for version in range(1, 4):
        states[version] = perturb(states[version - 1], seed=version)
    store = WeightStore.from_config(s3_config, RUN)
    writer = DeltaWriter(
        store, announcer=Announcer(kafka_config.client_config(), topics["versions"])
    )
    for version in (0, 1):  # before the worker starts; 2 and 3 while it runs
        writer.publish(states[version], version)

    samples = [
        rollout(
            skeleton,
            states,
            [1, 5, 6],
            [(1, 5)],
            labels=RecordLabels(RUN, "A", group_size=4, sample_index=0),
            seed=1,
            infer_noise=0.02,
        ),
        rollout(
            skeleton,
            states,
            [1, 7],
            [(2, 6)],
            labels=RecordLabels(RUN, "A", group_size=4, sample_index=1),
            seed=2,
            infer_noise=0.02,
        ),
        rollout(
            skeleton,
            states,
            [1, 8, 9],
            [(3, 4)],
            labels=RecordLabels(RUN, "A", group_size=4, sample_index=2),
            seed=3,
            infer_noise=0.02,
        ),
        # a partial rollout: 3 tokens under v2, then 4 under v3
        rollout(
            skeleton,
            states,
            [1, 4],
            [(2, 3), (3, 4)],
            labels=RecordLabels(RUN, "A", group_size=4, sample_index=3),
            seed=4,
            infer_noise=0.02,
        ),
        rollout(
            skeleton,
            states,
            [1, 6],
            [(0, 5)],
            labels=RecordLabels(RUN, "B", group_size=2, sample_index=0),
            seed=5,
        ),
    ]
    never = synthetic(run_id=RUN, group_id="B", group_size=2, sample_index=1, versions=(7,))

    worker = WorkerProcess(
        worker_config(
            kafka_config.bootstrap_servers,
            topics,
            unique_name("app"),
            run_id=RUN,
            s3=s3_config,
            # an allowance wide enough to admit version 7, which S3 never gets: "missing"
            staleness={"max_staleness": 8, "future_allowance": 8},
            old_logits={"mode": "exact", "source": "s3", "max_batch_sequences": 3},
            weights={"poll_interval_s": 0.5},
        ),
        tmp_path,
    ).start()
    try:
        for version in (2, 3):
            writer.publish(states[version], version)
        produce(kafka_config, topics["raw"], [*map(record, samples), record(never)])
        scored = read_topic(
            kafka_config.client_config(),
            [topics["scored"]],
            check=alive(worker),
            until=lambda m: len(m) >= 2,
            timeout=180,
        )
    finally:
        worker.stop()

    groups = {decode_group(m.value()).group_id: decode_group(m.value()) for m in scored}
    a, b = groups["A"], groups["B"]
    assert a.complete and len(a.samples) == 4
    sent = {t.trajectory_id: t for t in samples}
    for got, diag in zip(a.samples, a.diagnostics, strict=True):
        original = sent[got.trajectory_id]
        assert got.old_logits_status == "exact"
        assert got.response_ids.tobytes() == original.response_ids.tobytes()
        start = 0
        for version, length in zip(
            original.segment_versions, original.segment_lengths, strict=True
        ):
            want = direct_logp(states[int(version)], original, start, start + int(length))
            np.testing.assert_allclose(
                got.logp_old[start : start + length], want, atol=PADDED_BATCH_ATOL
            )
            start += int(length)
        assert diag.k3_kl >= 0 and diag.d_min <= diag.d_mean <= diag.d_max
    two_segments = next(s for s in a.samples if len(s.segment_versions) == 2)
    single_version = direct_logp(states[2], two_segments, 3, 7)  # the wrong weights
    assert np.abs(two_segments.logp_old[3:] - single_version).max() > 1e-3
    assert np.isclose(sum(s.advantage for s in a.samples), 0.0, atol=1e-9)

    by_index = {s.sample_index: s for s in b.samples}
    assert by_index[0].old_logits_status == "exact"
    assert by_index[1].old_logits_status == "missing" and by_index[1].logp_old is None


def test_version_reader_catches_up_and_follows(kafka_config: KafkaConfig, unique_name) -> None:
    client = kafka_config.client_config()
    topic = unique_name("versions")
    create_stream_topics(client, {**stream_topics(unique_name), "versions": topic})
    empty = VersionReader(client, topic, RUN, VersionTracker()).start()
    assert empty.caught_up.wait(30) and empty.tracker.version == NO_VERSION
    for version in (0, 1, 2):
        announce(kafka_config, topic, version)
    late = VersionReader(client, topic, RUN, VersionTracker()).start()
    assert late.caught_up.wait(30)
    assert late.tracker.version == 2  # caught up means: everything announced before is seen
    announce(kafka_config, topic, 3)
    assert empty.tracker.wait_for(3, 30) and late.tracker.wait_for(3, 30)
    empty.stop()
    late.stop()
