"""Ports chosen for roles that bind them later, by ``core.process.free_ports``."""

from __future__ import annotations

import socket

import pytest

from core import process
from core.process import LOWEST_CHOSEN_PORT, free_port, free_ports

pytestmark = pytest.mark.unit


def test_ports_are_distinct_unbound_and_below_the_ephemeral_range() -> None:
    ports = free_ports(40)
    assert len(set(ports)) == 40
    first_ephemeral = process._first_ephemeral_port()
    assert all(LOWEST_CHOSEN_PORT <= p < first_ephemeral for p in ports), ports
    for port in ports:  # each can be bound by whoever asked
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_or_already_drawn_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        spare = free_ports(2)
        draws = iter([busy, spare[0], busy, spare[0], spare[1]])

        class Scripted:
            def randrange(self, start: int, stop: int) -> int:
                return next(draws)

        monkeypatch.setattr(process.random, "SystemRandom", Scripted)
        monkeypatch.setattr(process, "_first_ephemeral_port", lambda: 65_536)
        assert free_ports(2) == spare


def test_an_unusual_ephemeral_range_leaves_the_choice_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "_first_ephemeral_port", lambda: 1024)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    assert free_port() > 0
