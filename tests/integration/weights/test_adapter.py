"""Adapter versions (a LoRA run's) against a real SeaweedFS: after one base, each version
stores only the adapter's tensors, followers rebuild it on the base they hold, and every
way of damaging one is refused with the held version kept."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest
import torch
from support.weight_states import UNSIGNED, same_bits, store_for, tiny_state

from core.config import S3Config
from weights.errors import RefusalReason, VersionRefused
from weights.follower import WeightFollower
from weights.manifest import MANIFEST_NAME, Manifest, generate_keypair, load_private_key
from weights.mirror import mirror_once
from weights.retention import plan_gc
from weights.store import WeightStore
from weights.writer import DeltaWriter

ADAPTER = ("layers.0.attn.lora_A.weight", "layers.0.attn.lora_B.weight")


def lora_state(seed: int, base_seed: int = 0) -> dict[str, torch.Tensor]:
    """A frozen model (``tiny_state``) with a rank-4 adapter drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        **tiny_state(base_seed),
        ADAPTER[0]: torch.randn(4, 48, generator=gen),
        ADAPTER[1]: torch.randn(48, 4, generator=gen),
    }


def manifest(store: WeightStore, version: int) -> Manifest:
    return Manifest.from_bytes(store.read_manifest(version))


def publish(writer: DeltaWriter, seeds: range) -> list[dict[str, torch.Tensor]]:
    states = [lora_state(seed) for seed in seeds]
    for state in states:
        writer.publish(state)
    return states


def test_adapters_store_only_their_tensors_and_followers_share_the_base(
    s3_config: S3Config,
) -> None:
    store = store_for(s3_config)
    writer = DeltaWriter(store, base_every=2, adapter_tensors=ADAPTER)
    states = publish(writer, range(6))  # base_every does not apply to adapters

    found = [manifest(store, v) for v in range(6)]
    assert [m.kind for m in found] == ["base"] + ["adapter"] * 5
    assert all(m.parent == m.base == 0 and m.overlay == tuple(sorted(ADAPTER)) for m in found[1:])
    adapter_bytes = (4 * 48 + 48 * 4) * 4
    assert all(adapter_bytes <= m.total_bytes < 2 * adapter_bytes for m in found[1:])
    assert found[0].total_bytes > 10 * adapter_bytes

    follower = WeightFollower(store)
    snapshots = [follower.sync(v) for v in range(6)]
    for state, snapshot in zip(states, snapshots, strict=True):
        assert snapshot is not None and same_bits(snapshot.state, state)
    # six versions hold one copy of the frozen tensors: each snapshot shares the first's
    frozen = "layers.0.mlp.weight"
    pointers = {s.state[frozen].data_ptr() for s in snapshots if s is not None}
    assert len(pointers) == 1
    assert len({s.state[ADAPTER[0]].data_ptr() for s in snapshots if s is not None}) == 6

    # a newcomer goes straight to the newest: the base, then one adapter
    newcomer = WeightFollower(store).sync()
    assert newcomer is not None and newcomer.version == 5 and same_bits(newcomer.state, states[5])


