"""Retention: keep the newest versions and everything they need; delete the rest.

A delta is useless without its base and every delta between them, so the kept set is
the newest ``keep_versions`` usable versions *plus their whole parent chains*, down to
and including each one's base. Everything else among complete versions goes, oldest
first, manifest before files (a version stops existing before its files vanish).

Whoever can write the bucket can write manifests too, so only versions that verify as
the run's own count (``weights.trust``: signed with its key, naming its run and version,
and the same for every version down the chain). Unverified manifests never fill the
window, so a pile of forged versions above the head cannot push every genuine one out
of it; nothing newer than the newest usable version is deleted (a wrong key or a broken
chain leaves the store as it is); an unverified version below it is deleted with the
other old ones, and logged.

Files that no manifest lists (an upload that crashed before its claim, the loser of a
claim race that died before cleaning up) are deleted once older than a grace period,
so a writer that is uploading right now never loses its files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from weights.errors import FormatError, ObjectMissing
from weights.manifest import MANIFEST_NAME, Manifest
from weights.store import StoredObject, WeightStore
from weights.trust import Trust

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GcPlan:
    """What a collection keeps and deletes (versions ascending, orphan keys), and which
    versions did not verify as the run's own, with why (never counted as kept)."""

    keep: list[int]
    delete: list[int]
    orphans: list[str]
    unverified: dict[int, str] = field(default_factory=dict)


@dataclass
class _Chains:
    """Verified manifests of one store, read once each; ``refused`` says why not."""

    store: WeightStore
    trust: Trust
    manifests: dict[int, Manifest] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    def verified(self, version: int) -> Manifest | None:
        if version not in self.manifests and version not in self.refused:
            try:
                self.manifests[version] = self.trust.manifest(self.store, version)
            except (FormatError, ObjectMissing) as err:
                self.refused[version] = str(err)
        return self.manifests.get(version)

    def chain(self, version: int) -> list[int] | None:
        """``version`` and every version it needs, down to its base, if each verifies."""
        found: list[int] = []
        current: int | None = version
        while current is not None:  # a verified manifest's parent is below it
            manifest = self.verified(current)
            if manifest is None:
                return None
            found.append(current)
            current = manifest.parent  # a delta's parent, an adapter's base; None for a base
        return found


def plan_gc(
    store: WeightStore,
    keep_versions: int,
    orphan_grace_s: float,
    now: datetime | None = None,
    *,
    trust: Trust,
) -> GcPlan:
    """Decide without deleting: the newest ``keep_versions`` versions whose whole chain
    verifies with ``trust`` are kept with those chains (see the module doc)."""
    if keep_versions < 1:
        raise ValueError("keep_versions must be at least 1")
    objects = list(store.objects())
    complete = sorted({o.version for o in objects if o.name == MANIFEST_NAME})
    chains = _Chains(store, trust)

    window: list[int] = []
    needed: set[int] = set()
    for version in reversed(complete):
        if len(window) == keep_versions:
            break
        if (chain := chains.chain(version)) is not None:
            window.append(version)
            needed.update(chain)
    head = window[0] if window else -1
    keep = sorted(v for v in complete if v in needed)
    delete = [v for v in complete if v not in needed and v < head]
    unverified = {v: chains.refused[v] for v in complete if v in chains.refused}
    broken = [v for v in complete if v not in needed and v not in unverified and v > head]
    for version, why in unverified.items():
        action = "deleted with the old versions" if version < head else "left in place"
        log.warning("gc %s: v%d does not verify (%s): %s", store.region, version, why, action)
    if broken:
        log.warning("gc %s: %s need unverified versions: left in place", store.region, broken)
    if not window and complete:
        log.warning("gc %s: no version verifies as this run's: nothing deleted", store.region)

    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=orphan_grace_s)
    present = set(complete)
    orphans = [o.key for o in objects if _is_orphan(o, present, chains.manifests, keep, cutoff)]
    return GcPlan(keep=keep, delete=delete, orphans=orphans, unverified=unverified)


def _is_orphan(
    obj: StoredObject,
    complete: set[int],
    manifests: dict[int, Manifest],
    keep: list[int],
    cutoff: datetime,
) -> bool:
    if obj.name == MANIFEST_NAME or obj.last_modified > cutoff:
        return False
    if obj.version in keep:
        return obj.name not in {f.name for f in manifests[obj.version].files}
    # A version without a manifest: an unfinished or abandoned upload. (A deleted version's
    # files go with it; one left in place keeps them.)
    return obj.version not in complete


def collect_garbage(
    store: WeightStore,
    keep_versions: int,
    orphan_grace_s: float,
    dry_run: bool = False,
    *,
    trust: Trust,
) -> GcPlan:
    """Plan, then (unless ``dry_run``) delete old versions oldest first, then orphans."""
    plan = plan_gc(store, keep_versions, orphan_grace_s, trust=trust)
    if not dry_run:
        for version in plan.delete:
            store.delete_version(version)
        store.delete(plan.orphans)
        log.info(
            "gc %s: deleted %d version(s) and %d orphan file(s), kept %d",
            store.region,
            len(plan.delete),
            len(plan.orphans),
            len(plan.keep),
        )
    return plan
