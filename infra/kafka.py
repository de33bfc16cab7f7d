"""The embedded Apache Kafka broker: jars from Maven Central, KRaft nodes on loopback.

Lifecycle: ``resolve_kafka_jars`` copies the broker and its runtime dependencies (by
``infra/pom.xml``) into a cache under the user's home, once per Kafka version.
``EmbeddedKafka.start`` formats the log directory the first time (``StorageTool format
--standalone``), starts ``kafka.Kafka`` as a combined broker+controller bound to
127.0.0.1 and waits until the broker answers a metadata request. Ports are chosen once
and kept in the data directory, because a KRaft controller's address is part of its
stored voter set: the same data directory always comes back on the same ports.

``EmbeddedKafkaCluster`` (``kafka.brokers`` > 1) runs several such nodes, each a combined
broker+controller under ``<data_dir>/node-<id>``, formatted with one cluster id and a static
voter set (``controller.quorum.voters``): the quorum survives any one node down. Kafka's
docs advise separate controllers in production; a cluster on one machine for tests and
local runs is the combined mode's use. The internal topics (``__consumer_offsets``,
``__transaction_state``) get the replication ``KafkaConfig.replication`` resolves for the
cluster's size, as every topic rollstream creates does.

Every tool run here has a time limit (``MAVEN_TIMEOUT_S``, ``STORAGE_TOOL_TIMEOUT_S``): a
Maven Central that stops answering or a JVM that hangs is a ``ServiceError`` that says
so, never a command that waits forever.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson
from confluent_kafka.admin import AdminClient

from core.config import KafkaConfig, Replication
from core.process import ServiceError, ServiceProcess, free_ports, port_open, service_env, tail

INFRA_DIR = Path(__file__).resolve().parent
POM = INFRA_DIR / "pom.xml"
LOG4J2_CONFIG = INFRA_DIR / "log4j2.yaml"

#: Resolving the broker's jars downloads ~100 MB the first time.
MAVEN_TIMEOUT_S = 1200.0
#: ``StorageTool format`` starts a JVM and returns in seconds.
STORAGE_TOOL_TIMEOUT_S = 180.0
# ``kafka.jvm_profile``: see its description in core.config.KafkaConfig.
JVM_PROFILES: dict[str, list[str]] = {
    "light": ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"],
    "throughput": ["-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"],
}
# What the JVM reads from its environment (``java`` is started directly: no Kafka script
# reads KAFKA_OPTS or KAFKA_HEAP_OPTS).
JVM_ENV = ("JAVA_HOME", "JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS")


def _run_tool(
    cmd: list[str], what: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to completion within ``timeout_s`` (the child is killed past it), in
    ``env`` if given, else in this process's environment."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, check=False, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired as err:
        # what it printed so far (bytes even with text=True, on some Python versions)
        parts = [
            p.decode(errors="replace") if isinstance(p, bytes) else p or ""
            for p in (err.stdout, err.stderr)
        ]
        output = "".join(parts)
        raise ServiceError(
            f"{what} did not finish within {timeout_s:.0f}s (killed): {' '.join(cmd[:3])} ...\n"
            f"{output[-2000:]}"
        ) from None


def cluster_id() -> str:
    """A fresh cluster id as Kafka's ``StorageTool random-uuid`` prints it (16 random bytes,
    URL-safe base64 without padding, never starting with '-'), without starting a JVM."""
    while True:
        made = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        if not made.startswith("-"):
            return made


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise ServiceError("java not found on PATH: the embedded Kafka broker needs a JRE 17+")
    return java


def resolve_kafka_jars(version: str, cache_dir: Path, timeout_s: float = MAVEN_TIMEOUT_S) -> Path:
    """Directory holding every runtime jar of ``kafka_2.13:<version>``; resolved once
    (Maven is killed after ``timeout_s``, and its partial copy is not marked complete)."""
    lib_dir = cache_dir / "kafka" / version / "libs"
    done_marker = lib_dir / ".complete"
    if done_marker.exists():
        return lib_dir
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ServiceError("mvn not found on PATH: it resolves the Kafka jars from Maven Central")
    if lib_dir.exists():
        shutil.rmtree(lib_dir)  # a half-finished earlier copy
    lib_dir.mkdir(parents=True)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(POM),
        f"-Dkafka.version={version}",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={lib_dir}",
    ]
    result = _run_tool(cmd, f"resolving Kafka {version} from Maven Central", timeout_s)
    if result.returncode != 0:
        raise ServiceError(
            f"resolving Kafka {version} from Maven Central failed:\n"
            f"{result.stdout}\n{result.stderr}"
        )
    if not any(lib_dir.glob(f"kafka_2.13-{version}.jar")):
        raise ServiceError(f"Maven ran but kafka_2.13-{version}.jar is not in {lib_dir}")
    done_marker.touch()
    return lib_dir


def with_listener(props: dict[str, str], protocol: str, address: str, port: int) -> dict[str, str]:
    """``props`` (a ``server.properties``) with one more client listener, named after its
    security ``protocol``, on ``address:port`` and advertised there."""
    url = f"{protocol}://{address}:{port}"
    return {
        **props,
        "listeners": f"{props['listeners']},{url}",
        "advertised.listeners": f"{props['advertised.listeners']},{url}",
        "listener.security.protocol.map": (
            f"{props['listener.security.protocol.map']},{protocol}:{protocol}"
        ),
    }


def with_scram_listener(props: dict[str, str], address: str, port: int) -> dict[str, str]:
    """``props`` with a SASL_PLAINTEXT listener whose clients log in with SCRAM-SHA-512
    (credentials added at format: ``scram_format_args``)."""
    return {
        **with_listener(props, "SASL_PLAINTEXT", address, port),
        "sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
    }


def scram_format_args(user: str, password: str) -> list[str]:
    """``StorageTool format`` arguments adding one SCRAM-SHA-512 credential: a KRaft
    cluster's can only be added when it is formatted, before any broker runs."""
    return ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]


