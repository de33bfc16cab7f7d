"""A command started before the embedded broker or store (or a producer before its engine)
says, in one line, what to start.

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
from support.up_runs import role_env, write_config

from core.config import KafkaConfig, S3Config
from infra.topics import ensure_topics
from rollstream.config.settings import load_config

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
    ["fork", "demo", "--as", "demo-x"],
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


@pytest.mark.integration
def test_a_producer_without_its_engine_says_what_to_start(
    tmp_path: Path, kafka_config: KafkaConfig, s3_config: S3Config
) -> None:
    """The broker and store answer; first the run's topics are missing, then nothing
    listens at the engine's address."""
    extra = {"producers": {"rollout": {"engine_url": "http://127.0.0.1:1", "retries": 1}}}
    config = write_config(tmp_path, kafka_config, s3_config, "no-engine", extra)

    def produce() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "rollstream", "--config", str(config), "produce"],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=role_env(),
        )  # fmt: skip
        output = done.stdout + done.stderr
        assert done.returncode == 1 and "Traceback" not in output, output
        (error,) = [line for line in output.splitlines() if line.startswith("Error:")]
        return error

    assert "rollstream topics ensure" in produce()
    loaded = load_config(config)
    ensure_topics(loaded.kafka.client_config(), loaded.run_topic_specs(), loaded.kafka)
    assert "`rollstream serve`" in produce()
