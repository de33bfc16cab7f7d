"""Arrow conversion and Parquet export/import of trajectories."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.paths import DATA

from schemas.parquet import read_parquet, write_parquet
from schemas.trajectory import TRAJECTORY_ARROW_SCHEMA, Trajectory, from_arrow, to_arrow


def turn_policies_for(seed: int, policy: str) -> tuple[str, ...] | None:
    """Per-turn provenance by seed: absent, peers, all environment, empty, or without turns
    (records need not be valid to round-trip)."""
    if seed % 4 == 1:  # the multi-turn records
        return [None, (policy, "bob"), (policy, "")][(seed // 12) % 3]
    if seed % 4 == 2:
        return [None, (), ("solo",)][(seed // 4) % 3]
    return None


def random_record(seed: int, max_tokens: int = 300) -> Trajectory:
    """A record with random lengths; optional fields present or absent by seed."""
    rng = np.random.default_rng(seed)
    n_response = int(rng.integers(0, max_tokens))
    cut = int(rng.integers(0, n_response + 1))
    logp_bits = rng.integers(0, 2**32, n_response, dtype=np.uint32)  # NaN payloads included
    return Trajectory(
        run_id="run-é",
        trajectory_id=f"traj-{seed}",
        group_id=f"group-{seed // 4}",
        group_size=4,
        sample_index=seed % 4,
        producer_id="gen-0",
        region=["region-a", "region-b"][seed % 2],
        task="reverse3",
        prompt_ids=rng.integers(0, 2**31, int(rng.integers(0, max_tokens)), dtype=np.int32),
        response_ids=rng.integers(0, 2**31, n_response, dtype=np.int32),
        logp_infer=logp_bits.view(np.float32),
        segment_versions=np.array([seed, seed + 1], np.int64),
        segment_lengths=np.array([cut, n_response - cut], np.int32),
        reward=float(rng.normal()),
        reward_details={"seed": seed, "nested": {"ok": bool(seed % 2)}, "list": [1.5, None]},
        finish_reason="length",
        created_at_ms=seed,
        finished_at_ms=seed + 10,
        logp_old=-rng.random(n_response, dtype=np.float32) if seed % 3 == 0 else None,
        old_logits_status="exact" if seed % 3 == 0 else "missing",
        advantage=float(seed) / 7 if seed % 2 else None,
        # every fourth record multi-turn (turns need not be valid to round-trip)
        turn_lengths=np.array([cut, n_response - cut], np.int32) if seed % 4 == 1 else None,
        turn_kinds=np.array([0, 1], np.uint8) if seed % 4 == 1 else None,
        tool_calls=seed % 4,
        episode_end="done" if seed % 4 == 1 else "",
        policy="alice" if seed % 3 == 1 else "",
        turn_policies=turn_policies_for(seed, "alice" if seed % 3 == 1 else ""),
    )


def test_parquet_round_trip(tmp_path: Path) -> None:
    records = [random_record(seed) for seed in range(25)]
    path = tmp_path / "rollouts.parquet"
    assert write_parquet(records, path) == 25
    assert list(tmp_path.iterdir()) == [path]  # the partial file was renamed into place
    back = read_parquet(path)
    assert len(back) == 25
    for original, read in zip(records, back, strict=True):
        assert read == original
    assert back[0].logp_old is not None and back[1].logp_old is None
    assert back[1].advantage is not None and back[0].advantage is None


def test_parquet_file_has_typed_columns_and_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.parquet"
    write_parquet([random_record(1)], path)
    schema = pq.read_schema(path)
    assert schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert schema.field("logp_infer").type == pa.list_(pa.float32())
    assert schema.field("segment_versions").type == pa.list_(pa.int64())
    assert schema.field("policy").type == pa.string() and not schema.field("policy").nullable
    assert schema.field("turn_policies").type == pa.list_(pa.string())
    assert schema.field("turn_policies").nullable
    assert schema.metadata[b"rollstream.schema_version"] == b"3"
    assert pq.read_metadata(path).num_rows == 1


def test_empty_export(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    assert write_parquet([], path) == 0
    assert read_parquet(path) == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=12))
def test_arrow_round_trip(seeds: list[int]) -> None:
    records = [random_record(seed, max_tokens=2000) for seed in seeds]
    table = to_arrow(records)
    assert table.schema.equals(TRAJECTORY_ARROW_SCHEMA, check_metadata=True)
    assert table.num_rows == len(records)
    assert from_arrow(table) == records


def test_sliced_and_chunked_tables_read_correctly() -> None:
    records = [random_record(seed) for seed in range(8)]
    table = pa.concat_tables([to_arrow(records[:3]), to_arrow(records[3:])])
    assert table.column("prompt_ids").num_chunks == 2
    assert from_arrow(table) == records
    assert from_arrow(table.slice(2, 4)) == records[2:6]  # a slice across chunks
    single = to_arrow(records).slice(3, 2)  # zero-copy slice: offsets do not start at 0
    assert single.column("prompt_ids").chunk(0).offsets[0].as_py() > 0
    assert from_arrow(single) == records[3:5]


def test_arrays_read_back_are_read_only() -> None:
    (record,) = from_arrow(to_arrow([random_record(3)]))
    assert record.logp_old is not None
    for array in (record.prompt_ids, record.response_ids, record.logp_infer, record.logp_old):
        assert not array.flags.writeable


def test_wrong_dtype_is_refused_on_export() -> None:
    record = random_record(1)
    bad = Trajectory(**{**_fields(record), "response_ids": record.response_ids.astype(np.int64)})
    with pytest.raises(ValueError, match="response_ids"):
        to_arrow([bad])


def test_foreign_tables_are_refused_with_the_reason() -> None:
    table = to_arrow([random_record(1)])
    with pytest.raises(ValueError, match="schema version 7"):
        from_arrow(table.replace_schema_metadata({b"rollstream.schema_version": b"7"}))
    with pytest.raises(ValueError, match="schema version none"):
        from_arrow(table.replace_schema_metadata(None))
    with pytest.raises(ValueError, match="task"):
        from_arrow(table.drop_columns(["task"]))
    retyped = table.set_column(
        table.schema.get_field_index("prompt_ids"),
        pa.field("prompt_ids", pa.list_(pa.int64()), nullable=False),
        table.column("prompt_ids").cast(pa.list_(pa.int64())),
    )
    with pytest.raises(ValueError, match="prompt_ids"):
        from_arrow(retyped)


def _fields(record: Trajectory) -> dict:
    return {name: getattr(record, name) for name in TRAJECTORY_ARROW_SCHEMA.names}


def test_turn_columns_round_trip_nulls_and_arrays() -> None:
    records = [random_record(seed) for seed in range(8)]
    table = to_arrow(records)
    assert table.schema.field("turn_kinds").type == pa.list_(pa.uint8())
    assert table.column("turn_lengths").null_count == 6  # single-turn records stay None
    back = from_arrow(table)
    assert back == records
    assert back[1].turn_kinds is not None and back[1].turn_kinds.tolist() == [0, 1]
    assert back[1].episode_end == "done" and back[1].tool_calls == 1


def test_version_1_parquet_reads_as_single_turn_records() -> None:
    """A file exported before multi-turn episodes (committed fixture) still reads."""
    (record,) = read_parquet(DATA / "trajectory_v1.parquet")
    assert record.trajectory_id == "traj-v1"
    assert record.response_ids.tolist() == [8, 9, 10, 11]
    assert record.turn_lengths is None and record.turn_kinds is None
    assert record.tool_calls == 0 and record.episode_end == ""
    assert record.loss_mask.tolist() == [True] * 4 and record.num_turns == 1
    assert record.policy == "" and record.turn_policies is None
    # and it is written back as version 3
    table = to_arrow([record])
    assert table.schema.metadata[b"rollstream.schema_version"] == b"3"
    assert from_arrow(table) == [record]


def test_version_1_table_with_a_version_2_column_is_refused() -> None:
    table = pq.read_table(DATA / "trajectory_v1.parquet")
    table = table.append_column("tool_calls", pa.array([0], pa.int32()))
    with pytest.raises(ValueError, match="schema version 1: unexpected columns"):
        from_arrow(table)


def test_policy_columns_round_trip_exactly() -> None:
    records = [random_record(seed) for seed in range(36)]
    owners = {record.turn_policies for record in records}
    assert owners >= {None, (), ("alice", "bob"), ("", ""), ("alice", ""), ("solo",)}
    table = to_arrow(records)
    assert table.column("turn_policies").null_count == sum(r.turn_policies is None for r in records)
    assert table.column("policy").to_pylist() == [r.policy for r in records]
    back = from_arrow(table)
    assert back == records
    for original, read in zip(records, back, strict=True):
        assert read.policy == original.policy
        assert read.turn_policies == original.turn_policies
        assert (read.turn_policies is None) == (original.turn_policies is None)  # () stays ()
        assert read.turn_policies is None or type(read.turn_policies) is tuple


def test_policy_columns_survive_parquet(tmp_path: Path) -> None:
    records = [random_record(seed) for seed in (1, 6, 10, 13, 17, 25, 29)]
    path = tmp_path / "policies.parquet"
    write_parquet(records, path)
    back = read_parquet(path)
    assert back == records
    assert [r.turn_policies for r in back] == [
        None,
        (),
        ("solo",),
        ("alice", "bob"),
        ("", "bob"),
        ("alice", ""),
        ("", ""),
    ]
    assert [r.policy for r in back] == ["alice", "", "alice", "alice", "", "alice", ""]


def test_version_2_parquet_reads_with_the_unnamed_policy() -> None:
    """A file exported before multi-policy runs (committed fixture, multi-turn)."""
    (record,) = read_parquet(DATA / "trajectory_v2.parquet")
    assert record.trajectory_id == "traj-v2"
    assert record.turn_lengths.tolist() == [2, 2, 2] and record.turn_kinds.tolist() == [0, 1, 0]
    assert record.tool_calls == 1 and record.episode_end == "done"
    assert record.policy == "" and record.turn_policies is None
    assert from_arrow(to_arrow([record])) == [record]


def test_version_2_table_with_a_version_3_column_is_refused() -> None:
    table = pq.read_table(DATA / "trajectory_v2.parquet")
    table = table.append_column("policy", pa.array(["alice"], pa.string()))
    with pytest.raises(ValueError, match="schema version 2: unexpected columns"):
        from_arrow(table)


@pytest.mark.parametrize(
    ("turn_policies", "match"),
    [(["alice", "bob"], "tuple"), (("alice", 2), r"turn_policies\[1\]"), ("alice", "tuple")],
)
def test_turn_policies_that_would_not_read_back_are_refused_on_export(
    turn_policies: object, match: str
) -> None:
    bad = Trajectory(**{**_fields(random_record(1)), "turn_policies": turn_policies})
    with pytest.raises(ValueError, match=match):
        to_arrow([bad])