@dataclass(frozen=True)
class KafkaPorts:
    broker: int
    controller: int


def node_ports(data_dir: Path, broker: int = 0, controller: int = 0) -> KafkaPorts:
    """The ports of the node whose data lives in ``data_dir``: chosen on first use (0: a
    free one), then kept in ``ports.json``."""
    ports_file = data_dir / "ports.json"
    if ports_file.exists():
        return KafkaPorts(**orjson.loads(ports_file.read_bytes()))
    spare = free_ports(2)
    ports = KafkaPorts(broker=broker or spare[0], controller=controller or spare[1])
    data_dir.mkdir(parents=True, exist_ok=True)
    ports_file.write_bytes(orjson.dumps(ports.__dict__))
    return ports


@dataclass(frozen=True)
class Quorum:
    """A node's place in a cluster: its id, the cluster's static voter set and id, and
    how many brokers it has (which sets the internal topics' replication)."""

    node_id: int
    voters: str  # controller.quorum.voters: "1@127.0.0.1:port,2@..."
    cluster_id: str
    brokers: int


class KafkaService(Protocol):
    """What ``infra.services`` needs of an embedded broker or cluster."""

    @property
    def bootstrap_servers(self) -> str: ...

    def running(self) -> bool: ...

    def launch(self) -> None: ...

    def wait_ready(self, timeout: float = 90.0) -> str: ...

    def start(self, timeout: float = 90.0) -> str: ...

    def stop(self) -> bool: ...

    def kill(self) -> bool: ...


