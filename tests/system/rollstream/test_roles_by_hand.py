"""Roles started by hand, as on separate machines, learn as ``rollstream up`` does.

Every process is started from one config file, the shipped example
(``infra/rollstream.example.toml``) with only the addresses, names and files of this test
laid over it, as a user would: an engine and a producer in the home region, a stream
worker, a trainer, a mirror copying versions to a second region, and a second engine and
producer there (``produce --region``). No ``up``. The run must train nothing staler than
the window, the second region must generate with versions the mirror copied there, and
the audit must reconcile after the roles stop. The run trains a LoRA adapter (``[lora]``
laid over the example), so it moves adapters: the engines get each version through the
dynamic LoRA endpoints, the mirror carries the one base and the adapters to the second
region.

The run spans hosts: each role runs in a network namespace of its own (``infra.hosts``:
the broker behind SCRAM, the trainer with region A's store and the mirror, region B behind
a rate-limited link with its store, engine and producer, the stream worker, region A's
engine and producer), every listener off loopback asking for its credentials; the mirror
must have sent region B its versions through that link. Where namespaces cannot be made
(not root) it runs on loopback on the session's services, saying so.
Learning through the pipeline is asserted by the end-to-end run of ``up``
(``tests/system/rollstream/test_e2e_pipeline.py``), and full-model versions through a
mirror by ``tests/integration/weights/test_mirror.py``: this run is the same pipeline,
started differently, so it runs only as long as its own assertions need (one run, not one
per weight kind: each costs about a minute and a half of CPU).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import tomllib
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
from support.paths import REPO

from core.config import merge_tables, to_toml
from core.process import Launcher, RoleSpec, free_port
from infra.hosts import (
    HOSTS,
    REGION_B_MBIT,
    health,
    hosts_tables,
    kafka_table,
    role_env,
    role_specs,
    rollstream,
    run_until_trained,
    services,
)
from infra.netns import lan, lan_namespaces, refusal
from schemas.codec import decode

pytestmark = pytest.mark.system

EXAMPLE = REPO / "infra" / "rollstream.example.toml"
STEPS = 10  # enough versions for the mirror to carry some to the second region
LORA = {"rank": 8, "alpha": 16.0}  # laid over the example: the run moves adapters


def _config(tmp_path: Path, tables: dict[str, object], unique) -> Path:
    """The example file with the services' addresses and keys (``tables``) and this test's
    topic names and files."""
    topics = {name: unique(f"rollouts.{name}") for name in ("raw", "scored", "stale", "dlq")}
    versions = unique("policy.versions")
    run = unique("by-hand")
    ours = {
        "run_id": run,
        "state_dir": str(tmp_path / "state"),
        "weights": {"topic": versions},
        "producers": {"rollout": {"topic": topics["raw"], "progress": False}},
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
    ours["lora"] = LORA
    with EXAMPLE.open("rb") as fh:
        example = tomllib.load(fh)
    path = tmp_path / "rl.toml"
    path.write_text(to_toml(merge_tables(example, merge_tables(tables, ours))))
    return path


def _loopback(
    request: pytest.FixtureRequest, tmp_path: Path, unique
) -> tuple[Path, list[RoleSpec]]:
    """The config and roles of a run on this host's loopback: the session's services."""
    kafka = request.getfixturevalue("kafka_config")
    home, other = (request.getfixturevalue(f) for f in ("s3_config", "second_s3_config"))
    ports = {"engine": free_port(), "engine_eu": free_port()}
    tables = {
        "kafka": kafka_table(kafka),
        "s3": home.model_copy(update={"name": "home"}).file_table(),
        "weights": {"regions": {"eu": other.model_copy(update={"name": "eu"}).file_table()}},
        "producers": {"engine": {"port": ports["engine"]}},
    }
    config = _config(tmp_path, tables, unique)
    rs = [sys.executable, "-m", "rollstream", "--config", str(config)]
    env = role_env()
    home_url = f"http://127.0.0.1:{ports['engine']}"
    eu_url = f"http://127.0.0.1:{ports['engine_eu']}"
    specs = [
        RoleSpec("engine", [*rs, "serve"], env, health(home_url)),
        RoleSpec("engine-eu", [*rs, "serve", "--port", str(ports["engine_eu"])], env,
                 health(eu_url)),
        RoleSpec("streams", [*rs, "stream"], env),
        RoleSpec("trainer", [*rs, "train"], env),
        RoleSpec("mirror", [*rs, "weights", "mirror", "--from", "home", "--to", "eu", "--watch"],
                 env),
        RoleSpec("producer", [*rs, "produce", "--engine-url", home_url, "--producer-id", "home-0"],
                 env),
        RoleSpec("producer-eu", [*rs, "produce", "--engine-url", eu_url, "--region", "eu",
                                 "--producer-id", "eu-0"], env),
    ]  # fmt: skip
    return config, specs


def _rows(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


REFUSED = refusal()


def test_roles_started_by_hand_from_the_example_config_span_two_regions_and_reconcile(
    request: pytest.FixtureRequest, unique_name, tmp_path: Path
) -> None:
    across_hosts = REFUSED is None
    if not across_hosts:
        warnings.warn(f"NETWORK NAMESPACES UNAVAILABLE, HOSTS NOT TESTED (loopback): {REFUSED}",
                      stacklevel=1)  # fmt: skip
    with ExitStack() as stack:
        if across_hosts:
            net = stack.enter_context(lan(HOSTS, {"region-b": REGION_B_MBIT}))
            found = stack.enter_context(services(net, tmp_path / "services"))
            tables = hosts_tables(found, secrets.token_urlsafe(24))
            config = _config(tmp_path, tables, unique_name)
            specs = role_specs(net, config)
            services_ready = found.wait_ready  # the engines load their model meanwhile
        else:
            config, specs = _loopback(request, tmp_path, unique_name)
            services_ready = _nothing

        def infra_up() -> None:  # external services: declares topics, bucket
            services_ready()
            infra = rollstream(config, "infra", "up")
            assert infra.returncode == 0, infra.stdout + infra.stderr

        launcher = Launcher(tmp_path / "logs")
        try:
            run_until_trained(launcher, specs, 900, infra_up)
        except RuntimeError as err:
            pytest.fail(str(err))
        assert not launcher.leftovers()
        if across_hosts:  # the mirror sent region B its versions through the limited link
            assert net.bytes_sent_to("region-b") > 100_000
        _check(config, tmp_path)
    if across_hosts:
        assert not set(lan_namespaces(HOSTS)) & set(_netns()), _netns()


def _nothing() -> None:
    pass


def _netns() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _check(config: Path, tmp_path: Path) -> None:
    """The run's assertions: its steps, both regions' delivery, the audit, the regions'
    versions and the adapters."""
    metrics = tmp_path / "trainer.jsonl"
    rows = _rows(metrics)
    assert len(rows) == STEPS
    window = tomllib.loads(config.read_text())["profile"]["staleness_window"]
    assert max(r["staleness/max"] for r in rows) <= window

    # both regions' producers delivered, the second one's records tagged with its region
    ledgers = tmp_path / "state" / "producers"
    producers = {p.parent.name for p in ledgers.rglob("ledger.jsonl") if p.stat().st_size}
    assert producers == {"home-0", "eu-0"}
    with ThreadPoolExecutor(2) as pool:  # each command is mostly its interpreter's start
        audited = pool.submit(rollstream, config, "audit", "--json")
        remotely = pool.submit(rollstream, config, "audit", "--json", "--delivery", "topic")
    audit, remote = audited.result(), remotely.result()
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    figures = json.loads(audit.stdout)
    assert figures["problems"] == [] and figures["producers"] == 2
    assert figures["delivery_from"] == "ledgers"
    # one command audits a multi-machine run: delivery told by the raw topic, no ledger files
    assert remote.returncode == 0, remote.stdout[-3000:] + remote.stderr[-3000:]
    from_topic = json.loads(remote.stdout)
    assert from_topic["delivery_from"] == "topic" and from_topic["producers"] == 2
    for key in ("delivered", "trained", "stale", "dlq", "missing", "problems"):
        assert from_topic[key] == figures[key], key
    # the second region generated under versions it read from its own store (the mirror's)
    newest = _newest_versions(config)
    assert set(newest) == {"home", "eu"} and newest["eu"] >= 1, newest
    for producer in ("home-0", "eu-0"):  # each region's engine got named adapters
        kept = list(ledgers.glob(f"*/{producer}/weights/v*"))
        assert kept and all(d.name.endswith("-adapter") for d in kept), (producer, kept)
    # the first version is the run's one base, kept while the adapters name it
    with ThreadPoolExecutor(2) as pool:
        shown = list(pool.map(lambda v: rollstream(config, "weights", "show", str(v)), (0, STEPS)))
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
