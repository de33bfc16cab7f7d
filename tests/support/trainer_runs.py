"""The trainer's tests on the real broker and S3: topics, scored records, a trainer
config, a trainer subprocess, and the weights a run must end with (``reference_weights``:
trained step by step from the ledger's groups, to compare bit for bit)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import orjson
import torch
from confluent_kafka import Consumer, Producer, TopicPartition

from consumers.checkpoint import CheckpointManager, TrainingLedger
from consumers.config import TrainerConfig
from consumers.train_engine import TrainEngine
from consumers.trainer import FAILPOINT_ENV, Trainer
from core.config import KafkaConfig, LoraConfig, S3Config, SharedConfig
from core.models import load_model
from core.prefork import ForkedRole
from infra.topics import ensure_topics
from schemas.group import encode_group
from schemas.topics import POLICY_VERSIONS, ROLLOUTS_DLQ, ROLLOUTS_SCORED
from schemas.trajectory import (
    Trajectory,
)
from support.forked_roles import start_role
from support.paths import REPO
from support.streams import read_topic
from support.synthetic import scored_group

RUN = "trainer-test"


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
    partition: int | None = None,
) -> None:
    """``timestamp_ms`` (0: now) orders records across partitions for the trainer, which
    serves the oldest first; ``partition`` (default: by key) puts every record in one."""
    producer = Producer({**kafka.client_config(), "enable.idempotence": True})
    errors: list[object] = []
    where = {} if partition is None else {"partition": partition}
    for key, value in items:
        producer.produce(
            topic,
            key=key,
            value=value,
            timestamp=timestamp_ms,
            on_delivery=lambda e, _m: errors.append(e),
            **where,
        )
        producer.poll(0)
    assert producer.flush(30) == 0
    assert not [e for e in errors if e is not None]


def group_records(groups: list[list[Trajectory]]) -> list[tuple[bytes, bytes]]:
    return [(g[0].group_id.encode(), encode_group(scored_group(g))) for g in groups]


def read_all(kafka: KafkaConfig, topic: str, expected: int, timeout_s: float = 30) -> list:
    """Every record of ``topic`` once ``expected`` of them are there, read to the end offsets
    seen then, so a record beyond ``expected`` (a duplicate) is never cut off by a short
    wait; ``TimeoutError`` if fewer than ``expected`` arrive."""
    client = kafka.client_config()
    read_topic(client, [topic], until=lambda m: len(m) >= expected, timeout=timeout_s)
    return read_topic(client, [topic], timeout=timeout_s)


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
        # deterministic: a crash test compares its weights with a run that never crashed
        "engine": {"lr": 1e-3, "zero_stage": 1, "bf16": True, "deterministic": True},
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


def shared_for(
    kafka: KafkaConfig, s3: S3Config | None = None, lora: LoraConfig | None = None
) -> SharedConfig:
    """The shared sections a trainer in this process gets: this cluster, no heartbeats,
    unsigned versions (these tests read them back with unkeyed followers)."""
    return SharedConfig(
        run_id=RUN,
        kafka=kafka,
        presence={"enabled": False},
        weights={"allow_unsigned": True},
        lora=lora,
        **({"s3": s3} if s3 else {}),
    )


STALENESS_WINDOW = 2
NO_PUBLISHING = {"every": 0, "initial": False}  # trainers with no S3 store


def settings_for(
    tmp: Path, topics: dict[str, str], kafka: KafkaConfig, **extra: object
) -> tuple[SharedConfig, TrainerConfig]:
    """A trainer's settings with a staleness window of ``STALENESS_WINDOW`` and no
    publishing."""
    config = TrainerConfig.model_validate(
        trainer_config(
            tmp,
            topics,
            staleness={"max_staleness": STALENESS_WINDOW},
            publish=NO_PUBLISHING,
            **extra,
        )
    )
    return shared_for(kafka), config


def metrics_lines(tmp: Path) -> list[dict]:
    """The rows of ``tmp/metrics.jsonl``."""
    return [orjson.loads(x) for x in (tmp / "metrics.jsonl").read_bytes().splitlines()]


def s3_toml(s3: S3Config) -> str:
    """``s3`` as the lines of a ``[s3]`` (or a region's) table."""
    return "".join(f"{key} = {to_toml_value(value)}\n" for key, value in s3.file_table().items())


def to_toml_value(value: object) -> str:
    """A scalar as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return orjson.dumps(value).decode() if isinstance(value, str) else repr(value)


def ids_of(groups: list[list[Trajectory]]) -> list[str]:
    return [t.trajectory_id for g in groups for t in g]


def restored_weights(
    config: TrainerConfig, lora: LoraConfig | None = None
) -> dict[str, torch.Tensor]:
    engine = TrainEngine(load_model(config.model.spec, lora=lora), config.engine)
    assert CheckpointManager(config.checkpoint).load(engine) is not None
    return engine.state_dict()


def reference_weights(
    kafka: KafkaConfig,
    config: TrainerConfig,
    ledger_path: Path,
    groups: list[list[Trajectory]],
    lora: LoraConfig | None = None,
) -> dict[str, torch.Tensor]:
    """The weights of a trainer that never crashed: an engine built as the trainer builds
    it (same seed, deterministic) trains, step by step, exactly the trajectories the ledger
    says each step trained, in one micro-batch (``grad_accum_steps = 1``). The ledger fixes
    the batches, which a second run from Kafka could form differently (fetch timing); a
    gradient applied twice or optimiser state lost on a restart makes the crashed run's
    weights differ from these."""
    assert config.engine.grad_accum_steps == 1 and config.engine.deterministic
    by_id = {t.trajectory_id: t for g in groups for t in g}
    home = ledger_path.parent / "reference"
    ref = config.model_copy(
        update={
            "checkpoint": config.checkpoint.model_copy(update={"dir": home / "ckpt"}),
            "ledger_file": None,
            "metrics_file": home / "metrics.jsonl",
        }
    )
    trainer = Trainer(shared_for(kafka, lora=lora), ref)
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        trainer._build()
        for step, ids in TrainingLedger.read(ledger_path):
            batch = [by_id[i] for i in ids]
            result = trainer.runner.train_step([batch], step=step - 1, relaxed=set())
            assert [t.trajectory_id for t in result.trained] == ids, step
        return trainer.engine.state_dict()
    finally:
        trainer.sink.close()
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(strict)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differ = [name for name, value in want.items() if not torch.equal(got[name], value)]
    assert not differ, f"weights differ from the uninterrupted reference: {differ[:5]}"


def spawn(config_path: Path, log_path: Path, failpoint: str | None = None) -> ForkedRole:
    """A trainer life: ``rollstream --config <file> train``, forked (``forked_roles``)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(REPO)
    if failpoint is not None:
        env[FAILPOINT_ENV] = failpoint
    argv = [sys.executable, "-m", "rollstream", "--config", str(config_path), "train"]
    return start_role(argv, env, log_path, cwd=REPO)


def write_trainer_file(
    path: Path, kafka: KafkaConfig, s3: S3Config, trainer: dict, **sections: object
) -> Path:
    """``path``: the config file of a trainer subprocess (``spawn``) on these services,
    its versions unsigned (read back by unkeyed followers); ``sections`` replace the
    defaults' tables (``weights``) or add others."""
    data = {
        "run_id": RUN,
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "s3": s3.file_table(),
        "trainer": trainer,
        "weights": {"allow_unsigned": True},
    }
    write_toml(path, {**data, **sections})
    return path


def run_to_the_end(config_path: Path, log_path: Path, timeout_s: float) -> None:
    """A trainer life (``spawn``) that must end with status 0 within ``timeout_s``."""
    life = spawn(config_path, log_path)
    try:
        assert life.wait(timeout_s) == 0, log_path.read_text()[-4000:]
    finally:
        if life.poll() is None:
            life.kill()


def wait_for_step(path: Path, step: int, proc: ForkedRole, timeout_s: float = 240) -> None:
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
