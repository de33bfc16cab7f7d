"""The curriculum loop: the stream's per-prompt statistics and the producer's choice of
prompts. Unit tests of both sides (no broker), the worker skipping a solved prompt with a
fake engine, and the whole loop through a real stream worker on the real broker."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from support.fake_engine import FakeBackend, FakePublisher
from support.streams import (
    Harness,
    WorkerProcess,
    create_stream_topics,
    keyed,
    produce,
    stream_topics,
    synthetic_group,
    worker_config,
)

from core.config import KafkaConfig
from producers.config import CurriculumConfig, RolloutConfig, SamplingConfig
from producers.rollout.curriculum import Curriculum, PromptStatsReader, PromptStatsView
from producers.rollout.publishing import Outbox, ProducerIdentity
from producers.rollout.worker import RolloutWorker, WorkerLinks
from producers.tasks.base import Prompt, TaskContext
from producers.tasks.catalog import make_task
from schemas.codec import encode
from schemas.control import PromptStats, prompt_key

RUN = "run"
SOLVED = [1, 5, 6, 7, 3]  # BOS d d d SEP
OPEN = [1, 8, 9, 10, 3]


def group(name: str, prompt: list[int], rewards: list[float], run: str = RUN) -> list:
    """A group whose samples all answer ``prompt``, as a producer's do."""
    ids = np.asarray(prompt, dtype=np.int32)
    return [dataclasses.replace(t, prompt_ids=ids) for t in synthetic_group(run, name, rewards)]


# --- the stream's side ------------------------------------------------------------------


def test_the_stream_publishes_running_statistics_per_prompt() -> None:
    h = Harness()
    for name, rewards in (("a", [1.0, 1.0, 0.5, 1.0]), ("b", [1.0, 0.0, 1.0, 1.0])):
        for t in group(name, SOLVED, rewards):
            h.feed(encode(t), t.group_id.encode())
    for t in group("c", OPEN, [0.0, 0.0, 0.0, 0.5]):
        h.feed(encode(t), t.group_id.encode())
    stats = [PromptStats.from_json(s.value) for s in h.on("prompts.stats")]
    assert [(s.prompt_key, s.samples, s.passes) for s in stats] == [
        (prompt_key(SOLVED), 4, 3),
        (prompt_key(SOLVED), 8, 6),  # cumulative, from the table
        (prompt_key(OPEN), 4, 0),
    ]
    assert stats[1].reward_sum == pytest.approx(6.5) and stats[1].pass_rate == 0.75
    assert h.on("prompts.stats")[1].key == f"{RUN}:{prompt_key(SOLVED)}:0".encode()
    off = Harness(prompt_stats={"enabled": False})
    for t in group("a", SOLVED, [1.0, 0.0, 1.0, 1.0]):
        off.feed(encode(t), t.group_id.encode())
    assert off.on("prompts.stats") == [] and len(off.on("rollouts.scored")) == 1


# --- the producer's side ----------------------------------------------------------------


def stats(prompt: list[int], samples: int, passes: int, partition: int = 0, run: str = RUN):
    return PromptStats(run, prompt_key(prompt), partition, samples, passes, float(passes), 3)


def test_the_view_adds_partitions_up_and_skips_garbage() -> None:
    view = PromptStatsView(RUN)
    view.apply(stats(SOLVED, 4, 4, partition=0).to_json())
    view.apply(stats(SOLVED, 4, 2, partition=1).to_json())
    view.apply(stats(SOLVED, 8, 8, partition=0).to_json())  # newer value of partition 0
    view.apply(stats(OPEN, 100, 100, run="other").to_json())  # another run's
    for garbage in (
        b"",
        b"not json",
        b"[]",
        b'{"run_id": "run"}',
        b"\xff\xfe",
        None,
        stats(OPEN, 4, 4).to_json().replace(b'"passes":4', b'"passes":9'),
    ):
        view.apply(garbage)  # fmt: skip
    totals = view.get(prompt_key(SOLVED))
    assert totals is not None and totals.samples == 12 and totals.pass_rate == 10 / 12
    assert view.get(prompt_key(OPEN)) is None and len(view) == 1 and view.malformed == 6


