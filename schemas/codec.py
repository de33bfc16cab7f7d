"""Binary codec for Kafka values, and the routing headers sent alongside them.

Why not JSON: a record is mostly token ids and log-probs; raw little-endian arrays are
several times faster to write and read than JSON number lists and barely larger than the
arrays themselves (``python -m bench.codec`` measures both).

Layout of schema version 3 (all integers little-endian)::

    preamble  magic b"RSTM" | schema version u8 | record kind u8 | flags u16
    header    total length u32 (whole record, checksum included)
              group_size i32 | sample_index i32
              element counts u32 x8: prompt_ids, response_ids, logp_infer, logp_old,
                                     segment_versions, segment_lengths,
                                     turn_lengths, turn_kinds
              created_at_ms i64 | finished_at_ms i64 | reward f64 | advantage f64
              UTF-8 byte lengths u16 x10: run_id, trajectory_id, group_id, producer_id,
                                          region, task, finish_reason, old_logits_status,
                                          episode_end, policy
              reward_details byte length u32 | tool_calls i32 |
              turn_policies byte length u32 (0: None) | 4 zero bytes
                                                       (120 bytes in all)
    arrays    segment_versions i64 | segment_lengths i32 | prompt_ids i32 |
              response_ids i32 | logp_infer f32 | logp_old f32 (only if flag 1) |
              turn_lengths i32 | turn_kinds u8 (both only if flag 4)
    strings   the ten strings in header order, then reward_details as orjson bytes, then
              turn_policies as an orjson list of strings (absent when None)
    checksum  low 32 bits of XXH3-64 of every byte before it, u32

Flags: bit 0 ``logp_old`` present, bit 1 ``advantage`` present, bit 2 turns present (a
multi-turn record; without it the record is a single policy turn). The 120-byte header
keeps the int64 array 8-byte aligned. ``turn_policies`` present is told by its length, not a
flag: ``[]`` (2 bytes) is an empty tuple, 0 bytes is ``None``. The codec does not check it
against the turns (validation does); JSON that is not a list of strings is ``bad_json``.

Older versions still decode; only version 3 is written. Version 2 is version 3 without the
multi-policy fields: string lengths u16 x9, then 2 zero bytes, the reward_details length u32
and ``tool_calls`` i32 (a 112-byte header); it decodes with ``policy`` ``""`` and
``turn_policies`` ``None``. Version 1 is version 2 without the turns: counts u32 x6, string
lengths u16 x8, no padding or ``tool_calls`` (96-byte header), flag bit 2 unknown; it decodes
as single-turn records. The preamble is checked before the checksum, so a reader meeting a
newer schema version or record kind says so instead of "checksum mismatch".

The codec carries any record the dataclass can hold, including invalid ones (a
``logp_infer`` of the wrong length, NaN rewards): checking is ``schemas.validation``'s job,
so a stream processor can decode a bad record and dead-letter it with a precise reason.
Arrays decode as zero-copy, read-only views into the message bytes (they keep those bytes
alive); ``.copy()`` one to modify it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import NoReturn

import numpy as np
import orjson
import xxhash

from schemas.trajectory import (
    LOGPROB_DTYPE,
    SCHEMA_VERSION,
    SEGMENT_LENGTH_DTYPE,
    TOKEN_DTYPE,
    TURN_KIND_DTYPE,
    TURN_LENGTH_DTYPE,
    VERSION_DTYPE,
    Trajectory,
    check_turn_policies,
    wire_array,
)

MAGIC = b"RSTM"
SUPPORTED_SCHEMA_VERSIONS: tuple[int, ...] = (1, 2, SCHEMA_VERSION)
MAX_RECORD_BYTES = 4 * 1024 * 1024
"""Default size limit for one encoded record (Kafka's own default limit is 1 MiB)."""


class RecordKind(IntEnum):
    """What the bytes after the preamble hold."""

    TRAJECTORY = 1
    SCORED_GROUP = 2  # a whole GRPO group with advantages (schemas/group.py)


class DecodeReason(StrEnum):
    """Why bytes could not be read as a record (``DecodeError.reason``)."""

    EMPTY = "empty"
    OVERSIZE = "oversize"
    BAD_MAGIC = "bad_magic"
    UNKNOWN_SCHEMA_VERSION = "unknown_schema_version"
    UNKNOWN_RECORD_KIND = "unknown_record_kind"
    TRUNCATED = "truncated"
    TRAILING_BYTES = "trailing_bytes"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    BAD_LAYOUT = "bad_layout"  # checksum fine but counts/flags inconsistent: a foreign writer
    BAD_UTF8 = "bad_utf8"
    BAD_JSON = "bad_json"
    BAD_HEADERS = "bad_headers"  # Kafka routing headers missing or malformed


class DecodeError(ValueError):
    """Bytes that are not a readable record; ``reason`` is a stable code for routing."""

    def __init__(self, reason: DecodeReason | str, message: str) -> None:
        super().__init__(reason, message)  # both args, so the exception pickles
        self.reason = DecodeReason(reason)
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


FLAG_LOGP_OLD = 1
FLAG_ADVANTAGE = 2
FLAG_TURNS = 4
_KNOWN_FLAGS = FLAG_LOGP_OLD | FLAG_ADVANTAGE | FLAG_TURNS
_KNOWN_FLAGS_V1 = FLAG_LOGP_OLD | FLAG_ADVANTAGE

_PREFIX = MAGIC + bytes([SCHEMA_VERSION, RecordKind.TRAJECTORY])  # what decode() expects
_PREFIX_V2 = MAGIC + bytes([2, RecordKind.TRAJECTORY])
_PREFIX_V1 = MAGIC + bytes([1, RecordKind.TRAJECTORY])
_HEADER = struct.Struct("<6sH I ii 8I qq dd 10H I i I 4x")  # 120 bytes, a multiple of 8
_HEADER_V2 = struct.Struct("<6sH I ii 8I qq dd 9H 2x I i")  # 112 bytes
_HEADER_V1 = struct.Struct("<6sH I ii 6I qq dd 8H I")  # 96 bytes
_CHECKSUM = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
_MIN_SIZE = HEADER_SIZE + _CHECKSUM.size
_MIN_SIZES = {  # by schema version: the smallest record (empty arrays and strings)
    1: _HEADER_V1.size + _CHECKSUM.size,
    2: _HEADER_V2.size + _CHECKSUM.size,
    SCHEMA_VERSION: _MIN_SIZE,
}

_STRING_FIELDS = (
    "run_id",
    "trajectory_id",
    "group_id",
    "producer_id",
    "region",
    "task",
    "finish_reason",
    "old_logits_status",
    "episode_end",
    "policy",
)
_MAX_STRING_BYTES = 0xFFFF


def _record_size(counts: Sequence[int], text_bytes: int, header_size: int = HEADER_SIZE) -> int:
    """Bytes of a whole record with the header's eight element ``counts`` (in header order)
    and ``text_bytes`` of strings and JSON: the one place that does the layout's arithmetic."""
    (
        n_prompt,
        n_response,
        n_logp_infer,
        n_logp_old,
        n_versions,
        n_lengths,
        n_turn_lengths,
        n_turn_kinds,
    ) = counts
    four_byte_values = (
        n_prompt + n_response + n_logp_infer + n_logp_old + n_lengths + n_turn_lengths
    )
    return (
        header_size
        + 8 * n_versions
        + 4 * four_byte_values
        + n_turn_kinds
        + text_bytes
        + _CHECKSUM.size
    )


def record_checksum(body: bytes | memoryview) -> int:
    """The u32 that ends every record: the low half of XXH3-64.

    Not CRC32: zlib's CRC costs 1.5 us per 5 KB record, XXH3 0.14 us, and the record is
    hashed once on encode and once on decode. Kafka already guards transport and disk with
    CRC32C; this checksum catches a writer (or a hand-edited replay) that broke a record.
    """
    return xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF


# --- encode -----------------------------------------------------------------------------


def encode(traj: Trajectory, *, max_bytes: int = MAX_RECORD_BYTES) -> bytes:
    """The Kafka value for ``traj``.

    Raises ``ValueError`` for what the format cannot carry: arrays of another dtype,
    strings over 65535 UTF-8 bytes or not encodable, ``reward_details`` that orjson
    cannot serialise, ``turn_policies`` other than ``None`` or a tuple of strings, integers
    out of their field's range, or more than ``max_bytes``.
    """
    total, parts = _encode_parts(traj)
    if total > max_bytes:
        raise ValueError(f"oversize: record would be {total} bytes, limit is {max_bytes}")
    body = b"".join(parts)
    return body + _CHECKSUM.pack(record_checksum(body))


def encoded_size(traj: Trajectory) -> int:
    """Bytes ``encode(traj)`` would produce, without building the record."""
    return _encode_parts(traj)[0]


def _encode_parts(traj: Trajectory) -> tuple[int, list[bytes | np.ndarray]]:
    """Total record size and its pieces in wire order, checksum excluded."""
    arrays = [
        wire_array(traj.segment_versions, VERSION_DTYPE, "segment_versions"),
        wire_array(traj.segment_lengths, SEGMENT_LENGTH_DTYPE, "segment_lengths"),
        wire_array(traj.prompt_ids, TOKEN_DTYPE, "prompt_ids"),
        wire_array(traj.response_ids, TOKEN_DTYPE, "response_ids"),
        wire_array(traj.logp_infer, LOGPROB_DTYPE, "logp_infer"),
    ]
    flags = 0
    if traj.logp_old is not None:
        arrays.append(wire_array(traj.logp_old, LOGPROB_DTYPE, "logp_old"))
        flags |= FLAG_LOGP_OLD
    if traj.advantage is not None:
        flags |= FLAG_ADVANTAGE
    turn_lengths, turn_kinds = traj.turn_lengths, traj.turn_kinds
    if (turn_lengths is None) != (turn_kinds is None):
        raise ValueError("turn_lengths and turn_kinds must both be arrays or both None")
    if turn_lengths is not None and turn_kinds is not None:
        arrays.append(wire_array(turn_lengths, TURN_LENGTH_DTYPE, "turn_lengths"))
        arrays.append(wire_array(turn_kinds, TURN_KIND_DTYPE, "turn_kinds"))
        flags |= FLAG_TURNS
    try:
        strings = [  # the order of _STRING_FIELDS, spelled out: this runs for every record
            traj.run_id.encode(),
            traj.trajectory_id.encode(),
            traj.group_id.encode(),
            traj.producer_id.encode(),
            traj.region.encode(),
            traj.task.encode(),
            traj.finish_reason.encode(),
            traj.old_logits_status.encode(),
            traj.episode_end.encode(),
            traj.policy.encode(),
        ]
    except (AttributeError, UnicodeEncodeError) as exc:
        raise _string_problem(traj) or ValueError(f"string fields: {exc}") from exc
    if type(traj.reward_details) is not dict:
        raise ValueError(f"reward_details must be a dict, got {type(traj.reward_details).__name__}")
    try:
        details = orjson.dumps(traj.reward_details)
    except TypeError as exc:  # orjson.JSONEncodeError
        raise ValueError(f"reward_details is not JSON-serialisable: {exc}") from exc
    owners = b""
    if traj.turn_policies is not None:
        check_turn_policies(traj.turn_policies)
        try:
            owners = orjson.dumps(traj.turn_policies)
        except TypeError as exc:  # a str orjson refuses (a lone surrogate)
            raise ValueError(f"turn_policies is not JSON-serialisable: {exc}") from exc

    counts = (  # element counts, in header order
        len(traj.prompt_ids),
        len(traj.response_ids),
        len(traj.logp_infer),
        0 if traj.logp_old is None else len(traj.logp_old),
        len(traj.segment_versions),
        len(traj.segment_lengths),
        0 if turn_lengths is None else len(turn_lengths),
        0 if turn_kinds is None else len(turn_kinds),
    )
    string_lengths = list(map(len, strings))
    total = _record_size(counts, sum(string_lengths) + len(details) + len(owners))
    try:
        header = _HEADER.pack(
            _PREFIX,
            flags,
            total,
            traj.group_size,
            traj.sample_index,
            *counts,
            traj.created_at_ms,
            traj.finished_at_ms,
            traj.reward,
            0.0 if traj.advantage is None else traj.advantage,
            *string_lengths,
            len(details),
            traj.tool_calls,
            len(owners),
        )
    except struct.error as exc:
        raise _string_problem(traj) or ValueError(
            f"header field out of range or of the wrong type ({exc}): group_size, "
            "sample_index and tool_calls are int32, timestamps int64, reward and advantage "
            "floats"
        ) from exc
    return total, [header, *arrays, *strings, details, owners]


def _string_problem(traj: Trajectory) -> ValueError | None:
    """An error naming the first string field the format cannot carry, if there is one."""
    for name in _STRING_FIELDS:
        value = getattr(traj, name)
        if not isinstance(value, str):
            return ValueError(f"{name}: expected str, got {type(value).__name__}")
        try:
            data = value.encode()
        except UnicodeEncodeError as exc:
            return ValueError(f"{name}: not encodable as UTF-8 ({exc.reason})")
        if len(data) > _MAX_STRING_BYTES:
            return ValueError(f"{name}: {len(data)} UTF-8 bytes, at most {_MAX_STRING_BYTES}")
    return None


# --- decode -----------------------------------------------------------------------------


def decode(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_RECORD_BYTES
) -> Trajectory:
    """The record in ``data``; any defect raises ``DecodeError``, never another error.

    ``bytearray``/``memoryview`` input is copied once so that the returned read-only
    arrays can never change under the caller's feet.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    header, header_size = _parse_header(data, max_bytes)
    return _parse_body(data, header, header_size)


# Positions in a header tuple shaped as version 3's (what ``_parse_header`` returns).
_FLAGS = 1
_TOTAL = 2
_COUNTS = slice(5, 13)
_STRING_LENGTHS = slice(17, 27)
_N_DETAILS = 27
_N_OWNERS = 29


def _parse_header(data: bytes, max_bytes: int) -> tuple[tuple, int]:
    """The header fields in version 3's order (an older version's missing fields filled
    in as it decodes) and the header's size in bytes, once the record's framing, size,
    checksum and layout arithmetic are checked."""
    size = len(data)
    if data.startswith(_PREFIX) and _MIN_SIZE <= size <= max_bytes:
        header = _HEADER.unpack_from(data)
        header_size, known_flags = HEADER_SIZE, _KNOWN_FLAGS
    elif data.startswith(_PREFIX_V2) and _MIN_SIZES[2] <= size <= max_bytes:
        fields = _HEADER_V2.unpack_from(data)
        # no policy (""), no turn_policies (None)
        header = (*fields[:26], 0, *fields[26:28], 0)
        header_size, known_flags = _HEADER_V2.size, _KNOWN_FLAGS
    elif data.startswith(_PREFIX_V1) and _MIN_SIZES[1] <= size <= max_bytes:
        fields = _HEADER_V1.unpack_from(data)
        # no turns; no episode_end, no policy; no tool_calls, no turn_policies
        header = (*fields[:11], 0, 0, *fields[11:23], 0, 0, fields[23], 0, 0)
        header_size, known_flags = _HEADER_V1.size, _KNOWN_FLAGS_V1
    else:
        _reject_framing(data, max_bytes)
    check_frame(data, header[_TOTAL])
    _check_layout(header, header_size, known_flags)
    return header, header_size


def check_frame(data: bytes, total: int, what: str = "record") -> None:
    """``data`` is exactly the ``total`` bytes the header announces, checksum intact: the
    frame of every record kind (a trajectory, a scored group; ``what`` names it)."""
    size = len(data)
    if size < total:
        raise DecodeError(DecodeReason.TRUNCATED, f"expected {total} bytes, have {size}")
    if size > total:
        raise DecodeError(
            DecodeReason.TRAILING_BYTES, f"{what} is {total} bytes, {size - total} more follow"
        )
    (stored_crc,) = _CHECKSUM.unpack_from(data, size - _CHECKSUM.size)
    crc = record_checksum(memoryview(data)[: size - _CHECKSUM.size])
    if crc != stored_crc:
        raise DecodeError(
            DecodeReason.CHECKSUM_MISMATCH,
            f"stored checksum {stored_crc:#010x}, computed {crc:#010x} over {size - 4} bytes",
        )


def _check_layout(header: tuple, header_size: int, known_flags: int) -> None:
    """The header's flags and counts agree with each other and with its total size: the
    checksum only proves the writer wrote this, not that its arithmetic was right."""
    flags, total, counts = header[_FLAGS], header[_TOTAL], header[_COUNTS]
    n_logp_old, n_tl, n_tk = counts[3], counts[6], counts[7]
    if flags & ~known_flags:
        raise DecodeError(DecodeReason.BAD_LAYOUT, f"unknown flag bits {flags & ~known_flags:#x}")
    if not flags & FLAG_LOGP_OLD and n_logp_old:
        raise DecodeError(DecodeReason.BAD_LAYOUT, f"{n_logp_old} logp_old values but no flag")
    if not flags & FLAG_TURNS and (n_tl or n_tk):
        raise DecodeError(DecodeReason.BAD_LAYOUT, f"{n_tl} + {n_tk} turn values but no flag")
    text_bytes = sum(header[_STRING_LENGTHS]) + header[_N_DETAILS] + header[_N_OWNERS]
    expected = _record_size(counts, text_bytes, header_size)
    if expected != total:
        raise DecodeError(
            DecodeReason.BAD_LAYOUT, f"header counts imply {expected} bytes, record has {total}"
        )


def _parse_body(data: bytes, header: tuple, header_size: int) -> Trajectory:
    """The record after its checked ``header``: arrays, strings and JSON, in wire order."""
    (
        _preamble,
        flags,
        _total,
        group_size,
        sample_index,
        n_prompt,
        n_response,
        n_logp_infer,
        n_logp_old,
        n_versions,
        n_lengths,
        n_tl,
        n_tk,
        created_at_ms,
        finished_at_ms,
        reward,
        advantage,
        *string_lengths,
        n_details,
        tool_calls,
        n_owners,
    ) = header

    # Zero-copy views; read-only because ``data`` is immutable bytes.
    offset = header_size
    segment_versions = np.frombuffer(data, VERSION_DTYPE, n_versions, offset)
    offset += 8 * n_versions
    segment_lengths = np.frombuffer(data, SEGMENT_LENGTH_DTYPE, n_lengths, offset)
    offset += 4 * n_lengths
    prompt_ids = np.frombuffer(data, TOKEN_DTYPE, n_prompt, offset)
    offset += 4 * n_prompt
    response_ids = np.frombuffer(data, TOKEN_DTYPE, n_response, offset)
    offset += 4 * n_response
    logp_infer = np.frombuffer(data, LOGPROB_DTYPE, n_logp_infer, offset)
    offset += 4 * n_logp_infer
    logp_old = None
    if flags & FLAG_LOGP_OLD:
        logp_old = np.frombuffer(data, LOGPROB_DTYPE, n_logp_old, offset)
        offset += 4 * n_logp_old
    turn_lengths = turn_kinds = None
    if flags & FLAG_TURNS:
        turn_lengths = np.frombuffer(data, TURN_LENGTH_DTYPE, n_tl, offset)
        offset += 4 * n_tl
        turn_kinds = np.frombuffer(data, TURN_KIND_DTYPE, n_tk, offset)
        offset += n_tk

    strings: list[str] = []
    try:
        for length in string_lengths:
            strings.append(data[offset : offset + length].decode())
            offset += length
    except UnicodeDecodeError as exc:
        name = _STRING_FIELDS[len(strings)]
        raise DecodeError(DecodeReason.BAD_UTF8, f"{name} is not UTF-8 ({exc.reason})") from exc
    run_id, trajectory_id, group_id, producer_id, region, task, finish, status, end, policy = (
        strings
    )
    reward_details = _decode_details(data[offset : offset + n_details])
    offset += n_details
    turn_policies = _decode_turn_policies(data[offset : offset + n_owners]) if n_owners else None

    # Positional, in field order: keyword arguments cost 30% of decode()'s own time.
    return Trajectory(
        run_id,
        trajectory_id,
        group_id,
        group_size,
        sample_index,
        producer_id,
        region,
        task,
        prompt_ids,
        response_ids,
        logp_infer,
        segment_versions,
        segment_lengths,
        reward,
        reward_details,
        finish,
        created_at_ms,
        finished_at_ms,
        logp_old,
        status,
        advantage if flags & FLAG_ADVANTAGE else None,
        turn_lengths,
        turn_kinds,
        tool_calls,
        end,
        policy,
        turn_policies,
    )


def _reject_framing(data: bytes, max_bytes: int) -> NoReturn:
    """Say what is wrong with a record whose size or first six bytes are not as expected."""
    check_preamble(data, max_bytes, RecordKind.TRAJECTORY, "record")
    size = len(data)
    least = _MIN_SIZES[data[4]] if size > 4 else _MIN_SIZE
    raise DecodeError(DecodeReason.TRUNCATED, f"expected at least {least} bytes, have {size}")


def check_preamble(data: bytes, max_bytes: int, kind: RecordKind, what: str) -> None:
    """The checks every record kind's reader starts with: ``data`` (a ``what``) is not
    empty, within ``max_bytes``, and its first six bytes are the magic, a supported schema
    version and ``kind``, as far as they go (a short start of a valid record passes: the
    caller says it is truncated)."""
    size = len(data)
    if size == 0:
        raise DecodeError(DecodeReason.EMPTY, f"{what} is empty (0 bytes)")
    if size > max_bytes:
        raise DecodeError(DecodeReason.OVERSIZE, f"{what} is {size} bytes, limit is {max_bytes}")
    head = data[: len(MAGIC)]
    if head != MAGIC[: len(head)]:
        raise DecodeError(
            DecodeReason.BAD_MAGIC, f"starts with {head.hex()}, expected {MAGIC.hex()} ({MAGIC!r})"
        )
    if size > 4 and data[4] not in SUPPORTED_SCHEMA_VERSIONS:
        raise DecodeError(
            DecodeReason.UNKNOWN_SCHEMA_VERSION,
            f"schema version {data[4]}; this reader supports {list(SUPPORTED_SCHEMA_VERSIONS)}",
        )
    if size > 5 and data[5] != kind:
        known = {k.value: k.name.lower() for k in RecordKind}
        name = f" ({known[data[5]]})" if data[5] in known else ""
        raise DecodeError(
            DecodeReason.UNKNOWN_RECORD_KIND,
            f"record kind {data[5]}{name}; this reader decodes {int(kind)} ({kind.name.lower()})",
        )


def _load_json(raw: bytes, field: str) -> object:
    """``raw`` parsed, or ``BAD_JSON`` naming the record's ``field``."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(DecodeReason.BAD_JSON, f"{field}: {exc}") from exc


