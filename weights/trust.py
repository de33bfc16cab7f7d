"""Which versions to believe: one place that says whether a stored manifest is genuine.

The bucket is not trusted (whoever can write it could otherwise choose the weights), and
neither is ``policy.versions`` (anyone who can produce to it could move every clock). A
version counts only once the store holds a manifest for it that is signed with the
run's key and names that run and version. ``Trust.from_config`` refuses to run with no
key unless ``weights.allow_unsigned`` says so explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from core.config import ConfigurationError, WeightsConfig
from schemas.control import VersionAnnouncement
from weights.errors import FormatError, ObjectMissing, RefusalReason
from weights.manifest import (
    Manifest,
    chain_fields_problem,
    load_private_key,
    load_public_key,
    parse_manifest,
    sha256_hex,
    verify_signature,
)
from weights.store import WeightStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trust:
    """The key versions must be signed with (``None``: unsigned ones are accepted)."""

    public_key: Ed25519PublicKey | None

    @classmethod
    def from_config(cls, config: WeightsConfig) -> Trust:
        """The configured public key, else the public half of the signing key; with
        neither, an error unless ``allow_unsigned``."""
        if config.public_key is not None:
            return cls(load_public_key(config.public_key))
        if config.signing_key is not None:
            return cls(load_private_key(config.signing_key).public_key())
        if config.allow_unsigned:
            return cls(None)
        raise ConfigurationError(
            "weights.public_key is not set: versions cannot be verified. `rollstream up` "
            "and `rollstream infra up` create a key pair in the state dir; or set "
            "weights.public_key (and weights.signing_key for the trainer), or "
            "weights.allow_unsigned = true to accept unsigned versions"
        )

    def manifest(
        self, store: WeightStore, version: int, expected_sha256: str | None = None
    ) -> Manifest:
        """The stored manifest of ``version`` if it is genuine; raises ``FormatError``
        (the reason says why not) or ``ObjectMissing``."""
        data = store.read_manifest(version)
        if expected_sha256 is not None and sha256_hex(data) != expected_sha256:
            raise FormatError(
                RefusalReason.BAD_HASH, f"manifest of v{version} differs from the announced one"
            )
        return self.check(data, store.run, version)

    def check(self, data: bytes, run: str, version: int) -> Manifest:
        """Parse manifest bytes read as ``version`` of ``run``; raises ``FormatError``
        unless they are signed with the key and name that run and version."""
        manifest, canonical = parse_manifest(data)
        verify_signature(manifest, canonical, self.public_key)
        if problem := chain_fields_problem(manifest, run, version):
            raise FormatError(RefusalReason.BROKEN_CHAIN, f"v{version}: {problem}")
        return manifest

    def latest(self, store: WeightStore, after: int | None = None) -> int | None:
        """The newest version (after ``after``) whose manifest is genuine (forged ones
        above it are skipped, with a warning), or None."""
        for version in reversed(store.versions(after)):
            try:
                self.manifest(store, version)
            except (FormatError, ObjectMissing) as err:
                log.warning("weights: ignoring v%d in %s: %s", version, store.region, err)
                continue
            return version
        return None

    def confirms(self, store: WeightStore, announcement: VersionAnnouncement) -> bool | None:
        """Whether the store backs ``announcement`` with a genuine manifest of the same
        bytes: True, False (refused: forged), or None (no manifest yet, or the store did
        not answer: ask again)."""
        if announcement.run != store.run:
            return False
        try:
            self.manifest(store, announcement.version, announcement.sha256 or None)
        except (ObjectMissing, BotoCoreError, ClientError):
            return None
        except FormatError as err:
            log.warning(
                "ignoring the announcement of v%d of run %s: %s",
                announcement.version,
                announcement.run,
                err,
            )
            return False
        return True

    def announcement_check(
        self, store: WeightStore
    ) -> Callable[[VersionAnnouncement], bool | None] | None:
        """The ``confirm`` check of an ``AnnouncementListener`` reading announcements of
        ``store``'s versions; None (announcements believed) when unsigned versions are
        allowed, since nothing then tells a genuine manifest from a forged one."""
        if self.public_key is None:
            return None
        return lambda announcement: self.confirms(store, announcement)
