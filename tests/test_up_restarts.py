"""``rollstream up --restarts N``: a role that exits unexpectedly is started again, N times.

The supervision loop of ``up`` (``rollstream.up_supervise.supervise``) on real processes standing
in for the roles: a "producer" that crashes on its first start, and a "trainer" that
finishes (exit 0, as at ``max_steps``) once it sees the producer's second start; then a
"trainer" killed by SIGKILL in its first incarnation. The real roles are killed under the
same loop in ``tests/test_chaos.py``.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from core.process import Launcher, RoleSpec
from rollstream.config import load_config
from rollstream.up_display import Dashboard, TrainerLog
from rollstream.up_plan import Ports, plan_policies
from rollstream.up_supervise import StopFlag, supervise


def _script(path: Path, body: str) -> list[str]:
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def _launcher(tmp_path: Path) -> Launcher:
    starts = tmp_path / "producer-starts"
    launcher = Launcher(tmp_path / "logs")
    producer = f"""
        import pathlib, sys, time
        starts = pathlib.Path({str(starts)!r})
        with starts.open("a") as f:
            f.write("start\\n")
        if len(starts.read_text().split()) == 1:
            raise ValueError("example 5 has no prompt text")  # the first incarnation crashes
        time.sleep(120)
        """
    trainer = f"""
        import pathlib, sys, time
        starts = pathlib.Path({str(starts)!r})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if starts.exists() and len(starts.read_text().split()) >= 2:
                sys.exit(0)  # done, like a trainer at max_steps
            time.sleep(0.1)
        sys.exit(1)
        """
    launcher.add(RoleSpec("trainer", _script(tmp_path / "trainer.py", trainer)))
    launcher.add(RoleSpec("producer", _script(tmp_path / "producer.py", producer)))
    return launcher


def _run(tmp_path: Path, restarts: int) -> tuple[tuple[str, bool], int]:
    launcher = _launcher(tmp_path)
    outcome = _supervise(tmp_path, launcher, restarts)
    return outcome, launcher.roles["producer"].starts


def test_a_crashed_role_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    outcome, producer_starts = _run(tmp_path, restarts=1)
    assert outcome == ("max_steps reached", True)
    assert producer_starts == 2


def test_without_restarts_a_crashed_role_ends_the_run(tmp_path: Path) -> None:
    outcome, producer_starts = _run(tmp_path, restarts=0)
    # the cause, from the role's log, is on the screen
    assert outcome == (
        "producer exited with code 1: ValueError: example 5 has no prompt text",
        False,
    )
    assert producer_starts == 1


def _trainer_killed_once(tmp_path: Path) -> Launcher:
    """A "trainer" killed by SIGKILL in its first incarnation; the second finishes."""
    starts = tmp_path / "trainer-starts"
    trainer = f"""
        import os, pathlib, signal, sys, time
        starts = pathlib.Path({str(starts)!r})
        with starts.open("a") as f:
            f.write("start\\n")
        time.sleep(0.5)
        if len(starts.read_text().split()) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(0)  # the restarted trainer reaches max_steps
        """
    launcher = Launcher(tmp_path / "logs")
    launcher.add(RoleSpec("trainer", _script(tmp_path / "trainer.py", trainer)))
    idle = _script(tmp_path / "producer.py", "import time\ntime.sleep(120)\n")
    launcher.add(RoleSpec("producer", idle))
    return launcher


def _supervise(tmp_path: Path, launcher: Launcher, restarts: int) -> tuple[str, bool]:
    try:
        for role in launcher.roles.values():
            role.start()
        config = load_config(None, run_id="restarts")
        logs = {"": TrainerLog(tmp_path / "metrics.jsonl")}
        display = Dashboard(config, plan_policies(config, Ports.free()), logs)
        return supervise(launcher, display, StopFlag(), restarts)
    finally:
        launcher.stop_all(timeout_s=10)
        assert launcher.leftovers() == []


def test_a_killed_trainer_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    launcher = _trainer_killed_once(tmp_path)
    assert _supervise(tmp_path, launcher, restarts=2) == ("max_steps reached", True)
    assert launcher.roles["trainer"].starts == 2
    assert launcher.roles["producer"].starts == 1


def test_without_restarts_a_killed_trainer_ends_the_run(tmp_path: Path) -> None:
    launcher = _trainer_killed_once(tmp_path)
    assert _supervise(tmp_path, launcher, restarts=0) == ("trainer exited with code -9", False)
    assert launcher.roles["trainer"].starts == 1
