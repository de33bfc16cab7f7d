"""The rollout worker's own decisions, with an engine and a publisher the test drives
(``support.fake_engine``): version-change policies mid-generation, admission credit, the
pause reasons. No model, no broker, no sleeps: the fake engine parks generation where the
test wants it, so every scenario is deterministic."""

from __future__ import annotations

import asyncio

import pytest
from support.fake_engine import TOKEN, TOKENS, FakeBackend, FakePublisher, fake_worker


async def _change_version_mid_generation(policy: str) -> tuple[FakeBackend, FakePublisher]:
    backend, publisher = FakeBackend(), FakePublisher()
    worker = fake_worker(backend, publisher, version_policy=policy, max_inflight_groups=1)
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


@pytest.mark.parametrize("policy", ["interrupt", "abort", "finish"])
def test_a_streamed_turn_is_told_tokens_that_only_grow_across_a_version_change(
    policy: str,
) -> None:
    """A gateway call's tokens as they come (``on_tokens``), through a version change mid
    turn: kept tokens are told once and continued (interrupt, finish); under ``abort``,
    which discards them, nothing is told before the turn is whole."""

    async def scenario() -> tuple[list[list[int]], list[int], list[list[int]]]:
        backend = FakeBackend()
        worker = fake_worker(backend, version_policy=policy)
        loader = asyncio.create_task(worker.versions.run())
        told: list[list[int]] = []
        backend.hold_after(2)
        turn = asyncio.create_task(
            worker.generator.turn([1, 2, 3], TOKENS, "call", None, lambda ids, _: told.append(ids))
        )
        await backend.wait_generated(2)
        swap = asyncio.create_task(worker.on_new_version(1, {}))
        if policy == "finish":  # it waits for the call in flight: let it finish
            backend.release()
        await swap
        backend.release()
        sample = await asyncio.wait_for(turn, 10)
        loader.cancel()
        return told, sample.response_ids, sample.segments

    told, ids, segments = asyncio.run(scenario())
    assert ids == [TOKEN] * TOKENS
    if policy == "abort":
        assert told == [] and segments == [[1, TOKENS]]
    else:
        assert [len(t) for t in told] == list(range(1, TOKENS + 1))
        assert all(ids[: len(t)] == t for t in told)
        assert segments == ([[0, 2], [1, TOKENS - 2]] if policy == "interrupt" else [[0, TOKENS]])


def test_admission_credit_pauses_until_the_next_version() -> None:
    async def scenario() -> tuple[list[str | None], FakePublisher]:
        backend, publisher = FakeBackend(), FakePublisher()
        worker = fake_worker(backend, publisher, groups_per_version=2, staleness_window=0)
        run = asyncio.create_task(worker.run(groups=4))
        while len(publisher.groups) < 2:
            await asyncio.sleep(0)
        for _ in range(50):  # it stays paused, however long it waits
            await asyncio.sleep(0)
        reasons = [worker.admission.pause_reason()]
        paused_at = len(publisher.groups)
        await worker.on_new_version(1, {})
        await asyncio.wait_for(run, 10)
        reasons.append(worker.admission.pause_reason())
        return [reasons[0], str(paused_at), reasons[1]], publisher

    (paused, count, after), publisher = asyncio.run(scenario())
    assert count == "2"
    assert paused is not None and "1.0 steps of data started ahead of the trainer's v0" in paused
    assert after is not None and "ahead of the trainer's v1" in after  # v1's credit used up
    assert [list(g[0].segment_versions) for g in publisher.groups] == [[0], [0], [1], [1]]


def test_pause_reasons_name_what_the_worker_waits_for() -> None:
    backend = FakeBackend()
    ahead = {"v": 5}
    worker = fake_worker(backend, staleness_window=2)
    worker.trainer.announced_version = lambda: ahead["v"]
    assert "more than the staleness window (2) behind" in (worker.admission.pause_reason() or "")
    ahead["v"] = 2
    assert worker.admission.pause_reason() is None
    worker.trainer.consumed_version = lambda: -3
    assert "ahead of the trainer's consumed version" in (worker.admission.pause_reason() or "")
    worker.trainer.consumed_version = None
    slow = FakePublisher(auto_ack=False)
    slow.groups = [[] for _ in range(worker.config.max_undelivered_groups)]
    worker.outbox.publisher = slow  # type: ignore[assignment]
    assert "await Kafka acknowledgement" in (worker.admission.pause_reason() or "")