def _decode_details(raw: bytes) -> dict:
    details = _load_json(raw, "reward_details")
    if not isinstance(details, dict):
        raise DecodeError(
            DecodeReason.BAD_JSON,
            f"reward_details must be a JSON object, got {type(details).__name__}",
        )
    return details


def _decode_turn_policies(raw: bytes) -> tuple[str, ...]:
    owners = _load_json(raw, "turn_policies")
    if not isinstance(owners, list):
        raise DecodeError(
            DecodeReason.BAD_JSON,
            f"turn_policies must be a JSON list of strings, got {type(owners).__name__}",
        )
    for i, name in enumerate(owners):
        if not isinstance(name, str):
            raise DecodeError(
                DecodeReason.BAD_JSON,
                f"turn_policies[{i}] must be a string, got {type(name).__name__} {name!r}",
            )
    return tuple(owners)


# --- Kafka headers ----------------------------------------------------------------------

KafkaHeaders = Iterable[tuple[str, bytes | None]] | Mapping[str, bytes | None] | None
"""Headers as Kafka clients hand them over: a list of pairs (confluent-kafka, aiokafka),
a mapping (Faust) or ``None``."""


@dataclass(frozen=True, slots=True)
class RoutingHeaders:
    """What a router needs to filter a record without decoding its value."""

    schema_version: int
    run_id: str
    group_id: str
    trajectory_id: str
    min_version: int
    max_version: int
    producer_id: str
    region: str
    #: turns and policy-generated response tokens; ``None`` from a writer older than
    #: schema version 2, which did not send them
    turns: int | None = None
    policy_tokens: int | None = None
    #: the record's policy; ``""`` (the run's single, unnamed policy) from a writer older
    #: than schema version 3, which did not send it
    policy: str = ""


