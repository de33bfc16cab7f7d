"""Bad configuration is refused by ``rollstream config`` (the one resolver, as every command
runs it) with exit 2 and a message that names the key and where it was set: the file and
line, the ``ROLLSTREAM_*`` variable, or ``--set``; never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rollstream.cli.main import main

BAD_VALUES = [
    ("kafka", "port", "-5"),
    ("kafka", "controller_port", "70000"),
    ("s3", "port", "99999"),
    ("streams", "metrics_port", "-1"),
    ("streams", "metrics_port", "70000"),
    ("producers.engine", "port", "65536"),
    ("producers.rollout", "metrics_port", "-1"),
    ("trainer", "prometheus_port", "100000"),
    ("", "run_id", '"../../etc"'),
    ("", "run_id", '"a/b"'),
    ("", "run_id", '""'),
    ("producers.rollout", "producer_id", '"../x"'),
    ("streams.topics", "raw", '"raw/../x"'),
    ("streams.topics", "scored", '"a b"'),
    ("trainer.topics", "scored", '".."'),
    ("streams", "app_id", '"app id"'),
    ("weights", "topic", '"v:1"'),
    ("presence", "topic", '""'),
    ("streams.validation", "vocab_size", "0"),
    ("streams.validation", "vocab_size", "-3"),
    ("streams.validation", "max_record_bytes", "1000000000000"),
    ("producers.rollout.sampling", "top_k", "0"),
    ("producers.rollout.sampling", "top_k", "-5"),
    ("producers.engine", "max_batch_size", "1000000000"),
    ("kafka", "heap", '"1g -XX:+X"'),
    ("kafka", "heap", '"lots"'),
    ("kafka", "jvm_profile", '"-XX:+UnlockDiagnosticVMOptions"'),
    ("s3", "memory_limit", '"512MiB; rm"'),
    ("weights", "public_key", '"/nonexistent/weights.pub"'),
    ("trainer.retry", "initial_s", "60.0"),
    ("streams.restart", "backoff_s", "100.0"),
    ("streams.groups", "eps", "inf"),
]
CROSS_FIELD = {"initial_s", "backoff_s"}
"""Checked against another key of their table: the error names the table (its header's
line) and the key in its message."""


def _run(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(main, [*args, "config"], env=env)


def _refused(result, *names: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.exception is not None
    for name in names:
        assert name in result.output, result.output


@pytest.mark.parametrize(("table", "key", "value"), BAD_VALUES)
def test_each_bad_value_in_the_file_is_refused_naming_key_and_line(
    tmp_path: Path, table: str, key: str, value: str
) -> None:
    path = tmp_path / "bad.toml"
    header = f"[{table}]\n" if table else ""
    path.write_text(f"# a comment\n{header}{key} = {value}\n")
    line = 3 if table else 2
    dotted = f"{table}.{key}" if table else key
    if key in CROSS_FIELD:
        line, dotted = 2, table
    _refused(_run(["--config", str(path)]), dotted, key, f"{path}:{line}")


@pytest.mark.parametrize(("table", "key", "value"), BAD_VALUES[:4] + BAD_VALUES[8:10])
def test_each_bad_value_given_by_set_is_refused_naming_key(
    table: str, key: str, value: str
) -> None:
    dotted = f"{table}.{key}" if table else key
    _refused(_run(["--set", f"{dotted}={value}"]), dotted, "--set")


def test_a_toml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('run_id = "ok"\n[kafka]\nport = = 3\n')
    _refused(_run(["--config", str(path)]), f"{path}:3")


def test_a_bad_variable_is_refused_naming_it() -> None:
    result = _run([], env={"ROLLSTREAM_KAFKA__PORT": "70000"})
    _refused(result, "kafka.port", "ROLLSTREAM_KAFKA__PORT")
    result = _run([], env={"ROLLSTREAM_RUN_ID": "../../etc"})
    _refused(result, "run_id", "ROLLSTREAM_RUN_ID")


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("ROLLSTREAM_KAFKA_BOOTSTRAP_SERVERS", "ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS"),
        ("ROLLSTREAM_RUNID", "ROLLSTREAM_RUN_ID"),
        ("ROLLSTREAM_TRAINER__ENGINE__LRR", "ROLLSTREAM_TRAINER__ENGINE__LR"),
        ("ROLLSTREAM_NOTHING_LIKE_IT", None),
    ],
)
def test_an_unknown_variable_is_refused_with_the_closest_setting(
    name: str, meant: str | None
) -> None:
    result = _run([], env={name: "x"})
    _refused(result, name)
    if meant is not None:
        assert f"did you mean {meant}?" in result.output


def test_variables_that_are_not_settings_and_nested_tables_are_accepted() -> None:
    env = {
        "ROLLSTREAM_TEST_BOOTSTRAP": "127.0.0.1:1",
        "ROLLSTREAM_UP_STEPS": "5",
        "ROLLSTREAM_TRAINER_FAILPOINT": "after_checkpoint",
        "ROLLSTREAM_TRAINER__ENGINE__LR": "0.5",
        "ROLLSTREAM_WEIGHTS__REGIONS__EU__BUCKET": "b-eu",
        "ROLLSTREAM_KAFKA__CLIENT_OVERRIDES__LINGER_MS": "5",
    }
    result = _run([], env=env)
    assert result.exit_code == 0, result.output
