"""Supervise role processes on one machine: start, readiness, stop, kill, restart.

``rollstream up`` starts each role as the command a user would run on its own machine,
so the roles share nothing but Kafka, S3 and the config file. Each role runs in its own
session (a terminal's Ctrl-C reaches only the launcher, which then stops the roles in
order) with its output in ``<log_dir>/<name>.log``. Nothing is left behind: ``stop``
sends SIGTERM to the role's whole process group and SIGKILL after a timeout, and every
role gets ``PR_SET_PDEATHSIG`` so that it is killed even if the launcher itself dies
by SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.process import pid_alive, tail

_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A role did not start or did not become ready; the message holds its log tail."""


@dataclass(frozen=True)
class RoleSpec:
    """How to run one role: argv, extra environment, readiness probe, CPU pinning."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    ready: Callable[[], bool] | None = None  # None: ready once started
    cpus: frozenset[int] | None = None  # os.sched_setaffinity of the role


def _child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: die with the launcher, pin to cores."""

    def setup() -> None:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class RoleProcess:
    """One supervised role. Not thread-safe: one supervisor drives it."""

    def __init__(self, spec: RoleSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_file = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.started_at = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> int:
        """Start the role (appending to its log); returns its pid."""
        if self.running():
            raise LaunchError(f"{self.name} is already running (pid {self.pid})")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        with self.log_file.open("ab") as log:
            log.write(f"--- start {self.starts + 1}: {' '.join(self.spec.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                list(self.spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_child_setup(self.spec.cpus),  # before any thread starts
            )
        self.starts += 1
        self.started_at = time.monotonic()
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Poll the readiness probe; fail early, with the log tail, if the role exits.
        Returns early (not ready) once ``cancelled()`` is true, e.g. after Ctrl-C."""
        deadline = time.monotonic() + timeout_s
        while not cancelled():
            if not self.running():
                raise LaunchError(
                    f"{self.name} exited with code {self.returncode()} before it was ready; "
                    f"log {self.log_file}:\n{tail(self.log_file)}"
                )
            probe = self.spec.ready
            ok = False
            if probe is None:
                ok = True
            else:
                with contextlib.suppress(Exception):
                    ok = bool(probe())
            if ok:
                return
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{self.name} not ready after {timeout_s:.0f}s; log {self.log_file}:\n"
                    f"{tail(self.log_file)}"
                )
            time.sleep(0.2)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the role's whole process group (its children too)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc is None:
            return None
        if self.running():
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        return self.kill() if self.running() else self._reap_group()

    def kill(self) -> int | None:
        """SIGKILL the process group at once (crash tests); returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGKILL)
        code = self.proc.wait()
        self._reap_group()
        return code

    def _reap_group(self) -> int | None:
        """Kill what the role left in its group (a forked helper) and return its code."""
        assert self.proc is not None
        self.signal(signal.SIGKILL)  # the leader is gone: only stragglers receive it
        return self.proc.poll()

    def restart(self, timeout_s: float = 30.0) -> int:
        self.stop(timeout_s)
        return self.start()


class Launcher:
    """Roles started in order and stopped in reverse order (or a given order)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.roles: dict[str, RoleProcess] = {}

    def add(self, spec: RoleSpec) -> RoleProcess:
        if spec.name in self.roles:
            raise ValueError(f"role {spec.name!r} added twice")
        role = RoleProcess(spec, self.log_dir)
        self.roles[spec.name] = role
        return role

    def start(self, name: str, ready_timeout_s: float) -> RoleProcess:
        role = self.roles[name]
        role.start()
        role.wait_ready(ready_timeout_s)
        return role

    def exited(self) -> list[RoleProcess]:
        """Roles that were started and are no longer running."""
        return [r for r in self.roles.values() if r.proc is not None and not r.running()]

    def pids(self) -> dict[str, int]:
        return {name: r.pid for name, r in self.roles.items() if r.pid is not None}

    def stop_all(self, order: Sequence[str] | None = None, timeout_s: float = 30.0) -> None:
        """Stop every role, ``order`` first (the rest in reverse start order)."""
        names = [n for n in order or [] if n in self.roles]
        names += [n for n in reversed(self.roles) if n not in names]
        for name in names:
            self.roles[name].stop(timeout_s)

    def leftovers(self) -> list[int]:
        """Pids of started roles that still exist (should be empty after ``stop_all``)."""
        return [r.pid for r in self.roles.values() if r.pid is not None and pid_alive(r.pid)]
