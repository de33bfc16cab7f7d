"""Roles started by hand, as on separate machines, learn as ``rollstream up`` does.

Every process is started from one config file, the shipped example
(``infra/rollstream.example.toml``) with only the addresses, names and files of this test
laid over it, as a user would: an engine and a producer in the home region, a stream
worker, a trainer, a mirror copying versions to a second region, and a second engine and
producer there (``produce --region``). No ``up``. The run must train nothing staler than
the window, the second region must generate with versions the mirror copied there, and
the audit must reconcile after the roles stop. The same run with ``[lora]`` laid over it
moves adapters instead of models: the engines get each version through the dynamic LoRA
endpoints, the mirror carries the one base and the adapters to the second region.
Learning through the pipeline is asserted by the end-to-end run of ``up``
(``tests/test_e2e_pipeline.py``): this run is the same pipeline, started differently, so
it runs only as long as its own assertions need.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from core.config import KafkaConfig, S3Config, merge_tables, to_toml
from core.process import Launcher, RoleSpec, free_port
from schemas.codec import decode

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "infra" / "rollstream.example.toml"
STEPS = 10  # enough versions for the mirror to carry some to the second region


def _store(config: S3Config) -> dict[str, object]:
    secret = config.secret_access_key.get_secret_value() if config.secret_access_key else None
    return {
        "endpoint_url": config.endpoint_url,
        "bucket": config.bucket,
        "embedded": False,
        "access_key_id": config.access_key_id,
        "secret_access_key": secret,
    }


def _config(
    tmp_path: Path,
    kafka: KafkaConfig,
    home: S3Config,
    other: S3Config,
    unique,
    ports,
    lora: dict[str, object] | None,
) -> Path:
    """The example file with this test's broker, stores, topic names and files."""
    topics = {name: unique(f"rollouts.{name}") for name in ("raw", "scored", "stale", "dlq")}
    versions = unique("policy.versions")
    run = unique("by-hand")
    ours = {
        "run_id": run,
        "state_dir": str(tmp_path / "state"),
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "s3": {**_store(home), "name": "home"},
        "weights": {"topic": versions, "regions": {"eu": _store(other)}},
        "producers": {
            "engine": {"port": ports["engine"]},
            "rollout": {"topic": topics["raw"], "progress": False},
        },
        "streams": {"app_id": unique("streams"), "topics": {**topics, "versions": versions}},
        "trainer": {
            "max_steps": STEPS,
            "progress": False,
            "metrics_file": str(tmp_path / "trainer.jsonl"),
            "ledger_file": str(tmp_path / "ledger.jsonl"),
            "checkpoint": {"dir": str(tmp_path / "checkpoints")},
            "topics": {
                "scored": topics["scored"],
                "dlq": topics["dlq"],
                "stale": topics["stale"],
                "versions": versions,
                "group_id": unique("trainer"),
            },
        },
    }
    if lora is not None:
        ours["lora"] = lora
    with EXAMPLE.open("rb") as fh:
        example = tomllib.load(fh)
    path = tmp_path / "rl.toml"
    path.write_text(to_toml(merge_tables(example, ours)))
    return path


