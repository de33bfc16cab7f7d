"""A command started before the embedded broker or store says, in one line, what to start.

A new user's first ``rollstream gateway`` (or ``produce``, ``train``...) on a fresh state dir
used to print seconds of client connection errors and a traceback. Each command that needs
an embedded service that is not running exits 1 with one ``Error:`` line naming
``rollstream infra up``, before it starts anything (the stream worker's supervisor too).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = [
    ["gateway"],
    ["produce"],
    ["stream"],
    ["train"],
    ["eval", "--every-versions", "1"],
    ["replay", "raw"],
    ["roles"],
    ["audit"],
    ["topics", "ensure"],
    ["export", "-o", "{tmp}/model"],
    ["weights", "ls"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_role_without_its_embedded_services_says_what_to_start(
    tmp_path: Path, command: list[str]
) -> None:
    argv = [part.format(tmp=tmp_path) for part in command]
    done = subprocess.run(
        [sys.executable, "-m", "rollstream", "--state-dir", str(tmp_path / "state"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "`rollstream infra up`" in errors[0], output
    assert "restart" not in output  # refused before a supervisor started a worker
    assert not (tmp_path / "state" / "kafka").exists()  # nothing was started
