"""Roles forked from a prefork server (``core.prefork``), on real processes.

The preloaded module is a small one that records every import of itself in a file, and
the role module reports what it found (its arguments, environment, directory, whether the
preloaded module was already there) in its log, so each test sees what a role forked
from the server runs with, against what ``python -m`` would give it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from core.prefork import PreforkServer
from core.process import Launcher, LaunchError, RoleSpec

pytestmark = pytest.mark.unit

PRELOADED = "heavy_library"
ROLE = "role_main"


def modules(tmp_path: Path) -> dict[str, str]:
    """Two modules in ``tmp_path`` and an environment that finds them (and ``core``)."""
    imports = tmp_path / "imports"
    (tmp_path / f"{PRELOADED}.py").write_text(
        f"import os\nwith open({str(imports)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
    )
    (tmp_path / f"{ROLE}.py").write_text(
        textwrap.dedent(
            f"""
            import json, os, sys, time
            print(json.dumps({{
                "argv": sys.argv[1:],
                "colour": os.environ.get("COLOUR"),
                "cwd": os.getcwd(),
                "path": sys.path[:2],
                "preloaded": {PRELOADED!r} in sys.modules,
                "title": open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode(),
            }}))
            action = sys.argv[1]
            if action == "sleep":
                open(sys.argv[2], "w").close()
                time.sleep(60)
            if action == "raise":
                raise RuntimeError("the role failed")
            sys.exit(int(action))
            """
        )
    )
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).parents[3])])
    return {**os.environ, "PYTHONPATH": path}


def role_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", ROLE, *args]


def report(log: Path) -> dict[str, object]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return dict(orjson.loads(lines[-1]))


def imports(tmp_path: Path) -> list[str]:
    return (tmp_path / "imports").read_text().split()


def wait_for(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    env = modules(tmp_path)
    server = PreforkServer([PRELOADED], env, tmp_path / "prefork.log", ready_timeout_s=60)
    yield server
    server.close()


def test_a_forked_role_runs_its_module_as_python_m_would_with_its_imports_done(
    tmp_path: Path, server: PreforkServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    extra = tmp_path / "extra"
    path = os.pathsep.join([str(extra), server.env["PYTHONPATH"]])
    env = {**server.env, "COLOUR": "teal", "PYTHONPATH": path}
    logs = [tmp_path / f"role-{i}.log" for i in range(2)]
    monkeypatch.chdir(workdir)  # the role runs where its launcher is
    roles = [server.spawn(role_argv("3", f"extra-{i}"), env, log) for i, log in enumerate(logs)]
    assert [role.wait(30) for role in roles] == [3, 3]
    assert server.reaped_cpu_s > 0  # what the two roles used, reported by the server
    for i, log in enumerate(logs):
        seen = report(log)
        assert seen["argv"] == ["3", f"extra-{i}"]
        assert seen["colour"] == "teal" and seen["cwd"] == str(workdir)
        assert seen["path"] == [str(workdir), str(extra)]  # as python -m there would have
        assert seen["preloaded"] is True
        assert str(seen["title"]).split() == role_argv("3", f"extra-{i}")  # what ps shows
    assert len(imports(tmp_path)) == 1  # imported by the server, by neither role


def test_a_crash_and_a_kill_are_reported_as_popen_would(
    tmp_path: Path, server: PreforkServer
) -> None:
    crashed = server.spawn(role_argv("raise"), server.env, tmp_path / "crash.log")
    assert crashed.wait(30) == 1
    assert "RuntimeError: the role failed" in (tmp_path / "crash.log").read_text()
    started = tmp_path / "started"
    sleeper = server.spawn(role_argv("sleep", str(started)), server.env, tmp_path / "s.log")
    wait_for(started.exists)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    os.killpg(sleeper.pid, signal.SIGKILL)  # the role leads its own process group
    assert sleeper.wait(30) == -signal.SIGKILL
    assert sleeper.returncode == -signal.SIGKILL


def test_roles_die_with_the_server_and_the_next_role_starts_a_new_one(
    tmp_path: Path, server: PreforkServer
) -> None:
    started = tmp_path / "started"
    sleeper = server.spawn(role_argv("sleep", str(started)), server.env, tmp_path / "s.log")
    wait_for(started.exists)
    assert server._proc is not None
    server._proc.kill()
    assert sleeper.wait(30) == -signal.SIGKILL
    wait_for(lambda: gone(sleeper.pid))
    again = server.spawn(role_argv("0"), server.env, tmp_path / "again.log")
    assert again.wait(30) == 0
    assert len(imports(tmp_path)) == 2  # a second server imported it again


def test_a_server_that_cannot_import_says_so_with_its_log(tmp_path: Path) -> None:
    server = PreforkServer(["no_such_module_here"], modules(tmp_path), tmp_path / "p.log", 60)
    try:
        with pytest.raises(LaunchError, match="No module named 'no_such_module_here'"):
            server.spawn(role_argv("0"), server.env, tmp_path / "role.log")
    finally:
        server.close()


def test_a_server_whose_imports_started_a_thread_refuses_to_fork(tmp_path: Path) -> None:
    env = modules(tmp_path)
    (tmp_path / "threaded_library.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), name='poller', daemon=True).start()\n"
    )
    server = PreforkServer([PRELOADED, "threaded_library"], env, tmp_path / "p.log", 60)
    try:
        with pytest.raises(LaunchError, match=r"started threads \['poller'\]"):
            server.spawn(role_argv("0"), server.env, tmp_path / "role.log")
    finally:
        server.close()


def test_only_python_m_commands_are_forked(tmp_path: Path, server: PreforkServer) -> None:
    assert server.can_fork(role_argv("0"))
    assert not server.can_fork(["/bin/true"])
    assert not server.can_fork(["/usr/bin/python3", "-m", ROLE])  # another interpreter
    with pytest.raises(ValueError, match="not a"):
        server.spawn(["/bin/true"], server.env, tmp_path / "role.log")


def test_garbage_requests_are_refused_and_the_server_keeps_serving(tmp_path: Path) -> None:
    replies_r, replies_w = os.pipe()
    server = subprocess.Popen(
        [sys.executable, "-m", "core.prefork", "--reply-fd", str(replies_w), PRELOADED],
        stdin=subprocess.PIPE,
        env=modules(tmp_path),
        pass_fds=(replies_w,),
    )
    os.close(replies_w)
    valid = {
        "id": 3,
        "module": ROLE,
        "args": ["4"],
        "env": modules(tmp_path),
        "cwd": str(tmp_path),
        "log_file": str(tmp_path / "role.log"),
    }
    assert server.stdin is not None
    garbage = [
        b"not json",
        b'{"id": 2, "module": "m"}',  # fields missing
        b"[]",
        orjson.dumps({**valid, "id": 5, "args": "4"}),  # a string where a list belongs
        orjson.dumps({**valid, "id": 6, "module": ""}),
        orjson.dumps({**valid, "id": 7, "shell": "rm -rf /"}),  # a field nobody reads
    ]
    for line in [*garbage, orjson.dumps(valid)]:
        server.stdin.write(line + b"\n")
    server.stdin.flush()
    answers = []
    with os.fdopen(replies_r, "rb") as replies:
        while not any("exited" in answer for answer in answers):
            answers.append(orjson.loads(replies.readline()))
        server.stdin.close()
        assert server.wait(30) == 0
    refused = [answer for answer in answers if "refused" in answer]
    assert [answer["id"] for answer in refused] == [None, 2, None, 5, 6, 7]
    (started,) = [answer for answer in answers if "started" in answer]
    assert started["id"] == 3
    (exited,) = [answer for answer in answers if answer.get("exited") == started["started"]]
    assert exited["code"] == 4 and exited["cpu_s"] > 0


def test_a_launcher_forks_restarts_and_stops_its_roles_through_the_server(
    tmp_path: Path, server: PreforkServer
) -> None:
    started = tmp_path / "started"
    launcher = Launcher(tmp_path / "logs", server)
    role = launcher.add(RoleSpec("sleeper", role_argv("sleep", str(started)), server.env))
    launcher.start("sleeper", ready_timeout_s=30)
    wait_for(started.exists)
    first = role.pid
    started.unlink()
    role.restart(timeout_s=10)
    wait_for(started.exists)
    assert role.pid != first and role.running()
    launcher.stop_all(timeout_s=10)
    assert role.returncode() == -signal.SIGTERM
    assert launcher.leftovers() == []
    assert server._proc is None  # stopping the roles stopped the server
    log = (tmp_path / "logs" / "sleeper.log").read_text()
    assert log.count("--- start") == 2 and log.count('"preloaded": true') == 2