@pytest.mark.parametrize(("producers", "started"), [(None, 4), (1, 4), (2, 2), (4, 1)])
def test_producers_share_the_trainers_announced_pace(producers: int | None, started: int) -> None:
    """The trainer takes 4 groups a step and trained the groups of ``producers`` producers
    lately: each of them starts its share, so together they stay within the window."""
    from schemas.control import VersionAnnouncement

    announced = VersionAnnouncement(
        run="run", version=0, uri="s3://b/v0/", parent=None, base=0, sha256="0" * 64,
        bytes=1, published_at_ms=1, groups_per_step=4, max_staleness=0, producers=producers,
    )  # fmt: skip

    async def scenario() -> tuple[int, str | None]:
        publisher = FakePublisher()
        worker = fake_worker(FakeBackend(), publisher, staleness_window=0)
        worker.trainer.announcement = lambda: announced
        run = asyncio.create_task(worker.run(groups=10))
        for _ in range(200):
            await asyncio.sleep(0)
        reason = worker.admission.pause_reason()
        worker.request_stop()
        await asyncio.wait_for(run, 10)
        return len(publisher.groups), reason

    count, reason = asyncio.run(scenario())
    assert count == started
    assert reason is not None and "waiting for the trainer" in reason


def test_garbage_producer_counts_are_refused() -> None:
    from schemas.control import VersionAnnouncement

    base = {
        "run": "r", "version": 1, "uri": "u", "parent": None, "base": 1, "sha256": "a" * 64,
        "bytes": 0, "published_at_ms": 0,
    }  # fmt: skip
    for bad in (0, -2, "3", 1.5):
        with pytest.raises(ValueError):
            VersionAnnouncement(**base, groups_per_step=4, producers=bad)  # type: ignore[arg-type]
    again = VersionAnnouncement(**base, groups_per_step=4, producers=3)
    assert VersionAnnouncement.from_json(again.to_json()) == again


def test_a_share_that_shrinks_does_not_strand_the_groups_already_started() -> None:
    """A producer started its groups while it was the only one the trainer knew; the
    trainer then announces two producers. Each version still takes one step of lead away,
    so the producer resumes at its new share instead of waiting for ever (it used to count
    its old groups at the new, smaller share: a deadlock with a trainer left without
    fresh data)."""
    from schemas.control import VersionAnnouncement

    def announced(version: int, producers: int | None) -> VersionAnnouncement:
        return VersionAnnouncement(
            run="run", version=version, uri="s3://b/v/", parent=None, base=version,
            sha256="0" * 64, bytes=1, published_at_ms=1, groups_per_step=4, max_staleness=0,
            producers=producers,
        )  # fmt: skip

    async def scenario() -> list[tuple[int, str | None]]:
        publisher = FakePublisher()
        worker = fake_worker(FakeBackend(), publisher, staleness_window=0)
        current = {"a": announced(0, None)}
        worker.trainer.announcement = lambda: current["a"]
        run = asyncio.create_task(worker.run(groups=20))
        seen = []
        for version, producers, expected in ((0, None, 4), (1, 2, 6), (2, 2, 8)):
            current["a"] = announced(version, producers)
            if version:  # the producer follows the trainer's weights
                await worker.on_new_version(version, {})
            for _ in range(500):  # the paused admission loop looks again every 50 ms
                if len(publisher.groups) >= expected and worker.admission.pause_reason():
                    break
                await asyncio.sleep(0.01)
            seen.append((len(publisher.groups), worker.admission.pause_reason()))
        worker.request_stop()
        await asyncio.wait_for(run, 10)
        return seen

    seen = asyncio.run(scenario())
    assert [count for count, _ in seen] == [4, 6, 8]
    assert all(reason and "waiting for the trainer" in reason for _, reason in seen)
