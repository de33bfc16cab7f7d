"""Profiles: a role started alone from a config file gets the settings ``rollstream up``
runs it with (model, dtypes, lr, loss, batch, admission credit), and what the file sets
explicitly still wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.paths import REPO

from core.config_sources import InvalidConfigError
from rollstream.cli.main import main
from rollstream.config.profiles import ProfileConfig, profile_sections
from rollstream.config.settings import RollstreamConfig, UpConfig, load_config
from rollstream.up.plan import Ports, build_config, write_config

EXAMPLE = REPO / "infra" / "rollstream.example.toml"

# what a role needs to learn: the same under `up` and when started alone
LEARNING_KEYS = (
    ("producers", "engine", "model"),
    ("producers", "engine", "dtype"),
    ("producers", "rollout", "task"),
    ("producers", "rollout", "group_size"),
    ("producers", "rollout", "staleness_window"),
    ("trainer", "staleness", "max_staleness"),
    ("streams", "staleness", "max_staleness"),
    ("streams", "old_logits", "model"),
    ("streams", "old_logits", "dtype"),
    ("trainer", "model", "spec"),
    ("trainer", "engine", "lr"),
    ("trainer", "engine", "bf16"),
    ("trainer", "loss", "type"),
    ("trainer", "batch", "max_groups"),
)


def _value(config: RollstreamConfig, path: tuple[str, ...]) -> object:
    node: object = config
    for part in path:
        node = getattr(node, part)
    return node


def test_profile_settings_lie_under_explicit_values(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[trainer.engine]\nlr = 1e-3\n[profile]\nstaleness_window = 3\n")
    config = load_config(path)
    assert config.profile.resolved_name == "tiny"
    assert config.trainer.engine.lr == 1e-3  # the file wins
    assert config.trainer.engine.zero_stage == 0  # the profile fills the rest
    assert config.trainer.batch.max_groups == 16
    assert config.producers.rollout.staleness_window == 3
    assert config.trainer.staleness.max_staleness == 3  # checked again at training time
    assert config.streams.staleness.max_staleness == 3
    # --set wins over both
    assert load_config(path, trainer={"engine": {"lr": 2e-3}}).trainer.engine.lr == 2e-3


def test_sync_and_language_model_profiles() -> None:
    sync = load_config(None, profile={"sync": True, "staleness_window": 5})
    assert sync.producers.rollout.staleness_window == 0
    assert sync.streams.staleness.max_staleness == 0
    assert sync.trainer.batch.max_wait_s == 120.0
    lm = load_config(None, profile={"model": "smollm2-135m-instruct", "precision": "bf16"})
    assert lm.profile.resolved_name == "language-model"
    assert lm.trainer.engine.bf16 and lm.trainer.engine.lr == 2e-5
    assert lm.producers.rollout.task == "arithmetic"
    assert lm.streams.old_logits.dtype == lm.producers.engine.dtype == "bfloat16"


@pytest.mark.parametrize(("native", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_auto_precision_takes_bf16_only_where_the_machine_computes_it_natively(
    native: bool, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("core.models.bf16_is_native", lambda: native)
    lm = load_config(None, profile={"model": "smollm2"})
    assert lm.producers.engine.dtype == lm.streams.old_logits.dtype == dtype
    assert lm.trainer.engine.bf16 == native
    # the tiny model stays float32, a pinned precision holds whatever the machine
    assert load_config(None).trainer.engine.bf16 is False
    pinned = load_config(None, profile={"model": "smollm2", "precision": "fp32"})
    assert pinned.streams.old_logits.dtype == "float32" and not pinned.trainer.engine.bf16
    with pytest.raises(InvalidConfigError):
        load_config(None, profile={"precision": "fp8"})


def test_the_run_file_holds_the_precision_up_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role started by hand from the run's file computes in the dtype ``up`` chose, even
    on a machine that would decide otherwise."""
    monkeypatch.setattr("core.models.bf16_is_native", lambda: True)
    base = load_config(None, profile={"model": "smollm2"})
    config = build_config(base, UpConfig(max_steps=5), "run", tmp_path, Ports(1, 2, 3, 4))
    write_config(config, tmp_path / "run.toml")
    monkeypatch.setattr("core.models.bf16_is_native", lambda: False)
    again = load_config(tmp_path / "run.toml")
    assert again.streams.old_logits.dtype == again.producers.engine.dtype == "bfloat16"
    assert again.trainer.engine.bf16


def test_profile_none_applies_nothing() -> None:
    assert profile_sections(ProfileConfig(name="none")) == {}
    bare = load_config(None, profile={"name": "none"})
    assert bare.producers.rollout.groups_per_version is None
    assert bare.trainer.engine.lr == RollstreamConfig().trainer.engine.lr


@pytest.mark.parametrize(
    "profile",
    [{"name": "huge"}, {"model": "gpt-17"}, {"staleness_window": -1}, {"groups": 3}],
)
def test_bad_profiles_are_refused(profile: dict[str, object]) -> None:
    with pytest.raises(InvalidConfigError):
        load_config(None, profile=profile)


@pytest.mark.parametrize(
    "profile", [{}, {"sync": True}, {"model": "smollm2", "task": "reverse-3-digits"}]
)
def test_a_role_started_alone_gets_what_up_gives_it(
    profile: dict[str, object], tmp_path: Path
) -> None:
    alone = load_config(None, profile=profile)
    under_up = build_config(alone, UpConfig(max_steps=5), "run", tmp_path, Ports(1, 2, 3, 4))
    for path in LEARNING_KEYS:
        assert _value(under_up, path) == _value(alone, path), path


def test_the_example_config_runs_the_tiny_profile_by_hand() -> None:
    config = load_config(EXAMPLE)
    assert config.profile.resolved_name == "tiny"
    # backpressure by default: the producers follow the trainer's announced pace
    assert config.producers.rollout.groups_per_version is None
    assert config.trainer.staleness.max_staleness == config.producers.rollout.staleness_window
    assert config.trainer.engine.lr == 3e-3
    window = config.producers.rollout.staleness_window
    assert config.streams.staleness.max_staleness == window


def test_config_role_prints_one_role(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["config", "--role", "trainer"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert "trainer" in shown and "producers" not in shown and "streams" not in shown
    assert shown["trainer"]["engine"]["lr"] == 3e-3 and shown["profile"]["name"] == "auto"
    bad = CliRunner().invoke(main, ["config", "--role", "janitor"])
    assert bad.exit_code != 0


def test_the_tiny_profile_runs_the_delta_path() -> None:
    """fp32 AdamW changes every element: the tiny profile lets deltas be dense so the main
    job still publishes deltas (docs/weights-format.md), a language model keeps 0.25."""
    assert load_config(None).weights.max_delta_fraction == 1.0
    lm = load_config(None, profile={"model": "smollm2"})
    assert lm.weights.max_delta_fraction == RollstreamConfig().weights.max_delta_fraction
