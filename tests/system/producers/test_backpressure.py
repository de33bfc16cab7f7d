"""Backpressure by default: a producer that follows the trainer's announcements pauses
when the trainer stops (within the staleness window) and resumes when it goes on.

Real components on the real broker and store: the trainer's own announcer
(``consumers.trainer.trainer_announcer``, the one ``Trainer`` publishes with) and weight
writer stand for a trainer that publishes a version per step; the producer is
``run_producer`` with its in-process engine, its weight follower and nothing set for
backpressure (no ``groups_per_version``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from support.producer_runs import check_records, make_topic, read_topic, rollout, rs_config

from consumers.config import TrainerConfig
from consumers.trainer import trainer_announcer
from core.config import WeightsConfig
from core.models import build_tiny_llama
from infra.topics import ensure_topics
from producers.app import run_producer
from producers.config import EngineConfig, ProducersConfig, SamplingConfig
from schemas.topics import POLICY_VERSIONS
from weights.store import WeightStore
from weights.writer import DeltaWriter

torch.set_num_threads(1)
pytestmark = pytest.mark.system

GROUPS_PER_STEP = 2
WINDOW = 1


async def wait_until(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_stopped_trainer_pauses_generation_within_the_window(
    kafka_config, s3_config, unique_name, tmp_path
):
    topic = make_topic(kafka_config, unique_name)
    client = kafka_config.client_config()
    versions_topic = unique_name("policy.versions")
    ensure_topics(client, [dataclasses.replace(POLICY_VERSIONS, name=versions_topic)])
    config = rs_config(kafka_config, tmp_path).model_copy(
        update={
            "s3": s3_config,
            "weights": WeightsConfig(topic=versions_topic, poll_interval_s=1, allow_unsigned=True),
        }
    )
    trainer = TrainerConfig.model_validate(
        {
            "batch": {"max_groups": GROUPS_PER_STEP},
            "staleness": {"max_staleness": WINDOW},
            "topics": {"versions": versions_topic},
        }
    )
    announcer = trainer_announcer(client, trainer)
    writer = DeltaWriter(WeightStore.from_config(s3_config, config.run_id), announcer=announcer)
    weights = [build_tiny_llama(seed=0).state_dict(), build_tiny_llama(seed=1).state_dict()]
    writer.publish(weights[0], 0)  # the trainer's version 0, then it stops
    settings = ProducersConfig(
        engine=EngineConfig(seed=0),
        rollout=rollout(
            topic,
            max_inflight_groups=1,
            follow_weights=True,
            sampling=SamplingConfig(max_new_tokens=4, ignore_eos=True, stop_token_ids=[]),
        ),
    )
    assert settings.rollout.groups_per_version is None  # nothing set for backpressure
    credit = (WINDOW + 1) * GROUPS_PER_STEP  # groups a producer may start ahead of v0
    holder: dict = {}
    seen: dict = {}

    async def scenario():
        async def trainer_side():
            await wait_until(lambda: "worker" in holder, "the worker")
            worker = holder["worker"]
            m = worker.metrics

            def settled() -> bool:
                return bool(m.get("admission_paused")) and not m.get("inflight_groups")

            # paused before v0 is loaded is not the pause under test: wait for v0 first
            await wait_until(lambda: worker.version == 0, "the producer to load v0")
            # the trainer is stopped at v0: the producer runs out of credit and pauses
            await wait_until(
                lambda: settled() or worker.publisher.delivered_groups > credit, "a pause"
            )
            await asyncio.sleep(1.0)  # paused means paused: nothing starts meanwhile
            seen["stopped"] = (worker.publisher.delivered_groups, m.get("lead"), settled())
            if not settled():  # no backpressure: it runs on regardless
                worker.request_stop()
                return
            # the trainer goes on (one step): the producer resumes for one step's groups
            await asyncio.to_thread(writer.publish, weights[1], 1)
            await wait_until(
                lambda: worker.publisher.delivered_groups >= credit + GROUPS_PER_STEP,
                "the producer to resume",
            )
            await wait_until(settled, "the next pause")
            await asyncio.sleep(1.0)
            seen["resumed"] = (worker.publisher.delivered_groups, m.get("lead"), worker.version)
            worker.request_stop()

        async def trainer_side_then_stop():
            try:
                await trainer_side()
            finally:  # a failed wait stops the producer, so the test reports it, not a hang
                if "worker" in holder:
                    holder["worker"].request_stop()

        task = asyncio.create_task(trainer_side_then_stop())
        report = await run_producer(
            config, settings, install_signals=False, on_worker=lambda w: holder.update(worker=w)
        )
        await asyncio.wait_for(task, 60)
        return report

    try:
        report = asyncio.run(asyncio.wait_for(scenario(), 300))
    finally:
        announcer.close()
    # stopped at v0: exactly (window + 1) steps of groups, and the lead says so
    assert seen["stopped"] == (credit, WINDOW + 1, True)
    # one more step of the trainer: one more step of groups, the lead is the window again
    assert seen["resumed"] == (credit + GROUPS_PER_STEP, WINDOW + 1, 1)
    assert report.groups_delivered == credit + GROUPS_PER_STEP
    records = check_records(
        read_topic(kafka_config, topic), report.groups_delivered, 4, config.run_id
    )
    assert sum(list(t.segment_versions) == [0] for t in records) == credit * 4
