"""Copy complete versions from one region's store to another's.

For S3 stores that do not replicate by themselves. A version is copied only once its
manifest exists at the source; its files are copied first, each checked against the
manifest's size and sha256 on the way (a corrupt source version is not propagated),
then the manifest bytes, unchanged (signatures stay valid), by the same conditional put
the writer uses. So a reader in the destination region never sees half a version, and
two mirrors running at once cannot disagree.

The manifest's signature (``Trust``) is checked before anything is copied: a forged
source version is never copied, so it cannot claim the destination's version number
ahead of the genuine one. Forged versions already in the destination do not count when
deciding where to resume.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from weights.errors import FormatError, ObjectMissing, VersionTaken, WeightsError
from weights.manifest import check_file_entry, sha256_hex
from weights.store import WeightStore, sha256_file
from weights.trust import Trust

log = logging.getLogger(__name__)


@dataclass
class MirrorReport:
    """Versions copied, already present (or copied by someone else), and refused."""

    copied: list[int] = field(default_factory=list)
    present: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    bytes: int = 0


def versions_to_copy(
    src: WeightStore, dst: WeightStore, since: int | None = None, *, trust: Trust
) -> list[int]:
    """Source versions the destination lacks.

    With ``since``: every missing version from ``since`` on. Without: versions newer
    than the destination's latest genuine one, or, for a destination with none,
    everything from the base of the source's latest genuine version (older versions
    are of no use to a reader).
    """
    have = set(dst.versions())
    available = src.versions()
    if since is None:
        if (dst_latest := trust.latest(dst)) is not None:
            since = dst_latest + 1
        elif (src_latest := trust.latest(src)) is not None:
            since = trust.manifest(src, src_latest).base
        else:
            return []
    return [v for v in available if v >= since and v not in have]


def copy_version(src: WeightStore, dst: WeightStore, version: int, *, trust: Trust) -> int:
    """Copy one complete version, manifest last; returns the bytes copied.

    Raises ``FormatError``/``WeightsError`` for a source version that does not verify
    (its signature first: nothing is copied) and ``VersionTaken`` if the destination
    got the version meanwhile.
    """
    manifest_bytes = src.read_manifest(version)
    manifest = trust.check(manifest_bytes, src.run, version)
    copied = 0
    with tempfile.TemporaryDirectory(prefix="rollstream-mirror-") as scratch:
        for entry in manifest.files:
            check_file_entry(manifest.kind, entry, manifest.stored_tensors)
            big = entry.bytes >= src.transfer.multipart_threshold
            dest = Path(scratch) / entry.name if big else None
            data = src.download(src.key(version, entry.name), dest, size=entry.bytes)
            size = data.stat().st_size if isinstance(data, Path) else len(data)
            digest = sha256_file(data) if isinstance(data, Path) else sha256_hex(data)
            if size != entry.bytes or digest != entry.sha256:
                raise WeightsError(
                    f"v{version} file {entry.name} at {src.region} does not match its "
                    f"manifest ({size} bytes, sha256 {digest[:12]}…): not mirrored"
                )
            dst.upload(dst.key(version, entry.name), data)
            copied += size
    dst.claim(version, manifest_bytes)
    return copied + len(manifest_bytes)


def mirror_once(
    src: WeightStore, dst: WeightStore, since: int | None = None, *, trust: Trust
) -> MirrorReport:
    """Copy every version ``versions_to_copy`` selects, oldest first."""
    report = MirrorReport()
    for version in versions_to_copy(src, dst, since, trust=trust):
        try:
            copied = copy_version(src, dst, version, trust=trust)
        except VersionTaken:
            report.present.append(version)
            continue
        except (FormatError, ObjectMissing, WeightsError) as err:
            # Keep going: later versions may be usable (a later base certainly is).
            log.error("mirror %s -> %s: v%d skipped: %s", src.region, dst.region, version, err)
            report.failed[version] = str(err)
            continue
        report.copied.append(version)
        report.bytes += copied
        log.info("mirror %s -> %s: copied v%d (%d bytes)", src.region, dst.region, version, copied)
    return report


def mirror_forever(
    src: WeightStore,
    dst: WeightStore,
    stop: threading.Event,
    interval_s: float = 2.0,
    *,
    trust: Trust,
) -> None:
    """Run ``mirror_once`` every ``interval_s`` until ``stop`` is set; store errors are
    logged and retried at the next round."""
    while not stop.is_set():
        try:
            mirror_once(src, dst, trust=trust)
        except (BotoCoreError, ClientError, WeightsError) as err:
            log.warning("mirror %s -> %s: round failed: %s", src.region, dst.region, err)
        stop.wait(interval_s)