def test_a_changed_frozen_tensor_makes_the_version_a_base(
    s3_config: S3Config, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_for(s3_config)
    writer = DeltaWriter(store, adapter_tensors=ADAPTER)
    publish(writer, range(2))
    moved = lora_state(2)
    moved["layers.0.norm.weight"] = moved["layers.0.norm.weight"] * 2
    with caplog.at_level(logging.WARNING, logger="weights.writer"):
        writer.publish(moved)
        writer.publish(lora_state(3) | {"layers.0.norm.weight": moved["layers.0.norm.weight"]})
    assert [manifest(store, v).kind for v in range(4)] == ["base", "adapter", "base", "adapter"]
    assert manifest(store, 3).base == 2
    assert "layers.0.norm.weight" in caplog.text
    snapshot = WeightFollower(store).sync()
    assert snapshot is not None and snapshot.state["layers.0.norm.weight"][0].item() == 2.0


def test_a_restarted_writer_puts_adapters_on_the_stored_base_only_if_it_is_its_own(
    s3_config: S3Config, tmp_path: Path
) -> None:
    generate_keypair(tmp_path / "key", tmp_path / "key.pub")
    generate_keypair(tmp_path / "other", tmp_path / "other.pub")
    key, other = load_private_key(tmp_path / "key"), load_private_key(tmp_path / "other")
    store = store_for(s3_config)
    publish(DeltaWriter(store, signing_key=key, adapter_tensors=ADAPTER), range(3))

    restarted = DeltaWriter(store, signing_key=key, adapter_tensors=ADAPTER)
    restarted.publish(lora_state(3))
    restarted.publish(lora_state(4))  # and keeps to it
    for version in (3, 4):
        assert manifest(store, version).kind == "adapter" and manifest(store, version).base == 0

    # another key's writer cannot vouch for the stored base, nor can one with other weights
    DeltaWriter(store, signing_key=other, adapter_tensors=ADAPTER).publish(lora_state(5))
    assert manifest(store, 5).kind == "base"
    DeltaWriter(store, signing_key=other, adapter_tensors=ADAPTER).publish(lora_state(6, 1))
    assert manifest(store, 6).kind == "base"


def test_retention_keeps_the_base_of_every_kept_adapter_and_the_mirror_copies_it(
    s3_config: S3Config,
) -> None:
    store = store_for(s3_config)
    publish(DeltaWriter(store, adapter_tensors=ADAPTER), range(6))
    plan = plan_gc(store, keep_versions=2, orphan_grace_s=0, trust=UNSIGNED)
    assert plan.keep == [0, 4, 5] and plan.delete == [1, 2, 3]

    replica = WeightStore.from_config(
        s3_config.model_copy(update={"prefix": "replica/", "name": "region-b"}), store.run
    )
    mirror_once(store, replica, trust=UNSIGNED)
    snapshot = WeightFollower(replica).sync()
    assert snapshot is not None and snapshot.version == 5
    assert same_bits(snapshot.state, lora_state(5))


# --- refusals: the follower keeps what it holds ------------------------------------------


@pytest.fixture()
def adapters(s3_config: S3Config) -> tuple[WeightStore, WeightFollower]:
    store = store_for(s3_config)
    publish(DeltaWriter(store, adapter_tensors=ADAPTER), range(3))
    follower = WeightFollower(store)
    assert follower.sync(1) is not None
    return store, follower


def rewrite_manifest(store: WeightStore, version: int, **changes: object) -> None:
    """An unsigned forgery: anyone with write access to the bucket can do it."""
    raw = orjson.loads(store.read_manifest(version))
    raw.update(changes)
    key = store.key(version, MANIFEST_NAME)
    store.client.put_object(Bucket=store.bucket, Key=key, Body=orjson.dumps(raw))


def refused(follower: WeightFollower, version: int) -> RefusalReason:
    with pytest.raises(VersionRefused) as caught:
        follower.sync(version)
    assert follower.version == 1
    return caught.value.reason


def test_refuses_an_adapter_file_that_is_not_the_manifests(adapters) -> None:
    store, follower = adapters
    key = store.key(2, manifest(store, 2).files[0].name)
    store.client.put_object(Bucket=store.bucket, Key=key, Body=b"not safetensors")
    assert refused(follower, 2) in (RefusalReason.TRUNCATED, RefusalReason.BAD_HASH)


def test_refuses_an_adapter_whose_overlay_lies_about_its_file(adapters) -> None:
    store, follower = adapters
    rewrite_manifest(store, 2, overlay=[ADAPTER[0]])
    assert refused(follower, 2) is RefusalReason.CORRUPT


def test_refuses_forged_tensors_of_the_base_in_an_adapter(adapters) -> None:
    store, follower = adapters
    checksums = orjson.loads(store.read_manifest(2))["checksums"]
    checksums["layers.0.mlp.weight"] ^= 1
    rewrite_manifest(store, 2, checksums=checksums)
    assert refused(follower, 2) is RefusalReason.STATE_MISMATCH


@pytest.mark.parametrize(
    "changes",
    [
        {"parent": 1},  # an adapter applies on its base
        {"parent": None},
        {"base": 2, "parent": 2},
        {"overlay": []},
        {"overlay": ["no.such.tensor"]},
        {"overlay": list(reversed(sorted(ADAPTER)))},
        {"overlay": "layers"},
        {"kind": "delta"},
    ],
)
def test_refuses_an_adapter_manifest_with_garbage_chain_fields(adapters, changes) -> None:
    store, follower = adapters
    rewrite_manifest(store, 2, **changes)
    assert refused(follower, 2) in (
        RefusalReason.BROKEN_CHAIN,
        RefusalReason.BAD_MANIFEST,
        RefusalReason.CORRUPT,
    )


def test_refuses_an_adapter_whose_base_is_missing_or_not_a_base(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    publish(DeltaWriter(store, adapter_tensors=ADAPTER), range(3))
    rewrite_manifest(store, 1, kind="delta", parent=0)  # v1 posing as v2's base
    rewrite_manifest(store, 2, base=1, parent=1)
    follower = WeightFollower(store)
    with pytest.raises(VersionRefused) as caught:
        follower.sync(2)
    assert caught.value.reason is RefusalReason.BROKEN_CHAIN
    store.client.delete_object(Bucket=store.bucket, Key=store.key(0, MANIFEST_NAME))
    rewrite_manifest(store, 2, base=0, parent=0)
    with pytest.raises(VersionRefused) as caught:
        follower.sync(2)
    assert caught.value.reason is RefusalReason.MISSING_PARENT
    assert follower.version is None


def test_a_base_or_delta_with_an_overlay_is_refused(s3_config: S3Config) -> None:
    store = store_for(s3_config)
    DeltaWriter(store).publish(tiny_state())
    rewrite_manifest(store, 0, overlay=["embed.weight"])
    with pytest.raises(VersionRefused) as caught:
        WeightFollower(store).sync(0)
    assert caught.value.reason is RefusalReason.BROKEN_CHAIN
