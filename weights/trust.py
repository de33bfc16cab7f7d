"""Which versions to believe: one place that says whether a stored manifest is genuine.

The bucket is not trusted (whoever can write it could otherwise choose the weights), and
neither is ``policy.versions`` (anyone who can produce to it could move every clock). A
version counts only once the store holds a manifest for it that is signed with the
run's key and names that run and version. ``Trust.from_config`` refuses to run with no
key unless ``weights.allow_unsigned`` says so explicitly.

An announcement's version is vouched for by its manifest; the trainer's pace it carries
is believed only when the announcement itself is signed with the run's key
(``vouched``). Manifests refused once are remembered by key and ETag, so a forged
object in the bucket costs one read and one warning, not one of each per poll.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from botocore.exceptions import BotoCoreError, ClientError
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from core.config import ConfigurationError, WeightsConfig
from schemas.control import VersionAnnouncement
from weights.errors import FormatError, ObjectMissing, RefusalReason
from weights.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
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
    # manifests found not genuine: (region, URI) -> ETag when refused (read again once
    # it changes); one Trust may judge several regions' stores (the mirror)
    refused: dict[tuple[str, str], str] = field(default_factory=dict, compare=False, repr=False)

    MAX_REFUSED = 4096  # remembered refusals; the oldest are forgotten first

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
        """The newest version (after ``after``) whose manifest is genuine, or None. Forged
        ones above it are skipped: each is read and warned about once, then passed over
        unread while its ETag stays the same."""
        manifests = [o for o in store.objects(after) if o.name == MANIFEST_NAME]
        for listed in reversed(manifests):
            where = (store.region, store.uri(listed.key))
            if self.refused.get(where) == listed.etag:
                continue
            try:
                if listed.size > MAX_MANIFEST_BYTES:
                    raise FormatError(
                        RefusalReason.BAD_MANIFEST,
                        f"{listed.size} bytes, more than {MAX_MANIFEST_BYTES}: not read",
                    )
                self.manifest(store, listed.version)
            except FormatError as err:
                log.warning("weights: ignoring v%d in %s: %s", listed.version, store.region, err)
                self._remember_refusal(where, listed.etag)
                continue
            except ObjectMissing:  # deleted since it was listed
                continue
            return listed.version
        return None

    def _remember_refusal(self, where: tuple[str, str], etag: str) -> None:
        if not etag:  # a store that lists no ETags: nothing tells a rewrite apart
            return
        self.refused.pop(where, None)  # re-inserted as the newest
        self.refused[where] = etag
        while len(self.refused) > self.MAX_REFUSED:
            del self.refused[next(iter(self.refused))]

    def vouched(self, announcement: VersionAnnouncement) -> VersionAnnouncement:
        """``announcement`` with its pace cleared (and a warning) unless it is signed with
        the key: the manifest vouches for the version, not for the pace. Without a key
        it is taken as it is (its pace within the schema's bounds)."""
        if self.public_key is None or not announcement.has_pace:
            return announcement
        if announcement.signature is not None:
            try:
                signature = base64.b64decode(announcement.signature, validate=True)
                self.public_key.verify(signature, announcement.signed_bytes())
                return announcement
            except (InvalidSignature, ValueError):
                pass
        log.warning(
            "ignoring the pace announced with v%d of run %s (groups per step %s, staleness "
            "%s, producers %s, paused %s): the announcement is %s",
            announcement.version,
            announcement.run,
            announcement.groups_per_step,
            announcement.max_staleness,
            announcement.producers,
            announcement.paused,
            "not signed" if announcement.signature is None else "signed with another key",
        )
        return dataclasses.replace(
            announcement, groups_per_step=None, max_staleness=None, producers=None, paused=None
        )

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
