"""The pipeline across hosts made of network namespaces, on one machine, as root.

Each host is a namespace on one switch (``infra.netns.lan``), with an address that exists
only there; this namespace joins the switch as 10.214.0.254 to declare topics and audit:

==========  ===========  ===========================================================
host        address      runs
==========  ===========  ===========================================================
kafka       10.214.0.1   the broker: SASL_PLAINTEXT + SCRAM-SHA-512 on 10.214.0.1:9093;
                         its controller and PLAINTEXT listeners on its own loopback
trainer     10.214.0.2   region A's SeaweedFS (``home``), the trainer, the mirror
region-b    10.214.0.3   region B's SeaweedFS (``eu``), an engine, ``produce --region eu``;
                         its link limited to ``REGION_B_MBIT`` both ways (``tc tbf``)
streams     10.214.0.4   the stream worker
producers   10.214.0.5   region A's engine and producer
==========  ===========  ===========================================================

Every role is its documented command behind ``ip netns exec rs-<host>``, reading one config
file that names the other hosts' addresses; every listener off loopback authenticates:
the broker by SCRAM, the engines (bound to their host's address) by the config's
``api_key``, the stores by their access keys. ``sudo python -m infra.hosts --dir D`` builds
it, runs the roles until the trainer's last step, audits the run and removes every
namespace, whatever happens; ``tests/system/rollstream/test_roles_by_hand.py`` runs the same layout.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from core.config import KafkaConfig, S3Config, default_cache_dir, merge_tables, to_toml
from core.process import Launcher, RoleSpec, port_open
from infra.kafka import EmbeddedKafka, scram_format_args, with_scram_listener
from infra.netns import Lan, lan
from infra.s3 import Host, SeaweedServer, ensure_bucket
from infra.tls import replace_private
from weights.store import make_s3_client

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "infra" / "rollstream.example.toml"
HOSTS = ("kafka", "trainer", "region-b", "streams", "producers")
REGION_B_MBIT = 100.0
SCRAM_PORT, ENGINE_PORT = 9093, 30000  # each host has its own ports: fixed ones serve
SCRAM_USER = "rollstream"


class ScramKafka(EmbeddedKafka):
    """One KRaft node in ``netns`` whose clients log in with SCRAM-SHA-512 on
    ``address``; its controller and inter-broker listeners stay on that host's loopback,
    where no other host reaches them. The credential is added at format, as KRaft asks."""

    def __init__(self, data_dir: Path, cache_dir: Path, address: str, netns: str) -> None:
        super().__init__(KafkaConfig(), data_dir, cache_dir, netns=netns)
        self.address = address
        self.password = _kept_secret(data_dir / "scram-password")

    def format_args(self) -> list[str]:
        return scram_format_args(SCRAM_USER, self.password)

    def properties(self) -> dict[str, str]:
        return with_scram_listener(super().properties(), self.address, SCRAM_PORT)

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.address}:{SCRAM_PORT}"

    def client_config(self) -> KafkaConfig:
        """What every role's ``[kafka]`` says: this address, with the SCRAM login."""
        return KafkaConfig(
            bootstrap_servers=self.bootstrap_servers,
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username=SCRAM_USER,
            sasl_password=self.password,  # type: ignore[arg-type]
        )

    def healthy(self) -> bool:
        """The broker answers a logged-in metadata request across the switch."""
        if not port_open(SCRAM_PORT, self.address):  # quiet pre-check: librdkafka logs refusals
            return False
        config = {**self.client_config().client_config(), "socket.timeout.ms": 2000}
        return 1 in AdminClient(config).list_topics(timeout=2).brokers


def _kept_secret(path: Path) -> str:
    """A random secret kept in ``path`` (owner-only), made on first use."""
    if not path.exists():
        replace_private(path, secrets.token_urlsafe(24).encode())
    return path.read_text().strip()


@dataclass(frozen=True)
class Services:
    """What the hosts serve before any role starts: the broker and the two regions'
    stores, whose addresses and keys are known as soon as they are launched;
    ``wait_ready`` returns once all three answer (and both buckets exist)."""

    kafka: KafkaConfig
    home: S3Config
    other: S3Config
    wait_ready: Callable[[], None]


