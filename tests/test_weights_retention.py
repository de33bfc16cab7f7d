"""Retention against a real SeaweedFS: keep the window and everything it needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from weights_support import same_bits, step, store_for, tiny_state

from core.config import S3Config
from weights.errors import WeightsError
from weights.follower import WeightFollower
from weights.manifest import Manifest
from weights.retention import collect_garbage, plan_gc
from weights.store import WeightStore
from weights.writer import DeltaWriter


def publish(store: WeightStore, count: int, base_every: int) -> list[dict]:
    writer = DeltaWriter(store, base_every=base_every)
    states = [tiny_state()]
    for i in range(1, count):
        states.append(step(states[-1], seed=i))
    for state in states:
        writer.publish(state)
    return states


@pytest.mark.parametrize(
    ("keep", "expected_keep"),
    [
        (1, list(range(8, 12))),  # v11 needs base 8 and deltas 9, 10
        (3, list(range(8, 12))),
        (4, list(range(8, 12))),
        (5, list(range(4, 12))),  # v7 pulls in base 4 and its deltas
        (20, list(range(12))),
    ],
)
def test_gc_keeps_the_window_and_the_chains_it_needs(
    s3_config: S3Config, keep: int, expected_keep: list[int]
) -> None:
    store = store_for(s3_config)
    states = publish(store, 12, base_every=4)  # bases at 0, 4, 8
    plan = collect_garbage(store, keep_versions=keep, orphan_grace_s=0)
    assert plan.keep == expected_keep
    assert store.versions() == expected_keep
    # Every kept version still rebuilds exactly, from a follower that holds nothing.
    for version in expected_keep:
        assert same_bits(WeightFollower(store).sync(version).state, states[version])
    # No kept delta lost its base.
    for version in expected_keep:
        assert Manifest.from_bytes(store.read_manifest(version)).base in expected_keep


def test_gc_collects_orphans_only_after_the_grace_period(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    publish(store, 3, base_every=10)
    stray_unfinished = store.key(7, "abc.delta.safetensors.zst")  # crashed upload
    stray_loser = store.key(2, "def.delta.safetensors.zst")  # a claim loser's leftover
    for key in (stray_unfinished, stray_loser):
        store.upload(key, b"partial")

    assert plan_gc(store, keep_versions=10, orphan_grace_s=3600).orphans == []
    later = datetime.now(UTC) + timedelta(hours=2)
    plan = plan_gc(store, keep_versions=10, orphan_grace_s=3600, now=later)
    assert sorted(plan.orphans) == sorted([stray_loser, stray_unfinished])
    assert plan.delete == []

    dry = collect_garbage(store, keep_versions=10, orphan_grace_s=0, dry_run=True)
    assert len(dry.orphans) == 2 and len(list(store.objects())) == 3 * 2 + 2
    collect_garbage(store, keep_versions=10, orphan_grace_s=0)
    assert len(list(store.objects())) == 3 * 2
    assert store.versions() == [0, 1, 2]


def test_gc_refuses_to_guess_when_a_kept_manifest_is_unreadable(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    publish(store, 6, base_every=3)
    store.client.put_object(Bucket=store.bucket, Key=store.manifest_key(4), Body=b"{garbled")
    with pytest.raises(WeightsError, match="cannot read the chain"):
        collect_garbage(store, keep_versions=2, orphan_grace_s=0)
    assert store.versions() == list(range(6))  # nothing deleted