# Every Kafka header name rollstream writes, declared here once.
SCHEMA_VERSION_HEADER = "rs-schema-version"
RUN_ID_HEADER = "rs-run-id"
GROUP_ID_HEADER = "rs-group-id"
TRAJECTORY_ID_HEADER = "rs-trajectory-id"
MIN_VERSION_HEADER = "rs-min-version"
MAX_VERSION_HEADER = "rs-max-version"
PRODUCER_ID_HEADER = "rs-producer-id"
REGION_HEADER = "rs-region"
TURNS_HEADER = "rs-turns"
POLICY_TOKENS_HEADER = "rs-policy-tokens"
POLICY_HEADER = "rs-policy"
COMPLETE_HEADER = "rs-complete"
"""A scored group's header: ``1`` when it holds all G samples, ``0`` for a partial one."""
DEAD_LETTER_HEADER = "rs-dead-letter"
"""Why a record was dead-lettered (``schemas.control.DeadLetter``)."""
STALE_HEADER = "rs-stale"
"""Why a record was routed to the stale topic (``schemas.control.StaleRecord``)."""
FILTERED_HEADER = "rs-filtered"
"""Which operator filtered a group out (``schemas.control.FilteredGroup``)."""

_HEADER_KEYS = {
    "schema_version": SCHEMA_VERSION_HEADER,
    "run_id": RUN_ID_HEADER,
    "group_id": GROUP_ID_HEADER,
    "trajectory_id": TRAJECTORY_ID_HEADER,
    "min_version": MIN_VERSION_HEADER,
    "max_version": MAX_VERSION_HEADER,
    "producer_id": PRODUCER_ID_HEADER,
    "region": REGION_HEADER,
    "turns": TURNS_HEADER,
    "policy_tokens": POLICY_TOKENS_HEADER,
    "policy": POLICY_HEADER,
}
_INT_HEADERS = ("schema_version", "min_version", "max_version", "turns", "policy_tokens")
_OPTIONAL_HEADERS = ("turns", "policy_tokens", "policy")  # absent: RoutingHeaders' default