@contextmanager
def services(net: Lan, directory: Path, cache_dir: Path | None = None) -> Iterator[Services]:
    """The broker on ``kafka``, region A's store on ``trainer`` and region B's on
    ``region-b``, launched together (not waited for: the engines, which need none of
    them, load their model meanwhile) and stopped on exit."""
    broker = ScramKafka(
        directory / "kafka",
        cache_dir or default_cache_dir(),
        net.address["kafka"],
        net.netns["kafka"],
    )
    stores = [
        SeaweedServer(directory / name, host=Host(net.address[host], net.netns[host]))
        for name, host in (("region-a", "trainer"), ("region-b", "region-b"))
    ]
    with ExitStack() as stack:
        for service in (*stores, broker):  # the broker's format takes a JVM's start: last
            stack.callback(service.stop)
            service.launch()
        home, other = (s.config(name=n) for s, n in zip(stores, ("home", "eu"), strict=True))

        def wait_ready() -> None:
            broker.wait_ready(120)
            for store, config in zip(stores, (home, other), strict=True):
                store.wait_ready(60)  # the mirror writes into region B's bucket: make both
                ensure_bucket(make_s3_client(config), config.bucket)

        yield Services(broker.client_config(), home, other, wait_ready)


def kafka_table(config: KafkaConfig) -> dict[str, object]:
    """``[kafka]`` for a config file, with the SASL login when there is one."""
    table: dict[str, object] = {"bootstrap_servers": config.bootstrap_servers}
    if config.security_protocol != "PLAINTEXT":
        table["security_protocol"] = config.security_protocol
        table["sasl_mechanism"] = config.sasl_mechanism
        table["sasl_username"] = config.sasl_username
        table["sasl_password"] = (
            config.sasl_password.get_secret_value() if config.sasl_password else None
        )
    return table


def hosts_tables(found: Services, api_key: str) -> dict[str, object]:
    """What the hosts add to a config: the broker, both stores (``eu`` is region B) and
    the engines' port and key."""
    return {
        "kafka": kafka_table(found.kafka),
        "s3": found.home.file_table(),
        "weights": {"regions": {"eu": found.other.file_table()}},
        "producers": {"engine": {"port": ENGINE_PORT, "api_key": api_key}},
    }


def engine_url(net: Lan, host: str) -> str:
    return f"http://{net.address[host]}:{ENGINE_PORT}"


def health(url: str) -> Callable[[], bool]:
    """A probe of an engine's open ``/health`` endpoint, never through a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def probe() -> bool:
        with opener.open(f"{url}/health", timeout=1.0) as response:
            return bool(response.status == 200)

    return probe


def role_env() -> dict[str, str]:
    """Roles import this checkout, whatever the interpreter's own install points at."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def role_specs(net: Lan, config: Path, python: str = sys.executable) -> list[RoleSpec]:
    """Every role by its documented command, on its host, in the order they start."""
    env = role_env()

    def on(host: str, *args: str) -> list[str]:
        return [*net.exec_prefix(host), python, "-m", "rollstream", "--config", str(config), *args]

    home, eu = engine_url(net, "producers"), engine_url(net, "region-b")
    return [
        RoleSpec("engine", on("producers", "serve", "--host", net.address["producers"]), env,
                 health(home)),
        RoleSpec("engine-eu", on("region-b", "serve", "--host", net.address["region-b"]), env,
                 health(eu)),
        RoleSpec("streams", on("streams", "stream"), env),
        RoleSpec("trainer", on("trainer", "train"), env),
        RoleSpec("mirror", on("trainer", "weights", "mirror", "--from", "home", "--to", "eu",
                              "--watch"), env),
        RoleSpec("producer", on("producers", "produce", "--engine-url", home, "--producer-id",
                                "home-0"), env),
        RoleSpec("producer-eu", on("region-b", "produce", "--engine-url", eu, "--region", "eu",
                                   "--producer-id", "eu-0"), env),
    ]  # fmt: skip


#: The order roles stop in, a tier at a time: generation first, the trainer's inputs last.
STOP_TIERS = (("producer", "producer-eu"), ("engine", "engine-eu", "mirror"), ("streams",))


