"""The trainer as two data-parallel ranks (gloo on the CPU), started by torch's own
launcher and fed from the real broker by rank 0 (``consumers.ranks``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
from support.streams import wait_until
from support.synthetic import synthetic_groups
from support.trainer_runs import (
    REPO,
    RUN,
    end_and_committed,
    group_records,
    ids_of,
    make_topics,
    produce,
    read_all,
    trainer_config,
    wait_for_step,
    write_toml,
)

from consumers.config import TrainerConfig
from consumers.ranks import split_for_ranks, token_imbalance
from consumers.step import StepRunner
from consumers.train_engine import TrainEngine
from core.config import KafkaConfig, S3Config
from core.models import load_model
from schemas.group import decode_group
from schemas.trajectory import Trajectory

pytestmark = pytest.mark.system

FP32 = {"lr": 1e-2, "zero_stage": 1, "bf16": False}


Launch = Callable[[Path, Path], subprocess.Popen]


@pytest.fixture()
def launch() -> Iterator[Launch]:
    """Starts ``torchrun --standalone --nproc-per-node 2 -m consumers --config <path>``,
    output to a log; whatever is left of those process trees is killed at teardown, so a
    failed test leaves no rank running."""
    started: list[subprocess.Popen] = []
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"

    def start(config_path: Path, log_path: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", "-m", "consumers", "--config", str(config_path)],
            cwd=REPO, env=env, stdout=log_path.open("ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = psutil.Process(proc.pid)
            for child in [*tree.children(recursive=True), tree]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        proc.wait(30)


def config_file(tmp: Path, kafka: KafkaConfig, trainer: dict, **sections: object) -> Path:
    """The run's config file: ``run_id`` (default ``RUN``), Kafka, the trainer, and any
    other sections (``s3``); versions unsigned (read back by unkeyed followers)."""
    path = tmp / "rollstream.toml"
    write_toml(
        path,
        {
            "run_id": RUN,
            "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
            "trainer": trainer,
            "weights": {"allow_unsigned": True},
            **sections,
        },
    )
    return path


def checkpoint_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The module weights of the LATEST checkpoint, read from DeepSpeed's file (its
    optimiser state is partitioned for two ranks: a world of one cannot load it)."""
    import orjson

    tag = orjson.loads((directory / "LATEST").read_bytes())["tag"]
    state = torch.load(
        directory / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
    )
    return state["module"]


def ledger_steps(path: Path) -> list[tuple[int, list[str]]]:
    from consumers.checkpoint import TrainingLedger

    return TrainingLedger.read(path)


def test_split_for_ranks_balances_tokens_and_keeps_every_record_once() -> None:
    groups = synthetic_groups(3, seed=1, group_size=4, response_len=9)
    records = [t for g in groups for t in g]
    shares = split_for_ranks(records, 2)
    assert sorted(t.trajectory_id for s in shares for t in s) == sorted(ids_of(groups))
    assert token_imbalance(shares) == 0.0  # equal lengths split evenly
    assert split_for_ranks(records, 2) == shares  # deterministic
    assert [len(s) for s in split_for_ranks(records[:1], 3)] == [1, 0, 0]


