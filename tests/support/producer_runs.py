"""The producers' tests on the real broker: a unique topic, a config and rollout section
for a worker, reading the topic back, and checking the records a worker delivered (whole
groups, valid, their log-probs those of the model that generated them)."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from confluent_kafka import Consumer, TopicPartition

from core.config import default_cache_dir
from core.topic_reader import end_offsets
from infra.topics import ensure_topics
from producers.config import RolloutConfig
from rollstream.config.settings import RollstreamConfig
from schemas.codec import decode, parse_headers
from schemas.topics import TopicSpec
from schemas.trajectory import Trajectory
from schemas.validation import ValidationLimits, validate

torch.set_num_threads(1)
pytestmark = pytest.mark.system


def make_topic(kafka_config, unique_name, partitions: int = 4) -> str:
    name = unique_name("rollouts.raw")
    ensure_topics(kafka_config.client_config(), [TopicSpec(name, partitions=partitions)])
    return name


def rs_config(kafka_config, tmp_path: Path) -> RollstreamConfig:
    return RollstreamConfig(
        run_id=f"run-{uuid.uuid4().hex[:6]}",
        state_dir=tmp_path / "state",
        cache_dir=default_cache_dir(),
        kafka=kafka_config,
    )


def rollout(topic: str, **overrides) -> RolloutConfig:
    values = {
        "topic": topic,
        "group_size": 4,
        "seed": 1,
        "progress": False,
        "producer_id": "worker-a",
        "ledger_fsync": False,
        "follow_weights": False,
        **overrides,
    }
    return RolloutConfig(**values)


def read_topic(kafka_config, topic: str) -> list:
    """Every message of ``topic`` (a plain confluent-kafka consumer, from the beginning)."""
    ends = end_offsets(kafka_config.client_config(), topic)
    consumer = Consumer(
        {
            **kafka_config.client_config(),
            "group.id": f"test-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p, end in ends.items() if end > 0])
    todo = {p for p, end in ends.items() if end > 0}
    messages = []
    deadline = time.monotonic() + 60
    while todo and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is None:
            continue
        assert message.error() is None, message.error()
        messages.append(message)
        if message.offset() + 1 >= ends[message.partition()]:
            todo.discard(message.partition())
    consumer.close()
    assert not todo, f"could not read partitions {todo} to their end"
    return messages


def recompute(model, prompt, response) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]


def check_records(messages, groups: int, size: int, run_id: str) -> list[Trajectory]:
    """Exactly ``groups`` complete, valid groups of ``size``; returns the records."""
    assert len(messages) == groups * size
    records = []
    by_group = defaultdict(list)
    for message in messages:
        traj = decode(message.value())
        assert validate(traj, ValidationLimits(vocab_size=16)) == []
        headers = parse_headers(message.headers())
        assert headers.trajectory_id == traj.trajectory_id
        assert message.key().decode() == traj.group_id == headers.group_id
        assert traj.run_id == run_id and traj.group_size == size
        by_group[traj.group_id].append(traj)
        records.append(traj)
    assert len(by_group) == groups
    for members in by_group.values():
        assert sorted(t.sample_index for t in members) == list(range(size))
        assert len({tuple(t.prompt_ids) for t in members}) == 1
    return records