class EmbeddedKafka:
    """A KRaft broker+controller whose data lives in ``data_dir``: alone (its own
    single-voter quorum), or one node of an ``EmbeddedKafkaCluster`` (``quorum``)."""

    def __init__(
        self,
        config: KafkaConfig,
        data_dir: Path,
        cache_dir: Path,
        quorum: Quorum | None = None,
        netns: str | None = None,
    ) -> None:
        self.config = config
        self.data_dir = data_dir
        self.cache_dir = cache_dir
        self.quorum = quorum
        self.netns = netns  # run the broker in this network namespace (a host of its own)
        self.process = ServiceProcess("kafka", data_dir)

    @property
    def node_id(self) -> int:
        return self.quorum.node_id if self.quorum else 1

    # -- files -------------------------------------------------------------------------
    @property
    def log_dir(self) -> Path:
        return self.data_dir / "log"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    def ports(self) -> KafkaPorts:
        """Ports of this data directory: chosen on first use, then fixed."""
        if self.quorum is not None:  # a cluster chose every node's ports before its voters
            return node_ports(self.data_dir)
        return node_ports(self.data_dir, self.config.port, self.config.controller_port)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.ports().broker}"

    def properties(self) -> dict[str, str]:
        """The broker's ``server.properties``: one KRaft node on 127.0.0.1."""
        ports = self.ports()
        if self.quorum is None:
            voters = {"controller.quorum.bootstrap.servers": f"127.0.0.1:{ports.controller}"}
            internal = Replication(1, 1)
        else:
            voters = {"controller.quorum.voters": self.quorum.voters}
            internal = self.config.replication(self.quorum.brokers)
        factor, min_insync = str(internal.factor), str(internal.min_insync or 1)
        return {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            **voters,
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{ports.broker},CONTROLLER://127.0.0.1:{ports.controller}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{ports.broker}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.log_dir),
            "num.partitions": "1",
            "offsets.topic.replication.factor": factor,
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": factor,
            "transaction.state.log.min.isr": min_insync,
            "transaction.state.log.num.partitions": "8",
            "share.coordinator.state.topic.replication.factor": factor,
            "share.coordinator.state.topic.min.isr": min_insync,
            "group.initial.rebalance.delay.ms": "0",
            # Trajectories of long responses and scored groups are larger than 1 MB.
            "message.max.bytes": str(16 * 1024 * 1024),
            "replica.fetch.max.bytes": str(16 * 1024 * 1024),
            "auto.create.topics.enable": "false",
        }

    def _write_properties(self) -> None:
        props = self.properties()
        self.properties_file.write_text("".join(f"{k}={v}\n" for k, v in props.items()))

    # -- lifecycle ---------------------------------------------------------------------
    def _java(self, main_class: str, *args: str, heap: str | None = None) -> list[str]:
        lib_dir = resolve_kafka_jars(self.config.kafka_version, self.cache_dir)
        jvm = [java_binary()]
        if heap:
            jvm += [f"-Xmx{heap}", f"-Xms{heap}"]
        jvm += JVM_PROFILES[self.config.jvm_profile]
        jvm += [
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}",
            f"-Dkafka.logs.dir={self.data_dir}",
            "-cp",
            f"{lib_dir}/*",
            main_class,
        ]
        return jvm + list(args)

    def format_args(self) -> list[str]:
        """Extra ``StorageTool format`` arguments: a broker with a SCRAM listener adds its
        credentials here (``scram_format_args``)."""
        return []

    def formatted(self) -> bool:
        return (self.log_dir / "meta.properties").exists()

    def format(self) -> None:
        """Format the log directory once (idempotent): alone with a fresh cluster id as
        its own single voter; in a cluster with the cluster's id and static voters."""
        self._write_properties()
        if self.formatted():
            return
        if self.quorum is None:
            identity = ["-t", cluster_id(), "--standalone"]
        else:
            identity = ["-t", self.quorum.cluster_id]
        result = _run_tool(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                *identity,
                "-c",
                str(self.properties_file),
                "-g",
                *self.format_args(),
            ),
            f"formatting {self.log_dir}",
            STORAGE_TOOL_TIMEOUT_S,
            service_env(*JVM_ENV),
        )
        if result.returncode != 0 or not self.formatted():
            raise ServiceError(f"formatting {self.log_dir} failed:\n{result.stdout}{result.stderr}")

    def running(self) -> bool:
        return self.process.running()

    def launch(self) -> None:
        """Start the broker process unless it runs already; does not wait."""
        if not self.process.running():
            self.format()
            argv = self._java("kafka.Kafka", str(self.properties_file), heap=self.config.heap)
            if self.netns is not None:
                argv = ["ip", "netns", "exec", self.netns, *argv]
            self.process.start(argv, service_env(*JVM_ENV), marker=str(self.properties_file))

    def wait_ready(self, timeout: float = 90.0) -> str:
        """Wait until the broker answers; returns its bootstrap address."""
        self.process.wait_until(self.healthy, timeout, "a broker that answers metadata requests")
        return self.bootstrap_servers

    def start(self, timeout: float = 90.0) -> str:
        self.launch()
        return self.wait_ready(timeout)

    def healthy(self) -> bool:
        """True when the broker answers a metadata request that lists it (a cluster's
        node: and every other broker of the cluster)."""
        if not port_open(self.ports().broker):  # quiet pre-check: librdkafka logs refusals
            return False
        admin = AdminClient(
            {"bootstrap.servers": self.bootstrap_servers, "socket.timeout.ms": 2000}
        )
        metadata = admin.list_topics(timeout=2)
        wanted = self.quorum.brokers if self.quorum else 1
        return self.node_id in metadata.brokers and len(metadata.brokers) >= wanted

    def stop(self) -> bool:
        """Controlled shutdown (SIGTERM); True if a broker was running."""
        return self.process.stop(timeout=60)

    def kill(self) -> bool:
        """Crash the broker (SIGKILL, no controlled shutdown): the next start recovers its
        log directory as after a power cut. True if a broker was running."""
        return self.process.kill()

    def describe_failure(self) -> str:
        return tail(self.process.log_file)