def routing_headers(traj: Trajectory) -> list[tuple[str, bytes]]:
    """Kafka headers for ``traj``: UTF-8 text, integers in decimal (readable by any tool).
    ``rs-policy`` is always sent, empty for the run's single, unnamed policy."""
    values = {
        "schema_version": SCHEMA_VERSION,
        "run_id": traj.run_id,
        "group_id": traj.group_id,
        "trajectory_id": traj.trajectory_id,
        "min_version": traj.min_version,
        "max_version": traj.max_version,
        "producer_id": traj.producer_id,
        "region": traj.region,
        "turns": traj.num_turns,
        "policy_tokens": traj.num_policy_tokens,
        "policy": traj.policy,
    }
    return [(key, str(values[name]).encode()) for name, key in _HEADER_KEYS.items()]


def min_schema_version(traj: Trajectory) -> int:
    """The oldest schema version whose layout carries ``traj``: 3 with a ``policy`` or
    ``turn_policies``, 2 with turns, ``tool_calls`` or an ``episode_end``, else 1."""
    if traj.policy != "" or traj.turn_policies is not None:
        return 3
    if (
        traj.turn_lengths is not None
        or traj.turn_kinds is not None
        or traj.tool_calls != 0
        or traj.episode_end != ""
    ):
        return 2
    return 1


