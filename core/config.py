"""The config sections every layer shares: connections, weights, retries, restarts.

Pydantic only (no torch), so every entry point validates its configuration before it
imports anything heavy. ``StrictModel`` is the base of every section: unknown keys are
errors and instances are frozen. The whole file (``RollstreamConfig``) is assembled in
``rollstream.config.settings`` from these sections and the roles' own.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, NamedTuple, TypeVar

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

log = logging.getLogger(__name__)

Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port; 0 asks the system for a free one."""

Seconds = Annotated[float, Field(gt=0)]
"""A duration, a timeout or an interval: more than 0 seconds."""

MetricsHost = Annotated[
    str,
    Field(
        description="Address the metrics endpoint binds (loopback: the metrics tell run "
        "topology, versions and DLQ reasons; open it on purpose).",
    ),
]
"""The address a role's Prometheus endpoint binds (every role's the same setting)."""

SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""Names that become file paths and S3 keys (run ids, producer ids, regions): no ``/``,
no leading dot, so ``..`` or an absolute path can never leave the state dir or prefix."""
SafeName = Annotated[str, Field(pattern=SAFE_NAME)]

TOPIC_NAME = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,248}$"
"""Kafka's legal topic (and, here, app and group id) characters and length, no leading dot:
they also name changelog topics and transactional ids."""
TopicName = Annotated[str, Field(pattern=TOPIC_NAME)]


class StrictModel(BaseModel):
    """Base for config sections: unknown keys are rejected, instances are immutable, and
    no float setting is NaN or infinite (TOML can write both; no setting means them)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ConfigurationError(ValueError):
    """A setting that cannot work here, with what to change: the CLI shows the message,
    not a traceback."""


def default_state_dir() -> Path:
    """Where embedded services keep their data and logs unless told otherwise."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "rollstream"


def default_cache_dir() -> Path:
    """Where downloaded artefacts (Kafka jars, converted models) are cached."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollstream"


SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
"""``kafka.sasl_mechanism`` values; PLAIN and SCRAM take a user name and password,
OAUTHBEARER an OIDC client (``oauth_*``), GSSAPI its Kerberos settings through
``client_overrides`` (librdkafka clients only)."""
PASSWORD_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

DEFAULT_REPLICAS = 3
"""Replicas of a topic on a cluster of at least this many brokers, unless configured."""


class Replication(NamedTuple):
    """What every topic rollstream creates gets: its replication factor and its
    ``min.insync.replicas`` (``None``: the cluster's default)."""

    factor: int
    min_insync: int | None

    def topic_configs(self) -> dict[str, str]:
        """The topic configs to add at creation."""
        return {} if self.min_insync is None else {"min.insync.replicas": str(self.min_insync)}


#: librdkafka properties, and the value that turns off a check TLS relies on.
INSECURE_OVERRIDES = {
    "enable.ssl.certificate.verification": "false",
    "ssl.endpoint.identification.algorithm": "none",
}


