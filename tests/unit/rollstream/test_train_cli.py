"""The trainer's entry points: config parsing before any heavy import, overrides, dry run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from support.paths import REPO

from rollstream.cli.main import main
from rollstream.config.settings import load_config, parse_assignments

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
        "import sys; from rollstream.cli import main; "
        "from rollstream.config.settings import load_config; load_config(None); "
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_load_sections_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "rollstream.toml"
    path.write_text(TOML)
    config = load_config(
        path, **parse_assignments(("trainer.engine.lr=0.25", "trainer.progress=false"))
    )
    trainer, weights = config.trainer, config.weights
    assert config.run_id == "cli-run" and config.kafka.bootstrap_servers == "127.0.0.1:9"
    assert trainer.max_steps == 7 and trainer.engine.zero_stage == 2
    assert trainer.engine.lr == 0.25 and trainer.progress is False
    assert trainer.loss.type == "mu_grpo" and trainer.loss.clip_bounds == (0.0, 4.0)
    assert weights.base_every == 5
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_assignments(("no-equals-sign",))
    with pytest.raises(ValueError, match="not a table"):
        parse_assignments(("trainer=1", "trainer.engine.lr=2"))


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


def test_set_applies_to_every_command_from_the_root() -> None:
    result = CliRunner().invoke(main, ["--set", "trainer.engine.lr=0.5", "train", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.output)["engine"]["lr"] == 0.5
    result = CliRunner().invoke(main, ["--set", "streams.app_id=other", "stream", "--check"])
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.output)["app_id"] == "other"
    bad = CliRunner().invoke(main, ["--set", "no-equals", "train", "--dry-run"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
