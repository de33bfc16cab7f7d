"""Publishing from the trainer against the real S3 server: a claim whose answer was lost
is recognised as ours, a version held by other weights is refused, and a restarted
publisher never rewrites versions that already exist."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.streams import rollout
from support.weight_states import keypair

from consumers.config import PublishConfig
from consumers.weight_publisher import Publisher
from core.config import RetryConfig, S3Config
from core.logprobs import response_logprobs
from core.models import build_tiny_llama
from streams.config import OldLogitsConfig
from streams.oldlogits import OldLogitEngine
from streams.snapshots import FollowerSource, SnapshotStore
from weights import format as fmt
from weights.errors import VersionTaken
from weights.follower import WeightFollower
from weights.manifest import load_private_key, load_public_key, parse_manifest, sha256_hex
from weights.store import WeightStore
from weights.trust import Trust
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


def test_a_forged_claim_on_the_next_version_is_removed_never_adopted(
    s3_config: S3Config, tmp_path: Path
) -> None:
    """Whoever can write the bucket claims the trainer's next versions first: v1 with
    other weights, v2 with exactly the weights the trainer is about to publish (anyone who
    knows them can compute the state digest). Neither verifies, so neither is adopted:
    each is deleted, counted, and the trainer's own signed version takes the slot. One
    put back before every claim makes the publisher give up after a few rounds."""
    private, public = keypair(tmp_path)
    key = load_private_key(private)
    store = WeightStore.from_config(s3_config, "forged-claim")
    pub = Publisher(DeltaWriter(store, signing_key=key), PublishConfig(), RetryConfig(max_s=1.0))
    pub.publish(0, state(0))
    DeltaWriter(store).publish(state(7), 1)  # anonymous, other weights
    DeltaWriter(store).publish(state(2), 2)  # anonymous, the trainer's own next weights
    for version in (1, 2):
        assert pub.publish(version, state(version)).version == version
    assert pub.forged_claims == 2
    trust = Trust(load_public_key(public))
    for version in (0, 1, 2):
        announced = trust.manifest(store, version)  # signed by the trainer's key now
        assert announced.signature is not None
    assert pub.last is not None
    assert pub.last.announcement.sha256 == sha256_hex(store.read_manifest(2))
    follower = WeightFollower(store, public_key=trust.public_key)
    snapshot = follower.sync(2)
    assert snapshot is not None
    assert all(torch.equal(snapshot.state[k], v) for k, v in state(2).items())

    # a forger that puts its manifest back before every claim: bounded, then refused
    forger = WeightStore.from_config(s3_config, "forged-claim")
    pub.writer.before_claim = lambda version: DeltaWriter(forger).publish(state(9), version)
    with pytest.raises(VersionTaken):
        pub.publish(3, state(3))
    assert pub.forged_claims == 2 + 3


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


def adamw_steps(model: torch.nn.Module, steps: int, lr: float) -> None:
    """``steps`` AdamW steps of a next-token loss on fixed tokens, in fp32."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.arange(32).reshape(2, 16) % 13 + 3
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()


def test_bf16_versions_of_fp32_master_weights_are_small_and_scored_exactly(
    s3_config: S3Config,
) -> None:
    """``publish.dtype = "bfloat16"``: the trainer keeps fp32 master weights and ships their
    bf16 copy. Each version is exactly that copy (followers rebuild it bit for bit, tied
    tensors stay one tensor); after a small step few bf16 values move, so the version is a
    small delta where the fp32 lineage ships a base; a claim whose answer was lost
    is still recognised; and the stream's old logits are those of the shipped weights,
    computed in fp32, not of the master weights."""
    master = build_tiny_llama(seed=0)
    bf16_store = WeightStore.from_config(s3_config, "ship-bf16")
    fp32_store = WeightStore.from_config(s3_config, "ship-fp32")
    shipped = publisher(bf16_store, dtype="bfloat16")
    as_is = publisher(fp32_store)
    for version in range(2):
        if version:
            adamw_steps(master, 1, lr=1e-6)
        shipped.publish(version, master.state_dict())
        as_is.publish(version, master.state_dict())
    bf16_v1 = parse_manifest(bf16_store.read_manifest(1))[0]
    fp32_v1 = parse_manifest(fp32_store.read_manifest(1))[0]
    assert {spec.dtype for spec in bf16_v1.tensors.values()} == {"bfloat16"}
    assert bf16_v1.aliases == fp32_v1.aliases != {}  # tied embeddings stored once in both
    # every fp32 element moved: a base; a few % of the bf16 copy's (lr 1e-6 on this tiny
    # model moves about the share of bf16 values lr 1e-5 moves on SmolLM2-135M)
    assert fp32_v1.kind == "base" and bf16_v1.kind == "delta"
    assert bf16_v1.changed_elements < 0.1 * bf16_v1.total_elements
    assert bf16_v1.total_bytes < 0.1 * fp32_v1.total_bytes

    copy = fmt.cast_state(master.state_dict(), torch.bfloat16)
    snapshot = WeightFollower(bf16_store).sync(1)
    assert snapshot is not None
    assert all(torch.equal(snapshot.state[k], copy[k]) for k in copy)
    assert publisher(bf16_store, dtype="bfloat16").publish(1, master.state_dict()).version == 1

    # the stream scores version 1 in fp32: the shipped values, not the master's
    source = FollowerSource(bf16_store, max_attempts=1, timeout_s=10)
    engine = OldLogitEngine(
        OldLogitsConfig(dtype="float32"), SnapshotStore(source, budget_bytes=1 << 30)
    )
    prompt = [1, 5, 6, 7]
    traj = rollout(build_tiny_llama(seed=0), {1: copy}, prompt, [(1, 6)], seed=3)
    response = traj.response_ids.tolist()
    (scored,) = engine.attach([traj])
    assert scored.old_logits_status == "exact"
    upcast = build_tiny_llama(seed=0)
    upcast.load_state_dict(copy)  # bf16 values into the fp32 model: exact
    for name, value in upcast.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, copy[name].float())
    (want,) = response_logprobs(upcast, [(prompt, response)], torch.float32)
    (mine,) = response_logprobs(master, [(prompt, response)], torch.float32)
    assert np.asarray(scored.logp_old).tobytes() == np.asarray(want, np.float32).tobytes()
    assert not np.array_equal(np.asarray(want), np.asarray(mine))