class KafkaConfig(StrictModel):
    """How to reach Kafka. No ``bootstrap_servers`` means: run the embedded broker."""

    bootstrap_servers: str | None = Field(
        default=None,
        description="host:port[,host:port]; empty to start the embedded KRaft broker.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="librdkafka security.protocol of every client."
    )
    sasl_mechanism: str | None = Field(
        default=None,
        description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or GSSAPI; "
        "empty with a SASL protocol: PLAIN.",
    )
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(
        default=None, description="SASL password (masked when a config is printed)."
    )
    oauth_token_endpoint_url: str | None = Field(
        default=None,
        description="OAUTHBEARER: the OIDC token endpoint (client-credentials grant).",
    )
    oauth_client_id: str | None = Field(default=None, description="OAUTHBEARER: the client id.")
    oauth_client_secret: SecretStr | None = Field(
        default=None, description="OAUTHBEARER: the client secret (masked when printed)."
    )
    oauth_scope: str | None = Field(
        default=None, description="OAUTHBEARER: the scope asked for; empty: none."
    )
    ssl_ca_location: str | None = Field(
        default=None, description="CA certificate file for TLS; empty: the system's CAs."
    )
    ssl_certificate_location: str | None = Field(
        default=None, description="Client certificate (PEM) for mutual TLS, with ssl_key_location."
    )
    ssl_key_location: str | None = Field(
        default=None, description="The client certificate's private key (PEM)."
    )
    ssl_key_password: SecretStr | None = Field(
        default=None, description="Password of an encrypted ssl_key_location (masked when printed)."
    )
    replication_factor: int | None = Field(
        default=None,
        ge=1,
        description="Replicas of every topic rollstream creates (Faust's included); empty: "
        "1 on the embedded broker, else min(3, the cluster's brokers).",
    )
    min_insync_replicas: int | None = Field(
        default=None,
        ge=1,
        description="min.insync.replicas of every topic rollstream creates; empty: one "
        "less than the replication factor when that is 3 or more, else the cluster's default.",
    )
    client_overrides: dict[str, str] = Field(
        default_factory=dict,
        description="Extra librdkafka properties passed through to every client (not "
        "security.protocol, and TLS verification stays on unless `insecure`).",
    )
    insecure: bool = Field(
        default=False,
        description="Allow client_overrides that turn TLS certificate or host name "
        "verification off; every client built with them logs a warning.",
    )
    # Embedded broker only.
    brokers: int = Field(
        default=1,
        ge=1,
        le=9,
        description="Brokers of the embedded cluster: 1, or a cluster of combined KRaft "
        "nodes on loopback whose topics are replicated. Not used with bootstrap_servers "
        "set: an external cluster's size is read from its metadata.",
    )
    port: Port = Field(default=0, description="Embedded broker port; 0 picks a free one.")
    controller_port: Port = Field(default=0, description="Embedded controller port; 0 = free.")
    heap: str = Field(
        default="512m",
        pattern=r"^([1-9][0-9]*[kKmMgG]?)?$",
        description="JVM heap (-Xmx/-Xms) of the embedded broker: a size such as 512m or 2g.",
    )
    jvm_profile: Literal["light", "throughput"] = Field(
        default="light",
        description=(
            "JVM settings of the embedded broker: light (the quick compiler only, a serial"
            " collector: less CPU on a machine the roles share) or throughput (the optimising"
            " compiler and G1, for sustained load)."
        ),
    )
    kafka_version: str = Field(default="4.1.1", description="Apache Kafka release to resolve.")

    @field_validator("sasl_mechanism")
    @classmethod
    def _known_mechanism(cls, mechanism: str | None) -> str | None:
        if mechanism is None:
            return None
        upper = mechanism.upper()
        if upper not in SASL_MECHANISMS:
            raise ValueError(f"unknown SASL mechanism; one of {', '.join(SASL_MECHANISMS)}")
        return upper

    @model_validator(mode="after")
    def _security_settings_fit(self) -> KafkaConfig:
        """Refuse settings the chosen protocol would ignore or cannot work without, here,
        rather than as a client that retries a connection the broker never accepts."""
        protocol = self.security_protocol
        sasl, tls = protocol.startswith("SASL_"), protocol.endswith("SSL")
        mechanism = self.mechanism
        oauth = ("oauth_token_endpoint_url", "oauth_client_id", "oauth_client_secret")
        problems = []
        if not sasl:
            given = ["sasl_mechanism", "sasl_username", "sasl_password", *oauth, "oauth_scope"]
            if given := [f for f in given if getattr(self, f) is not None]:
                problems.append(f"{', '.join(given)} set, which only a SASL_* protocol uses")
        if not tls:
            given = ["ssl_ca_location", "ssl_certificate_location", "ssl_key_location"]
            if given := [f for f in given if getattr(self, f) is not None]:
                problems.append(f"{', '.join(given)} set, which only SSL or SASL_SSL uses")
        if mechanism in PASSWORD_MECHANISMS and (
            not self.sasl_username or self.sasl_password is None
        ):
            problems.append(f"SASL {mechanism} needs sasl_username and sasl_password")
        if mechanism == "OAUTHBEARER":
            if missing := [f for f in oauth if not getattr(self, f)]:
                problems.append(f"SASL OAUTHBEARER needs {', '.join(missing)}")
        elif sasl and any(getattr(self, f) for f in (*oauth, "oauth_scope")):
            problems.append("oauth_* settings need sasl_mechanism OAUTHBEARER")
        if (self.ssl_certificate_location is None) != (self.ssl_key_location is None):
            problems.append("ssl_certificate_location and ssl_key_location go together")
        if self.ssl_key_password is not None and self.ssl_key_location is None:
            problems.append("ssl_key_password needs ssl_key_location")
        if problems:
            raise ValueError(f"security_protocol {protocol}: " + "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _overrides_keep_security(self) -> KafkaConfig:
        """An override must not undo the typed security settings without saying so: the
        protocol has its own key, and TLS verification goes off only with ``insecure``."""
        if "security.protocol" in self.client_overrides:
            raise ValueError(
                "client_overrides may not set security.protocol: set security_protocol"
            )
        if (weakened := self.verification_off()) and not self.insecure:
            raise ValueError(
                f"client_overrides {', '.join(weakened)} turn TLS verification off: "
                "set kafka.insecure = true to allow it"
            )
        return self

    def verification_off(self) -> list[str]:
        """The ``client_overrides`` (``key=value``) that turn TLS verification off."""
        return [
            f"{key}={value}"
            for key, value in self.client_overrides.items()
            if INSECURE_OVERRIDES.get(key) == value.strip().lower()
        ]

    @model_validator(mode="after")
    def _cluster_settings_fit(self) -> KafkaConfig:
        """A cluster's nodes choose their ports."""
        if self.brokers > 1 and (self.port or self.controller_port):
            raise ValueError(
                "kafka.port and kafka.controller_port fix the single embedded broker's "
                f"ports; a cluster of {self.brokers} chooses free ones: leave them 0"
            )
        return self

    @model_validator(mode="after")
    def _insync_within_replicas(self) -> KafkaConfig:
        both = self.min_insync_replicas, self.replication_factor
        if None not in both and both[0] > both[1]:  # type: ignore[operator]
            raise ValueError(
                f"min_insync_replicas = {both[0]} is more than replication_factor = "
                f"{both[1]}: no write would succeed"
            )
        return self

    @property
    def embedded(self) -> bool:
        return not self.bootstrap_servers

    @property
    def mechanism(self) -> str | None:
        """The SASL mechanism in force: PLAIN when a SASL protocol names none (for every
        client alike: librdkafka's own default would be GSSAPI)."""
        if not self.security_protocol.startswith("SASL_"):
            return None
        return self.sasl_mechanism or "PLAIN"

    def replication(self, brokers: int) -> Replication:
        """The one resolver of every topic's replication, given the cluster's broker count
        (from its metadata): the configured values, else min(3, brokers) replicas and
        ``min.insync.replicas`` one less than the factor when that is 3 or more (one broker
        may be down and ``acks=all`` writes still succeed, yet each is on two), else the
        cluster's default.
        The embedded broker is one broker, so it gets 1 and the default."""
        if brokers < 1:
            raise ConfigurationError("the Kafka cluster reported no brokers")
        factor = self.replication_factor or min(DEFAULT_REPLICAS, brokers)
        if factor > brokers:
            raise ConfigurationError(
                f"kafka.replication_factor = {factor} but the cluster has {brokers} broker(s): "
                f"set it to at most {brokers}"
            )
        min_insync = self.min_insync_replicas
        if min_insync is None and factor >= DEFAULT_REPLICAS:
            min_insync = factor - 1
        if min_insync is not None and min_insync > factor:
            raise ConfigurationError(
                f"kafka.min_insync_replicas = {min_insync} is more than the replication "
                f"factor {factor}: no write would succeed"
            )
        return Replication(factor, min_insync)

    def client_config(self, bootstrap_servers: str | None = None) -> dict[str, str]:
        """librdkafka (confluent-kafka) settings for this cluster, security included."""
        servers = bootstrap_servers or self.bootstrap_servers
        if not servers:
            raise ValueError("no bootstrap servers: start the embedded broker or configure one")
        conf: dict[str, str] = {
            "bootstrap.servers": servers,
            "security.protocol": self.security_protocol,
        }
        if self.mechanism:
            conf["sasl.mechanism"] = self.mechanism
        if self.sasl_username:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password:
            conf["sasl.password"] = self.sasl_password.get_secret_value()
        if self.mechanism == "OAUTHBEARER":
            conf["sasl.oauthbearer.method"] = "oidc"
            conf["sasl.oauthbearer.token.endpoint.url"] = str(self.oauth_token_endpoint_url)
            conf["sasl.oauthbearer.client.id"] = str(self.oauth_client_id)
            assert self.oauth_client_secret is not None  # the validator saw to it
            conf["sasl.oauthbearer.client.secret"] = self.oauth_client_secret.get_secret_value()
            if self.oauth_scope:
                conf["sasl.oauthbearer.scope"] = self.oauth_scope
        for key, value in (
            ("ssl.ca.location", self.ssl_ca_location),
            ("ssl.certificate.location", self.ssl_certificate_location),
            ("ssl.key.location", self.ssl_key_location),
        ):
            if value:
                conf[key] = value
        if self.ssl_key_password is not None:
            conf["ssl.key.password"] = self.ssl_key_password.get_secret_value()
        conf.update(self.client_overrides)
        if weakened := self.verification_off():
            log.warning("Kafka TLS verification is off (%s, kafka.insecure)", ", ".join(weakened))
        return conf


class S3Config(StrictModel):
    """One S3 store (a region). No ``endpoint_url`` and ``embedded`` true: run SeaweedFS."""

    name: SafeName = Field(default="local", description="Region name used in logs and records.")
    endpoint_url: str | None = Field(
        default=None, description="S3 endpoint; empty means AWS (or the embedded store)."
    )
    bucket: str = Field(default="rollstream", description="Bucket holding the weights.")
    prefix: str = Field(default="", description="Key prefix inside the bucket.")
    region_name: str = Field(default="us-east-1", description="The S3 client's region.")
    embedded: bool = Field(
        default=True,
        description="Start SeaweedFS when no endpoint is set. False with no endpoint = AWS.",
    )
    access_key_id: str | None = Field(
        default=None, description="Leave empty to use the standard AWS credential chain."
    )
    secret_access_key: SecretStr | None = Field(
        default=None, description="With access_key_id; masked when a config is printed."
    )
    # Embedded store only.
    port: Port = Field(default=0, description="Embedded S3 port; 0 picks a free one.")
    memory_limit: str = Field(
        default="512MiB",
        pattern=r"^([1-9][0-9]*(B|KiB|MiB|GiB|TiB)?)?$",
        description="GOMEMLIMIT of the embedded store: a size such as 512MiB or 2GiB.",
    )

    @property
    def starts_embedded(self) -> bool:
        return self.embedded and not self.endpoint_url

    def file_table(self) -> dict[str, str | bool]:
        """This store as a config file's ``[s3]`` (or region) table for a process elsewhere:
        its address, bucket and keys written out, ``embedded = false``; unset keys left out."""
        secret = self.secret_access_key.get_secret_value() if self.secret_access_key else None
        table = {
            "name": self.name,
            "endpoint_url": self.endpoint_url,
            "bucket": self.bucket,
            "region_name": self.region_name,
            "embedded": False,
            "access_key_id": self.access_key_id,
            "secret_access_key": secret,
        }
        return {k: v for k, v in table.items() if v is not None}


class WeightsConfig(StrictModel):
    """How versions are written, found, verified and kept."""

    base_every: int = Field(
        default=20, ge=1, description="Write a full base at least every this many versions."
    )
    max_delta_fraction: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="Write a base instead of a delta larger than this fraction of a base.",
    )
    zstd_level: int = Field(default=3, ge=1, le=22, description="zstd level of deltas.")
    keep_versions: int = Field(
        default=16,
        ge=1,
        description="Retention window: the newest N versions stay, plus what they need.",
    )
    orphan_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="Files of unfinished uploads older than this are garbage-collected.",
    )
    signing_key: Path | None = Field(
        default=None, description="ed25519 private key (PEM) the writer signs manifests with."
    )
    public_key: Path | None = Field(
        default=None,
        description="ed25519 public key (PEM) every version must be signed with; "
        "`rollstream up` / `infra up` create a key pair in the state dir and fill both in.",
    )
    allow_unsigned: bool = Field(
        default=False,
        description="Accept unsigned versions when no key is configured (anyone who can "
        "write the bucket then controls the weights); without it, no key is an error.",
    )
    verify_state: bool = Field(
        default=True,
        description="Followers check each rebuilt tensor against the writer's CRC-32.",
    )
    poll_interval_s: Seconds = Field(
        default=2.0, description="How often followers and mirrors poll the store."
    )
    retry_max_s: Seconds = Field(
        default=30.0, description="Longest back-off between retries of a refused version."
    )
    topic: TopicName = Field(default="policy.versions", description="Announcement topic.")
    regions: dict[SafeName, S3Config] = Field(
        default_factory=dict,
        description="Other S3 stores by region name (the home store is the [s3] section).",
    )

    @field_validator("regions")
    @classmethod
    def _regions_are_named_by_their_key(cls, regions: dict[str, S3Config]) -> dict[str, S3Config]:
        """``[weights.regions.eu]`` is the region ``eu``: its ``name`` may be left out."""
        named = {}
        for key, region in regions.items():
            if "name" in region.model_fields_set and region.name != key:
                raise ValueError(f"region {key!r} has a different name {region.name!r}")
            named[key] = region if region.name == key else region.model_copy(update={"name": key})
        return named

    @field_validator("public_key")
    @classmethod
    def _public_key_is_a_file(cls, path: Path | None) -> Path | None:
        """Refused here, not later inside a role's task: a follower without its key
        cannot verify anything."""
        if path is not None and not path.is_file():
            raise ValueError(f"no such file: {path}")
        return path

    def region(self, name: str, home: S3Config) -> S3Config:
        """The store named ``name``: a configured region or the home store."""
        if name in self.regions:
            return self.regions[name]
        if name == home.name:
            return home
        known = sorted({home.name, *self.regions})
        raise KeyError(f"unknown region {name!r} (known: {', '.join(known)})")


