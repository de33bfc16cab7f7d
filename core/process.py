"""Child processes, in one place: services, supervised roles, restarted workers.

Three uses, each a section below:

* ``ServiceProcess``: a long-running service (broker, object store) detached into its own
  session with a pid file and a log file, so that ``rollstream infra up`` can exit and a
  later ``rollstream infra down`` (another process) stops it by pid. The pid file also
  records the command line, so a recycled pid is never mistaken for ours.
* ``Launcher`` / ``RoleProcess``: ``rollstream up`` starts each role as the command a user
  would run on its own machine (exec'd, or forked from a prefork server that has done the
  command's imports: ``core.prefork``), each in its own session with its output in
  ``<log_dir>/<name>.log``; ``stop`` sends SIGTERM to the role's process group and
  SIGKILL after a timeout.
* ``ChildSupervisor``: runs a role's worker as a child (a command, or a fork of the
  supervisor) and starts it again when it crashes, within a crash-loop limit
  (``RestartConfig``) in the spirit of systemd's ``StartLimitBurst``. A Faust worker that
  hits an error it cannot recover from in place (the broker aborted its transaction while
  restarting, a fenced producer) crashes with its event loop; a restart rebuilds the table
  from its changelog and resumes at the committed offsets, so an aborted transaction's
  effects are redone exactly once. SIGTERM and SIGINT are forwarded to the child (SIGHUP
  as SIGTERM), which stops cleanly and is not restarted.

Every child gets ``PR_SET_PDEATHSIG`` (``die_with_parent``), so none outlives a parent
killed by SIGKILL; trainer ranks that torchrun started set it themselves
(``die_with_rank_launcher``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Protocol

import orjson

from core.config import RestartConfig, default_cache_dir

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a child before exec: have the kernel send ``signum`` when the parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def die_with_rank_launcher() -> None:
    """In a rank that torch's launcher started (torchrun sets ``TORCHELASTIC_RUN_ID``): die
    when the launcher does. torchrun starts each rank in a session of its own and stops
    them when it is told to stop, but killed outright (SIGKILL, as a role is when the
    ``up`` above it dies) it leaves them waiting on a world that is gone. The rank's state
    is its last checkpoint, so a kill loses nothing a restart would not resume."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    die_with_parent(signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the line above: orphaned to init
        os._exit(1)


# --- services: detached, found again by pid file -------------------------------------------


class ServiceError(RuntimeError):
    """A service failed to start, answer or stop; the message points at its log."""


LOWEST_CHOSEN_PORT = 10_000
"""Ports below this are left to services a user configures by number."""


PORT_LEASE_S = 600.0
"""How long a drawn port stays kept from every other chooser on the machine: long enough
for whoever drew it to start and bind it (a role under load takes minutes)."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that nothing is bound to right now.

    Whoever asks binds the port seconds later, in another process (a role ``up`` starts).
    A port from the kernel's ephemeral range may meanwhile become the source port of any
    outgoing connection on the machine (a Kafka client's, an S3 call's), and the role then
    fails with "address already in use"; so the ports are drawn at random from below that
    range, where only another chooser's draw can land. Each draw is leased for
    ``PORT_LEASE_S`` in a file every chooser of this user reads and writes under a lock
    (``port_leases``), so two concurrent choosers never hand out the same port. Under an
    unusual range (under 1,000 ports below it) the kernel picks them."""
    first_ephemeral = _first_ephemeral_port()
    below_ephemeral = first_ephemeral - LOWEST_CHOSEN_PORT >= 1_000
    draw = random.SystemRandom()
    chosen: list[int] = []
    with port_leases() as leased, contextlib.ExitStack() as held:  # held: distinct
        while len(chosen) < count:
            port = draw.randrange(LOWEST_CHOSEN_PORT, first_ephemeral) if below_ephemeral else 0
            if port in leased:
                continue
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use (or held by this call already)
                continue
            chosen.append(int(sock.getsockname()[1]))
        until = time.time() + PORT_LEASE_S
        leased.update({port: until for port in chosen})
    return chosen


def port_lease_file() -> Path:
    """Where this user's choosers keep their leases: in the cache, outside any run."""
    return default_cache_dir() / "port-leases"


