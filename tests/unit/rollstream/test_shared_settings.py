"""Shared settings: the staleness window, the model spec and the precision are declared
once in ``[profile]`` and propagated into every role's section; a source that contradicts
a declaration is refused with both keys named, and a role's own value set in a source that
wins over the declaration is an override (``rollstream.config.shared``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import ConfigurationError
from core.config_sources import InvalidConfigError
from rollstream.config.settings import UpConfig, load_config
from rollstream.up.plan import Ports, build_config, write_config


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rollstream.toml"
    path.write_text(text)
    return path


def _windows(config: object) -> tuple[int | None, int | None, int | None]:
    return (
        config.producers.rollout.staleness_window,  # type: ignore[attr-defined]
        config.streams.staleness.max_staleness,  # type: ignore[attr-defined]
        config.trainer.staleness.max_staleness,  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize(
    ("text", "role_key", "declaring_key"),
    [
        (
            "[profile]\nstaleness_window = 3\n[streams.staleness]\nmax_staleness = 5\n",
            "streams.staleness.max_staleness = 5",
            "profile.staleness_window = 3",
        ),
        (
            "[profile]\nsync = true\n[producers.rollout]\nstaleness_window = 2\n",
            "producers.rollout.staleness_window = 2",
            "profile.sync = True",
        ),
        (
            '[profile]\nmodel = "tiny"\n[trainer.model]\nspec = "tiny:num_layers=3"\n',
            "trainer.model.spec = 'tiny:num_layers=3'",
            "profile.model = 'tiny'",
        ),
        (
            '[profile]\nprecision = "bf16"\n[streams.old_logits]\ndtype = "float32"\n',
            "streams.old_logits.dtype = 'float32'",
            "profile.precision = 'bf16'",
        ),
        (
            '[profile]\nprecision = "fp32"\n[trainer.engine]\nbf16 = true\n',
            "trainer.engine.bf16 = True",
            "profile.precision = 'fp32'",
        ),
    ],
)
def test_a_file_contradicting_a_shared_setting_is_refused_naming_both_keys(
    text: str, role_key: str, declaring_key: str, tmp_path: Path
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigurationError) as refused:
        load_config(path)
    message = str(refused.value)
    assert role_key in message and declaring_key in message and str(path) in message


def test_the_declared_window_is_every_roles_and_agreeing_copies_are_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(
        tmp_path, "[profile]\nstaleness_window = 3\n[trainer.staleness]\nmax_staleness = 3\n"
    )
    assert _windows(load_config(path)) == (3, 3, 3)
    # every copy written out, agreeing, as in a run's file; a variable's string agrees too
    every = _file(
        tmp_path,
        '[profile]\nprecision = "bf16"\nstaleness_window = 3\n'
        '[producers.engine]\ndtype = "bfloat16"\n[streams.old_logits]\ndtype = "bfloat16"\n'
        "[trainer.engine]\nbf16 = true\n[trainer.staleness]\nmax_staleness = 3\n",
    )
    monkeypatch.setenv("ROLLSTREAM_STREAMS__STALENESS__MAX_STALENESS", "3")
    monkeypatch.setenv("ROLLSTREAM_PROFILE__PRECISION", "bf16")
    monkeypatch.setenv("ROLLSTREAM_PRODUCERS__ENGINE__DTYPE", "bfloat16")
    monkeypatch.setenv("ROLLSTREAM_TRAINER__ENGINE__BF16", "True")
    agreed = load_config(every)
    assert _windows(agreed) == (3, 3, 3) and agreed.trainer.engine.bf16
    assert agreed.producers.engine.dtype == agreed.streams.old_logits.dtype == "bfloat16"
    # the same spec written another way is the same model
    model = _file(tmp_path, '[profile]\nmodel = "tiny"\n[producers.engine]\nmodel = " tiny "\n')
    assert load_config(model).producers.engine.model == "tiny"


def test_a_winning_source_overrides_one_roles_copy_and_a_declaration_over_a_pinned_copy_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path, "[profile]\nstaleness_window = 3\n")
    # --set (and the environment) win over the file: the stream alone is narrower
    narrower = load_config(path, streams={"staleness": {"max_staleness": 0}})
    assert _windows(narrower) == (3, 0, 3)
    monkeypatch.setenv("ROLLSTREAM_TRAINER__STALENESS__MAX_STALENESS", "1")
    assert _windows(load_config(path)) == (3, 3, 1)
    monkeypatch.delenv("ROLLSTREAM_TRAINER__STALENESS__MAX_STALENESS")
    # a declaration from a winning source is not honoured by a copy the file pins: refused
    pinned = _file(tmp_path, "[streams.staleness]\nmax_staleness = 1\n")
    with pytest.raises(ConfigurationError, match=r"streams.staleness.max_staleness = 1 .*--set"):
        load_config(pinned, profile={"staleness_window": 3})


def test_profile_none_still_propagates_what_it_declares(tmp_path: Path) -> None:
    """``none`` derives nothing else; a window it declares is no longer silently dropped."""
    path = _file(tmp_path, '[profile]\nname = "none"\nstaleness_window = 3\n')
    assert _windows(load_config(path)) == (3, 3, 3)
    assert _windows(load_config(None, profile={"name": "none"})) == (4, 4, 4)  # the defaults


def test_a_policy_table_contradicting_its_own_declaration_is_refused(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        "[policies.solver.profile]\nstaleness_window = 1\n"
        "[policies.solver.streams.staleness]\nmax_staleness = 2\n",
    )
    with pytest.raises(ConfigurationError, match=r"\[policies.solver\]"):
        load_config(path, policy="solver")
    agreeing = _file(tmp_path, "[policies.solver.profile]\nstaleness_window = 1\n")
    assert _windows(load_config(agreeing, policy="solver")) == (1, 1, 1)


def test_a_run_started_with_an_override_writes_a_file_its_roles_read(tmp_path: Path) -> None:
    """``up --set streams.staleness.max_staleness=0`` over a declared window: the run's file
    holds what each role runs with, and reads back as that."""
    path = _file(tmp_path, "[profile]\nstaleness_window = 3\n")
    base = load_config(path, streams={"staleness": {"max_staleness": 0}})
    config = build_config(base, UpConfig(max_steps=5), "run", tmp_path, Ports(1, 2, 3, 4))
    write_config(config, tmp_path / "run.toml")
    assert _windows(load_config(tmp_path / "run.toml")) == (3, 0, 3)
    # a declared precision (bf16 everywhere) reads back from the run's file as it was
    pinned = load_config(None, profile={"model": "smollm2", "precision": "bf16"})
    run = build_config(pinned, UpConfig(max_steps=5), "p", tmp_path, Ports(1, 2, 3, 4))
    write_config(run, tmp_path / "pinned.toml")
    again = load_config(tmp_path / "pinned.toml")
    assert again.profile.precision == "bf16" and again.trainer.engine.bf16
    # without an override the declaration stays in the run's file
    plain = build_config(load_config(path), UpConfig(max_steps=5), "r", tmp_path, Ports(1, 2, 3, 4))
    write_config(plain, tmp_path / "plain.toml")
    assert load_config(tmp_path / "plain.toml").profile.staleness_window == 3


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ROLLSTREAM_STREAMS__STALENESS__MAX_STALENESS", "many"),
        ("ROLLSTREAM_TRAINER__ENGINE__BF16", "maybe"),
        ("ROLLSTREAM_PRODUCERS__ENGINE__MODEL", "no-such-model"),
    ],
)
def test_a_garbage_copy_is_refused_as_invalid_naming_its_source(
    variable: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path, '[profile]\nstaleness_window = 3\nprecision = "fp32"\n')
    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidConfigError, match=variable):
        load_config(path)


def test_a_profile_that_is_no_table_is_refused_as_invalid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path, "[streams.staleness]\nmax_staleness = 3\n")
    monkeypatch.setenv("ROLLSTREAM_PROFILE", "3")
    with pytest.raises(InvalidConfigError, match="ROLLSTREAM_PROFILE"):
        load_config(path)
    # a table from a winning source replaces it, as for any table
    assert load_config(path, profile={"staleness_window": 3}).streams.staleness.max_staleness == 3
    monkeypatch.delenv("ROLLSTREAM_PROFILE")
    with pytest.raises(InvalidConfigError, match="profile"):
        load_config(_file(tmp_path, 'profile = "tiny"\n'))


def test_the_cli_refuses_a_contradiction_before_any_role_starts(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from rollstream.cli.main import main

    path = _file(
        tmp_path, "[profile]\nstaleness_window = 3\n[trainer.staleness]\nmax_staleness = 1\n"
    )
    root = ["--config", str(path), "--state-dir", str(tmp_path / "state")]
    for command in (["config"], ["train", "--dry-run"], ["stream", "--check"]):
        result = CliRunner().invoke(main, [*root, *command])
        assert result.exit_code == 2, result.output
        assert f"trainer.staleness.max_staleness = 1 ({path}:4)" in result.output
        assert f"profile.staleness_window = 3 ({path}:2)" in result.output
