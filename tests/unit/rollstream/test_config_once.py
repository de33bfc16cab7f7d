"""One configuration pass per process: each role's command reads its file and the
environment once and validates the whole configuration once; ``rollstream up`` validates
the user's config once, the run's config (with its ports and files) once, and reads the
run's file back once to prove every role will read the same."""

from __future__ import annotations

import collections
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.paths import REPO

from rollstream.cli.main import main
from rollstream.config.settings import RollstreamConfig

EXAMPLE = REPO / "infra" / "rollstream.example.toml"


class _Counting:
    """``RollstreamConfig``'s validator, counting validations (a ``BaseSettings`` validates
    in its ``__init__``, the call that passes ``self_instance``)."""

    def __init__(self, inner: Any, counts: collections.Counter[str]) -> None:
        self._inner, self._counts = inner, counts

    def validate_python(self, *args: Any, **kwargs: Any) -> Any:
        if "self_instance" in kwargs:
            self._counts["validations"] += 1
        return self._inner.validate_python(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Whole-config validations, TOML parses and reads of the environment, counted."""
    import pydantic_settings.sources as settings_sources

    counted: collections.Counter[str] = collections.Counter()
    validator = _Counting(RollstreamConfig.__pydantic_validator__, counted)
    monkeypatch.setattr(RollstreamConfig, "__pydantic_validator__", validator)
    loads, load = tomllib.loads, tomllib.load

    def counted_loads(*args: Any, **kwargs: Any) -> Any:
        counted["toml parses"] += 1
        return loads(*args, **kwargs)

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        counted["toml parses"] += 1
        return load(*args, **kwargs)

    monkeypatch.setattr(tomllib, "loads", counted_loads)
    monkeypatch.setattr(tomllib, "load", counted_load)
    read_env = settings_sources.EnvSettingsSource.__call__

    def counted_env(self: Any) -> Any:
        counted["environment reads"] += 1
        return read_env(self)

    monkeypatch.setattr(settings_sources.EnvSettingsSource, "__call__", counted_env)
    return counted


@pytest.mark.parametrize(
    "command",
    [["config"], ["config", "--role", "trainer"], ["train", "--dry-run"], ["stream", "--check"]],
)
def test_a_role_reads_and_validates_its_config_once(
    command: list[str], counts: collections.Counter[str], tmp_path: Path
) -> None:
    root = ["--config", str(EXAMPLE), "--state-dir", str(tmp_path)]
    result = CliRunner().invoke(main, [*root, *command])
    assert result.exit_code == 0, result.output
    assert counts == {"validations": 1, "toml parses": 1, "environment reads": 1}


def test_up_validates_the_users_config_and_the_runs_once_each(
    counts: collections.Counter[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``up`` to the point where its roles start (services and processes stood in)."""
    import core.process
    import infra.services
    import rollstream.up.run as run

    class Services:
        kafka = s3 = None

        def __init__(self, config: RollstreamConfig, **_: Any) -> None:
            self.config = config

        def up_for_run(self, _run_id: str, _specs: Any) -> Any:
            return type("Report", (), {"bootstrap_servers": "", "s3_endpoint": "", "seconds": 0})

        def release_run(self) -> list[str]:
            return []

        def resolved(self) -> RollstreamConfig:
            return self.config

    class Launcher:
        def __init__(self, *_: Any) -> None:
            self.roles: dict[str, Any] = {}

        def add(self, spec: Any) -> None:
            self.roles[spec.name] = spec

        def stop_all(self, *_: Any, **__: Any) -> None:
            return None

        def pids(self) -> dict[str, int]:
            return {}

    started: list[str] = []

    def start_roles(launcher: Launcher, *_: Any) -> None:
        started.extend(launcher.roles)
        raise core.process.LaunchError("stopped before the roles start")

    monkeypatch.setattr(infra.services, "Services", Services)
    monkeypatch.setattr(core.process, "Launcher", Launcher)
    monkeypatch.setattr(run, "start_groups_at_end", lambda _config: {})
    monkeypatch.setattr(run, "start_roles", start_roles)
    root = ["--config", str(EXAMPLE), "--state-dir", str(tmp_path / "state")]
    result = CliRunner().invoke(main, [*root, "up", "--run-dir", str(tmp_path / "run")])
    assert "stopped before the roles start" in result.output
    assert started == ["streams", "trainer", "engine", "producer"]
    # the user's config, the run's config, and the run's file read back (the proof)
    assert counts == {"validations": 3, "toml parses": 2, "environment reads": 1}