def header_disagreements(
    traj: Trajectory, headers: KafkaHeaders, *, schema_version: int | None = None
) -> list[str]:
    """Each routing header of ``headers`` that contradicts ``traj`` (the record's body),
    as ``"rs-run-id='a', body 'b'"``; a routing header that appears twice or is not UTF-8
    counts too. Empty: every routing header present agrees with the body.

    A header left out is not a disagreement (headers are a convenience for filtering
    without decoding); one that is there must tell the truth, since tools route on it. The
    exception is ``rs-policy``: left out, it reads as ``""`` (a writer older than schema
    version 3), so a body naming a policy needs it, or a router would hand the record to
    the run's unnamed policy.

    ``rs-schema-version`` must be ``schema_version`` (the value's version byte) when it is
    given; otherwise any version this reader knows whose layout can carry the body (a
    writer older than this one is no liar).
    """
    expected = dict(routing_headers(traj))
    if schema_version is not None:
        versions = {str(schema_version)}
        truth = f"value is schema version {schema_version}"
    else:
        oldest = min_schema_version(traj)
        versions = {str(v) for v in SUPPORTED_SCHEMA_VERSIONS if v >= oldest}
        later = "" if oldest == SCHEMA_VERSION else f" to {SCHEMA_VERSION}"
        truth = f"body needs schema version {oldest}{later}"
    seen: set[str] = set()
    problems: list[str] = []
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or ())
    for key, raw in pairs:
        if key not in expected:
            continue
        if key in seen:
            problems.append(f"{key} appears more than once")
            continue
        seen.add(key)
        try:
            text = (raw or b"").decode()
        except UnicodeDecodeError:
            problems.append(f"{key}={raw!r} is not UTF-8")
            continue
        if key == SCHEMA_VERSION_HEADER:
            if text not in versions:
                problems.append(f"{key}={text!r}, {truth}")
        elif text != expected[key].decode():
            problems.append(f"{key}={text!r}, body {expected[key].decode()!r}")
    if POLICY_HEADER not in seen and expected[POLICY_HEADER]:
        problems.append(
            f"{POLICY_HEADER} missing (read as ''), body {expected[POLICY_HEADER].decode()!r}"
        )
    return problems


