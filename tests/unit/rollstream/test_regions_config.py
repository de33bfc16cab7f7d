"""One config file for every machine of a multi-region run: regions named by their table,
``produce --region`` choosing a store that exists."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from core.config import S3Config, WeightsConfig
from rollstream.cli.main import main


def test_a_region_is_named_by_its_table() -> None:
    weights = WeightsConfig.model_validate({"regions": {"eu": {"bucket": "b-eu"}}})
    assert weights.regions["eu"].name == "eu"
    assert weights.region("eu", S3Config()).bucket == "b-eu"
    assert weights.region("local", S3Config()) == S3Config()
    with pytest.raises(KeyError, match="unknown region 'us'"):
        weights.region("us", S3Config())
    with pytest.raises(ValidationError, match="different name"):
        WeightsConfig.model_validate({"regions": {"eu": {"name": "us", "bucket": "b"}}})


def test_produce_refuses_an_unknown_region(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        f'state_dir = "{tmp_path}"\n[weights.regions.eu]\nendpoint_url = "http://127.0.0.1:1"\n'
    )
    result = CliRunner().invoke(main, ["--config", str(config), "produce", "--region", "asia"])
    assert result.exit_code == 2
    assert "unknown region 'asia' (known: eu, local)" in result.output


def test_a_store_without_credentials_is_a_clear_error(tmp_path: Path) -> None:
    """A config naming an S3 endpoint (here: where an embedded store would listen) with no
    credentials anywhere says what to set, instead of a boto traceback."""
    import os
    import subprocess
    import sys

    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n[s3]\nendpoint_url = "http://127.0.0.1:1"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROLLSTREAM_"))}
    env |= {
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    result = subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config), "weights", "ls"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no S3 credentials for the store 'local'" in result.stderr
    assert "s3-secret" in result.stderr and "Traceback" not in result.stderr
