"""``rollstream replay`` and ``rollstream inspect`` against the real broker.

Known records are produced with the codec (trajectories, scored groups, dead letters,
stale records) at chosen partitions and timestamps; the CLI reads them back by offset
and by time range, with filters, and the tests check exactly which records come back,
what the Parquet export holds, what is printed, that no consumer group gained offsets,
and that ``--rerun train`` gives the loss the loss function gives.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from support.replay import EVIL, T0, assert_literal, scored_group
from support.streams import synthetic

from core.config import KafkaConfig, S3Config, to_toml
from infra.topics import ensure_topics
from rollstream.cli.main import main
from rollstream.debug.parquet import trajectories_from_export
from schemas.codec import encode, routing_headers
from schemas.control import DeadLetter, StaleRecord, VersionAnnouncement
from schemas.group import encode_group
from schemas.topics import TopicSpec
from schemas.trajectory import Trajectory

# --- helpers ------------------------------------------------------------------------------


@pytest.fixture()
def client(kafka_config: KafkaConfig) -> dict[str, str]:
    return kafka_config.client_config()


@pytest.fixture()
def topics(client: dict[str, str], unique_name: Callable[[str], str]) -> dict[str, str]:
    names = {short: unique_name(f"replay.{short}") for short in ("raw", "scored", "stale", "dlq")}
    names["versions"] = unique_name("replay.versions")
    # Records carry fixed timestamps from 2025, older than the default 7-day retention:
    # keep them forever, or the broker's periodic retention check (every 5 minutes)
    # deletes them under a test that happens to span it.
    specs = [TopicSpec(names["raw"], 2, retention_ms=-1)] + [
        TopicSpec(names[s], 1, retention_ms=-1) for s in ("scored", "stale", "dlq")
    ]
    specs.append(TopicSpec(names["versions"], 1, cleanup_policy="compact"))
    ensure_topics(client, specs)
    return names


def write_config(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    topics: dict[str, str],
    loss: str = 'type = "decoupled"',
    **extra: object,
) -> Path:
    """A config file for the CLI: the test's broker and topics, a float32 tiny trainer."""
    values: dict[str, object] = {
        "run_id": "run",
        "state_dir": str(tmp_path / "state"),
        "kafka": {"bootstrap_servers": kafka_config.bootstrap_servers},
        "streams": {"topics": dict(topics)},
        "trainer": {"engine": {"bf16": False}},
    }
    values.update(extra)
    path = tmp_path / "rollstream.toml"
    path.write_text(to_toml(values) + f"[trainer.loss]\n{loss}\n")
    return path


