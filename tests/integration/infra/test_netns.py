"""Hosts made of network namespaces (``infra.netns``): a namespace joined by a veth pair,
its rate limit, a store listening only inside it, and nothing left behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from pydantic import SecretStr

from infra.netns import lan, namespace_host, refusal
from infra.s3 import Host, SeaweedServer, ensure_bucket
from weights.store import make_s3_client

pytestmark = pytest.mark.integration

REFUSED = refusal()
needs_netns = pytest.mark.skipif(
    REFUSED is not None, reason=f"NETWORK NAMESPACES UNAVAILABLE HERE: {REFUSED}"
)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(("index", "mbit"), [(0, None), (255, None), (7, 0.0), (7, -5.0)])
def test_a_link_out_of_range_is_refused_before_anything_is_made(
    index: int, mbit: float | None
) -> None:
    with pytest.raises(ValueError), namespace_host("bad", index, mbit):
        pass


@needs_netns
def test_a_namespace_host_is_limited_reachable_and_removed(tmp_path: Path) -> None:
    with namespace_host("probe", 201, 50) as link:
        assert link.netns in _ip("netns", "list")
        qdisc = subprocess.run(
            ["tc", "qdisc", "show", "dev", link.host_dev], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc, qdisc
        store = SeaweedServer(tmp_path / "b", host=Host(link.ns_address, link.netns))
        try:
            assert store.start(60) == f"http://{link.ns_address}:{store.ports()['s3.port']}"
            config = store.config(bucket="probe")
            client = make_s3_client(config)
            ensure_bucket(client, "probe")
            client.put_object(Bucket="probe", Key="k", Body=b"across the link")
            assert client.get_object(Bucket="probe", Key="k")["Body"].read() == b"across the link"
            stranger = make_s3_client(
                config.model_copy(update={"secret_access_key": SecretStr("not-the-key")})
            )
            with pytest.raises(ClientError):
                stranger.get_object(Bucket="probe", Key="k")
        finally:
            store.stop()
    assert link.netns not in _ip("netns", "list")
    assert link.host_dev not in _ip("link", "show")


@pytest.mark.parametrize(
    ("hosts", "mbit"),
    [([], None), (["a", "a"], None), (["a"], {"b": 5.0}), (["a"], {"a": 0.0})],
)
def test_a_lan_out_of_range_is_refused_before_anything_is_made(
    hosts: list[str], mbit: dict[str, float] | None
) -> None:
    with pytest.raises(ValueError), lan(hosts, mbit):
        pass
