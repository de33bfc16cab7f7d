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

Construction checks types and ranges, so a message that exists is well-formed;
``from_json`` raises ``ValueError`` naming the missing, unknown or mistyped field. Fields
added later have defaults, so messages written before them still parse.
"""

from __future__ import annotations

import builtins
import dataclasses
import re
from typing import Any, TypeVar

import orjson

from schemas.codec import (
    DEAD_LETTER_HEADER,
    FILTERED_HEADER,
    STALE_HEADER,
    KafkaHeaders,
    headers_to_dict,
)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_BASE64 = re.compile(r"[A-Za-z0-9+/]{1,256}={0,2}")

#: Bounds of the announced pace, far above any real trainer's, so that even a run that
#: does not sign its announcements cannot be handed an absurd one.
MAX_GROUPS_PER_STEP = 1_000_000
MAX_STALENESS = 1_000_000
MAX_PRODUCERS = 100_000
MAX_PAUSE_REASON = 500  # a guard's one-line reason, not a payload


def most_producers(groups_per_step: int | None, max_staleness: int | None) -> int:
    """The most producers an announcement may count: a trainer counts those whose groups
    it trained over its last window + 1 steps, at most ``groups_per_step`` a step."""
    if groups_per_step is None:
        return MAX_PRODUCERS
    return min(MAX_PRODUCERS, groups_per_step * ((max_staleness or 0) + 1))


@dataclasses.dataclass(frozen=True, slots=True)
class VersionAnnouncement:
    """A published policy version; ``parent is None`` means a full base, not a delta."""

    run: str
    version: int
    uri: str  # where the version's manifest lives, e.g. s3://bucket/weights/<run>/v<N>/
    parent: int | None  # version this delta applies to
    base: int  # full base version the delta chain starts from (== version for a base)
    sha256: str  # of the manifest, lowercase hex
    bytes: int  # total size of the version's files
    published_at_ms: int
    # The trainer's pace, for the producers' default backpressure (None: not announced):
    # groups it takes per trainer step, and its staleness window. ``version`` is the
    # trainer's step count when it published, so it is also the trainer's trained version.
    groups_per_step: int | None = None
    max_staleness: int | None = None
    # How many producers' groups the trainer trained over its last window + 1 steps: they
    # share its pace (each starts about groups_per_step / producers groups per step).
    producers: int | None = None
    # Set by a stability guard of the trainer (``consumers.guards``, action ``pause``): why
    # producers should start no new group until a later version clears it.
    paused: str | None = None
    # base64 ed25519 signature, by the run's key, over ``signed_bytes`` (None: unsigned);
    # a listener with the key believes the pace only when it verifies.
    signature: str | None = None

    def __post_init__(self) -> None:
        _check_str(self, "run")
        _check_str(self, "uri")
        _check_int(self, "version", minimum=0)
        if self.parent is None:  # a full base is its own base
            _check_int(self, "base", minimum=self.version, maximum=self.version)
        else:  # a delta: base <= parent < version
            _check_int(self, "base", minimum=0, maximum=self.version - 1)
            _check_int(self, "parent", minimum=self.base, maximum=self.version - 1)
        _check_str(self, "sha256")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(
                f"VersionAnnouncement.sha256 must be 64 lowercase hex digits, got {self.sha256!r}"
            )
        _check_int(self, "bytes", minimum=0)
        _check_int(self, "published_at_ms", minimum=0)
        self._check_pace()
        if self.signature is not None:
            _check_str(self, "signature")
            if not _BASE64.fullmatch(self.signature):
                raise ValueError("VersionAnnouncement.signature must be base64")

    def _check_pace(self) -> None:
        """Each pace field within its bound (``most_producers``): more is no trainer's."""
        if self.groups_per_step is not None:
            _check_int(self, "groups_per_step", minimum=1, maximum=MAX_GROUPS_PER_STEP)
        if self.max_staleness is not None:
            _check_int(self, "max_staleness", minimum=0, maximum=MAX_STALENESS)
        if self.producers is not None:
            most = most_producers(self.groups_per_step, self.max_staleness)
            _check_int(self, "producers", minimum=1, maximum=most)
        if self.paused is not None:
            _check_str(self, "paused")
            if len(self.paused) > MAX_PAUSE_REASON:
                raise ValueError(
                    f"VersionAnnouncement.paused is longer than {MAX_PAUSE_REASON} characters"
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

    @classmethod
    def from_json(cls, data: builtins.bytes | str) -> VersionAnnouncement:
        return _from_json(cls, data)


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLetter:
    """Why a record went to ``rollouts.dlq`` and where it came from.

    ``reason`` is a ``schemas.validation.Reason`` or ``schemas.codec.DecodeReason`` code,
    or a processing error code of the stream worker.
    """

    reason: str
    detail: str
    source_topic: str
    partition: int
    offset: int

    def __post_init__(self) -> None:
        _check_str(self, "reason")
        _check_str(self, "detail", allow_empty=True)
        _check_str(self, "source_topic")
        _check_int(self, "partition", minimum=0)
        _check_int(self, "offset", minimum=0)

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> DeadLetter:
        return _from_json(cls, data)

    def header(self) -> tuple[str, bytes]:
        """The Kafka header to add to the original record's value and headers."""
        return DEAD_LETTER_HEADER, self.to_json()

    @classmethod
    def from_headers(cls, headers: KafkaHeaders) -> DeadLetter:
        return cls.from_json(_header_value(headers, DEAD_LETTER_HEADER))


STALE_STAGES = ("stream", "trainer")


@dataclasses.dataclass(frozen=True, slots=True)
class StaleRecord:
    """Why a record went to ``rollouts.stale``: ``staleness = trainer_version - min_version``.

    ``stage`` says who filtered it: ``stream`` (a raw trajectory record, on arrival) or
    ``trainer`` (a whole scored group that became too stale while it waited to be
    trained; ``trajectory_id`` is then the group id, the samples are in the value).
    """

    trajectory_id: str
    staleness: int
    trainer_version: int
    max_staleness: int  # the limit in force when the record was filtered
    stage: str = "stream"

    def __post_init__(self) -> None:
        _check_str(self, "trajectory_id")
        _check_int(self, "staleness")
        _check_int(self, "trainer_version", minimum=0)
        _check_int(self, "max_staleness", minimum=0)
        if self.stage not in STALE_STAGES:
            raise ValueError(f"StaleRecord.stage must be one of {STALE_STAGES}, got {self.stage!r}")

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> StaleRecord:
        return _from_json(cls, data)

    def header(self) -> tuple[str, bytes]:
        """The Kafka header to add to the original record's value and headers."""
        return STALE_HEADER, self.to_json()

    @classmethod
    def from_headers(cls, headers: KafkaHeaders) -> StaleRecord:
        return cls.from_json(_header_value(headers, STALE_HEADER))


@dataclasses.dataclass(frozen=True, slots=True)
class FilteredGroup:
    """Why a complete group went to ``rollouts.filtered``: the stream operator that dropped
    it and its reason (never a silent drop)."""

    group_id: str
    operator: str
    reason: str

    def __post_init__(self) -> None:
        _check_str(self, "group_id")
        _check_str(self, "operator")
        _check_str(self, "reason")

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> FilteredGroup:
        return _from_json(cls, data)

    def header(self) -> tuple[str, bytes]:
        """The Kafka header to add to the filtered group's record."""
        return FILTERED_HEADER, self.to_json()

    @classmethod
    def from_headers(cls, headers: KafkaHeaders) -> FilteredGroup:
        return cls.from_json(_header_value(headers, FILTERED_HEADER))


def prompt_key(prompt_ids: Any) -> str:
    """A prompt's identity on ``prompts.stats``: a hash of its token ids (int32, little
    endian), the same for the producer that samples it and the stream that scores it."""
    import hashlib

    import numpy as np

    ids = np.asarray(prompt_ids, dtype="<i4")
    return hashlib.blake2b(ids.tobytes(), digest_size=10).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class PromptStats:
    """What one stream partition has seen of one prompt, cumulative: the value on the
    compacted ``prompts.stats`` topic, keyed ``<run_id>:<prompt_key>:<partition>`` (each
    partition's worker is the only writer of its keys; a reader adds the partitions up).

    ``passes``: samples whose reward reached the stream's ``pass_threshold``.
    """

    run_id: str
    prompt_key: str
    partition: int
    samples: int
    passes: int
    reward_sum: float
    last_version: int

    def __post_init__(self) -> None:
        _check_str(self, "run_id")
        _check_str(self, "prompt_key")
        _check_int(self, "partition", minimum=0)
        _check_int(self, "samples", minimum=1)
        _check_int(self, "passes", minimum=0, maximum=self.samples)
        if not isinstance(self.reward_sum, int | float) or isinstance(self.reward_sum, bool):
            raise ValueError(f"PromptStats.reward_sum must be a number, got {self.reward_sum!r}")
        _check_int(self, "last_version", minimum=-1)

    @property
    def pass_rate(self) -> float:
        return self.passes / self.samples

    @property
    def key(self) -> bytes:
        return f"{self.run_id}:{self.prompt_key}:{self.partition}".encode()

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> PromptStats:
        return _from_json(cls, data)


ROLE_KINDS = ("producer", "streams", "trainer")
ROLE_STATES = ("up", "left")


@dataclasses.dataclass(frozen=True, slots=True)
class RoleHeartbeat:
    """A role instance's latest word: ``up`` every few seconds while it runs, ``left``
    once when it stops cleanly (``detail`` then says what it did with its work in
    flight). An instance that stops beating without ``left`` was killed.

    ``detail``: small figures and words (groups delivered, aborted, its engine ...)."""

    run: str
    role: str
    instance: str
    host: str
    pid: int
    state: str
    at_ms: int
    interval_s: float
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_str(self, "run")
        _check_str(self, "instance")
        _check_str(self, "host")
        _check_int(self, "pid", minimum=0)
        _check_int(self, "at_ms", minimum=0)
        if self.role not in ROLE_KINDS:
            raise ValueError(f"RoleHeartbeat.role must be one of {ROLE_KINDS}, got {self.role!r}")
        if self.state not in ROLE_STATES:
            raise ValueError(
                f"RoleHeartbeat.state must be one of {ROLE_STATES}, got {self.state!r}"
            )
        if (
            not isinstance(self.interval_s, int | float)
            or isinstance(self.interval_s, bool)
            or not self.interval_s > 0
        ):
            raise ValueError(f"RoleHeartbeat.interval_s must be > 0, got {self.interval_s!r}")
        if not isinstance(self.detail, dict) or not all(isinstance(k, str) for k in self.detail):
            raise ValueError(f"RoleHeartbeat.detail must be an object, got {self.detail!r}")

    @property
    def key(self) -> bytes:
        return f"{self.run}/{self.role}/{self.instance}".encode()

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> RoleHeartbeat:
        return _from_json(cls, data)


_Message = TypeVar(
    "_Message",
    VersionAnnouncement,
    DeadLetter,
    StaleRecord,
    FilteredGroup,
    PromptStats,
    RoleHeartbeat,
)


def _from_json(cls: type[_Message], data: bytes | str) -> _Message:
    """Parse, then insist on exactly the dataclass's fields; the constructor checks types."""
    name = cls.__name__
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(obj).__name__}")
    fields = {field.name for field in dataclasses.fields(cls)}
    required = {
        field.name
        for field in dataclasses.fields(cls)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    }
    if unknown := sorted(obj.keys() - fields):
        raise ValueError(f"{name}: unknown field(s) {unknown}")
    if missing := sorted(required - obj.keys()):
        raise ValueError(f"{name}: missing field(s) {missing}")
    return cls(**obj)


def _check_str(message: Any, field: str, *, allow_empty: bool = False) -> None:
    value = getattr(message, field)
    if not isinstance(value, str):
        raise ValueError(f"{type(message).__name__}.{field} must be a string, got {value!r}")
    if not value and not allow_empty:
        raise ValueError(f"{type(message).__name__}.{field} must not be empty")


def _check_int(
    message: Any, field: str, *, minimum: int | None = None, maximum: int | None = None
) -> None:
    value = getattr(message, field)
    name = f"{type(message).__name__}.{field}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _header_value(headers: KafkaHeaders, key: str) -> bytes:
    value = headers_to_dict(headers).get(key)
    if value is None:
        raise ValueError(f"header {key} is missing")
    return value
