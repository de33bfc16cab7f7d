"""After ``rollstream up`` on embedded services stops at ``max_steps``, the run's own config
file brings the services back and the audit reconciles: the sequence a user follows.

``up`` starts its own embedded broker and store here (in a temporary state dir), as the
README's main job does; the fixtures' services are not used.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from core.process import free_port

pytestmark = pytest.mark.slow


def _rollstream(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return subprocess.run(
        [sys.executable, "-m", "rollstream", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_up_stops_then_infra_up_and_audit_from_the_run_config(tmp_path: Path) -> None:
    state, run_dir = tmp_path / "state", tmp_path / "run"
    done = _rollstream(
        "--state-dir", str(state), "up", "--max-steps", "8", "--run-dir", str(run_dir),
        timeout_s=420,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
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
