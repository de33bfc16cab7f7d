"""The scored group: what the stream processors emit on ``rollouts.scored``, one per prompt.

A ``ScoredGroup`` is the G samples of one GRPO group (fewer when it was emitted partial,
after a timeout), each a ``Trajectory`` carrying ``logp_old`` (or a status saying why not)
and its group-normalised ``advantage``, plus per-sample diagnostics of the
training-inference discrepancy ``d = exp(logp_old - logp_infer)`` and the group's reward
statistics.

Binary layout (all integers little-endian), record kind ``RecordKind.SCORED_GROUP``::

    preamble  magic b"RSTM" | schema version u8 | record kind u8 (2) | flags u16 (0)
    header    total length u32 (whole record, checksum included) | meta length u32 |
              sample count u32 | reserved u32 (0)                        (24 bytes in all)
    meta      orjson object: the scalar fields and ``diagnostics`` (a list, one per sample)
    samples   count x (length u32 | a ``schemas.codec`` trajectory record)
    checksum  low 32 bits of XXH3-64 of every byte before it, u32 (as in codec.py)

Each sample keeps its own checksum; the outer one covers the meta and the framing. Non-finite
diagnostics (NaN without ``logp_old``) travel as JSON ``null`` and decode as NaN.
``decode_group`` raises ``schemas.codec.DecodeError`` for every defect, never another
exception.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import numpy as np
import orjson

from schemas.codec import (
    MAGIC,
    DecodeError,
    DecodeReason,
    RecordKind,
    check_frame,
    check_preamble,
    decode,
    encode,
    record_checksum,
)
from schemas.trajectory import NO_VERSION, SCHEMA_VERSION, Trajectory

MAX_GROUP_BYTES = 16 * 1024 * 1024
"""Default size limit of one scored group (``rollouts.scored`` allows 16 MiB messages)."""

_PREFIX = MAGIC + bytes([SCHEMA_VERSION, RecordKind.SCORED_GROUP])
_HEADER = struct.Struct("<6sH I I I I")
_LENGTH = struct.Struct("<I")
_CHECKSUM = struct.Struct("<I")
_MIN_SIZE = _HEADER.size + _CHECKSUM.size


class GroupTooLarge(ValueError):
    """The encoded group exceeds the size it was given: no retry can make it fit."""


@dataclasses.dataclass(frozen=True, slots=True)
class SampleDiagnostics:
    """Per-sample numbers the trainer logs (it can recompute them from the arrays).

    ``staleness``: trainer version seen when the sample arrived minus its oldest segment's
    version (``NO_VERSION`` when the trainer version was not known yet). ``k3_kl``: mean
    over response tokens of ``exp(x) - 1 - x`` with ``x = logp_old - logp_infer`` (an
    estimate of KL(π_infer ‖ π_old), ≥ 0). ``d_mean``/``d_min``/``d_max``: of the per-token
    discrepancy ``d = exp(x)``. All four are over policy tokens only (environment tokens of
    a multi-turn episode were never sampled) and NaN without ``logp_old`` or policy tokens.
    """

    staleness: int
    k3_kl: float
    d_mean: float
    d_min: float
    d_max: float

    @classmethod
    def of(cls, traj: Trajectory, staleness: int) -> SampleDiagnostics:
        """Diagnostics of ``traj`` from its ``logp_old`` and ``logp_infer``."""
        if traj.logp_old is None or len(traj.logp_old) == 0:
            nan = math.nan
            return cls(int(staleness), nan, nan, nan, nan)
        x = traj.logp_old.astype(np.float64) - traj.logp_infer.astype(np.float64)
        if traj.turn_kinds is not None:
            x = x[traj.loss_mask]
            if len(x) == 0:
                nan = math.nan
                return cls(int(staleness), nan, nan, nan, nan)
        d = np.exp(x)
        return cls(
            int(staleness),
            float(np.mean(d - 1.0 - x)),
            float(d.mean()),
            float(d.min()),
            float(d.max()),
        )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ScoredGroup:
    """One prompt's samples with old log-probs and advantages, ready for the trainer.

    ``complete`` is true when all ``group_size`` samples are present; a partial group
    (timed out) carries fewer, its advantages normalised over the samples present.
    ``trainer_version_seen`` is the newest policy version the stream knew of at emission
    (``NO_VERSION`` if none). Equality compares every field bit for bit.
    """

    run_id: str
    group_id: str
    group_size: int
    trainer_version_seen: int
    samples: tuple[Trajectory, ...]
    diagnostics: tuple[SampleDiagnostics, ...]
    reward_mean: float
    reward_std: float
    complete: bool
    emitted_at_ms: int

    def __post_init__(self) -> None:
        if len(self.samples) != len(self.diagnostics):
            raise ValueError(f"{len(self.samples)} samples but {len(self.diagnostics)} diagnostics")
        for traj in self.samples:
            if traj.group_id != self.group_id or traj.run_id != self.run_id:
                raise ValueError(
                    f"sample {traj.trajectory_id} belongs to group {traj.group_id!r} of run "
                    f"{traj.run_id!r}, not {self.group_id!r} of {self.run_id!r}"
                )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScoredGroup):
            return NotImplemented
        return _meta(self) == _meta(other) and self.samples == other.samples

    __hash__ = None  # type: ignore[assignment]


def _meta(group: ScoredGroup) -> bytes:
    return orjson.dumps(
        {
            "run_id": group.run_id,
            "group_id": group.group_id,
            "group_size": group.group_size,
            "trainer_version_seen": group.trainer_version_seen,
            "reward_mean": _float_out(group.reward_mean),
            "reward_std": _float_out(group.reward_std),
            "complete": group.complete,
            "emitted_at_ms": group.emitted_at_ms,
            "diagnostics": [
                [
                    d.staleness,
                    _float_out(d.k3_kl),
                    _float_out(d.d_mean),
                    _float_out(d.d_min),
                    _float_out(d.d_max),
                ]
                for d in group.diagnostics
            ],
        }
    )


def encode_group(group: ScoredGroup, *, max_bytes: int = MAX_GROUP_BYTES) -> bytes:
    """The Kafka value for ``group``; ``ValueError`` if a sample cannot be encoded,
    ``GroupTooLarge`` if the whole exceeds ``max_bytes`` (the room its topic leaves the
    value, ``schemas.topics.value_room``)."""
    meta = _meta(group)
    parts: list[bytes] = []
    for traj in group.samples:
        record = encode(traj, max_bytes=max_bytes)
        parts.append(_LENGTH.pack(len(record)))
        parts.append(record)
    total = _HEADER.size + len(meta) + sum(map(len, parts)) + _CHECKSUM.size
    if total > max_bytes:
        raise GroupTooLarge(f"oversize: group would be {total} bytes, limit is {max_bytes}")
    body = b"".join(
        [_HEADER.pack(_PREFIX, 0, total, len(meta), len(group.samples), 0), meta, *parts]
    )
    return body + _CHECKSUM.pack(record_checksum(body))


def decode_group(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_GROUP_BYTES
) -> ScoredGroup:
    """The group in ``data``; any defect raises ``DecodeError``."""
    if not isinstance(data, bytes):
        data = bytes(data)
    size = len(data)
    check_preamble(data, max_bytes, RecordKind.SCORED_GROUP, "group")
    if size < _MIN_SIZE:
        raise DecodeError(
            DecodeReason.TRUNCATED, f"expected at least {_MIN_SIZE} bytes, have {size}"
        )
    _prefix, flags, total, meta_len, count, reserved = _HEADER.unpack_from(data)
    check_frame(data, total, "group")
    if flags or reserved:
        raise DecodeError(DecodeReason.BAD_LAYOUT, f"flags {flags:#x}, reserved {reserved:#x}")
    end = size - _CHECKSUM.size
    offset = _HEADER.size + meta_len
    if offset > end:
        raise DecodeError(DecodeReason.BAD_LAYOUT, f"meta of {meta_len} bytes overruns the group")
    meta = _parse_meta(data[_HEADER.size : offset], count)
    samples: list[Trajectory] = []
    for _ in range(count):
        if offset + _LENGTH.size > end:
            raise DecodeError(DecodeReason.BAD_LAYOUT, "sample length overruns the group")
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + length > end:
            raise DecodeError(DecodeReason.BAD_LAYOUT, f"sample of {length} bytes overruns")
        samples.append(decode(data[offset : offset + length], max_bytes=max_bytes))
        offset += length
    if offset != end:
        raise DecodeError(DecodeReason.BAD_LAYOUT, f"{end - offset} unaccounted bytes")
    try:
        return ScoredGroup(samples=tuple(samples), **meta)
    except ValueError as exc:
        raise DecodeError(DecodeReason.BAD_LAYOUT, str(exc)) from exc


_META_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "group_id": (str,),
    "group_size": (int,),
    "trainer_version_seen": (int,),
    "reward_mean": (float, int, type(None)),
    "reward_std": (float, int, type(None)),
    "complete": (bool,),
    "emitted_at_ms": (int,),
    "diagnostics": (list,),
}


def _parse_meta(raw: bytes, count: int) -> dict[str, Any]:
    try:
        meta = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(DecodeReason.BAD_JSON, f"group meta: {exc}") from exc
    if not isinstance(meta, dict) or set(meta) != set(_META_TYPES):
        keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise DecodeError(DecodeReason.BAD_JSON, f"group meta has keys {keys}")
    for key, types in _META_TYPES.items():
        value = meta[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise DecodeError(DecodeReason.BAD_JSON, f"group meta {key}={value!r}")
    rows = meta["diagnostics"]
    if len(rows) != count:
        raise DecodeError(DecodeReason.BAD_LAYOUT, f"{len(rows)} diagnostics, {count} samples")
    diagnostics = []
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 5
            or not isinstance(row[0], int)
            or isinstance(row[0], bool)
            or not all(v is None or isinstance(v, int | float) for v in row[1:])
        ):
            raise DecodeError(DecodeReason.BAD_JSON, f"diagnostics row {row!r}")
        diagnostics.append(SampleDiagnostics(row[0], *(_float_in(v) for v in row[1:])))
    meta["diagnostics"] = tuple(diagnostics)
    meta["reward_mean"] = _float_in(meta["reward_mean"])
    meta["reward_std"] = _float_in(meta["reward_std"])
    return meta


def _float_out(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _float_in(value: float | int | None) -> float:
    return math.nan if value is None else float(value)


__all__ = [
    "MAX_GROUP_BYTES",
    "NO_VERSION",
    "GroupTooLarge",
    "SampleDiagnostics",
    "ScoredGroup",
    "decode_group",
    "encode_group",
]