@contextlib.contextmanager
def port_leases() -> Iterator[dict[int, float]]:
    """The ports drawn in the last ``PORT_LEASE_S`` (port: lease end), locked against
    other choosers while the block runs; what the block adds is written back. Lines that
    do not parse are dropped. Without a usable file, no leases (the draw is still random)."""
    path = port_lease_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+", errors="replace")
    except OSError:
        yield {}
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        now = time.time()
        leased: dict[int, float] = {}
        for line in handle.read().splitlines():
            with contextlib.suppress(ValueError):
                port, until = line.split()
                if float(until) > now:
                    leased[int(port)] = float(until)
        yield leased
        handle.seek(0)
        handle.truncate()
        handle.write("".join(f"{port} {until:.0f}\n" for port, until in leased.items()))


def free_port() -> int:
    """One port as ``free_ports`` chooses them."""
    return free_ports(1)[0]


def _first_ephemeral_port() -> int:
    try:
        low = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        return int(low)
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


START_MARK = "--- start"
"""How a role's log marks each start of the role (``--- start 2: argv``)."""


def tail(path: Path, lines: int = 30) -> str:
    """Last lines of a log, for error messages."""
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def last_error(path: Path, lines: int = 200) -> str:
    """The last line of a log's tail that reads as an error (``...Error: ...``, a Python
    exception's last line, ``Error:``), else nothing: what to show of a role that exited,
    so the cause is on the screen and not only in the log."""
    if not path.exists():
        return ""
    text = [line.strip() for line in tail(path, lines).splitlines() if line.strip()]
    starts = [i for i, line in enumerate(text) if line.startswith(START_MARK)]
    text = text[starts[-1] + 1 :] if starts else text  # this incarnation's lines only
    for line in reversed(text):
        head = line.split(":", 1)[0]
        if ":" in line and (head.endswith(("Error", "Exception", "Exit")) or head == "Error"):
            return line
    return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# What any service may read from the parent's environment: the rest (cloud keys, tokens)
# stays out of a process that has no use for it and that others may be able to inspect.
SERVICE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR")


def service_env(*names: str, **deliberate: str) -> dict[str, str]:
    """The whole environment of a service: the parent's ``SERVICE_ENV``, locale
    (``LC_*``) and ``names``, plus the ``deliberate`` settings."""
    keep = set(SERVICE_ENV) | set(names)
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("LC_")}
    return env | deliberate


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

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        marker: str,
        cwd: Path | None = None,
        umask: int = -1,
    ) -> int:
        """Start detached (in ``cwd`` if given, with ``umask`` unless -1); ``marker`` is a
        string unique to this command line."""
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
                cwd=cwd,
                start_new_session=True,
                umask=umask,
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
            _kill_group(pid)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> bool:
        """SIGKILL the process group at once, no shutdown at all (crash tests); True if
        it was running."""
        pid = self.pid()
        if pid is None:
            return False
        _kill_group(pid)
        self.pid_file.unlink(missing_ok=True)
        return True


