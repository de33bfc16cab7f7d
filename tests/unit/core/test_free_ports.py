"""Ports chosen for roles that bind them later, by ``core.process.free_ports``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from core import process
from core.process import LOWEST_CHOSEN_PORT, free_port, free_ports

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def own_leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's choosers share a lease file of its own (the cache under ``tmp_path``)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return process.port_lease_file()


def script_draws(monkeypatch: pytest.MonkeyPatch, ports: Iterable[int]) -> None:
    """The chooser draws ``ports`` in this order (from a range up to 65536)."""
    draws = iter(ports)

    class Scripted:
        def randrange(self, start: int, stop: int) -> int:
            return next(draws)

    monkeypatch.setattr(process.random, "SystemRandom", Scripted)
    monkeypatch.setattr(process, "_first_ephemeral_port", lambda: 65_536)


def test_ports_are_distinct_unbound_and_below_the_ephemeral_range() -> None:
    ports = free_ports(40)
    assert len(set(ports)) == 40
    first_ephemeral = process._first_ephemeral_port()
    assert all(LOWEST_CHOSEN_PORT <= p < first_ephemeral for p in ports), ports
    for port in ports:  # each can be bound by whoever asked
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_or_already_drawn_is_drawn_again(
    own_leases: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        spare = free_ports(2)
        own_leases.unlink()  # drawn again below as if by nobody before
        script_draws(monkeypatch, [busy, spare[0], busy, spare[0], spare[1]])
        assert free_ports(2) == spare


def test_a_port_another_process_drew_is_not_drawn_while_its_lease_lasts(
    own_leases: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chooser = [sys.executable, "-c", "from core.process import free_ports; print(*free_ports(3))"]
    theirs = [int(p) for p in subprocess.check_output(chooser, env=os.environ).split()]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))  # a free port nobody leased
        spare = probe.getsockname()[1]
    script_draws(monkeypatch, [*theirs, spare])
    assert free_ports(1) == [spare]  # unbound all along, but leased to the other process
    leases = dict(line.split() for line in own_leases.read_text().splitlines())
    assert {int(p) for p in leases} == {*theirs, spare}
    assert all(float(until) > time.time() + 0.9 * process.PORT_LEASE_S for until in leases.values())


def test_expired_and_unreadable_lease_lines_are_dropped(
    own_leases: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expired, live = free_ports(2)
    own_leases.write_bytes(
        f"{expired} {time.time() - 1:.0f}\nnot a lease\n\xff\xfe 7\n1 2 3\n"
        f"{live} {time.time() + 60:.0f}\n".encode("latin-1")
    )
    script_draws(monkeypatch, [live, expired])
    assert free_ports(1) == [expired]
    assert sorted(int(line.split()[0]) for line in own_leases.read_text().splitlines()) == sorted(
        [expired, live]
    )


def test_an_unusual_ephemeral_range_leaves_the_choice_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "_first_ephemeral_port", lambda: 1024)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    assert free_port() > 0
