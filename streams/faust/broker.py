"""How the Faust app reaches Kafka: broker URLs and credentials from ``KafkaConfig``.

The worker's confluent-kafka clients (version reader, gap guard, ticks, topic setup) take
``KafkaConfig.client_config()``; Faust's own consumer and producers (aiokafka) take
``broker`` URLs and a credentials object instead. Both are built from the same
``[kafka]`` section, so a cluster behind SASL (PLAIN, SCRAM, OAUTHBEARER) or TLS (with
a client certificate or without) works for every client of the worker.
``client_overrides`` are librdkafka properties and do not reach aiokafka.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time

import aiohttp
import faust
import orjson
from aiokafka.abc import AbstractTokenProvider
from faust.types.auth import CredentialsT

from core.config import PASSWORD_MECHANISMS, KafkaConfig

TOKEN_TIMEOUT_S = 30.0
"""A token endpoint that does not answer within this is an error aiokafka retries."""
REFRESH_BEFORE_S = 60.0
"""A token is fetched again this long before it expires (or at half its life if shorter)."""


def broker_urls(kafka: KafkaConfig) -> str:
    """Faust's ``broker`` setting: one ``kafka://host:port`` URL per bootstrap server."""
    servers = kafka.client_config()["bootstrap.servers"]
    return ";".join(f"kafka://{server.strip()}" for server in servers.split(","))


def broker_credentials(kafka: KafkaConfig) -> CredentialsT | None:
    """Faust's ``broker_credentials`` for ``kafka.security_protocol``; None for PLAINTEXT.

    Raises ``ValueError`` for a SASL setting Faust's client cannot use (GSSAPI), naming
    it, rather than letting the worker retry a connection the broker never accepts.
    """
    protocol = kafka.security_protocol
    if protocol == "PLAINTEXT":
        return None
    tls = _ssl_context(kafka) if protocol in ("SSL", "SASL_SSL") else None
    if protocol == "SSL":
        assert tls is not None
        return faust.SSLCredentials(tls)
    mechanism = kafka.mechanism
    if mechanism == "OAUTHBEARER":
        return faust.OAuthCredentials(oauth_cb=ClientCredentialsToken(kafka), ssl_context=tls)
    if mechanism not in PASSWORD_MECHANISMS:
        raise ValueError(
            f"kafka.sasl_mechanism {mechanism!r}: the stream worker supports "
            f"{', '.join(PASSWORD_MECHANISMS)} and OAUTHBEARER"
        )
    assert kafka.sasl_username and kafka.sasl_password is not None  # KafkaConfig checks
    return faust.SASLCredentials(
        username=kafka.sasl_username,
        password=kafka.sasl_password.get_secret_value(),
        mechanism=mechanism,
        ssl_context=tls,
    )


def _ssl_context(kafka: KafkaConfig) -> ssl.SSLContext:
    """Verify the broker against ``ssl_ca_location`` (or the system's CAs); present the
    client certificate when one is configured (mutual TLS)."""
    context = ssl.create_default_context(cafile=kafka.ssl_ca_location)
    if kafka.ssl_certificate_location:
        key = kafka.ssl_key_location
        secret = kafka.ssl_key_password

        def password() -> str:
            """OpenSSL would prompt on the terminal for an encrypted key without one."""
            if secret is None:
                raise ValueError(f"kafka.ssl_key_location {key} is encrypted: set ssl_key_password")
            return secret.get_secret_value()

        context.load_cert_chain(kafka.ssl_certificate_location, key, password)
    return context


class ClientCredentialsToken(AbstractTokenProvider):
    """aiokafka's OAUTHBEARER token: the OIDC client-credentials grant at
    ``kafka.oauth_token_endpoint_url``, the same request librdkafka's
    ``sasl.oauthbearer.method=oidc`` makes, so both kinds of client log in alike. One
    token is shared by every connection until shortly before it expires."""

    def __init__(self, kafka: KafkaConfig) -> None:
        assert kafka.oauth_token_endpoint_url and kafka.oauth_client_id
        assert kafka.oauth_client_secret is not None  # KafkaConfig checks
        self.url = kafka.oauth_token_endpoint_url
        user = f"{kafka.oauth_client_id}:{kafka.oauth_client_secret.get_secret_value()}"
        self.headers = {"Authorization": "Basic " + base64.b64encode(user.encode()).decode()}
        self.form = {"grant_type": "client_credentials"}
        if kafka.oauth_scope:
            self.form["scope"] = kafka.oauth_scope
        self._token: str | None = None
        self._renew_at = 0.0
        self._lock: asyncio.Lock | None = None  # made in the loop that asks

    async def token(self) -> str:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # connections opened together share one request
            if self._token is None or time.monotonic() >= self._renew_at:
                self._token, lifetime = await self._fetch()
                self._renew_at = time.monotonic() + max(
                    min(lifetime - REFRESH_BEFORE_S, lifetime / 2), 0.0
                )
            return self._token

    async def _fetch(self) -> tuple[str, float]:
        timeout = aiohttp.ClientTimeout(total=TOKEN_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(self.url, data=self.form, headers=self.headers) as response,
        ):
            try:
                body = orjson.loads(await response.read())
            except orjson.JSONDecodeError:
                body = None
            if response.status != 200 or not isinstance(body, dict) or "access_token" not in body:
                raise PermissionError(
                    f"the token endpoint {self.url} refused the client credentials "
                    f"(HTTP {response.status}): {str(body)[:300]}"
                )
        return str(body["access_token"]), float(body.get("expires_in", 300))
