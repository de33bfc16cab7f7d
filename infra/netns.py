"""Another host on this machine: a Linux network namespace joined by a veth pair.

Regions and hosts are separate machines in a deployment; on one machine a network
namespace gives a process its own network stack and addresses that exist only on the
veth pair joining it to this one, and ``tc``'s token bucket filter (``tbf``) limits the
link's rate, so a benchmark measures what crossing a real link costs rather than loopback.
Making namespaces needs root (``CAP_NET_ADMIN``); ``namespace_host`` says so plainly when
it is refused, and removes what it made whatever happens.

``lan`` makes several such hosts on one network, as a deployment's machines are: a
"switch" namespace holds a Linux bridge, each host namespace has one veth pair to it
(``eth0`` inside, 10.214.0.<n>/24), and one more pair joins this namespace to the bridge
(10.214.0.254) so the process that made them reaches every host. Nothing else changes
here: no sysctl, no route but the one the uplink's address implies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
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


#: ``ip`` and ``tc`` return at once; one that hangs past this is killed.
COMMAND_TIMEOUT_S = 30.0


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    """``cmd``'s outcome, never raising on its exit status; killed past the time limit."""
    return subprocess.run(
        list(cmd), capture_output=True, text=True, check=False, timeout=COMMAND_TIMEOUT_S
    )


def _checked(*cmd: str) -> None:
    """Run ``cmd``; a ``ServiceError`` with its message if it fails."""
    result = _run(*cmd)
    if result.returncode != 0:
        raise ServiceError(f"{' '.join(cmd)}: {result.stderr.strip()}")


def _ip(*args: str) -> None:
    _checked("ip", *args)


def _limit(dev: str, mbit: float, netns: str | None = None) -> None:
    """A token bucket on ``dev``'s egress (in ``netns``, if given): ``mbit`` Mbit/s, a
    burst of 1 MiB (above the largest segment a veth passes at once), packets queued for
    at most 100 ms."""
    where = ["-n", netns] if netns else []
    cmd = ["tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf"]
    _checked(*cmd, "rate", f"{mbit}mbit", "burst", "1mb", "latency", "100ms")


def refusal() -> str | None:
    """Why namespaces cannot be made here (no ``ip``/``tc``, or not allowed), else None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    probe = f"rs-probe-{os.getpid()}"  # two test workers probing at once must not collide
    made = _run("ip", "netns", "add", probe)
    if made.returncode != 0:
        return f"ip netns add is refused: {made.stderr.strip()} (it needs root)"
    _run("ip", "netns", "del", probe)
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
    _run("ip", "netns", "del", link.netns)
    _run("ip", "link", "del", link.host_dev)
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
        _run("ip", "link", "del", link.host_dev)
        _run("ip", "netns", "del", link.netns)


# --- several hosts on one switch -------------------------------------------------------------

#: The hosts' network: 10.214.0.<n>/24, host n = 1, 2, ...; this namespace is .254.
LAN = "10.214.0"
#: The namespace holding the bridge, and this namespace's end of the uplink to it.
SWITCH = "rs-switch"
UPLINK = "rslan0"


@dataclass(frozen=True)
class Lan:
    """Host namespaces on one bridge: ``netns[name]`` and ``address[name]`` of each host,
    ``uplink_address`` this namespace's address on it, ``mbit`` the limited hosts."""

    netns: Mapping[str, str]
    address: Mapping[str, str]
    mbit: Mapping[str, float]
    uplink_address: str = f"{LAN}.254"

    def exec_prefix(self, host: str) -> list[str]:
        """What runs a command on ``host``: ``ip netns exec rs-<host>``."""
        return ["ip", "netns", "exec", self.netns[host]]

    def switch_port(self, host: str) -> str:
        """The bridge's port to ``host`` (in ``SWITCH``): its egress is what ``host``
        receives, so ``tc -n rs-switch -s qdisc show dev <port>`` counts it."""
        return f"p{list(self.netns).index(host) + 1}"

    def bytes_sent_to(self, host: str) -> int:
        """Bytes the switch sent ``host`` through its rate limit (0 if unlimited)."""
        shown = _run("tc", "-n", SWITCH, "-s", "qdisc", "show", "dev", self.switch_port(host))
        words = shown.stdout.split()
        return int(words[words.index("Sent") + 1]) if "Sent" in words else 0


def lan_namespaces(hosts: Sequence[str]) -> list[str]:
    """The namespaces ``lan(hosts)`` makes: ``rs-<host>`` each, and the switch."""
    return [f"rs-{host}" for host in hosts] + [SWITCH]


def remove_lan(hosts: Sequence[str]) -> None:
    """Remove what ``lan(hosts)`` makes, were it left by a run that was killed: the
    processes still inside those namespaces (SIGKILL), the namespaces, the uplink."""
    listed = _run("ip", "netns", "list").stdout
    present = {line.split()[0] for line in listed.splitlines() if line.strip()}
    for netns in lan_namespaces(hosts):
        if netns not in present:
            continue
        pids = _run("ip", "netns", "pids", netns)
        for pid in pids.stdout.split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _run("ip", "netns", "del", netns)
    _run("ip", "link", "del", UPLINK)


@contextmanager
def lan(hosts: Sequence[str], mbit: Mapping[str, float] | None = None) -> Iterator[Lan]:
    """Hosts ``rs-<name>`` at 10.214.0.1, .2, ... in ``hosts``' order, on one bridge that
    this namespace reaches as 10.214.0.254; a host in ``mbit`` has its link limited both
    ways to that many Mbit/s (a region behind a slower line). Leftovers of an earlier run
    are removed first; everything made is removed on exit, whatever happens."""
    limits = dict(mbit or {})
    if not 0 < len(hosts) < 254 or len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts must be 1..253 distinct names, got {list(hosts)}")
    if unknown := set(limits) - set(hosts):
        raise ValueError(f"rate limits for hosts that are not on the LAN: {sorted(unknown)}")
    if any(rate <= 0 for rate in limits.values()):
        raise ValueError(f"rates must be positive, got {limits}")
    if (why := refusal()) is not None:
        raise ServiceError(f"cannot make network namespaces: {why}")
    made = Lan(
        netns={host: f"rs-{host}" for host in hosts},
        address={host: f"{LAN}.{i}" for i, host in enumerate(hosts, 1)},
        mbit=limits,
    )
    remove_lan(hosts)
    try:
        _ip("netns", "add", SWITCH)
        _ip("-n", SWITCH, "link", "add", "br0", "type", "bridge")
        _ip("-n", SWITCH, "link", "set", "br0", "up")
        for host in hosts:
            netns, port = made.netns[host], made.switch_port(host)
            _ip("netns", "add", netns)
            _ip("-n", SWITCH, "link", "add", port, "type", "veth", "peer", "eth0", "netns", netns)
            _ip("-n", SWITCH, "link", "set", port, "master", "br0", "up")
            _ip("-n", netns, "addr", "add", f"{made.address[host]}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            if host in limits:
                _limit(port, limits[host], SWITCH)  # into the host
                _limit("eth0", limits[host], netns)  # out of it
        _ip("link", "add", UPLINK, "type", "veth", "peer", "up0", "netns", SWITCH)
        _ip("-n", SWITCH, "link", "set", "up0", "master", "br0", "up")
        _ip("addr", "add", f"{made.uplink_address}/24", "dev", UPLINK)
        _ip("link", "set", UPLINK, "up")
        yield made
    finally:
        remove_lan(hosts)