def test_the_curriculum_skips_solved_and_hopeless_prompts_but_never_stalls() -> None:
    view = PromptStatsView(RUN)
    config = CurriculumConfig(enabled=True, min_pass_rate=0.1, max_pass_rate=0.9, min_samples=8)
    skipped: list[str] = []
    curriculum = Curriculum(config, view, on_skip=skipped.append)
    hopeless = [1, 5, 5, 5, 3]
    view.apply(stats(SOLVED, 8, 8).to_json())
    view.apply(stats(hopeless, 16, 0).to_json())
    view.apply(stats(OPEN, 4, 4).to_json())  # too few samples to judge
    assert curriculum.skip_reason(SOLVED) == "solved"
    assert curriculum.skip_reason(hopeless) == "hopeless"
    assert curriculum.skip_reason(OPEN) is None and curriculum.skip_reason([1, 2, 3]) is None
    draws = iter([SOLVED, hopeless, OPEN])
    assert curriculum.choose(lambda: next(draws)) == OPEN and skipped == ["solved", "hopeless"]
    assert curriculum.choose(lambda: SOLVED) == SOLVED  # every prompt solved: no stall
    assert len(skipped) == 2 + config.max_skips
    for bad in (
        {"min_pass_rate": 0.9, "max_pass_rate": 0.5},
        {"min_samples": 0},
        {"max_pass_rate": 2.0},
        {"max_skips": "many"},
    ):
        with pytest.raises(ValidationError):
            CurriculumConfig.model_validate(bad)  # fmt: skip


def test_the_worker_does_not_start_groups_on_a_solved_prompt() -> None:
    task = make_task("copy-first-digit-twice", {"num_digits": 1},
                     TaskContext(cache_dir=Path("/nonexistent")))  # fmt: skip
    solved = task.sample(random.Random(0))  # one of ten prompts
    view = PromptStatsView(RUN)
    view.apply(stats(solved.ids, 64, 64).to_json())
    config = RolloutConfig.model_validate(
        {"group_size": 2, "seed": 0, "progress": False, "follow_weights": False,
         "ledger_fsync": False, "curriculum": {"enabled": True, "min_samples": 8},
         "sampling": SamplingConfig(max_new_tokens=3, ignore_eos=True, stop_token_ids=[])}
    )  # fmt: skip
    publisher = FakePublisher()
    worker = RolloutWorker(
        config, FakeBackend(), task, Outbox(publisher),  # type: ignore[arg-type]
        ProducerIdentity(run_id=RUN, producer_id="p0", region="local"),
        links=WorkerLinks(curriculum=Curriculum(config.curriculum, view)),
    )  # fmt: skip
    asyncio.run(worker.run(groups=40))
    prompts = [tuple(g[0].prompt_ids) for g in publisher.groups]
    assert len(prompts) == 40 and tuple(solved.ids) not in prompts
    assert len(set(prompts)) == 9  # every other prompt still sampled


# --- the loop on the real broker ---------------------------------------------------------


@pytest.mark.system
def test_a_prompt_that_becomes_solved_stops_being_sampled(
    kafka_config: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    client = kafka_config.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics)
    worker = WorkerProcess(
        worker_config(
            kafka_config.bootstrap_servers,
            topics,
            unique_name("app"),
            run_id=RUN,
            old_logits={"mode": "off"},
        ),
        tmp_path,
    ).start()
    view = PromptStatsView(RUN)
    reader = PromptStatsReader(client, topics["prompt_stats"], view).start()
    config = CurriculumConfig(enabled=True, min_samples=8, max_pass_rate=0.9)
    curriculum = Curriculum(config, view)
    rng = random.Random(0)

    def draw() -> Prompt:
        return Prompt(list(rng.choice([SOLVED, OPEN])))

    try:
        assert any(curriculum.choose(draw).ids == SOLVED for _ in range(50))  # not yet known
        # the model gets SOLVED right every time, OPEN half the time
        records = [t for i in range(3) for t in group(f"s{i}", SOLVED, [1.0] * 4)]
        records += [t for i in range(3) for t in group(f"o{i}", OPEN, [1.0, 0.0, 1.0, 0.0])]
        produce(client, topics["raw"], [keyed(t) for t in records])
        limit = time.monotonic() + 120

        def arrived() -> bool:  # every group's statistics, of both prompts
            totals = view.get(prompt_key(OPEN))
            solved = curriculum.skip_reason(SOLVED) == "solved"
            return solved and totals is not None and totals.samples >= 12

        while not arrived():
            assert worker.alive(), worker.log()[-3000:]
            assert time.monotonic() < limit, "the stream's statistics did not arrive"
            time.sleep(0.5)
        chosen = [curriculum.choose(draw).ids for _ in range(50)]
        assert chosen == [OPEN] * 50
        totals = view.get(prompt_key(OPEN))
        assert totals is not None and totals.samples == 12 and totals.pass_rate == 0.5
    finally:
        reader.close()
        worker.stop()
