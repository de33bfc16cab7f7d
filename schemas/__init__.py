"""Wire contracts every rollstream role shares: the trajectory record and its encodings.

- ``trajectory``: the ``Trajectory`` dataclass and its Arrow schema.
- ``codec``: the binary Kafka value format and the routing headers.
- ``validation``: what a record must satisfy, with precise reasons.
- ``control``: small JSON control messages (version announcements, DLQ/stale metadata).
- ``parquet``: offline export/import.
- ``topics``: the Kafka topics (imported on its own: ``from schemas.topics import ...``).
"""

from schemas.codec import (
    DEAD_LETTER_HEADER,
    MAGIC,
    MAX_RECORD_BYTES,
    STALE_HEADER,
    SUPPORTED_SCHEMA_VERSIONS,
    DecodeError,
    DecodeReason,
    RecordKind,
    RoutingHeaders,
    decode,
    encode,
    encoded_size,
    headers_to_dict,
    parse_headers,
    routing_headers,
)
from schemas.control import (
    DeadLetter,
    StaleRecord,
    VersionAnnouncement,
)
from schemas.parquet import read_parquet, write_parquet
from schemas.trajectory import (
    ARRAY_DTYPES,
    NO_VERSION,
    SCHEMA_VERSION,
    TRAJECTORY_ARROW_SCHEMA,
    EpisodeEnd,
    FinishReason,
    OldLogitsStatus,
    Trajectory,
    TurnKind,
    from_arrow,
    to_arrow,
)
from schemas.validation import Defect, Reason, ValidationLimits, validate, validate_bytes

__all__ = [
    "ARRAY_DTYPES",
    "DEAD_LETTER_HEADER",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "NO_VERSION",
    "SCHEMA_VERSION",
    "STALE_HEADER",
    "SUPPORTED_SCHEMA_VERSIONS",
    "TRAJECTORY_ARROW_SCHEMA",
    "DeadLetter",
    "DecodeError",
    "DecodeReason",
    "Defect",
    "EpisodeEnd",
    "FinishReason",
    "OldLogitsStatus",
    "Reason",
    "RecordKind",
    "RoutingHeaders",
    "StaleRecord",
    "Trajectory",
    "TurnKind",
    "ValidationLimits",
    "VersionAnnouncement",
    "decode",
    "encode",
    "encoded_size",
    "from_arrow",
    "headers_to_dict",
    "parse_headers",
    "read_parquet",
    "routing_headers",
    "to_arrow",
    "validate",
    "validate_bytes",
    "write_parquet",
]
