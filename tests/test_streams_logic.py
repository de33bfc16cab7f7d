"""The stream's decisions without Faust or Kafka: routing, staleness, assembly, closing."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from support.streams import synthetic

from schemas.codec import MAGIC, encode
from schemas.control import DeadLetter, StaleRecord
from schemas.group import decode_group
from schemas.trajectory import NO_VERSION
from streams.config import StalenessConfig, StreamsConfig
from streams.groups import GROUP_PREFIX, SAMPLE_PREFIX, GroupState, group_key
from streams.oldlogits import OldLogitEngine
from streams.processor import Message, Processor, Step
from streams.staleness import StalenessPolicy, VersionTracker

RUN = "run"
RAW = "rollouts.raw"


class Harness:
    """A processor over a dict table, applying each step the way ``streams.txn`` does."""

    def __init__(self, **config) -> None:
        self.config = StreamsConfig.model_validate({"old_logits": {"mode": "off"}, **config})
        self.table: dict[bytes, bytes] = {}
        self.tracker = VersionTracker()
        self.processor = Processor(self.config, RUN, self.tracker, self.table)
        self.engine = OldLogitEngine(self.config.old_logits, None)
        self.sent: list = []
        self.offsets: dict[tuple[str, int], int] = {}
        self.now = 1_000_000

    def feed(
        self, value: bytes | None, key: bytes | None = None, partition: int = 0, topic: str = RAW
    ) -> Step:
        offset = self.offsets.get((topic, partition), -1) + 1
        self.offsets[(topic, partition)] = offset
        return self.deliver(Message(topic, partition, offset, key, value, (("x-h", b"1"),)))

    def deliver(self, msg: Message) -> Step:
        step = self.processor.handle(msg, self.now)
        attached = {
            c.state.group_id: self.engine.attach(c.samples) for c in step.closings if c.emit
        }
        self.processor.finish(step, attached, self.now)
        for send in step.sends:
            self.sent.append(send)
        for key, value in step.writes:
            if value is None:
                self.table.pop(key, None)
            else:
                self.table[key] = value
        return step

    def sample(self, **kw) -> Step:
        traj = synthetic(run_id=RUN, **kw)
        return self.feed(encode(traj), traj.group_id.encode())

    def tick(self, partition: int = 0) -> Step:
        return self.feed(b"", None, partition, topic=self.config.ticks_topic)

    def on(self, topic: str) -> list:
        return [s for s in self.sent if s.topic == topic]

    def dead_letters(self) -> list[DeadLetter]:
        return [DeadLetter.from_headers(s.headers) for s in self.on("rollouts.dlq")]


def test_complete_group_is_emitted_once_with_advantages() -> None:
    h = Harness()
    for i in range(4):
        h.sample(group_id="g1", sample_index=3 - i, reward=float(i))
    (out,) = h.on("rollouts.scored")
    group = decode_group(out.value)
    assert out.key == b"g1" and group.complete and group.group_size == 4
    assert [s.sample_index for s in group.samples] == [0, 1, 2, 3]
    assert math.isclose(sum(s.advantage for s in group.samples), 0.0, abs_tol=1e-9)
    assert group.samples[0].advantage > group.samples[3].advantage  # index 0 had reward 3
    assert all(s.old_logits_status == "off" and s.logp_old is None for s in group.samples)
    assert group.trainer_version_seen == NO_VERSION
    assert not any(k.startswith(SAMPLE_PREFIX) for k in h.table)
    marker = GroupState.from_bytes(h.table[group_key("g1")])
    assert marker.closed and marker.outcome == "complete"
    h.sample(group_id="g1", sample_index=1, seed=99)  # a late duplicate: refused
    assert len(h.on("rollouts.scored")) == 1
    assert [d.reason for d in h.dead_letters()] == ["late_sample"]


def test_samples_are_kept_in_the_table_until_the_group_closes() -> None:
    h = Harness()
    h.sample(group_id="g", sample_index=0)
    h.sample(group_id="g", sample_index=1)
    state = GroupState.from_bytes(h.table[group_key("g")])
    assert [s.sample_index for s in state.samples] == [0, 1] and state.group_size == 4
    assert sum(k.startswith(SAMPLE_PREFIX) for k in h.table) == 2
    assert h.sent == []


def corrupt(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def test_bad_records_go_to_the_dlq_with_reason_bytes_and_source() -> None:
    h = Harness()
    good = synthetic(run_id=RUN, group_id="g")
    n = len(good.response_ids)
    mismatched = dataclasses.replace(good, logp_infer=good.logp_infer[:-1])
    nan = dataclasses.replace(good, logp_infer=np.full(n, np.nan, np.float32))
    future = MAGIC + bytes([7]) + encode(good)[5:]
    cases = {
        b"\x00garbage\xff": "bad_magic",
        encode(mismatched): "length_mismatch",
        encode(nan): "nonfinite_logprob",
        future: "unknown_schema_version",
        corrupt(encode(good), 120): "checksum_mismatch",
        b"": "empty",
    }
    for value in cases:
        h.feed(value, b"g")
    letters = h.on("rollouts.dlq")
    assert [DeadLetter.from_headers(s.headers).reason for s in letters] == list(cases.values())
    for offset, (send, value) in enumerate(zip(letters, cases, strict=True)):
        letter = DeadLetter.from_headers(send.headers)
        assert send.value == value and send.key == b"g"
        assert (letter.source_topic, letter.partition, letter.offset) == (RAW, 0, offset)
        assert ("x-h", b"1") in send.headers  # original headers kept
    assert "logp_infer" in DeadLetter.from_headers(letters[1].headers).detail


def test_wrong_run_and_wrong_key_are_dead_lettered() -> None:
    h = Harness()
    other = synthetic(run_id="other", group_id="g")
    h.feed(encode(other), b"g")
    mine = synthetic(run_id=RUN, group_id="g")
    h.feed(encode(mine), b"not-g")
    assert [d.reason for d in h.dead_letters()] == ["foreign_run", "key_mismatch"]


def test_duplicates_and_conflicts_are_dead_lettered() -> None:
    h = Harness()
    h.sample(group_id="g", sample_index=0)
    h.sample(group_id="g", sample_index=0)  # same trajectory id
    clash = synthetic(run_id=RUN, group_id="g", sample_index=1)
    h.feed(encode(dataclasses.replace(clash, trajectory_id="other", sample_index=0)), b"g")
    h.feed(encode(dataclasses.replace(clash, group_size=8)), b"g")
    assert [d.reason for d in h.dead_letters()] == [
        "duplicate_sample",
        "duplicate_sample_index",
        "group_size_mismatch",
    ]


def test_replayed_offsets_are_skipped() -> None:
    h = Harness()
    traj = synthetic(run_id=RUN, group_id="g", group_size=1)
    msg = Message(RAW, 0, 5, b"g", encode(traj))
    first = h.deliver(msg)
    again = h.deliver(msg)
    assert not first.skipped and again.skipped
    assert len(h.on("rollouts.scored")) == 1
    assert h.deliver(dataclasses.replace(msg, offset=4)).skipped
    assert h.deliver(Message(RAW, 1, 5, b"x", b"junk")).skipped is False  # other partition


def test_stale_records_are_routed_and_counted_as_dropped() -> None:
    h = Harness(staleness={"max_staleness": 2})
    h.tracker.observe(10)
    h.sample(group_id="g", group_size=3, sample_index=0, versions=(7,))  # staleness 3
    (stale,) = h.on("rollouts.stale")
    record = StaleRecord.from_headers(stale.headers)
    assert (record.staleness, record.trainer_version, record.max_staleness) == (3, 10, 2)
    assert record.trajectory_id == "g-0"
    h.sample(group_id="g", group_size=3, sample_index=1, versions=(8, 9))  # staleness 2
    h.sample(group_id="g", group_size=3, sample_index=2, versions=(10,))
    (out,) = h.on("rollouts.scored")  # closes at once: every sample accounted for
    group = decode_group(out.value)
    assert not group.complete and [s.sample_index for s in group.samples] == [1, 2]
    assert [d.staleness for d in group.diagnostics] == [2, 0]
    assert group.trainer_version_seen == 10


def test_invalid_samples_of_a_group_count_as_dropped() -> None:
    h = Harness()
    bad = synthetic(run_id=RUN, group_id="g", group_size=3, sample_index=0)
    h.feed(encode(dataclasses.replace(bad, logp_infer=bad.logp_infer * np.nan)), b"g")
    h.sample(group_id="g", group_size=3, sample_index=1)
    h.sample(group_id="g", group_size=3, sample_index=2)
    assert decode_group(h.on("rollouts.scored")[0].value).samples[0].sample_index == 1


def test_timeout_emits_a_partial_group_on_tick() -> None:
    h = Harness(groups={"timeout_s": 5})
    h.sample(group_id="g", sample_index=0, reward=1.0)
    h.sample(group_id="g", sample_index=2, reward=0.0)
    h.now += 4_000
    assert h.processor.due_partitions(h.now) == set()
    h.tick()
    assert h.on("rollouts.scored") == []
    h.now += 1_000
    assert h.processor.due_partitions(h.now) == {0}
    h.tick(partition=1)  # another partition's tick leaves it alone
    assert h.on("rollouts.scored") == []
    h.tick()
    group = decode_group(h.on("rollouts.scored")[0].value)
    assert not group.complete and len(group.samples) == 2
    assert [round(s.advantage, 3) for s in group.samples] == [0.707, -0.707]


def test_timeout_with_too_few_samples_or_drop_policy_dead_letters_them() -> None:
    for config, present in (
        ({"timeout_s": 1, "min_partial_samples": 3}, 2),
        ({"timeout_s": 1, "partial_policy": "drop"}, 3),
    ):
        h = Harness(groups=config)
        for i in range(present):
            h.sample(group_id="g", sample_index=i)
        h.now += 1_000
        h.tick()
        assert h.on("rollouts.scored") == []
        letters = h.dead_letters()
        assert [d.reason for d in letters] == ["incomplete_group"] * present
        assert sorted(d.offset for d in letters) == list(range(present))
        assert GroupState.from_bytes(h.table[group_key("g")]).outcome == "dropped"


def test_closed_group_markers_are_forgotten_after_retention() -> None:
    h = Harness(groups={"emitted_retention_s": 10})
    h.sample(group_id="g", group_size=1)
    assert group_key("g") in h.table
    h.now += 10_000
    assert h.processor.due_partitions(h.now) == {0}
    h.tick()
    assert not any(k.startswith(GROUP_PREFIX) for k in h.table)


def test_no_retention_deletes_the_marker_at_once() -> None:
    h = Harness(groups={"emitted_retention_s": 0})
    h.sample(group_id="g", group_size=1)
    assert group_key("g") not in h.table


def test_window_policy() -> None:
    policy = StalenessPolicy(StalenessConfig(max_staleness=2))
    assert policy.judge(5, NO_VERSION).admitted
    assert policy.judge(8, 10).admitted and not policy.judge(7, 10).admitted
    assert policy.judge(12, 10).admitted  # announcement not seen yet
    assert policy.oldest_admitted(10) == 8 and policy.oldest_admitted(NO_VERSION) == 0


@pytest.mark.parametrize(
    ("admitted", "trainer", "oldest"),
    [(0, 10, 8), (0, 15, 8), (0, 16, 16), (1, 15, 0), (1, 16, 8), (2, 23, 0)],
)
def test_staged_policy_admits_whole_stages(admitted: int, trainer: int, oldest: int) -> None:
    policy = StalenessPolicy(
        StalenessConfig(mode="staged", stage_versions=8, stages_admitted=admitted)
    )
    assert policy.oldest_admitted(trainer) == oldest
    assert policy.judge(oldest, trainer).admitted
    if oldest > 0:
        verdict = policy.judge(oldest - 1, trainer)
        assert not verdict.admitted and verdict.limit == trainer - oldest


def test_version_tracker_only_moves_forward() -> None:
    tracker = VersionTracker()
    assert tracker.observe(3) and not tracker.observe(2) and not tracker.observe(3)
    assert tracker.version == 3 and tracker.wait_for(3, 0.01) and not tracker.wait_for(4, 0.01)


def test_config_rejects_unknown_keys_and_clashing_topics() -> None:
    with pytest.raises(ValueError, match="extra"):
        StreamsConfig.model_validate({"nope": 1})
    with pytest.raises(ValueError, match="must differ"):
        StreamsConfig.model_validate({"topics": {"scored": "rollouts.raw"}})
    assert StreamsConfig(app_id="a").ticks_topic == "a-ticks"


def test_stream_command_checks_the_config(tmp_path, monkeypatch) -> None:
    from click.testing import CliRunner

    from rollstream.cli import main

    good = tmp_path / "good.toml"
    good.write_text(
        'run_id = "r"\n[kafka]\nbootstrap_servers = "localhost:1"\n'
        '[streams]\napp_id = "a"\n[streams.staleness]\nmode = "staged"\n'
        "[weights]\npoll_interval_s = 1.0\n"
    )
    monkeypatch.setenv("ROLLSTREAM_CONFIG", str(good))
    result = CliRunner().invoke(main, ["stream", "--check"])
    assert result.exit_code == 0, result.output
    assert '"mode": "staged"' in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[streams]\nunknown_key = 1\n")
    monkeypatch.setenv("ROLLSTREAM_CONFIG", str(bad))
    result = CliRunner().invoke(main, ["stream", "--check"])
    assert result.exit_code != 0 and "unknown_key" in result.output


def test_gap_guard_seeks_back_over_records_faust_skipped() -> None:
    import asyncio

    from streams.gaps import GapGuard
    from streams.groups import offset_key

    table = {offset_key(RAW, 0): b"13"}
    seeks: list[tuple[int, int]] = []

    async def seek(partition: int, offset: int) -> None:
        seeks.append((partition, offset))

    guard = GapGuard(table, {}, RAW, seek)
    real = {14: 14, 20: 20}  # what a read_committed consumer finds from an offset on
    guard._first_offset_from = lambda partition, offset: real.get(offset, offset)  # type: ignore[method-assign]
    guard._low_watermark = lambda partition: 0  # type: ignore[method-assign]

    def admit(partition: int, offset: int, topic: str = RAW) -> bool:
        return asyncio.run(guard.admit(Message(topic, partition, offset, b"k", b"v")))

    assert admit(0, 12) and admit(0, 13) and admit(0, 14)  # replays and the next record
    assert not admit(0, 19) and seeks == [(0, 14)]  # 14..18 skipped upstream: seek back
    assert not admit(0, 20) and seeks == [(0, 14)]  # still buffered past the hole: no re-seek
    # Faust acknowledged 19 and 20 when they were dropped: 14..20 come again from below
    # its committed offset, and their transactions must be committed by the agent.
    reread = [o for o in range(12, 24) if guard.rereading(Message(RAW, 0, o, b"k", b"v"))]
    assert reread == list(range(12, 21))
    assert not guard.rereading(Message(RAW, 1, 0, b"k", b"v"))
    table[offset_key(RAW, 0)] = b"19"
    real[20] = 25  # a legitimate jump (e.g. transaction markers): 20..24 hold no records
    assert admit(0, 25) and seeks == [(0, 14)]
    assert admit(1, 0) and not admit(1, 3)  # no watermark yet: the log start is expected
    assert admit(0, 99, topic="ticks")  # only the raw topic is guarded

    # first_start = "committed": a partition without a watermark starts at the app's
    # committed offset (a new run's end of topic), not at the log start.
    fresh = GapGuard({}, {}, RAW, seek, start_group="rollstream-streams-run-2")
    fresh._first_offset_from = lambda partition, offset: offset  # type: ignore[method-assign]
    fresh._low_watermark = lambda partition: 0  # type: ignore[method-assign]
    fresh._committed_offset = lambda partition: {0: 500}.get(partition)  # type: ignore[method-assign]

    def admit_fresh(partition: int, offset: int) -> bool:
        return asyncio.run(fresh.admit(Message(RAW, partition, offset, b"k", b"v")))

    assert admit_fresh(0, 500) and not admit_fresh(0, 503)  # starts at 500, 501..502 missing
    assert admit_fresh(1, 0) and not admit_fresh(1, 4)  # no committed offset: the log start
