"""The trainer side: turn each new state dict into a published, announced version.

``DeltaWriter`` keeps its own copy of the last published weights, so it can diff the
next state against exactly what readers hold. Each ``publish`` writes a sparse delta,
or a full base when there is no previous state, every ``base_every`` versions, when the
tensor layout changed, or when the delta would exceed ``max_delta_fraction`` of a base
(a base then costs readers little more and shortens every later chain).

A LoRA run's writer is given its ``adapter_tensors``: after one base, each version is an
adapter holding just those tensors whole, on that base, for as long as every other tensor
is bit-for-bit the base's (checked by checksum each version; a change writes a new base).
A restarted writer reuses the store's base when its frozen tensors are still ours, so a
restart costs an adapter, not a model.

Order of operations: data files, then the manifest by conditional put (the claim),
then the announcement. A crash before the claim leaves only orphan files (collected by
retention); a crash after it leaves a valid version that pollers still find.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
from confluent_kafka import KafkaException
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from core.config import WeightsConfig
from schemas.control import VersionAnnouncement
from weights import format as fmt
from weights.announce import Announcer
from weights.errors import FormatError, ObjectMissing, VersionTaken
from weights.manifest import FileEntry, Kind, Manifest, load_private_key, sha256_hex
from weights.store import WeightStore, new_file_name, sha256_file
from weights.trust import Trust

log = logging.getLogger(__name__)

INCOMPRESSIBLE = 2.0
"""Changed weights' values seldom compress to half their size, so a delta whose values
alone exceed this many times the size limit becomes a base without being compressed (a
full-precision version, where nearly every value changes, saves a compression pass)."""


@dataclass(frozen=True)
class PublishResult:
    """What was published, where, and how long each stage took (seconds)."""

    manifest: Manifest
    manifest_sha256: str
    uri: str
    announcement: VersionAnnouncement
    timings: dict[str, float] = field(default_factory=dict)


def announcement_of(
    store: WeightStore, key: str, manifest: Manifest, manifest_bytes: bytes
) -> VersionAnnouncement:
    """The announcement of a version whose manifest (``manifest_bytes``, parsed as
    ``manifest``) ``store`` holds at ``key``: where it is, what it chains to, its hash,
    stamped now."""
    return VersionAnnouncement(
        run=store.run,
        version=manifest.version,
        uri=store.uri(key),
        parent=manifest.parent,
        base=manifest.base,
        sha256=sha256_hex(manifest_bytes),
        bytes=manifest.total_bytes,
        published_at_ms=int(time.time() * 1000),
    )


class DeltaWriter:
    """Publishes versions of one run to one store, optionally signed and announced."""

    def __init__(
        self,
        store: WeightStore,
        *,
        base_every: int = 20,
        max_delta_fraction: float = 0.25,
        zstd_level: int = 3,
        signing_key: Ed25519PrivateKey | None = None,
        announcer: Announcer | None = None,
        adapter_tensors: Collection[str] | None = None,
    ) -> None:
        self.store = store
        self.base_every = base_every
        self.max_delta_fraction = max_delta_fraction
        self.zstd_level = zstd_level
        self.signing_key = signing_key
        self.announcer = announcer
        self.adapter_tensors = None if adapter_tensors is None else frozenset(adapter_tensors)
        self._adapter_base: Manifest | None = None  # the base a LoRA run's adapters go on
        self._prev: fmt.StateDict | None = None  # our own copy of the last published state
        self._aliases: dict[str, str] = {}
        self._version: int | None = None
        self._base: int | None = None
        # called with the version once its data file is uploaded, before the manifest is
        # claimed: the trainer's crash tests kill the process there (a torn publish)
        self.before_claim: Callable[[int], None] | None = None

    @classmethod
    def from_config(
        cls,
        store: WeightStore,
        config: WeightsConfig,
        announcer: Announcer | None = None,
        adapter_tensors: Collection[str] | None = None,
    ) -> DeltaWriter:
        return cls(
            store,
            base_every=config.base_every,
            max_delta_fraction=config.max_delta_fraction,
            zstd_level=config.zstd_level,
            signing_key=load_private_key(config.signing_key) if config.signing_key else None,
            announcer=announcer,
            adapter_tensors=adapter_tensors,
        )

    @property
    def version(self) -> int | None:
        """The last version this writer published."""
        return self._version

    def publish(
        self, state: Mapping[str, torch.Tensor], version: int | None = None
    ) -> PublishResult:
        """Publish ``state`` as ``version`` (default: the one after this writer's last, or
        after the store's latest for a writer that has not published yet, e.g. after a
        restart, whose first version is a base, or for an adapter writer an adapter on
        the store's base when that verifies as its own). ``state`` must not change while
        this runs.

        Raises ``VersionTaken`` if another writer claimed the number first; this writer's
        files are then removed, and its next version will be a full base (the chain in
        the store continues from the other writer's state, not from ours).
        """
        if version is None:
            last = self._version if self._version is not None else self.store.latest()
            version = 0 if last is None else last + 1
        if self._version is not None and version <= self._version:
            raise ValueError(f"version {version} is not after {self._version}")
        timings: dict[str, float] = {}
        clock = time.perf_counter()

        unique, aliases = fmt.split_aliases({k: v.detach() for k, v in state.items()})
        specs = fmt.specs_of(unique)
        delta, checksums, on_base = None, None, None
        if self.adapter_tensors is None:
            delta, checksums = self._try_delta(unique, aliases, version)
        timings["encode"] = time.perf_counter() - clock

        clock = time.perf_counter()  # a comparison checksummed the new state as it went
        checksums = checksums if checksums is not None else fmt.state_checksums(unique)
        timings["checksum"] = time.perf_counter() - clock
        overlay: tuple[str, ...] = ()
        if self.adapter_tensors is not None:
            overlay = tuple(sorted(self.adapter_tensors & unique.keys()))
            on_base = self._base_for_adapter(specs, aliases, checksums, overlay, version)

        with tempfile.TemporaryDirectory(prefix="rollstream-weights-") as scratch:
            clock = time.perf_counter()
            kind: Kind = "delta" if delta is not None else "base" if on_base is None else "adapter"
            name = new_file_name(kind)
            payload: bytes | Path
            if delta is None:
                payload = Path(scratch) / name
                stored = unique if on_base is None else {n: unique[n] for n in overlay}
                safetensors.torch.save_file(
                    fmt.base_payload(stored), payload, metadata=fmt.BASE_METADATA
                )
                size = raw_size = payload.stat().st_size
                file_sha = sha256_file(payload)
            else:
                payload, size, raw_size = delta.blob, len(delta.blob), delta.raw_bytes
                file_sha = sha256_hex(delta.blob)
            if on_base is not None:  # an adapter applies on its base
                parent, base = on_base.version, on_base.version
            elif delta is not None:
                parent, base = self._version, self._base
            else:
                parent, base = None, version
            manifest = Manifest(
                run=self.store.run,
                version=version,
                kind=kind,
                parent=parent,
                base=base,  # type: ignore[arg-type]
                tensors=specs,
                aliases=aliases,
                files=(FileEntry(name=name, bytes=size, sha256=file_sha, raw_bytes=raw_size),),
                checksums=checksums,
                state_sha256=fmt.digest_of_checksums(checksums),
                changed_elements=0 if delta is None else delta.changed_elements,
                overlay=overlay if kind == "adapter" else (),
            )
            if self.signing_key is not None:
                manifest = manifest.sign(self.signing_key)
            manifest_bytes = manifest.to_bytes()
            timings["serialize"] = time.perf_counter() - clock

            clock = time.perf_counter()
            file_key = self.store.key(version, name)
            self.store.upload(file_key, payload)
            timings["upload"] = time.perf_counter() - clock
            if self.before_claim is not None:
                self.before_claim(version)
            clock = time.perf_counter()
            try:
                manifest_key = self.store.claim(version, manifest_bytes)
            except VersionTaken:
                self.store.delete([file_key])
                # The store's chain now holds another writer's state: our next version
                # must not be a delta against ours, so it will be a full base.
                self._prev = self._adapter_base = None
                log.warning(
                    "version %d of run %s was claimed by another writer", version, self.store.run
                )
                raise
            timings["claim"] = time.perf_counter() - clock

        clock = time.perf_counter()
        if self.adapter_tensors is not None:
            # the next adapter goes on this base, or on this adapter's (after a restart: the
            # store's)
            self._adapter_base = manifest if on_base is None else on_base
            self._base = self._adapter_base.version
        elif delta is None:
            self._prev = {
                k: v.cpu().clone(memory_format=torch.contiguous_format) for k, v in unique.items()
            }
            self._base = version
        else:
            assert self._prev is not None
            fmt.apply_delta_inplace(self._prev, delta.changes)
        self._aliases = aliases
        self._version = version
        timings["remember"] = time.perf_counter() - clock

        announcement = announcement_of(self.store, manifest_key, manifest, manifest_bytes)
        if self.announcer is not None:
            clock = time.perf_counter()
            self._announce(announcement)
            timings["announce"] = time.perf_counter() - clock
        log.info(
            "published %s v%d of run %s: %d bytes, %d changed elements (%s)",
            kind,
            version,
            self.store.run,
            manifest.total_bytes,
            manifest.changed_elements,
            self.store.region,
        )
        return PublishResult(
            manifest=manifest,
            manifest_sha256=announcement.sha256,
            uri=announcement.uri,
            announcement=announcement,
            timings=timings,
        )

    def _try_delta(
        self, unique: fmt.StateDict, aliases: dict[str, str], version: int
    ) -> tuple[fmt.EncodedDelta | None, dict[str, int] | None]:
        """The delta to publish (None when this version should be a base), and the new
        state's checksums when the comparison computed them."""
        if self._prev is None or self._base is None or self._version is None:
            return None, None
        if version - self._base >= self.base_every or aliases != self._aliases:
            return None, None
        if not fmt.delta_compatible(fmt.specs_of(self._prev), fmt.specs_of(unique)):
            log.info("tensor layout changed at v%d: writing a base", version)
            return None, None
        limit = self.max_delta_fraction * fmt.dense_bytes(unique)
        diff = fmt.diff_state(self._prev, unique)
        if diff.value_bytes > INCOMPRESSIBLE * limit:
            log.info(
                "v%d changes %d bytes of values (> %d): writing a base",
                version,
                diff.value_bytes,
                int(INCOMPRESSIBLE * limit),
            )
            return None, diff.checksums
        delta = fmt.compress_diff(diff, level=self.zstd_level)
        if len(delta.blob) > limit:
            log.info(
                "delta of v%d is %d bytes (> %d): writing a base",
                version,
                len(delta.blob),
                int(limit),
            )
            return None, delta.checksums
        return delta, delta.checksums

    def _base_for_adapter(
        self,
        specs: Mapping[str, fmt.TensorSpec],
        aliases: Mapping[str, str],
        checksums: Mapping[str, int],
        overlay: tuple[str, ...],
        version: int,
    ) -> Manifest | None:
        """The base this version can be an adapter on: ours, or after a restart the store's
        latest version's (when it verifies as ours); None when a base must be written."""
        base = self._adapter_base
        if base is None and self._version is None:
            base = self._stored_base()
        if base is None or not overlay:
            return None
        frozen_changed = [
            name
            for name in specs
            if name not in overlay and checksums[name] != base.checksums.get(name)
        ]
        if dict(specs) != base.tensors or dict(aliases) != base.aliases or frozen_changed:
            log.warning(
                "v%d: tensors outside the adapter differ from base v%d (%s): writing a base",
                version,
                base.version,
                frozen_changed[:3] or "layout",
            )
            return None
        return base

    def _stored_base(self) -> Manifest | None:
        """The base of the store's latest version, read and (when we sign) verified as
        signed by our key; None if there is none or it does not verify."""
        latest = self.store.latest()
        if latest is None:
            return None
        ours = Trust(None if self.signing_key is None else self.signing_key.public_key())
        try:
            manifest = ours.manifest(self.store, latest)
            return manifest if manifest.kind == "base" else ours.manifest(self.store, manifest.base)
        except (FormatError, ObjectMissing) as err:
            log.warning("no reusable base in the store (%s): writing a base", err)
            return None

    def _announce(self, announcement: VersionAnnouncement) -> None:
        assert self.announcer is not None
        for attempt in Retrying(
            stop=stop_after_attempt(3),
            wait=wait_exponential(multiplier=0.5, max=5),
            retry=retry_if_exception_type(KafkaException),
            reraise=True,
        ):
            with attempt:
                self.announcer.announce(announcement)
