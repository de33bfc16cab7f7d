"""The embedded services start with a chosen environment, not the parent's.

A canary secret set in the test's own environment (as an AWS key or a token would be)
must not reach the real ``weed mini`` or the real Kafka JVM: their
``/proc/<pid>/environ`` is read back, and each service still answers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import KafkaConfig
from infra.kafka import EmbeddedKafka
from infra.s3 import EMBEDDED_ACCESS_KEY, SeaweedServer, ensure_bucket
from weights.store import make_s3_client

pytestmark = pytest.mark.integration

CANARY = "ROLLSTREAM_TEST_CANARY_SECRET"


def environ_of(pid: int | None) -> dict[str, str]:
    assert pid is not None
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.fixture()
def canary(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "canary-value-that-must-not-leak"
    monkeypatch.setenv(CANARY, value)
    monkeypatch.setenv("AWS_SESSION_TOKEN", value)
    monkeypatch.setenv("WEED_JWT_SIGNING_KEY", "")  # would turn the store's JWT off
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    return value


def test_the_store_gets_no_variable_it_was_not_given(canary: str, tmp_path: Path) -> None:
    server = SeaweedServer(tmp_path / "s3")
    try:
        server.start()
        env = environ_of(server.process.pid())
        assert canary not in "".join(env.values())
        for name in (CANARY, "AWS_SESSION_TOKEN", "WEED_JWT_SIGNING_KEY"):
            assert name not in env
        assert env["AWS_ACCESS_KEY_ID"] == EMBEDDED_ACCESS_KEY
        assert env["GOMEMLIMIT"] == server.memory_limit
        assert env["LC_ALL"] == "C.UTF-8"
        assert "PATH" in env

        client = make_s3_client(server.config(bucket="env"))
        ensure_bucket(client, "env")
        client.put_object(Bucket="env", Key="k", Body=b"v")
        assert client.get_object(Bucket="env", Key="k")["Body"].read() == b"v"
    finally:
        server.stop()


def test_the_broker_gets_no_variable_it_was_not_given(
    canary: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache_dir: Path
) -> None:
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Drollstream.test=1")  # read by the JVM
    broker = EmbeddedKafka(KafkaConfig(), tmp_path / "kafka", cache_dir)
    try:
        broker.start()
        env = environ_of(broker.process.pid())
        assert canary not in "".join(env.values())
        assert CANARY not in env and "AWS_SESSION_TOKEN" not in env
        assert env["JAVA_TOOL_OPTIONS"] == "-Drollstream.test=1"
        assert broker.healthy()
    finally:
        broker.stop()
