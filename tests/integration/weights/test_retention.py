"""Retention against a real SeaweedFS: keep the window and everything it needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from support.weight_states import UNSIGNED, forge, keypair, same_bits, step, store_for, tiny_state

from core.config import S3Config
from weights.follower import WeightFollower
from weights.manifest import Manifest, load_private_key, load_public_key
from weights.retention import collect_garbage, plan_gc
from weights.store import WeightStore
from weights.trust import Trust
from weights.writer import DeltaWriter


def publish(
    store: WeightStore, count: int, base_every: int, writer: DeltaWriter | None = None
) -> list[dict]:
    writer = writer or DeltaWriter(store, base_every=base_every)
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
    plan = collect_garbage(store, keep_versions=keep, orphan_grace_s=0, trust=UNSIGNED)
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

    assert plan_gc(store, keep_versions=10, orphan_grace_s=3600, trust=UNSIGNED).orphans == []
    later = datetime.now(UTC) + timedelta(hours=2)
    plan = plan_gc(store, keep_versions=10, orphan_grace_s=3600, now=later, trust=UNSIGNED)
    assert sorted(plan.orphans) == sorted([stray_loser, stray_unfinished])
    assert plan.delete == []

    dry = collect_garbage(store, keep_versions=10, orphan_grace_s=0, dry_run=True, trust=UNSIGNED)
    assert len(dry.orphans) == 2 and len(list(store.objects())) == 3 * 2 + 2
    collect_garbage(store, keep_versions=10, orphan_grace_s=0, trust=UNSIGNED)
    assert len(list(store.objects())) == 3 * 2
    assert store.versions() == [0, 1, 2]


def test_an_unreadable_manifest_is_not_counted_and_what_needs_it_stays(
    s3_config: S3Config,
) -> None:
    """Even with unsigned versions allowed the chain must verify: a garbled v4 is not a
    kept version, v5 (a delta on it) is useless but newer than every usable version, so
    both stay; the newest usable version (base v3) is kept and what is older goes."""
    store = store_for(s3_config)
    publish(store, 6, base_every=3)  # bases at 0 and 3
    store.client.put_object(Bucket=store.bucket, Key=store.manifest_key(4), Body=b"{garbled")
    plan = collect_garbage(store, keep_versions=1, orphan_grace_s=0, trust=UNSIGNED)
    assert plan.keep == [3] and plan.delete == [0, 1, 2]
    assert list(plan.unverified) == [4]
    assert store.versions() == [3, 4, 5]
    assert [o.version for o in store.objects()].count(5) == 2  # v5's files stay with it


def test_forged_versions_above_the_head_do_not_push_the_genuine_ones_out(
    s3_config: S3Config, tmp_path: Path
) -> None:
    """Whoever can write the bucket writes more forged versions above the head than the
    window holds (unsigned, and signed by a stranger's key): gc keeps the newest genuine
    versions and their chains, deletes only genuine versions below them, and leaves the
    forged ones where they are (they never count)."""
    private, public = keypair(tmp_path)
    stranger, _ = keypair(tmp_path, "stranger")
    store = store_for(s3_config)
    writer = DeltaWriter(store, base_every=3, signing_key=load_private_key(private))
    states = publish(store, 8, base_every=3, writer=writer)  # bases at 0, 3, 6; head v7
    keep = 3
    forged = list(range(8, 8 + 2 * keep))
    for version in forged:  # forged bases, each a complete version of its own
        forge(store, version, like=6, signer=stranger if version % 2 else None)

    trust = Trust(load_public_key(public))
    plan = collect_garbage(store, keep_versions=keep, orphan_grace_s=0, trust=trust)
    assert plan.keep == [3, 4, 5, 6, 7]  # v7, v6, v5 and the chain down to base 3
    assert plan.delete == [0, 1, 2]
    assert sorted(plan.unverified) == forged
    assert store.versions() == [3, 4, 5, 6, 7, *forged]
    assert trust.latest(store) == 7
    follower = WeightFollower(store, public_key=trust.public_key)
    assert same_bits(follower.sync().state, states[7])
    assert same_bits(WeightFollower(store, public_key=trust.public_key).sync(5).state, states[5])

    # with a key that verifies nothing, nothing at all is deleted
    other = Trust(load_public_key(keypair(tmp_path, "third")[1]))
    assert plan_gc(store, keep_versions=1, orphan_grace_s=0, trust=other).delete == []
