"""The doc blocks a new user runs first, run as written: every ```` ```bash first-try ````
block of README.md and docs/*.md, line by line, on the embedded default (its own broker and
store, started by the commands themselves) in a state dir of its own.

A line fails the test on a non-zero exit or a traceback in its output. Blocks are tagged in
the docs, so a doc change that breaks the first contact breaks this test.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.up_runs import role_env

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TAG = "```bash first-try"


def first_try_blocks() -> list[tuple[str, list[str]]]:
    """``(where, commands)`` of each tagged block: continuation lines joined."""
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            if line.strip() != TAG:
                continue
            commands: list[str] = []
            pending = ""
            for body in lines[number:]:
                if body.startswith("```"):
                    break
                if body.rstrip().endswith("\\"):
                    pending += body.rstrip()[:-1] + " "
                    continue
                if command := (pending + body).strip():
                    commands.append(command)
                pending = ""
            blocks.append((f"{path.relative_to(REPO)}:{number}", commands))
    return blocks


def argv(command: str) -> list[str]:
    """The command's words (its comment dropped), ``rollstream`` as this interpreter's."""
    words = shlex.split(command, comments=True)
    if words and words[0] == "rollstream":
        return [sys.executable, "-m", "rollstream", *words[1:]]
    return words


BLOCKS = first_try_blocks()


def test_the_docs_have_first_try_blocks() -> None:
    assert any(where.startswith("README.md") for where, _ in BLOCKS), BLOCKS


@pytest.mark.parametrize(("where", "commands"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_a_first_try_block_runs_as_written(where: str, commands: list[str], tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = {**role_env(), "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # the embedded default, not the session's
    env.pop("AWS_ENDPOINT_URL", None)
    env.pop("AWS_ENDPOINT_URL_S3", None)
    try:
        for command in commands:
            done = subprocess.run(
                argv(command), cwd=work, env=env, capture_output=True, text=True,
                timeout=600, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            output = done.stdout + done.stderr
            print(f"$ {command}\n{output[-1500:]}")
            said = f"{where}: `{command}` exited {done.returncode}:\n{output[-4000:]}"
            assert done.returncode == 0, said
            assert "Traceback" not in output, said
    finally:
        subprocess.run(
            [sys.executable, "-m", "rollstream", "infra", "down"], cwd=work, env=env,
            capture_output=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert os.listdir(work), "the block left nothing to look at"
