"""Another host on this machine: a Linux network namespace joined by a veth pair.

Regions and hosts are separate machines in a deployment; on one machine a network
namespace gives a process its own network stack and addresses that exist only on the
veth pair joining it to this one, and ``tc``'s token bucket filter (``tbf``) limits the
link's rate, so a benchmark measures what crossing a real link costs rather than loopback.
Making namespaces needs root (``CAP_NET_ADMIN``); ``namespace_host`` says so plainly when
it is refused, and removes what it made whatever happens.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from core.process import ServiceError

#: Addresses of the links made here: 10.213.<index>.1 on this side, .2 in the namespace.
SUBNET = "10.213"


@dataclass(frozen=True)
class Link:
    """A namespace and the veth pair that joins it to this host."""

    netns: str
    host_dev: str
    ns_dev: str
    host_address: str
    ns_address: str
    mbit: float | None  # the rate of this host -> the namespace; None: unlimited


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServiceError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _limit(dev: str, mbit: float) -> None:
    """A token bucket on ``dev``'s egress: ``mbit`` Mbit/s, a burst of 1 MiB (above the
    largest segment a veth passes at once), packets queued for at most 100 ms."""
    cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf"]
    cmd += ["rate", f"{mbit}mbit", "burst", "1mb", "latency", "100ms"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServiceError(f"{' '.join(cmd)}: {result.stderr.strip()}")


def refusal() -> str | None:
    """Why namespaces cannot be made here (no ``ip``/``tc``, or not allowed), else None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    probe = "rs-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add is refused: {made.stderr.strip()} (it needs root)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


@contextmanager
def namespace_host(name: str, index: int, mbit: float | None = None) -> Iterator[Link]:
    """A namespace ``rs-<name>`` joined by a veth pair (10.213.<index>.1 here, .2 there),
    the direction here -> there limited to ``mbit`` Mbit/s (what a mirror writing into
    that region sends; the way back is not limited); removed on exit, with its veth pair."""
    if not 0 < index < 255:
        raise ValueError(f"index must be within 1..254, got {index}")
    if mbit is not None and mbit <= 0:
        raise ValueError(f"mbit must be positive, got {mbit}")
    if (why := refusal()) is not None:
        raise ServiceError(f"cannot make a network namespace: {why}")
    link = Link(
        netns=f"rs-{name}",
        host_dev=f"rs{index}a",
        ns_dev=f"rs{index}b",
        host_address=f"{SUBNET}.{index}.1",
        ns_address=f"{SUBNET}.{index}.2",
        mbit=mbit,
    )
    subprocess.run(["ip", "netns", "del", link.netns], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", link.host_dev], capture_output=True, check=False)
    _ip("netns", "add", link.netns)
    try:
        _ip("link", "add", link.host_dev, "type", "veth", "peer", "name", link.ns_dev)
        _ip("link", "set", link.ns_dev, "netns", link.netns)
        _ip("addr", "add", f"{link.host_address}/24", "dev", link.host_dev)
        _ip("link", "set", link.host_dev, "up")
        inside = ("netns", "exec", link.netns, "ip")
        _ip(*inside, "addr", "add", f"{link.ns_address}/24", "dev", link.ns_dev)
        _ip(*inside, "link", "set", link.ns_dev, "up")
        _ip(*inside, "link", "set", "lo", "up")
        if mbit is not None:
            _limit(link.host_dev, mbit)
        yield link
    finally:
        subprocess.run(["ip", "link", "del", link.host_dev], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", link.netns], capture_output=True, check=False)
