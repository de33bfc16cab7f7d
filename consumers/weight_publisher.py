"""Publishing policy versions from the trainer through ``weights``.

Version number = trainer step count (scored batches, not optimiser steps): the weights
after step ``n`` are version ``n`` (version 0 = the initial weights, published at start
when the store has none).

- **Outages.** The S3 part (``DeltaWriter.publish``: data file, then the manifest claim)
  and the announcement on ``policy.versions`` are retried separately with back-off, so an
  outage of one never re-runs the other. A claim that reached S3 but whose answer was
  lost comes back as ``VersionTaken`` on retry: if the stored manifest verifies as this
  run's (``weights.trust``: signature and chain fields) and its state digest is that of
  our weights, the version *is* ours and is announced; if it verifies but holds other
  weights, another writer owns the number and the error is raised. No scheduled version
  is skipped.
- **Forged claims.** A manifest on the trainer's next slot that does not verify was
  written by whoever could write the bucket, not by a writer of this run: it is never
  adopted. The publisher deletes it (logged, counted in ``forged_claims``) and claims
  the slot again, so version numbers stay the trainer's steps; after
  ``FORGED_CLAIM_ATTEMPTS`` rounds of it being put back the error is raised. With
  unsigned versions allowed only a malformed manifest fails verification.
- **Precision.** ``publish.dtype = "bfloat16"`` publishes the bf16 copy of fp32 master
  weights: every reader (engines, the old-logit service, followers in other regions) gets
  exactly those values, and a version's delta holds only the elements whose bf16 value moved.
- **Retention.** Every ``gc_every`` published versions the publisher applies the
  retention window (``weights.retention``: the newest ``keep_versions`` and the chains
  they need) to the store it writes to. A failed collection is logged and tried again
  next time: it never holds training up. Other regions' stores are collected where they
  are mirrored (``rollstream weights gc --region``).
- **Restarts.** After a crash the trainer resumes from its last checkpoint at step
  ``k``, but it may have published versions ``k+1..m`` before dying. Those versions stay
  what they are (generators and the old-logit service may already use them; the store
  never rewrites a version), so the restarted trainer does not publish again until its
  step passes ``m``; its first publish after a restart is a full base (the writer holds
  no previous state). Version numbers in the store stay gap-free with respect to the
  schedule and monotonic. Only genuine versions count (``weights.trust``): a forged
  manifest with a huge number, written by whoever could write the bucket, is ignored
  rather than stopping publication until the trainer reaches it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError
from confluent_kafka import KafkaException

from consumers.config import PublishConfig
from core.config import RetryConfig
from core.retry import retrying
from schemas.control import VersionAnnouncement
from weights import format as fmt
from weights.announce import Announcer
from weights.errors import FormatError, ObjectMissing, VersionTaken, WeightsError
from weights.retention import collect_garbage
from weights.trust import Trust
from weights.writer import DeltaWriter, PublishResult, announcement_of

log = logging.getLogger(__name__)

S3_ERRORS: tuple[type[BaseException], ...] = (BotoCoreError, ClientError, Boto3Error)
T = TypeVar("T")

FORGED_CLAIM_ATTEMPTS = 3
"""Claims of one version the publisher makes while forged manifests hold its slot (a
writer that puts one back each time it is deleted is attacking, not glitching)."""


@dataclass(frozen=True)
class Published:
    """One published version: its announcement and where the time went (seconds)."""

    version: int
    announcement: VersionAnnouncement
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)


class Publisher:
    """Decides when to publish and publishes with retries (see the module doc)."""

    def __init__(
        self,
        writer: DeltaWriter,
        config: PublishConfig,
        retry: RetryConfig,
        announcer: Announcer | None = None,
        keep_versions: int | None = None,
        orphan_grace_s: float = 3600.0,
        trust: Trust | None = None,
    ) -> None:
        self.keep_versions = keep_versions  # None: no retention here
        self.orphan_grace_s = orphan_grace_s
        self.published_count = 0
        self.forged_claims = 0  # forged manifests deleted off this publisher's slots
        self.writer = writer
        self.store = writer.store
        self.config = config
        self.retry = retry
        self.announcer = announcer
        # which stored versions are genuine; by default those signed by this writer's key
        signer = writer.signing_key
        self.trust = trust or Trust(None if signer is None else signer.public_key())
        self.skip_through = -1  # versions up to this one already exist in the store
        self.last: Published | None = None
        self.last_version: int | None = None

    def resume(
        self, step: int, state: Callable[[], Mapping[str, torch.Tensor]]
    ) -> Published | None:
        """Look at the store once at start: remember the newest genuine version (never
        republish it or anything before it) and publish ``step`` when there is none."""
        latest = self._s3(lambda: self.trust.latest(self.store), "list versions")
        if latest is not None:
            self.skip_through = latest
            self.last_version = latest
            if latest > step:
                log.warning(
                    "the store already holds versions up to %d (published before a crash); "
                    "resuming at step %d, the next publish will be after step %d",
                    latest,
                    step,
                    latest,
                )
            return None
        if not self.config.initial:
            return None
        return self.publish(step, state())

    def due(self, step: int) -> bool:
        every = self.config.every
        return every is not None and step % every == 0 and step > self.skip_through

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> Published:
        """Publish ``state`` (in ``config.dtype``) as ``version`` to S3, then announce it;
        retried on outages."""
        started = time.perf_counter()
        if self.config.dtype == "bfloat16":
            state = fmt.cast_state(state, torch.bfloat16)
        result: PublishResult | None = None
        announcement: VersionAnnouncement | None = None
        for _ in range(FORGED_CLAIM_ATTEMPTS):
            try:
                result = self._s3(
                    lambda: self.writer.publish(state, version), f"publish v{version}"
                )
                announcement = result.announcement
            except VersionTaken:
                announcement = self._ours_after_lost_answer(version, state)
            if announcement is not None:
                break
        if announcement is None:
            raise VersionTaken(self.store.run, version, self.store.manifest_key(version))
        if self.announcer is not None and self.config.announce:
            announcer = self.announcer
            for attempt in retrying(self.retry, (KafkaException,), f"announce v{version}"):
                with attempt:
                    announcer.announce(announcement)
        self.skip_through = version
        self.last_version = version
        self.last = Published(
            version=version,
            announcement=announcement,
            seconds=time.perf_counter() - started,
            timings=dict(result.timings) if result is not None else {},
        )
        log.info(
            "published v%d (%s, %d bytes) in %.3fs",
            version,
            "a base" if announcement.is_base else f"on v{announcement.parent}",
            announcement.bytes,
            self.last.seconds,
        )
        self.published_count += 1
        self._collect_if_due()
        return self.last

    def _collect_if_due(self) -> None:
        every = self.config.gc_every
        if self.keep_versions is None or every is None or self.published_count % every:
            return
        try:
            collect_garbage(self.store, self.keep_versions, self.orphan_grace_s, trust=self.trust)
        except (*S3_ERRORS, WeightsError) as err:  # retention waits; training does not
            log.warning("retention of %s failed, tried again later: %s", self.store.region, err)

    def _ours_after_lost_answer(
        self, version: int, state: Mapping[str, torch.Tensor]
    ) -> VersionAnnouncement | None:
        """After ``VersionTaken``: the announcement of the stored version if it verifies
        and holds our weights (a retried claim whose first answer was lost); None once a
        manifest that does not verify is deleted (claim again); else re-raise."""
        key = self.store.manifest_key(version)
        try:
            raw = self._s3(lambda: self.store.read_manifest(version), f"read manifest v{version}")
            manifest = self.trust.check(raw, self.store.run, version)
        except ObjectMissing:
            return None  # gone since the claim failed: claim again
        except FormatError as err:
            self.forged_claims += 1
            log.warning(
                "v%d is held by a manifest that does not verify as this run's (%s): "
                "deleting it and claiming v%d again",
                version,
                err,
                version,
            )
            self._s3(lambda: self.store.delete([key]), f"delete forged manifest v{version}")
            return None
        unique, _aliases = fmt.split_aliases({k: v.detach() for k, v in state.items()})
        if manifest.state_sha256 != fmt.state_digest(unique):
            raise VersionTaken(self.store.run, version, key)
        log.warning("v%d was already claimed by this trainer (a lost answer): keeping it", version)
        return announcement_of(self.store, key, manifest, raw)

    def _s3(self, fn: Callable[[], T], what: str) -> T:
        for attempt in retrying(self.retry, S3_ERRORS, what):
            with attempt:
                return fn()
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        if self.announcer is not None:
            self.announcer.close()
