"""A policy's trainer on the real broker never trains another policy's tokens: a scored
group holding a record of another policy (only a misrouted or forged one can) goes to the
dead-letter topic as ``foreign_policy`` with its bytes, and the rest is trained."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from confluent_kafka import Producer
from support.streams import read_topic
from support.synthetic import scored_group, synthetic_groups

from consumers.config import BatchConfig, TopicsConfig
from consumers.source import ScoredSource, TrainableRecords
from core.config import KafkaConfig, RetryConfig
from infra.topics import ensure_topics
from schemas.control import DeadLetter
from schemas.group import encode_group
from schemas.topics import ROLLOUTS_DLQ, ROLLOUTS_SCORED

RUN = "mp-trainer-test"


def test_a_trainer_dead_letters_a_group_holding_another_policys_record(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    scored, dlq = unique_name("rollouts.scored.solver"), unique_name("rollouts.dlq.solver")
    ensure_topics(
        kafka_config.client_config(),
        [
            dataclasses.replace(ROLLOUTS_SCORED, name=scored),
            dataclasses.replace(ROLLOUTS_DLQ, name=dlq),
        ],
    )
    groups = synthetic_groups(4, group_size=4, response_len=6, run_id=RUN, vary_lengths=False)
    as_policy = [
        [dataclasses.replace(t, policy="solver") for t in groups[0]],  # trained
        [dataclasses.replace(t, policy="proposer") for t in groups[1]],  # another policy's
        [  # one forged sample of another policy inside a solver group
            dataclasses.replace(t, policy="proposer" if i == 2 else "solver")
            for i, t in enumerate(groups[2])
        ],
        [dataclasses.replace(t, policy="solver") for t in groups[3]],  # trained
    ]
    producer = Producer(kafka_config.client_config())
    values = {}
    for group in as_policy:  # one partition: the two refused groups are read before the last
        values[group[0].group_id] = encode_group(scored_group(group))
        producer.produce(
            scored, key=group[0].group_id.encode(), value=values[group[0].group_id], partition=0
        )
    assert producer.flush(30) == 0

    source = ScoredSource(
        kafka_config.client_config(),
        TopicsConfig(scored=scored, dlq=dlq, group_id=f"trainer-{scored}", group_instance_id=None),
        BatchConfig(max_groups=2, max_wait_s=5.0),
        RetryConfig(),
        accepts=TrainableRecords(run_id=RUN, vocab_size=16, max_length=10_000, policy="solver"),
    )
    try:
        micro = source.next_micro_batch(threading.Event())
        assert micro is not None
        trained = {g.group_id for g in micro.groups}
        assert trained == {as_policy[0][0].group_id, as_policy[3][0].group_id}
        assert all(t.policy == "solver" for g in micro.groups for t in g.trajectories)
        source.flush_dead_letters()
    finally:
        source.close()
    letters = read_topic(kafka_config.client_config(), [dlq], until=lambda m: len(m) >= 2)
    dead = {msg.key(): DeadLetter.from_headers(msg.headers()) for msg in letters}
    assert len(letters) == 2 and {d.reason for d in dead.values()} == {"foreign_policy"}
    for msg in letters:  # the original bytes, to replay or repair
        assert msg.value() == values[msg.key().decode()]
    assert any("this trainer trains 'solver'" in d.detail for d in dead.values())
