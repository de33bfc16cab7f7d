"""The trainer on the real broker and the real S3 server.

- In process: scored groups in, dead letters out (garbage, and a group for each reason the
  trainer refuses one), every valid trajectory trained once, offsets committed, versions
  0..N readable from S3 and equal bit for bit to the checkpointed weights.
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
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from support.streams import read_topic
from support.synthetic import scored_group, synthetic_groups
from support.tracking import mlflow_history, tensorboard_scalars
from support.trainer_runs import (
    RUN,
    assert_same_weights,
    end_and_committed,
    group_records,
    ids_of,
    make_topics,
    produce,
    read_all,
    reference_weights,
    restored_weights,
    run_to_the_end,
    shared_for,
    spawn,
    trainer_config,
    wait_for_step,
    write_toml,
    write_trainer_file,
)

from consumers.checkpoint import CheckpointManager, TrainingLedger
from consumers.config import TrainerConfig
from consumers.trainer import Trainer
from core.config import KafkaConfig, LoraConfig, S3Config, TrackingConfig
from infra.s3 import SeaweedServer, ensure_bucket
from infra.topics import ensure_topics
from schemas.codec import encode
from schemas.control import DeadLetter, VersionAnnouncement
from schemas.group import decode_group, encode_group
from schemas.topics import ROLLOUTS_STALE
from schemas.trajectory import (
    LOGPROB_DTYPE,
    SEGMENT_LENGTH_DTYPE,
    TOKEN_DTYPE,
    TURN_KIND_DTYPE,
    TURN_LENGTH_DTYPE,
    Trajectory,
    TurnKind,
)
from weights.follower import WeightFollower
from weights.manifest import Manifest
from weights.store import WeightStore, make_s3_client


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
    # the bad records come first in one partition (and are the oldest), so they are read
    # before the last group is trained: across partitions, a fetch may bring them too late
    bad = [(b"junk", b"not a scored group"), (b"g", encode_group(scored_group(bad_token[0])))]
    old_ms = int(time.time() * 1000) - 60_000
    produce(kafka_config, topics["scored"], bad, timestamp_ms=old_ms, partition=0)
    produce(kafka_config, topics["scored"], group_records(groups), partition=0)

    config = TrainerConfig.model_validate(trainer_config(tmp_path, topics, max_steps=3))
    tracking = TrackingConfig(backends=["tensorboard", "mlflow"])
    shared = shared_for(kafka_config, s3_config).model_copy(
        update={"state_dir": tmp_path / "state", "tracking": tracking}
    )
    summary = Trainer(shared, config).run()

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
    assert committed[0] == ends[0] == sum(ends.values()) == 8  # the others: empty

    lines = [orjson.loads(x) for x in (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in lines] == [1.0, 2.0, 3.0]
    for key in ("loss/total", "reward/mean", "staleness/hist/0", "grad/norm", "clip/frac"):
        assert key in lines[-1]
    assert lines[-1]["weights/forged_claims_total"] == 0.0  # nobody else wrote the bucket
    # the same rows in the tracking backends
    home = tmp_path / "state" / "tracking" / RUN
    for key in ("loss/total", "reward/mean"):
        want = [(int(m["step"]), m[key]) for m in lines]
        board = tensorboard_scalars(home / "tensorboard" / f"{RUN}-trainer", key)
        assert [(s, pytest.approx(v)) for s, v in board] == want  # TensorBoard keeps float32
        uri = f"sqlite:///{home / 'mlflow.db'}"
        assert mlflow_history(uri, "rollstream", f"{RUN}-trainer", key) == want

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


def _defective(traj: Trajectory, defect: str) -> Trajectory:
    """``traj`` with one defect the codec carries but the trainer must refuse; each name is
    the reason the trainer dead-letters it with (``check_trainable``'s branches)."""
    n = traj.num_response_tokens
    f32 = np.float32
    bad: dict[str, dict[str, object]] = {
        "empty_prompt": {"prompt_ids": np.zeros(0, TOKEN_DTYPE)},
        "bad_advantage/nan": {"advantage": float("nan")},
        "bad_advantage/inf": {"advantage": float("-inf")},
        "bad_advantage/none": {"advantage": None},
        "length_mismatch/infer": {"logp_infer": traj.logp_infer[:-1].copy()},
        "length_mismatch/old": {"logp_old": np.append(traj.logp_old, f32(-1.0))},
        "missing_old_logits": {"logp_old": None},
        "too_long": {"prompt_ids": np.ones(GUARD_MAX_LENGTH, TOKEN_DTYPE)},
        "token_out_of_range/response": {"response_ids": traj.response_ids + 1_000_000},
        "token_out_of_range/prompt": {"prompt_ids": traj.prompt_ids - 100},
        "nonfinite_logprob/infer": {"logp_infer": np.full(n, np.nan, LOGPROB_DTYPE)},
        "nonfinite_logprob/old": {"logp_old": np.full(n, -np.inf, LOGPROB_DTYPE)},
        "segment_mismatch": {"segment_lengths": np.array([n + 1], SEGMENT_LENGTH_DTYPE)},
        "turn_mismatch/sum": {
            "turn_lengths": np.array([n - 1], TURN_LENGTH_DTYPE),
            "turn_kinds": np.array([TurnKind.POLICY], TURN_KIND_DTYPE),
        },
        "turn_mismatch/count": {
            "turn_lengths": np.array([1, n - 1], TURN_LENGTH_DTYPE),
            "turn_kinds": np.array([TurnKind.POLICY], TURN_KIND_DTYPE),
        },
        "empty_turn": {
            "turn_lengths": np.array([0, n], TURN_LENGTH_DTYPE),
            "turn_kinds": np.array([TurnKind.ENV, TurnKind.POLICY], TURN_KIND_DTYPE),
        },
        "foreign_policy": {"policy": "another"},
    }
    return dataclasses.replace(traj, **bad[defect])  # type: ignore[arg-type]


def _with_defect(group: list[Trajectory], defect: str) -> bytes:
    """The scored record of ``group`` with its second sample made defective. The header's
    diagnostics come from the sound samples (computing them from a defective one would
    fail); the sample itself goes through the real encoder, which checks only what the
    wire format can carry."""
    sound = scored_group(group)
    samples = list(sound.samples)
    samples[1] = _defective(samples[1], defect)
    return encode_group(dataclasses.replace(sound, samples=tuple(samples)))


GUARD_MAX_LENGTH = 16
GUARD_DEFECTS = (
    "empty_prompt",
    "bad_advantage/nan",
    "bad_advantage/inf",
    "bad_advantage/none",
    "length_mismatch/infer",
    "length_mismatch/old",
    "missing_old_logits",
    "too_long",
    "token_out_of_range/response",
    "token_out_of_range/prompt",
    "nonfinite_logprob/infer",
    "nonfinite_logprob/old",
    "segment_mismatch",
    "turn_mismatch/sum",
    "turn_mismatch/count",
    "empty_turn",
    "foreign_policy",
)


@pytest.mark.system
def test_the_last_guard_dead_letters_each_untrainable_group_and_trains_the_rest(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    """Every reason the trainer refuses a decoded group (a NaN or missing advantage, NaN or
    infinite log-probs, lengths that disagree, missing old logits, too long, tokens out of
    the vocabulary, segments or turns that do not cover the response, an empty turn or
    group, another policy's sample), each in one group among sound ones: each defective
    group is dead-lettered whole with its reason and original bytes, a group of another
    run is skipped (neither trained nor dead-lettered, its offset committed), and every
    sound group trains once."""
    topics = make_topics(kafka_config, unique_name)
    good = synthetic_groups(6, seed=41, run_id=RUN)
    defective = synthetic_groups(len(GUARD_DEFECTS), seed=42, run_id=RUN, vary_lengths=False)
    sent = {d: _with_defect(g, d) for d, g in zip(GUARD_DEFECTS, defective, strict=True)}
    empty = dataclasses.replace(scored_group(defective[0]), samples=(), diagnostics=())
    sent["empty_group"] = encode_group(empty)
    sent["bad_magic"] = b"not a scored group"
    (other_run,) = synthetic_groups(1, seed=43, run_id="another-run")
    # the one turn defect the wire cannot carry: lengths without kinds never reach a trainer
    with pytest.raises(ValueError, match="both be arrays or both None"):
        encode(dataclasses.replace(other_run[0], turn_lengths=np.array([1], TURN_LENGTH_DTYPE)))
    records = [(d.encode(), value) for d, value in sent.items()]
    records.append((b"other-run", encode_group(scored_group(other_run))))
    # the defective records come first in one partition, so all are read before the last step
    old_ms = int(time.time() * 1000) - 60_000
    produce(kafka_config, topics["scored"], records, timestamp_ms=old_ms, partition=0)
    produce(kafka_config, topics["scored"], group_records(good), partition=0)

    config = TrainerConfig.model_validate(
        trainer_config(tmp_path, topics, max_steps=3, model={"max_length": GUARD_MAX_LENGTH})
    )
    summary = Trainer(shared_for(kafka_config, s3_config), config).run()

    assert summary.step == 3 and summary.trained == 24
    trained = [i for _, ids in TrainingLedger.read(tmp_path / "ledger.jsonl") for i in ids]
    assert sorted(trained) == sorted(ids_of(good))  # each sound sample once, nothing else
    letters = read_topic(kafka_config.client_config(), [topics["dlq"]], timeout=60)
    by_key = {m.key().decode(): m for m in letters}
    assert len(by_key) == len(letters) == len(sent) == summary.dead_letters
    for defect, value in sent.items():
        letter = DeadLetter.from_headers(by_key[defect].headers())
        assert letter.reason == defect.split("/")[0], (defect, letter)
        assert by_key[defect].value() == value, defect  # the original bytes, replayable
    ends, committed = end_and_committed(kafka_config, topics["scored"], config.topics.group_id)
    assert committed[0] == ends[0] == sum(ends.values()) == len(records) + len(good)


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
            # deltas even at this high lr; unsigned (read back by unkeyed followers)
            "weights": {"max_delta_fraction": 1.0, "allow_unsigned": True},
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
    run_to_the_end(config_path, log_path, 180)

    ledger = TrainingLedger.read(tmp_path / "ledger.jsonl")
    assert [s for s, _ in ledger] == list(range(1, 15))
    trained = [i for _, ids in ledger for i in ids]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert set(trained) == set(ids_of(groups)), "a trajectory was skipped"
    # both crashes were real: life 1 died right after step 3's checkpoint (its metrics
    # row, written before the checkpoint, is kept), life 2 logged steps 4-7, life 3
    # trained step 7 again
    steps_logged = [orjson.loads(x)["step"] for x in metrics.read_bytes().splitlines()]
    assert steps_logged == [*range(1, 8), *range(7, 15)]

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
    # the weights are the proof: the same steps trained without a crash end identical
    reference = reference_weights(
        kafka_config, TrainerConfig.model_validate(trainer), ledger_path, groups
    )
    assert_same_weights(final, reference)


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


FAILPOINT_CASES = [
    ("after_route_stale", None),
    ("after_ledger", None),
    ("mid_checkpoint", None),
    ("mid_publish", None),
    ("mid_publish", LoraConfig(rank=4, alpha=8.0)),  # a LoRA run's versions are adapters
]


@pytest.mark.system
@pytest.mark.parametrize(("point", "lora"), FAILPOINT_CASES, ids=lambda c: getattr(c, "rank", c))
def test_a_kill_at_each_failpoint_loses_nothing_trains_nothing_twice_and_ends_on_the_same_weights(
    point: str,
    lora: LoraConfig | None,
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    """A trainer SIGKILLs itself at ``point`` of step 4 (the failpoint's log line and the
    exit by SIGKILL prove the kill landed there), then a second life runs to step 5.
    Steps 1-3 train six version-0 groups; gathering step 4 finds two more version-0 groups
    now over the window (set aside, routed at checkpoint 4) and trains fresh version-3
    ones. Afterwards: the ledger holds every fresh trajectory once and the late ones once
    as stale, the stale topic holds each late group once (twice only after a kill between
    routing and the ledger: the documented repeat of the same decision), offsets are
    committed to the end, the store holds versions 0-5 once each, and the final weights
    equal those of the same steps trained without a crash."""
    topics = make_topics(kafka_config, unique_name)
    topics["stale"] = unique_name("rollouts.stale")
    ensure_topics(
        kafka_config.client_config(), [dataclasses.replace(ROLLOUTS_STALE, name=topics["stale"])]
    )
    first = synthetic_groups(6, seed=51, run_id=RUN, version=0)
    late = synthetic_groups(2, seed=52, run_id=RUN, version=0)
    fresh = synthetic_groups(4, seed=53, run_id=RUN, version=3)
    # all in one partition: the groups are judged in the order produced, in both lives
    # (across partitions the order depends on what each fetch brought)
    produce(kafka_config, topics["scored"], group_records(first + late + fresh), partition=0)
    trainer = trainer_config(
        tmp_path,
        topics,
        max_steps=5,
        staleness={"max_staleness": 2},
        checkpoint={"dir": str(tmp_path / "ckpt"), "every": 2},
    )
    config = TrainerConfig.model_validate(trainer)
    config_path = write_trainer_file(
        tmp_path / "rollstream.toml",
        kafka_config,
        s3_config,
        trainer,
        weights={"max_delta_fraction": 1.0, "allow_unsigned": True},
        **({"lora": lora.model_dump()} if lora else {}),
    )
    log_path = tmp_path / "trainer.log"
    ledger_path = tmp_path / "ledger.jsonl"
    checkpoints = CheckpointManager(config.checkpoint)
    store = WeightStore.from_config(s3_config, RUN)

    life = spawn(config_path, log_path, failpoint=f"{point}:4")
    assert life.wait(180) == -signal.SIGKILL, log_path.read_text()[-4000:]
    assert f"failpoint {point}:4: killing this process" in log_path.read_text()
    # what the kill left behind is what that point promises
    steps = [s for s, _ in TrainingLedger.read(ledger_path)]
    committed_ends = end_and_committed(kafka_config, topics["scored"], config.topics.group_id)
    if point in ("after_route_stale", "after_ledger"):
        assert checkpoints.latest() == ("step000000004", 4)
        assert steps == ([1, 2] if point == "after_route_stale" else [1, 2, 3, 4])
        committed = committed_ends[1].values()
        assert sum(max(o, 0) for o in committed) == 4  # checkpoint 2's offsets, not 4's
    else:
        assert checkpoints.latest() == ("step000000002", 2) and steps == [1, 2]
    if point == "mid_checkpoint":
        assert (checkpoints.dir / "step000000004").is_dir()  # torn: written, never LATEST
    if point == "mid_publish":
        assert store.versions() == [0, 1, 2, 3]  # v4's file is up, its manifest is not

    run_to_the_end(config_path, log_path, 180)

    ledger = TrainingLedger.read(ledger_path)
    assert [s for s, _ in ledger] == [1, 2, 3, 4, 5]
    trained = [i for _, ids in ledger for i in ids]
    assert sorted(trained) == sorted(ids_of(first + fresh)), "lost or trained twice"
    stale_ids = [i for _, ids in TrainingLedger.read_stale(ledger_path) for i in ids]
    assert sorted(stale_ids) == sorted(ids_of(late))
    routed_twice = 2 if point == "after_route_stale" else 1
    records = read_all(kafka_config, topics["stale"], expected=len(late) * routed_twice)
    routed = [s.trajectory_id for m in records for s in decode_group(m.value()).samples]
    assert sorted(routed) == sorted(ids_of(late) * routed_twice)
    ends, committed = end_and_committed(kafka_config, topics["scored"], config.topics.group_id)
    assert committed[0] == ends[0] == sum(ends.values()) == 12  # the other partitions: empty
    assert store.versions() == list(range(6))
    final = restored_weights(config, lora)
    snapshot = WeightFollower(store).sync(5)
    assert snapshot is not None
    assert_same_weights(snapshot.state, final)
    reference = reference_weights(kafka_config, config, ledger_path, first + fresh, lora)
    assert_same_weights(final, reference)
    if lora is not None:  # one base, then adapters on it, the second life's too
        kinds = [Manifest.from_bytes(store.read_manifest(v)) for v in range(6)]
        assert [m.kind for m in kinds] == ["base"] + ["adapter"] * 5
        assert {m.base for m in kinds} == {0}
