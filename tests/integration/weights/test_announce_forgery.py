"""What a forger who can produce to ``policy.versions`` and write the bucket (but holds no
signing key) can still do to the readers of announcements, tried on the real broker and
the real SeaweedFS stores: replay an announcement with a forged pace (the producers'
credit is unmoved), park a version that never gets a manifest (a later genuine one is
still delivered), and leave forged manifests in the bucket (each is read and warned
about once, not on every poll).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer
from support.weight_states import forge, forged_announcement, keypair, step, store_for, tiny_state

from core.config import KafkaConfig, S3Config
from infra.topics import ensure_topics
from producers.rollout.credit import AdmissionCredit
from producers.rollout.versions import WatchedListener
from schemas.control import MAX_PRODUCERS, VersionAnnouncement
from schemas.topics import TopicSpec
from weights.announce import AnnouncementListener, Announcer
from weights.follower import WeightFollower
from weights.manifest import MAX_MANIFEST_BYTES, load_private_key, load_public_key
from weights.mirror import mirror_once
from weights.trust import Trust
from weights.writer import DeltaWriter

HUGE = 9_999_999_999  # a version far beyond any run's

GROUPS_PER_STEP = 4
WINDOW = 2


def versions_topic(kafka_config: KafkaConfig, unique_name: Callable[[str], str]) -> str:
    topic = unique_name("policy.versions")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 1, cleanup_policy="compact")])
    return topic


def read_until(
    listener: AnnouncementListener | WatchedListener,
    done: Callable[[VersionAnnouncement | None], bool],
    timeout_s: float = 30,
) -> VersionAnnouncement | None:
    """``next`` until ``done`` says so of what it returned; the last of those returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = listener.next(0.2)
        if done(found):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"listener: condition not met in {timeout_s}s (last {found})")


def groups_before_pause(trainer: VersionAnnouncement | None, limit: int = 1000) -> int:
    """How many groups a fresh producer starts on ``trainer``'s announcement before its
    credit pauses it (its engine at the trainer's version)."""
    credit = AdmissionCredit()
    version = trainer.version if trainer is not None else 0
    for started in range(limit):
        if credit.pause(trainer, WINDOW, version) is not None:
            return started
        credit.started()
    return limit


