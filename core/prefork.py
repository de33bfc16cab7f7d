"""Roles forked from one interpreter that has already imported torch and transformers.

A model role started as ``python -m rollstream ... serve`` spends most of a short run's CPU
importing torch and transformers (about 9 CPU-seconds on a 2-core machine), and every
model role pays it again: ``rollstream up`` starts three to six of them and starts them
again after a crash. A *prefork server* imports those modules once and forks each role
from itself. The role then runs the same module with the same arguments, environment,
working directory and log file, in its own session and dying with the server, as the
command would; it only finds its imports done.

The server is single-threaded, never runs role code itself (every fork starts from the
same state) and refuses to serve if importing initialised CUDA or started a thread, which
a forked child could not use. It dies with its launcher, and its roles die with it
(``PR_SET_PDEATHSIG``), as roles started by ``exec`` die with theirs.

Protocol: the launcher writes one JSON ``ForkRequest`` a line to the server's stdin; the
server answers on a pipe, one JSON line when it is ready, one per started role (its pid)
and one per exited role (its code, negative for a signal, as ``subprocess.Popen`` says,
and the CPU seconds it used, which a launcher cannot read from ``getrusage``: the server
reaped it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import runpy
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import orjson
import setproctitle
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.process import LaunchError, die_with_parent, tail


class ForkRequest(BaseModel):
    """One role to fork: ``python -m <module> <args>`` as the launcher would exec it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: int
    module: str = Field(min_length=1)
    args: list[str]
    env: dict[str, str]
    cwd: str
    log_file: str
    cpus: list[int] | None = None


