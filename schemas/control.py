"""Small control messages, as orjson objects whose keys are exactly the dataclass fields.

- ``VersionAnnouncement``: the value on ``policy.versions`` ("version N of run R is at
  this URI, its manifest hashes to ...", and the trainer's groups per step and staleness
  window, from which producers derive their admission credit). Keyed by run id (see
  ``schemas.topics``).
- ``DeadLetter`` and ``StaleRecord``: metadata of a record sent to ``rollouts.dlq`` or
  ``rollouts.stale``. The Kafka *value* of those messages is the original record bytes,
  unchanged (replayable as is, no base64 growth, no size surprise); the metadata travels
  as JSON in one header (``DEAD_LETTER_HEADER`` / ``STALE_HEADER``), next to the original
  routing headers.
- ``FilteredGroup``: why a data operator filtered a sample (``rs-filtered`` header on
  ``rollouts.filtered``, whose value is the original record bytes).
- ``PromptStats``: per prompt, what the stream has seen (``prompts.stats``, compacted),
  read by producers that skip solved or hopeless prompts.
- ``RoleHeartbeat``: one running role instance says it is there (``rollstream.roles``,
  compacted, keyed ``<run>/<role>/<instance>``), so a run's display counts the producers,
  stream workers and trainers that joined it from any machine, and sees which left.

Each message is a pydantic dataclass whose fields declare their types and bounds (strict:
no coercion, no unknown field), so a message that exists is well-formed; construction,
``dataclasses.replace`` and ``from_json`` raise ``ValueError`` (pydantic's
``ValidationError``) naming the missing, unknown or mistyped field. Fields added later
have defaults, so messages written before them still parse.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar, get_args

import orjson
from pydantic import ConfigDict, Field, JsonValue, TypeAdapter
from pydantic.dataclasses import dataclass

from schemas.codec import (
    DEAD_LETTER_HEADER,
    FILTERED_HEADER,
    STALE_HEADER,
    KafkaHeaders,
    headers_to_dict,
)

#: Bounds of the announced pace, far above any real trainer's, so that even a run that
#: does not sign its announcements cannot be handed an absurd one.
MAX_GROUPS_PER_STEP = 1_000_000
MAX_STALENESS = 1_000_000
MAX_PRODUCERS = 100_000
MAX_PAUSE_REASON = 500  # a guard's one-line reason, not a payload
MAX_MESSAGE_BYTES = 1024 * 1024
"""The largest JSON a control message is parsed from (far above any real one's)."""

_STRICT = ConfigDict(strict=True, extra="forbid")

Name = Annotated[str, Field(min_length=1)]
"""A non-empty string."""
_INT64_MAX = 2**63 - 1  # what orjson writes: a larger integer could be read, not sent on
Count = Annotated[int, Field(ge=0, le=_INT64_MAX)]
"""A non-negative integer (an offset, a size, a time in ms)."""
Int64 = Annotated[int, Field(ge=-_INT64_MAX - 1, le=_INT64_MAX)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
"""64 lowercase hex digits."""
Signature = Annotated[str, Field(pattern=r"^[A-Za-z0-9+/]{1,256}={0,2}$")]
"""A base64 ed25519 signature."""
StaleStage = Literal["stream", "trainer"]
RoleKind = Literal["producer", "streams", "trainer"]
RoleState = Literal["up", "left"]

STALE_STAGES: tuple[str, ...] = get_args(StaleStage)
ROLE_KINDS: tuple[str, ...] = get_args(RoleKind)
ROLE_STATES: tuple[str, ...] = get_args(RoleState)


def most_producers(groups_per_step: int | None, max_staleness: int | None) -> int:
    """The most producers an announcement may count: a trainer counts those whose groups
    it trained over its last window + 1 steps, at most ``groups_per_step`` a step."""
    if groups_per_step is None:
        return MAX_PRODUCERS
    return min(MAX_PRODUCERS, groups_per_step * ((max_staleness or 0) + 1))


class _JsonMessage:
    """What every message does: its JSON (exactly its fields) and back."""

    __slots__ = ()

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        return _from_json(cls, data)


class _HeaderMessage(_JsonMessage):
    """A message that travels as JSON in the Kafka header ``HEADER`` of the record it
    explains (the record's value stays the original bytes)."""

    __slots__ = ()
    HEADER: ClassVar[str]

    def header(self) -> tuple[str, bytes]:
        """The Kafka header to add to the record's headers."""
        return self.HEADER, self.to_json()

    @classmethod
    def from_headers(cls, headers: KafkaHeaders) -> Self:
        return cls.from_json(_header_value(headers, cls.HEADER))


@dataclass(frozen=True, slots=True, config=_STRICT)
class VersionAnnouncement(_JsonMessage):
    """A published policy version; ``parent is None`` means a full base, not a delta."""

    run: Name
    version: Count
    uri: Name  # where the version's manifest lives, e.g. s3://bucket/weights/<run>/v<N>/
    parent: int | None  # version this delta applies to
    base: int  # full base version the delta chain starts from (== version for a base)
    sha256: Sha256  # of the manifest
    bytes: Count  # total size of the version's files
    published_at_ms: Count
    # The trainer's pace, for the producers' default backpressure (None: not announced):
    # groups it takes per trainer step, and its staleness window. ``version`` is the
    # trainer's step count when it published, so it is also the trainer's trained version.
    groups_per_step: Annotated[int, Field(ge=1, le=MAX_GROUPS_PER_STEP)] | None = None
    max_staleness: Annotated[int, Field(ge=0, le=MAX_STALENESS)] | None = None
    # How many producers' groups the trainer trained over its last window + 1 steps: they
    # share its pace (each starts about groups_per_step / producers groups per step);
    # at most ``most_producers`` of the pace.
    producers: Annotated[int, Field(ge=1, le=MAX_PRODUCERS)] | None = None
    # Set by a stability guard of the trainer (``consumers.guards``, action ``pause``): why
    # producers should start no new group until a later version clears it.
    # At most ``MAX_PAUSE_REASON`` characters.
    paused: Name | None = None
    # base64 ed25519 signature, by the run's key, over ``signed_bytes`` (None: unsigned);
    # a listener with the key believes the pace only when it verifies.
    signature: Signature | None = None

    def __post_init__(self) -> None:
        """The bounds that relate fields: a base is its own base, a delta's
        ``base <= parent < version``, and no more producers than the pace allows; and
        the pause reason's length."""
        if self.parent is None:
            if self.base != self.version:
                raise ValueError(
                    f"VersionAnnouncement.base must be the version {self.version} of a full "
                    f"base, got {self.base}"
                )
        elif not 0 <= self.base < self.version:
            raise ValueError(
                f"VersionAnnouncement.base must be in [0, {self.version}) for a delta, "
                f"got {self.base}"
            )
        elif not self.base <= self.parent < self.version:
            raise ValueError(
                f"VersionAnnouncement.parent must be in [{self.base}, {self.version}), "
                f"got {self.parent}"
            )
        if self.paused is not None and len(self.paused) > MAX_PAUSE_REASON:
            raise ValueError(
                f"VersionAnnouncement.paused is longer than {MAX_PAUSE_REASON} characters"
            )
        most = most_producers(self.groups_per_step, self.max_staleness)
        if self.producers is not None and self.producers > most:
            raise ValueError(
                f"VersionAnnouncement.producers must be <= {most}, got {self.producers}"
            )

    @property
    def has_pace(self) -> bool:
        pace = (self.groups_per_step, self.max_staleness, self.producers, self.paused)
        return pace != (None, None, None, None)

    @property
    def is_base(self) -> bool:
        return self.parent is None

    # ``builtins.bytes``: inside this class, ``bytes`` is also the name of a field.
    def to_json(self) -> builtins.bytes:
        """The pace fields and the signature are left out when unset, so such an
        announcement still reads with a parser that predates them."""
        return orjson.dumps(self._fields(signed=True))

    def signed_bytes(self) -> builtins.bytes:
        """What the signature covers: every other field that is set, keys sorted."""
        return orjson.dumps(self._fields(signed=False), option=orjson.OPT_SORT_KEYS)

    def _fields(self, *, signed: bool) -> dict[str, Any]:
        obj = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not signed:
            del obj["signature"]
        for name in ("groups_per_step", "max_staleness", "producers", "paused", "signature"):
            if obj.get(name, 0) is None:
                del obj[name]
        return obj


@dataclass(frozen=True, slots=True, config=_STRICT)
class DeadLetter(_HeaderMessage):
    """Why a record went to ``rollouts.dlq`` and where it came from.

    ``reason`` is a ``schemas.validation.Reason`` or ``schemas.codec.DecodeReason`` code,
    or a processing error code of the stream worker.
    """

    HEADER: ClassVar[str] = DEAD_LETTER_HEADER

    reason: Name
    detail: str
    source_topic: Name
    partition: Count
    offset: Count


@dataclass(frozen=True, slots=True, config=_STRICT)
class StaleRecord(_HeaderMessage):
    """Why a record went to ``rollouts.stale``: ``staleness = trainer_version - min_version``.

    ``stage`` says who filtered it: ``stream`` (a raw trajectory record, on arrival) or
    ``trainer`` (a whole scored group that became too stale while it waited to be
    trained; ``trajectory_id`` is then the group id, the samples are in the value).
    """

    HEADER: ClassVar[str] = STALE_HEADER

    trajectory_id: Name
    staleness: Int64
    trainer_version: Count
    max_staleness: Count  # the limit in force when the record was filtered
    stage: StaleStage = "stream"


@dataclass(frozen=True, slots=True, config=_STRICT)
class FilteredGroup(_HeaderMessage):
    """Why a complete group went to ``rollouts.filtered``: the stream operator that dropped
    it and its reason (never a silent drop)."""

    HEADER: ClassVar[str] = FILTERED_HEADER

    group_id: Name
    operator: Name
    reason: Name


def prompt_key(prompt_ids: Any) -> str:
    """A prompt's identity on ``prompts.stats``: a hash of its token ids (int32, little
    endian), the same for the producer that samples it and the stream that scores it."""
    import hashlib

    import numpy as np

    ids = np.asarray(prompt_ids, dtype="<i4")
    return hashlib.blake2b(ids.tobytes(), digest_size=10).hexdigest()


@dataclass(frozen=True, slots=True, config=_STRICT)
class PromptStats(_JsonMessage):
    """What one stream partition has seen of one prompt, cumulative: the value on the
    compacted ``prompts.stats`` topic, keyed ``<run_id>:<prompt_key>:<partition>`` (each
    partition's worker is the only writer of its keys; a reader adds the partitions up).

    ``passes``: samples whose reward reached the stream's ``pass_threshold``.
    """

    run_id: Name
    prompt_key: Name
    partition: Count
    samples: Annotated[int, Field(ge=1, le=_INT64_MAX)]
    passes: Count  # at most ``samples``
    reward_sum: float
    last_version: Annotated[int, Field(ge=-1, le=_INT64_MAX)]

    def __post_init__(self) -> None:
        if self.passes > self.samples:
            raise ValueError(
                f"PromptStats.passes must be <= samples ({self.samples}), got {self.passes}"
            )

    @property
    def pass_rate(self) -> float:
        return self.passes / self.samples

    @property
    def key(self) -> bytes:
        return f"{self.run_id}:{self.prompt_key}:{self.partition}".encode()


@dataclass(frozen=True, slots=True, config=_STRICT)
class RoleHeartbeat(_JsonMessage):
    """A role instance's latest word: ``up`` every few seconds while it runs, ``left``
    once when it stops cleanly (``detail`` then says what it did with its work in
    flight). An instance that stops beating without ``left`` was killed.

    ``detail``: small figures and words (groups delivered, aborted, its engine ...)."""

    run: Name
    role: RoleKind
    instance: Name
    host: Name
    pid: Count
    state: RoleState
    at_ms: Count
    interval_s: Annotated[float, Field(gt=0)]
    detail: dict[str, JsonValue] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> bytes:
        return f"{self.run}/{self.role}/{self.instance}".encode()


_Message = TypeVar("_Message", bound=_JsonMessage)


@functools.cache
def _adapter(cls: type[_Message]) -> TypeAdapter[_Message]:
    return TypeAdapter(cls)


def _from_json(cls: type[_Message], data: bytes | str) -> _Message:
    """Parse and validate ``data`` as exactly the fields of ``cls`` (their declared types
    and bounds; missing, unknown or mistyped fields are named)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{cls.__name__}: {len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
    return _adapter(cls).validate_json(data)


def _header_value(headers: KafkaHeaders, key: str) -> bytes:
    value = headers_to_dict(headers).get(key)
    if value is None:
        raise ValueError(f"header {key} is missing")
    return value
