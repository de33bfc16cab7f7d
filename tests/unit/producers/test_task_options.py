"""A task's options are checked against its factory before a run starts.

A misspelt option used to pass config validation, start every role, and kill the
evaluator with ``TypeError: ... unexpected keyword argument`` in its log.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigurationError
from producers.tasks.catalog import check_task_options


def test_a_misspelt_file_task_option_names_the_key_and_section() -> None:
    with pytest.raises(ConfigurationError) as err:
        check_task_options("file", {"path": "train.jsonl", "eval_pth": "x"}, "producers.rollout")
    message = str(err.value)
    assert "[producers.rollout]" in message and "'eval_pth'" in message
    assert "eval_path" in message  # what it takes


@pytest.mark.parametrize(
    ("task", "options", "problem"),
    [
        ("file", {}, "missing option 'path'"),
        ("file", {"path": "a", "reward": "m:f", "shuffle": 1}, "unknown option 'shuffle'"),
        ("copy-first-digit-twice", {"bogus": 1}, "unknown option 'bogus'"),
        ("arithmetic", {"levle": 2}, "unknown option 'levle'"),
    ],
)
def test_garbage_task_options_are_refused(task: str, options: dict, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        check_task_options(task, options, "producers.rollout")


def test_known_options_and_user_factories_pass() -> None:
    check_task_options("file", {"path": "a", "eval_path": "b", "chat": True}, "producers.rollout")
    check_task_options("my_tasks:factory", {"anything": 1}, "producers.rollout")


def test_up_refuses_a_misspelt_task_option_before_anything_starts(tmp_path: Path) -> None:
    config = tmp_path / "rollstream.toml"
    config.write_text(
        '[producers.rollout]\ntask = "file"\n'
        '[producers.rollout.task_options]\npath = "train.jsonl"\neval_pth = "eval.jsonl"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config),
         "--state-dir", str(tmp_path / "state"), "up", "--max-steps", "1"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "'eval_pth'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "state" / "kafka").exists()  # nothing started
