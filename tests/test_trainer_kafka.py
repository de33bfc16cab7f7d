"""The trainer on the real broker and the real S3 server.

- In process: scored groups in, dead letters out (garbage and untrainable records), every
  valid trajectory trained once, offsets committed, versions 0..N readable from S3 and
  equal bit for bit to the checkpointed weights.
- As a subprocess with three lives: killed right after a checkpoint is durable but before
  its ledger lines and offset commit (a failpoint), then SIGKILLed between two
  checkpoints, then run to the end. The ledger (written only for checkpointed steps) holds
  every produced trajectory exactly once, the rolled-back step was trained again, offsets
  end committed at the topic's end, and the store holds every version 0..N once, with a
  base after the second restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import orjson
import pytest
import torch
from confluent_kafka import Consumer, Producer, TopicPartition
from support.synthetic import scored_group, synthetic_groups

from consumers.checkpoint import CheckpointManager, TrainingLedger
from consumers.config import TrainerConfig
from consumers.train_engine import TrainEngine
from consumers.trainer import FAILPOINT_ENV, Trainer
from core.config import KafkaConfig, S3Config, SharedConfig
from core.models import load_model
from infra.s3 import SeaweedServer, ensure_bucket
from infra.topics import ensure_topics
from schemas.control import DeadLetter, VersionAnnouncement
from schemas.group import encode_group
from schemas.topics import POLICY_VERSIONS, ROLLOUTS_DLQ, ROLLOUTS_SCORED
from schemas.trajectory import Trajectory
from weights.follower import WeightFollower
from weights.store import WeightStore, make_s3_client

RUN = "trainer-test"
REPO = Path(__file__).resolve().parents[1]


def make_topics(kafka: KafkaConfig, unique_name: Callable[[str], str]) -> dict[str, str]:
    names = {
        "scored": unique_name("rollouts.scored"),
        "dlq": unique_name("rollouts.dlq"),
        "versions": unique_name("policy.versions"),
    }
    specs = [
        dataclasses.replace(ROLLOUTS_SCORED, name=names["scored"]),
        dataclasses.replace(ROLLOUTS_DLQ, name=names["dlq"]),
        dataclasses.replace(POLICY_VERSIONS, name=names["versions"]),
    ]
    ensure_topics(kafka.client_config(), specs)
    return names


def produce(
    kafka: KafkaConfig,
    topic: str,
    items: Iterable[tuple[bytes, bytes]],
    timestamp_ms: int = 0,
) -> None:
    """``timestamp_ms`` (0: now) orders records across partitions for the trainer, which
    serves the oldest first."""
    producer = Producer({**kafka.client_config(), "enable.idempotence": True})
    errors: list[object] = []
    for key, value in items:
        producer.produce(
            topic,
            key=key,
            value=value,
            timestamp=timestamp_ms,
            on_delivery=lambda e, _m: errors.append(e),
        )
        producer.poll(0)
    assert producer.flush(30) == 0
    assert not [e for e in errors if e is not None]


def group_records(groups: list[list[Trajectory]]) -> list[tuple[bytes, bytes]]:
    return [(g[0].group_id.encode(), encode_group(scored_group(g))) for g in groups]


def read_all(kafka: KafkaConfig, topic: str, expected: int, timeout_s: float = 30) -> list:
    consumer = Consumer(
        {
            **kafka.client_config(),
            "group.id": f"reader-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    found = []
    deadline = time.monotonic() + timeout_s
    while len(found) < expected and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            found.append(msg)
    time.sleep(0.5)  # anything beyond `expected` would show up now
    while (msg := consumer.poll(0.5)) is not None:
        found.append(msg)
    consumer.close()
    return found


def end_and_committed(kafka: KafkaConfig, topic: str, group_id: str) -> tuple[dict, dict]:
    consumer = Consumer({**kafka.client_config(), "group.id": group_id})
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    ends = {
        p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
        for p in partitions
    }
    committed = {
        tp.partition: tp.offset
        for tp in consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
    }
    consumer.close()
    return ends, committed


def trainer_config(tmp: Path, topics: dict[str, str], **extra: object) -> dict:
    return {
        # explicit, so the trainer subprocesses (which derive the rest from the profile)
        # and the in-process checks build the same engine
        "engine": {"lr": 1e-3, "zero_stage": 1, "bf16": True},
        "batch": {"max_groups": 2, "max_wait_s": 30.0},
        "topics": {**topics, "group_id": f"trainer-{topics['scored']}"},
        "checkpoint": {"dir": str(tmp / "ckpt"), "every": 3},
        "metrics_file": str(tmp / "metrics.jsonl"),
        "ledger_file": str(tmp / "ledger.jsonl"),
        "progress": False,
        # the synthetic groups are all version 0: every one stays trainable at any step
        "staleness": {"max_staleness": 1000},
        **extra,
    }


def shared_for(kafka: KafkaConfig, s3: S3Config | None = None) -> SharedConfig:
    """The shared sections a trainer in this process gets: this cluster, no heartbeats."""
    return SharedConfig(
        run_id=RUN, kafka=kafka, presence={"enabled": False}, **({"s3": s3} if s3 else {})
    )


def ids_of(groups: list[list[Trajectory]]) -> list[str]:
    return [t.trajectory_id for g in groups for t in g]


def restored_weights(config: TrainerConfig) -> dict[str, torch.Tensor]:
    engine = TrainEngine(load_model(config.model.spec), config.engine)
    assert CheckpointManager(config.checkpoint).load(engine) is not None
    return engine.state_dict()


@pytest.mark.system
def test_trains_every_valid_group_dead_letters_the_rest_and_publishes(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    topics = make_topics(kafka_config, unique_name)
    groups = synthetic_groups(6, seed=21, run_id=RUN)
    bad_token = synthetic_groups(1, seed=22, run_id=RUN, vocab_size=99, prompt_len=1)
    bad_token[0][0] = dataclasses.replace(
        bad_token[0][0], response_ids=bad_token[0][0].response_ids + 90
    )
    # the bad records are the oldest, so they are read before the last group is trained
    bad = [(b"junk", b"not a scored group"), (b"g", encode_group(scored_group(bad_token[0])))]
    produce(kafka_config, topics["scored"], bad, timestamp_ms=int(time.time() * 1000) - 60_000)
    produce(kafka_config, topics["scored"], group_records(groups))

    config = TrainerConfig.model_validate(trainer_config(tmp_path, topics, max_steps=3))
    summary = Trainer(shared_for(kafka_config, s3_config), config).run()

    assert summary.step == 3 and summary.trained == 24 and summary.dead_letters == 2
    ledger = TrainingLedger.read(tmp_path / "ledger.jsonl")
    assert [s for s, _ in ledger] == [1, 2, 3]
    trained = [i for _, ids in ledger for i in ids]
    assert sorted(trained) == sorted(ids_of(groups))

    letters = read_all(kafka_config, topics["dlq"], expected=2)
    reasons = sorted(DeadLetter.from_headers(m.headers()).reason for m in letters)
    assert reasons == ["bad_magic", "token_out_of_range"]
    junk = next(m for m in letters if m.key() == b"junk")
    assert junk.value() == b"not a scored group"  # the original bytes, replayable

    ends, committed = end_and_committed(kafka_config, topics["scored"], config.topics.group_id)
    assert committed == ends and sum(ends.values()) == 8

    lines = [orjson.loads(x) for x in (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in lines] == [1.0, 2.0, 3.0]
    for key in ("loss/total", "reward/mean", "staleness/hist/0", "grad/norm", "clip/frac"):
        assert key in lines[-1]

    store = WeightStore.from_config(s3_config, RUN)
    assert store.versions() == [0, 1, 2, 3]
    announced = read_all(kafka_config, topics["versions"], expected=4)
    versions = [VersionAnnouncement.from_json(m.value()).version for m in announced]
    assert versions == [0, 1, 2, 3]
    snapshot = WeightFollower(store).sync(3)
    assert snapshot is not None and snapshot.version == 3
    final = restored_weights(config)
    for name, value in final.items():
        assert torch.equal(snapshot.state[name], value), name


def spawn(config_path: Path, log_path: Path, failpoint: str | None = None) -> subprocess.Popen:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(REPO)
    if failpoint is not None:
        env[FAILPOINT_ENV] = failpoint
    return subprocess.Popen(
        [sys.executable, "-m", "consumers", "--config", str(config_path)],
        cwd=REPO,
        env=env,
        stdout=log_path.open("ab"),
        stderr=subprocess.STDOUT,
    )


def wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_bytes().splitlines()
            if lines and orjson.loads(lines[-1])["step"] >= step:
                return
        assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout_s}s")


def write_toml(path: Path, data: dict) -> None:
    def value(v: object) -> str:
        if isinstance(v, str):
            return orjson.dumps(v).decode()
        if isinstance(v, bool):
            return "true" if v else "false"
        return repr(v)

    def table(prefix: str, body: dict) -> list[str]:
        lines = [f"[{prefix}]"] if prefix else []
        nested = []
        for key, v in body.items():
            if isinstance(v, dict):
                nested.append((key, v))
            else:
                lines.append(f"{key} = {value(v)}")
        for key, v in nested:
            lines += table(f"{prefix}.{key}" if prefix else key, v)
        return lines

    path.write_text("\n".join(table("", data)) + "\n")


@pytest.mark.system
def test_kill_9_between_checkpoints_then_restart_trains_each_trajectory_once(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    topics = make_topics(kafka_config, unique_name)
    groups = synthetic_groups(28, seed=31, run_id=RUN)
    trainer = trainer_config(tmp_path, topics, max_steps=14)
    group_id = trainer["topics"]["group_id"]
    s3 = {
        "name": s3_config.name,
        "endpoint_url": s3_config.endpoint_url,
        "bucket": s3_config.bucket,
        "embedded": False,
        "access_key_id": s3_config.access_key_id,
        "secret_access_key": s3_config.secret_access_key.get_secret_value()
        if s3_config.secret_access_key
        else None,
    }
    config_path = tmp_path / "rollstream.toml"
    write_toml(
        config_path,
        {
            "run_id": RUN,
            "kafka": {"bootstrap_servers": kafka_config.bootstrap_servers},
            "s3": {k: v for k, v in s3.items() if v is not None},
            "trainer": trainer,
            "weights": {"max_delta_fraction": 1.0},  # deltas even at this high lr
        },
    )
    log_path = tmp_path / "trainer.log"
    metrics = tmp_path / "metrics.jsonl"
    ledger_path = tmp_path / "ledger.jsonl"
    checkpoints = CheckpointManager(TrainerConfig.model_validate(trainer).checkpoint)
    produce(kafka_config, topics["scored"], group_records(groups[:14]))

    # Life 1: dies right after checkpoint 3 is durable, before the ledger and the commit.
    first = spawn(config_path, log_path, failpoint="after_checkpoint:3")
    assert first.wait(180) == -signal.SIGKILL, log_path.read_text()[-4000:]
    assert checkpoints.latest() == ("step000000003", 3)
    assert TrainingLedger.read(ledger_path) == []
    _ends, committed = end_and_committed(kafka_config, topics["scored"], group_id)
    assert all(offset < 0 for offset in committed.values())  # nothing committed yet

    # Life 2: restores step 3 (the ledger gets steps 1-3 from the checkpoint, the offsets
    # come from the checkpoint, not from Kafka), trains up to step 7 with the 14 groups
    # (checkpoint at 6), and is killed while it waits for more data.
    second = spawn(config_path, log_path)
    try:
        wait_for_step(metrics, 7, second)
        second.send_signal(signal.SIGKILL)
        assert second.wait(30) == -signal.SIGKILL
    finally:
        if second.poll() is None:
            second.kill()
    assert [s for s, _ in TrainingLedger.read(ledger_path)] == list(range(1, 7))
    assert checkpoints.latest() == ("step000000006", 6)

    # Life 3: the rest of the data; it resumes at step 6's offsets and stops at 14.
    produce(kafka_config, topics["scored"], group_records(groups[14:]))
    third = spawn(config_path, log_path)
    try:
        assert third.wait(180) == 0, log_path.read_text()[-4000:]
    finally:
        if third.poll() is None:
            third.kill()

    ledger = TrainingLedger.read(tmp_path / "ledger.jsonl")
    assert [s for s, _ in ledger] == list(range(1, 15))
    trained = [i for _, ids in ledger for i in ids]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert set(trained) == set(ids_of(groups)), "a trajectory was skipped"
    # both crashes were real: life 1 died inside step 3's checkpoint (its metrics line is
    # written after it), life 2 logged steps 4-7, life 3 trained step 7 again
    steps_logged = [orjson.loads(x)["step"] for x in metrics.read_bytes().splitlines()]
    assert steps_logged == [1, 2, *range(4, 8), *range(7, 15)]

    ends, committed = end_and_committed(kafka_config, topics["scored"], group_id)
    assert committed == ends and sum(ends.values()) == 28

    store = WeightStore.from_config(s3_config, RUN)
    assert store.versions() == list(range(15))  # no gap, no version written twice
    from weights.manifest import Manifest

    kinds = [Manifest.from_bytes(store.read_manifest(v)).kind for v in range(15)]
    # a base at 0, and again at 8: the first version after the restart of life 3 (the
    # writer holds no previous state then); after life 2's restart, v4 is a base too
    assert kinds == [
        "base",
        "delta",
        "delta",
        "delta",
        "base",
        "delta",
        "delta",
        "delta",
        "base",
        "delta",
        "delta",
        "delta",
        "delta",
        "delta",
        "delta",
    ]
    snapshot = WeightFollower(store).sync(14)
    final = restored_weights(TrainerConfig.model_validate(trainer))
    assert snapshot is not None
    for name, value in final.items():
        assert torch.equal(snapshot.state[name], value), name


@pytest.mark.system
def test_an_s3_outage_is_retried_without_a_version_gap(
    kafka_config: KafkaConfig,
    unique_name: Callable[[str], str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = SeaweedServer(tmp_path / "s3")
    server.start()
    try:
        s3 = server.config(bucket="outage")
        ensure_bucket(make_s3_client(s3), s3.bucket)
        topics = make_topics(kafka_config, unique_name)
        groups = synthetic_groups(6, seed=41, run_id=RUN)
        config = TrainerConfig.model_validate(
            trainer_config(tmp_path, topics, max_steps=3, retry={"initial_s": 0.2, "max_s": 1.0})
        )
        trainer = Trainer(shared_for(kafka_config, s3), config)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                trainer.run()
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        produce(kafka_config, topics["scored"], group_records(groups[:2]))
        thread = threading.Thread(target=run, daemon=True)
        with caplog.at_level(logging.WARNING, logger="core.retry"):
            thread.start()
            metrics = tmp_path / "metrics.jsonl"
            deadline = time.monotonic() + 120
            while not (metrics.exists() and metrics.read_bytes().count(b"\n") >= 1):
                assert time.monotonic() < deadline and not errors, errors
                time.sleep(0.1)
            server.stop()  # S3 goes away after v1
            produce(kafka_config, topics["scored"], group_records(groups[2:]))
            deadline = time.monotonic() + 60
            while not any("publish v2 failed" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline and not errors, errors
                time.sleep(0.1)
            assert metrics.read_bytes().count(b"\n") == 1  # step 2 waits for its version
            server.start()
            thread.join(120)
        assert not thread.is_alive() and not errors, errors
        assert trainer.summary.step == 3 and trainer.summary.published == [0, 1, 2, 3]
        assert WeightStore.from_config(s3, RUN).versions() == [0, 1, 2, 3]
        announced = read_all(kafka_config, topics["versions"], expected=4)
        assert [VersionAnnouncement.from_json(m.value()).version for m in announced] == [
            0,
            1,
            2,
            3,
        ]
    finally:
        server.stop()
