"""A cluster behind SASL: the stream worker's Faust clients get the same credentials as
its confluent-kafka clients (``streams.faust.broker``).

A second real KRaft broker whose client listener requires SASL/PLAIN; a group produced
there comes out scored. Before ``streams.faust.broker`` the worker's Faust consumer spoke
PLAINTEXT to that listener and never got a record.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from support.streams import (
    WorkerProcess,
    create_stream_topics,
    keyed,
    produce,
    read_topic,
    stream_topics,
    synthetic,
    worker_config,
)

from core.config import KafkaConfig
from core.process import free_port
from infra.kafka import EmbeddedKafka, with_listener
from schemas.group import decode_group
from streams.faust.broker import broker_credentials, broker_urls

USER, PASSWORD = "alice", "alice-secret"


class SaslKafka(EmbeddedKafka):
    """The embedded broker plus a SASL_PLAINTEXT (PLAIN) listener for clients; the
    PLAINTEXT one stays for the controller link and the readiness check."""

    def __init__(self, config: KafkaConfig, data_dir: Path, cache_dir: Path) -> None:
        super().__init__(config, data_dir, cache_dir)
        self.sasl_port = free_port()

    def properties(self) -> dict[str, str]:
        props = with_listener(super().properties(), "SASL_PLAINTEXT", "127.0.0.1", self.sasl_port)
        props["sasl.enabled.mechanisms"] = "PLAIN"
        props["listener.name.sasl_plaintext.plain.sasl.jaas.config"] = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'user_{USER}="{PASSWORD}";'
        )
        return props


@pytest.fixture(scope="module")
def sasl_kafka(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[KafkaConfig]:
    broker = SaslKafka(KafkaConfig(), tmp_path_factory.mktemp("kafka-sasl"), cache_dir)
    try:
        broker.start()
        yield KafkaConfig(
            bootstrap_servers=f"127.0.0.1:{broker.sasl_port}",
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="PLAIN",
            sasl_username=USER,
            sasl_password=PASSWORD,  # type: ignore[arg-type]
        )
    finally:
        broker.stop()


def test_faust_credentials_follow_the_kafka_config() -> None:
    assert broker_credentials(KafkaConfig(bootstrap_servers="a:1")) is None
    assert broker_urls(KafkaConfig(bootstrap_servers="a:1, b:2")) == "kafka://a:1;kafka://b:2"
    scram = broker_credentials(
        KafkaConfig(
            bootstrap_servers="a:1",
            security_protocol="SASL_SSL",
            sasl_mechanism="scram-sha-512",
            sasl_username="u",
            sasl_password="p",  # type: ignore[arg-type]
        )
    )
    assert scram is not None
    assert scram.protocol.value == "SASL_SSL" and scram.mechanism.value == "SCRAM-SHA-512"
    assert isinstance(scram.ssl_context, ssl.SSLContext)  # type: ignore[attr-defined]
    tls = broker_credentials(KafkaConfig(bootstrap_servers="a:1", security_protocol="SSL"))
    assert tls is not None and tls.protocol.value == "SSL"
    with pytest.raises(ValueError, match="GSSAPI"):
        broker_credentials(
            KafkaConfig(
                bootstrap_servers="a:1", security_protocol="SASL_PLAINTEXT", sasl_mechanism="GSSAPI"
            )
        )
    with pytest.raises(ValueError, match="sasl_password"):
        broker_credentials(
            KafkaConfig(
                bootstrap_servers="a:1", security_protocol="SASL_PLAINTEXT", sasl_username="u"
            )
        )


@pytest.mark.system
def test_the_listener_refuses_a_wrong_password(sasl_kafka: KafkaConfig) -> None:
    wrong = {**sasl_kafka.client_config(), "sasl.password": "wrong", "socket.timeout.ms": 3000}
    with pytest.raises(KafkaException):
        AdminClient(wrong).list_topics(timeout=5)
    assert AdminClient(sasl_kafka.client_config()).list_topics(timeout=30).brokers


@pytest.mark.system
def test_stream_worker_scores_a_group_on_a_sasl_cluster(
    sasl_kafka: KafkaConfig, unique_name, tmp_path: Path
) -> None:
    client = sasl_kafka.client_config()
    topics = stream_topics(unique_name)
    create_stream_topics(client, topics, raw_partitions=2)
    run = "run-sasl"
    security = {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_username": USER,
        "sasl_password": PASSWORD,
    }
    config = worker_config(
        sasl_kafka.client_config()["bootstrap.servers"],
        topics,
        unique_name("app"),
        run_id=run,
        kafka=security,
        staleness={"max_staleness": 100},
        old_logits={"mode": "exact", "source": "seeded", "model": "tiny"},
    )
    group = [
        synthetic(run_id=run, group_id="grp-sasl", group_size=4, sample_index=i, seed=i)
        for i in range(4)
    ]
    produce(client, topics["raw"], [keyed(t) for t in group])
    worker = WorkerProcess(config, tmp_path / "w", name="w").start()
    try:
        msgs = read_topic(
            client,
            [topics["scored"]],
            until=lambda m: len(m) >= 1,
            timeout=120,
            check=lambda: worker.alive() or pytest.fail(worker.log()[-5000:]),
        )
    finally:
        worker.kill()
    assert [decode_group(m.value()).group_id for m in msgs] == ["grp-sasl"], worker.log()[-3000:]
    assert decode_group(msgs[0].value()).complete
