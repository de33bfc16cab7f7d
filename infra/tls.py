"""A private certificate authority for one service's own components (mutual TLS).

``write_tls_files`` makes a fresh CA, signs one certificate (server and client use,
valid for 127.0.0.1) with it and throws the CA's key away: nothing can sign a second
certificate the service would accept, so a client is let in only with the files
written here, all mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough that a store left running never sees its certificate expire; the files
# are made again at every start anyway.
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths: the CA certificate, and the one certificate it signed with its key."""

    ca: str
    cert: str
    key: str

    @classmethod
    def in_dir(cls, directory: Path) -> TlsFiles:
        return cls(*(str(directory / f"tls-{part}.pem") for part in ("ca", "cert", "key")))

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts only this CA and presents the certificate."""
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        return context


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def write_tls_files(
    directory: Path, common_name: str, addresses: tuple[str, ...] = ("127.0.0.1",)
) -> TlsFiles:
    """A new CA and one certificate ``common_name`` in ``directory`` (replacing any),
    valid for ``localhost`` and the IP ``addresses`` the service listens on."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{common_name} CA")

    def builder(subject: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
        )

    ca = (
        builder(ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf = (
        builder(_name(common_name), leaf_key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    *(x509.IPAddress(ipaddress.ip_address(a)) for a in dict.fromkeys(addresses)),
                    x509.DNSName("localhost"),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = leaf_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    files = TlsFiles.in_dir(directory)
    for path, data in (
        (files.ca, ca.public_bytes(pem)),
        (files.cert, leaf.public_bytes(pem)),
        (files.key, key_pem),
    ):
        replace_private(Path(path), data)
    return files


def replace_private(path: Path, data: bytes) -> None:
    """Write ``path`` readable by its owner only: a new file (never briefly readable by
    others) renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(partial, path)
