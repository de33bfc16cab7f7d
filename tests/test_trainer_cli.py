"""The trainer's entry points: config parsing before any heavy import, overrides, dry run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import orjson
import pytest
from click.testing import CliRunner

from rollstream.config import RollstreamConfig
from rollstream.train_cli import apply_overrides, load_sections, train

REPO = Path(__file__).resolve().parents[1]

TOML = """
run_id = "cli-run"
[kafka]
bootstrap_servers = "127.0.0.1:9"
[trainer]
max_steps = 7
[trainer.engine]
zero_stage = 2
[trainer.loss]
type = "mu_grpo"
clip_bounds = [0.0, 4.0]
[weights]
base_every = 5
"""


def test_parsing_the_config_imports_no_torch() -> None:
    code = (
        "import sys; from rollstream.train_cli import load_sections; load_sections(None); "
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_load_sections_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "rollstream.toml"
    path.write_text(TOML)
    config, trainer, weights = load_sections(
        path, ("trainer.engine.lr=0.25", "trainer.progress=false")
    )
    assert config.run_id == "cli-run" and config.kafka.bootstrap_servers == "127.0.0.1:9"
    assert trainer.max_steps == 7 and trainer.engine.zero_stage == 2
    assert trainer.engine.lr == 0.25 and trainer.progress is False
    assert trainer.loss.type == "mu_grpo" and trainer.loss.clip_bounds == (0.0, 4.0)
    assert weights.base_every == 5
    with pytest.raises(click.BadParameter):
        apply_overrides({}, ("no-equals-sign",))


def test_python_m_consumers_dry_run(tmp_path: Path) -> None:
    """``python -m consumers`` is a shim for ``rollstream train``: same options, same checks."""
    path = tmp_path / "rollstream.toml"
    path.write_text(TOML)
    args = ["--config", str(path), "--max-steps", "3", "--dry-run"]
    result = subprocess.run(
        [sys.executable, "-m", "consumers", *args, "--set", "trainer.batch.max_groups=4"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    shown = orjson.loads(result.stdout)
    assert shown["max_steps"] == 3 and shown["batch"]["max_groups"] == 4
    assert shown["loss"]["type"] == "mu_grpo"
    bad = subprocess.run(
        [sys.executable, "-m", "consumers", *args, "--set", "trainer.nope=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_train_command_under_the_rollstream_group() -> None:
    @click.group()
    @click.pass_context
    def group(ctx: click.Context) -> None:
        ctx.obj = RollstreamConfig()

    group.add_command(train)
    result = CliRunner().invoke(group, ["train", "--dry-run", "--set", "trainer.engine.lr=0.5"])
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.output)["engine"]["lr"] == 0.5
