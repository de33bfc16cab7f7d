"""Which ``rollstream up`` runs use a state dir's embedded services, so that one run's end
never stops the broker and store under another run.

Each ``up`` on embedded services registers itself under ``<state_dir>/users`` while it
runs (``up-<pid>.json``, holding its run id). Services an ``up`` started are
stopped by the last ``up`` to end, whichever run that is; services that were already
running when the first ``up`` came (``rollstream infra up``) are left running, as before.
A user file whose process is gone (a killed ``up``) no longer counts. Joining and leaving
hold an exclusive lock on ``<state_dir>/users/.lock``, so two runs that end at once agree
on which of them is last.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from core.process import pid_alive

STARTED_BY_UP = "started-by-up.json"
"""The names of the services running now that an ``up`` started (the last ``up`` stops
them)."""


@dataclass(frozen=True)
class ServiceUsers:
    """The ``up`` runs registered under one state dir (module doc)."""

    state_dir: Path
    pid: int = field(default_factory=os.getpid)

    @property
    def directory(self) -> Path:
        return self.state_dir / "users"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the state dir's user lock (blocking until other ``up`` runs release it)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def join(self, run_id: str, *, starting: list[str]) -> None:
        """Register this process as a user of the services (under ``locked``), before it
        starts ``starting`` (names of services not running), which an ``up`` then stops
        once no run uses them."""
        (self.directory / f"up-{self.pid}.json").write_text(
            json.dumps({"run_id": run_id, "pid": self.pid})
        )
        if starting:
            marker = self.directory / STARTED_BY_UP
            marker.write_text(json.dumps(sorted({*self.started_by_up(), *starting})))

    def leave(self) -> list[str]:
        """Unregister this process (under ``locked``); the run ids of the other live
        users, whose files stay (those of processes gone are removed)."""
        (self.directory / f"up-{self.pid}.json").unlink(missing_ok=True)
        others = []
        for path in sorted(self.directory.glob("up-*.json")):
            try:
                user = json.loads(path.read_text())
                pid, run_id = int(user["pid"]), str(user["run_id"])
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)  # unreadable: no run can be waiting on it
                continue
            if pid != self.pid and pid_alive(pid):
                others.append(run_id)
            else:
                path.unlink(missing_ok=True)
        return others

    def started_by_up(self) -> list[str]:
        """The services an ``up`` started that still run (as far as this file knows)."""
        try:
            names = json.loads((self.directory / STARTED_BY_UP).read_text())
        except (OSError, ValueError):
            return []
        return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []

    def forget_starter(self) -> None:
        """The services are stopped (by the last ``up``) or now the user's own (``rollstream
        infra up``, which leaves them running until ``infra down``)."""
        (self.directory / STARTED_BY_UP).unlink(missing_ok=True)
