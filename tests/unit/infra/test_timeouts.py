"""A tool that hangs while the embedded broker is prepared is killed after its time
limit and reported, never waited on forever."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.process import ServiceError
from infra.kafka import resolve_kafka_jars


def test_a_hanging_maven_is_killed_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"
    mvn.write_text("#!/bin/sh\necho resolving...\nexec sleep 600\n")  # Maven Central hangs
    mvn.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    with pytest.raises(ServiceError, match="did not finish within 1s") as failure:
        resolve_kafka_jars("9.9.9", tmp_path / "cache", timeout_s=1)
    assert "resolving..." in str(failure.value)
    assert not (tmp_path / "cache" / "kafka" / "9.9.9" / "libs" / ".complete").exists()
