"""Who may change the policy: forged weights and forged announcements are refused.

Every path an attacker on the host has to the bucket is tried against real SeaweedFS
(S3 with the old public secret, the filer's HTTP port, forged manifests written with
the real credentials: unsigned, wrongly signed, a huge version number), and a forged
announcement against the real broker. Each is refused, and whoever reads keeps its last
genuine version.
"""

from __future__ import annotations

import dataclasses
import stat
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from botocore.exceptions import ClientError
from pydantic import SecretStr
from support.weight_states import (
    forge,
    forged_announcement,
    keypair,
    same_bits,
    step,
    store_for,
    tiny_state,
)

from consumers.config import PublishConfig
from consumers.weight_publisher import Publisher
from core.config import (
    ConfigurationError,
    KafkaConfig,
    RetryConfig,
    S3Config,
    SharedConfig,
    WeightsConfig,
)
from infra.s3 import SECRET_FILE, SECURITY_FILE, SeaweedServer, ensure_bucket
from infra.topics import ensure_topics
from producers.rollout.versions import start_follower
from schemas.topics import TopicSpec
from streams.snapshots import FollowerSource, VersionUnavailable
from streams.staleness import VersionTracker
from streams.versions import VersionReader, VersionVoucher
from weights.announce import Announcer
from weights.errors import RefusalReason, VersionRefused
from weights.follower import WeightFollower
from weights.manifest import (
    load_private_key,
    load_public_key,
    sha256_hex,
)
from weights.mirror import mirror_once
from weights.store import make_s3_client
from weights.trust import Trust
from weights.writer import DeltaWriter

HUGE = 9_999_999_999
OLD_PUBLIC_SECRET = "rollstream-embedded-secret"  # the fixed secret every install shared


def test_the_embedded_store_has_a_private_secret_and_no_unauthenticated_write_path(
    tmp_path: Path,
) -> None:
    server = SeaweedServer(tmp_path / "s3")
    try:
        server.start()
        secret_file = tmp_path / "s3" / SECRET_FILE
        for private in (secret_file, tmp_path / "s3" / SECURITY_FILE):
            assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
        config = server.config(bucket="trusted")
        assert config.secret_access_key is not None
        assert config.secret_access_key.get_secret_value() != OLD_PUBLIC_SECRET
        client = make_s3_client(config)
        ensure_bucket(client, "trusted")
        client.put_object(Bucket="trusted", Key="weights/r/v0000000000/manifest.json", Body=b"1")

        stranger = make_s3_client(
            config.model_copy(update={"secret_access_key": SecretStr(OLD_PUBLIC_SECRET)})
        )
        with pytest.raises(ClientError):
            stranger.put_object(Bucket="trusted", Key="weights/r/v9/manifest.json", Body=b"x")

        filer = f"http://127.0.0.1:{server.ports()['filer.port']}/buckets/trusted/weights/r"
        for method, url, body in (
            ("PUT", f"{filer}/v0000000000/manifest.json", b'{"forged": 1}'),
            ("POST", f"{filer}/v9999999999/manifest.json", b'{"forged": 1}'),
            ("GET", f"{filer}/v0000000000/manifest.json", None),
            ("DELETE", f"{filer}/v0000000000/manifest.json", None),
        ):
            request = urllib.request.Request(url, data=body, method=method)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=5)
            assert refused.value.code == 401, (method, url)

        got = client.get_object(Bucket="trusted", Key="weights/r/v0000000000/manifest.json")
        assert got["Body"].read() == b"1"
        listed = client.list_objects_v2(Bucket="trusted", Prefix="weights/r/")["Contents"]
        assert [item["Key"] for item in listed] == ["weights/r/v0000000000/manifest.json"]
    finally:
        server.stop()


