"""Errors of the weights subsystem, and the closed list of reasons a version is refused.

A follower never applies a version it cannot fully verify; every refusal carries one of
the ``RefusalReason`` values, which is also the label of the refusal counter metric.
"""

from __future__ import annotations

from enum import StrEnum


class RefusalReason(StrEnum):
    """Why a version was not applied (a metric label: keep the set small and stable)."""

    NOT_FOUND = "not_found"  # no manifest for the version (not published, or collected)
    MISSING_FILE = "missing_file"  # the manifest names a file the store does not have
    MISSING_PARENT = "missing_parent"  # a delta whose parent chain cannot be fetched
    TRUNCATED = "truncated"  # a file shorter or longer than the manifest says
    BAD_HASH = "bad_hash"  # right size, wrong sha256
    UNKNOWN_FORMAT = "unknown_format"  # a manifest format version this code does not know
    BAD_MANIFEST = "bad_manifest"  # not JSON, missing or ill-typed fields
    UNSIGNED = "unsigned"  # a public key is configured and the manifest has no signature
    BAD_SIGNATURE = "bad_signature"  # signature does not verify with the configured key
    CORRUPT = "corrupt"  # hashes match but the payload does not decode consistently
    BROKEN_CHAIN = "broken_chain"  # run, parent or base fields that do not line up
    STATE_MISMATCH = "state_mismatch"  # rebuilt tensors differ from the writer's checksums


class WeightsError(Exception):
    """Base class of every error raised by ``weights``."""


class FormatError(WeightsError):
    """A payload or manifest that does not decode; carries the refusal reason."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class VersionRefused(WeightsError):
    """A version that failed verification; the holder keeps the version it had."""

    def __init__(self, version: int, reason: RefusalReason, message: str) -> None:
        super().__init__(f"version {version} refused ({reason}): {message}")
        self.version = version
        self.reason = reason


class CallbackFailed(WeightsError):
    """The follower's ``on_version`` callback raised: the version is not applied (the
    follower keeps the one it had) and is handed over again on the next attempt."""

    def __init__(self, version: int, err: BaseException) -> None:
        super().__init__(f"on_version(v{version}) raised {type(err).__name__}: {err}")
        self.version = version


class VersionTaken(WeightsError):
    """Another writer claimed this version number first (the manifest already exists)."""

    def __init__(self, run: str, version: int, key: str) -> None:
        super().__init__(
            f"version {version} of run {run!r} is already published ({key} exists): "
            "another writer claimed it first; this writer's files were removed"
        )
        self.run = run
        self.version = version
        self.key = key


class ObjectMissing(WeightsError):
    """A key that is not in the store (never written, or garbage-collected)."""

    def __init__(self, uri: str) -> None:
        super().__init__(f"{uri} does not exist")
        self.uri = uri
