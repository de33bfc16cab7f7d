"""Every client against a secured cluster: SASL/SCRAM-SHA-512 and mutual TLS on a real
broker, OAUTHBEARER's mapping and token fetch, and the combinations refused up front.

One extra broker for the module (``support.secure_kafka.SecuredKafka``) has both
listeners. librdkafka clients get ``KafkaConfig.client_config()``; the stream worker's
aiokafka clients get what Faust passes them from ``streams.faust.broker.broker_credentials``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError
from confluent_kafka import Consumer, KafkaError, Producer
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from pydantic import ValidationError
from support.secure_kafka import SecuredKafka, make_tls

from core.config import KafkaConfig
from infra.topics import ensure_topics
from schemas.topics import TopicSpec
from streams.faust.broker import ClientCredentialsToken, broker_credentials

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[SecuredKafka]:
    root = tmp_path_factory.mktemp("kafka-secured")
    broker = SecuredKafka(root / "kafka", cache_dir, make_tls(root / "tls"))
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


# --- librdkafka (producers, trainer, topic setup) ---------------------------------------------


def _round_trip(kafka: KafkaConfig) -> None:
    """Create a topic, produce a record and consume it back, all with ``kafka``'s clients."""
    client = kafka.client_config()
    topic = f"secured-{uuid.uuid4().hex[:8]}"
    assert ensure_topics(client, [TopicSpec(topic, 1)], kafka).created == (topic,)
    producer = Producer(client)
    producer.produce(topic, b"hello")
    assert producer.flush(30) == 0
    consumer = Consumer({**client, "group.id": topic, "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                assert msg.value() == b"hello"
                return
        pytest.fail(f"nothing read back from {topic}")
    finally:
        consumer.close()


def _refusal(kafka: KafkaConfig) -> KafkaError:
    """The first error a client built from ``kafka`` reports (its connection refused)."""
    errors: list[KafkaError] = []
    producer = Producer({**kafka.client_config(), "error_cb": errors.append})
    deadline = time.monotonic() + 20
    while not errors and time.monotonic() < deadline:
        producer.poll(0.2)
    assert errors, "the broker accepted a client it should refuse"
    return errors[0]


def test_scram_clients_produce_consume_and_create_topics(secured: SecuredKafka) -> None:
    _round_trip(secured.scram_config())


def test_scram_refuses_a_wrong_password_saying_so(secured: SecuredKafka) -> None:
    error = _refusal(secured.scram_config(password="wrong"))
    assert error.code() == KafkaError._AUTHENTICATION
    assert "invalid credentials" in error.str() and "SCRAM-SHA-512" in error.str()


def test_mutual_tls_clients_with_a_certificate(secured: SecuredKafka) -> None:
    _round_trip(secured.tls_config())


def test_mutual_tls_refuses_a_client_without_a_certificate(secured: SecuredKafka) -> None:
    error = _refusal(secured.tls_config(with_certificate=False))
    assert "certificate" in error.str()


# --- aiokafka, as Faust builds its clients --------------------------------------------------


async def _aiokafka_round_trip(kafka: KafkaConfig, topic: str) -> bytes | None:
    auth = credentials_to_aiokafka_auth(broker_credentials(kafka))
    servers = kafka.client_config()["bootstrap.servers"]
    producer = AIOKafkaProducer(bootstrap_servers=servers, request_timeout_ms=15000, **auth)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"from-faust")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=servers, auto_offset_reset="earliest", **auth
    )
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 30)
        return msg.value
    finally:
        await consumer.stop()


@pytest.mark.parametrize("listener", ["scram", "tls"])
def test_faust_clients_reach_the_secured_listeners(secured: SecuredKafka, listener: str) -> None:
    kafka = secured.scram_config() if listener == "scram" else secured.tls_config()
    topic = f"faust-{listener}-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka.client_config(), [TopicSpec(topic, 1)], kafka)
    assert asyncio.run(_aiokafka_round_trip(kafka, topic)) == b"from-faust"


@pytest.mark.parametrize("listener", ["scram", "tls"])
def test_faust_clients_are_refused_without_the_right_credentials(
    secured: SecuredKafka, listener: str
) -> None:
    if listener == "scram":
        kafka = secured.scram_config(password="wrong")
    else:
        kafka = secured.tls_config(with_certificate=False)

    async def start() -> None:
        auth = credentials_to_aiokafka_auth(broker_credentials(kafka))
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka.client_config()["bootstrap.servers"],
            request_timeout_ms=5000,
            **auth,
        )
        try:
            await asyncio.wait_for(producer.start(), 20)
        finally:
            await producer.stop()

    with pytest.raises(KafkaConnectionError, match="Unable to bootstrap"):  # not a hang
        asyncio.run(start())


# --- the config: mapping and refused combinations (no broker) ---------------------------------

OAUTH = {
    "bootstrap_servers": "a:1",
    "security_protocol": "SASL_SSL",
    "sasl_mechanism": "OAUTHBEARER",
    "oauth_token_endpoint_url": "https://idp.example/token",
    "oauth_client_id": "rollstream",
    "oauth_client_secret": "idp-secret",
    "oauth_scope": "kafka",
}


