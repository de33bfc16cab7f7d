"""The embedded Apache Kafka broker: jars from Maven Central, one KRaft node on loopback.

Lifecycle: ``resolve_kafka_jars`` copies the broker and its runtime dependencies (by
``infra/pom.xml``) into a cache under the user's home, once per Kafka version.
``EmbeddedKafka.start`` formats the log directory the first time (``StorageTool format
--standalone``), starts ``kafka.Kafka`` as a combined broker+controller bound to
127.0.0.1 and waits until the broker answers a metadata request. Ports are chosen once
and kept in the data directory, because a KRaft controller's address is part of its
stored voter set: the same data directory always comes back on the same ports.

Every tool run here has a time limit (``MAVEN_TIMEOUT_S``, ``STORAGE_TOOL_TIMEOUT_S``): a
Maven Central that stops answering or a JVM that hangs is a ``ServiceError`` that says
so, never a command that waits forever.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import orjson
from confluent_kafka.admin import AdminClient

from core.config import KafkaConfig
from core.process import ServiceError, ServiceProcess, free_port, port_open, service_env, tail

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


@dataclass(frozen=True)
class KafkaPorts:
    broker: int
    controller: int


class EmbeddedKafka:
    """A single-node KRaft broker+controller whose data lives in ``data_dir``."""

    def __init__(self, config: KafkaConfig, data_dir: Path, cache_dir: Path) -> None:
        self.config = config
        self.data_dir = data_dir
        self.cache_dir = cache_dir
        self.process = ServiceProcess("kafka", data_dir)

    # -- files -------------------------------------------------------------------------
    @property
    def log_dir(self) -> Path:
        return self.data_dir / "log"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    def ports(self) -> KafkaPorts:
        """Ports of this data directory: chosen on first use, then fixed."""
        ports_file = self.data_dir / "ports.json"
        if ports_file.exists():
            return KafkaPorts(**orjson.loads(ports_file.read_bytes()))
        ports = KafkaPorts(
            broker=self.config.port or free_port(),
            controller=self.config.controller_port or free_port(),
        )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_file.write_bytes(orjson.dumps(ports.__dict__))
        return ports

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.ports().broker}"

    def properties(self) -> dict[str, str]:
        """The broker's ``server.properties``: one KRaft node on 127.0.0.1."""
        ports = self.ports()
        return {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{ports.controller}",
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{ports.broker},CONTROLLER://127.0.0.1:{ports.controller}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{ports.broker}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.log_dir),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "8",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
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
        """Extra ``StorageTool format`` arguments: a KRaft cluster's SCRAM credentials
        can only be added when it is formatted (``--add-scram``), before any broker
        runs; a broker with a SCRAM listener adds them here."""
        return []

    def formatted(self) -> bool:
        return (self.log_dir / "meta.properties").exists()

    def format(self) -> None:
        """Format the log directory once with a fresh cluster id (idempotent)."""
        self._write_properties()
        if self.formatted():
            return
        uuid = cluster_id()
        result = _run_tool(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                "-t",
                uuid,
                "-c",
                str(self.properties_file),
                "--standalone",
                "-g",
                *self.format_args(),
            ),
            f"formatting {self.log_dir}",
            STORAGE_TOOL_TIMEOUT_S,
            service_env(*JVM_ENV),
        )
        if result.returncode != 0 or not self.formatted():
            raise ServiceError(f"formatting {self.log_dir} failed:\n{result.stdout}{result.stderr}")

    def launch(self) -> None:
        """Start the broker process unless it runs already; does not wait."""
        if not self.process.running():
            self.format()
            argv = self._java("kafka.Kafka", str(self.properties_file), heap=self.config.heap)
            self.process.start(argv, service_env(*JVM_ENV), marker=str(self.properties_file))

    def wait_ready(self, timeout: float = 90.0) -> str:
        """Wait until the broker answers; returns its bootstrap address."""
        self.process.wait_until(self.healthy, timeout, "a broker that answers metadata requests")
        return self.bootstrap_servers

    def start(self, timeout: float = 90.0) -> str:
        self.launch()
        return self.wait_ready(timeout)

    def healthy(self) -> bool:
        """True when the broker answers a metadata request and lists itself."""
        if not port_open(self.ports().broker):  # quiet pre-check: librdkafka logs refusals
            return False
        admin = AdminClient(
            {"bootstrap.servers": self.bootstrap_servers, "socket.timeout.ms": 2000}
        )
        metadata = admin.list_topics(timeout=2)
        return len(metadata.brokers) >= 1

    def stop(self) -> bool:
        """Controlled shutdown (SIGTERM); True if a broker was running."""
        return self.process.stop(timeout=60)

    def kill(self) -> bool:
        """Crash the broker (SIGKILL, no controlled shutdown): the next start recovers its
        log directory as after a power cut. True if a broker was running."""
        return self.process.kill()

    def describe_failure(self) -> str:
        return tail(self.process.log_file)
