"""The trajectory record: one generated response and everything the trainer needs from it.

A ``Trajectory`` is what producers send on ``rollouts.raw`` and what the stream processors
enrich (``logp_old``, ``advantage``) before the trainer reads it. Token ids and
log-probabilities are numpy arrays with fixed wire dtypes (``ARRAY_DTYPES``), so the binary
codec and the Arrow/Parquet export move them without converting element by element.

A partial rollout can span policy versions: ``segment_lengths[i]`` consecutive response
tokens were generated under version ``segment_versions[i]``; lengths sum to the response
length and versions never decrease (``schemas.validation`` checks this).

The dataclass stores what it is given and never converts: ``Trajectory.create`` coerces
lists or other dtypes (refusing lossy integer casts), ``schemas.validation`` reports wrong
dtypes. Arrays decoded from Kafka or read from Arrow are read-only views; ``.copy()`` one
before changing it.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Sequence
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

SCHEMA_VERSION = 1
"""Version of the record layout, shared by the binary codec and the Arrow schema."""

NO_VERSION = -1
"""``min_version``/``max_version`` of a record without segments (never valid)."""


class FinishReason(StrEnum):
    """Why generation stopped: end of sequence, length limit, or interrupted."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class OldLogitsStatus(StrEnum):
    """Whether ``logp_old`` is attached, and how it was obtained."""

    MISSING = "missing"  # not computed (yet)
    EXACT = "exact"  # training-side numerics at the record's own version(s)
    APPROX = "approx"  # e.g. a PPO-EWMA proximal policy
    OFF = "off"  # the old-logit service is disabled for this run


TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i8")
SEGMENT_LENGTH_DTYPE = np.dtype("<i4")

ARRAY_DTYPES: MappingProxyType[str, np.dtype] = MappingProxyType(
    {
        "prompt_ids": TOKEN_DTYPE,
        "response_ids": TOKEN_DTYPE,
        "logp_infer": LOGPROB_DTYPE,
        "segment_versions": VERSION_DTYPE,
        "segment_lengths": SEGMENT_LENGTH_DTYPE,
        "logp_old": LOGPROB_DTYPE,
    }
)
"""Wire dtype (little-endian) of every array field."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Trajectory:
    """One generated response of one prompt (one sample of a GRPO group).

    Equality (``==``) compares every field bit for bit, so two records with the same NaN
    payloads are equal and ``0.0`` differs from ``-0.0``: the codec's round-trip contract.
    ``reward_details`` is a small JSON-able dict; treat it as immutable.
    """

    run_id: str
    trajectory_id: str
    group_id: str
    group_size: int
    sample_index: int
    producer_id: str
    region: str
    task: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logp_infer: np.ndarray
    segment_versions: np.ndarray
    segment_lengths: np.ndarray
    reward: float
    reward_details: dict[str, Any]
    finish_reason: str
    created_at_ms: int
    finished_at_ms: int
    # Filled in later by the stream processors.
    logp_old: np.ndarray | None = None
    old_logits_status: str = OldLogitsStatus.MISSING.value
    advantage: float | None = None

    @classmethod
    def create(cls, **fields: Any) -> Trajectory:
        """Build a record from sequences or arrays of any dtype, cast to the wire dtypes.

        Integer casts that would change a value raise ``ValueError`` (an int64 token id
        beyond int32, a fractional token id); float64 log-probs are rounded to float32.
        """
        for name, dtype in ARRAY_DTYPES.items():
            if fields.get(name) is not None:
                fields[name] = coerce_array(fields[name], dtype, name)
        return cls(**fields)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def min_version(self) -> int:
        """Oldest policy version that generated any response token (``NO_VERSION`` if none)."""
        return int(self.segment_versions.min()) if len(self.segment_versions) else NO_VERSION

    @property
    def max_version(self) -> int:
        """Newest policy version that generated any response token (``NO_VERSION`` if none)."""
        return int(self.segment_versions.max()) if len(self.segment_versions) else NO_VERSION

    def token_versions(self) -> np.ndarray:
        """The policy version of every response token (int64, one per token).

        Needs well-formed segments (non-negative lengths, one per version).
        """
        return np.repeat(self.segment_versions, self.segment_lengths)

    def with_old_logits(
        self, logp_old: Any, status: str = OldLogitsStatus.EXACT.value
    ) -> Trajectory:
        """A copy with training-side old log-probs attached (cast to float32)."""
        return dataclasses.replace(
            self,
            logp_old=coerce_array(logp_old, LOGPROB_DTYPE, "logp_old"),
            old_logits_status=str(status),
        )

    def with_advantage(self, advantage: float) -> Trajectory:
        """A copy carrying its group-normalised advantage."""
        return dataclasses.replace(self, advantage=float(advantage))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        for field in dataclasses.fields(Trajectory):
            if not _same_value(getattr(self, field.name), getattr(other, field.name)):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # arrays and dicts are not hashable


def coerce_array(values: Any, dtype: np.dtype, field: str) -> np.ndarray:
    """``values`` as a contiguous 1-D array of ``dtype``; lossy integer casts raise."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{field}: expected a 1-D sequence, got shape {array.shape}")
    if array.dtype == dtype:
        return np.ascontiguousarray(array)
    cast = array.astype(dtype)
    if dtype.kind in "iu" and not np.array_equal(cast, array):
        raise ValueError(f"{field}: values of dtype {array.dtype} do not fit {dtype.name}")
    return cast


