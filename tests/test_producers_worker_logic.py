"""The rollout worker's own decisions, with an engine and a publisher the test drives
(``support.fake_engine``): version-change policies mid-generation, admission credit, the
pause reasons. No model, no broker, no sleeps: the fake engine parks generation where the
test wants it, so every scenario is deterministic."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.fake_engine import TOKEN, FakeBackend, FakePublisher

from producers.config import RolloutConfig, SamplingConfig
from producers.tasks import TaskContext, make_task
from producers.worker import RolloutWorker

TOKENS = 6  # per sample


def _worker(
    backend: FakeBackend, publisher: FakePublisher | None = None, **rollout: object
) -> RolloutWorker:
    config = RolloutConfig.model_validate(
        {
            "group_size": 2,
            "seed": 0,
            "progress": False,
            "follow_weights": False,
            "ledger_fsync": False,
            "sampling": SamplingConfig(max_new_tokens=TOKENS, ignore_eos=True, stop_token_ids=[]),
            **rollout,
        }
    )
    task = make_task("copy-first-digit-twice", None, TaskContext(cache_dir=Path("/nonexistent")))
    return RolloutWorker(
        config=config,
        backend=backend,
        task=task,
        publisher=publisher or FakePublisher(),  # type: ignore[arg-type]
        run_id="run",
        producer_id="p0",
        region="local",
    )


async def _change_version_mid_generation(policy: str) -> tuple[FakeBackend, FakePublisher]:
    backend, publisher = FakeBackend(), FakePublisher()
    worker = _worker(backend, publisher, version_policy=policy, max_inflight_groups=1)
    backend.hold_after(3)  # the first group is parked mid-generation
    run = asyncio.create_task(worker.run(groups=2))
    await backend.wait_generated(3)
    swap = asyncio.create_task(worker.on_new_version(1, {}))
    if policy == "finish":  # it waits for the calls in flight: let them finish
        backend.release()
    await swap
    backend.release()
    report = await asyncio.wait_for(run, 10)
    assert report.versions_applied == [1] and backend.loaded == [1]
    return backend, publisher


@pytest.mark.parametrize(
    ("policy", "first_group_versions"),
    [("interrupt", [0, 1]), ("abort", [1]), ("finish", [0])],
)
def test_a_version_change_mid_generation_follows_the_policy(
    policy: str, first_group_versions: list[int]
) -> None:
    _, publisher = asyncio.run(_change_version_mid_generation(policy))
    first, second = publisher.groups
    for traj in first:
        assert list(traj.segment_versions) == first_group_versions
        assert list(traj.response_ids) == [TOKEN] * TOKENS  # the whole response, once
        assert sum(traj.segment_lengths) == TOKENS
        assert ("interruptions" in traj.reward_details) == (policy != "finish")
    for traj in second:
        assert list(traj.segment_versions) == [1]


def test_admission_credit_pauses_until_the_next_version() -> None:
    async def scenario() -> tuple[list[str | None], FakePublisher]:
        backend, publisher = FakeBackend(), FakePublisher()
        worker = _worker(backend, publisher, groups_per_version=2, staleness_window=0)
        run = asyncio.create_task(worker.run(groups=4))
        while len(publisher.groups) < 2:
            await asyncio.sleep(0)
        for _ in range(50):  # it stays paused, however long it waits
            await asyncio.sleep(0)
        reasons = [worker._pause_reason()]
        paused_at = len(publisher.groups)
        await worker.on_new_version(1, {})
        await asyncio.wait_for(run, 10)
        reasons.append(worker._pause_reason())
        return [reasons[0], str(paused_at), reasons[1]], publisher

    (paused, count, after), publisher = asyncio.run(scenario())
    assert count == "2"
    assert paused is not None and "credit of v0" in paused
    assert after is not None and "credit of v1" in after  # 4 started: v1's credit is used up
    assert [list(g[0].segment_versions) for g in publisher.groups] == [[0], [0], [1], [1]]


def test_pause_reasons_name_what_the_worker_waits_for() -> None:
    backend = FakeBackend()
    ahead = {"v": 5}
    worker = _worker(backend, staleness_window=2)
    worker.announced_version = lambda: ahead["v"]
    assert "more than the staleness window (2) behind" in (worker._pause_reason() or "")
    ahead["v"] = 2
    assert worker._pause_reason() is None
    worker.consumed_version = lambda: -3
    assert "ahead of the trainer's consumed version" in (worker._pause_reason() or "")
    worker.consumed_version = None
    slow = FakePublisher(auto_ack=False)
    slow.groups = [[] for _ in range(worker.config.max_undelivered_groups)]
    worker.publisher = slow  # type: ignore[assignment]
    assert "await Kafka acknowledgement" in (worker._pause_reason() or "")