def test_followers_refuse_forged_versions_and_keep_the_last_genuine_one(
    s3_config: S3Config, tmp_path: Path
) -> None:
    private, public = keypair(tmp_path)
    stranger, _ = keypair(tmp_path, "stranger")
    store = store_for(s3_config)
    writer = DeltaWriter(store, signing_key=load_private_key(private))
    states = [tiny_state()]
    writer.publish(states[0], 0)
    states.append(step(states[0], seed=1))
    writer.publish(states[1], 1)

    forge(store, 2, like=1)  # unsigned
    forge(store, 3, like=1, signer=stranger)  # signed, by the wrong key
    forge(store, HUGE, like=1)  # a huge version number

    config = WeightsConfig(public_key=public)
    follower = WeightFollower.from_config(store_for(s3_config, store.run), config)
    assert same_bits(follower.sync(1).state, states[1])
    for version, reason in (
        (2, RefusalReason.UNSIGNED),
        (3, RefusalReason.BAD_SIGNATURE),
        (HUGE, RefusalReason.UNSIGNED),
    ):
        with pytest.raises(VersionRefused) as refused:
            follower.sync(version)
        assert refused.value.reason == reason
        assert follower.version == 1
    # Polling the store: the newest genuine version counts, the forged ones above it do not
    # stall the follower.
    assert follower.sync().version == 1
    writer.publish(step(states[1], seed=4), 4)
    assert follower.sync().version == 4

    # The stream's old-logit service rebuilds versions the same way, and refuses too.
    source = FollowerSource(
        store, make_follower=lambda s: WeightFollower.from_config(s, config), max_attempts=1
    )
    assert same_bits(source.load(1), states[1])
    for forged in (2, 3, HUGE):
        with pytest.raises(VersionUnavailable):
            source.load(forged)

    # No key and no explicit opt-out: a follower is not built at all.
    with pytest.raises(ConfigurationError, match=r"weights\.public_key is not set"):
        WeightFollower.from_config(store, WeightsConfig())
    unsigned_ok = WeightFollower.from_config(store, WeightsConfig(allow_unsigned=True))
    assert unsigned_ok.sync(2).version == 2  # opted out: the forged version is taken


def test_the_mirror_verifies_before_it_claims(
    s3_config: S3Config, second_s3_config: S3Config, tmp_path: Path
) -> None:
    private, public = keypair(tmp_path)
    run = f"mirror-{uuid.uuid4().hex[:6]}"
    src, dst = store_for(s3_config, run), store_for(second_s3_config, run)
    writer = DeltaWriter(src, signing_key=load_private_key(private))
    states = [tiny_state()]
    writer.publish(states[0], 0)
    states.append(step(states[0], seed=1))
    writer.publish(states[1], 1)
    forge(src, 2, like=1)  # a forged source version: never copied
    genuine_dst = DeltaWriter(dst, signing_key=load_private_key(private))
    genuine_dst.publish(states[0], 0)
    forge(dst, HUGE, like=0)  # a forged destination version: does not stop the mirror

    trust = Trust(load_public_key(public))
    report = mirror_once(src, dst, trust=trust)
    assert report.copied == [1] and list(report.failed) == [2], report
    assert 2 not in dst.versions()  # the forged version did not claim the number

    # The genuine v2 cannot be written at the source now (the number is taken there),
    # but the trainer's next version goes through and is mirrored.
    states.append(step(states[1], seed=2))
    writer.publish(states[2], 3)
    assert mirror_once(src, dst, trust=trust).copied == [3]
    follower = WeightFollower(dst, public_key=load_public_key(public))
    assert same_bits(follower.sync(3).state, states[2])


def test_the_publisher_ignores_a_forged_latest_version(s3_config: S3Config, tmp_path: Path) -> None:
    private, _ = keypair(tmp_path)
    store = store_for(s3_config)
    writer = DeltaWriter(store, signing_key=load_private_key(private))
    state = tiny_state()
    writer.publish(state, 0)
    forge(store, HUGE, like=0)
    assert store.latest() == HUGE

    restarted = Publisher(
        DeltaWriter(store_for(s3_config, store.run), signing_key=load_private_key(private)),
        PublishConfig(every=1),
        RetryConfig(initial_s=0.01, max_s=0.05),
    )
    assert restarted.resume(0, lambda: state) is None
    assert restarted.skip_through == 0
    assert restarted.due(1)
    restarted.publish(1, step(state, seed=1))
    assert Trust(load_private_key(private).public_key()).latest(store) == 1


# --- announcements -------------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def errors(reader: VersionReader, kind: str) -> float:
    value = reader.metrics.registry.get_sample_value(
        "rollstream_streams_version_read_errors_total", {"kind": kind}
    )
    return value or 0.0


@pytest.fixture()
def signed_run(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    tmp_path: Path,
    unique_name: Callable[[str], str],
) -> dict[str, Any]:
    """A run whose trainer signs: its store, writer, announcer, key and topic."""
    private, public = keypair(tmp_path)
    topic = unique_name("policy.versions")
    ensure_topics(kafka_config.client_config(), [TopicSpec(topic, 1, cleanup_policy="compact")])
    store = store_for(s3_config)
    announcer = Announcer(kafka_config.client_config(), topic)
    writer = DeltaWriter(store, signing_key=load_private_key(private), announcer=announcer)
    return {"store": store, "writer": writer, "announcer": announcer, "public": public,
            "topic": topic}  # fmt: skip