class LoraConfig(StrictModel):
    """Train a LoRA adapter on the frozen model instead of every weight: each version is
    then the adapter, a few MB, published on one base (see ``weights.writer``)."""

    rank: int = Field(default=16, ge=1, le=1024, description="The adapter's rank r.")
    alpha: float = Field(
        default=32.0, gt=0, description="Scale numerator: the update is (alpha / rank) B A."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear modules that get an adapter (PEFT's matching: a "
        "module whose name ends with one of them).",
    )

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
                raise ValueError(f"{name!r} is not a module name")
        return value


class RetryConfig(StrictModel):
    """Back-off for S3 and broker outages: retried until they answer, never skipped."""

    initial_s: Seconds = Field(default=0.5, description="First back-off.")
    max_s: Seconds = Field(default=30.0, description="Longest back-off between attempts.")
    give_up_after_s: Seconds | None = Field(
        default=None,
        description="Raise after retrying this long; empty: retry until it works.",
    )

    @model_validator(mode="after")
    def _first_within_longest(self) -> RetryConfig:
        if self.initial_s > self.max_s:
            raise ValueError(f"initial_s = {self.initial_s} is more than max_s = {self.max_s}")
        return self


class RestartConfig(StrictModel):
    """When a crashed worker is started again (``core.process``)."""

    max_restarts: int = Field(
        default=5, ge=0, description="Restarts allowed within window_s; 0: never restart."
    )
    window_s: Seconds = Field(
        default=300.0,
        description="A child that ran longer than this resets the restart count.",
    )
    backoff_s: float = Field(
        default=1.0, ge=0, description="Wait before the first restart; doubled per crash."
    )
    max_backoff_s: float = Field(default=30.0, ge=0, description="Longest wait between restarts.")

    @model_validator(mode="after")
    def _first_within_longest(self) -> RestartConfig:
        if self.backoff_s > self.max_backoff_s:
            raise ValueError(
                f"backoff_s = {self.backoff_s} is more than max_backoff_s = {self.max_backoff_s}"
            )
        return self


class PresenceConfig(StrictModel):
    """Role heartbeats on a compacted topic (``core.presence``): how a run learns which
    producers, stream workers and trainers are there, wherever they were started."""

    topic: TopicName = Field(default="rollstream.roles", description="The heartbeat topic.")
    interval_s: Seconds = Field(
        default=5.0, description="Seconds between heartbeats of a running role."
    )
    enabled: bool = Field(default=True, description="Send heartbeats at all.")


TrackingBackend = Literal["tensorboard", "wandb", "mlflow"]


class TrackingConfig(StrictModel):
    """The ``[tracking]`` section: where metric rows go besides their JSONL files."""

    backends: list[TrackingBackend] = Field(
        default_factory=list,
        description="Any of tensorboard, wandb, mlflow (none: the JSONL files only).",
    )
    dir: Path | None = Field(
        default=None,
        description="TensorBoard logs, W&B offline runs and the local MLflow store "
        "(default: <state_dir>/tracking/<run_id>).",
    )
    project: str = Field(
        default="rollstream",
        min_length=1,
        description="The W&B project and the MLflow experiment.",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        default="offline",
        description="offline writes under dir with no network (sync later with `wandb sync`).",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="An MLflow server or store URI (default: an SQLite store, dir/mlflow.db).",
    )

    def directory(self, state_dir: Path, run_id: str) -> Path:
        return self.dir if self.dir is not None else Path(state_dir) / "tracking" / run_id


class SharedConfig(BaseSettings):
    """The sections every role reads: the run, where state lives, Kafka, S3 and weights.

    ``rollstream.config.settings.RollstreamConfig`` adds the roles' sections; below the
    application, code is typed against this base so it never depends on a role."""

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        env_prefix="ROLLSTREAM_",
        env_nested_delimiter="__",
    )

    run_id: str = Field(
        default="default",
        pattern=SAFE_NAME,
        description="Name of the training run (a path and S3 key component: letters, "
        "digits, '.', '_' and '-', not starting with a dot).",
    )
    policy: str = Field(
        default="",
        pattern=r"^([a-z][a-z0-9_-]{0,31})?$",
        description="The policy of a multi-policy run this process serves ('' = the run's "
        "only policy). Set by `--policy`, which also applies that policy's [policies.<name>].",
    )
    state_dir: Path = Field(
        default_factory=default_state_dir,
        description="Data and logs of embedded services.",
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Cached Kafka jars and converted models (never inside the repo).",
    )
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    s3: S3Config = Field(default_factory=S3Config)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    presence: PresenceConfig = Field(default_factory=PresenceConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    lora: LoraConfig | None = Field(
        default=None,
        description="Train and ship a LoRA adapter (empty: full fine-tuning). The trainer, "
        "engine and old-logit service all build the same adapter on their model.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Built from its values alone: the environment is read once per process, by the
        resolver (``core.config_sources.read_sources``), not again by every copy."""
        return (init_settings,)


SectionT = TypeVar("SectionT", bound=BaseModel)


class RoleConfig(NamedTuple, Generic[SectionT]):
    """What a role receives, the same shape for every role: ``shared`` (the run, the
    policy served, state and cache dirs, Kafka, S3, weights, presence) and ``section``, the
    role's own (``ProducersConfig``, ``StreamsConfig`` or ``TrainerConfig``).

    A pair rather than the whole file, so a role can only depend on what it is given;
    ``rollstream.config.settings.role_config`` cuts it from the one resolved configuration."""

    shared: SharedConfig
    section: SectionT


def merge_tables(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top`` laid over it; nested tables merge key by key."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_tables(merged[key], value)
        else:
            merged[key] = value
    return merged


def to_toml(data: Mapping[str, Any]) -> str:
    """TOML text of a nested dict (``tomli-w``); ``None`` values are left out (TOML has no
    null), paths and secrets are written as plain strings."""
    return tomli_w.dumps(_plain(data))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return value