def test_oauthbearer_maps_to_librdkafka_oidc_and_a_faust_token_provider() -> None:
    kafka = KafkaConfig(**OAUTH)  # type: ignore[arg-type]
    conf = kafka.client_config()
    assert {k: v for k, v in conf.items() if k.startswith("sasl.")} == {
        "sasl.mechanism": "OAUTHBEARER",
        "sasl.oauthbearer.method": "oidc",
        "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token",
        "sasl.oauthbearer.client.id": "rollstream",
        "sasl.oauthbearer.client.secret": "idp-secret",
        "sasl.oauthbearer.scope": "kafka",
    }
    assert "idp-secret" not in repr(kafka)
    credentials = broker_credentials(kafka)
    auth = credentials_to_aiokafka_auth(credentials)
    assert auth["security_protocol"] == "SASL_SSL" and auth["sasl_mechanism"] == "OAUTHBEARER"
    assert isinstance(auth["sasl_oauth_token_provider"], ClientCredentialsToken)
    assert isinstance(auth["ssl_context"], ssl.SSLContext)


def test_client_certificate_settings_reach_both_kinds_of_client(tmp_path: Path) -> None:
    tls = make_tls(tmp_path)
    kafka = KafkaConfig(
        bootstrap_servers="a:1",
        security_protocol="SSL",
        ssl_ca_location=str(tls.ca),
        ssl_certificate_location=str(tls.client_certificate),
        ssl_key_location=str(tls.client_key),
        ssl_key_password="client-key-secret",  # type: ignore[arg-type]
    )
    conf = kafka.client_config()
    assert conf["ssl.certificate.location"] == str(tls.client_certificate)
    assert conf["ssl.key.location"] == str(tls.client_key)
    assert conf["ssl.key.password"] == "client-key-secret"
    assert "client-key-secret" not in repr(kafka)
    credentials = broker_credentials(kafka)
    assert credentials is not None and credentials.protocol.value == "SSL"
    with pytest.raises(ValueError, match="is encrypted: set ssl_key_password"):
        broker_credentials(kafka.model_copy(update={"ssl_key_password": None}))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"security_protocol": "SASL_SSL"}, "PLAIN needs sasl_username and sasl_password"),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-256",
                "sasl_username": "u",
            },
            "SCRAM-SHA-256 needs sasl_username and sasl_password",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
            "OAUTHBEARER needs oauth_token_endpoint_url, oauth_client_id, oauth_client_secret",
        ),
        (
            {
                **{k: v for k, v in OAUTH.items() if k != "sasl_mechanism"},
                "sasl_username": "u",
                "sasl_password": "p",
            },
            "oauth_\\* settings need sasl_mechanism OAUTHBEARER",
        ),
        ({"sasl_mechanism": "PLAIN"}, "only a SASL_\\* protocol uses"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "DIGEST"}, "unknown SASL mechanism"),
        ({"ssl_ca_location": "/ca.pem"}, "only SSL or SASL_SSL uses"),
        ({"security_protocol": "SSL", "ssl_certificate_location": "/c.pem"}, "go together"),
        ({"security_protocol": "SSL", "ssl_key_password": "x"}, "needs ssl_key_location"),
        ({"replication_factor": 0}, "greater than or equal to 1"),
        ({"min_insync_replicas": -1}, "greater than or equal to 1"),
        ({"replication_factor": 2, "min_insync_replicas": 3}, "no write would succeed"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KafkaConfig(**{"bootstrap_servers": "a:1", **settings})


def test_the_token_provider_fetches_a_client_credentials_token_once() -> None:
    """The grant librdkafka's oidc method makes, against a stand-in token endpoint."""
    seen: list[tuple[str | None, dict]] = []

    async def token(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization"), dict(await request.post())))
        if request.headers.get("Authorization") != "Basic cm9sbHN0cmVhbTppZHAtc2VjcmV0":
            return web.json_response({"error": "invalid_client"}, status=401)
        return web.json_response({"access_token": f"tok-{len(seen)}", "expires_in": 3600})

    async def scenario() -> tuple[list[str], str]:
        app = web.Application()
        app.router.add_post("/token", token)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/token"
        try:
            provider = ClientCredentialsToken(
                KafkaConfig(**{**OAUTH, "oauth_token_endpoint_url": url})  # type: ignore[arg-type]
            )
            tokens = list(await asyncio.gather(*(provider.token() for _ in range(3))))
            wrong = ClientCredentialsToken(
                KafkaConfig(
                    **{**OAUTH, "oauth_token_endpoint_url": url, "oauth_client_secret": "no"}  # type: ignore[arg-type]
                )
            )
            try:
                await wrong.token()
            except PermissionError as err:
                return tokens, str(err)
            return tokens, ""
        finally:
            await runner.cleanup()

    tokens, refusal = asyncio.run(scenario())
    assert tokens == ["tok-1"] * 3  # three connections, one request
    assert seen[0][1] == {"grant_type": "client_credentials", "scope": "kafka"}
    assert "refused the client credentials (HTTP 401)" in refusal and "invalid_client" in refusal