def stop_in_tiers(launcher: Launcher, timeout_s: float = 30.0) -> None:
    """Stop every role: each tier's roles at once (SIGTERM to all, then wait for each),
    tier after tier; the roles in no tier (the trainer) last."""
    tiers = [[n for n in tier if n in launcher.roles] for tier in STOP_TIERS]
    named = {n for tier in tiers for n in tier}
    tiers.append([n for n in launcher.roles if n not in named])
    for tier in tiers:
        roles = [launcher.roles[n] for n in tier]
        for role in roles:
            if role.running():
                role.signal(signal.SIGTERM)
        for role in roles:
            role.stop(timeout_s)


def rollstream(
    config: Path, *args: str, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """A ``rollstream`` command from this namespace (it reaches every host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(role_env())
    return subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config), *args],
        env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


def run_until_trained(
    launcher: Launcher,
    specs: list[RoleSpec],
    timeout_s: float,
    meanwhile: Callable[[], None] = lambda: None,
) -> None:
    """Start the roles and wait for the trainer to finish; raises with the log of a role
    that exits before it, or of a trainer that fails. The roles with a readiness probe
    (the engines, which need nothing else) start first, all at once, and load their model
    while ``meanwhile`` runs (``infra up``); the rest start, in order, once they answer.
    Stops every role, whatever happens."""
    for spec in specs:
        launcher.add(spec)
    probed = [spec.name for spec in specs if spec.ready is not None]
    try:
        for name in probed:
            launcher.roles[name].start()
        meanwhile()
        for name in probed:
            launcher.roles[name].wait_ready(240)
        for spec in specs:
            if spec.name not in probed:
                launcher.start(spec.name, ready_timeout_s=240)
        trainer = launcher.roles["trainer"]
        deadline = time.monotonic() + timeout_s
        while trainer.running() and time.monotonic() < deadline:
            for role in launcher.exited():
                if role.name != "trainer":
                    raise RuntimeError(f"{role.name} exited ({role.returncode()}):\n{_tail(role)}")
            time.sleep(1.0)
        if trainer.returncode() != 0:
            raise RuntimeError(f"trainer ended with {trainer.returncode()}:\n{_tail(trainer)}")
    finally:
        stop_in_tiers(launcher)


def _tail(role: object) -> str:
    log = getattr(role, "log_file", None)
    return log.read_text(errors="replace")[-4000:] if log and log.exists() else ""


def main(argv: list[str] | None = None) -> int:
    """Build the hosts, run the pipeline across them for ``--steps``, audit, clean up."""
    parser = argparse.ArgumentParser(prog="python -m infra.hosts", description=__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="Where data, config and logs go.")
    parser.add_argument("--steps", type=int, default=10, help="Trainer steps (default 10).")
    parser.add_argument("--mbit", type=float, default=REGION_B_MBIT, help="Region B's link rate.")
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    with lan(HOSTS, {"region-b": args.mbit}) as net, services(net, directory / "services") as found:
        ours = {
            "run_id": "hosts",
            "state_dir": str(directory / "state"),
            "trainer": {"max_steps": args.steps, "progress": False},
            "producers": {"rollout": {"progress": False}},
        }
        with EXAMPLE.open("rb") as fh:
            example = tomllib.load(fh)
        tables = merge_tables(ours, hosts_tables(found, secrets.token_urlsafe(24)))
        config = directory / "rl.toml"
        config.write_text(to_toml(merge_tables(example, tables)))

        def infra_up() -> None:  # declares the topics (and signing keys) the roles need
            found.wait_ready()
            up = rollstream(config, "infra", "up")
            if up.returncode != 0:
                raise RuntimeError(f"rollstream infra up failed:\n{up.stdout}{up.stderr}")

        run_until_trained(Launcher(directory / "logs"), role_specs(net, config), 1800, infra_up)
        print(f"region B received {net.bytes_sent_to('region-b')} bytes through its link")
        audit = rollstream(config, "audit", "--json")
        print(audit.stdout or audit.stderr)
        return audit.returncode


if __name__ == "__main__":
    sys.exit(main())