def test_a_forged_announcement_does_not_move_the_streams_clock(
    kafka_config: KafkaConfig, signed_run: dict[str, Any]
) -> None:
    store, writer, announcer = signed_run["store"], signed_run["writer"], signed_run["announcer"]
    state = tiny_state()
    writer.publish(state, 0)
    forge(store, 7, like=0)  # an unsigned manifest in the store does not help a forger
    tracker = VersionTracker()
    trust = Trust(load_public_key(signed_run["public"]))
    reader = VersionReader(
        kafka_config.client_config(),
        signed_run["topic"],
        store.run,
        tracker,
        retry=RetryConfig(initial_s=0.05, max_s=0.2),
        confirm=trust.announcement_check(store),
    )
    reader.start()
    try:
        assert tracker.wait_for(0, 60)
        announcer.announce(forged_announcement(store.run, 10**12))
        forged_7 = sha256_hex(store.read_manifest(7))
        announcer.announce(dataclasses.replace(forged_announcement(store.run, 7), sha256=forged_7))
        wait_until(lambda: errors(reader, "forged") >= 1, 30, "the forged announcements refused")
        time.sleep(1.0)
        assert tracker.version == 0
        assert reader.alive() and reader.caught_up.is_set()

        writer.publish(step(state, seed=1), 1)  # genuine: announced by the writer
        assert tracker.wait_for(1, 30)
        assert tracker.version == 1
    finally:
        reader.stop()
        announcer.close()


def test_a_forged_announcement_does_not_move_the_producers_version(
    kafka_config: KafkaConfig, s3_config: S3Config, signed_run: dict[str, Any]
) -> None:
    store, writer, announcer = signed_run["store"], signed_run["writer"], signed_run["announcer"]
    state = tiny_state()
    writer.publish(state, 0)
    config = SharedConfig(
        run_id=store.run,
        kafka=kafka_config,
        s3=s3_config,
        weights=WeightsConfig(
            public_key=signed_run["public"], topic=signed_run["topic"], poll_interval_s=0.2
        ),
    )

    class Target:
        def __init__(self) -> None:
            self.versions: list[int] = []

        def submit_version(self, version: int, state_dict: Any) -> None:
            self.versions.append(version)

    target, stop = Target(), threading.Event()
    follower = start_follower(config, target, stop)
    try:
        wait_until(lambda: target.versions == [0], 60, "v0 applied")
        wait_until(lambda: follower.listener.newest == 0, 60, "v0 announced")
        announcer.announce(forged_announcement(store.run, 10**12))
        time.sleep(2.0)
        assert follower.listener.newest == 0 and target.versions == [0]
        assert follower.listener.latest is not None and follower.listener.latest.version == 0

        writer.publish(step(state, seed=1), 1)
        wait_until(lambda: follower.listener.newest == 1, 30, "v1 announced")
        wait_until(lambda: target.versions == [0, 1], 30, "v1 applied")
    finally:
        stop.set()
        follower.thread.join(30)
        follower.listener.close()
        announcer.close()


def test_unsigned_configs_must_say_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="allow_unsigned"):
        Trust.from_config(WeightsConfig())
    assert Trust.from_config(WeightsConfig(allow_unsigned=True)).public_key is None
    private, _ = keypair(tmp_path)
    signer_only = Trust.from_config(WeightsConfig(signing_key=private))
    assert signer_only.public_key is not None
    assert orjson.dumps(WeightsConfig().model_dump(mode="json"))  # the field is plain config


def test_the_stream_asks_the_store_about_unannounced_versions(
    s3_config: S3Config, tmp_path: Path
) -> None:
    """``VersionVoucher``: a genuine version (and every one before it) is vouched for; a
    forged or missing one is not, and is asked about again only after ``recheck_s``."""
    private, public = keypair(tmp_path)
    store = store_for(s3_config)
    writer = DeltaWriter(store, signing_key=load_private_key(private))
    states = [tiny_state()]
    for version in range(3):
        writer.publish(states[-1], version)
        states.append(step(states[-1], seed=version + 1))
    forge(store, 3, like=2)  # unsigned
    now = [0.0]
    voucher = VersionVoucher(
        lambda: store_for(s3_config, store.run),
        Trust(load_public_key(public)),
        clock=lambda: now[0],
    )
    assert voucher.vouches(2) and voucher.vouches(0)
    assert not voucher.vouches(3)  # forged
    assert not voucher.vouches(4)  # not published yet
    writer.publish(states[-1], 4)
    assert not voucher.vouches(4)  # asked too soon: the last answer stands
    now[0] += voucher.recheck_s
    assert voucher.vouches(4)
