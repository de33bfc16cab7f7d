"""The systemd units in infra/systemd/ (docs/deployment.md#supervision).

- ``systemd-analyze verify`` accepts every unit, rendered with an existing executable in
  place of the deployment's venv, without a single warning (it reports unknown keys and
  bad values as warnings with exit status 0);
- every ``ExecStart`` is a ``rollstream`` command line that the CLI parses, each option of
  the command it follows, with its value converted;
- each unit stops its role the way the role stops cleanly, and the engine's command
  started as the unit starts it answers ``/health`` and exits 0 on SIGTERM to its main
  process (``KillMode=mixed``) within ``TimeoutStopSec``.

No service manager runs here, so no unit is started under systemd itself.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import click
import pytest
from support.paths import REPO

from core.process import free_port
from producers.config import RolloutConfig
from rollstream.cli.main import main

UNITS = REPO / "infra" / "systemd"
VENV_ROLLSTREAM = "/opt/rollstream/venv/bin/rollstream"
CONFIG = "/etc/rollstream/rollstream.toml"
#: Each unit file and the instance it is checked as.
INSTANCES = {
    "rollstream-engine@.service": "30000",
    "rollstream-producer@.service": "30000",
    "rollstream-stream@.service": "0",
    "rollstream-trainer.service": "",
}
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read(UNITS / name)
    return parser


def _instance_name(name: str) -> str:
    return name.replace("@.", f"@{INSTANCES[name]}.")


def _exec_words(name: str) -> list[str]:
    """The unit's ExecStart after systemd's specifiers, as an instance would run it."""
    line = _unit(name)["Service"]["ExecStart"]
    for spec, value in {"%i": INSTANCES[name], "%S": "/var/lib", "%H": "host-1"}.items():
        line = line.replace(spec, value)
    assert "%" not in line, f"{name}: a specifier the test does not resolve: {line}"
    return shlex.split(line)


def _seconds(value: str) -> float:
    units = {"s": 1, "sec": 1, "min": 60, "h": 3600}
    m = re.fullmatch(r"(\d+)(s|sec|min|h)?", value)
    assert m, value
    return int(m.group(1)) * units[m.group(2) or "s"]


def test_the_units_are_the_ones_checked_here() -> None:
    assert sorted(p.name for p in UNITS.glob("*.service")) == sorted(INSTANCES)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_systemd_analyze_verifies_the_unit(name: str, tmp_path: Path) -> None:
    rollstream = shutil.which("rollstream") or str(Path(sys.executable).with_name("rollstream"))
    assert Path(rollstream).is_file(), "the venv's rollstream script"
    for unit in UNITS.glob("*.service"):  # the producer's dependency must resolve too
        text = unit.read_text()
        assert VENV_ROLLSTREAM in text
        (tmp_path / unit.name).write_text(text.replace(VENV_ROLLSTREAM, rollstream))
    target = _instance_name(name)
    result = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", "--man=no", target],
        cwd=tmp_path,
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", "SYSTEMD_LOG_COLOR": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        f"{target}: exit {result.returncode}\n{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_exec_start_is_a_rollstream_command_line_that_parses(name: str, tmp_path: Path) -> None:
    words = _exec_words(name)
    assert words[0] == VENV_ROLLSTREAM
    args = words[1:]
    # The click types check these paths exist: the example config stands in for the
    # machine's, a temporary directory for the state directory.
    assert args[:4] == ["--config", CONFIG, "--state-dir", "/var/lib/rollstream"]
    args[1], args[3] = str(REPO / "infra" / "rollstream.example.toml"), str(tmp_path)
    root = main.make_context("rollstream", args[:4])
    command_name, *rest = args[4:]
    command = main.get_command(root, command_name)
    assert command is not None, f"{name}: rollstream has no command {command_name!r}"
    try:
        sub = command.make_context(command_name, rest, parent=root)
    except click.UsageError as err:  # an unknown option or a value of the wrong type
        pytest.fail(f"{name}: `rollstream {' '.join(args)}`: {err.format_message()}")
    assert not sub.args, f"{name}: arguments the command does not take: {sub.args}"


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_each_unit_runs_unprivileged_restarts_on_failure_and_stops_gently(name: str) -> None:
    service = _unit(name)["Service"]
    assert service["User"] == service["Group"] == "rollstreamd"
    assert service["EnvironmentFile"] == "/etc/rollstream/rollstream.env"
    assert service["Restart"] == "on-failure"
    # SIGTERM to the main process only: each role's command handles it (the stream's
    # supervisor forwards it to its worker once); SIGKILL only after the timeout.
    assert (service["KillSignal"], service["KillMode"]) == ("SIGTERM", "mixed")
    assert _seconds(service["TimeoutStopSec"]) >= 30


def test_the_producer_may_finish_its_groups_before_systemd_kills_it() -> None:
    stop = _seconds(_unit("rollstream-producer@.service")["Service"]["TimeoutStopSec"])
    assert stop > RolloutConfig().stop_finish_timeout_s


def test_the_producer_drives_its_own_engine() -> None:
    words = _exec_words("rollstream-producer@.service")
    engine = _exec_words("rollstream-engine@.service")
    port = engine[engine.index("--port") + 1]
    assert words[words.index("--engine-url") + 1] == f"http://127.0.0.1:{port}"
    unit = _unit("rollstream-producer@.service")["Unit"]
    for key in ("Requires", "After", "PartOf"):
        assert "rollstream-engine@%i.service" in unit[key].split()


def test_the_engine_unit_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    words = _exec_words("rollstream-engine@.service")
    args = words[1:]
    args[1], args[3] = str(REPO / "infra" / "rollstream.example.toml"), str(tmp_path)
    args[args.index("--port") + 1] = str(port)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stop_s = _seconds(_unit("rollstream-engine@.service")["Service"]["TimeoutStopSec"])
    log = (tmp_path / "engine.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollstream", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the engine did not answer /health"
            time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # KillMode=mixed: the main process only
        code = proc.wait(timeout=stop_s)
        assert code == 0, (tmp_path / "engine.log").read_text()
        assert time.monotonic() - started < stop_s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