def test_a_replayed_announcement_with_a_forged_pace_does_not_change_the_credit(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    tmp_path: Path,
    unique_name: Callable[[str], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    private, public = keypair(tmp_path)
    keypair(tmp_path, "stranger")
    topic = versions_topic(kafka_config, unique_name)
    client = kafka_config.client_config()
    store = store_for(s3_config)
    key = load_private_key(private)
    announcer = Announcer(
        client, topic, groups_per_step=GROUPS_PER_STEP, max_staleness=WINDOW, signing_key=key
    )
    announcer.producers = 1
    writer = DeltaWriter(store, signing_key=key, announcer=announcer)
    state = tiny_state()
    writer.publish(state, 0)
    trust = Trust(load_public_key(public))
    watched = WatchedListener(
        AnnouncementListener(
            client, store.run, topic, confirm=trust.announcement_check(store), vouch=trust.vouched
        )
    )
    forger = Producer(client)
    try:
        genuine = read_until(watched, lambda found: found is not None)
        assert genuine is not None and genuine.producers == 1
        assert genuine.signature is not None
        assert groups_before_pause(watched.latest) == (WINDOW + 1) * GROUPS_PER_STEP

        # The current announcement replayed: with an absurd pace (refused by the schema),
        # with the most producers the schema lets through, unsigned and with the genuine
        # signature left on; and an honest-looking pace a stranger signed.
        absurd = orjson.loads(genuine.to_json()) | {"producers": 10**9}
        bounded = dataclasses.replace(
            genuine, groups_per_step=1, max_staleness=MAX_PRODUCERS, producers=MAX_PRODUCERS
        )
        stranger = Announcer(client, topic, signing_key=load_private_key(tmp_path / "stranger"))
        for value in (
            orjson.dumps(absurd),
            dataclasses.replace(bounded, signature=None).to_json(),
            bounded.to_json(),
        ):
            forger.produce(topic, key=store.run.encode(), value=value)
        forger.flush(30)
        stranger.announce(bounded)
        stranger.close()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            watched.next(0.2)
        assert watched.latest == genuine
        assert groups_before_pause(watched.latest) == (WINDOW + 1) * GROUPS_PER_STEP

        # The trainer's next version carries its pace as before.
        announcer.producers = 2
        writer.publish(step(state, seed=1), 1)
        newer = read_until(watched, lambda found: found is not None and found.version == 1)
        assert newer is not None and newer.producers == 2 and watched.latest == newer
        assert groups_before_pause(watched.latest) == (WINDOW + 1) * GROUPS_PER_STEP // 2

        # A genuine version announced first by someone else (a forger racing the trainer,
        # or a trainer without the key), with a pace of their own: the version counts, its
        # pace is not believed (said once), and the pace last believed stays.
        quiet = DeltaWriter(store, signing_key=key)  # publishes without announcing
        published = quiet.publish(step(state, seed=2), 2).announcement
        racer = Announcer(client, topic, groups_per_step=1, max_staleness=MAX_PRODUCERS)
        racer.producers = MAX_PRODUCERS
        with caplog.at_level(logging.WARNING, logger="weights.trust"):
            racer.announce(published)
            raced = read_until(watched, lambda found: found is not None and found.version == 2)
        racer.close()
        assert raced is not None and raced.producers is None
        assert "ignoring the pace announced with v2" in caplog.text
        assert watched.latest is not None and watched.latest.version == 2
        assert watched.latest.producers == 2
        assert groups_before_pause(watched.latest) == (WINDOW + 1) * GROUPS_PER_STEP // 2
    finally:
        watched.close()
        announcer.close()


def test_a_forged_pace_is_bounded_where_announcements_are_not_signed() -> None:
    """A run that allows unsigned versions believes any pace; the schema and the credit
    still keep it from stopping a producer for more than a window."""
    base = forged_announcement("r", 3)
    for pace in (
        {"groups_per_step": 4, "producers": 10**9},
        {"groups_per_step": 1, "max_staleness": 1, "producers": 3},  # more than 2 steps hold
        {"groups_per_step": 10**9},
        {"max_staleness": 10**9},
    ):
        with pytest.raises(ValueError):
            dataclasses.replace(base, **pace)
    forged = dataclasses.replace(
        base, groups_per_step=1, max_staleness=MAX_PRODUCERS, producers=MAX_PRODUCERS
    )
    credit = AdmissionCredit()
    assert credit.pause(forged, WINDOW, 3) is None
    credit.started()
    assert credit.lead == WINDOW + 1  # not MAX_PRODUCERS steps
    later = 3 + WINDOW + 1
    genuine = dataclasses.replace(base, version=later, base=later, groups_per_step=GROUPS_PER_STEP)
    assert credit.pause(genuine, WINDOW, genuine.version) is None  # free again a window on


def test_a_forged_announcement_without_a_manifest_does_not_hide_later_genuine_ones(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    second_s3_config: S3Config,
    tmp_path: Path,
    unique_name: Callable[[str], str],
) -> None:
    """A mirrored region: announcements arrive before the mirror copies the manifests."""
    private, public = keypair(tmp_path)
    topic = versions_topic(kafka_config, unique_name)
    client = kafka_config.client_config()
    src = store_for(s3_config)
    dst = store_for(second_s3_config, src.run)
    trust = Trust(load_public_key(public))
    announcer = Announcer(client, topic)
    writer = DeltaWriter(src, signing_key=load_private_key(private), announcer=announcer)
    state = tiny_state()
    writer.publish(state, 0)
    mirror_once(src, dst, trust=trust)
    listener = AnnouncementListener(client, src.run, topic, confirm=trust.announcement_check(dst))
    try:
        first = read_until(listener, lambda found: found is not None)
        assert first is not None and first.version == 0
        announcer.announce(forged_announcement(src.run, HUGE))  # its manifest never comes
        for version in (1, 2):
            state = step(state, seed=version)
            writer.publish(state, version)  # announced; the mirror has not copied it yet
            assert read_until(listener, lambda found: True, 2) is None
            time.sleep(1)
            assert listener.next(0.5) is None
            mirror_once(src, dst, trust=trust)
            delivered = read_until(listener, lambda found: found is not None)
            assert delivered is not None and delivered.version == version
    finally:
        listener.close()
        announcer.close()


def test_a_forged_manifest_is_read_and_logged_once_across_polls(
    s3_config: S3Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    private, public = keypair(tmp_path)
    stranger, _ = keypair(tmp_path, "stranger")
    store = store_for(s3_config)
    writer = DeltaWriter(store, signing_key=load_private_key(private))
    state = tiny_state()
    writer.publish(state, 0)
    forge(store, 1, like=0)  # unsigned
    forge(store, 2, like=0, signer=stranger)
    forge(store, HUGE, like=0)
    oversized = store.manifest_key(5)
    store.client.put_object(
        Bucket=store.bucket, Key=oversized, Body=b"x" * (MAX_MANIFEST_BYTES + 1)
    )

    reader = store_for(s3_config, store.run)
    reads: list[int] = []
    read_manifest = reader.read_manifest

    def counted(version: int) -> bytes:
        reads.append(version)
        return read_manifest(version)

    reader.read_manifest = counted  # type: ignore[method-assign]
    follower = WeightFollower(reader, public_key=load_public_key(public))
    assert follower.sync(0).version == 0
    reads.clear()
    with caplog.at_level(logging.WARNING, logger="weights.trust"):
        for _ in range(20):
            assert follower.sync().version == 0
    assert sorted(reads) == [1, 2, HUGE]  # v5 is refused by its listed size, unread
    refusals = [r for r in caplog.records if "ignoring v" in r.getMessage()]
    assert len(refusals) == 4, [r.getMessage() for r in refusals]

    # Rewritten, a forged manifest is read (and refused) once more.
    store.client.put_object(Bucket=store.bucket, Key=store.manifest_key(1), Body=b"{}")
    reads.clear()
    for _ in range(5):
        assert follower.sync().version == 0
    assert reads == [1]

    writer.publish(step(state, seed=3), 3)  # a genuine version is still taken at once
    assert follower.sync().version == 3
