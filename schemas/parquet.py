"""Parquet export and import of trajectories, for offline analysis and replay.

Same columns as ``TRAJECTORY_ARROW_SCHEMA`` (the schema version rides in the file's
metadata), so any Arrow/Parquet reader — pandas, DuckDB, Spark — sees typed token and
log-prob lists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq

from schemas.trajectory import Trajectory, from_arrow, to_arrow


def write_parquet(
    records: Iterable[Trajectory], path: str | os.PathLike[str], *, compression: str = "zstd"
) -> int:
    """Write ``records`` to ``path`` and return the row count.

    The file is written next to ``path`` and renamed into place, so a reader never sees a
    half-written file.
    """
    table = to_arrow(records)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    pq.write_table(table, partial, compression=compression)
    partial.replace(target)
    return table.num_rows


def read_parquet(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Every record in a file written by ``write_parquet`` (by this schema version or an
    older one, see ``from_arrow``); ``ValueError`` on another schema."""
    return from_arrow(pq.read_table(path))
