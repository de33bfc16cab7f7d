"""``rollstream up --restarts N``: a role that exits unexpectedly is started again, N times.

The supervision loop of ``up`` (``rollstream.up.supervise.supervise``) on real processes standing
in for the roles: a "producer" that crashes on its first start, and a "trainer" that
finishes (exit 0, as at ``max_steps``) once it sees the producer's second start; then a
"trainer" killed by SIGKILL in its first incarnation. The real roles are killed under the
same loop in ``tests/system/rollstream/test_chaos.py``.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from support.paths import REPO

from core.process import Launcher, RoleSpec
from rollstream.config.settings import load_config
from rollstream.up.display import Dashboard, RewardWatch, TrainerLog
from rollstream.up.plan import Ports, plan_policies
from rollstream.up.supervise import StopFlag, supervise


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
    assert _supervise(tmp_path, launcher, restarts=0) == (
        "trainer exited with code -9: killed by SIGKILL",
        False,
    )
    assert launcher.roles["trainer"].starts == 1


def test_a_trainer_a_guard_stopped_is_not_restarted_and_its_line_ends_the_run(
    tmp_path: Path,
) -> None:
    """The real ``run_trainer`` turns a guard's stop into exit status 3 and one line; `up`
    shows that line and does not restart the trainer (it would trip again)."""
    trainer = f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import consumers.trainer, infra.services
        from consumers.guards import GuardStop
        from rollstream.cli.train import run_trainer

        class Stopped:
            def __init__(self, *args):
                pass
            def install_signal_handlers(self):
                pass
            def run(self):
                raise GuardStop("guard 'flat_rewards' tripped at step 9 (stop): flat")

        class Services:
            def __init__(self, shared):
                pass
            def running(self, s3):
                return None

        consumers.trainer.Trainer = Stopped
        infra.services.Services = Services
        sys.exit(run_trainer(None, None))
        """
    launcher = Launcher(tmp_path / "logs")
    launcher.add(RoleSpec("trainer", _script(tmp_path / "trainer.py", trainer)))
    idle = _script(tmp_path / "producer.py", "import time\ntime.sleep(120)\n")
    launcher.add(RoleSpec("producer", idle))
    assert _supervise(tmp_path, launcher, restarts=2) == (
        "trainer exited with code 3: GuardExit: guard 'flat_rewards' tripped at step 9 "
        "(stop): flat",
        False,
    )
    assert launcher.roles["trainer"].starts == 1


def _failing_rows(path: Path, steps: int, share: float) -> None:
    rows = [
        {"step": s, "reward/mean": 0.0, "reward/fn_failed/accuracy": share,
         "reward/fn_failed/format": 0.0}
        for s in range(1, steps + 1)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize(("ends_run", "finished"), [(True, False), (False, True)])
def test_a_reward_function_failing_on_every_sample_is_seen(
    tmp_path: Path, ends_run: bool, finished: bool
) -> None:
    """Five steps in which one reward function failed on every sample: the run stops
    naming it (or, with ``warn``, goes on to its end)."""
    metrics = tmp_path / "metrics.jsonl"
    _failing_rows(metrics, steps=5, share=1.0)
    logs = {"": TrainerLog(metrics)}
    launcher = Launcher(tmp_path / "logs")
    trainer = "import time\ntime.sleep(3)\n"  # finishes (max_steps) after a while
    launcher.add(RoleSpec("trainer", _script(tmp_path / "trainer.py", trainer)))
    watch = RewardWatch(logs, steps=5, ends_run=ends_run)
    try:
        launcher.roles["trainer"].start()
        config = load_config(None, run_id="rewards")
        display = Dashboard(config, plan_policies(config, Ports.free()), logs)
        reason, done = supervise(launcher, display, StopFlag(), 0, watches=[watch])
    finally:
        launcher.stop_all(timeout_s=10)
    assert done is finished
    if ends_run:
        assert reason == (
            "reward function accuracy failed on every sample for 5 steps: "
            "see the producer log for why"
        )
    assert logs[""].summary()["reward_failures"] == {"accuracy": 1.0, "format": 0.0}


def test_a_reward_function_that_sometimes_works_is_not_reported(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    _failing_rows(metrics, steps=4, share=1.0)  # fewer steps than the watch needs
    log = TrainerLog(metrics)
    log.poll()
    assert RewardWatch({"": log}, steps=5, ends_run=True).check() is None
    _failing_rows(metrics, steps=8, share=0.75)
    log = TrainerLog(metrics)
    log.poll()
    assert log.always_failing(5) == [] and log.reward_failures(10)["accuracy"] == 0.75
    assert RewardWatch({"": log}, steps=0, ends_run=True).check() is None  # off
