"""The Kafka cluster and S3 store of one configuration: embedded ones are started here.

``Services.up`` starts whatever the config leaves embedded (the Kafka broker under
``<state_dir>/kafka``, SeaweedFS under ``<state_dir>/s3``), then declares the topics and
the bucket on whichever cluster and store are in use. ``Services.resolved`` gives every
role a config whose addresses are filled in, so a role never needs to know whether the
broker is embedded or a managed cluster in another region.

Weights are signed by default: ``up`` creates an ed25519 key pair under
``<state_dir>/keys`` (private key mode 0600) unless the config names keys or sets
``weights.allow_unsigned``, and ``resolved`` fills both paths in, so the trainer signs
and every follower, mirror and stream refuses a version not signed with it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from core.config import SharedConfig
from core.process import ServiceError
from infra.kafka import KafkaService, embedded_kafka
from infra.s3 import SeaweedServer, ensure_bucket
from infra.service_users import ServiceUsers
from infra.topics import TopicReport, ensure_topics
from schemas.topics import ALL_TOPICS, TopicSpec
from weights.manifest import generate_keypair
from weights.store import make_s3_client

SIGNING_KEY_FILE = "weights-signing.pem"
PUBLIC_KEY_FILE = "weights-public.pem"


@dataclass(frozen=True)
class ServiceStatus:
    """One line of ``rollstream infra status``."""

    name: str
    mode: str  # "embedded" or "external"
    address: str
    healthy: bool
    detail: str = ""


@dataclass(frozen=True)
class UpReport:
    bootstrap_servers: str
    s3_endpoint: str
    bucket: str
    topics: TopicReport
    seconds: float


ConfigT = TypeVar("ConfigT", bound=SharedConfig)


class Services(Generic[ConfigT]):
    """Kafka + S3 for one ``SharedConfig``."""

    def __init__(self, config: ConfigT, s3_only: bool = False) -> None:
        self.config = config
        self.s3_only = s3_only  # a region's store: no broker, no topics
        self.kafka: KafkaService | None = (
            embedded_kafka(config.kafka, config.state_dir / "kafka", config.cache_dir)
            if config.kafka.embedded and not s3_only
            else None
        )
        self.s3 = (
            SeaweedServer(config.state_dir / "s3", config.s3.port, config.s3.memory_limit)
            if config.s3.starts_embedded
            else None
        )
        embedded = self.kafka is not None or self.s3 is not None
        self.users = ServiceUsers(config.state_dir) if embedded else None

    def _embedded(self) -> dict[str, KafkaService | SeaweedServer]:
        return {
            name: service
            for name, service in (("kafka", self.kafka), ("s3", self.s3))
            if service is not None
        }

    @property
    def key_dir(self) -> Path:
        return self.config.state_dir / "keys"

    def _uses_state_keys(self) -> bool:
        """Whether the weight keys are this state dir's: the config names none and does
        not choose unsigned weights."""
        weights = self.config.weights
        return (
            weights.signing_key is None
            and weights.public_key is None
            and not weights.allow_unsigned
        )

    def ensure_keys(self) -> None:
        """Create the state dir's weight key pair unless the config names keys, allows
        unsigned weights, or the pair exists."""
        if not self._uses_state_keys():
            return
        private, public = self.key_dir / SIGNING_KEY_FILE, self.key_dir / PUBLIC_KEY_FILE
        if not private.exists():
            generate_keypair(private, public)

    def resolved(self) -> ConfigT:
        """The config with embedded addresses (and embedded S3 credentials) filled in,
        and the state dir's weight keys when the config names none."""
        update: dict[str, object] = {}
        public = self.key_dir / PUBLIC_KEY_FILE
        if self._uses_state_keys() and public.exists():
            update["weights"] = self.config.weights.model_copy(
                update={"signing_key": self.key_dir / SIGNING_KEY_FILE, "public_key": public}
            )
        if self.kafka is not None:
            update["kafka"] = self.config.kafka.model_copy(
                update={"bootstrap_servers": self.kafka.bootstrap_servers}
            )
        if self.s3 is not None:
            embedded = self.s3.config(bucket=self.config.s3.bucket, name=self.config.s3.name)
            update["s3"] = self.config.s3.model_copy(
                update={
                    "endpoint_url": embedded.endpoint_url,
                    "access_key_id": embedded.access_key_id,
                    "secret_access_key": embedded.secret_access_key,
                }
            )
        return self.config.model_copy(update=update)

    def running(self, *, kafka: bool = True, s3: bool = True) -> ConfigT:
        """``resolved()`` for a command that needs the embedded broker (``kafka``) or store
        (``s3``) to be running already: a ``ServiceError`` saying what to start when one
        is not, instead of a client retrying a port where nothing listens. A role asks
        only for what every run of it uses (the broker: a trainer that publishes nothing
        or a stream with seeded old logits never reads the store). External services are
        not checked here: their clients retry an outage."""
        missing = [
            name
            for name, needed, service in (("kafka", kafka, self.kafka), ("s3", s3, self.s3))
            if needed and service is not None and not service.running()
        ]
        if missing:
            raise ServiceError(
                f"the embedded {' and '.join(missing)} of state dir {self.config.state_dir} "
                "is not running: start it with `rollstream infra up` (with the same --config "
                "and --state-dir), or configure external ones"
            )
        return self.resolved()

    def up(self, topics: Sequence[TopicSpec] = ALL_TOPICS) -> UpReport:
        """Start embedded services, wait for them, declare ``topics`` (the run's names)
        and the bucket."""
        started = time.monotonic()
        if not self.s3_only:
            self._require_external_reachable(self.resolved())  # before anything starts
            self.ensure_keys()
        # Launch both before waiting on either: the JVM's start-up overlaps SeaweedFS's.
        for service in (self.kafka, self.s3):
            if service is not None:
                service.launch()
        for service in (self.kafka, self.s3):
            if service is not None:
                service.wait_ready()
        config = self.resolved()
        declared = TopicReport((), ())
        if not self.s3_only:
            declared = ensure_topics(config.kafka.client_config(), topics, config.kafka)
        ensure_bucket(make_s3_client(config.s3), config.s3.bucket)
        return UpReport(
            bootstrap_servers="" if self.s3_only else config.kafka.bootstrap_servers or "",
            s3_endpoint=config.s3.endpoint_url or "(AWS default endpoint)",
            bucket=config.s3.bucket,
            topics=declared,
            seconds=time.monotonic() - started,
        )

    def up_for_run(self, run_id: str, topics: Sequence[TopicSpec] = ALL_TOPICS) -> UpReport:
        """``up`` for a ``rollstream up`` run, registered as a user of the embedded
        services (``infra.service_users``); ``release_run`` when the run ends."""
        if self.users is None:
            return self.up(topics)
        with self.users.locked():
            starting = [name for name, s in self._embedded().items() if not s.running()]
            self.users.join(run_id, starting=starting)
            return self.up(topics)

    def release_run(self) -> list[str]:
        """The run ends: the embedded services an ``up`` started are stopped unless other
        runs still use them; the run ids of those runs (empty: nothing left running for
        another run)."""
        if self.users is None:
            return []
        with self.users.locked():
            others = self.users.leave()
            if not others:
                embedded = self._embedded()
                for name in self.users.started_by_up():
                    if name in embedded:
                        embedded[name].stop()
                self.users.forget_starter()
        return others

    def keep_running(self) -> None:
        """The services are the user's now (``rollstream infra up``): no run's end stops
        them; ``infra down`` does."""
        if self.users is not None:
            with self.users.locked():
                self.users.forget_starter()

    def _require_external_reachable(self, config: SharedConfig) -> None:
        """An external broker that does not answer is a clear error within seconds, not
        a long retry behind a screen of client errors (a config naming an address where
        nothing listens)."""
        if self.kafka is not None:
            return
        status = self._kafka_status(config)
        if not status.healthy:
            raise ServiceError(
                f"kafka at {status.address} is configured as external "
                f"(kafka.bootstrap_servers is set) and does not answer ({status.detail}): "
                "start it, or leave kafka.bootstrap_servers empty to run the embedded broker"
            )

    def down(self) -> list[str]:
        """Stop embedded services (data is kept); names of those that were running."""
        stopped = []
        if self.kafka is not None and self.kafka.stop():
            stopped.append("kafka")
        if self.s3 is not None and self.s3.stop():
            stopped.append("s3")
        return stopped

    def status(self) -> list[ServiceStatus]:
        config = self.resolved()
        return [self._kafka_status(config), self._s3_status(config)]

    def _kafka_status(self, config: SharedConfig) -> ServiceStatus:
        address = config.kafka.bootstrap_servers or ""
        if self.kafka is not None and not self.kafka.running():
            return ServiceStatus("kafka", "embedded", address, False, "not running")
        try:
            from confluent_kafka.admin import AdminClient

            admin = AdminClient(
                config.kafka.client_config()
                | {"socket.timeout.ms": "3000", "log_level": "0"}  # the error is reported once
            )
            metadata = admin.list_topics(timeout=5)
            detail = f"{len(metadata.brokers)} broker(s), {len(metadata.topics)} topic(s)"
            healthy = True
        except Exception as err:  # status reports, it does not raise
            detail, healthy = f"unreachable: {err}", False
        mode = "embedded" if self.kafka is not None else "external"
        return ServiceStatus("kafka", mode, address, healthy, detail)

    def _s3_status(self, config: SharedConfig) -> ServiceStatus:
        address = f"{config.s3.endpoint_url or 'AWS'} bucket={config.s3.bucket}"
        if self.s3 is not None and not self.s3.running():
            return ServiceStatus("s3", "embedded", address, False, "not running")
        try:
            make_s3_client(config.s3).head_bucket(Bucket=config.s3.bucket)
            detail, healthy = "bucket reachable", True
        except Exception as err:  # status reports, it does not raise
            detail, healthy = f"unreachable: {err}", False
        mode = "embedded" if self.s3 is not None else "external"
        return ServiceStatus("s3", mode, address, healthy, detail)
