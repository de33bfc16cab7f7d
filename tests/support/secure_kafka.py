"""A real embedded broker with secured client listeners, for the security tests.

``SecuredKafka`` adds a SASL/SCRAM-SHA-512 listener (its credential written when the
storage is formatted, as KRaft requires) and a mutual-TLS listener (PEM key and trust
stores) to ``infra.kafka.EmbeddedKafka``; the PLAINTEXT listener stays for the
controller link and the readiness check. ``make_tls`` writes a throwaway CA, a broker
certificate for 127.0.0.1 and a client certificate (its key encrypted) with
``cryptography``.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from core.config import KafkaConfig
from core.process import free_port
from infra.kafka import EmbeddedKafka, scram_format_args, with_listener, with_scram_listener

SCRAM_USER, SCRAM_PASSWORD = "alice", "alice-secret"
KEY_PASSWORD = "client-key-secret"


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    broker_keystore: Path  # the broker's key (PKCS#8) and certificate, one PEM file
    client_certificate: Path
    client_key: Path  # encrypted with KEY_PASSWORD


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    *,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signer = issuer if issuer else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
    return builder.sign(signer, hashes.SHA256())


def make_tls(directory: Path) -> TlsFiles:
    """A CA, a broker certificate for 127.0.0.1 and a client certificate, as PEM files."""
    directory.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    ca_key, broker_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _certificate("rollstream-test-ca", ca_key, None)
    broker = _certificate("127.0.0.1", broker_key, ("rollstream-test-ca", ca_key), server=True)
    client = _certificate("alice", client_key, ("rollstream-test-ca", ca_key))
    files = TlsFiles(
        ca=directory / "ca.pem",
        broker_keystore=directory / "broker.pem",
        client_certificate=directory / "client.pem",
        client_key=directory / "client.key",
    )
    files.ca.write_bytes(ca.public_bytes(pem))
    files.broker_keystore.write_bytes(
        broker_key.private_bytes(pem, pkcs8, serialization.NoEncryption())
        + broker.public_bytes(pem)
        + ca.public_bytes(pem)
    )
    files.client_certificate.write_bytes(client.public_bytes(pem))
    files.client_key.write_bytes(
        client_key.private_bytes(
            pem, pkcs8, serialization.BestAvailableEncryption(KEY_PASSWORD.encode())
        )
    )
    return files


class SecuredKafka(EmbeddedKafka):
    """The embedded broker plus a SASL_PLAINTEXT (SCRAM-SHA-512) listener and an SSL
    listener that requires a client certificate signed by ``tls.ca``."""

    def __init__(self, data_dir: Path, cache_dir: Path, tls: TlsFiles) -> None:
        super().__init__(KafkaConfig(), data_dir, cache_dir)
        self.tls = tls
        self.scram_port, self.tls_port = free_port(), free_port()

    def format_args(self) -> list[str]:
        return scram_format_args(SCRAM_USER, SCRAM_PASSWORD)

    def properties(self) -> dict[str, str]:
        props = with_scram_listener(super().properties(), "127.0.0.1", self.scram_port)
        props = with_listener(props, "SSL", "127.0.0.1", self.tls_port)
        ssl = "listener.name.ssl."
        props[ssl + "ssl.client.auth"] = "required"
        props[ssl + "ssl.keystore.type"] = "PEM"
        props[ssl + "ssl.keystore.location"] = str(self.tls.broker_keystore)
        props[ssl + "ssl.truststore.type"] = "PEM"
        props[ssl + "ssl.truststore.location"] = str(self.tls.ca)
        return props

    def scram_config(self, password: str = SCRAM_PASSWORD) -> KafkaConfig:
        return KafkaConfig(
            bootstrap_servers=f"127.0.0.1:{self.scram_port}",
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username=SCRAM_USER,
            sasl_password=password,  # type: ignore[arg-type]
        )

    def tls_config(self, with_certificate: bool = True) -> KafkaConfig:
        mine = {}
        if with_certificate:
            mine = {
                "ssl_certificate_location": str(self.tls.client_certificate),
                "ssl_key_location": str(self.tls.client_key),
                "ssl_key_password": KEY_PASSWORD,
            }
        return KafkaConfig(
            bootstrap_servers=f"127.0.0.1:{self.tls_port}",
            security_protocol="SSL",
            ssl_ca_location=str(self.tls.ca),
            **mine,  # type: ignore[arg-type]
        )