def _kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` and wait until the leader is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    while pid_alive(pid):
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


# --- roles: started, watched and stopped by `rollstream up` ----------------------------


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


class RunningRole(Protocol):
    """A started role's process: a ``subprocess.Popen`` or a forked role."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class RoleForker(Protocol):
    """Forks ``python -m`` roles instead of exec'ing them (``core.prefork.PreforkServer``)."""

    def can_fork(self, argv: Sequence[str]) -> bool: ...

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_file: Path,
        cpus: frozenset[int] | None = None,
    ) -> RunningRole: ...

    def close(self) -> None: ...


def _child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: die with the launcher, pin to cores."""

    def setup() -> None:
        die_with_parent(signal.SIGKILL)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class RoleProcess:
    """One supervised role. Not thread-safe: one supervisor drives it. With a prefork
    server, a ``python -m`` role is forked from it (``core.prefork``) instead of exec'd."""

    def __init__(self, spec: RoleSpec, log_dir: Path, prefork: RoleForker | None = None) -> None:
        self.spec = spec
        self.log_file = log_dir / f"{spec.name}.log"
        self.prefork = prefork
        self.proc: RunningRole | None = None
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
            log.write(f"{START_MARK} {self.starts + 1}: {' '.join(self.spec.argv)}\n".encode())
            log.flush()
        if self.prefork is not None and self.prefork.can_fork(self.spec.argv):
            self.proc = self.prefork.spawn(self.spec.argv, env, self.log_file, self.spec.cpus)
        else:
            self.proc = self._exec(env)
        self.starts += 1
        self.started_at = time.monotonic()
        return self.proc.pid

    def _exec(self, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        with self.log_file.open("ab") as log:
            return subprocess.Popen(
                list(self.spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_child_setup(self.spec.cpus),  # before any thread starts
            )

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

    def __init__(self, log_dir: Path, prefork: RoleForker | None = None) -> None:
        self.log_dir = log_dir
        self.prefork = prefork
        self.roles: dict[str, RoleProcess] = {}

    def add(self, spec: RoleSpec) -> RoleProcess:
        if spec.name in self.roles:
            raise ValueError(f"role {spec.name!r} added twice")
        role = RoleProcess(spec, self.log_dir, self.prefork)
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
        if self.prefork is not None:
            self.prefork.close()

    def leftovers(self) -> list[int]:
        """Pids of started roles that still exist (should be empty after ``stop_all``)."""
        return [r.pid for r in self.roles.values() if r.pid is not None and pid_alive(r.pid)]


# --- a worker restarted when it crashes ----------------------------------------------------


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ForkedWorker:
    """A forked child, as much of ``subprocess.Popen`` as the supervisor uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        code = self._reap(0)
        if code is None:
            raise ChildProcessError(f"pid {self.pid} is not a child of this process")
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def _reap(self, flags: int) -> int | None:
        # a stop signal's handler may poll (and reap) while wait() blocks: the retried
        # waitpid then finds no child, and the code is already here
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, flags)
                if pid != 0:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class ChildSupervisor:
    """Starts the worker, restarts it after a crash within ``policy``, forwards stop signals.

    The worker is the command ``argv`` or, with ``argv`` None, a fork of this process:
    ``run`` then returns None in the forked child (as ``os.fork`` returns 0 there), which
    goes on to be the worker. A fork hands the worker what this process has imported (a
    role forked from a prefork server has torch and transformers) and costs nothing more
    than an exec when it has not."""

    def __init__(
        self,
        argv: Sequence[str] | None,
        policy: RestartConfig,
        *,
        env: Mapping[str, str] | None = None,
        name: str = "worker",
    ) -> None:
        self.argv = None if argv is None else list(argv)
        self.policy = policy
        self.env = dict(os.environ if env is None else env)
        self.name = name
        self.restarts = 0  # in total, for the log and the tests
        self._stopping = threading.Event()  # set by a stop signal; cuts a backoff short
        self._child: subprocess.Popen[bytes] | ForkedWorker | None = None
        self._stop_signal: int | None = None

    def run(self) -> int | None:
        """Run until the child exits cleanly, is told to stop, or crashes too often;
        returns the exit code to leave with (None in a forked child: be the worker)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED_SIGNALS}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int | None:
        recent = 0  # crashes inside the current window
        while True:
            started = time.monotonic()
            self._child = self._start_child()
            if self._child is None:
                return None  # the forked child
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

    def _start_child(self) -> subprocess.Popen[bytes] | ForkedWorker | None:
        if self.argv is not None:
            return subprocess.Popen(self.argv, env=self.env, preexec_fn=die_with_parent)
        parent = os.getpid()
        sys.stdout.flush()  # or the child writes what is buffered a second time
        sys.stderr.flush()
        pid = os.fork()
        if pid != 0:
            return ForkedWorker(pid)
        die_with_parent()
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)
        return None

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


# --- role shims: `python -m producers|streams|consumers` -----------------------------------


ROOT_OPTIONS = ("--config", "--state-dir", "--set", "--policy")


def exec_role_command(command: str, args: Sequence[str]) -> None:
    """Replace this process with ``python -m rollstream [--config F] <command> <args>``.

    The role packages' ``__main__`` shims call this: the ``rollstream`` command is the one
    CLI root, and a role package never imports the application above it. The root's
    options (``--config FILE``, ``--state-dir DIR``, ``--set KEY=VALUE``, ``--policy NAME``)
    are moved in front of the command.
    """
    head: list[str] = []
    rest: list[str] = []
    pending = list(args)
    while pending:
        arg = pending.pop(0)
        if arg in ROOT_OPTIONS and pending:
            head += [arg, pending.pop(0)]
        elif arg.split("=", 1)[0] in ROOT_OPTIONS:
            head.append(arg)
        else:
            rest.append(arg)
    argv = [sys.executable, "-m", "rollstream", *head, command, *rest]
    os.execv(sys.executable, argv)
