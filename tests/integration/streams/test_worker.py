"""The stream worker's composition root (``streams.faust.worker``, ``streams.faust.app.build_app``).

What Faust registers on the app at build time is part of the worker's contract: the group
table's changelog (``<app_id>-groups-changelog``, what a restart restores from) is the
one the steps write, Faust's own table's changelog stays empty, the agent's channel is
raw plus the co-partitioned ticks topic, and the timers and the start-up task run in the
order they were registered. The integration test pins all of it on a real broker; the
others test the worker's parts alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import faust
import pytest
from support.streams import synthetic

from core.config import KafkaConfig, PresenceConfig, SharedConfig, WeightsConfig
from core.devices import resolve_device
from schemas.codec import encode, routing_headers
from schemas.control import DeadLetter
from schemas.group import decode_group
from schemas.topics import ROLLOUTS_DLQ
from schemas.trajectory import Trajectory
from streams.config import OldLogitsConfig, StreamsConfig, StreamTopics
from streams.faust.agent import Assembler, message_of, wait_for_versions
from streams.faust.app import build_app
from streams.faust.gaps import GAP_SWEEP_INTERVAL_S
from streams.faust.topics import TICKS_RETENTION_MS, topic_specs
from streams.faust.worker import OldLogitPass
from streams.metrics import StreamMetrics
from streams.oldlogits import OldLogitEngine
from streams.processor import Message, Processor, Step
from streams.snapshots import SeededSource
from streams.staleness import VersionTracker


def _timer_interval(task: Callable[..., object]) -> float:
    """The interval of a task ``app.timer`` registered (faust-streaming 0.15.3 keeps it in
    the closure of the wrapper it registers)."""
    around_timer = inspect.unwrap(task, stop=lambda f: "interval_s" in f.__code__.co_freevars)
    return inspect.getclosurevars(around_timer).nonlocals["interval_s"]


def test_build_app_registers_the_table_agent_timers_and_task(
    kafka_config: KafkaConfig,
    unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    topics = StreamTopics(
        raw=unique_name("raw"),
        scored=unique_name("scored"),
        stale=unique_name("stale"),
        dlq=unique_name("dlq"),
        filtered=unique_name("filtered"),
        prompt_stats=unique_name("prompt-stats"),
        versions=unique_name("versions"),
    )
    app_id = unique_name("app")
    config = StreamsConfig(
        app_id=app_id, topics=topics, old_logits=OldLogitsConfig(mode="off"), commit_interval_s=0.5
    )
    shared = SharedConfig(
        run_id="run-worker",
        kafka=kafka_config,
        presence=PresenceConfig(),
        weights=WeightsConfig(allow_unsigned=True),  # no weight store in this test
    )
    app = build_app(shared, config, tmp_path / "state")
    assert isinstance(app, faust.App)
    # its local state where it is told from the start, not in ./<app_id>-data
    assert app.conf.datadir == tmp_path / "state"
    assert app.conf.tabledir.is_relative_to(tmp_path / "state")

    conf = app.conf
    assert conf.id == app_id
    assert conf.broker_client_id.startswith(f"{app_id}-")
    assert conf.processing_guarantee.value == "exactly_once"
    assert conf.broker_commit_interval == 0.5
    assert conf.topic_partitions == 8  # raw's partitions (created here: the default count)
    assert conf.table_standby_replicas == 0
    # the largest record of any topic it writes: the DLQ's
    assert conf.producer_max_request_size == ROLLOUTS_DLQ.max_message_bytes
    assert not conf.web_enabled
    assert str(conf.store) == "memory:"

    assert list(app.tables) == ["groups-memory"]  # its changelog is never written
    table = app.tables["groups-memory"]
    assert table.changelog_topic.get_topic_name() == f"{app_id}-groups-memory-changelog"
    assert (table.partitions, table.key_type, table.value_type) == (8, bytes, bytes)

    assert list(app.agents) == ["streams.app.assemble"]
    channel = app.agents["streams.app.assemble"].channel
    assert channel.topics == (topics.raw, f"{app_id}-ticks")
    assert (channel.key_serializer, channel.value_serializer) == ("raw", "raw")

    tasks = [(task.__name__, task) for task in app._app_tasks]
    assert [name for name, _ in tasks] == ["tick", "sweep_gaps", "report_lag", "start_services"]
    intervals = [_timer_interval(task) for _, task in tasks[:3]]
    assert intervals == [
        config.groups.tick_interval_s,
        GAP_SWEEP_INTERVAL_S,
        shared.presence.interval_s,
    ]
    assert len(list(app.on_partitions_revoked.iter_receivers(app))) == 1  # abort, rebuild
    assert len(list(app.on_before_shutdown.iter_receivers(app))) == 1  # the beacon's leave


# --- the parts alone ------------------------------------------------------------------------

RUN = "run"
RAW = "rollouts.raw"


def test_topic_specs_give_the_source_topics_raw_s_partition_count() -> None:
    config = StreamsConfig(app_id="app", topics=StreamTopics(raw="r", versions="v"))
    specs = {spec.name: spec for spec in topic_specs(config, raw_partitions=3)}
    assert list(specs) == [
        "r",
        "rollouts.scored",
        "rollouts.stale",
        "rollouts.dlq",
        "rollouts.filtered",
        "prompts.stats",
        "v",
        "app-ticks",
        "app-groups-changelog",
        "app-groups-memory-changelog",
    ]
    assert specs["r"].partitions == specs["app-ticks"].partitions == 3
    assert specs["app-ticks"].retention_ms == TICKS_RETENTION_MS
    assert specs["v"].cleanup_policy == specs["prompts.stats"].cleanup_policy == "compact"


def test_message_of_a_faust_event_carries_its_headers_as_pairs() -> None:
    def event(headers: object) -> SimpleNamespace:
        message = SimpleNamespace(topic=RAW, partition=2, offset=7, headers=headers)
        return SimpleNamespace(message=message, key=b"g", value=b"v")

    as_mapping = message_of(event({"rs-run-id": b"run", "empty": None}))
    assert as_mapping == Message(RAW, 2, 7, b"g", b"v", (("rs-run-id", b"run"), ("empty", b"")))
    assert message_of(event([("a", b"1")])).headers == (("a", b"1"),)
    assert message_of(event(None)).headers == ()


def test_the_agent_waits_for_the_version_topic_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    versions = SimpleNamespace(topic="policy.versions", caught_up=threading.Event(), started=0)
    versions.start = lambda: setattr(versions, "started", versions.started + 1)

    async def wait() -> None:
        asyncio.get_running_loop().call_later(0.2, versions.caught_up.set)
        await wait_for_versions(versions, warn_every_s=0.05, poll_s=0.01)  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="streams"):
        asyncio.run(wait())
    assert versions.started == 1
    assert "policy.versions not read to its end" in caplog.text


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


class FakeGaps:
    """The gap guard's interface: drops the offsets in ``drop``, ``reread`` are re-read."""

    def __init__(self, drop: set[int] = frozenset(), reread: set[int] = frozenset()) -> None:
        self.drop, self.reread = drop, reread

    def busy(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def admit(self, msg: Message) -> bool:
        return msg.offset not in self.drop

    def rereading(self, msg: Message) -> bool:
        return msg.offset in self.reread


class TableWriter:
    """Applies steps to a dict table, as ``EffectWriter`` does to the Faust table."""

    def __init__(self, table: dict[bytes, bytes]) -> None:
        self.table = table
        self.applied: list[tuple[Step, bool]] = []
        self.epoch = 0  # no rebalance here

    async def apply(self, step: Step, *, commit: bool = False, epoch: int | None = None) -> bool:
        assert epoch == self.epoch
        self.applied.append((step, commit))
        for key, value in step.writes:
            if value is None:
                self.table.pop(key, None)
            else:
                self.table[key] = value
        return True


class FailsFor:
    """An old-logit engine failing the groups named in ``groups``."""

    def __init__(self, config: StreamsConfig, groups: set[str]) -> None:
        self.engine = OldLogitEngine(config.old_logits, None)
        self.groups = groups

    def attach(self, samples: list[Trajectory]) -> list[Trajectory]:
        if samples[0].group_id in self.groups:
            raise IndexError("index out of range in self")
        return self.engine.attach(samples)


def assembler(engine_fails: set[str] = frozenset(), **gaps: set[int]) -> Assembler:
    config = StreamsConfig.model_validate(
        {"old_logits": {"mode": "off"}, "groups": {"timeout_s": 1, "min_partial_samples": 1}}
    )
    table: dict[bytes, bytes] = {}
    processor = Processor(config, RUN, VersionTracker(), table)
    return Assembler(
        processor,
        FailsFor(config, engine_fails),  # type: ignore[arg-type]
        FakeGaps(**gaps),  # type: ignore[arg-type]
        TableWriter(table),  # type: ignore[arg-type]
        ThreadPoolExecutor(max_workers=1),
        clock=Clock(),
    )


def sample_message(offset: int, group_id: str) -> Message:
    traj = synthetic(run_id=RUN, group_id=group_id, sample_index=0)
    return Message(RAW, 0, offset, group_id.encode(), encode(traj), tuple(routing_headers(traj)))


def test_a_group_whose_old_logits_fail_is_failed_alone() -> None:
    work = assembler(engine_fails={"g1"})
    writer, clock = work.writer, work.clock
    assert isinstance(writer, TableWriter) and isinstance(clock, Clock)

    async def run() -> None:
        await work.handle(sample_message(0, "g1"))
        await work.handle(sample_message(1, "g2"))
        clock.now += 2_000  # both groups time out: one tick closes both
        await work.handle(Message(work.processor.ticks_topic, 0, 0, None, b""))

    asyncio.run(run())
    tick, _commit = writer.applied[-1]
    assert {c.state.group_id: c.outcome for c in tick.closings} == {
        "g1": "failed",
        "g2": "partial",
    }
    (scored,) = [s for s in tick.sends if s.topic == "rollouts.scored"]
    assert decode_group(scored.value).group_id == "g2"
    (letter,) = [
        DeadLetter.from_headers(s.headers) for s in tick.sends if s.topic == "rollouts.dlq"
    ]
    assert letter.reason == "group_failed" and "IndexError" in letter.detail


def test_the_gap_guard_drops_and_a_bug_dead_letters_the_message() -> None:
    work = assembler(drop={1}, reread={2})
    writer = work.writer
    assert isinstance(writer, TableWriter)

    def bug(msg: Message, now_ms: int) -> Step:
        raise RuntimeError("a bug")

    async def run() -> None:
        await work.handle(sample_message(0, "g"))
        await work.handle(sample_message(1, "g"))  # dropped: records before it are re-read
        work.processor.handle = bug  # type: ignore[method-assign]
        await work.handle(sample_message(2, "h"))

    asyncio.run(run())
    assert [(step.message.offset, commit) for step, commit in writer.applied] == [
        (0, False),
        (2, True),  # re-read after a gap: its transaction is committed at once
    ]
    (letter,) = [DeadLetter.from_headers(s.headers) for s in writer.applied[1][0].sends]
    assert letter.reason == "processing_error" and "a bug" in letter.detail


def test_old_logits_off_run_no_model() -> None:
    config = StreamsConfig.model_validate({"old_logits": {"mode": "off"}})
    old = OldLogitPass(SharedConfig(), config.old_logits, StreamMetrics())
    assert old.source is None and not old.follows_weights
    assert old.model_limits() == (None, None)
    seeded = OldLogitsConfig(mode="exact", source="seeded")
    exact = OldLogitPass(SharedConfig(), seeded, StreamMetrics())
    assert isinstance(exact.source, SeededSource)
    # The device is resolved once; the engine and its snapshot store share it.
    assert exact.device == exact.engine.device == exact.snapshots.device == resolve_device()
