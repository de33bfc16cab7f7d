"""After ``rollstream up`` on embedded services is stopped with Ctrl-C, the run's own config
file brings the services back and the audit reconciles: the sequence a user follows.

``up`` starts its own embedded broker and store here (in a temporary state dir), as the
README's main job does; the fixtures' services are not used.
"""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from support.up_runs import finish, metric_rows, role_env, strays

from core.process import free_port, pid_alive

pytestmark = pytest.mark.system


def _rollstream(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollstream", *args],
        env=role_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_ctrl_c_on_up_then_infra_up_and_audit_from_the_run_config(tmp_path: Path) -> None:
    """Ctrl-C once every role trains: ``up`` exits 130 and leaves no role behind; then the
    run's own file brings the embedded services back and the audit reconciles, what Ctrl-C
    cut short counted as in flight, not lost."""
    state, run_dir = tmp_path / "state", tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollstream", "--state-dir", str(state), "up",
         "--max-steps", "10000", "--run-dir", str(run_dir)],
        env=role_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    pids: dict[str, int] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        pids_file = run_dir / "pids.json"
        if pids_file.exists():
            pids = json.loads(pids_file.read_text() or "{}")
        if len(pids) == 4 and len(metric_rows(run_dir)) >= 3:  # every role up and training
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out = finish(proc, timeout_s=180).decode(errors="replace")
    assert len(pids) == 4 and metric_rows(run_dir), out[-4000:]
    assert proc.returncode == 130, out[-4000:]
    assert not [name for name, pid in pids.items() if pid_alive(pid)]
    assert not strays(run_dir)

    config = run_dir / "rollstream.toml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600  # it can hold credentials
    written = tomllib.loads(config.read_text())
    assert not written["kafka"].get("bootstrap_servers")  # embedded stays embedded
    assert not written["s3"].get("endpoint_url") and not written["s3"].get("secret_access_key")

    try:
        started = time.monotonic()
        infra = _rollstream("--config", str(config), "infra", "up", timeout_s=120)
        assert infra.returncode == 0, infra.stdout + infra.stderr
        assert "Traceback" not in infra.stderr
        assert time.monotonic() - started < 60

        audit = _rollstream("--config", str(config), "audit", "--json", timeout_s=300)
        assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
        figures = json.loads(audit.stdout)
        assert figures["problems"] == [] and figures["missing"] == 0
        assert figures["trained"] > 0 and figures["trained_twice"] == 0
        # the producer ran ahead of the last step: those records are in flight, not lost
        in_flight = figures["untrained"] + figures["unprocessed"]
        assert figures["delivered"] == (
            figures["trained_of_delivered"]
            + figures["stale_of_delivered"]
            + figures["dlq_of_delivered"]
            + in_flight
        )
    finally:
        _rollstream("--config", str(config), "infra", "down", timeout_s=120)


def test_infra_up_against_an_external_broker_that_is_not_there_says_so(tmp_path: Path) -> None:
    config = tmp_path / "external.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[kafka]\nbootstrap_servers = "127.0.0.1:{free_port()}"\n'
    )
    started = time.monotonic()
    result = _rollstream("--config", str(config), "infra", "up", timeout_s=120)
    assert result.returncode != 0
    assert "configured as external" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60
