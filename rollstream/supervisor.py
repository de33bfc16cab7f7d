"""Run a role's worker as a child process and start it again when it crashes.

Why a child process: a Faust worker that hits an error it cannot recover from in place
(the broker aborted its transaction while it was restarting, a fenced producer) crashes,
and its event loop is closed with it. Recovering means what a restart does anyway: the
table is rebuilt from its changelog (``read_committed``) and the consumer resumes at the
committed offsets, so an aborted transaction's effects are redone exactly once. Kafka
Streams does the same in-process (``REPLACE_THREAD``); here the unit is the process.

The policy is a crash-loop limit in the spirit of systemd's ``StartLimitBurst``: at most
``max_restarts`` restarts within ``window_s`` (a child that ran longer than the window
resets the count), waiting ``backoff_s`` doubled per consecutive crash up to
``max_backoff_s``. Past the limit the supervisor exits with the child's code, so a
launcher or an orchestrator above it sees the failure.

Signals: SIGTERM and SIGINT are forwarded to the child (SIGHUP as SIGTERM), which stops cleanly
(final commit) and is not restarted; the supervisor exits with its code. The child gets
``PR_SET_PDEATHSIG`` (SIGTERM) so that it never outlives a supervisor killed by SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType

from pydantic import Field

from rollstream.strict import StrictModel

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class RestartConfig(StrictModel):
    """When a crashed worker is started again (``rollstream.supervisor``)."""

    max_restarts: int = Field(
        default=5, ge=0, description="Restarts allowed within window_s; 0: never restart."
    )
    window_s: float = Field(
        default=300.0,
        gt=0,
        description="A child that ran longer than this resets the restart count.",
    )
    backoff_s: float = Field(
        default=1.0, ge=0, description="Wait before the first restart; doubled per crash."
    )
    max_backoff_s: float = Field(default=30.0, ge=0, description="Longest wait between restarts.")


class ChildSupervisor:
    """Starts ``argv``, restarts it after a crash within ``policy``, forwards stop signals."""

    def __init__(
        self,
        argv: Sequence[str],
        policy: RestartConfig,
        *,
        env: Mapping[str, str] | None = None,
        name: str = "worker",
    ) -> None:
        self.argv = list(argv)
        self.policy = policy
        self.env = dict(os.environ if env is None else env)
        self.name = name
        self.restarts = 0  # in total, for the log and the tests
        self._stopping = threading.Event()  # set by a stop signal; cuts a backoff short
        self._child: subprocess.Popen[bytes] | None = None
        self._stop_signal: int | None = None

    def run(self) -> int:
        """Run until the child exits cleanly, is told to stop, or crashes too often;
        returns the exit code to leave with."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED_SIGNALS}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        recent = 0  # crashes inside the current window
        while True:
            started = time.monotonic()
            self._child = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent)
            code = self._wait_child()
            ran_s = time.monotonic() - started
            if self._stop_signal is not None or code == 0:
                return code
            recent = 1 if ran_s > self.policy.window_s else recent + 1
            if recent > self.policy.max_restarts:
                log.error(
                    "%s exited with code %d after %.0f s; %d restarts within %.0f s: giving up",
                    self.name,
                    code,
                    ran_s,
                    recent - 1,
                    self.policy.window_s,
                )
                return code
            delay = min(self.policy.backoff_s * 2 ** (recent - 1), self.policy.max_backoff_s)
            log.warning(
                "%s exited with code %d after %.0f s: restart %d of %d in %.1f s "
                "(it resumes from its committed offsets and changelog)",
                self.name,
                code,
                ran_s,
                recent,
                self.policy.max_restarts,
                delay,
            )
            if self._stopping.wait(delay):  # told to stop while waiting
                return code
            self.restarts += 1

    def _wait_child(self) -> int:
        assert self._child is not None
        while True:
            with contextlib.suppress(InterruptedError):
                code = self._child.wait()
                # a child killed by a signal reports -N; exit as a shell would
                return code if code >= 0 else 128 - code

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        first = self._stop_signal is None
        self._stop_signal = signum
        self._stopping.set()
        child = self._child
        if first and child is not None and child.poll() is None:
            forward = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(forward)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the supervisor dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
