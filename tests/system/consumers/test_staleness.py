"""The staleness window enforced at training time, on the real broker.

A group checked by the stream can wait in ``rollouts.scored`` while the trainer's version
moves on; the trainer judges it again against the version it is about to train, routes
it to the stale topic if it is now over ``[trainer.staleness] max_staleness``, and keeps
exactly-once accounting (ledger, offsets, checkpoint).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.synthetic import synthetic_groups
from support.trainer_runs import (
    NO_PUBLISHING,
    STALENESS_WINDOW,
    assert_same_weights,
    end_and_committed,
    group_records,
    ids_of,
    make_topics,
    metrics_lines,
    produce,
    read_all,
    reference_weights,
    restored_weights,
    settings_for,
    shared_for,
    spawn,
    trainer_config,
    write_trainer_file,
)

from consumers.checkpoint import CheckpointManager, TrainingLedger
from consumers.config import TrainerConfig
from consumers.trainer import Trainer
from core.config import KafkaConfig, S3Config, SharedConfig
from infra.topics import ensure_topics
from schemas.control import StaleRecord
from schemas.group import decode_group
from schemas.topics import ROLLOUTS_STALE

RUN = "trainer-test"


def topics_with_stale(kafka: KafkaConfig, unique_name: Callable[[str], str]) -> dict[str, str]:
    """The trainer's topics plus a stale topic of its own."""
    topics = make_topics(kafka, unique_name)
    topics["stale"] = unique_name("rollouts.stale")
    ensure_topics(
        kafka.client_config(), [dataclasses.replace(ROLLOUTS_STALE, name=topics["stale"])]
    )
    return topics


