"""A long-running child service (broker, object store) with a pid file and a log file.

The service is detached into its own session so that ``rollstream infra up`` can exit
and a later ``rollstream infra down`` (another process) can stop it by pid. The pid
file also records the command line, so a recycled pid is never mistaken for ours.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson


class ServiceError(RuntimeError):
    """A service failed to start, answer or stop; the message points at its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def tail(path: Path, lines: int = 30) -> str:
    """Last lines of a log, for error messages."""
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ServiceProcess:
    """One detached service: ``name`` labels logs; files live in ``run_dir``."""

    name: str
    run_dir: Path

    @property
    def pid_file(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    def pid(self) -> int | None:
        """Pid of our live process, or None (a stale pid file is removed)."""
        if not self.pid_file.exists():
            return None
        record = orjson.loads(self.pid_file.read_bytes())
        pid, marker = int(record["pid"]), str(record["marker"])
        if marker and marker in _cmdline(pid):
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def running(self) -> bool:
        return self.pid() is not None

    def start(self, argv: Sequence[str], env: Mapping[str, str], marker: str) -> int:
        """Start detached; ``marker`` is a string unique to this command line."""
        if (pid := self.pid()) is not None:
            return pid
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
        # Until exec() completes, /proc shows the forked Python's command line; wait for
        # ours so that running() (which checks the marker) never sees a stranger.
        deadline = time.monotonic() + 10
        while marker not in _cmdline(proc.pid) and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited at once; log {self.log_file}:\n{tail(self.log_file)}"
                )
            time.sleep(0.01)
        self.pid_file.write_bytes(orjson.dumps({"pid": proc.pid, "marker": marker}))
        return proc.pid

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready`` until true; fail early, with the log, if the process died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise ServiceError(
                    f"{self.name} exited while waiting for {what}; log {self.log_file}:\n"
                    f"{tail(self.log_file)}"
                )
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.2)
        raise ServiceError(
            f"{self.name}: {what} not reached in {timeout:.0f}s; log {self.log_file}:\n"
            f"{tail(self.log_file)}"
        )

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM the process group, SIGKILL after ``timeout``. True if it was running."""
        pid = self.pid()
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.1)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            while pid_alive(pid):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return True


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