def module_command(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` when ``argv`` is ``<this python> -m module args``: the commands a
    prefork server can run; None for any other command (it is started as it is)."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], list(argv[3:])
    return None


# --- the launcher's side ---------------------------------------------------------------------


class ForkedRole:
    """A role the server forked: the part of ``subprocess.Popen`` a launcher uses."""

    def __init__(self, pid: int, server: PreforkServer) -> None:
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        """To the role's process only, as ``Popen.send_signal``."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreforkServer:
    """Starts the server on first use and forks roles through it. Thread-safe."""

    def __init__(
        self, preload: Sequence[str], env: Mapping[str, str], log_file: Path, ready_timeout_s: float
    ) -> None:
        self.preload = list(preload)
        self.env = dict(env)
        self.log_file = log_file
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._changed = threading.Condition()
        self._ready = False
        self._started: dict[int, int | str] = {}  # request id: pid, or the server's error
        self._exits: dict[int, int] = {}  # pid: exit code
        self.reaped_cpu_s = 0.0  # CPU of the roles that have exited, as getrusage counts
        self._next_id = 0

    @staticmethod
    def can_fork(argv: Sequence[str]) -> bool:
        return module_command(argv) is not None

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_file: Path,
        cpus: frozenset[int] | None = None,
        cwd: Path | None = None,
    ) -> ForkedRole:
        """Fork ``argv`` (``python -m module ...``, see ``module_command``) in ``cwd``
        (default: this process's) and return it once it runs."""
        command = module_command(argv)
        if command is None:
            raise ValueError(f"not a `{sys.executable} -m module` command: {list(argv)}")
        with self._changed:
            self._ensure_started()
            self._wait_for(lambda: self._ready, self.ready_timeout_s, "to import its modules")
            self._next_id += 1
            request = ForkRequest(
                id=self._next_id,
                module=command[0],
                args=command[1],
                env=dict(env),
                cwd=str(cwd or os.getcwd()),
                log_file=str(log_file),
                cpus=sorted(cpus) if cpus else None,
            )
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write(request.model_dump_json().encode() + b"\n")
            self._proc.stdin.flush()
            self._wait_for(lambda: request.id in self._started, 30.0, "to fork a role")
            answer = self._started.pop(request.id)
        if isinstance(answer, str):
            raise LaunchError(f"prefork server refused {list(argv)}: {answer}")
        return ForkedRole(answer, self)

    def start(self) -> None:
        """Start the server's imports now, so that they overlap what the launcher does
        before its first role (``spawn`` starts it otherwise)."""
        with self._changed:
            self._ensure_started()

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._exits:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
            return self._exits[pid]

    def close(self) -> None:
        """Stop the server (its roles, if any are left, die with it)."""
        with self._changed:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # end of requests: the server exits
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # Callers hold self._changed from here on.

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._ready = False
        replies_r, replies_w = os.pipe()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "core.prefork", "--reply-fd", str(replies_w), *self.preload],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                pass_fds=(replies_w,),
                start_new_session=True,  # a Ctrl-C for the launcher is not for the server
                preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )
        os.close(replies_w)
        replies = os.fdopen(replies_r, "rb")
        threading.Thread(
            target=self._read_replies,
            args=(replies, self._proc, set()),
            name="prefork",
            daemon=True,
        ).start()

    def _wait_for(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            proc = self._proc
            if proc is None or proc.poll() is not None:
                raise LaunchError(
                    f"prefork server exited with code {None if proc is None else proc.returncode}; "
                    f"log {self.log_file}:\n{tail(self.log_file)}"
                )
            if time.monotonic() > deadline:
                raise LaunchError(f"prefork server took over {timeout_s:.0f}s {what}")
            self._changed.wait(0.2)

    def _read_replies(
        self, replies: IO[bytes], proc: subprocess.Popen[bytes], forked: set[int]
    ) -> None:
        """One server's answers, until it exits; its roles then died with it (SIGKILL)."""
        with replies:
            for line in replies:
                reply = orjson.loads(line)
                with self._changed:
                    if "ready" in reply:
                        self._ready = True
                    elif "started" in reply:
                        self._started[reply["id"]] = reply["started"]
                        forked.add(reply["started"])
                    elif "refused" in reply:
                        self._started[reply["id"]] = reply["refused"]
                    elif "exited" in reply:
                        self._exits[reply["exited"]] = reply["code"]
                        self.reaped_cpu_s += reply["cpu_s"]
                        forked.discard(reply["exited"])
                    self._changed.notify_all()
        proc.wait()
        with self._changed:
            for pid in forked:
                self._exits.setdefault(pid, -signal.SIGKILL)
            self._changed.notify_all()


# --- the server ----------------------------------------------------------------------------


def serve(requests: int, replies: IO[bytes]) -> ForkRequest | None:
    """Fork a role per request and report it and its exit, until the requests end.
    Returns only in a forked child, with the request it is to run."""

    def say(message: dict[str, Any]) -> None:
        replies.write(orjson.dumps(message) + b"\n")
        replies.flush()

    say({"ready": True})
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.1)
        for pid, code, cpu_s in _reap():
            say({"exited": pid, "code": code, "cpu_s": round(cpu_s, 3)})
        if not readable:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:
            return None  # the launcher is gone; roles still running die with us
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                request = ForkRequest.model_validate_json(line)
            except ValidationError as err:
                say({"refused": f"malformed request: {err}", "id": _request_id(line)})
                continue
            pid = os.fork()
            if pid == 0:  # the role: its stdin becomes /dev/null in become_role
                replies.close()
                return request
            say({"started": pid, "id": request.id})


def _request_id(line: bytes) -> int | None:
    """The id of a malformed request, where it has one, so that its sender hears back."""
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
        found = orjson.loads(line).get("id")
        return found if isinstance(found, int) else None
    return None


def _reap() -> list[tuple[int, int, float]]:
    """Exited roles: pid, exit code, CPU seconds (theirs and their reaped children's)."""
    exited = []
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return exited
        if pid == 0:
            return exited
        cpu_s = usage.ru_utime + usage.ru_stime
        exited.append((pid, os.waitstatus_to_exitcode(status), cpu_s))


def become_role(request: ForkRequest) -> None:
    """In the forked child: take the role's session, log, environment and cores, then run
    its module as ``python -m`` would. Its exit is this interpreter's ordinary exit."""
    os.setsid()
    die_with_parent(signal.SIGKILL)
    if request.cpus:
        os.sched_setaffinity(0, request.cpus)
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    # what ps shows; before the environment changes, which moves what setproctitle uses
    setproctitle.setproctitle(shlex.join([sys.executable, "-m", request.module, *request.args]))
    search_path = _module_search_path(request)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    sys.path[:] = search_path
    sys.argv = [request.module, *request.args]
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


def _module_search_path(request: ForkRequest) -> list[str]:
    """``sys.path`` as ``python -m`` in the role's directory with its ``PYTHONPATH`` would
    start it: that directory, then those entries, then the server's own library paths
    (read while the environment is still the server's)."""
    python_path = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    server_python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    libraries = [p for p in sys.path[1:] if p not in server_python_path]
    return [request.cwd, *python_path, *libraries]


def _fork_hazard() -> str | None:
    """What the imports left that a forked role could not use: CUDA, which cannot be used
    again after a fork, or threads, which a fork does not copy."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "initialised CUDA"
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    return f"started threads {threads}" if threads else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.prefork", description=__doc__)
    parser.add_argument("--reply-fd", type=int, required=True, help="Pipe for the answers.")
    parser.add_argument("preload", nargs="*", help="Modules to import before forking.")
    options = parser.parse_args(argv)
    replies = os.fdopen(options.reply_fd, "wb")
    for name in options.preload:
        importlib.import_module(name)
    hazard = _fork_hazard()
    if hazard is not None:
        print(f"importing {options.preload} {hazard}: roles cannot be forked")
        return 2
    gc.freeze()  # a role's collections skip what is here: its pages stay shared
    request = serve(sys.stdin.fileno(), replies)
    if request is not None:
        become_role(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())
