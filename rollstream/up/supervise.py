"""The processes of ``rollstream up``: started in order, probed until ready, restarted
when they crash (``--restarts``), stopped in an order that loses nothing, and a stop on
SIGINT/SIGTERM. What to start is ``rollstream.up.plan``'s; what to show while they run
is a display's (``rollstream.up.display``), so this loop serves every kind of run."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol

import click

from consumers.guard_config import GUARD_EXIT
from core.process import Launcher, last_error

STOP_ORDER = ("eval", "producer", "engine", "streams", "trainer")


class StopFlag:
    """SIGINT/SIGTERM set it; the supervisor loop polls it."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum

    def __bool__(self) -> bool:
        return self.signum is not None


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """A ``StopFlag`` that SIGINT and SIGTERM set while the block runs (the handlers
    before it come back after): the roles are then stopped in order, not killed with us."""
    stop = StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def http_ok(url: str) -> Callable[[], bool]:
    """Ready once ``url`` answers 200 (an engine's ``/health``)."""

    def probe() -> bool:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)

    return probe


def port_probe(port: int) -> Callable[[], bool]:
    """Ready once the role listens on ``port`` (its metrics endpoint)."""
    from core.process import port_open

    return lambda: port_open(port)


def stop_order(names: list[str]) -> list[str]:
    """The evaluator and producers first (no new data), then engines, stream workers,
    the trainer."""
    rank = {kind: i for i, kind in enumerate(STOP_ORDER)}
    return sorted(names, key=lambda name: rank[name.split("-")[0]])


def start_roles(launcher: Launcher, stop: StopFlag, ready_timeout_s: float) -> None:
    """Start the launcher's roles in order, producers last (once what they feed is ready),
    and wait for each to be ready; a signal cancels the waiting."""
    producers = [name for name in launcher.roles if name.startswith("producer")]
    for name, role in launcher.roles.items():
        if name not in producers:
            role.start()
    for name, role in launcher.roles.items():
        if stop:
            break
        if name in producers:
            role.start()
        role.wait_ready(ready_timeout_s, cancelled=lambda: bool(stop))
        click.echo(f"{name} ready (pid {role.pid}, log {role.log_file})", err=True)


class Watch(Protocol):
    """Something the loop checks besides the processes: ``check`` returns a message when
    it sees a problem; with ``ends_run`` that message ends the run."""

    ends_run: bool

    def check(self) -> str | None: ...


class Display(Protocol):
    """What the loop shows: a live table on a terminal, else a line now and then."""

    def table(self, alive: dict[str, str]) -> Any: ...

    def line(self, alive: dict[str, str]) -> str: ...


def alive(launcher: Launcher) -> dict[str, str]:
    """Each role's process state: ``pid 123`` or ``exit 1``."""
    return {
        n: (f"pid {r.pid}" if r.running() else f"exit {r.returncode()}")
        for n, r in launcher.roles.items()
    }


def killed_by(code: int | None) -> str:
    """``killed by SIGKILL`` for a process a signal ended (a negative exit code)."""
    if code is None or code >= 0:
        return ""
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def supervise(
    launcher: Launcher,
    display: Display,
    stop: StopFlag,
    restarts: int,
    watches: Sequence[Watch] = (),
) -> tuple[str, bool]:
    """Show progress until a trainer ends, a role fails for good, a watch that ends the
    run sees a problem, or a signal arrives; returns why the run ended and whether it
    finished (a trainer reached max_steps)."""
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=True)
    restarts_left = dict.fromkeys(launcher.roles, restarts)
    trainers = [name for name in launcher.roles if name.split("-")[0] == "trainer"]

    def check() -> tuple[str, bool] | None:
        # One trainer per policy in a multi-policy run: the run ends when the first
        # reaches max_steps (the others would soon starve: one producer feeds them all).
        # A trainer that crashed is restarted like any role: it resumes from its
        # checkpoint and the ledger keeps it from training a trajectory twice.
        for name in trainers:
            if launcher.roles[name].returncode() == 0:
                return ("max_steps reached", True)
        for role in launcher.exited():
            cause = last_error(role.log_file) or killed_by(role.returncode())
            guarded = role.name in trainers and role.returncode() == GUARD_EXIT
            if restarts_left[role.name] > 0 and not guarded:  # a guard's stop is final
                restarts_left[role.name] -= 1
                console.log(f"{role.name} exited ({role.returncode()}): {cause}; restarting")
                role.start()
            else:
                ended = f"{role.name} exited with code {role.returncode()}"
                return (f"{ended}: {cause}" if cause else ended, False)
        for watch in watches:
            if (problem := watch.check()) is not None:
                if watch.ends_run:
                    return (problem, False)
                console.log(f"[bold red]{problem}[/]")
        return None

    last_line = 0.0
    if console.is_terminal:
        with Live(display.table(alive(launcher)), console=console, refresh_per_second=2) as live:
            while not stop and (outcome := check()) is None:
                time.sleep(0.5)
                live.update(display.table(alive(launcher)))
    else:
        while not stop and (outcome := check()) is None:
            time.sleep(0.5)
            if time.monotonic() - last_line > 10:
                last_line = time.monotonic()
                console.print(display.line(alive(launcher)), soft_wrap=True)
    if stop:
        return f"stopped by {signal.Signals(stop.signum or 2).name}", False
    assert outcome is not None
    return outcome
