"""A follower's callback on real S3: a version counts as applied only once its callback
has returned; a failing callback is retried, counted and logged, never skipped."""

from __future__ import annotations

import threading

import pytest
from support.weight_states import same_bits, step, store_for, tiny_state, wait_for

from core.config import S3Config
from weights.errors import CallbackFailed
from weights.follower import Snapshot, WeightFollower
from weights.writer import DeltaWriter


def sample(follower: WeightFollower, name: str, **labels: str) -> float:
    value = follower.metrics.registry.get_sample_value(
        name, {"region": follower.store.region, "run": follower.store.run, **labels}
    )
    return value or 0.0


class Flaky:
    """A callback that raises for its first ``failures`` calls."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[int] = []
        self.taken: list[Snapshot] = []

    def __call__(self, snapshot: Snapshot) -> None:
        self.calls.append(snapshot.version)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("engine busy")
        self.taken.append(snapshot)


def test_a_version_is_applied_only_after_its_callback_succeeded(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    writer = DeltaWriter(store, base_every=10)
    state = tiny_state()
    writer.publish(state)
    callback = Flaky(failures=1)
    follower = WeightFollower(store_for(s3_config, store.run), callback)

    with pytest.raises(CallbackFailed):
        follower.sync()
    assert follower.version is None and follower.snapshot is None  # v0 is not held
    assert sample(follower, "rollstream_weights_callback_failures_total") == 1
    assert sample(follower, "rollstream_weights_applied_total", path="base") == 0

    # the next attempt hands the same v0 over again (no newer version exists)
    snapshot = follower.sync()
    assert snapshot is not None and follower.version == 0
    assert callback.calls == [0, 0]
    assert same_bits(callback.taken[0].state, state)
    assert sample(follower, "rollstream_weights_applied_total", path="base") == 1


def test_a_failing_callback_is_retried_by_follow_and_no_version_is_skipped(
    s3_config: S3Config, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_for(s3_config)
    writer = DeltaWriter(store, base_every=10)
    states = [tiny_state()]
    writer.publish(states[0])
    callback = Flaky(failures=0)
    follower = WeightFollower(store_for(s3_config, store.run), callback, retry_max_s=0.3)
    assert follower.sync().version == 0

    states.append(step(states[0], seed=1))
    writer.publish(states[1])  # v1 is the newest: it must reach the callback
    callback.failures = 4
    stop = threading.Event()
    thread = threading.Thread(
        target=follower.follow, args=(stop,), kwargs={"poll_interval_s": 0.1}, daemon=True
    )
    thread.start()
    try:
        wait_for(lambda: follower.version == 1, what="v1 applied once the callback works")
    finally:
        stop.set()
        thread.join(10)
    assert callback.calls == [0, 1, 1, 1, 1, 1]
    assert [s.version for s in callback.taken] == [0, 1]
    assert same_bits(callback.taken[1].state, states[1])
    assert sample(follower, "rollstream_weights_callback_failures_total") == 4
    assert "on_version callback failed for v1" in caplog.text


def test_a_version_not_mirrored_yet_is_awaited_quietly(
    s3_config: S3Config, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower in a region whose mirror has not copied an announced version yet says so
    once, not on every attempt; it still counts each attempt and applies the version
    when it arrives."""
    import logging

    from weights.errors import VersionRefused

    store = store_for(s3_config)
    writer = DeltaWriter(store, base_every=10)
    writer.publish(tiny_state())
    follower = WeightFollower(store_for(s3_config, store.run), Flaky(failures=0))
    assert follower.sync().version == 0
    with caplog.at_level(logging.INFO, logger="weights.follower"):
        for _ in range(20):
            with pytest.raises(VersionRefused):
                follower.sync(1)  # announced, not in this store yet
    said = [r for r in caplog.records if "v1" in r.getMessage()]
    assert len(said) == 1 and "waiting for v1" in said[0].getMessage()
    assert sample(follower, "rollstream_weights_refusals_total", reason="not_found") == 20
    writer.publish(step(tiny_state(), seed=1))
    assert follower.sync(1).version == 1
