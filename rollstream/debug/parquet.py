"""Parquet export of replayed records (``rollstream replay --parquet``): one row per record.

Why one row per Kafka record (a scored group is one row, its samples a list column): the
export is a faithful copy of what the topic held, offset for offset, so counts, offsets and
dead letters line up with the broker's. Every row has the Kafka coordinates
(``kafka_topic``, ``kafka_partition``, ``kafka_offset``, ``kafka_timestamp_ms``,
``kafka_key``, ``kafka_headers``), ``record_kind``, ``decode_error``, a ``dead_letter`` and
a ``stale`` struct (null unless the header is there) and ``value``: the original bytes, kept
only where the payload columns are null (undecodable records), so a dead letter is never
lost. The payload columns depend on what the export holds (file metadata
``rollstream.replay_layout``): ``trajectory`` — the columns of
``schemas.trajectory.TRAJECTORY_ARROW_SCHEMA``, as ``schemas.parquet`` writes them;
``scored_group`` — the group's scalar fields plus ``samples``, a list of structs (the
trajectory columns and the per-sample diagnostics); ``announcement`` — the fields of
``VersionAnnouncement``. A record of another kind than the layout keeps only its bytes.
``trajectories_from_export`` reads a trajectory export back as ``Trajectory`` records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollstream.debug.records import ReplayRecord

if TYPE_CHECKING:
    import pyarrow as pa

    from schemas.trajectory import Trajectory

Layout = Literal["trajectory", "scored_group", "announcement"]


def export_layout(records: Sequence[ReplayRecord]) -> Layout:
    """Scored groups if any record is one, announcements if every decoded record is one,
    trajectories otherwise."""
    kinds = {r.kind for r in records} - {"undecodable"}
    if "scored_group" in kinds:
        return "scored_group"
    if kinds == {"announcement"}:
        return "announcement"
    return "trajectory"


def _kafka_columns(records: Sequence[ReplayRecord], payload_present: list[bool]) -> dict:
    import pyarrow as pa

    dead_type = pa.struct(
        [
            ("reason", pa.string()),
            ("detail", pa.string()),
            ("source_topic", pa.string()),
            ("source_partition", pa.int32()),
            ("source_offset", pa.int64()),
        ]
    )
    stale_type = pa.struct(
        [
            ("trajectory_id", pa.string()),
            ("staleness", pa.int64()),
            ("trainer_version", pa.int64()),
            ("max_staleness", pa.int64()),
        ]
    )
    dead = [
        None
        if (d := r.dead_letter) is None
        else {
            "reason": d.reason,
            "detail": d.detail,
            "source_topic": d.source_topic,
            "source_partition": d.partition,
            "source_offset": d.offset,
        }
        for r in records
    ]
    stale = [None if r.stale is None else dataclasses.asdict(r.stale) for r in records]
    return {
        "kafka_topic": pa.array([r.topic for r in records], pa.string()),
        "kafka_partition": pa.array([r.partition for r in records], pa.int32()),
        "kafka_offset": pa.array([r.offset for r in records], pa.int64()),
        "kafka_timestamp_ms": pa.array([r.timestamp_ms for r in records], pa.int64()),
        "kafka_key": pa.array([r.key for r in records], pa.binary()),
        "kafka_headers": pa.array(
            [list(r.headers) for r in records], pa.map_(pa.string(), pa.binary())
        ),
        "record_kind": pa.array([r.kind for r in records], pa.string()),
        "decode_error": pa.array([r.error for r in records], pa.string()),
        "dead_letter": pa.array(dead, dead_type),
        "stale": pa.array(stale, stale_type),
        "value": pa.array(
            [
                None if present else r.value
                for r, present in zip(records, payload_present, strict=True)
            ],
            pa.binary(),
        ),
    }


def _nullable(table: pa.Table) -> pa.Table:
    import pyarrow as pa

    schema = pa.schema([f.with_nullable(True) for f in table.schema])
    return pa.Table.from_arrays(table.columns, schema=schema)


def _trajectory_payload(records: Sequence[ReplayRecord]) -> tuple[pa.Table, list[bool]]:
    import pyarrow as pa

    from schemas.trajectory import to_arrow

    present = [r.trajectory is not None for r in records]
    table = to_arrow([r.trajectory for r in records if r.trajectory is not None])
    indices, row = [], 0
    for has in present:
        indices.append(row if has else None)
        row += int(has)
    return _nullable(table).take(pa.array(indices, pa.int64())), present


def _group_payload(records: Sequence[ReplayRecord]) -> tuple[pa.Table, list[bool]]:
    import numpy as np
    import pyarrow as pa

    from schemas.trajectory import to_arrow

    groups = [r.group for r in records]
    present = [g is not None for g in groups]
    samples = [t for g in groups if g is not None for t in g.samples]
    diags = [d for g in groups if g is not None for d in g.diagnostics]
    table = to_arrow(samples)
    extra = {
        "staleness": pa.array([d.staleness for d in diags], pa.int64()),
        "k3_kl": pa.array([d.k3_kl for d in diags], pa.float64()),
        "d_mean": pa.array([d.d_mean for d in diags], pa.float64()),
        "d_min": pa.array([d.d_min for d in diags], pa.float64()),
        "d_max": pa.array([d.d_max for d in diags], pa.float64()),
    }
    struct = pa.StructArray.from_arrays(
        [*(c.combine_chunks() for c in table.columns), *extra.values()],
        fields=[
            *(f.with_nullable(True) for f in table.schema),
            *(pa.field(name, column.type) for name, column in extra.items()),
        ],
    )
    counts = [len(g.samples) if g is not None else 0 for g in groups]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    mask = pa.array([not p for p in present])
    lists = pa.ListArray.from_arrays(pa.array(offsets), struct, mask=mask)

    def scalar(name: str, type_: pa.DataType) -> pa.Array:
        return pa.array([getattr(g, name) if g is not None else None for g in groups], type_)

    columns = {
        "run_id": scalar("run_id", pa.string()),
        "group_id": scalar("group_id", pa.string()),
        "group_size": scalar("group_size", pa.int32()),
        "trainer_version_seen": scalar("trainer_version_seen", pa.int64()),
        "reward_mean": scalar("reward_mean", pa.float64()),
        "reward_std": scalar("reward_std", pa.float64()),
        "complete": scalar("complete", pa.bool_()),
        "emitted_at_ms": scalar("emitted_at_ms", pa.int64()),
        "samples": lists,
    }
    return pa.table(columns), present


def _announcement_payload(records: Sequence[ReplayRecord]) -> tuple[pa.Table, list[bool]]:
    import pyarrow as pa

    types = {
        "run": pa.string(),
        "version": pa.int64(),
        "uri": pa.string(),
        "parent": pa.int64(),
        "base": pa.int64(),
        "sha256": pa.string(),
        "bytes": pa.int64(),
        "published_at_ms": pa.int64(),
    }
    anns = [r.announcement for r in records]
    columns = {
        name: pa.array([getattr(a, name) if a is not None else None for a in anns], type_)
        for name, type_ in types.items()
    }
    return pa.table(columns), [a is not None for a in anns]


def export_table(records: Sequence[ReplayRecord]) -> pa.Table:
    """One row per record (see the module doc for the columns)."""
    import pyarrow as pa

    from schemas.trajectory import TRAJECTORY_ARROW_SCHEMA

    layout = export_layout(records)
    build = {
        "trajectory": _trajectory_payload,
        "scored_group": _group_payload,
        "announcement": _announcement_payload,
    }[layout]
    payload, present = build(records)
    kafka = _kafka_columns(records, present)
    names = [*kafka, *payload.column_names]
    arrays = [*kafka.values(), *payload.columns]
    metadata = dict(TRAJECTORY_ARROW_SCHEMA.metadata or {})
    metadata[b"rollstream.record_kind"] = b"replay"
    metadata[b"rollstream.replay_layout"] = layout.encode()
    return pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(metadata)


def write_export(records: Sequence[ReplayRecord], path: Path) -> int:
    """Write ``records`` to ``path`` (written aside, then renamed); returns the row count."""
    import pyarrow.parquet as pq

    table = export_table(records)
    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial, compression="zstd")
    partial.replace(path)
    return table.num_rows


def trajectories_from_export(path: Path) -> list[Trajectory]:
    """The trajectories of a ``trajectory``-layout export (undecodable rows skipped)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from schemas.trajectory import TRAJECTORY_ARROW_SCHEMA, from_arrow

    table = pq.read_table(path)
    layout = (table.schema.metadata or {}).get(b"rollstream.replay_layout")
    if layout != b"trajectory":
        raise ValueError(f"{path} is a {layout!r} export, not a trajectory one")
    rows = table.filter(pc.is_valid(table.column("run_id")))
    for name in ("policy", "turn_policies"):  # an export written before schema version 3
        if name not in rows.schema.names:
            field = TRAJECTORY_ARROW_SCHEMA.field(name)
            fill = pa.array([""] * rows.num_rows if name == "policy" else [None] * rows.num_rows)
            rows = rows.append_column(field, fill.cast(field.type))
    rows = rows.select(TRAJECTORY_ARROW_SCHEMA.names).cast(TRAJECTORY_ARROW_SCHEMA)
    return from_arrow(rows)