def _rows(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _health(port: int):
    import urllib.request

    def probe() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as r:
            return bool(r.status == 200)

    return probe


def _rollstream(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config), *args],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("lora", [None, {"rank": 8, "alpha": 16.0}], ids=["full", "lora"])
def test_roles_started_by_hand_from_the_example_config_span_two_regions_and_reconcile(
    lora: dict[str, object] | None,
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    second_s3_config: S3Config,
    unique_name,
    tmp_path: Path,
) -> None:
    ports = {"engine": free_port(), "engine_eu": free_port()}
    config = _config(tmp_path, kafka_config, s3_config, second_s3_config, unique_name, ports, lora)
    rs = [sys.executable, "-m", "rollstream", "--config", str(config)]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    home_url = f"http://127.0.0.1:{ports['engine']}"
    eu_url = f"http://127.0.0.1:{ports['engine_eu']}"
    launcher = Launcher(tmp_path / "logs")
    specs = [
        RoleSpec("engine", [*rs, "serve"], env, _health(ports["engine"])),
        RoleSpec("engine-eu", [*rs, "serve", "--port", str(ports["engine_eu"])], env,
                 _health(ports["engine_eu"])),
        RoleSpec("streams", [*rs, "stream"], env),
        RoleSpec("trainer", [*rs, "train"], env),
        RoleSpec("mirror", [*rs, "weights", "mirror", "--from", "home", "--to", "eu", "--watch"],
                 env),
        RoleSpec("producer", [*rs, "produce", "--engine-url", home_url, "--producer-id", "home-0"],
                 env),
        RoleSpec("producer-eu", [*rs, "produce", "--engine-url", eu_url, "--region", "eu",
                                 "--producer-id", "eu-0"], env),
    ]  # fmt: skip
    for spec in specs:
        launcher.add(spec)
    metrics = tmp_path / "trainer.jsonl"
    infra = _rollstream(config, "infra", "up")  # external services: declares topics, bucket
    assert infra.returncode == 0, infra.stdout + infra.stderr
    try:
        for spec in specs:
            launcher.start(spec.name, ready_timeout_s=240)
        trainer = launcher.roles["trainer"]
        deadline = time.monotonic() + 900
        while trainer.running() and time.monotonic() < deadline:
            for role in launcher.exited():
                if role.name != "trainer":
                    pytest.fail(f"{role.name} exited ({role.returncode()}):\n" + _tail(role))
            time.sleep(1.0)
        assert trainer.returncode() == 0, _tail(trainer)
    finally:
        launcher.stop_all(["producer", "producer-eu", "engine", "engine-eu", "mirror", "streams"])
    assert not launcher.leftovers()

    rows = _rows(metrics)
    assert len(rows) == STEPS
    window = tomllib.loads(config.read_text())["profile"]["staleness_window"]
    assert max(r["staleness/max"] for r in rows) <= window

    # both regions' producers delivered, the second one's records tagged with its region
    ledgers = tmp_path / "state" / "producers"
    producers = {p.parent.name for p in ledgers.rglob("ledger.jsonl") if p.stat().st_size}
    assert producers == {"home-0", "eu-0"}
    audit = _rollstream(config, "audit", "--json")
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    figures = json.loads(audit.stdout)
    assert figures["problems"] == [] and figures["producers"] == 2
    assert figures["delivery_from"] == "ledgers"
    # one command audits a multi-machine run: delivery told by the raw topic, no ledger files
    remote = _rollstream(config, "audit", "--json", "--delivery", "topic")
    assert remote.returncode == 0, remote.stdout[-3000:] + remote.stderr[-3000:]
    from_topic = json.loads(remote.stdout)
    assert from_topic["delivery_from"] == "topic" and from_topic["producers"] == 2
    for key in ("delivered", "trained", "stale", "dlq", "missing", "problems"):
        assert from_topic[key] == figures[key], key
    # the second region generated under versions it read from its own store (the mirror's)
    newest = _newest_versions(config)
    assert set(newest) == {"home", "eu"} and newest["eu"] >= 1, newest
    if lora is not None:  # each region's engine got the versions as named adapters
        for producer in ("home-0", "eu-0"):
            kept = list(ledgers.glob(f"*/{producer}/weights/v*"))
            assert kept and all(d.name.endswith("-adapter") for d in kept), (producer, kept)
        # the first version is the run's one base, kept while the adapters name it
        shown = [_rollstream(config, "weights", "show", str(v)) for v in (0, STEPS)]
        assert all(s.returncode == 0 for s in shown), [s.stderr[-3000:] for s in shown]
        manifests = [json.loads(s.stdout) for s in shown]
        assert [m["kind"] for m in manifests] == ["base", "adapter"]
        assert manifests[1]["base"] == 0


def _newest_versions(config: Path) -> dict[str, int]:
    """The newest policy version each region's raw records were generated under."""
    from confluent_kafka import Consumer

    from core.topic_reader import read_range, reader_config, whole_topic
    from rollstream.config.settings import load_config

    loaded = load_config(config)
    topic = loaded.producers.rollout.topic
    consumer = Consumer(reader_config(loaded.kafka.client_config(), "regions"))
    found: dict[str, int] = {}
    try:
        for msg in read_range(consumer, topic, whole_topic(consumer, topic)):
            record = decode(msg.value())
            found[record.region] = max(found.get(record.region, -1), record.max_version)
    finally:
        consumer.close()
    return found


def _tail(role) -> str:
    return role.log_file.read_text(errors="replace")[-4000:] if role.log_file.exists() else ""
