"""Configuration: files, environment, strictness, client settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from support.paths import REPO

from core.config import KafkaConfig
from core.config_sources import InvalidConfigError
from rollstream.config.settings import load_config


def test_every_shipped_config_file_parses() -> None:
    shipped = sorted(REPO.glob("infra/*.toml"))
    assert shipped, "the repo ships at least one example config"
    for path in shipped:
        config = load_config(path)
        assert config.run_id


def test_unknown_keys_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[kafka]\nbootstrap_server = "typo:9092"\n')
    with pytest.raises(InvalidConfigError, match="bootstrap_server"):
        load_config(path)


def test_environment_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.toml"
    path.write_text('run_id = "from-file"\n[kafka]\nbootstrap_servers = "file:9092"\n')
    monkeypatch.setenv("ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS", "env:9092")
    config = load_config(path)
    assert config.run_id == "from-file"
    assert config.kafka.bootstrap_servers == "env:9092"
    assert not config.kafka.embedded


def test_well_known_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "b1:9092,b2:9092")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio:9000")
    config = load_config()
    assert config.kafka.bootstrap_servers == "b1:9092,b2:9092"
    assert config.s3.endpoint_url == "http://minio:9000"
    assert not config.s3.starts_embedded


def test_defaults_are_embedded(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KAFKA_BOOTSTRAP_SERVERS", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    config = load_config()
    assert config.kafka.embedded
    assert config.s3.starts_embedded
    assert ".cache" in str(config.cache_dir) or "XDG" in str(config.cache_dir)


def test_sasl_ssl_settings_pass_through_to_clients() -> None:
    config = KafkaConfig(
        bootstrap_servers="broker:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="alice",
        sasl_password="s3cret",  # type: ignore[arg-type]
        ssl_ca_location="/etc/ca.pem",
        client_overrides={"client.id": "rollstream-test"},
    )
    assert config.client_config() == {
        "bootstrap.servers": "broker:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "alice",
        "sasl.password": "s3cret",
        "ssl.ca.location": "/etc/ca.pem",
        "client.id": "rollstream-test",
    }
    assert "s3cret" not in repr(config)


@pytest.mark.parametrize(
    "overrides",
    [
        {"enable.ssl.certificate.verification": "false"},
        {"enable.ssl.certificate.verification": " FALSE "},
        {"ssl.endpoint.identification.algorithm": "none"},
    ],
)
def test_overrides_that_turn_tls_verification_off_need_insecure(
    overrides: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    tls = {"bootstrap_servers": "broker:9093", "security_protocol": "SSL"}
    with pytest.raises(ValidationError, match=r"kafka\.insecure"):
        KafkaConfig.model_validate({**tls, "client_overrides": overrides})
    allowed = KafkaConfig.model_validate({**tls, "client_overrides": overrides, "insecure": True})
    with caplog.at_level("WARNING", logger="core.config"):
        assert allowed.client_config().items() >= overrides.items()
    assert "TLS verification is off" in caplog.text


def test_an_override_cannot_change_the_security_protocol() -> None:
    with pytest.raises(ValidationError, match="security_protocol"):
        KafkaConfig.model_validate(
            {
                "bootstrap_servers": "broker:9093",
                "security_protocol": "SASL_SSL",
                "sasl_username": "alice",
                "sasl_password": "s3cret",
                "client_overrides": {"security.protocol": "PLAINTEXT"},
            }
        )


def test_embedded_kafka_has_no_client_config_until_resolved() -> None:
    with pytest.raises(ValueError, match="no bootstrap servers"):
        KafkaConfig().client_config()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"brokers": 0}, "greater than or equal to 1"),
        ({"brokers": 10}, "less than or equal to 9"),
        ({"brokers": "three"}, "valid integer"),
        ({"brokers": 3, "port": 9092}, "chooses free ones"),
        ({"brokers": 3, "controller_port": 9093}, "chooses free ones"),
    ],
)
def test_a_bad_embedded_cluster_size_is_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KafkaConfig.model_validate(settings)


def test_an_embedded_cluster_lays_out_its_nodes_with_one_quorum(tmp_path: Path) -> None:
    """Three nodes, each its own data directory, ports and node id, one cluster id and
    one voter set naming every node's controller port; the internal topics replicated
    as the resolver says (3, two in sync)."""
    from infra.kafka import EmbeddedKafka, EmbeddedKafkaCluster, embedded_kafka

    assert isinstance(embedded_kafka(KafkaConfig(), tmp_path / "one", tmp_path), EmbeddedKafka)
    cluster = embedded_kafka(KafkaConfig(brokers=3), tmp_path / "three", tmp_path)
    assert isinstance(cluster, EmbeddedKafkaCluster)
    props = [node.properties() for node in cluster.nodes]
    assert [p["node.id"] for p in props] == ["1", "2", "3"]
    assert len({p["listeners"] for p in props}) == 3
    voters = props[0]["controller.quorum.voters"]
    assert all(p["controller.quorum.voters"] == voters for p in props)
    assert voters == ",".join(
        f"{n.node_id}@127.0.0.1:{n.ports().controller}" for n in cluster.nodes
    )
    assert len({n.quorum.cluster_id for n in cluster.nodes if n.quorum}) == 1
    assert props[0]["transaction.state.log.replication.factor"] == "3"
    assert props[0]["transaction.state.log.min.isr"] == "2"
    assert props[0]["offsets.topic.replication.factor"] == "3"
    assert len(cluster.bootstrap_servers.split(",")) == 3
    again = EmbeddedKafkaCluster(KafkaConfig(brokers=3), tmp_path / "three", tmp_path)
    assert [n.properties() for n in again.nodes] == props  # ports and id are kept


def test_topic_specs_use_the_names_the_sections_give() -> None:
    """``infra up`` and ``topics ensure`` declare the run's topics by their configured
    names, with the partitions and configs of ``schemas.topics``."""
    from rollstream.config.settings import load_config

    config = load_config(
        None,
        producers={"rollout": {"topic": "raw-x"}},
        streams={"topics": {"raw": "raw-x", "scored": "scored-x"}},
        trainer={"topics": {"scored": "scored-y"}},
        weights={"topic": "versions-x"},
    )
    specs = {spec.name: spec for spec in config.topic_specs()}
    assert specs["raw-x"].partitions == 8
    assert specs["scored-x"].partitions == specs["scored-y"].partitions == 4
    assert specs["versions-x"].cleanup_policy == "compact"
    assert "policy.versions" in specs and "rollouts.stale" in specs and "rollouts.raw" not in specs


def test_publish_every_0_or_empty_means_never_so_a_toml_file_can_say_it() -> None:
    from consumers.config import TrainerConfig

    for never in (0, "0", ""):
        assert TrainerConfig.model_validate({"publish": {"every": never}}).publish.every is None
    assert TrainerConfig.model_validate({"publish": {"every": 2}}).publish.every == 2
    with pytest.raises(ValueError, match="every"):
        TrainerConfig.model_validate({"publish": {"every": -1}})


def test_publish_dtype_takes_trainer_or_bfloat16_and_the_language_model_profile_ships_bf16() -> (
    None
):
    from consumers.config import TrainerConfig
    from rollstream.config.profiles import ProfileConfig, profile_sections

    assert TrainerConfig().publish.dtype == "trainer"
    for garbage in ("float16", "bf16", "", 16, None, ["bfloat16"]):
        with pytest.raises(ValueError, match="dtype"):
            TrainerConfig.model_validate({"publish": {"dtype": garbage}})
    for precision in ("fp32", "bf16"):
        sections = profile_sections(ProfileConfig(model="smollm2", precision=precision))
        assert sections["trainer"]["publish"] == {"dtype": "bfloat16"}
    assert "publish" not in profile_sections(ProfileConfig())["trainer"]  # tiny: as trained
