"""The reader side: follow a run's versions in one region and rebuild them exactly.

``WeightFollower`` learns of new versions from ``policy.versions`` announcements or by
polling the store, walks the parent chain from the wanted version back to the version it
holds (or to a base, when it is too far behind or holds nothing), downloads and verifies
every manifest and file, applies the deltas, checks every rebuilt tensor against the
writer's checksums, and only then hands the new ``Snapshot`` to its callback. An adapter
version (a LoRA run's) is its base's tensors with its own few laid over them: the base's
tensors are taken from the version held when it has the same base (fetched once per base
otherwise), so successive snapshots share them and only the adapter's tensors are new.

A version counts as applied (``version``, ``snapshot``, the applied metric) only once the
callback has returned. A callback that raises leaves the follower at the version it had:
the failure is logged and counted in ``rollstream_weights_callback_failures_total``, and
the rebuilt version is handed over again on the next attempt (``sync_with_retry`` backs
off through ``core.retry``), never skipped.

Anything it cannot verify is *refused*: one log line naming the version, region and
reason, one increment of ``rollstream_weights_refusals_total{reason=...}``, and the
follower keeps the version it had. Retries back off exponentially (``core.retry``).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from botocore.exceptions import BotoCoreError, ClientError
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from prometheus_client import CollectorRegistry

from core.config import RetryConfig, WeightsConfig
from core.prometheus import MetricFactory
from core.retry import retrying
from weights import format as fmt
from weights.announce import AnnouncementListener
from weights.errors import (
    CallbackFailed,
    FormatError,
    ObjectMissing,
    RefusalReason,
    VersionRefused,
    WeightsError,
)
from weights.manifest import (
    FileEntry,
    Manifest,
    chain_fields_problem,
    check_file_entry,
    parse_manifest,
    sha256_hex,
    verify_signature,
)
from weights.store import WeightStore, sha256_file
from weights.trust import Trust

log = logging.getLogger(__name__)

#: Errors worth another attempt: refusals (a file may still be mirroring), S3 hiccups and
#: a callback that failed (it may work the next time).
RETRYABLE = (VersionRefused, CallbackFailed, BotoCoreError, ClientError)


@dataclass(frozen=True)
class Snapshot:
    """The weights of one version. ``state`` must be treated as read-only: later
    snapshots share the tensors a delta did not touch."""

    version: int
    state: dict[str, torch.Tensor]  # tied names included, as the same tensor objects
    manifest: Manifest


class FollowerMetrics:
    """Prometheus metrics of one follower, on a registry the caller owns (or a new one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["region", "run"]
        m = MetricFactory(self.registry, "rollstream_weights_")
        self.refusals = m.counter(
            "refusals", "Versions refused by a follower, by reason.", [*labels, "reason"]
        )
        self.applied = m.counter(
            "applied",
            "Versions applied by a follower, by how they were reached.",
            [*labels, "path"],
        )
        self.store_errors = m.counter(
            "store_errors", "S3 errors (network, throttling) while following.", labels
        )
        self.callback_failures = m.counter(
            "callback_failures",
            "Times the on_version callback raised (the version is not applied, it is retried).",
            labels,
        )
        self.version = m.gauge("version", "Version the follower holds.", labels)
        self.sync_seconds = m.gauge(
            "last_sync_seconds",
            "Duration of the last successful sync (download, verify, apply).",
            labels,
        )


class WeightFollower:
    """Holds one version of a run and moves it forward, verifying every step."""

    def __init__(
        self,
        store: WeightStore,
        on_version: Callable[[Snapshot], None] | None = None,
        *,
        public_key: Ed25519PublicKey | None = None,
        verify_state: bool = True,
        retry_max_s: float = 30.0,
        metrics: FollowerMetrics | None = None,
    ) -> None:
        self.store = store
        self.on_version = on_version
        self.public_key = public_key
        self.trust = Trust(public_key)  # remembers the forged manifests it refused
        self.verify_state = verify_state
        self.retry_max_s = retry_max_s
        self.metrics = metrics if metrics is not None else FollowerMetrics()
        self._labels = {"region": store.region, "run": store.run}
        self._snapshot: Snapshot | None = None
        self._unique: fmt.StateDict = {}  # the held state without tied duplicates
        # rebuilt and verified, but its callback failed: handed over again, not rebuilt
        self._unapplied: tuple[Snapshot, fmt.StateDict, str] | None = None
        self._waiting_for: int | None = None  # a version announced but not in the store yet
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        store: WeightStore,
        config: WeightsConfig,
        on_version: Callable[[Snapshot], None] | None = None,
        metrics: FollowerMetrics | None = None,
    ) -> WeightFollower:
        return cls(
            store,
            on_version,
            public_key=Trust.from_config(config).public_key,
            verify_state=config.verify_state,
            retry_max_s=config.retry_max_s,
            metrics=metrics,
        )

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    @property
    def version(self) -> int | None:
        return None if self._snapshot is None else self._snapshot.version

    # --- one attempt ------------------------------------------------------------------------

    def sync(
        self, target: int | None = None, *, manifest_sha256: str | None = None
    ) -> Snapshot | None:
        """Move to ``target`` (default: the newest complete version in the store).

        One attempt: raises ``VersionRefused`` (the held version is kept) or a botocore
        error. ``manifest_sha256`` (from an announcement) pins the target's manifest.
        Returns the snapshot held afterwards (None if the store is empty).
        """
        with self._lock:
            try:
                return self._sync(target, manifest_sha256)
            except (BotoCoreError, ClientError):
                self.metrics.store_errors.labels(**self._labels).inc()
                raise

    def _sync(self, target: int | None, manifest_sha256: str | None) -> Snapshot | None:
        if target is None:  # the newest genuine one: a forged newer version must not stall us
            if self.public_key is not None:
                target = self.trust.latest(self.store, after=self.version)
            else:
                target = self.store.latest(after=self.version)
            if target is None:
                return self._snapshot
        if self.version is not None and target <= self.version:
            return self._snapshot
        started = time.perf_counter()
        if self._unapplied is not None and self._unapplied[0].version == target:
            snapshot, state, path = self._unapplied
            return self._apply(snapshot, state, path, started, 0)
        chain = self._chain(target, manifest_sha256)
        head = chain[-1]
        found: dict[str, int] | None = None  # the last delta checksums what it applies
        with tempfile.TemporaryDirectory(prefix="rollstream-follow-") as scratch:
            if chain[0].kind == "adapter":
                state, found = self._load_adapter(target, chain, Path(scratch))
                deltas, path = [], "adapter"
            elif head.kind == "base":
                state = self._load_stored(target, head, Path(scratch))
                deltas, path = chain[-2::-1], "base"
            else:
                state, deltas, path = self._unique, chain[::-1], "delta"
        for manifest in deltas:
            if fmt.specs_of(state) != manifest.tensors:
                raise self._refuse(
                    target,
                    RefusalReason.BROKEN_CHAIN,
                    f"v{manifest.version} lists tensors that differ from its parent's",
                )
            changes = self._load_delta(target, manifest)
            if self.verify_state and manifest is deltas[-1]:
                state, found = fmt.apply_delta_checked(state, changes)
            else:
                state = fmt.apply_delta(state, changes)
        final = chain[0]
        if fmt.specs_of(state) != final.tensors or not set(final.aliases.values()) <= set(state):
            raise self._refuse(
                target, RefusalReason.CORRUPT, "rebuilt tensors differ from manifest"
            )
        if self.verify_state:
            found = fmt.state_checksums(state) if found is None else found
            if found != final.checksums:
                wrong = sorted(
                    k
                    for k in found.keys() | final.checksums.keys()
                    if found.get(k) != final.checksums.get(k)
                )
                raise self._refuse(
                    target,
                    RefusalReason.STATE_MISMATCH,
                    f"{len(wrong)} rebuilt tensor(s) differ from the writer's, e.g. {wrong[:3]}",
                )
            if fmt.digest_of_checksums(found) != final.state_sha256:
                raise self._refuse(
                    target, RefusalReason.STATE_MISMATCH, "state_sha256 disagrees with checksums"
                )
        snapshot = Snapshot(target, fmt.join_aliases(state, final.aliases), final)
        return self._apply(snapshot, state, path, started, len(chain))

    def _apply(
        self, snapshot: Snapshot, state: fmt.StateDict, path: str, started: float, fetched: int
    ) -> Snapshot:
        """Hand ``snapshot`` to the callback; hold it only once that has succeeded."""
        target = snapshot.version
        if self.on_version is not None:
            try:
                self.on_version(snapshot)
            except Exception as err:
                self._unapplied = (snapshot, state, path)
                self.metrics.callback_failures.labels(**self._labels).inc()
                log.warning(
                    "weights: on_version callback failed for v%d of run %s in %s; "
                    "keeping v%s and handing v%d over again",
                    target,
                    self.store.run,
                    self.store.region,
                    self.version,
                    target,
                    exc_info=True,
                )
                raise CallbackFailed(target, err) from err
        self._unapplied = None
        self._unique, self._snapshot = state, snapshot
        self.metrics.applied.labels(**self._labels, path=path).inc()
        self.metrics.version.labels(**self._labels).set(target)
        self.metrics.sync_seconds.labels(**self._labels).set(time.perf_counter() - started)
        log.info(
            "applied v%d of run %s in %s via %s (%d version(s) fetched)",
            target,
            self.store.run,
            self.store.region,
            path,
            fetched,
        )
        return snapshot

    def _chain(self, target: int, manifest_sha256: str | None) -> list[Manifest]:
        """Manifests from ``target`` back to the held version's child or to a base."""
        chain = [self._manifest(target, target, manifest_sha256, RefusalReason.NOT_FOUND)]
        held = self._snapshot
        if chain[0].kind == "adapter":  # one step from its base, or from a sibling we hold
            if held and held.manifest.kind != "delta" and held.manifest.base == chain[0].base:
                return chain
            base = self._manifest(chain[0].base, target, None, RefusalReason.MISSING_PARENT)
            if base.kind != "base":
                raise self._refuse(
                    target,
                    RefusalReason.BROKEN_CHAIN,
                    f"adapter v{target} names v{base.version}, a {base.kind}, as its base",
                )
            return [*chain, base]
        # Behind the target's base: the deltas we could apply do not lead there.
        jump = held is None or held.version < chain[0].base
        while chain[-1].kind == "delta":
            child = chain[-1]
            assert child.parent is not None
            if not jump and held is not None and child.parent == held.version:
                if child.base != held.manifest.base:
                    raise self._refuse(
                        target,
                        RefusalReason.BROKEN_CHAIN,
                        f"v{child.version} has base {child.base}, held v{held.version} has "
                        f"base {held.manifest.base}",
                    )
                return chain
            if held is not None and not jump and child.parent < held.version:
                raise self._refuse(
                    target,
                    RefusalReason.BROKEN_CHAIN,
                    f"v{child.version} skips the held v{held.version}",
                )
            parent = self._manifest(child.parent, target, None, RefusalReason.MISSING_PARENT)
            if parent.base != child.base or parent.kind == "adapter":
                raise self._refuse(
                    target,
                    RefusalReason.BROKEN_CHAIN,
                    f"v{child.version} has base {child.base}, its parent has {parent.base}",
                )
            chain.append(parent)
        return chain

    # --- fetching and verifying -------------------------------------------------------------

    def _refuse(self, target: int, reason: RefusalReason, message: str) -> VersionRefused:
        self.metrics.refusals.labels(**self._labels, reason=reason.value).inc()
        if reason is RefusalReason.NOT_FOUND:
            self._not_there_yet(target, message)
        else:
            log.warning(
                "weights: refused v%d of run %s in region %s: %s: %s; keeping v%s",
                target,
                self.store.run,
                self.store.region,
                reason.value,
                message,
                self.version,
            )
        return VersionRefused(target, reason, message)

    def _not_there_yet(self, target: int, message: str) -> None:
        """An announced version not in this region's store yet (its mirror has not copied
        it): normal for a while, so said once per version, then only at debug level."""
        first = self._waiting_for != target
        self._waiting_for = target
        log.log(
            logging.INFO if first else logging.DEBUG,
            "weights: waiting for v%d of run %s to reach region %s (%s); keeping v%s",
            target,
            self.store.run,
            self.store.region,
            message,
            self.version,
        )

    def _manifest(
        self, version: int, target: int, expected_sha: str | None, missing: RefusalReason
    ) -> Manifest:
        try:
            data = self.store.read_manifest(version)
        except ObjectMissing as err:
            raise self._refuse(target, missing, f"no manifest for v{version} ({err.uri})") from None
        except FormatError as err:
            raise self._refuse(target, err.reason, f"manifest of v{version}: {err}") from None
        if expected_sha is not None and sha256_hex(data) != expected_sha:
            raise self._refuse(
                target, RefusalReason.BAD_HASH, f"manifest of v{version} differs from announced"
            )
        try:
            manifest, canonical = parse_manifest(data)
            verify_signature(manifest, canonical, self.public_key)
        except FormatError as err:
            raise self._refuse(target, err.reason, f"manifest of v{version}: {err}") from None
        problem = chain_fields_problem(manifest, self.store.run, version)
        if problem:
            raise self._refuse(target, RefusalReason.BROKEN_CHAIN, f"v{version}: {problem}")
        return manifest

    def _fetch(
        self, target: int, manifest: Manifest, entry: FileEntry, dest: Path | None
    ) -> bytes | Path:
        """One data file, its size and sha256 checked against the manifest."""
        key = self.store.key(manifest.version, entry.name)
        try:
            check_file_entry(manifest.kind, entry, manifest.stored_tensors)
            data = self.store.download(key, dest, size=entry.bytes)
        except ObjectMissing as err:
            raise self._refuse(target, RefusalReason.MISSING_FILE, f"{err.uri} missing") from None
        except FormatError as err:
            raise self._refuse(target, err.reason, f"v{manifest.version}: {err}") from None
        size = data.stat().st_size if isinstance(data, Path) else len(data)
        if size != entry.bytes:
            raise self._refuse(
                target,
                RefusalReason.TRUNCATED,
                f"{self.store.uri(key)} has {size} bytes, manifest says {entry.bytes}",
            )
        digest = sha256_file(data) if isinstance(data, Path) else sha256_hex(data)
        if digest != entry.sha256:
            raise self._refuse(
                target,
                RefusalReason.BAD_HASH,
                f"{self.store.uri(key)} sha256 {digest[:12]}… "
                f"differs from manifest {entry.sha256[:12]}…",
            )
        return data

    def _load_stored(self, target: int, manifest: Manifest, scratch: Path) -> fmt.StateDict:
        """The tensors of a base's or an adapter's safetensors files, checked to be
        exactly the ones the manifest says they store."""
        what = f"{manifest.kind} v{manifest.version}"
        state: fmt.StateDict = {}
        for entry in manifest.files:
            path = self._fetch(target, manifest, entry, scratch / entry.name)
            assert isinstance(path, Path)
            try:
                state.update(safetensors.torch.load_file(path))
            except Exception as err:  # safetensors raises its own error types
                raise self._refuse(target, RefusalReason.CORRUPT, f"{what}: {err}") from None
            path.unlink()
        try:
            fmt.check_base(state, manifest.stored_tensors)
        except FormatError as err:
            raise self._refuse(target, err.reason, f"{what}: {err}") from None
        return state

    def _load_adapter(
        self, target: int, chain: list[Manifest], scratch: Path
    ) -> tuple[fmt.StateDict, dict[str, int] | None]:
        """An adapter's state: the held sibling's (or the fetched base's) tensors with the
        adapter's laid over them, and (when verifying) the checksums of that state."""
        adapter = chain[0]
        if len(chain) == 2:
            source = self._load_stored(target, chain[1], scratch)
            source_sums = fmt.state_checksums(source) if self.verify_state else None
        else:
            assert self._snapshot is not None
            source, source_sums = self._unique, self._snapshot.manifest.checksums
        overlay = self._load_stored(target, adapter, scratch)
        state = {**source, **overlay}
        if source_sums is None:
            return state, None
        return state, {**source_sums, **fmt.state_checksums(overlay)}

    def _load_delta(self, target: int, manifest: Manifest) -> dict[str, fmt.TensorDelta]:
        changes: dict[str, fmt.TensorDelta] = {}
        for entry in manifest.files:
            blob = self._fetch(target, manifest, entry, None)
            assert isinstance(blob, bytes)
            try:
                changes.update(fmt.decode_delta(blob, entry.raw_bytes, manifest.tensors))
            except FormatError as err:
                raise self._refuse(
                    target, err.reason, f"delta v{manifest.version}: {err}"
                ) from None
        return changes

    # --- retrying and following -------------------------------------------------------------

    def sync_with_retry(
        self,
        target: int | None = None,
        *,
        manifest_sha256: str | None = None,
        stop: threading.Event | None = None,
        max_attempts: int | None = None,
        give_up_after_s: float | None = None,
    ) -> Snapshot | None:
        """``sync`` until it succeeds, backing off exponentially (with jitter, at most
        ``retry_max_s`` apart) between attempts; gives up (re-raising the last error)
        after ``max_attempts`` or ``give_up_after_s``, or when ``stop`` is set."""
        policy = RetryConfig(initial_s=0.2, max_s=self.retry_max_s, give_up_after_s=give_up_after_s)
        attempts = retrying(
            policy,
            RETRYABLE,
            f"weights: sync of run {self.store.run} in {self.store.region}",
            stop_event=stop if stop is not None else threading.Event(),
            max_attempts=max_attempts,
        )
        for attempt in attempts:
            with attempt:
                return self.sync(target, manifest_sha256=manifest_sha256)
        return self._snapshot  # pragma: no cover - Retrying either returns or raises

    def follow(
        self,
        stop: threading.Event,
        *,
        listener: AnnouncementListener | None = None,
        poll_interval_s: float = 2.0,
    ) -> None:
        """Run until ``stop`` is set: react to announcements at once when a listener is
        given, and poll the store every ``poll_interval_s`` either way (an announcement
        can be lost, and a mirrored region may get the files after the announcement)."""
        next_poll = time.monotonic()  # poll the store once at start
        while not stop.is_set():
            wait = max(0.0, next_poll - time.monotonic())
            announcement = None
            if listener is not None:
                # Short waits so that ``stop`` is noticed within a fraction of a second.
                announcement = listener.next(timeout_s=min(wait, 0.5))
            elif stop.wait(wait):
                break
            target = sha = None
            if announcement is not None:
                if self.version is not None and announcement.version <= self.version:
                    continue
                target, sha = announcement.version, announcement.sha256
            elif time.monotonic() < next_poll:
                continue
            else:
                next_poll = time.monotonic() + poll_interval_s
            try:
                self.sync_with_retry(
                    target, manifest_sha256=sha, stop=stop, give_up_after_s=self.retry_max_s
                )
            except (WeightsError, BotoCoreError, ClientError) as err:
                log.warning(
                    "weights: still at v%s in %s after retries: %s",
                    self.version,
                    self.store.region,
                    err,
                )
            except Exception:  # a bug must not stop following; retried at the next poll
                log.exception("weights: sync failed at v%s", self.version)
