"""How the Faust app reaches Kafka: broker URLs and credentials from ``KafkaConfig``.

The worker's confluent-kafka clients (version reader, gap guard, ticks, topic setup) take
``KafkaConfig.client_config()``; Faust's own consumer and producers (aiokafka) take
``broker`` URLs and a credentials object instead. Both are built from the same
``[kafka]`` section, so a cluster behind SASL or TLS works for every client of the
worker. ``client_overrides`` are librdkafka properties and do not reach aiokafka.
"""

from __future__ import annotations

import ssl

import faust
from faust.types.auth import CredentialsT

from core.config import KafkaConfig

PASSWORD_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
"""SASL mechanisms the worker supports: those that take a username and a password."""


def broker_urls(kafka: KafkaConfig) -> str:
    """Faust's ``broker`` setting: one ``kafka://host:port`` URL per bootstrap server."""
    servers = kafka.client_config()["bootstrap.servers"]
    return ";".join(f"kafka://{server.strip()}" for server in servers.split(","))


def broker_credentials(kafka: KafkaConfig) -> CredentialsT | None:
    """Faust's ``broker_credentials`` for ``kafka.security_protocol``; None for PLAINTEXT.

    Raises ``ValueError`` for a SASL setting Faust's client cannot use, naming it, rather
    than letting the worker retry a connection the broker will never accept.
    """
    protocol = kafka.security_protocol
    if protocol == "PLAINTEXT":
        return None
    tls = _ssl_context(kafka) if protocol in ("SSL", "SASL_SSL") else None
    if protocol == "SSL":
        assert tls is not None
        return faust.SSLCredentials(tls)
    mechanism = (kafka.sasl_mechanism or "PLAIN").upper()
    if mechanism not in PASSWORD_MECHANISMS:
        raise ValueError(
            f"kafka.sasl_mechanism {mechanism!r}: the stream worker supports "
            f"{', '.join(PASSWORD_MECHANISMS)}"
        )
    if not kafka.sasl_username or kafka.sasl_password is None:
        raise ValueError(
            f"kafka.security_protocol {protocol} needs sasl_username and sasl_password"
        )
    return faust.SASLCredentials(
        username=kafka.sasl_username,
        password=kafka.sasl_password.get_secret_value(),
        mechanism=mechanism,
        ssl_context=tls,
    )


def _ssl_context(kafka: KafkaConfig) -> ssl.SSLContext:
    """Verify the broker against ``ssl_ca_location`` (or the system's CAs)."""
    return ssl.create_default_context(cafile=kafka.ssl_ca_location)