class EmbeddedKafkaCluster:
    """``config.brokers`` combined KRaft nodes on loopback, under ``data_dir/node-<id>``
    (see the module doc). Ports and the cluster id are chosen once and kept."""

    def __init__(self, config: KafkaConfig, data_dir: Path, cache_dir: Path) -> None:
        self.config = config
        self.data_dir = data_dir
        ids = range(1, config.brokers + 1)
        ports = {i: node_ports(data_dir / f"node-{i}") for i in ids}
        voters = ",".join(f"{i}@127.0.0.1:{ports[i].controller}" for i in ids)
        self.nodes = [
            EmbeddedKafka(
                config,
                data_dir / f"node-{i}",
                cache_dir,
                Quorum(i, voters, self._cluster_id(), config.brokers),
            )
            for i in ids
        ]

    def _cluster_id(self) -> str:
        """The cluster's id, chosen when its first node is formatted, then kept."""
        path = self.data_dir / "cluster-id"
        if not path.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(cluster_id())
        return path.read_text().strip()

    def node(self, node_id: int) -> EmbeddedKafka:
        """The node whose ``node.id`` (a broker id in the cluster's metadata) is ``node_id``."""
        return self.nodes[node_id - 1]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def running(self) -> bool:
        """Whether any node runs (the cluster is stopped only when none does)."""
        return any(node.running() for node in self.nodes)

    def launch(self) -> None:
        """Start every node that is not running; does not wait (a quorum needs a majority
        of the voters, so the nodes must start together)."""
        for node in self.nodes:
            node.launch()

    def wait_ready(self, timeout: float = 90.0) -> str:
        """Wait until every node answers and sees all the cluster's brokers."""
        for node in self.nodes:
            node.wait_ready(timeout)
        return self.bootstrap_servers

    def start(self, timeout: float = 90.0) -> str:
        self.launch()
        return self.wait_ready(timeout)

    def stop(self) -> bool:
        """Controlled shutdown of every node, all at once (one by one, the last nodes
        would wait for a quorum that is gone); True if any was running."""
        for pid in [node.process.pid() for node in self.nodes]:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)
        return any([node.stop() for node in self.nodes])

    def kill(self) -> bool:
        """SIGKILL every node; True if any was running."""
        return any([node.kill() for node in self.nodes])

    def describe_failure(self) -> str:
        return "\n".join(f"node {n.node_id}: {n.describe_failure()}" for n in self.nodes)


def embedded_kafka(config: KafkaConfig, data_dir: Path, cache_dir: Path) -> KafkaService:
    """The embedded broker ``config`` asks for: one node, or a cluster of ``brokers``."""
    if config.brokers > 1:
        return EmbeddedKafkaCluster(config, data_dir, cache_dir)
    return EmbeddedKafka(config, data_dir, cache_dir)
