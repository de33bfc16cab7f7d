"""Mirroring versions between two real SeaweedFS servers standing for two regions."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from support.paths import SUPPORT
from support.weight_states import UNSIGNED, same_bits, step, store_for, tiny_state, wait_for

from core.config import KafkaConfig, S3Config
from infra.topics import ensure_topics
from schemas.topics import TopicSpec
from weights.announce import AnnouncementListener, Announcer
from weights.errors import RefusalReason, VersionRefused
from weights.follower import WeightFollower
from weights.manifest import (
    MANIFEST_NAME,
    Manifest,
    generate_keypair,
    load_private_key,
    load_public_key,
)
from weights.mirror import mirror_forever, mirror_once, versions_to_copy
from weights.trust import Trust
from weights.writer import DeltaWriter


def test_mirror_copies_complete_versions_manifest_bytes_unchanged(
    s3_config: S3Config, second_s3_config: S3Config, tmp_path: Path
) -> None:
    generate_keypair(tmp_path / "k", tmp_path / "k.pub")
    run = "mirrored"
    src, dst = store_for(s3_config, run), store_for(second_s3_config, run)
    assert (src.region, dst.region) == ("region-a", "region-b")
    writer = DeltaWriter(src, base_every=3, signing_key=load_private_key(tmp_path / "k"))
    states = [tiny_state()]
    writer.publish(states[0])
    for i in range(1, 7):
        states.append(step(states[-1], seed=i))
        writer.publish(states[-1])

    trust = Trust(load_public_key(tmp_path / "k.pub"))
    report = mirror_once(src, dst, since=0, trust=trust)
    assert report.copied == list(range(7)) and not report.failed
    assert dst.versions() == src.versions()
    for version in range(7):
        assert dst.read_manifest(version) == src.read_manifest(version)
    assert mirror_once(src, dst, trust=trust).copied == []  # nothing new

    follower = WeightFollower(dst, public_key=load_public_key(tmp_path / "k.pub"))
    for version in (2, 6):
        assert same_bits(follower.sync(version).state, states[version])

    states.append(step(states[-1], seed=99))
    writer.publish(states[-1])
    assert versions_to_copy(src, dst, trust=trust) == [7]
    assert mirror_once(src, dst, trust=trust).copied == [7]
    assert same_bits(follower.sync().state, states[7])


def test_empty_region_starts_from_the_latest_base(
    s3_config: S3Config, second_s3_config: S3Config
) -> None:
    src, dst = store_for(s3_config, "late"), store_for(second_s3_config, "late")
    writer = DeltaWriter(src, base_every=4)
    state = tiny_state()
    for i in range(7):  # bases at 0 and 4
        state = step(state, seed=i)
        writer.publish(state)
    assert mirror_once(src, dst, trust=UNSIGNED).copied == [4, 5, 6]
    assert same_bits(WeightFollower(dst).sync().state, state)


def test_a_corrupt_source_version_is_not_mirrored(
    s3_config: S3Config, second_s3_config: S3Config
) -> None:
    src, dst = store_for(s3_config, "bad"), store_for(second_s3_config, "bad")
    writer = DeltaWriter(src, base_every=10)
    state = tiny_state()
    for i in range(3):
        state = step(state, seed=i)
        writer.publish(state)
    manifest = Manifest.from_bytes(src.read_manifest(1))
    key = src.key(1, manifest.files[0].name)
    src.client.put_object(Bucket=src.bucket, Key=key, Body=src.get_bytes(key)[:-3])

    report = mirror_once(src, dst, since=0, trust=UNSIGNED)
    assert report.copied == [0, 2]
    assert list(report.failed) == [1] and "does not match its manifest" in report.failed[1]
    # No manifest for v1 at the destination: readers there never see the damaged version.
    assert dst.versions() == [0, 2]
    assert MANIFEST_NAME not in {o.name for o in dst.objects(version=1)}
    follower = WeightFollower(dst)
    follower.sync(0)
    with pytest.raises(VersionRefused) as err:
        follower.sync(2)
    assert err.value.reason is RefusalReason.MISSING_PARENT


def test_follower_in_second_region_follows_kafka_and_mirror(
    s3_config: S3Config, second_s3_config: S3Config, kafka_config: KafkaConfig, unique_name
) -> None:
    """The full path: trainer in region A announces, a mirror copies, a follower in
    region B applies (it may hear the announcement before the files arrive)."""
    topic = unique_name("policy.versions")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 1, cleanup_policy="compact")])
    run = "two-regions"
    src, dst = store_for(s3_config, run), store_for(second_s3_config, run)
    announcer = Announcer(kafka_config.client_config(), topic)
    writer = DeltaWriter(src, base_every=5, announcer=announcer)
    follower = WeightFollower(dst, retry_max_s=0.5)
    listener = AnnouncementListener(kafka_config.client_config(), run, topic)
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=mirror_forever,
            args=(src, dst, stop, 0.2),
            kwargs={"trust": UNSIGNED},
            daemon=True,
        ),
        threading.Thread(
            target=follower.follow,
            args=(stop,),
            kwargs={"listener": listener, "poll_interval_s": 5.0},
            daemon=True,
        ),
    ]
    for thread in threads:
        thread.start()
    try:
        state = tiny_state()
        for version in range(7):
            state = step(state, seed=version)
            writer.publish(state)
            wait_for(lambda v=version: follower.version == v, what=f"v{version} in region B")
            assert same_bits(follower.snapshot.state, state)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        listener.close()
        announcer.close()


def _crash(what: str, configs: Path, run: str, version: int) -> None:
    """Run ``support/weights_crash.py``, which must die by SIGKILL where it was told."""
    script = SUPPORT / "weights_crash.py"
    done = subprocess.run(
        [sys.executable, str(script), what, str(configs), run, str(version)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


def test_a_mirror_or_follower_killed_mid_version_never_serves_half_of_it(
    s3_config: S3Config, second_s3_config: S3Config, tmp_path: Path
) -> None:
    """kill -9 of the mirror once every file of v2 is in region B but before its manifest:
    B lists v0 and v1 only, a reader there gets v1 whole, and the next mirror copies v2
    and v3 over the files left behind. kill -9 of a follower as it hands v3 over leaves
    nothing behind either: a fresh one rebuilds v3 bit for bit."""
    run = f"crash-{uuid.uuid4().hex[:6]}"
    src, dst = store_for(s3_config, run), store_for(second_s3_config, run)
    writer = DeltaWriter(src, base_every=10)
    states = [tiny_state()]
    for i in range(4):  # v0 the base, v1..v3 deltas
        if i:
            states.append(step(states[-1], seed=i))
        writer.publish(states[-1])
    configs = tmp_path / "configs.json"
    configs.write_text(
        json.dumps({"a": s3_config.file_table(), "b": second_s3_config.file_table()})
    )

    _crash("mirror", configs, run, 2)
    assert dst.versions() == [0, 1]
    left_behind = {o.name for o in dst.objects() if o.version == 2}
    assert left_behind and MANIFEST_NAME not in left_behind  # files, no manifest
    assert same_bits(WeightFollower(dst).sync().state, states[1])

    assert mirror_once(src, dst, trust=UNSIGNED).copied == [2, 3]
    _crash("follow", configs, run, 3)
    assert same_bits(WeightFollower(dst).sync().state, states[3])
