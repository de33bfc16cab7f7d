"""Typed configuration shared by every role.

One light module (pydantic only, no torch) so that every entry point can parse and
validate its configuration before importing anything heavy. Unknown keys are errors.

Sources, later ones winning: defaults < TOML file (``--config``) < environment
(``ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS=...``, nested with ``__``). A few widely used
variables are honoured too: ``KAFKA_BOOTSTRAP_SERVERS`` and ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``. S3 credentials come from the standard AWS chain unless the store
is the embedded one.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.config import TrainerConfig
from producers.config import ProducersConfig
from rollstream.strict import StrictModel
from streams.config import StreamsConfig


def default_state_dir() -> Path:
    """Where embedded services keep their data and logs unless told otherwise."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "rollstream"


def default_cache_dir() -> Path:
    """Where downloaded artefacts (Kafka jars, converted models) are cached."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollstream"


class KafkaConfig(StrictModel):
    """How to reach Kafka. No ``bootstrap_servers`` means: run the embedded broker."""

    bootstrap_servers: str | None = Field(
        default=None,
        description="host:port[,host:port]; empty to start the embedded KRaft broker.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = Field(default=None, description="PLAIN, SCRAM-SHA-512, ...")
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = None
    client_overrides: dict[str, str] = Field(
        default_factory=dict,
        description="Extra librdkafka properties passed through to every client.",
    )
    # Embedded broker only.
    port: int = Field(default=0, description="Embedded broker port; 0 picks a free one.")
    controller_port: int = Field(default=0, description="Embedded controller port; 0 = free.")
    heap: str = Field(default="512m", description="JVM heap (-Xmx/-Xms) of the embedded broker.")
    kafka_version: str = Field(default="4.1.1", description="Apache Kafka release to resolve.")

    @property
    def embedded(self) -> bool:
        return not self.bootstrap_servers

    def client_config(self, bootstrap_servers: str | None = None) -> dict[str, str]:
        """librdkafka (confluent-kafka) settings for this cluster, security included."""
        servers = bootstrap_servers or self.bootstrap_servers
        if not servers:
            raise ValueError("no bootstrap servers: start the embedded broker or configure one")
        conf: dict[str, str] = {
            "bootstrap.servers": servers,
            "security.protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password:
            conf["sasl.password"] = self.sasl_password.get_secret_value()
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        conf.update(self.client_overrides)
        return conf


class S3Config(StrictModel):
    """One S3 store (a region). No ``endpoint_url`` and ``embedded`` true: run SeaweedFS."""

    name: str = Field(default="local", description="Region name used in logs and records.")
    endpoint_url: str | None = Field(
        default=None, description="S3 endpoint; empty means AWS (or the embedded store)."
    )
    bucket: str = "rollstream"
    prefix: str = Field(default="", description="Key prefix inside the bucket.")
    region_name: str = "us-east-1"
    embedded: bool = Field(
        default=True,
        description="Start SeaweedFS when no endpoint is set. False with no endpoint = AWS.",
    )
    access_key_id: str | None = Field(
        default=None, description="Leave empty to use the standard AWS credential chain."
    )
    secret_access_key: SecretStr | None = None
    # Embedded store only.
    port: int = Field(default=0, description="Embedded S3 port; 0 picks a free one.")
    memory_limit: str = Field(default="512MiB", description="GOMEMLIMIT of the embedded store.")

    @property
    def starts_embedded(self) -> bool:
        return self.embedded and not self.endpoint_url


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
        description="ed25519 public key (PEM); when set, followers refuse unsigned versions.",
    )
    verify_state: bool = Field(
        default=True,
        description="Followers check each rebuilt tensor against the writer's CRC-32.",
    )
    poll_interval_s: float = Field(
        default=2.0, gt=0, description="How often followers and mirrors poll the store."
    )
    retry_max_s: float = Field(
        default=30.0, gt=0, description="Longest back-off between retries of a refused version."
    )
    topic: str = Field(default="policy.versions", description="Announcement topic.")
    regions: dict[str, S3Config] = Field(
        default_factory=dict,
        description="Other S3 stores by region name (the home store is the [s3] section).",
    )

    @model_validator(mode="after")
    def _region_names_match(self) -> WeightsConfig:
        for key, region in self.regions.items():
            if region.name not in (key, "local"):
                raise ValueError(f"region {key!r} has a different name {region.name!r}")
        return self

    def region(self, name: str, home: S3Config) -> S3Config:
        """The store named ``name``: a configured region or the home store."""
        if name in self.regions:
            found = self.regions[name]
            return found if found.name == name else found.model_copy(update={"name": name})
        if name == home.name:
            return home
        known = sorted({home.name, *self.regions})
        raise KeyError(f"unknown region {name!r} (known: {', '.join(known)})")


class UpConfig(StrictModel):
    """``rollstream up``: the whole pipeline on one machine. The role sections are derived
    from these keys, under whatever the role sections of the file set explicitly."""

    sync: bool = Field(
        default=False,
        description="Synchronous baseline: staleness window 0, generation waits for each "
        "update (same code as async, only the derived config differs).",
    )
    staleness_window: int = Field(
        default=2,
        ge=0,
        description="Async mode: how many versions generation may run ahead of training "
        "(producers' admission credit and the streams' staleness filter).",
    )
    model: Literal["tiny", "smollm2-135m"] = Field(
        default="tiny",
        description="tiny: the ~132k-parameter Llama built from a config; smollm2-135m: "
        "SmolLM2-135M-Instruct from the cached GGUF.",
    )
    task: str | None = Field(
        default=None,
        description="Task name; empty: copy-first-digit-twice (tiny) or arithmetic (smollm2).",
    )
    groups_per_step: int | None = Field(
        default=None,
        ge=1,
        description="GRPO groups per optimiser step; empty: 16 (tiny) or 4 (smollm2).",
    )
    max_steps: int = Field(default=150, ge=1, description="Stop after this many trainer steps.")
    stop_timeout_s: float = Field(
        default=30.0, gt=0, description="SIGTERM grace per role before SIGKILL."
    )
    ready_timeout_s: float = Field(
        default=300.0, gt=0, description="Longest wait for a role to become ready."
    )
    restarts: int = Field(
        default=0, ge=0, description="Restart a role that exits unexpectedly this many times."
    )
    pin_cores: bool = Field(
        default=False,
        description="Pin roles to CPU cores (os.sched_setaffinity): trainer and streams on "
        "the last core, engine and producer on the others, as if on separate devices.",
    )


class RollstreamConfig(BaseSettings):
    """The whole configuration: one file for every role."""

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        env_prefix="ROLLSTREAM_",
        env_nested_delimiter="__",
    )

    run_id: str = Field(default="default", description="Name of the training run.")
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
    producers: ProducersConfig = Field(
        default_factory=ProducersConfig, description="[producers]: engine and rollout worker."
    )
    streams: StreamsConfig = Field(
        default_factory=StreamsConfig, description="[streams]: the Faust stream processors."
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="[trainer]: the DeepSpeed trainer."
    )
    up: UpConfig = Field(
        default_factory=UpConfig, description="[up]: `rollstream up` (all roles on one machine)."
    )


def _well_known_env() -> dict[str, Any]:
    """Standard variables that users of Kafka and S3 tools already set."""
    found: dict[str, Any] = {}
    if servers := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        found.setdefault("kafka", {})["bootstrap_servers"] = servers
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        found.setdefault("s3", {})["endpoint_url"] = endpoint
    return found


def merge_tables(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top`` laid over it; nested tables merge key by key."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_tables(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: Path | None = None, **overrides: Any) -> RollstreamConfig:
    """Build the config from an optional TOML file, the environment and explicit overrides.

    ``ROLLSTREAM_*`` variables win over the file (pydantic-settings gives init values
    priority, so they are merged in here by hand), explicit ``overrides`` win over both.
    """
    values: dict[str, Any] = {}
    if path is not None:
        with Path(path).open("rb") as fh:
            values = tomllib.load(fh)
    values = merge_tables(values, _well_known_env())
    env_only = RollstreamConfig.model_validate({}).model_dump(exclude_unset=True)
    values = merge_tables(values, env_only)
    values = merge_tables(values, overrides)
    return RollstreamConfig.model_validate(values)
