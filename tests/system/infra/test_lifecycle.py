"""``rollstream infra up|status|down`` on real processes, and external (non-embedded) mode."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from core.config import KafkaConfig, S3Config
from core.process import free_port, pid_alive, port_open
from infra.services import Services
from rollstream.config.settings import RollstreamConfig, load_config
from weights.store import make_s3_client
from weights.trust import Trust


def _cli(
    state_dir: Path, *args: str, config: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "KAFKA_"))}
    env.pop("AWS_ENDPOINT_URL", None)
    env.pop("AWS_ENDPOINT_URL_S3", None)
    options = ["--config", str(config)] if config else []
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollstream",
            *options,
            "--state-dir",
            str(state_dir),
            "infra",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )


def _pids(state_dir: Path) -> list[int]:
    return [int(p.read_text().split('"pid":')[1].split(",")[0]) for p in state_dir.rglob("*.pid")]


@pytest.mark.system
def test_up_status_down_up_keeps_data(tmp_path: Path) -> None:
    state = tmp_path / "state"
    started = time.monotonic()
    up = _cli(state, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    assert time.monotonic() - started < 60, "infra up must be ready within a minute"
    assert "topics created: rollouts.raw" in up.stdout

    status = _cli(state, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    lines = status.stdout.splitlines()
    assert any(
        line.startswith("kafka") and "healthy" in line and "127.0.0.1:" in line for line in lines
    )
    assert any(
        line.startswith("s3") and "healthy" in line and "http://127.0.0.1:" in line
        for line in lines
    )

    config = Services(load_config(state_dir=state)).resolved()
    # up made the state dir's weight key pair and the store's secret, owner-only
    assert config.weights.signing_key == state / "keys" / "weights-signing.pem"
    assert config.weights.public_key == state / "keys" / "weights-public.pem"
    for private in (config.weights.signing_key, state / "s3" / "s3-secret"):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    assert Trust.from_config(config.weights).public_key is not None
    pids = _pids(state)
    assert len(pids) == 2
    broker_port = int(config.kafka.bootstrap_servers.rsplit(":", 1)[1])

    # Write something to both stores.
    key = uuid.uuid4().hex
    producer = Producer(config.kafka.client_config())
    producer.produce("rollouts.dlq", key=key, value=b"kept across restarts")
    assert producer.flush(30) == 0
    del producer  # no client may outlive the broker (it would log reconnect attempts)
    s3 = make_s3_client(config.s3)
    s3.put_object(Bucket=config.s3.bucket, Key=f"probe/{key}", Body=b"also kept")

    down = _cli(state, "down")
    assert down.returncode == 0 and "stopped: kafka, s3" in down.stdout
    for pid in pids:
        assert not pid_alive(pid), f"process {pid} left running"
    assert not port_open(broker_port)
    after = _cli(state, "status")
    assert after.returncode == 1 and after.stdout.count("not running") == 2
    assert "nothing was running" in _cli(state, "down").stdout

    again = _cli(state, "up")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "topics present: rollouts.raw" in again.stdout
    try:
        # Same addresses as before: ports are kept with the data.
        assert Services(load_config(state_dir=state)).resolved() == config
        body = s3.get_object(Bucket=config.s3.bucket, Key=f"probe/{key}")["Body"].read()
        assert body == b"also kept"
        consumer = Consumer(
            config.kafka.client_config()
            | {"group.id": key, "auto.offset.reset": "earliest", "enable.auto.commit": "false"}
        )
        consumer.subscribe(["rollouts.dlq"])
        seen: list[bytes] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not seen:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None and msg.key() == key.encode():
                seen.append(msg.value())
        consumer.close()
        assert seen == [b"kept across restarts"]
    finally:
        final = _cli(state, "down")
    assert final.returncode == 0
    for pid in _pids(state) + pids:
        assert not pid_alive(pid)


def test_external_services_are_used_not_started(
    tmp_path: Path, kafka_config: KafkaConfig, s3_config: S3Config
) -> None:
    config = RollstreamConfig(
        state_dir=tmp_path / "state",
        kafka=kafka_config,
        s3=s3_config.model_copy(
            update={"embedded": False, "bucket": f"ext-{uuid.uuid4().hex[:8]}"}
        ),
    )
    services = Services(config)
    assert services.kafka is None and services.s3 is None
    report = services.up()
    assert report.bootstrap_servers == kafka_config.bootstrap_servers
    assert report.s3_endpoint == s3_config.endpoint_url
    # nothing embedded is started: the state dir holds only the weight key pair
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["keys"]
    # The bucket was created on the external store, the topics on the external cluster.
    make_s3_client(config.s3).head_bucket(Bucket=config.s3.bucket)
    assert set(report.topics.created) | set(report.topics.existing) >= {"rollouts.raw"}
    assert [s.healthy for s in services.status()] == [True, True]
    assert services.down() == []


def test_infra_up_against_an_external_broker_that_is_not_there_says_so(tmp_path: Path) -> None:
    config = tmp_path / "external.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "127.0.0.1:{free_port()}"\n')
    started = time.monotonic()
    result = _cli(tmp_path / "state", "up", config=config)
    assert result.returncode != 0
    assert "configured as external" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


def test_unreachable_external_cluster_is_reported(tmp_path: Path) -> None:
    config = RollstreamConfig(
        state_dir=tmp_path,
        kafka=KafkaConfig(bootstrap_servers="127.0.0.1:1"),
        s3=S3Config(
            endpoint_url="http://127.0.0.1:1",
            embedded=False,
            access_key_id="x",
            secret_access_key="y",
        ),  # type: ignore[arg-type]
    )
    statuses = Services(config).status()
    assert [s.healthy for s in statuses] == [False, False]
    assert all("unreachable" in s.detail for s in statuses)


@pytest.mark.integration
def test_a_regions_store_alone(tmp_path: Path) -> None:
    """``infra up --s3-only`` starts a region's store in its own state dir: no broker, no
    topics; the store keeps a bucket its followers can read."""
    state = tmp_path / "eu"
    up = _cli(state, "up", "--s3-only")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "kafka" not in up.stdout and "s3     http://127.0.0.1:" in up.stdout
        assert not (state / "kafka").exists()
        config = load_config(None, state_dir=str(state))
        store = Services(config, s3_only=True).resolved().s3
        make_s3_client(store).head_bucket(Bucket=store.bucket)
    finally:
        down = _cli(state, "down")
    assert down.stdout.strip() == "stopped: s3"
    assert not [pid for pid in _pids(state) if pid_alive(pid)]


@pytest.mark.integration
def test_the_last_run_to_end_stops_the_services_a_run_started(
    tmp_path: Path, kafka_config: KafkaConfig
) -> None:
    """Two ``up`` runs on one state dir: the first starts the embedded store, the second
    finds it running; the first to end leaves it to the second, which stops it. A user
    file of a process gone, or unreadable, keeps nothing running; after ``infra up`` the
    services are the user's, and no run's end stops them. (The broker here is the
    session's, external: the store alone is embedded, the same rule for both.)"""
    from infra.service_users import ServiceUsers

    state = tmp_path / "state"
    config = RollstreamConfig(state_dir=state, kafka=kafka_config, s3=S3Config(port=free_port()))
    first = Services(config)
    second = Services(config)
    other_run = subprocess.Popen(["sleep", "120"])  # the second run's process
    try:
        second.users = ServiceUsers(state, pid=other_run.pid)
        assert first.s3 is not None and not first.s3.running()
        first.up_for_run("first", topics=[])
        second.up_for_run("second", topics=[])
        assert first.release_run() == ["second"]
        assert first.s3.running()  # still the second run's
        assert second.release_run() == []
        assert not first.s3.running()

        first.up_for_run("first", topics=[])
        (state / "users" / "up-999999999.json").write_text('{"run_id": "gone", "pid": 999999999}')
        (state / "users" / "up-7.json").write_text("not json")
        assert first.release_run() == []
        assert not first.s3.running()
        assert sorted(p.name for p in (state / "users").iterdir()) == [".lock"]

        first.up_for_run("first", topics=[])
        Services(config).keep_running()  # `rollstream infra up` meanwhile
        assert first.release_run() == []
        assert first.s3.running()
    finally:
        other_run.kill()
        Services(config).down()