def run_cli(config: Path, *args: str) -> Result:
    result = CliRunner().invoke(main, ["--config", str(config), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


Record = tuple[int, bytes | None, bytes, list[tuple[str, bytes]], int]  # partition, key, ...


def produce(client: dict[str, str], topic: str, records: Sequence[Record]) -> None:
    """Produce ``(partition, key, value, headers, timestamp_ms)`` and wait for the acks."""
    producer = Producer({**client, "linger.ms": 0})
    errors: list[object] = []
    for partition, key, value, headers, ts in records:
        producer.produce(
            topic,
            value=value,
            key=key,
            headers=headers,
            partition=partition,
            timestamp=ts,
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
        producer.flush(30)  # in order, one by one: offsets are then known
    assert not errors, errors


def raw_record(traj: Trajectory, partition: int, ts: int) -> Record:
    return partition, traj.group_id.encode(), encode(traj), routing_headers(traj), ts


def exported(path: Path) -> list[tuple[int, int]]:
    table = pq.read_table(path, columns=["kafka_partition", "kafka_offset"])
    return list(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))


@pytest.fixture()
def raw_records(client: dict[str, str], topics: dict[str, str]) -> list[Trajectory]:
    """Six trajectories on two partitions, one second apart:

    partition 0, offsets 0-2: group g1 (run "run"), versions 1, 2, 3, rewards 0.1, 0.5, 0.9
    partition 1, offsets 0-2: group g2, versions 2, 2, 4, rewards 0.2, 0.6, 1.0; offset 1
    belongs to run "other"."""
    trajs = [
        synthetic(group_id="g1", group_size=3, sample_index=i, versions=(v,), reward=r)
        for i, (v, r) in enumerate([(1, 0.1), (2, 0.5), (3, 0.9)])
    ]
    trajs += [
        synthetic(
            run_id="other" if i == 1 else "run",
            group_id="g2",
            group_size=3,
            sample_index=i,
            versions=(v,),
            reward=r,
        )
        for i, (v, r) in enumerate([(2, 0.2), (2, 0.6), (4, 1.0)])
    ]
    records = [raw_record(t, i // 3, T0 + 1000 * (i % 3)) for i, t in enumerate(trajs)]
    produce(client, topics["raw"], records)
    return trajs


# --- reading by offset and time ---------------------------------------------------------------


def test_replay_by_offset_with_filters(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    topics: dict[str, str],
    raw_records: list[Trajectory],
) -> None:
    config = write_config(tmp_path, kafka_config, topics)
    out = tmp_path / "out.parquet"

    def selected(*args: str) -> list[tuple[int, int]]:
        result = run_cli(config, "replay", "raw", "-q", "--parquet", str(out), *args)
        rows = exported(out)
        assert f"{len(rows)} record(s) selected" in result.output
        return sorted(rows)

    everything = [(p, o) for p in (0, 1) for o in range(3)]
    assert selected() == everything
    assert selected("--offset", "0:1") == [(0, 1), (0, 2)]
    assert selected("--offset", "1:2", "--offset", "0:0") == [(0, 0), (0, 1), (0, 2), (1, 2)]
    assert selected("--from-offset", "1") == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert selected("--from-offset", "0", "--to-offset", "0") == [(0, 0), (1, 0)]
    assert selected("--last", "1") == [(0, 2), (1, 2)]
    assert selected("--partition", "1") == [(1, 0), (1, 1), (1, 2)]
    # filters
    assert selected("--run", "other") == [(1, 1)]
    assert selected("--group", "g2", "--run", "run") == [(1, 0), (1, 2)]
    assert selected("--version", "2") == [(0, 1), (1, 0), (1, 1)]
    assert selected("--min-version", "3") == [(0, 2), (1, 2)]
    assert selected("--min-reward", "0.5", "--max-reward", "0.95") == [(0, 1), (0, 2), (1, 1)]
    assert selected("--trajectory", "g1-0") == [(0, 0)]
    # raw records carry no staleness: a staleness filter selects none of them
    assert selected("--max-staleness", "100") == []
    # --limit counts selected records
    assert len(selected("--group", "g1", "--limit", "2")) == 2


def test_replay_by_time_range(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    topics: dict[str, str],
    raw_records: list[Trajectory],
) -> None:
    config = write_config(tmp_path, kafka_config, topics)
    out = tmp_path / "out.parquet"
    iso = datetime.fromtimestamp((T0 + 1000) / 1000, UTC).isoformat()
    run_cli(
        config, "replay", "raw", "-q", "--parquet", str(out),
        "--from-time", iso, "--to-time", str(T0 + 2000),
    )  # fmt: skip
    assert sorted(exported(out)) == [(0, 1), (1, 1)]
    table = pq.read_table(out)
    assert table.column("kafka_timestamp_ms").to_pylist() == [T0 + 1000, T0 + 1000]
    run_cli(config, "replay", "raw", "-q", "--parquet", str(out), "--from-time", str(T0 + 2000))
    assert sorted(exported(out)) == [(0, 2), (1, 2)]
    run_cli(
        config, "replay", "raw", "-q", "--parquet", str(out),
        "--to-time", str(T0 + 1000), "--run", "run", "--partition", "1",
    )  # fmt: skip
    assert sorted(exported(out)) == [(1, 0)]


# --- Parquet -------------------------------------------------------------------------------------


def test_parquet_has_one_row_per_record_with_its_values(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    client: dict[str, str],
    topics: dict[str, str],
    raw_records: list[Trajectory],
) -> None:
    produce(client, topics["raw"], [(0, b"g9", b"not a record", [], T0 + 5000)])
    config = write_config(tmp_path, kafka_config, topics)
    out = tmp_path / "raw.parquet"
    run_cli(config, "replay", "raw", "-q", "--parquet", str(out), "--partition", "0")
    table = pq.read_table(out)
    assert table.num_rows == 4
    assert table.schema.metadata[b"rollstream.replay_layout"] == b"trajectory"
    assert table.column("kafka_offset").to_pylist() == [0, 1, 2, 3]
    assert table.column("record_kind").to_pylist() == ["trajectory"] * 3 + ["undecodable"]
    assert table.column("trajectory_id").to_pylist() == ["g1-0", "g1-1", "g1-2", None]
    assert table.column("value").to_pylist() == [None, None, None, b"not a record"]
    assert "bad_magic" in table.column("decode_error").to_pylist()[3]
    headers = dict(table.column("kafka_headers").to_pylist()[0])
    assert headers["rs-group-id"] == b"g1" and headers["rs-min-version"] == b"1"
    # the trajectory columns round-trip bit for bit through schemas.trajectory.from_arrow
    assert trajectories_from_export(out) == raw_records[:3]

    groups = [scored_group("ga", [3, 4, 4], [2, 1, 1]), scored_group("gb", [5, 5], [0, 0])]
    produce(
        client,
        topics["scored"],
        [(0, g.group_id.encode(), encode_group(g), [], T0 + i) for i, g in enumerate(groups)],
    )
    out = tmp_path / "scored.parquet"
    run_cli(config, "replay", "scored", "-q", "--parquet", str(out))
    table = pq.read_table(out)
    assert table.num_rows == 2  # one row per Kafka record, not per sample
    assert table.schema.metadata[b"rollstream.replay_layout"] == b"scored_group"
    assert table.column("group_id").to_pylist() == ["ga", "gb"]
    assert table.column("trainer_version_seen").to_pylist() == [9, 9]
    rows = table.column("samples").to_pylist()
    for group, samples in zip(groups, rows, strict=True):
        assert [s["trajectory_id"] for s in samples] == [t.trajectory_id for t in group.samples]
        assert [s["advantage"] for s in samples] == [t.advantage for t in group.samples]
        assert [s["staleness"] for s in samples] == [d.staleness for d in group.diagnostics]
        assert [s["k3_kl"] for s in samples] == [d.k3_kl for d in group.diagnostics]
        for s, t in zip(samples, group.samples, strict=True):
            assert np.array_equal(np.asarray(s["logp_old"], np.float32), t.logp_old)
    # staleness filters apply to the scored samples' recorded staleness
    run_cli(config, "replay", "scored", "-q", "--parquet", str(out), "--min-staleness", "2")
    assert pq.read_table(out).column("group_id").to_pylist() == ["ga"]


# --- printing ----------------------------------------------------------------------------------


def test_dead_letters_and_stale_records_print_why(
    tmp_path: Path, kafka_config: KafkaConfig, client: dict[str, str], topics: dict[str, str]
) -> None:
    bad = synthetic(group_id="gd", sample_index=0)
    letter = DeadLetter("nonfinite_logprob", "logp_infer[3] is nan", topics["raw"], 1, 42)
    other = DeadLetter("key_mismatch", "key b'x' is not the group id 'gd'", topics["raw"], 0, 7)
    produce(
        client,
        topics["dlq"],
        [
            (0, b"gd", encode(bad), [*routing_headers(bad), letter.header()], T0),
            (0, b"gd", b"\x00garbage", [other.header()], T0 + 1),
        ],
    )
    config = write_config(tmp_path, kafka_config, topics)
    result = run_cli(config, "replay", "dlq", "--tokenizer", "tiny")
    assert "dead letter: reason nonfinite_logprob — logp_infer[3] is nan" in result.output
    assert f"(from {topics['raw']}[1]@42)" in result.output
    assert "dead letter: reason key_mismatch" in result.output
    assert "undecodable" in result.output and "2 record(s) selected" in result.output
    # the token table: one row per response token, with logp_infer
    assert f"{bad.logp_infer[0]:.5f}" in result.output
    only = run_cli(config, "replay", "dlq", "--reason", "key_mismatch", "--no-tokens")
    assert "key_mismatch" in only.output and "nonfinite_logprob" not in only.output
    assert "1 record(s) selected" in only.output

    stale = synthetic(group_id="gs", versions=(1,))
    verdict = StaleRecord(stale.trajectory_id, 9, 10, 4)
    produce(
        client,
        topics["stale"],
        [(0, b"gs", encode(stale), [*routing_headers(stale), verdict.header()], T0)],
    )
    result = run_cli(config, "replay", "stale", "--no-tokens", "--min-staleness", "5")
    assert "stale: staleness 9 > limit 4 at trainer version 10" in result.output
    assert "1 record(s) selected" in result.output


def test_replay_prints_a_crafted_dead_letter_reason_literally(
    tmp_path: Path, kafka_config, client: dict[str, str], topics: dict[str, str]
) -> None:
    """Record fields are text, never markup or terminal escapes (more in
    unit/rollstream/test_replay_injection.py)."""

    bad = synthetic(group_id="gd", sample_index=0)
    records = [
        (
            0,
            b"gd",
            encode(bad),
            [*routing_headers(bad), DeadLetter(evil, evil, "raw", 0, i).header()],
            T0 + i,
        )
        for i, evil in enumerate(EVIL)
    ]
    stale = StaleRecord("[/]", 3, 4, 1)
    records.append((0, b"gd", encode(bad), [stale.header()], T0 + 9))
    produce(client, topics["dlq"], records)
    result = run_cli(write_config(tmp_path, kafka_config, topics), "replay", "dlq", "--no-tokens")
    assert f"{len(records)} record(s) selected" in result.output
    for evil in EVIL:
        assert_literal(result.output, evil)


def test_scored_groups_print_advantages_and_discrepancy(
    tmp_path: Path, kafka_config: KafkaConfig, client: dict[str, str], topics: dict[str, str]
) -> None:
    group = scored_group("gp", [3, 3], [1, 1])
    produce(client, topics["scored"], [(0, b"gp", encode_group(group), [], T0)])
    config = write_config(tmp_path, kafka_config, topics)
    result = run_cli(config, "replay", "scored", "--tokenizer", "tiny")
    out = result.output
    assert "scored group gp" in out and "complete 2/2" in out
    for traj in group.samples:
        assert f"{traj.advantage:+.4f}" in out
        x = float(traj.logp_old[0]) - float(traj.logp_infer[0])
        assert f"{x:+.5f}" in out and f"{math.exp(x):.5f}" in out


# --- offsets are never committed ------------------------------------------------------------------


def test_replay_commits_no_offsets(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    client: dict[str, str],
    topics: dict[str, str],
    raw_records: list[Trajectory],
) -> None:
    # a role's consumer group with committed offsets on the topic
    role_group = f"role-{uuid.uuid4().hex[:8]}"
    consumer = Consumer({**client, "group.id": role_group, "enable.auto.commit": False})
    committed = [TopicPartition(topics["raw"], 0, 1), TopicPartition(topics["raw"], 1, 2)]
    consumer.commit(offsets=committed, asynchronous=False)
    consumer.close()

    config = write_config(tmp_path, kafka_config, topics)
    run_cli(config, "replay", "raw", "-q")
    run_cli(config, "replay", "raw", "-q", "--from-time", str(T0 + 1000))

    admin = AdminClient(client)
    groups = admin.list_consumer_groups(request_timeout=30).result().valid
    ids = [g.group_id for g in groups]
    assert role_group in ids
    assert not [g for g in ids if g.startswith("rollstream-replay")]
    consumer = Consumer({**client, "group.id": role_group, "enable.auto.commit": False})
    try:
        found = consumer.committed(
            [TopicPartition(topics["raw"], 0), TopicPartition(topics["raw"], 1)], timeout=30
        )
    finally:
        consumer.close()
    assert [(tp.partition, tp.offset) for tp in found] == [(0, 1), (1, 2)]


def test_replay_of_a_missing_topic_or_partition_is_a_clear_error(
    tmp_path: Path, kafka_config: KafkaConfig, topics: dict[str, str]
) -> None:
    missing = {**topics, "raw": f"{topics['raw']}-missing"}
    config = write_config(tmp_path, kafka_config, missing)
    result = CliRunner().invoke(main, ["--config", str(config), "replay", "raw", "-q"])
    assert result.exit_code != 0
    assert f"topic {missing['raw']!r} cannot be read" in result.output
    assert "Traceback" not in result.output

    config = write_config(tmp_path, kafka_config, topics)
    args = ["--config", str(config), "replay", "raw", "-q", "--partition", "7"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert f"{topics['raw']} has partitions [0, 1], not [7]" in result.output


def test_last_counts_records_not_transaction_markers(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    topics: dict[str, str],
    raw_records: list[Trajectory],
) -> None:
    """On a topic written in transactions every commit marker takes an offset: ``--last N``
    still selects the last N records of each partition."""
    import uuid

    client = kafka_config.client_config()
    producer = Producer({**client, "transactional.id": f"t-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    for i in range(6):  # 6 records, 6 markers: offsets 0, 2, 4, ... hold the records
        producer.begin_transaction()
        traj = raw_records[i % len(raw_records)]
        producer.produce(topics["scored"], value=encode(traj), key=traj.group_id.encode())
        producer.commit_transaction(30)
    config = write_config(tmp_path, kafka_config, topics)
    out = tmp_path / "last.parquet"
    for n, offsets in ((1, [10]), (5, [2, 4, 6, 8, 10]), (9, [0, 2, 4, 6, 8, 10])):
        result = run_cli(config, "replay", "scored", "-q", "--parquet", str(out), "--last", str(n))
        assert f"{len(offsets)} record(s) selected" in result.output
        assert sorted(o for _p, o in exported(out)) == offsets


# --- re-running ---------------------------------------------------------------------------------


def _metric(output: str, name: str) -> float:
    match = re.search(rf"{re.escape(name)}\s+│?\s*(-?[0-9.e+-]+|nan)", output)
    assert match, f"{name} not in output:\n{output}"
    return float(match.group(1))


def test_rerun_train_gives_the_loss_of_the_loss_function(
    tmp_path: Path, kafka_config: KafkaConfig, client: dict[str, str], topics: dict[str, str]
) -> None:
    import torch

    from consumers.batching import pack, response_logprobs
    from consumers.loss_config import DecoupledLossConfig
    from consumers.losses import LossInputs, decoupled_loss
    from core.models import build_tiny_llama

    group = scored_group("gt", [2, 2, 3, 3], [1, 1, 0, 0])
    produce(client, topics["scored"], [(0, b"gt", encode_group(group), [], T0)])
    loss = 'type = "decoupled"\ncorrection = "mis"\ntoken_bounds = [0.8, 1.25]'
    config = write_config(tmp_path, kafka_config, topics, loss=loss)
    result = run_cli(config, "replay", "scored", "-q", "--rerun", "train")

    model = build_tiny_llama(seed=0)
    batch = pack(list(group.samples))
    with torch.no_grad():
        logp_new = response_logprobs(model, batch, pad_id=0)
    direct = decoupled_loss(
        LossInputs(
            logp_new=logp_new,
            logp_old=batch.logp_old,
            logp_infer=batch.logp_infer,
            advantages=batch.advantages,
            mask=batch.response_mask,
        ),
        DecoupledLossConfig(correction="mis", token_bounds=(0.8, 1.25)),
    )
    assert 0 < direct.metrics["mis/masked_frac"] < 1  # the bounds matter for this group
    for name in ("loss/total", "loss/policy", "mis/masked_frac", "clip/frac", "ratio/mean"):
        assert _metric(result.output, name) == pytest.approx(direct.metrics[name], rel=1e-6)


def test_rerun_train_loads_a_stored_version(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    s3_config: S3Config,
    client: dict[str, str],
    topics: dict[str, str],
) -> None:
    import torch

    from consumers.batching import pack, response_logprobs
    from consumers.loss_config import DecoupledLossConfig
    from consumers.losses import LossInputs, decoupled_loss
    from core.models import build_tiny_llama
    from weights.store import WeightStore
    from weights.writer import DeltaWriter

    writer = DeltaWriter(WeightStore.from_config(s3_config, "run"))
    for version, seed in ((0, 0), (1, 3)):
        writer.publish(build_tiny_llama(seed=seed).state_dict(), version)
    group = scored_group("gw", [1, 1, 1], [0, 0, 0])
    produce(client, topics["scored"], [(0, b"gw", encode_group(group), [], T0)])
    secret = s3_config.secret_access_key
    s3 = {
        "endpoint_url": s3_config.endpoint_url,
        "bucket": s3_config.bucket,
        "embedded": False,
        "access_key_id": s3_config.access_key_id,
        "secret_access_key": secret.get_secret_value() if secret else None,
    }
    # the test's writer does not sign
    config = write_config(tmp_path, kafka_config, topics, s3=s3, weights={"allow_unsigned": True})
    result = run_cli(config, "replay", "scored", "-q", "--rerun", "train", "--weights-version", "1")
    assert "version 1 of run run (float32)" in result.output

    batch = pack(list(group.samples))
    expected = {}
    for seed in (0, 3):
        with torch.no_grad():
            logp_new = response_logprobs(build_tiny_llama(seed=seed), batch, pad_id=0)
        inputs = LossInputs(
            logp_new=logp_new,
            logp_old=batch.logp_old,
            logp_infer=batch.logp_infer,
            advantages=batch.advantages,
            mask=batch.response_mask,
        )
        expected[seed] = decoupled_loss(inputs, DecoupledLossConfig()).metrics["loss/total"]
    assert expected[0] != pytest.approx(expected[3], rel=1e-3)  # the weights matter
    assert _metric(result.output, "loss/total") == pytest.approx(expected[3], rel=1e-6)


def test_rerun_stream_reproduces_the_stream_decisions(
    tmp_path: Path, kafka_config: KafkaConfig, client: dict[str, str], topics: dict[str, str]
) -> None:
    fresh = [
        synthetic(group_id="gf", group_size=2, sample_index=i, versions=(8,), reward=float(i))
        for i in range(2)
    ]
    old = synthetic(group_id="go", group_size=2, sample_index=0, versions=(0,))
    broken = synthetic(group_id="gx", group_size=2, sample_index=0, versions=(9,))
    values = broken.logp_infer.copy()
    values[1] = np.nan
    broken = Trajectory.create(**{**_fields(broken), "logp_infer": values})
    flat = [  # equal rewards: the zero_variance operator filters the group
        synthetic(group_id="gz", group_size=2, sample_index=i, versions=(8,), reward=1.0)
        for i in range(2)
    ]
    produce(
        client,
        topics["raw"],
        [raw_record(t, 0, T0 + i) for i, t in enumerate([fresh[0], old, broken, fresh[1], *flat])],
    )
    config = write_config(
        tmp_path,
        kafka_config,
        topics,
        streams={
            "topics": dict(topics),
            "staleness": {"max_staleness": 4},
            "old_logits": {"source": "seeded", "model": "tiny"},
            "operators": [{"name": "zero_variance"}],
        },
    )
    # the trainer version comes from the newest announcement of the run
    announcements = [
        VersionAnnouncement("run", v, f"s3://b/weights/run/v{v}/", None, v, "a" * 64, 10, T0)
        for v in (9, 10)
    ]
    other = VersionAnnouncement("other", 30, "s3://b/x/", None, 30, "b" * 64, 10, T0)
    produce(
        client,
        topics["versions"],
        [(0, a.run.encode(), a.to_json(), [], T0) for a in [*announcements, other]],
    )
    result = run_cli(config, "replay", "raw", "-q", "--no-tokens", "--rerun", "stream")
    out = result.output
    assert "trainer version 10" in out
    assert f"{topics['raw']}[0]@0 → joins group gf (1/2 samples" in out
    assert f"@1 → stale {topics['stale']}: staleness 10 > 4 at trainer version 10" in out
    assert f"@2 → DLQ {topics['dlq']}: nonfinite_logprob" in out
    assert f"@3 → scored {topics['scored']}: group gf" in out
    assert "scored group gf" in out and "complete 2/2" in out and "exact" in out
    assert "operators on group gf: zero_variance → kept" in out
    assert "operators on group gz: zero_variance → zero_variance" in out
    assert "@5 → filtered rollouts.filtered: group gz by operator zero_variance" in out

    export = tmp_path / "versions.parquet"
    run_cli(config, "replay", "versions", "-q", "--run", "run", "--parquet", str(export))
    table = pq.read_table(export)
    assert table.schema.metadata[b"rollstream.replay_layout"] == b"announcement"
    assert table.column("version").to_pylist() == [9, 10]
    assert table.column("kafka_offset").to_pylist() == [0, 1]


def _fields(traj: Trajectory) -> dict[str, object]:
    import dataclasses

    return {f.name: getattr(traj, f.name) for f in dataclasses.fields(traj)}


# --- inspect ---------------------------------------------------------------------------------


def test_inspect_shows_a_group_end_to_end(
    tmp_path: Path, kafka_config: KafkaConfig, client: dict[str, str], topics: dict[str, str]
) -> None:
    group = scored_group("gi", [4, 4, 5], [1, 1, 0])
    raw = [  # as the producer sent them: no logp_old, no advantage
        Trajectory.create(
            **{**_fields(t), "logp_old": None, "old_logits_status": "missing", "advantage": None}
        )
        for t in group.samples
    ]
    stale = synthetic(group_id="gi", group_size=3, sample_index=3, versions=(0,))
    produce(client, topics["raw"], [raw_record(t, 1, T0 + i) for i, t in enumerate(raw)])
    produce(client, topics["raw"], [raw_record(synthetic(group_id="other"), 1, T0 + 9)])
    verdict = StaleRecord(stale.trajectory_id, 5, 5, 4)
    produce(
        client,
        topics["stale"],
        [(0, b"gi", encode(stale), [*routing_headers(stale), verdict.header()], T0)],
    )
    produce(client, topics["scored"], [(0, b"gi", encode_group(group), [], T0 + 5)])
    config = write_config(tmp_path, kafka_config, topics)
    result = run_cli(config, "inspect", "gi", "--no-tokens")
    out = result.output
    assert f"raw trajectories on {topics['raw']}: 3 record(s)" in out
    assert f"filtered as stale on {topics['stale']}: 1 record(s)" in out
    assert f"dead-lettered on {topics['dlq']}: 0 record(s)" in out
    assert f"scored group on {topics['scored']}: 1 record(s)" in out
    assert "group other" not in out
    assert "segments [v4×6]" in out and "stale: staleness 5 > limit 4" in out
    assert "rerun train: loss decoupled" in out and "loss/total" in out

    missing = CliRunner().invoke(main, ["--config", str(config), "inspect", "nope"])
    assert missing.exit_code != 0 and "group 'nope' was not found" in missing.output
