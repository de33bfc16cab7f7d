"""The stream's decisions without Faust or Kafka: routing, staleness, assembly, closing."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from support.streams import RAW, RUN, Harness, synthetic

from schemas.codec import MAGIC, encode, routing_headers
from schemas.control import DeadLetter, StaleRecord
from schemas.group import decode_group
from schemas.trajectory import NO_VERSION
from streams.config import StalenessConfig, StreamsConfig
from streams.groups import GROUP_PREFIX, SAMPLE_PREFIX, GroupState, group_key
from streams.processor import Message
from streams.staleness import StalenessPolicy, VersionTracker


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


def test_an_invalid_sample_changes_no_group_and_its_group_closes_at_the_timeout() -> None:
    h = Harness(groups={"timeout_s": 5})
    bad = synthetic(run_id=RUN, group_id="g", group_size=3, sample_index=0)
    h.feed(encode(dataclasses.replace(bad, logp_infer=bad.logp_infer * np.nan)), b"g")
    assert group_key("g") not in h.table
    h.sample(group_id="g", group_size=3, sample_index=1)
    h.sample(group_id="g", group_size=3, sample_index=2)
    assert h.on("rollouts.scored") == []  # sample 0 may still come
    h.now += 5_000
    h.tick()
    group = decode_group(h.on("rollouts.scored")[0].value)
    assert not group.complete and [s.sample_index for s in group.samples] == [1, 2]
    assert [d.reason for d in h.dead_letters()] == ["nonfinite_logprob"]


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
    assert policy.judge(11, 10).admitted  # announcement not seen yet: within the allowance
    assert policy.judge(11, 10).staleness == 0  # never negative
    assert policy.judge(12, 10).future and not policy.judge(12, 10).admitted
    assert policy.judge(8, 10, 12).future  # the newest segment decides
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

    from rollstream.cli.main import main

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

    from streams.faust.gaps import GapGuard
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
    # recorded start offset (a new run's end of topic), not at the log start.
    fresh = GapGuard({}, {}, RAW, seek, start_topic="rollstream-streams-run-2-start")
    fresh._first_offset_from = lambda partition, offset: offset  # type: ignore[method-assign]
    fresh._low_watermark = lambda partition: 0  # type: ignore[method-assign]
    fresh._start_offset = lambda partition: {0: 500}.get(partition)  # type: ignore[method-assign]

    def admit_fresh(partition: int, offset: int) -> bool:
        return asyncio.run(fresh.admit(Message(RAW, partition, offset, b"k", b"v")))

    assert admit_fresh(0, 500) and not admit_fresh(0, 503)  # starts at 500, 501..502 missing
    assert admit_fresh(1, 0) and not admit_fresh(1, 4)  # no committed offset: the log start


# --- records the model cannot run, versions never published, lying headers --------------


def test_records_outside_the_models_vocabulary_or_context_are_dead_lettered() -> None:
    """An id the old-logit model has no embedding for (or a sequence longer than its
    context) never joins a group: the rest of the group is emitted without it (at the
    timeout: a refused record changes no group)."""
    h = Harness(model=(16, 12), groups={"timeout_s": 5})
    good = [synthetic(run_id=RUN, group_id="g", group_size=4, sample_index=i) for i in range(2)]
    base = synthetic(run_id=RUN, group_id="g", group_size=4, sample_index=2)
    ids = base.response_ids.copy()
    ids[3] = 16
    out_of_vocab = dataclasses.replace(base, response_ids=ids)
    too_long = synthetic(
        run_id=RUN, group_id="g", group_size=4, sample_index=3, prompt_len=4, response_len=9
    )
    for traj in (*good, out_of_vocab, too_long):
        h.feed(encode(traj), b"g")
    assert [d.reason for d in h.dead_letters()] == ["token_out_of_range", "too_long"]
    assert "[0, 16)" in h.dead_letters()[0].detail and "context is 12" in h.dead_letters()[1].detail
    h.now += 5_000
    h.tick()
    (out,) = h.on("rollouts.scored")
    assert [s.sample_index for s in decode_group(out.value).samples] == [0, 1]


class FailingEngine:
    def attach(self, samples):
        raise IndexError("index out of range in self")


def test_a_group_whose_old_logits_fail_dead_letters_every_sample_once() -> None:
    h = Harness(groups={"timeout_s": 1})
    h.engine = FailingEngine()
    trajs = [synthetic(run_id=RUN, group_id="g", sample_index=i) for i in range(4)]
    for traj in trajs:
        h.feed(encode(traj), b"g")
    letters = h.dead_letters()
    assert [d.reason for d in letters] == ["group_failed"] * 4
    assert "IndexError" in letters[0].detail
    assert sorted(d.offset for d in letters) == [0, 1, 2, 3]
    assert sorted(s.value for s in h.on("rollouts.dlq")) == sorted(encode(t) for t in trajs)
    assert h.on("rollouts.scored") == []
    assert GroupState.from_bytes(h.table[group_key("g")]).outcome == "failed"
    assert not any(k.startswith(SAMPLE_PREFIX) for k in h.table)
    assert h.processor.metrics.value("rollstream_streams_group_failures_total") == 1
    h.now += 5_000  # past the timeout: nothing left to close, nothing tried again
    assert h.processor.due_partitions(h.now) == set()
    h.tick()
    assert len(h.on("rollouts.dlq")) == 4


def test_a_group_that_cannot_be_read_on_a_tick_fails_once() -> None:
    """A closing that raises inside the tick fails its group (every sample dead-lettered
    with its stored bytes) instead of failing the tick, and so every later tick."""
    h = Harness(groups={"timeout_s": 1})
    for i in range(2):
        h.sample(group_id="g", sample_index=i)
    key = next(k for k in h.table if k.startswith(SAMPLE_PREFIX))
    h.table[key] = b"not a record"
    h.now += 1_000
    h.tick()
    letters = h.dead_letters()
    assert [d.reason for d in letters] == ["group_failed"] * 2
    assert b"not a record" in [s.value for s in h.on("rollouts.dlq")]
    h.now += 1_000
    h.tick()
    assert len(h.dead_letters()) == 2 and h.processor.due_partitions(h.now) == set()


def test_a_tick_that_fails_writes_no_empty_dead_letter() -> None:
    h = Harness()
    step = h.processor.failed(Message(h.config.ticks_topic, 0, 7, None, b""), KeyError("x"))
    assert step.sends == [] and step.writes[-1][1] == b"7"
    assert (
        h.processor.metrics.value(
            "rollstream_streams_processing_errors_total", topic=h.config.ticks_topic
        )
        == 1
    )


def test_versions_never_published_are_dead_lettered() -> None:
    h = Harness(staleness={"max_staleness": 2, "future_allowance": 1})
    h.tracker.observe(10)
    h.sample(group_id="g", group_size=3, sample_index=0, versions=(11,))  # in the allowance
    h.sample(group_id="g", group_size=3, sample_index=1, versions=(10, 12))  # never published
    h.sample(group_id="g", group_size=3, sample_index=2, versions=(9,))
    (letter,) = h.dead_letters()
    assert letter.reason == "future_version" and "reach 12" in letter.detail
    (out,) = h.on("rollouts.scored")  # the bad sample counts as dropped: closes at once
    group = decode_group(out.value)
    assert [s.sample_index for s in group.samples] == [0, 2]
    assert [d.staleness for d in group.diagnostics] == [0, 1]  # never negative


def test_a_version_the_store_vouches_for_is_fresh_and_the_clock_stays() -> None:
    """A broker outage delays announcements while producers follow the weight store: a
    record of a version the store holds reaches the stream ahead of its clock. The agent
    asks the store (``streams.versions.VersionVoucher``); vouched for, the record is
    admitted as fresh, and the clock staleness is measured against does not move."""
    h = Harness(staleness={"max_staleness": 2, "future_allowance": 1})
    h.tracker.observe(10)
    ahead = synthetic(run_id=RUN, group_id="g", group_size=2, sample_index=0, versions=(14,))
    msg = Message(RAW, 0, 0, b"g", encode(ahead), tuple(routing_headers(ahead)))
    h.offsets[(RAW, 0)] = 0
    assert h.processor.unannounced_version(msg) == 14
    assert h.processor.unannounced_version(dataclasses.replace(msg, headers=())) is None
    h.tracker.vouch(14)
    assert h.processor.unannounced_version(msg) is None
    h.deliver(msg)
    h.sample(group_id="g", group_size=2, sample_index=1, versions=(9,))
    assert h.dead_letters() == []
    (out,) = h.on("rollouts.scored")
    assert [d.staleness for d in decode_group(out.value).diagnostics] == [0, 1]
    assert h.tracker.version == 10  # the clock: still the newest announcement
    # beyond what the store vouched for: a version never published
    h.sample(group_id="g2", group_size=1, sample_index=0, versions=(15,))
    assert [d.reason for d in h.dead_letters()] == ["future_version"]


def test_a_version_unknown_on_arrival_is_judged_when_the_group_closes() -> None:
    h = Harness(groups={"timeout_s": 1, "min_partial_samples": 1})
    h.sample(group_id="g", group_size=3, sample_index=0, versions=(999,))
    h.sample(group_id="g", group_size=3, sample_index=1, versions=(0,))
    h.tracker.observe(1)
    h.now += 1_000
    h.tick()
    assert [d.reason for d in h.dead_letters()] == ["future_version"]
    (out,) = h.on("rollouts.scored")
    assert [s.sample_index for s in decode_group(out.value).samples] == [1]


@pytest.mark.parametrize("max_staleness", [0, 2, 3])
def test_the_window_is_exact_at_the_version_of_emission(max_staleness: int) -> None:
    """Samples admitted on arrival are judged again at closing, against the version the
    group is emitted at: exactly ``max_staleness`` is emitted (and recorded as such),
    one more goes to the stale topic, and the group closes with the rest."""
    h = Harness(staleness={"max_staleness": max_staleness})
    h.tracker.observe(10)
    oldest = 10 - max_staleness
    h.sample(group_id="g", group_size=3, sample_index=0, versions=(oldest,))
    h.sample(group_id="g", group_size=3, sample_index=1, versions=(oldest + 1,))
    h.tracker.observe(11)  # the trainer moves on while the group waits
    h.sample(group_id="g", group_size=3, sample_index=2, versions=(11,))
    (stale,) = h.on("rollouts.stale")
    record = StaleRecord.from_headers(stale.headers)
    assert (record.trajectory_id, record.staleness, record.trainer_version) == (
        "g-0",
        max_staleness + 1,
        11,
    )
    assert stale.value == encode(
        synthetic(run_id=RUN, group_id="g", group_size=3, versions=(oldest,))
    )
    (out,) = h.on("rollouts.scored")
    group = decode_group(out.value)
    assert group.trainer_version_seen == 11 and not group.complete
    assert [s.sample_index for s in group.samples] == [1, 2]
    assert [d.staleness for d in group.diagnostics] == [max_staleness, 0]
    assert h.dead_letters() == []
    assert not any(k.startswith(SAMPLE_PREFIX) for k in h.table)


def test_routing_headers_must_agree_with_the_body() -> None:
    from schemas.codec import routing_headers

    h = Harness(groups={"timeout_s": 5})
    trajs = [synthetic(run_id=RUN, group_id="g", group_size=5, sample_index=i) for i in range(5)]
    honest = routing_headers(trajs[0])
    lying_run = [(k, b"other-run" if k == "rs-run-id" else v) for k, v in routing_headers(trajs[1])]
    lying_group = [(k, b"h" if k == "rs-group-id" else v) for k, v in routing_headers(trajs[2])]
    twice = [*routing_headers(trajs[3]), ("rs-trajectory-id", b"g-3")]
    for traj, headers in zip(trajs, (honest, lying_run, lying_group, twice, []), strict=True):
        h.deliver(Message(RAW, 0, traj.sample_index, b"g", encode(traj), tuple(headers)))
    letters = h.dead_letters()
    assert [d.reason for d in letters] == ["header_mismatch"] * 3
    assert "rs-run-id='other-run', body 'run'" in letters[0].detail
    assert "rs-group-id" in letters[1].detail and "more than once" in letters[2].detail
    assert h.on("rollouts.scored") == []  # a refused record changes no group
    h.now += 5_000
    h.tick()
    (out,) = h.on("rollouts.scored")  # honest and header-less samples, at the timeout
    assert [s.sample_index for s in decode_group(out.value).samples] == [0, 4]


def test_faust_commit_alarms_are_explained_once_not_repeated(caplog) -> None:
    """Under exactly-once, offsets commit inside transactions: Faust's "Has not committed"
    alarm is a false alarm, logged once per partition at INFO with the reason."""
    import logging

    from streams.faust.faust_logs import FAUST_CONSUMER_LOGGER, quiet_commit_alarms

    faust_log = logging.getLogger(FAUST_CONSUMER_LOGGER)
    ours = logging.getLogger("streams.test")
    alarm_filter = quiet_commit_alarms(ours)
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                faust_log.error("Has not committed %r at all since worker start (started %s).",
                                "TP(topic='raw', partition=1)", "5 minutes ago")  # fmt: skip
            faust_log.error("Stream stopped processing, or is slow for %r", "TP(raw, 2)")
    finally:
        faust_log.removeFilter(alarm_filter)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    slow = "Stream stopped processing, or is slow for 'TP(raw, 2)'"
    assert [r.getMessage() for r in errors] == [slow]
    explained = [r for r in caplog.records if r.name == "streams.test"]
    assert len(explained) == 1 and "inside its transactions" in explained[0].getMessage()


# --- data operators ----------------------------------------------------------------------


def test_an_operator_filters_a_group_to_the_filtered_topic_with_its_bytes() -> None:
    from schemas.control import FilteredGroup

    h = Harness(operators=[{"name": "zero_variance"}])
    raw = {}
    for i in range(4):
        traj = synthetic(run_id=RUN, group_id="flat", sample_index=i, reward=1.0)
        raw[traj.trajectory_id] = encode(traj)
        h.feed(raw[traj.trajectory_id], b"flat")
    for i in range(4):
        h.sample(group_id="useful", sample_index=i, reward=float(i))
    assert [decode_group(s.value).group_id for s in h.on("rollouts.scored")] == ["useful"]
    filtered = h.on("rollouts.filtered")
    assert sorted(s.value for s in filtered) == sorted(raw.values())  # original bytes
    notes = [FilteredGroup.from_headers(s.headers) for s in filtered]
    assert {(n.group_id, n.operator, n.reason) for n in notes} == {
        ("flat", "zero_variance", "zero_variance")
    }
    assert all(s.key == b"flat" for s in filtered) and h.dead_letters() == []
    marker = GroupState.from_bytes(h.table[group_key("flat")])
    assert marker.closed and marker.outcome == "filtered"
    m = h.processor.metrics
    assert m.value("rollstream_streams_filtered_total", operator="zero_variance",
                   reason="zero_variance") == 4  # fmt: skip
    assert m.value("rollstream_streams_operator_decisions_total", operator="zero_variance",
                   decision="kept") == 1  # fmt: skip


def test_samples_an_operator_takes_out_are_filtered_and_advantages_follow_new_rewards() -> None:
    from schemas.control import FilteredGroup

    h = Harness(
        operators=[
            {"name": "reward_clip", "options": {"low": 0.0, "high": 2.0}},
            {"name": "overlong"},
        ]
    )
    for i, reward in enumerate([0.0, 5.0, 1.0, 3.0]):
        traj = synthetic(run_id=RUN, group_id="g", sample_index=i, reward=reward)
        if i == 2:
            traj = dataclasses.replace(traj, finish_reason="length")
        h.feed(encode(traj), b"g")
    (scored,) = h.on("rollouts.scored")
    group = decode_group(scored.value)
    assert [s.sample_index for s in group.samples] == [0, 1, 3] and not group.complete
    assert [s.reward for s in group.samples] == [0.0, 2.0, 2.0]  # clipped
    assert group.samples[1].advantage == group.samples[2].advantage > 0 > group.samples[0].advantage
    (out,) = h.on("rollouts.filtered")
    note = FilteredGroup.from_headers(out.headers)
    assert (note.operator, note.reason) == ("overlong", "removed")


def test_a_broken_user_operator_dead_letters_the_group_and_the_worker_goes_on() -> None:
    h = Harness(operators=[{"name": "support.user_operators:Raises"}])
    for i in range(4):
        h.sample(group_id="g", sample_index=i, reward=float(i))
    assert h.on("rollouts.scored") == [] and h.on("rollouts.filtered") == []
    letters = h.dead_letters()
    assert [d.reason for d in letters] == ["operator_failed"] * 4
    assert "raises" in letters[0].detail and "boom" in letters[0].detail
    h.sample(group_id="next", sample_index=0)  # still serving
    assert GroupState.from_bytes(h.table[group_key("next")]).group_size == 4


def test_the_operator_trace_is_on_the_step() -> None:
    h = Harness(operators=[{"name": "reward_clip"}, {"name": "zero_variance"}])
    steps = [h.sample(group_id="g", sample_index=i, reward=5.0) for i in range(4)]
    assert steps[-1].operator_trace == {"g": (("reward_clip", "changed"),
                                               ("zero_variance", "zero_variance"))}  # fmt: skip