def wire_array(array: Any, dtype: np.dtype, field: str) -> np.ndarray:
    """``array`` ready to be written as raw bytes: 1-D, C-contiguous, exactly ``dtype``.

    Only byte order is fixed silently; any other dtype is an error, so a wrong dtype is
    never truncated on the way out (``int64`` ids are not cast to ``int32``).
    """
    if (
        type(array) is np.ndarray
        and array.dtype == dtype
        and array.ndim == 1
        and array.flags.c_contiguous
    ):
        return array  # the common case, checked first: this runs for every record sent
    if not isinstance(array, np.ndarray):
        raise ValueError(
            f"{field}: expected a numpy {dtype.name} array, got {type(array).__name__}"
        )
    if array.ndim != 1:
        raise ValueError(f"{field}: expected a 1-D array, got shape {array.shape}")
    if array.dtype.kind != dtype.kind or array.dtype.itemsize != dtype.itemsize:
        raise ValueError(f"{field}: dtype {array.dtype.name}, expected {dtype.name}")
    return np.ascontiguousarray(array, dtype=dtype)


def _same_value(a: Any, b: Any) -> bool:
    """Bitwise equality for arrays and floats, ``==`` for everything else."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return a.tobytes() == b.tobytes()
    if isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, int | float) and isinstance(b, int | float)):
            return False
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


# --- Arrow ------------------------------------------------------------------------------

TRAJECTORY_ARROW_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("group_size", pa.int32(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("producer_id", pa.string(), nullable=False),
        pa.field("region", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logp_infer", pa.list_(pa.float32()), nullable=False),
        pa.field("segment_versions", pa.list_(pa.int64()), nullable=False),
        pa.field("segment_lengths", pa.list_(pa.int32()), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("reward_details", pa.string(), nullable=False),  # JSON object
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("created_at_ms", pa.int64(), nullable=False),
        pa.field("finished_at_ms", pa.int64(), nullable=False),
        pa.field("logp_old", pa.list_(pa.float32()), nullable=True),
        pa.field("old_logits_status", pa.string(), nullable=False),
        pa.field("advantage", pa.float64(), nullable=True),
    ],
    metadata={
        b"rollstream.schema_version": str(SCHEMA_VERSION).encode(),
        b"rollstream.record_kind": b"trajectory",
    },
)
"""One row per trajectory; column names and order are the dataclass fields."""

_LIST_COLUMNS = tuple(name for name in TRAJECTORY_ARROW_SCHEMA.names if name in ARRAY_DTYPES)


def to_arrow(records: Iterable[Trajectory]) -> pa.Table:
    """A table with ``TRAJECTORY_ARROW_SCHEMA``; arrays are concatenated, not converted."""
    records = list(records)
    columns: list[pa.Array] = []
    for field in TRAJECTORY_ARROW_SCHEMA:
        values = [getattr(record, field.name) for record in records]
        if field.name in ARRAY_DTYPES:
            columns.append(_list_array(values, ARRAY_DTYPES[field.name], field.name))
        elif field.name == "reward_details":
            columns.append(pa.array([orjson.dumps(v).decode() for v in values], pa.string()))
        else:
            columns.append(pa.array(values, field.type))
    return pa.Table.from_arrays(columns, schema=TRAJECTORY_ARROW_SCHEMA)


def from_arrow(table: pa.Table) -> list[Trajectory]:
    """Records from a table written by ``to_arrow`` (or read back from Parquet).

    Arrays are read-only views into the table's buffers (no copy per row).
    """
    check_arrow_schema(table.schema)
    columns: dict[str, Sequence[Any]] = {}
    for name in TRAJECTORY_ARROW_SCHEMA.names:
        column = table.column(name)
        if name in _LIST_COLUMNS:
            columns[name] = _split_list_column(column, ARRAY_DTYPES[name])
        elif name == "reward_details":
            columns[name] = [orjson.loads(text) for text in column.to_pylist()]
        else:
            columns[name] = column.to_pylist()
    names = TRAJECTORY_ARROW_SCHEMA.names
    return [
        Trajectory(**{name: columns[name][row] for name in names}) for row in range(table.num_rows)
    ]


def check_arrow_schema(schema: pa.Schema) -> None:
    """Raise ``ValueError`` unless ``schema`` is this version's trajectory schema."""
    seen = (schema.metadata or {}).get(b"rollstream.schema_version")
    if seen != str(SCHEMA_VERSION).encode():
        shown = seen.decode(errors="replace") if seen is not None else "none"
        raise ValueError(
            f"trajectory table has schema version {shown}, this reader supports {SCHEMA_VERSION}"
        )
    expected = TRAJECTORY_ARROW_SCHEMA.remove_metadata()
    if not schema.remove_metadata().equals(expected):
        problems = [
            f"{f.name}: expected {f.type}{'' if f.nullable else ' not null'}"
            for f in expected
            if f.name not in schema.names or not schema.field(f.name).equals(f)
        ]
        extra = sorted(set(schema.names) - set(expected.names))
        if extra:
            problems.append(f"unexpected columns {extra}")
        raise ValueError("trajectory table does not match the schema: " + "; ".join(problems))


def _list_array(arrays: list[np.ndarray | None], dtype: np.dtype, field: str) -> pa.ListArray:
    """One Arrow list column from per-row arrays (``None`` rows become nulls)."""
    present = [wire_array(a, dtype, field) for a in arrays if a is not None]
    lengths = np.fromiter((0 if a is None else len(a) for a in arrays), np.int64, len(arrays))
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{field}: over 2**31 elements in one table; write in smaller batches")
    values = np.concatenate(present) if present else np.empty(0, dtype)
    mask = pa.array([a is None for a in arrays]) if len(present) < len(arrays) else None
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values), mask=mask)


def _split_list_column(column: pa.ChunkedArray, dtype: np.dtype) -> list[np.ndarray | None]:
    """Per-row read-only numpy views of a list column (no copy); null rows become ``None``."""
    rows: list[np.ndarray | None] = []
    for chunk in column.chunks:
        # A sliced chunk's ``offsets`` index into its unsliced ``values`` child.
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy().astype(dtype, copy=False)
        nulls = chunk.is_null().to_numpy(zero_copy_only=False)
        rows.extend(
            None if nulls[i] else values[offsets[i] : offsets[i + 1]] for i in range(len(chunk))
        )
    return rows
