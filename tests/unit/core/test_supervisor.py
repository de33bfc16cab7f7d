"""The worker supervisor (``core.process``) on real child processes.

Children are small Python programs that count their starts in a file, so each test sees
exactly how many times the supervisor started them and with what outcome.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.config import RestartConfig
from core.process import ChildSupervisor

FAST = RestartConfig(max_restarts=3, window_s=60.0, backoff_s=0.01, max_backoff_s=0.05)


def child(tmp_path: Path, body: str) -> list[str]:
    """argv of a child that appends a line to ``starts`` on every start, then runs ``body``
    (``n`` is its start number, from 1)."""
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, pathlib, signal, sys, time
            starts = pathlib.Path(sys.argv[1])
            with starts.open("a") as f:
                f.write(f"{os.getpid()}\\n")
            n = len(starts.read_text().split())
            """
        )
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script), str(tmp_path / "starts")]


def starts(tmp_path: Path) -> list[int]:
    path = tmp_path / "starts"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_crashed_child_is_restarted_until_it_exits_cleanly(tmp_path: Path) -> None:
    argv = child(tmp_path, "sys.exit(3 if n <= 2 else 0)")
    supervisor = ChildSupervisor(argv, FAST)
    assert supervisor.run() == 0
    assert len(starts(tmp_path)) == 3
    assert supervisor.restarts == 2


def test_a_crash_loop_gives_up_with_the_childs_exit_code(tmp_path: Path) -> None:
    argv = child(tmp_path, "sys.exit(7)")
    supervisor = ChildSupervisor(argv, FAST)
    assert supervisor.run() == 7
    assert len(starts(tmp_path)) == FAST.max_restarts + 1


def test_zero_restarts_means_the_first_crash_is_final(tmp_path: Path) -> None:
    argv = child(tmp_path, "sys.exit(5)")
    assert ChildSupervisor(argv, FAST.model_copy(update={"max_restarts": 0})).run() == 5
    assert len(starts(tmp_path)) == 1


def test_a_child_killed_by_a_signal_counts_as_a_crash(tmp_path: Path) -> None:
    argv = child(tmp_path, "if n == 1: os.kill(os.getpid(), signal.SIGKILL)")
    supervisor = ChildSupervisor(argv, FAST)
    assert supervisor.run() == 0
    assert len(starts(tmp_path)) == 2


def test_a_child_that_ran_longer_than_the_window_resets_the_count(tmp_path: Path) -> None:
    # every run outlives the window, so five crashes in a row never exhaust one restart
    argv = child(tmp_path, "time.sleep(0.3); sys.exit(1 if n <= 5 else 0)")
    policy = RestartConfig(max_restarts=1, window_s=0.2, backoff_s=0.0)
    assert ChildSupervisor(argv, policy).run() == 0
    assert len(starts(tmp_path)) == 6


def _supervisor_process(tmp_path: Path, argv: list[str]) -> subprocess.Popen[bytes]:
    """The supervisor in its own process (signal handlers live in the main thread)."""
    program = textwrap.dedent(
        f"""
        import sys
        from core.process import ChildSupervisor
        from core.config import RestartConfig
        policy = RestartConfig(max_restarts=3, backoff_s=0.01)
        sys.exit(ChildSupervisor({argv!r}, policy).run())
        """
    )
    return subprocess.Popen([sys.executable, "-c", program], start_new_session=True)


def _wait_for(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); its state in /proc says it has exited
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] == "Z"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_reaches_the_child_once_and_is_not_followed_by_a_restart(
    tmp_path: Path, signum: int
) -> None:
    stopped, ready = tmp_path / "stopped", tmp_path / "ready"
    argv = child(
        tmp_path,
        f"""
        def on_stop(signum, frame):
            with open({str(stopped)!r}, "a") as f:
                f.write(f"{{signum}}\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        sys.exit(1)
        """,
    )
    supervisor = _supervisor_process(tmp_path, argv)
    try:
        _wait_for(lambda: len(starts(tmp_path)) == 1)
        _wait_for(ready.exists)  # the child's handlers are installed after its start line
        supervisor.send_signal(signum)  # the supervisor only, not its process group
        assert supervisor.wait(20) == 0
    finally:
        supervisor.kill()
    expected = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
    assert [int(s) for s in stopped.read_text().split()] == [expected]
    assert len(starts(tmp_path)) == 1


def test_a_child_does_not_outlive_a_killed_supervisor(tmp_path: Path) -> None:
    argv = child(tmp_path, "time.sleep(60)")
    supervisor = _supervisor_process(tmp_path, argv)
    try:
        _wait_for(lambda: len(starts(tmp_path)) == 1)
        supervisor.kill()
        supervisor.wait(20)
        (pid,) = starts(tmp_path)
        _wait_for(lambda: _gone(pid))
    finally:
        supervisor.kill()


def _forking_supervisor(tmp_path: Path, body: str) -> subprocess.Popen[bytes]:
    """A supervisor whose worker is a fork of itself (``argv`` None) running ``body``, in
    its own process; the worker counts its starts as ``child`` does."""
    program = textwrap.dedent(
        f"""
        import os, pathlib, signal, sys, time
        from core.process import ChildSupervisor
        from core.config import RestartConfig
        policy = RestartConfig(max_restarts=3, window_s=60.0, backoff_s=0.01, max_backoff_s=0.05)
        supervisor = ChildSupervisor(None, policy)
        code = supervisor.run()
        if code is not None:
            print("restarts", supervisor.restarts, flush=True)
            sys.exit(code)
        starts = pathlib.Path({str(tmp_path / "starts")!r})
        with starts.open("a") as f:
            f.write(f"{{os.getpid()}}\\n")
        n = len(starts.read_text().split())
        """
    )
    return subprocess.Popen(
        [sys.executable, "-c", program + textwrap.dedent(body)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )


def test_a_forked_worker_is_restarted_after_a_crash_and_its_code_is_the_supervisors(
    tmp_path: Path,
) -> None:
    supervisor = _forking_supervisor(tmp_path, "sys.exit(3 if n <= 2 else 0)")
    out, _ = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0
    assert out.decode().split() == ["restarts", "2"]  # printed by the supervisor only
    pids = starts(tmp_path)
    assert len(set(pids)) == 3 and supervisor.pid not in pids


def test_a_forked_worker_gets_the_stop_signal_and_dies_with_a_killed_supervisor(
    tmp_path: Path,
) -> None:
    stopped, ready = tmp_path / "stopped", tmp_path / "ready"
    body = f"""
        def on_stop(signum, frame):
            with open({str(stopped)!r}, "a") as f:
                f.write(f"{{signum}}\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_stop)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        """
    supervisor = _forking_supervisor(tmp_path, body)
    try:
        _wait_for(ready.exists)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(20) == 0
        assert [int(s) for s in stopped.read_text().split()] == [signal.SIGTERM]
        assert len(starts(tmp_path)) == 1
    finally:
        supervisor.kill()
    ready.unlink()
    supervisor = _forking_supervisor(
        tmp_path, "open(" + repr(str(ready)) + ", 'w').close(); time.sleep(60)"
    )
    try:
        _wait_for(ready.exists)
        supervisor.kill()
        supervisor.wait(20)
        _wait_for(lambda: _gone(starts(tmp_path)[-1]))
    finally:
        supervisor.kill()