def test_two_ranks_train_what_one_rank_trains_with_their_shares_as_micro_batches(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
    launch: Launch,
) -> None:
    run = unique_name("ranks-equal")
    topics = make_topics(kafka_config, unique_name)
    groups = synthetic_groups(4, seed=61, run_id=run, version=0)
    trainer = trainer_config(
        tmp_path,
        topics,
        engine=FP32,
        batch={"max_groups": 4, "max_wait_s": 30.0},
        max_steps=1,
    )
    log = tmp_path / "ranks.log"
    produce(kafka_config, topics["scored"], group_records(groups))
    path = config_file(tmp_path, kafka_config, trainer, run_id=run, s3=s3_config.file_table())
    proc = launch(path, log)
    assert proc.wait(300) == 0, log.read_text()[-4000:]

    [(step, trained)] = ledger_steps(tmp_path / "ledger.jsonl")
    assert step == 1 and sorted(trained) == sorted(ids_of(groups))  # once each
    two_ranks = checkpoint_weights(tmp_path / "ckpt")

    # one rank, the same records, the two ranks' shares as its two micro-batches
    by_id = {
        t.trajectory_id: t
        for m in read_all(kafka_config, topics["scored"], expected=4)
        for t in decode_group(m.value()).samples
    }
    shares = split_for_ranks([by_id[i] for i in trained], 2)
    assert all(shares)
    one = TrainerConfig.model_validate(
        {
            **trainer,
            "engine": {**FP32, "grad_accum_steps": 2},
            "checkpoint": {"dir": str(tmp_path / "one")},
        }
    )
    torch.manual_seed(one.engine.seed)
    engine = TrainEngine(load_model(one.model.spec, "float32"), one.engine)
    StepRunner(engine, one, pad_id=0).train_step(shares, step=0)
    one_rank = engine.state_dict()
    initial = load_model(one.model.spec, "float32").state_dict()
    moved = 0.0
    for name, value in one_rank.items():
        torch.testing.assert_close(two_ranks[name], value, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-4  # the step changed the weights: the comparison means something

    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert '"ranks/world":2.0' in metrics[0] and '"ranks/token_imbalance"' in metrics[0]


def test_kill_9_of_one_rank_takes_the_world_down_and_a_restart_trains_each_record_once(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
    launch: Launch,
) -> None:
    topics = make_topics(kafka_config, unique_name)
    first = synthetic_groups(8, seed=71, run_id=RUN, version=0)
    produce(kafka_config, topics["scored"], group_records(first))
    trainer = trainer_config(
        tmp_path, topics, checkpoint={"dir": str(tmp_path / "ckpt"), "every": 3}
    )
    path = config_file(tmp_path, kafka_config, trainer, s3=s3_config.file_table())
    log = tmp_path / "ranks.log"
    world = launch(path, log)
    wait_for_step(tmp_path / "metrics.jsonl", 4, world)  # 8 groups, 2 a step: all trained
    ranks = [
        p
        for p in psutil.Process(world.pid).children(recursive=True)
        if p.environ().get("LOCAL_RANK") is not None
    ]
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    follower = next(p for p in ranks if p.environ().get("RANK") == "1")
    follower.send_signal(signal.SIGKILL)  # waiting for rank 0's next order
    assert world.wait(120) != 0, log.read_text()[-3000:]  # the launcher stops the world
    wait_until(
        lambda: not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
        30,
        "the ranks to end with their world",
    )
    # checkpoint 3 is durable; step 4 was trained into weights that died with the world
    assert [s for s, _ in ledger_steps(tmp_path / "ledger.jsonl")] == [1, 2, 3]

    more = synthetic_groups(4, seed=72, run_id=RUN, version=0)
    produce(kafka_config, topics["scored"], group_records(more))
    trainer["max_steps"] = 6
    path = config_file(tmp_path, kafka_config, trainer, s3=s3_config.file_table())
    again = launch(path, log)
    assert again.wait(300) == 0, log.read_text()[-4000:]
    ledger = ledger_steps(tmp_path / "ledger.jsonl")
    assert [s for s, _ in ledger] == [1, 2, 3, 4, 5, 6]
    trained = [i for _, ids in ledger for i in ids]
    assert sorted(trained) == sorted(ids_of(first + more))  # nothing lost, nothing twice
    ends, committed = end_and_committed(
        kafka_config, topics["scored"], f"trainer-{topics['scored']}"
    )
    assert committed == ends

    # the weights are the proof: a world that never crashed, fed the same batches in the
    # order the ledger says they were trained (one partition, one step's groups after the
    # other), ends on the same weights bit for bit
    by_group = {g[0].group_id: g for g in first + more}
    ordered = [by_group[gid] for gid in ledger_group_order(ledger, first + more)]
    ref_topics = make_topics(kafka_config, unique_name)
    produce(kafka_config, ref_topics["scored"], group_records(ordered), partition=0)
    home = tmp_path / "reference"
    home.mkdir()
    reference = trainer_config(
        home,
        ref_topics,
        checkpoint={"dir": str(home / "ckpt"), "every": 3},
        publish={"every": 0, "initial": False},
        max_steps=6,
    )
    path = config_file(home, kafka_config, reference)
    uninterrupted = launch(path, home / "ranks.log")
    assert uninterrupted.wait(300) == 0, (home / "ranks.log").read_text()[-4000:]
    assert ledger_steps(home / "ledger.jsonl") == ledger  # the same batches, in order
    got, want = checkpoint_weights(tmp_path / "ckpt"), checkpoint_weights(home / "ckpt")
    assert got.keys() == want.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def ledger_group_order(
    ledger: list[tuple[int, list[str]]], groups: list[list[Trajectory]]
) -> list[str]:
    """The group ids in the order the ledger's steps trained their trajectories."""
    group_of = {t.trajectory_id: t.group_id for g in groups for t in g}
    return list(dict.fromkeys(group_of[i] for _, ids in ledger for i in ids))


def test_two_ranks_under_zero_2_publish_versions_equal_to_their_weights(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
    launch: Launch,
) -> None:
    from weights.follower import WeightFollower
    from weights.store import WeightStore

    run = unique_name("ranks-publish")
    topics = make_topics(kafka_config, unique_name)
    groups = synthetic_groups(4, seed=81, run_id=run, version=0)
    produce(kafka_config, topics["scored"], group_records(groups))
    trainer = trainer_config(
        tmp_path,
        topics,
        engine={**FP32, "zero_stage": 2},
        checkpoint={"dir": str(tmp_path / "ckpt"), "every": 1},
        max_steps=2,
    )
    path = config_file(tmp_path, kafka_config, trainer, run_id=run, s3=s3_config.file_table())
    log = tmp_path / "ranks.log"
    proc = launch(path, log)
    assert proc.wait(300) == 0, log.read_text()[-4000:]

    store = WeightStore.from_config(s3_config, run)
    assert store.versions() == [0, 1, 2]  # rank 0 alone published, once per version
    snapshot = WeightFollower(store).sync(2)
    assert snapshot is not None and snapshot.version == 2
    weights = checkpoint_weights(tmp_path / "ckpt")
    initial = load_model("tiny", "float32").state_dict()
    assert any(not torch.equal(weights[n], initial[n]) for n in weights)
    for name, value in weights.items():
        assert torch.equal(snapshot.state[name], value), name  # bit for bit
