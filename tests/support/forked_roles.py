"""Role processes the tests start themselves, forked from a prefork server.

A trainer life or a stream worker a system test starts imports torch and transformers as
any role does (most of its CPU in a short life), and the suite starts dozens of them. So
they are forked from one prefork server per test process (``core.prefork``), started on
first use, as ``rollstream up`` forks its roles: the same ``python -m rollstream``
command, environment, directory and log, a process and session of its own that a test
signals, kills and waits for as it would an exec'd one. Exec'd roles stay covered by the
tests that start ``rollstream`` commands as a user types them (first-try blocks, by hand).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from core.prefork import ForkedRole, PreforkServer

_servers: list[PreforkServer] = []  # this test process's server, once started


def start_role(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path
) -> ForkedRole:
    """``argv`` (``<python> -m ...``) forked from this test process's prefork server."""
    if not _servers:
        from rollstream.up.plan import PRELOADED  # on first use: the CPU plugin imports us

        server = PreforkServer(
            PRELOADED, dict(os.environ), log_path.parent / "prefork.log", ready_timeout_s=300
        )
        atexit.register(server.close)
        _servers.append(server)
    return _servers[0].spawn(argv, env, log_path, cwd=cwd)


def reaped_cpu_s() -> float:
    """CPU seconds of the forked roles that have exited so far (the server reaped them,
    so this process's ``getrusage`` does not count them)."""
    return sum(server.reaped_cpu_s for server in _servers)
