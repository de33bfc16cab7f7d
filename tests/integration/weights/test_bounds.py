"""Sizes a reader of the weight store never trusts: a delta whose manifest declares more
decoded bytes than its tensors could need (a zstd bomb), a manifest of any size, a data
file bigger than its manifest says. Each is refused before the memory is spent, with a
clear error, and the follower keeps the version it had (real SeaweedFS)."""

from __future__ import annotations

import hashlib
import resource
import time

import orjson
import pytest
import zstandard
from support.weight_states import UNSIGNED, overwrite, publish_chain, store_for

from core.config import S3Config
from weights import format as fmt
from weights.errors import FormatError, RefusalReason, VersionRefused
from weights.manifest import MAX_MANIFEST_BYTES, TensorSpec
from weights.mirror import mirror_once
from weights.store import WeightStore
from weights.writer import DeltaWriter

GIB = 1 << 30


def bomb(declared: int) -> bytes:
    """A small zstd frame of zeros that declares ``declared`` decoded bytes."""
    return zstandard.ZstdCompressor(level=19).compress(bytes(declared))


@pytest.fixture(scope="module")
def gib_bomb() -> bytes:
    return bomb(GIB)  # ~32 KB on the wire


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_decode_delta_refuses_a_bomb_before_decompressing(gib_bomb: bytes) -> None:
    specs = {"w": TensorSpec("float32", (64, 48))}
    assert len(gib_bomb) < 64 * 1024
    began, peak = time.thread_time(), _peak_rss_mib()  # CPU time: waiting for a core is not work
    with pytest.raises(FormatError, match=r"raw_bytes 1073741824 .*at most \d+") as err:
        fmt.decode_delta(gib_bomb, GIB, specs)
    assert err.value.reason is RefusalReason.CORRUPT
    assert time.thread_time() - began < 0.5
    assert _peak_rss_mib() - peak < 256  # nothing near 1 GiB was allocated
    # A real delta of those tensors stays within the bound, whatever its density.
    import torch

    old, new = {"w": torch.zeros(64, 48)}, {"w": torch.randn(64, 48)}
    real = fmt.encode_delta(old, new)
    assert real.raw_bytes <= fmt.max_delta_raw_bytes(specs)
    assert fmt.decode_delta(real.blob, real.raw_bytes, specs).keys() == {"w"}


@pytest.fixture()
def published(s3_config: S3Config):
    """v0 base and v1, v2 deltas; a follower holding v1."""
    from weights.follower import WeightFollower

    store = store_for(s3_config)
    publish_chain(DeltaWriter(store, base_every=10), 3)
    follower = WeightFollower(store_for(s3_config, store.run))
    follower.sync(1)
    return store, follower


def _forge_file(store: WeightStore, version: int, body: bytes, **entry_fields: int) -> None:
    """Replace ``version``'s data file and fix its manifest's size and hash to match."""
    manifest = orjson.loads(store.read_manifest(version))
    entry = manifest["files"][0]
    entry.update(bytes=len(body), sha256=hashlib.sha256(body).hexdigest(), **entry_fields)
    overwrite(store, store.key(version, entry["name"]), body)
    overwrite(store, store.manifest_key(version), orjson.dumps(manifest))


def _refused(follower, target: int) -> VersionRefused:
    held = follower.snapshot
    with pytest.raises(VersionRefused) as err:
        follower.sync(target)
    assert follower.snapshot is held and follower.version == 1  # the old version is kept
    return err.value


def test_follower_refuses_a_bomb_delta_and_keeps_its_version(published, gib_bomb) -> None:
    store, follower = published
    _forge_file(store, 2, gib_bomb, raw_bytes=GIB)
    began = time.monotonic()
    err = _refused(follower, 2)
    assert err.reason is RefusalReason.CORRUPT
    assert "raw_bytes 1073741824" in str(err)
    assert time.monotonic() - began < 5


def test_follower_refuses_an_oversize_manifest_and_keeps_its_version(published) -> None:
    store, follower = published
    manifest = orjson.loads(store.read_manifest(2))
    manifest["padding"] = "x" * (MAX_MANIFEST_BYTES + 1)
    overwrite(store, store.manifest_key(2), orjson.dumps(manifest))
    err = _refused(follower, 2)
    assert err.reason is RefusalReason.BAD_MANIFEST
    assert f"larger than {MAX_MANIFEST_BYTES} bytes" in str(err)
    # The mirror refuses it too, and copies nothing of it.
    other = WeightStore(store.client, store.bucket, store.run, prefix="mirror/")
    report = mirror_once(store, other, since=2, trust=UNSIGNED)
    assert 2 in report.failed and "larger than" in report.failed[2]
    assert other.versions() == []


def test_a_data_file_bigger_than_its_manifest_says_is_not_read_whole(published) -> None:
    store, follower = published
    manifest = orjson.loads(store.read_manifest(2))
    key = store.key(2, manifest["files"][0]["name"])
    overwrite(store, key, b"\0" * (4 << 20))  # 4 MiB where the manifest says a few KB
    declared = manifest["files"][0]["bytes"]
    got = store.download(key, size=declared)
    assert isinstance(got, bytes) and len(got) <= declared + 1
    err = _refused(follower, 2)
    assert err.reason is RefusalReason.TRUNCATED


def test_a_file_entry_beyond_what_the_tensors_allow_is_refused_before_fetching(
    published,
) -> None:
    store, follower = published
    manifest = orjson.loads(store.read_manifest(2))
    manifest["files"][0]["raw_bytes"] = 64 * GIB
    manifest["files"][0]["bytes"] = 63 * GIB  # never fetched: the entry itself is refused
    overwrite(store, store.manifest_key(2), orjson.dumps(manifest))
    err = _refused(follower, 2)
    assert err.reason is RefusalReason.CORRUPT and "raw_bytes" in str(err)
