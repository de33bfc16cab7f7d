"""``rollstream config --role X`` prints exactly what role X's entry receives: the role
commands and the printout cut the configuration with the same function
(``rollstream.config.settings.role_config``), so they cannot drift apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from core.config import SharedConfig
from rollstream.cli.main import main

CONFIG = """
run_id = "role-view"

[kafka]
bootstrap_servers = "127.0.0.1:1"
security_protocol = "SASL_PLAINTEXT"
sasl_mechanism = "PLAIN"
sasl_username = "user"
sasl_password = "kafka-secret"

[s3]
endpoint_url = "http://127.0.0.1:2"
access_key_id = "key"
secret_access_key = "s3-secret"

[trainer]
max_steps = 7
"""


class Received(Exception):
    """Raised by a stand-in role entry once it has what the role would run with."""

    def __init__(self, shared: SharedConfig, section: Any) -> None:
        super().__init__("received")
        self.shared, self.section = shared, section


def _stand_in_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    import producers.app

    async def run_producer(config: SharedConfig, producers: Any, **_: Any) -> Any:
        raise Received(config, producers)

    monkeypatch.setattr(producers.app, "run_producer", run_producer)


def _stand_in_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    import streams.faust.app

    def build_app(shared: SharedConfig, config: Any, datadir: Path) -> Any:
        raise Received(shared, config)

    monkeypatch.setattr(streams.faust.app, "build_app", build_app)


def _stand_in_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    import consumers.trainer

    class Trainer:
        def __init__(self, shared: SharedConfig, trainer: Any) -> None:
            raise Received(shared, trainer)

    monkeypatch.setattr(consumers.trainer, "Trainer", Trainer)


ROLES = {
    "producers": (_stand_in_producer, ["produce"]),
    "streams": (_stand_in_stream, ["stream", "--no-supervisor"]),
    "trainer": (_stand_in_trainer, ["train"]),
}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_config_role_prints_what_the_role_receives(
    role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rollstream.toml"
    path.write_text(CONFIG)
    root = ["--config", str(path), "--state-dir", str(tmp_path / "state")]
    shown = CliRunner().invoke(main, [*root, "config", "--role", role])
    assert shown.exit_code == 0, shown.output
    printed = json.loads(shown.output)

    stand_in, command = ROLES[role]
    stand_in(monkeypatch)
    ran = CliRunner().invoke(main, [*root, *command])
    assert isinstance(ran.exception, Received), ran.output
    shared, section = ran.exception.shared, ran.exception.section

    assert type(shared) is SharedConfig  # the shared sections only, not the whole file
    received = {**shared.model_dump(mode="json"), role: section.model_dump(mode="json")}
    profile = printed.pop("profile")  # what the role's settings were derived from
    assert printed == received
    assert profile["name"] == "auto"
    assert printed["kafka"]["sasl_password"] == printed["s3"]["secret_access_key"] == "**********"
    assert "kafka-secret" not in shown.output and "s3-secret" not in shown.output
    # the role itself gets the secrets
    assert shared.kafka.sasl_password is not None
    assert shared.kafka.sasl_password.get_secret_value() == "kafka-secret"


@pytest.mark.parametrize(
    ("command", "section"),
    [("serve", "producers"), ("produce", "producers"), ("gateway", "producers"),
     ("eval", "producers"), ("stream", "streams"), ("train", "trainer")],
)  # fmt: skip
def test_a_role_is_named_by_its_command_too(command: str, section: str, tmp_path: Path) -> None:
    """``--role`` takes the command that runs a role; the shared settings it shows are the
    ``[profile]``'s, propagated into the role's section."""
    path = tmp_path / "rollstream.toml"
    path.write_text(CONFIG + "[profile]\nstaleness_window = 3\n")
    root = ["--config", str(path), "--state-dir", str(tmp_path / "state")]
    by_command = CliRunner().invoke(main, [*root, "config", "--role", command])
    by_section = CliRunner().invoke(main, [*root, "config", "--role", section])
    assert by_command.exit_code == 0, by_command.output
    assert json.loads(by_command.output) == json.loads(by_section.output)
    shown = json.loads(by_command.output)[section]
    window = {
        "producers": lambda s: s["rollout"]["staleness_window"],
        "streams": lambda s: s["staleness"]["max_staleness"],
        "trainer": lambda s: s["staleness"]["max_staleness"],
    }[section](shown)
    assert window == 3


@pytest.mark.parametrize("role", ["mirror", "", "TRAINER", "trainer;rm", "--set"])
def test_an_unknown_role_is_refused_naming_the_roles(role: str, tmp_path: Path) -> None:
    path = tmp_path / "rollstream.toml"
    path.write_text(CONFIG)
    root = ["--config", str(path), "--state-dir", str(tmp_path / "state")]
    result = CliRunner().invoke(main, [*root, "config", "--role", role])
    assert result.exit_code == 2, result.output
    assert "--role" in result.output and "'producers'" in result.output
    assert "{" not in result.output  # nothing printed as if it were a role's config


def test_role_config_refuses_an_unknown_role() -> None:
    from rollstream.config.settings import RollstreamConfig, role_config

    with pytest.raises(ValueError, match=r"unknown role 'mirror': one of producers, .*train"):
        role_config(RollstreamConfig(), "mirror")
