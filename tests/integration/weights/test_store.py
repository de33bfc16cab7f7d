"""Publishing and following versions against a real SeaweedFS (and a real Kafka broker).

Every refusal path is exercised by damaging what is really in the bucket, the way a
crashed upload, a bit flip or an intruder with write access would, and each time the
follower must keep the version it had.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import orjson
import pytest
from support.weight_states import (
    overwrite,
    publish_chain,
    same_bits,
    step,
    store_for,
    tiny_state,
    wait_for,
)

from core.config import KafkaConfig, S3Config
from infra.topics import ensure_topics
from schemas.control import VersionAnnouncement
from schemas.topics import TopicSpec
from weights import format as fmt
from weights.announce import AnnouncementListener, Announcer
from weights.errors import RefusalReason, VersionRefused, VersionTaken
from weights.follower import Snapshot, WeightFollower
from weights.manifest import (
    MANIFEST_NAME,
    Manifest,
    generate_keypair,
    load_private_key,
    load_public_key,
)
from weights.store import WeightStore
from weights.writer import DeltaWriter


def refusals(follower: WeightFollower, reason: RefusalReason) -> float:
    value = follower.metrics.registry.get_sample_value(
        "rollstream_weights_refusals_total",
        {"region": follower.store.region, "run": follower.store.run, "reason": reason.value},
    )
    return value or 0.0


def data_key(store: WeightStore, version: int) -> str:
    manifest = Manifest.from_bytes(store.read_manifest(version))
    return store.key(version, manifest.files[0].name)


# --- the happy path ----------------------------------------------------------------------


def test_publish_and_follow_bit_exact(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    writer = DeltaWriter(store, base_every=4)
    states = publish_chain(writer, 10)
    kinds = [Manifest.from_bytes(store.read_manifest(v)).kind for v in store.versions()]
    assert store.versions() == list(range(10))
    assert kinds == ["base", "delta", "delta", "delta"] * 2 + ["base", "delta"]

    seen: list[Snapshot] = []
    follower = WeightFollower(store_for(s3_config, store.run), seen.append)
    for target in (0, 3, 5, 9):
        snapshot = follower.sync(target)
        assert snapshot is not None and snapshot.version == target
        assert same_bits(snapshot.state, states[target])
        assert snapshot.state["head.weight"] is snapshot.state["embed.weight"]
    assert [s.version for s in seen] == [0, 3, 5, 9]
    assert follower.sync() is seen[-1]  # nothing newer: same snapshot
    applied = follower.metrics.registry.get_sample_value(
        "rollstream_weights_applied_total",
        {"region": store.region, "run": store.run, "path": "delta"},
    )
    assert applied == 1  # 0 -> 3; 5 and 9 were behind a newer base
    # Earlier snapshots stay intact while later ones are built (copy on write).
    assert same_bits(seen[1].state, states[3])


def test_deltas_are_small_and_bases_are_forced_when_deltas_are_big(
    s3_config: S3Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_for(s3_config)
    writer = DeltaWriter(store, base_every=100, max_delta_fraction=0.25)
    compressed: list[int] = []
    compress = fmt.compress_diff

    def counted(diff, *args, **kwargs):
        compressed.append(diff.value_bytes)
        return compress(diff, *args, **kwargs)

    monkeypatch.setattr(fmt, "compress_diff", counted)
    state = tiny_state()
    writer.publish(state)
    states = [step(state, seed=1, fraction=0.01), step(state, seed=2, fraction=0.4)]
    states.append(step(states[-1], seed=3, fraction=0.9))
    sparse, half, dense = (writer.publish(s) for s in states)
    assert sparse.manifest.kind == "delta"
    assert sparse.manifest.total_bytes < 0.05 * fmt.dense_bytes(state)
    # 40% of the values changed: compressed, over a quarter of a base, so a base
    assert half.manifest.kind == "base" and len(compressed) == 2
    # 90%: over twice the limit in values alone, a base without compressing it
    assert dense.manifest.kind == "base" and len(compressed) == 2
    for result, published in zip((half, dense), states[1:], strict=True):
        assert result.manifest.checksums == fmt.state_checksums(fmt.split_aliases(published)[0])
    assert same_bits(WeightFollower(store_for(s3_config, store.run)).sync().state, states[-1])


def test_layout_change_publishes_a_base(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    writer = DeltaWriter(store)
    state = tiny_state()
    writer.publish(state)
    grown = {**state, "extra.bias": fmt.bits(state["layers.0.norm.weight"]).float()}
    result = writer.publish(grown)
    assert result.manifest.kind == "base"
    follower = WeightFollower(store_for(s3_config, store.run))
    assert same_bits(follower.sync().state, grown)


# --- claiming a version -------------------------------------------------------------------


def race(writers: list[DeltaWriter], states: list[dict], version: int) -> list[object]:
    """Both writers publish ``version`` at the same moment; results or errors, in order."""
    barrier = threading.Barrier(len(writers))
    outcomes: list[object] = [None] * len(writers)

    def publish(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = writers[i].publish(states[i], version=version)
        except VersionTaken as err:
            outcomes[i] = err

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(writers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_two_writers_racing_for_a_version_exactly_one_wins(s3_config: S3Config) -> None:
    run = "race"
    for version in range(6):
        writers = [DeltaWriter(store_for(s3_config, run)) for _ in range(2)]
        states = [tiny_state(seed=10 * version + i) for i in range(2)]
        outcomes = race(writers, states, version)
        losers = [o for o in outcomes if isinstance(o, VersionTaken)]
        assert len(losers) == 1, outcomes
        winner = next(i for i, o in enumerate(outcomes) if not isinstance(o, VersionTaken))
        assert "already published" in str(losers[0]) and f"version {version}" in str(losers[0])
        store = store_for(s3_config, run)
        # Only the winner's file and manifest remain; readers get the winner's weights.
        names = sorted(o.name for o in store.objects(version=version))
        assert len(names) == 2 and MANIFEST_NAME in names
        snapshot = WeightFollower(store).sync(version)
        assert same_bits(snapshot.state, states[winner])


def test_race_loser_continues_with_a_base(s3_config: S3Config) -> None:
    run = "loser"
    a, b = DeltaWriter(store_for(s3_config, run)), DeltaWriter(store_for(s3_config, run))
    state = tiny_state()
    a.publish(state, version=0)
    b.publish(state, version=1)  # b's first version: a base
    with pytest.raises(VersionTaken):
        a.publish(step(state, seed=3), version=1)
    mine = step(state, seed=4)
    assert a.publish(mine, version=2).manifest.kind == "base"
    follower = WeightFollower(store_for(s3_config, run))
    assert same_bits(follower.sync(2).state, mine)


# --- refusals: the follower keeps its version -----------------------------------------------


@pytest.fixture()
def published(s3_config: S3Config) -> tuple[WeightStore, list[dict], WeightFollower]:
    """v0 base and v1..v3 deltas published; a follower that holds v0."""
    store = store_for(s3_config)
    states = publish_chain(DeltaWriter(store, base_every=10), 4)
    follower = WeightFollower(store_for(s3_config, store.run))
    follower.sync(0)
    return store, states, follower


def expect_refusal(
    follower: WeightFollower, reason: RefusalReason, target: int | None = None, **kwargs: object
) -> None:
    held = follower.snapshot
    before = refusals(follower, reason)
    with pytest.raises(VersionRefused) as err:
        follower.sync(target, **kwargs)  # type: ignore[arg-type]
    assert err.value.reason is reason, err.value
    assert follower.snapshot is held  # the old version is kept
    assert refusals(follower, reason) == before + 1


def test_refuses_a_bad_hash(published, caplog: pytest.LogCaptureFixture) -> None:
    store, _, follower = published
    key = data_key(store, 1)
    body = bytearray(store.get_bytes(key))
    body[len(body) // 2] ^= 0x01
    overwrite(store, key, bytes(body))
    with caplog.at_level(logging.WARNING, logger="weights.follower"):
        expect_refusal(follower, RefusalReason.BAD_HASH)
    line = next(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert "refused v3" in line and "bad_hash" in line and "keeping v0" in line
    assert follower.version == 0


def test_refuses_a_truncated_file(published) -> None:
    store, _, follower = published
    key = data_key(store, 2)
    overwrite(store, key, store.get_bytes(key)[:-7])
    expect_refusal(follower, RefusalReason.TRUNCATED)


def test_refuses_a_missing_file(published) -> None:
    store, _, follower = published
    store.delete([data_key(store, 3)])
    expect_refusal(follower, RefusalReason.MISSING_FILE)


def test_refuses_a_missing_parent(published) -> None:
    store, _, follower = published
    store.delete_version(2)
    expect_refusal(follower, RefusalReason.MISSING_PARENT, 3)
    assert follower.sync(1).version == 1  # what is intact is still reachable


def test_refuses_an_unknown_format_version(published) -> None:
    store, _, follower = published
    manifest = orjson.loads(store.read_manifest(1))
    manifest["format"] = 99
    overwrite(store, store.manifest_key(1), orjson.dumps(manifest))
    expect_refusal(follower, RefusalReason.UNKNOWN_FORMAT, 1)


def test_refuses_a_garbled_manifest(published) -> None:
    store, _, follower = published
    overwrite(store, store.manifest_key(1), b'{"format": 1, "run": ')
    expect_refusal(follower, RefusalReason.BAD_MANIFEST, 1)


def test_refuses_a_manifest_that_differs_from_its_announcement(published) -> None:
    _, _, follower = published
    expect_refusal(follower, RefusalReason.BAD_HASH, 1, manifest_sha256="0" * 64)


def test_refuses_a_consistent_forgery_by_tensor_checksums(published) -> None:
    """Someone replaces a delta *and* fixes the manifest's hash: only the checksums of
    the rebuilt tensors (or a signature) can notice."""
    store, states, follower = published
    forged = fmt.encode_delta(
        fmt.split_aliases(states[0])[0], fmt.split_aliases(step(states[0], 99))[0]
    )
    manifest = orjson.loads(store.read_manifest(1))
    entry = manifest["files"][0]
    entry.update(
        bytes=len(forged.blob),
        sha256=hashlib.sha256(forged.blob).hexdigest(),
        raw_bytes=forged.raw_bytes,
    )
    overwrite(store, store.key(1, entry["name"]), forged.blob)
    overwrite(store, store.manifest_key(1), orjson.dumps(manifest))
    expect_refusal(follower, RefusalReason.STATE_MISMATCH, 1)


def test_refuses_a_corrupt_payload_with_matching_hash(published) -> None:
    store, _, follower = published
    junk = b"\x28\xb5\x2f\xfd" + b"not a zstd frame at all"
    manifest = orjson.loads(store.read_manifest(1))
    entry = manifest["files"][0]
    entry.update(bytes=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    overwrite(store, store.key(1, entry["name"]), junk)
    overwrite(store, store.manifest_key(1), orjson.dumps(manifest))
    expect_refusal(follower, RefusalReason.CORRUPT, 1)


def test_refusal_is_retried_until_the_store_is_repaired(published) -> None:
    store, states, follower = published
    follower.retry_max_s = 0.3
    key = data_key(store, 1)
    good = store.get_bytes(key)
    overwrite(store, key, good[:-1])
    stop = threading.Event()
    thread = threading.Thread(
        target=follower.follow, args=(stop,), kwargs={"poll_interval_s": 0.1}, daemon=True
    )
    thread.start()
    try:
        wait_for(lambda: refusals(follower, RefusalReason.TRUNCATED) >= 3, what="retries")
        assert follower.version == 0
        overwrite(store, key, good)
        wait_for(lambda: follower.version == 3, what="the follower to catch up")
        assert same_bits(follower.snapshot.state, states[3])
    finally:
        stop.set()
        thread.join(10)


# --- signatures ----------------------------------------------------------------------------


def test_signed_versions(s3_config: S3Config, tmp_path: Path) -> None:
    generate_keypair(tmp_path / "trainer", tmp_path / "trainer.pub")
    generate_keypair(tmp_path / "intruder", tmp_path / "intruder.pub")
    public = load_public_key(tmp_path / "trainer.pub")
    run = "signed"
    trainer = DeltaWriter(
        store_for(s3_config, run), signing_key=load_private_key(tmp_path / "trainer")
    )
    state = tiny_state()
    trainer.publish(state)
    follower = WeightFollower(store_for(s3_config, run), public_key=public)
    assert follower.sync().version == 0

    # An intruder with write access publishes unsigned, then self-signed versions.
    unsigned = DeltaWriter(store_for(s3_config, run))
    unsigned.publish(step(state, 1), version=1)
    expect_refusal(follower, RefusalReason.UNSIGNED, 1)
    intruder = DeltaWriter(
        store_for(s3_config, run), signing_key=load_private_key(tmp_path / "intruder")
    )
    intruder.publish(step(state, 2), version=2)
    expect_refusal(follower, RefusalReason.BAD_SIGNATURE, 2)

    # Tampering with a signed manifest (here: pointing it at other bytes) breaks the signature.
    good = trainer.publish(step(state, 3), version=3)
    tampered = orjson.loads(good.manifest.to_bytes())
    tampered["checksums"]["embed.weight"] ^= 1
    store = store_for(s3_config, run)
    overwrite(store, store.manifest_key(3), orjson.dumps(tampered))
    expect_refusal(follower, RefusalReason.BAD_SIGNATURE, 3)
    assert follower.version == 0

    # Without a key configured the same follower code accepts whatever verifies by hash.
    assert WeightFollower(store_for(s3_config, run)).sync(2).version == 2


# --- announcements on Kafka ----------------------------------------------------------------


def test_follower_learns_versions_from_kafka(
    s3_config: S3Config, kafka_config: KafkaConfig, unique_name
) -> None:
    topic = unique_name("policy.versions")
    ensure_topics(
        kafka_config.client_config(),
        [TopicSpec(topic, partitions=1, cleanup_policy="compact")],
    )
    store = store_for(s3_config)
    announcer = Announcer(kafka_config.client_config(), topic)
    writer = DeltaWriter(store, base_every=3, announcer=announcer)
    first = writer.publish(tiny_state())
    assert first.announcement.version == 0 and first.announcement.parent is None

    follower = WeightFollower(store_for(s3_config, store.run))
    listener = AnnouncementListener(kafka_config.client_config(), store.run, topic)
    stop = threading.Event()
    # Poll the store rarely: versions must arrive through the announcements.
    thread = threading.Thread(
        target=follower.follow,
        args=(stop,),
        kwargs={"listener": listener, "poll_interval_s": 60.0},
        daemon=True,
    )
    thread.start()
    try:
        wait_for(lambda: follower.version == 0, what="v0")
        state = tiny_state()
        for version in range(1, 5):
            state = step(state, seed=version)
            result = writer.publish(state)
            wait_for(lambda v=version: follower.version == v, what=f"v{version}")
            assert same_bits(follower.snapshot.state, state)
            ann = result.announcement
            assert (ann.run, ann.version, ann.parent, ann.base) == (
                store.run,
                version,
                result.manifest.parent,
                result.manifest.base,
            )
            assert ann.uri == store.uri(store.manifest_key(version))
            assert ann.sha256 == hashlib.sha256(store.read_manifest(version)).hexdigest()
    finally:
        stop.set()
        thread.join(70)
        listener.close()
        announcer.close()

    # The topic is keyed by run: a late listener finds the run's announcements.
    late = AnnouncementListener(kafka_config.client_config(), store.run, topic)
    try:
        newest: VersionAnnouncement | None = None
        for _ in range(20):
            found = late.next(timeout_s=1.0)
            newest = found or newest
            if newest is not None and newest.version == 4:
                break
        assert newest is not None and newest.version == 4
    finally:
        late.close()


def test_a_restarted_writer_continues_numbering_with_a_base(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    states = publish_chain(DeltaWriter(store), 3)
    restarted = DeltaWriter(store_for(s3_config, store.run))
    nxt = step(states[-1], seed=7)
    result = restarted.publish(nxt)
    assert (result.manifest.version, result.manifest.kind) == (3, "base")
    follower = WeightFollower(store_for(s3_config, store.run))
    follower.sync(2)
    assert same_bits(follower.sync().state, nxt)
