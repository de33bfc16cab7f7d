"""Retention: keep the newest versions and everything they need; delete the rest.

A delta is useless without its base and every delta between them, so the kept set is
the newest ``keep_versions`` complete versions *plus their whole parent chains*, down to
and including each one's base. Everything else among complete versions goes, oldest
first, manifest before files (a version stops existing before its files vanish).

Files that no manifest lists (an upload that crashed before its claim, the loser of a
claim race that died before cleaning up) are deleted once older than a grace period,
so a writer that is uploading right now never loses its files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from weights.errors import ObjectMissing, WeightsError
from weights.manifest import MANIFEST_NAME, Manifest
from weights.store import StoredObject, WeightStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GcPlan:
    """What a collection keeps and deletes (versions ascending, orphan keys)."""

    keep: list[int]
    delete: list[int]
    orphans: list[str]


def plan_gc(
    store: WeightStore,
    keep_versions: int,
    orphan_grace_s: float,
    now: datetime | None = None,
) -> GcPlan:
    """Decide without deleting. Raises ``WeightsError`` if a kept version's chain cannot
    be read (better to keep everything than to guess)."""
    if keep_versions < 1:
        raise ValueError("keep_versions must be at least 1")
    objects = list(store.objects())
    complete = sorted({o.version for o in objects if o.name == MANIFEST_NAME})
    manifests: dict[int, Manifest] = {}

    def manifest(version: int) -> Manifest:
        if version not in manifests:
            manifests[version] = Manifest.from_bytes(store.read_manifest(version))
        return manifests[version]

    needed: set[int] = set()
    for version in complete[-keep_versions:]:
        current: int | None = version
        while current is not None and current not in needed:
            needed.add(current)
            try:
                found = manifest(current)
            except ObjectMissing:
                log.warning("gc: v%d is needed but missing: its chain is broken", current)
                break
            except WeightsError as err:
                raise WeightsError(f"gc: cannot read the chain of v{version}: {err}") from err
            current = found.parent  # a delta's parent, an adapter's base; None for a base
    keep = sorted(v for v in complete if v in needed)
    delete = [v for v in complete if v not in needed]

    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=orphan_grace_s)
    orphans = [o.key for o in objects if _is_orphan(o, set(delete), manifests, keep, cutoff)]
    return GcPlan(keep=keep, delete=delete, orphans=orphans)


def _is_orphan(
    obj: StoredObject,
    deleted: set[int],
    manifests: dict[int, Manifest],
    keep: list[int],
    cutoff: datetime,
) -> bool:
    if obj.name == MANIFEST_NAME or obj.version in deleted or obj.last_modified > cutoff:
        return False
    if obj.version in keep and obj.version in manifests:
        return obj.name not in {f.name for f in manifests[obj.version].files}
    # A version without a manifest: an unfinished or abandoned upload.
    return obj.version not in keep


def collect_garbage(
    store: WeightStore, keep_versions: int, orphan_grace_s: float, dry_run: bool = False
) -> GcPlan:
    """Plan, then (unless ``dry_run``) delete old versions oldest first, then orphans."""
    plan = plan_gc(store, keep_versions, orphan_grace_s)
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
