"""The embedded store's internal ports, attacked by a local user without its files.

A real ``weed mini`` (``infra.s3.SeaweedServer``) holds one object; a stranger runs the
real ``weed`` tools from a directory of its own (no ``security.toml``, none under its
home) and tries what works against a SeaweedFS without mutual TLS: ``weed filer.copy``
into the bucket, ``weed shell`` with ``fs.rm``, the master's ``/col/delete`` (which
drops the bucket's volumes), and plain HTTP/2 on every gRPC port and unix socket. Each
is refused, and the object is still there and readable through S3 afterwards. The
same ``weed shell`` run with the store's own ``security.toml`` reaches the filer: the
refusals come from the missing certificate, not from a command that cannot work.
"""

from __future__ import annotations

import socket
import ssl
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infra.s3 import SECURITY_FILE, SeaweedServer, ensure_bucket, weed_binary
from infra.tls import TlsFiles, write_tls_files
from weights.store import make_s3_client

pytestmark = pytest.mark.integration

BUCKET, KEY, BODY = "guarded", "weights/r/v0000000001/manifest.json", b'{"genuine": 1}'
# A gRPC client without the certificate retries until it gives up; 10 s is plenty.
TOOL_TIMEOUT_S = 10
# The client preface and an empty SETTINGS frame: a plaintext gRPC server answers with
# its own SETTINGS frame (type 4); one that demands TLS closes or sends an alert.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")


def trusting_any_server() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


@dataclass(frozen=True)
class Store:
    server: SeaweedServer
    client: Any
    stranger: Path  # the attacker's working directory and home

    def port(self, name: str) -> int:
        return self.server.ports()[name]

    def address(self, component: str) -> str:
        """``host:port.grpcPort``, as the weed tools take it."""
        return f"127.0.0.1:{self.port(f'{component}.port')}.{self.port(f'{component}.port.grpc')}"

    def weed(self, args: list[str], stdin: str = "", cwd: Path | None = None) -> str:
        """Run a weed tool as the stranger (or in ``cwd``); its output, or what it printed
        before it was killed for not finishing."""
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.stranger)}
        try:
            done = subprocess.run(
                [weed_binary(), *args],
                input=stdin,
                cwd=cwd or self.stranger,
                env=env,
                capture_output=True,
                text=True,
                timeout=TOOL_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as err:
            return f"(killed) {err.stdout or ''}{err.stderr or ''}"
        return f"(exit {done.returncode}) {done.stdout}{done.stderr}"

    def keys(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
        return [item["Key"] for item in listed]

    def assert_intact(self) -> None:
        assert self.keys() == [KEY]
        assert self.client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == BODY


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    server = SeaweedServer(tmp_path_factory.mktemp("guarded-s3"))
    stranger = tmp_path_factory.mktemp("stranger")
    try:
        server.start()
        client = make_s3_client(server.config(bucket=BUCKET))
        ensure_bucket(client, BUCKET)
        client.put_object(Bucket=BUCKET, Key=KEY, Body=BODY)
        yield Store(server, client, stranger)
    finally:
        server.stop()


def test_the_certificates_and_sockets_are_the_owners_alone(store: Store) -> None:
    files = TlsFiles.in_dir(store.server.data_dir)
    for path in (store.server.data_dir / SECURITY_FILE, files.ca, files.cert, files.key):
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600, path
    sockets = list(Path("/tmp").glob(f"seaweedfs-filer-grpc-{store.port('filer.port.grpc')}.sock"))
    sockets += Path("/tmp").glob(f"seaweedfs-filer-{store.port('filer.port')}.sock")
    assert sockets
    for path in sockets:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_filer_copy_without_the_certificate_is_refused(store: Store) -> None:
    (store.stranger / "forged.json").write_text('{"forged": 1}')
    target = f"http://{store.address('filer')}/buckets/{BUCKET}/weights/r/v0000000001/"
    output = store.weed(["filer.copy", "forged.json", target])
    store.assert_intact()
    assert "(exit 0)" not in output, output


def test_shell_fs_rm_without_the_certificate_is_refused(store: Store) -> None:
    shell = ["shell", f"-master={store.address('master')}", f"-filer={store.address('filer')}"]
    output = store.weed(shell, stdin=f"fs.rm -r /buckets/{BUCKET}/weights\nexit\n")
    store.assert_intact()
    assert "(exit 0)" not in output, output

    # With the store's own security.toml (its working directory) the same shell works.
    listing = store.weed(
        shell,
        stdin=f"fs.ls /buckets/{BUCKET}/weights/r/v0000000001\nexit\n",
        cwd=store.server.data_dir,
    )
    assert "manifest.json" in listing, listing


def test_the_masters_http_api_refuses_a_client_without_the_certificate(
    store: Store, tmp_path: Path
) -> None:
    path = f"127.0.0.1:{store.port('master.port')}/col/delete?collection={BUCKET}"
    for method in ("GET", "POST"):
        request = urllib.request.Request(f"http://{path}", method=method, data=b"")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 400  # plain HTTP on the TLS port

    # TLS, trusting any server, with no client certificate or one from the stranger's CA
    anonymous, own_ca = trusting_any_server(), trusting_any_server()
    forged = write_tls_files(tmp_path, "rollstream-seaweedfs")
    own_ca.load_cert_chain(forged.cert, forged.key)
    for context in (anonymous, own_ca):
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"https://{path}", timeout=5, context=context)
    store.assert_intact()


@pytest.mark.parametrize("component", ["master", "volume", "filer", "s3", "admin"])
def test_grpc_ports_and_their_unix_sockets_refuse_plaintext(store: Store, component: str) -> None:
    port = store.port(f"{component}.port.grpc")
    targets: list[tuple[int, Any]] = [(socket.AF_INET, ("127.0.0.1", port))]
    unix = Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock")
    if unix.exists():
        targets.append((socket.AF_UNIX, str(unix)))
    for family, address in targets:
        with socket.socket(family, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            conn.connect(address)
            conn.sendall(HTTP2_PREFACE)
            try:
                answer = conn.recv(16)
            except (ConnectionError, TimeoutError):
                answer = b""
        # a SETTINGS frame (type 4 at byte 3) would be a plaintext gRPC server
        assert not (len(answer) > 3 and answer[3] == 4), (address, answer)
    store.assert_intact()
