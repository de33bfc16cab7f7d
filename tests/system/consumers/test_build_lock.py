"""DeepSpeed's op build under rollstream's build guard (``consumers.build_lock``).

The failure this pins: a trainer killed while torch held its build baton left a ``lock``
file behind, and every later trainer waited on it forever (a chaos-test kill -9 hung CI).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.paths import REPO

from consumers.build_lock import GUARD_FILE, extensions_root, op_build_guard, stale_batons


def test_guard_removes_batons_that_dead_processes_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with_python_tag = tmp_path / "py311_cu130" / "deepspeed_shm_comm" / "lock"
    without_tag = tmp_path / "cpu_adam" / "lock"
    for baton in (with_python_tag, without_tag):
        baton.parent.mkdir(parents=True)
        baton.touch()
    built = tmp_path / "cpu_adam" / "cpu_adam.so"
    built.touch()

    with (
        caplog.at_level(logging.WARNING, logger="consumers.build_lock"),
        op_build_guard(tmp_path),
    ):
        assert stale_batons(tmp_path) == []

    assert not with_python_tag.exists() and not without_tag.exists()
    assert built.exists(), "only batons are removed, never build outputs"
    assert sum("left by a killed process" in r.getMessage() for r in caplog.records) == 2


def test_guard_waits_for_a_live_holder_and_leaves_its_baton_alone(tmp_path: Path) -> None:
    """A process inside the guard owns its baton: a second one waits, and by the time it
    enters, the holder has finished and removed its own baton (nothing to clear)."""
    baton = tmp_path / "op" / "lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import pathlib, sys, time
                from consumers.build_lock import op_build_guard
                root = pathlib.Path({str(tmp_path)!r})
                baton = root / "op" / "lock"
                with op_build_guard(root):
                    baton.parent.mkdir(parents=True, exist_ok=True)
                    baton.touch()
                    print("held", flush=True)
                    time.sleep(4.0)  # long enough for a loaded core to start the wait
                    assert baton.exists(), "a live holder's baton was removed"
                    baton.unlink()
                """
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with op_build_guard(tmp_path):
            waited = time.monotonic() - started
            assert holder.wait(timeout=10) == 0
            assert not baton.exists()
        assert waited > 0.5, f"entered the guard after {waited:.2f}s while another process held it"
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / GUARD_FILE).exists()


def test_extensions_root_defaults_under_the_rollstream_cache_and_leaves_the_env_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # setenv first so that monkeypatch records (and restores) the variable being unset
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "unset-below")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    before = dict(os.environ)
    root = extensions_root(tmp_path)
    assert root == tmp_path / "torch_extensions"
    assert dict(os.environ) == before, "extensions_root changed the environment"
    with op_build_guard(root):  # torch reads the variable at every build: set in the block
        assert os.environ["TORCH_EXTENSIONS_DIR"] == str(root)
    assert dict(os.environ) == before, "op_build_guard left the environment changed"

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert extensions_root(tmp_path) == tmp_path / "mine", "a user's setting wins"
    with op_build_guard(tmp_path / "other"):
        assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "other")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine"), "restored"


def test_the_block_builds_with_the_interpreters_own_ninja_whatever_path_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ninja versions read each other's build log as stale: with and without the
    virtualenv on PATH, the op was rebuilt each time the other had run last."""
    own_ninja = Path(sys.executable).parent / "ninja"
    assert own_ninja.is_file(), "the lock installs ninja beside the interpreter"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with op_build_guard(tmp_path):
        assert shutil.which("ninja") == str(own_ninja)
    assert os.environ["PATH"] == "/usr/bin:/bin", "restored"
    monkeypatch.delenv("PATH")
    with op_build_guard(tmp_path):
        assert shutil.which("ninja") == str(own_ninja)
    assert "PATH" not in os.environ, "an unset PATH stays unset"


@pytest.mark.system
def test_deepspeed_starts_after_a_trainer_was_killed_holding_the_build_lock(
    tmp_path: Path,
) -> None:
    """Plant the baton a kill -9 leaves in a copy of the real op directory, then initialise
    DeepSpeed as a trainer does: it must come up (it used to wait forever). A copy, because
    the trainers of the other test workers share the real one and may clear a baton there
    first; the built op in it spares a compile."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    real = Path(env.get("TORCH_EXTENSIONS_DIR") or extensions_root())
    assert real == extensions_root(), "an earlier test leaked its extensions root"
    root = tmp_path / "torch_extensions"
    op = real / "deepspeed_shm_comm"
    with op_build_guard(real):  # no other process builds into it while it is copied
        if op.is_dir():
            shutil.copytree(op, root / op.name, ignore=shutil.ignore_patterns("lock"))
    env["TORCH_EXTENSIONS_DIR"] = str(root)
    baton = root / "deepspeed_shm_comm" / "lock"
    baton.parent.mkdir(parents=True, exist_ok=True)
    baton.touch()

    done = subprocess.run(
        [sys.executable, "-m", "consumers.prebuild"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a first build compiles for about a minute
    )

    assert done.returncode == 0, done.stderr[-2000:]
    assert "DeepSpeed ops ready for cpu" in done.stdout
    assert "left by a killed process" in done.stderr
    assert not baton.exists()
