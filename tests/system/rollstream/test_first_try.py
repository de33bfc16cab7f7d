"""The doc blocks a new user runs first, run as written: every ```` ```bash first-try ````
block of README.md and docs/*.md, as one bash script (``set -euo pipefail``: ``cd``, a
role started with ``&`` and ``wait $!`` work as in the user's shell) on the embedded
default (its own broker and store, started by the commands themselves), in a directory of
its own holding the repository's ``examples/`` (a clone has them) and a state dir of its
own.

A block fails the test on a non-zero exit or a traceback in its output. Blocks are tagged
in the docs, so a doc change that breaks the first contact breaks this test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO
from support.up_runs import role_env

pytestmark = pytest.mark.system

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TAG = "```bash first-try"
TIMED = "PS4='+ [${SECONDS}s] '\n"  # bash -x then says when each command started


def first_try_blocks() -> list[tuple[str, str]]:
    """``(where, script)`` of each tagged block."""
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            if line.strip() != TAG:
                continue
            body = []
            for text in lines[number:]:
                if text.startswith("```"):
                    break
                body.append(text)
            blocks.append((f"{path.relative_to(REPO)}:{number}", "\n".join(body) + "\n"))
    return blocks


BLOCKS = first_try_blocks()


def test_the_docs_have_first_try_blocks() -> None:
    assert any(where.startswith("README.md") for where, _ in BLOCKS), BLOCKS


@pytest.mark.parametrize(("where", "script"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_a_first_try_block_runs_as_written(where: str, script: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(REPO / "examples", work / "examples")
    env = {**role_env(), "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # the embedded default, not the session's
    env.pop("AWS_ENDPOINT_URL", None)
    env.pop("AWS_ENDPOINT_URL_S3", None)
    # `rollstream` and `python` as this interpreter's environment has them
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    block = subprocess.Popen(
        ["bash", "-x", "-euo", "pipefail", "-c", TIMED + script], cwd=work, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = block.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(block.pid, signal.SIGKILL)
        output, _ = block.communicate()
        pytest.fail(f"{where}: the block ran over 900 s:\n{output[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # what it left in the background
            os.killpg(block.pid, signal.SIGKILL)
        subprocess.run(
            [sys.executable, "-m", "rollstream", "infra", "down"], cwd=work, env=env,
            capture_output=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    print(output[-6000:])
    said = f"{where}: the block exited {block.returncode}:\n{output[-4000:]}"
    assert block.returncode == 0, said
    assert "Traceback" not in output, said
    runs = tmp_path / "state" / "rollstream" / "runs"
    made = (set(os.listdir(work)) - {"examples"}) | set(os.listdir(runs) if runs.is_dir() else ())
    assert made, "the block left nothing to look at: no file, no run"