@pytest.mark.system
def test_groups_too_stale_by_training_time_are_routed_not_trained(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str], tmp_path: Path
) -> None:
    topics = topics_with_stale(kafka_config, unique_name)
    # run 1: three steps on fresh version-0 groups (2 groups a step)
    first = synthetic_groups(6, seed=31, run_id=RUN, version=0)
    produce(kafka_config, topics["scored"], group_records(first))
    summary = Trainer(*settings_for(tmp_path, topics, kafka_config, max_steps=3)).run()
    assert summary.step == 3 and summary.stale_groups == 0

    # a backlog built while the trainer moved on: version-0 groups are now 3 versions
    # behind (over the window of 2) and must not be trained; version-3 groups are fresh
    late = synthetic_groups(3, seed=32, run_id=RUN, version=0)
    fresh = synthetic_groups(2, seed=33, run_id=RUN, version=3)
    # one partition, late first: across partitions a fetch could bring a fresh group
    # first, leaving the last late one alone in a micro-batch no step ever counts
    produce(kafka_config, topics["scored"], group_records(late + fresh), partition=0)
    trainer = Trainer(*settings_for(tmp_path, topics, kafka_config))
    done = threading.Event()
    thread = threading.Thread(target=lambda: (trainer.run(), done.set()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        trainer.summary.stale_groups == 3 and trainer.summary.trained == 2 * len(fresh[0])
    ):
        time.sleep(0.2)
    trainer.request_stop()
    thread.join(60)
    assert done.is_set()
    assert trainer.summary.stale_groups == 3, trainer.summary

    # never trained past the window: asserted from the trainer's own metrics
    lines = metrics_lines(tmp_path)
    assert lines and all(m["staleness/max"] <= STALENESS_WINDOW for m in lines), [
        (m["step"], m.get("staleness/max")) for m in lines
    ]
    assert sum(m["data/stale_groups"] for m in lines) == 3
    assert all("lag/total" in m for m in lines)

    # exactly-once accounting: trained once or routed once, never both, nothing lost
    ledger = TrainingLedger.read(tmp_path / "ledger.jsonl")
    trained = [i for _, ids in ledger for i in ids]
    stale_ids = [i for _, ids in TrainingLedger.read_stale(tmp_path / "ledger.jsonl") for i in ids]
    assert sorted(trained) == sorted(ids_of(first + fresh))
    assert sorted(stale_ids) == sorted(ids_of(late))

    records = read_all(kafka_config, topics["stale"], expected=3)
    assert len(records) == 3
    routed = []
    for msg in records:
        info = StaleRecord.from_headers(msg.headers())
        group = decode_group(msg.value())  # the scored record, unchanged
        assert info.stage == "trainer" and info.trajectory_id == group.group_id
        # judged at the version being trained (3, or 4 once a fresh group trained first)
        assert info.staleness == info.trainer_version > STALENESS_WINDOW
        assert info.max_staleness == STALENESS_WINDOW
        routed += [s.trajectory_id for s in group.samples]
    assert sorted(routed) == sorted(stale_ids)

    ends, committed = end_and_committed(
        kafka_config, topics["scored"], f"trainer-{topics['scored']}"
    )
    assert committed == ends and sum(ends.values()) == 11


@pytest.mark.system
def test_stale_groups_with_nothing_left_to_train_are_routed_when_the_trainer_stops(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str], tmp_path: Path
) -> None:
    topics = topics_with_stale(kafka_config, unique_name)
    first = synthetic_groups(6, seed=51, run_id=RUN, version=0)
    produce(kafka_config, topics["scored"], group_records(first))
    assert Trainer(*settings_for(tmp_path, topics, kafka_config, max_steps=3)).run().step == 3

    # the end of a run: only groups over the window arrive, so no step is ever gathered
    late = synthetic_groups(4, seed=52, run_id=RUN, version=0)  # two full micro-batches
    produce(kafka_config, topics["scored"], group_records(late))
    trainer = Trainer(*settings_for(tmp_path, topics, kafka_config))
    thread = threading.Thread(target=trainer.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        source = getattr(trainer, "source", None)
        if source is not None and sum(source.positions.values()) >= 10:
            break  # all ten groups read (six trained before, four late)
        time.sleep(0.2)
    time.sleep(1.0)  # the last micro-batch closes and is judged
    trainer.request_stop()
    thread.join(60)
    assert not thread.is_alive()
    assert trainer.step == 3 and trainer.summary.stale_groups == 4, trainer.summary

    # routed, and the offsets moved past them in a new checkpoint of the same step that
    # never overwrote the durable one
    records = read_all(kafka_config, topics["stale"], expected=4)
    routed = [s.trajectory_id for m in records for s in decode_group(m.value()).samples]
    assert sorted(routed) == sorted(ids_of(late))
    ends, committed = end_and_committed(
        kafka_config, topics["scored"], f"trainer-{topics['scored']}"
    )
    assert committed == ends
    manager = CheckpointManager(trainer.config.checkpoint)
    assert manager.latest() == ("step000000003-1", 3)
    trained = [i for _, ids in TrainingLedger.read(tmp_path / "ledger.jsonl") for i in ids]
    assert sorted(trained) == sorted(ids_of(first))


@pytest.mark.system
def test_stale_groups_of_a_checkpoint_cut_short_by_kill_9_are_routed_once_after_restart(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    topics = topics_with_stale(kafka_config, unique_name)
    one_a_step = {
        "batch": {"max_groups": 1, "max_wait_s": 30.0},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1},
    }
    # life 1 (in process): three steps of one fresh version-0 group each
    first = synthetic_groups(3, seed=41, run_id=RUN, version=0)
    produce(kafka_config, topics["scored"], group_records(first))
    first_life = settings_for(tmp_path, topics, kafka_config, max_steps=3, **one_a_step)
    summary = Trainer(*first_life).run()
    assert summary.step == 3

    # the backlog, oldest first: version-0 groups now over the window, then fresh ones
    late = synthetic_groups(3, seed=42, run_id=RUN, version=0)
    fresh = synthetic_groups(3, seed=43, run_id=RUN, version=3)
    now_ms = int(time.time() * 1000)
    produce(kafka_config, topics["scored"], group_records(late), timestamp_ms=now_ms - 60_000)
    produce(kafka_config, topics["scored"], group_records(fresh), timestamp_ms=now_ms - 30_000)

    # life 2 (a process): sets the late groups aside while gathering step 4, trains a
    # fresh one, and dies right after checkpoint 4 is durable: before routing them
    trainer = trainer_config(
        tmp_path, topics, staleness={"max_staleness": STALENESS_WINDOW}, **one_a_step
    )
    config_path = write_trainer_file(tmp_path / "rollstream.toml", kafka_config, s3_config, trainer)
    log_path = tmp_path / "trainer.log"
    second = spawn(config_path, log_path, failpoint="after_checkpoint:4")
    assert second.wait(180) == -signal.SIGKILL, log_path.read_text()[-4000:]
    assert CheckpointManager(TrainerConfig.model_validate(trainer).checkpoint).latest() == (
        "step000000004",
        4,
    )
    ledger_path = tmp_path / "ledger.jsonl"
    assert [s for s, _ in TrainingLedger.read(ledger_path)] == [1, 2, 3]
    assert read_all(kafka_config, topics["stale"], expected=0, timeout_s=2) == []

    # life 3 (in process): routes the checkpoint's stale groups, writes ledger line 4,
    # and trains the rest
    third = Trainer(*settings_for(tmp_path, topics, kafka_config, **one_a_step))
    thread = threading.Thread(target=third.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        trained = [i for _, ids in TrainingLedger.read(ledger_path) for i in ids]
        if len(trained) == len(ids_of(first + fresh)):
            break
        time.sleep(0.2)
    third.request_stop()
    thread.join(60)
    assert not thread.is_alive()

    trained = [i for _, ids in TrainingLedger.read(ledger_path) for i in ids]
    stale_ids = [i for _, ids in TrainingLedger.read_stale(ledger_path) for i in ids]
    assert sorted(trained) == sorted(ids_of(first + fresh))
    assert sorted(stale_ids) == sorted(ids_of(late))
    records = read_all(kafka_config, topics["stale"], expected=3)
    routed = [s.trajectory_id for m in records for s in decode_group(m.value()).samples]
    assert sorted(routed) == sorted(ids_of(late))  # each once: none lost, none twice
    lines = metrics_lines(tmp_path)
    assert all(m["staleness/max"] <= STALENESS_WINDOW for m in lines)
    # the weights are the proof: the same steps trained without a crash end identical
    config = third.config
    reference = reference_weights(kafka_config, config, ledger_path, first + fresh)
    assert_same_weights(restored_weights(config), reference)


@pytest.mark.system
def test_over_window_groups_train_with_the_relaxed_clip_up_to_the_hard_limit(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str], tmp_path: Path
) -> None:
    topics = topics_with_stale(kafka_config, unique_name)
    staleness = {"max_staleness": 1, "over_window": "relaxed_clip", "relaxed_max_staleness": 3}

    def settings(**extra: object) -> tuple[SharedConfig, TrainerConfig]:
        config = TrainerConfig.model_validate(
            trainer_config(tmp_path, topics, staleness=staleness, publish=NO_PUBLISHING, **extra)
        )
        return shared_for(kafka_config), config

    first = synthetic_groups(8, seed=41, run_id=RUN, version=0)
    produce(kafka_config, topics["scored"], group_records(first))
    assert Trainer(*settings(max_steps=4)).run().step == 4
    # judged at version 4: lag 4 is over the hard limit (routed), lag 2 over the window
    # (trained with the relaxed clip), lag 0 fresh
    routed = synthetic_groups(2, seed=42, run_id=RUN, version=0)
    relaxed = synthetic_groups(2, seed=43, run_id=RUN, version=2)
    fresh = synthetic_groups(2, seed=44, run_id=RUN, version=4)
    produce(kafka_config, topics["scored"], group_records(routed + relaxed + fresh))
    # one micro-batch holds the six groups: they are judged at the same version, 4
    trainer = Trainer(*settings(batch={"max_groups": 6, "max_wait_s": 5.0}))
    thread = threading.Thread(target=trainer.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        trainer.summary.stale_groups == 2 and trainer.summary.trained == 16
    ):
        time.sleep(0.2)
    trainer.request_stop()
    thread.join(60)
    summary = trainer.summary
    assert summary.stale_groups == 2 and summary.trained == 16, summary

    ledger = TrainingLedger.read(tmp_path / "ledger.jsonl")
    trained = sorted(i for _, ids in ledger for i in ids)
    assert trained == sorted(ids_of(first + relaxed + fresh)), (ledger, summary)
    stale_ids = [i for _, ids in TrainingLedger.read_stale(tmp_path / "ledger.jsonl") for i in ids]
    assert sorted(stale_ids) == sorted(ids_of(routed))
    lines = metrics_lines(tmp_path)
    over = [m for m in lines if m["data/over_window_trajectories"] > 0]
    # run 1 trained its own version-0 groups past the window too, at versions 2 and 3
    second = [m for m in lines if m["step"] > 4]
    assert sum(m["data/over_window_trajectories"] for m in second) == len(ids_of(relaxed))
    assert sum(m["data/over_window_trajectories"] for m in lines if m["step"] <= 4) == 16
    assert over and all(m["clip/relaxed_frac"] > 0 for m in over)
    assert all(m["staleness/max"] <= 3 for m in lines)
