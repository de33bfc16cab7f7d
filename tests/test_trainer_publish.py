"""Publishing from the trainer against the real S3 server: a claim whose answer was lost
is recognised as ours, a version held by other weights is refused, and a restarted
publisher never rewrites versions that already exist."""

from __future__ import annotations

import pytest
import torch

from consumers.config import PublishConfig
from consumers.weight_publisher import Publisher
from core.config import RetryConfig, S3Config
from core.models import build_tiny_llama
from weights.errors import VersionTaken
from weights.follower import WeightFollower
from weights.store import WeightStore
from weights.writer import DeltaWriter


def state(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in build_tiny_llama(seed=seed).state_dict().items()}


def publisher(store: WeightStore, **config: object) -> Publisher:
    return Publisher(DeltaWriter(store), PublishConfig(**config), RetryConfig(max_s=1.0))


def test_resume_publishes_version_zero_once_and_skips_existing_versions(
    s3_config: S3Config,
) -> None:
    store = WeightStore.from_config(s3_config, "pub")
    first = publisher(store)
    done = first.resume(0, lambda: state(0))
    assert done is not None and done.version == 0 and done.announcement.is_base
    assert first.due(1) and not first.due(0)
    first.publish(1, state(1))
    first.publish(2, state(2))
    # a trainer restarted from its step-1 checkpoint: v2 exists, so 2 is not due again
    restarted = publisher(store)
    assert restarted.resume(1, lambda: state(9)) is None
    assert not restarted.due(2) and restarted.due(3)
    assert restarted.publish(3, state(3)).announcement.is_base  # no previous state held
    assert store.versions() == [0, 1, 2, 3]
    snapshot = WeightFollower(store).sync(3)
    assert snapshot is not None
    for name, value in state(3).items():
        assert torch.equal(snapshot.state[name], value)


def test_a_lost_claim_answer_is_recognised_as_ours(s3_config: S3Config) -> None:
    store = WeightStore.from_config(s3_config, "lost")
    publisher(store).publish(4, state(4))  # the claim landed; the answer "was lost"
    retry = publisher(store)  # the retry runs on a writer that does not know it
    again = retry.publish(4, state(4))
    assert again.version == 4 and again.announcement.uri.endswith("manifest.json")
    with pytest.raises(VersionTaken):
        publisher(store).publish(4, state(5))  # other weights: not ours, refused
    assert store.versions() == [4]


def test_the_trainer_applies_the_retention_window_as_it_publishes(s3_config: S3Config) -> None:
    """Every ``gc_every`` versions the publisher keeps the newest ``keep_versions`` (and the
    chain they need) and deletes the rest, so a long run does not fill the store; a
    follower still rebuilds the newest version."""
    store = WeightStore.from_config(s3_config, "gc")
    pub = Publisher(
        DeltaWriter(store, base_every=4),
        PublishConfig(gc_every=3),
        RetryConfig(max_s=1.0),
        keep_versions=2,
        orphan_grace_s=0.0,
    )
    for version in range(9):
        pub.publish(version, state(version % 3))
    kept = store.versions()
    assert kept[-1] == 8 and 0 not in kept and len(kept) < 9
    assert {7, 8} <= set(kept)
    assert WeightFollower(store).sync(8) is not None
    # without a window (gc_every empty) nothing is deleted
    other = WeightStore.from_config(s3_config, "keep-all")
    keep_all = Publisher(
        DeltaWriter(other), PublishConfig(gc_every=None), RetryConfig(max_s=1.0), keep_versions=1
    )
    for version in range(4):
        keep_all.publish(version, state(version))
    assert other.versions() == [0, 1, 2, 3]