def parse_headers(headers: KafkaHeaders) -> RoutingHeaders:
    """The routing headers of a message; other headers are ignored. ``rs-turns`` and
    ``rs-policy-tokens`` may be absent (a schema version 1 writer), and ``rs-policy`` (a
    writer older than version 3: the policy is ``""``).

    Raises ``DecodeError`` (reason ``bad_headers``) naming the missing, duplicated or
    malformed header.
    """
    found = headers_to_dict(headers)
    values: dict[str, int | str] = {}
    for name, key in _HEADER_KEYS.items():
        raw = found.get(key)
        if raw is None and name in _OPTIONAL_HEADERS:
            continue
        if raw is None:
            raise DecodeError(DecodeReason.BAD_HEADERS, f"header {key} is missing")
        try:
            text = raw.decode()
            values[name] = int(text) if name in _INT_HEADERS else text
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise DecodeError(DecodeReason.BAD_HEADERS, f"header {key}={raw!r}: {exc}") from exc
    return RoutingHeaders(**values)  # type: ignore[arg-type]


def headers_to_dict(headers: KafkaHeaders) -> dict[str, bytes | None]:
    """Kafka headers as a dict; a key that appears twice raises ``DecodeError``."""
    if headers is None:
        return {}
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, bytes | None] = {}
    for key, value in pairs:
        if key in found:
            raise DecodeError(DecodeReason.BAD_HEADERS, f"header {key} appears more than once")
        found[key] = value
    return found
