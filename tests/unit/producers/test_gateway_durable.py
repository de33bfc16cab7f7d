"""Durable gateway sessions without a broker: each completed call is an ``episode_call``
ledger line before its answer, a restart closes the episodes a kill left open as
abandoned (the ledger and the audit say so), the restarted desk answers their agents 409
with the reason, and malformed ``episode_call`` lines are refused like any other."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from producers.config import GatewayConfig
from producers.gateway.desk import EpisodeDesk, EpisodeEnded, EpisodeRefused
from producers.rollout.generation import Sample
from producers.rollout.ledger import (
    GATEWAY_RESTARTED,
    CallCounts,
    Ledger,
    StopRecord,
    read_ledger,
)
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.versions import Stopped, StopSignals
from producers.tasks.base import Prompt
from producers.tasks.environments import EpisodeLimits
from rollstream.runs.audit import AuditReport
from rollstream.runs.reads import TopicView, read_producer_ledgers


def _killed_producer(directory: Path) -> None:
    """A gateway producer's ledger as a kill -9 leaves it: group ``done`` published (one of
    its episodes abandoned by its agent), ``open`` with calls of two episodes and nothing
    settling it, ``cut`` aborted by an earlier stop, ``sent`` pending (handed to Kafka)."""
    with Ledger(directory, fsync=False) as ledger:
        ledger.episode_call("done", "d1", CallCounts(1, 12, 2))
        ledger.episode_call("done", "d2", CallCounts(1, 12, 2))
        ledger.abandoned("done", {"d2": "the agent aborted it: bored"})
        ledger.pending("done", ["done-0"])
        ledger.delivered("done", ["done-0"], [(0, 0)])
        ledger.episode_call("cut", "c1", CallCounts(1, 12, 2))
        ledger.stopped(StopRecord("abort", [], ["cut"], []))
        for number in (1, 2):
            ledger.episode_call("open", "o1", CallCounts(number, 12 + 5 * number, 2))
        ledger.episode_call("open", "o2", CallCounts(1, 12, 0))
        ledger.episode_call("sent", "s1", CallCounts(1, 12, 2))
        ledger.pending("sent", ["sent-0"])


def test_a_restart_closes_the_open_episodes_with_calls_as_abandoned_once(tmp_path: Path):
    _killed_producer(tmp_path / "p0")
    state = read_ledger(tmp_path / "p0" / "ledger.jsonl")
    assert state.episode_calls["open"] == {"o1": 2, "o2": 1}
    assert state.interrupted() == {"open": {"o1": 2, "o2": 1}, "cut": {"c1": 1}}
    with Ledger(tmp_path / "p0") as ledger:
        closed = ledger.close_interrupted()
    assert closed == {
        "o1": GATEWAY_RESTARTED,
        "o2": GATEWAY_RESTARTED,
        "c1": "the producer stopped",
    }
    state = read_ledger(tmp_path / "p0" / "ledger.jsonl")
    assert state.interrupted() == {}
    assert state.abandoned["open"] == {"o1": GATEWAY_RESTARTED, "o2": GATEWAY_RESTARTED}
    assert state.abandoned["done"] == {"d2": "the agent aborted it: bored"}  # kept
    with Ledger(tmp_path / "p0") as ledger:  # a second restart finds nothing more to close
        assert ledger.close_interrupted() == {}
        assert ledger.state.lines == state.lines


def test_the_audit_counts_restarted_episodes_apart_never_as_lost(tmp_path: Path):
    _killed_producer(tmp_path / "p0")
    before = read_producer_ledgers(tmp_path)
    assert before.interrupted == {"o1", "o2", "c1"}  # not restarted yet: said, not lost
    with Ledger(tmp_path / "p0") as ledger:
        ledger.close_interrupted()
    produced = read_producer_ledgers(tmp_path)
    produced.settle_pending(["sent-0"])
    report = AuditReport(
        run_id="r",
        produced=produced,
        trained=Counter({"done-0": 1, "sent-0": 1}),
        stale=TopicView("stale"),
        dlq=TopicView("dlq"),
    )
    counts = report.counts()
    assert counts["abandoned_episodes"] == 4
    assert counts["abandoned_with_calls"] == 4
    assert counts["abandoned_reasons"] == {
        GATEWAY_RESTARTED: 2,
        "the producer stopped": 1,
        "the agent aborted it: bored": 1,
    }
    assert counts["interrupted_episodes"] == 0
    assert counts["lost_groups"] == 0 and counts["missing"] == 0
    assert report.problems() == []


GARBAGE = [
    b'{"kind": "episode_call", "group_id": "g", "episode_id": "e", "prompt_tokens": 3}',
    b'{"kind": "episode_call", "group_id": "g", "episode_id": "e", "call": "1",'
    b' "prompt_tokens": 3, "response_tokens": 1}',
    b'{"kind": "episode_call", "group_id": "g", "episode_id": "e", "call": 0,'
    b' "prompt_tokens": 3, "response_tokens": 1}',
    b'{"kind": "episode_call", "group_id": "g", "episode_id": 7, "call": 1,'
    b' "prompt_tokens": 3, "response_tokens": 1}',
    b'{"kind": "episode_call", "group_id": null, "episode_id": "e", "call": 1,'
    b' "prompt_tokens": 3, "response_tokens": 1}',
    b'{"kind": "episode_call", "group_id": "g", "episode_id": "e", "call": true,'
    b' "prompt_tokens": 3, "response_tokens": 1}',
    b'{"kind": "episode_call", "group_id": "g", "episode_id": "e", "call": 1,'
    b' "prompt_tokens": -3, "response_tokens": 1}',
    b'{"kind": "episode_call", "group_id": "g", "episode_id": "e", "call": 1,'
    b' "prompt_tokens": 3, "response_tokens": 1.5}',
    b'{"kind": "episode_call", "group_id": "g", "episode_id": "e", "call": 1',  # no brace
    b"[1, 2]",
]


@pytest.mark.parametrize("line", GARBAGE)
def test_a_malformed_episode_call_line_is_refused_naming_its_line(tmp_path: Path, line: bytes):
    with Ledger(tmp_path, fsync=False) as ledger:
        ledger.episode_call("g", "e", CallCounts(1, 3, 1))
    with (tmp_path / "ledger.jsonl").open("ab") as fh:
        fh.write(line + b"\n")
    with pytest.raises(ValueError, match=r"ledger\.jsonl:2: malformed ledger line"):
        read_ledger(tmp_path / "ledger.jsonl")
    with pytest.raises(ValueError, match="malformed"), Ledger(tmp_path):
        pass  # a producer does not start on it


def test_a_torn_episode_call_line_is_cut_like_any_torn_tail(tmp_path: Path):
    with Ledger(tmp_path, fsync=False) as ledger:
        ledger.episode_call("g", "e", CallCounts(1, 3, 1))
    with (tmp_path / "ledger.jsonl").open("ab") as fh:
        fh.write(b'{"kind": "episode_call", "group_id": "g", "epis')
    with Ledger(tmp_path) as ledger:
        assert ledger.state.episode_calls == {"g": {"e": 1}}
        assert ledger.close_interrupted() == {"e": GATEWAY_RESTARTED}


def _turn(n: int = 2) -> Sample:
    return Sample([5] * n, [-0.5] * n, [[0, n]], "length", 0)


def test_the_desk_commits_each_call_before_it_returns_and_refuses_restarted_episodes(
    tmp_path: Path,
):
    async def play() -> None:
        with Ledger(tmp_path, fsync=True) as ledger:
            desk = EpisodeDesk(GatewayConfig(), EpisodeLimits(), ProducerMetrics(), ledger)
            stop = StopSignals()
            group = asyncio.ensure_future(desk.play(Prompt([1, 2, 3]), "g1", 1, stop))
            episode = await desk.claim()
            assert episode is not None
            episode.place([1, 2, 3], "", lambda ids, text: None)
            await desk.commit_call(episode, _turn(), 3)
            lines = read_ledger(ledger.path).episode_calls
            assert lines == {"g1": {episode.episode_id: 1}}  # on disk before the answer
            group.cancel()

    asyncio.run(play())
    (episode_id,) = read_ledger(tmp_path / "ledger.jsonl").episode_calls["g1"]
    with Ledger(tmp_path) as ledger:  # the restart
        ledger.close_interrupted()
        desk = EpisodeDesk(GatewayConfig(), EpisodeLimits(), ProducerMetrics(), ledger)
        with pytest.raises(EpisodeEnded) as ended:
            desk.episode(episode_id)
        assert ended.value.status == 409 and ended.value.reason == GATEWAY_RESTARTED
        assert GATEWAY_RESTARTED in str(ended.value)
        with pytest.raises(EpisodeRefused) as unknown:
            desk.episode("never-opened")
        assert unknown.value.status == 404


def test_a_stop_with_no_episode_closed_still_says_why_its_episodes_ended(tmp_path: Path):
    async def play() -> None:
        with Ledger(tmp_path, fsync=False) as ledger:
            desk = EpisodeDesk(GatewayConfig(), EpisodeLimits(), ProducerMetrics(), ledger)
            stop = StopSignals()
            group = asyncio.ensure_future(desk.play(Prompt([1, 2, 3]), "g1", 2, stop))
            episode = await desk.claim()
            assert episode is not None
            episode.place([1, 2, 3], "", lambda ids, text: None)
            await desk.commit_call(episode, _turn(), 3)
            stop.cancelled.set()
            with pytest.raises(Stopped):
                await group

    asyncio.run(play())
    state = read_ledger(tmp_path / "ledger.jsonl")
    assert set(state.abandoned["g1"].values()) == {"the producer stopped"}
    assert len(state.abandoned["g1"]) == 2 and state.interrupted() == {}


def test_calls_committed_together_share_an_fsync_begun_after_their_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    async def play() -> None:
        with Ledger(tmp_path, fsync=True) as ledger:
            began: list[int] = []  # the lines written when each fsync began
            done: list[int] = []
            running = threading.Event()
            real = ledger.sync

            def slow_sync() -> None:
                began.append(ledger.state.lines)
                running.set()
                time.sleep(0.05)
                real()
                done.append(began[-1])

            monkeypatch.setattr(ledger, "sync", slow_sync)

            async def commit(n: int) -> None:
                ledger.episode_call("g", f"e{n}", CallCounts(1, 3, 2), sync=False)
                written = ledger.state.lines
                await ledger.synced()
                assert done and max(done) >= written  # its own line is on disk

            first = asyncio.ensure_future(commit(0))
            await asyncio.to_thread(running.wait, 10)  # its fsync runs: the next ones wait

            late = [asyncio.ensure_future(commit(n)) for n in range(1, 8)]
            leaving = asyncio.ensure_future(commit(8))
            await asyncio.sleep(0)
            leaving.cancel()  # a caller that leaves does not cancel the others' fsync
            await asyncio.gather(first, *late)
            assert began == [1, 9]  # the first call's fsync, then one for the eight after it

            def broken() -> None:
                raise OSError("the disk is gone")

            monkeypatch.setattr(ledger, "sync", broken)
            ledger.episode_call("g", "e9", CallCounts(1, 3, 2), sync=False)
            failed = await asyncio.gather(ledger.synced(), ledger.synced(), return_exceptions=True)
            assert [type(f) for f in failed] == [OSError, OSError]  # no call answered unsynced
            monkeypatch.setattr(ledger, "sync", slow_sync)
            await ledger.synced()
            assert len(began) == 3 and began[2] == ledger.state.lines
            await ledger.synced()  # nothing new written: no fsync
            assert len(began) == 3

        with Ledger(tmp_path / "nosync", fsync=False) as unsynced:
            monkeypatch.setattr(unsynced, "sync", broken)
            unsynced.episode_call("g", "e", CallCounts(1, 3, 2), sync=False)
            await unsynced.synced()  # fsync off: flushed to the OS only

    asyncio.run(play())
