"""The audit on the documented multi-machine path: a trainer started by hand from the
shipped example config (``infra/rollstream.example.toml``), which names no ledger file,
keeps its ledger in its default place, and ``rollstream audit`` with the same file finds
it and reconciles. Only this test's addresses, names and a short run are laid over the
example, as a user would."""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner
from confluent_kafka import Producer
from support.paths import REPO
from support.synthetic import scored_group, synthetic_groups

from core.config import KafkaConfig, S3Config, merge_tables, to_toml
from infra.services import Services
from infra.topics import ensure_topics
from rollstream.cli.main import main
from rollstream.config.settings import load_config, role_config
from schemas.codec import encode
from schemas.group import encode_group

EXAMPLE = REPO / "infra" / "rollstream.example.toml"


def _example_with(tmp_path: Path, kafka: KafkaConfig, s3: S3Config, unique) -> Path:
    """The example file with this test's broker, store, topic names and state dir."""
    topics = {name: unique(f"rollouts.{name}") for name in ("raw", "scored", "stale", "dlq")}
    versions = unique("policy.versions")
    secret = s3.secret_access_key.get_secret_value() if s3.secret_access_key else None
    ours = {
        "run_id": unique("by-hand"),
        "state_dir": str(tmp_path / "state"),
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "s3": {
            "endpoint_url": s3.endpoint_url,
            "bucket": s3.bucket,
            "embedded": False,
            "access_key_id": s3.access_key_id,
            "secret_access_key": secret,
        },
        "weights": {"topic": versions},
        "presence": {"enabled": False},
        "producers": {"rollout": {"topic": topics["raw"]}},
        "streams": {"app_id": unique("streams"), "topics": {**topics, "versions": versions}},
        "trainer": {
            "max_steps": 2,
            "progress": False,
            "batch": {"max_groups": 2, "max_wait_s": 30.0},
            "topics": {
                **{k: topics[k] for k in ("scored", "stale", "dlq")},
                "versions": versions,
                "group_id": unique("trainer"),
                "group_instance_id": unique("trainer-0"),
            },
        },
    }
    with EXAMPLE.open("rb") as fh:
        example = tomllib.load(fh)
    assert "ledger_file" not in example.get("trainer", {})  # the path under test
    path = tmp_path / "rl.toml"
    path.write_text(to_toml(merge_tables(example, ours)))
    return path


def _produce(kafka: KafkaConfig, topic: str, items: list[tuple[bytes, bytes]]) -> None:
    producer = Producer({**kafka.client_config(), "enable.idempotence": True})
    now = int(time.time() * 1000)
    for key, value in items:
        producer.produce(topic, key=key, value=value, timestamp=now)
    assert producer.flush(30) == 0


def test_a_trainer_started_from_the_example_config_keeps_a_ledger_the_audit_finds(
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    from consumers.trainer import Trainer

    path = _example_with(tmp_path, kafka_config, s3_config, unique_name)
    config = load_config(path)
    assert config.trainer.ledger_file is None
    ensure_topics(kafka_config.client_config(), config.run_topic_specs())
    groups = synthetic_groups(4, seed=61, run_id=config.run_id)
    # what the producers delivered (raw) and what the stream scored from it
    raw = [(t.group_id.encode(), encode(t)) for g in groups for t in g]
    _produce(kafka_config, config.producers.rollout.topic, raw)
    scored = [(g[0].group_id.encode(), encode_group(scored_group(g))) for g in groups]
    _produce(kafka_config, config.trainer.topics.scored, scored)

    # what `rollstream infra up` does for roles started by hand: the state dir's key pair
    services = Services(config)
    services.ensure_keys()
    shared, section = role_config(services.resolved(), "trainer")
    summary = Trainer(shared, section).run()
    assert summary.step == 2 and summary.trained == 16

    result = CliRunner().invoke(
        main, ["--config", str(path), "audit", "--delivery", "topic", "--quick", "--json"]
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert figures["trained"] == 16 and figures["delivered"] == 16
    assert figures["missing"] == 0 and figures["trained_twice"] == 0
    ledger = config.state_dir / "trainer" / config.run_id / "checkpoints" / "ledger.jsonl"
    assert ledger.is_file()  # where docs/configuration.md says it is
