"""Snapshot store and exact old logits, in process (no Kafka); S3 rebuilds on real SeaweedFS."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from support.streams import rollout

from core.config import S3Config
from core.logprobs import PADDED_BATCH_ATOL
from core.models import build_tiny_llama
from schemas.group import SampleDiagnostics
from schemas.trajectory import Trajectory, TurnKind
from schemas.validation import ValidationLimits, validate
from streams.config import OldLogitsConfig
from streams.metrics import StreamMetrics
from streams.oldlogits import OldLogitEngine, Unit, plan_batches, segment_units
from streams.snapshots import (
    FollowerSource,
    InMemorySource,
    SeededSource,
    SnapshotStore,
    VersionUnavailable,
)
from weights.store import WeightStore
from weights.writer import DeltaWriter

torch.set_num_threads(1)

VERSIONS = (3, 4, 5)


@pytest.fixture(scope="module")
def states() -> dict[int, dict[str, torch.Tensor]]:
    return {v: build_tiny_llama(seed=100 + v).state_dict() for v in VERSIONS}


@pytest.fixture(scope="module")
def model():
    return build_tiny_llama(seed=0)


def engine_for(states, model, **config) -> tuple[OldLogitEngine, SnapshotStore, InMemorySource]:
    source = InMemorySource(states)
    metrics = StreamMetrics()
    store = SnapshotStore(source, budget_bytes=1 << 30, metrics=metrics)
    engine = OldLogitEngine(OldLogitsConfig(**config), store, model=model, metrics=metrics)
    return engine, store, source


def direct(states, version, traj, start, end) -> np.ndarray:
    model = build_tiny_llama(seed=0)
    model.load_state_dict(states[version])
    ids = torch.tensor([[*traj.prompt_ids.tolist(), *traj.response_ids.tolist()]])
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
    p = traj.num_prompt_tokens
    return np.array(
        [logp[p + j - 1, traj.response_ids[j]].item() for j in range(start, end)], np.float32
    )


def test_each_segment_is_scored_under_its_own_version(states, model) -> None:
    trajs = [
        rollout(model, states, [1, 5, 6], [(3, 4)], seed=1, infer_noise=0.05),
        rollout(model, states, [1, 7], [(3, 3), (5, 4)], seed=2),  # two segments
        rollout(model, states, [1, 8, 9, 4], [(4, 5)], seed=3),
    ]
    engine, _, _ = engine_for(states, model)
    out = engine.attach(trajs)
    for traj, got in zip(trajs, out, strict=True):
        assert got.old_logits_status == "exact"
        start = 0
        for version, length in zip(traj.segment_versions, traj.segment_lengths, strict=True):
            want = direct(states, int(version), traj, start, start + int(length))
            np.testing.assert_allclose(
                got.logp_old[start : start + length], want, atol=PADDED_BATCH_ATOL
            )
            start += int(length)
    # The second segment really used version 5: version 3 scores it differently.
    two = trajs[1]
    under_3 = direct(states, 3, two, 3, 7)
    assert np.abs(out[1].logp_old[3:] - under_3).max() > 1e-3
    # Sampled at temperature 1 without noise: logp_old matches logp_infer.
    np.testing.assert_allclose(out[1].logp_old, two.logp_infer, atol=1e-5)


def test_a_batch_of_one_is_bit_exact_with_a_direct_pass(states, model) -> None:
    traj = rollout(model, states, [2, 3], [(4, 6)], seed=5)
    engine, _, _ = engine_for(states, model)
    (got,) = engine.attach([traj])
    assert got.logp_old.tobytes() == direct(states, 4, traj, 0, 6).tobytes()
    # The engine's own model, loaded on an explicit device, and the default (auto: the
    # CPU here) give the same values.
    for device in ("cpu", "auto"):
        own = OldLogitEngine(
            OldLogitsConfig(device=device), SnapshotStore(InMemorySource(states), budget_bytes=1)
        )
        (again,) = own.attach([traj])
        assert own.device == torch.device("cpu") and own.model.device == torch.device("cpu")
        assert again.logp_old.tobytes() == got.logp_old.tobytes()


def test_missing_version_marks_the_record_missing(states, model) -> None:
    partial = dict(states)
    del partial[4]
    engine, _, source = engine_for(partial, model)
    trajs = [
        rollout(model, states, [1], [(3, 2), (4, 2)], seed=1),
        rollout(model, states, [1], [(5, 3)], seed=2),
    ]
    first, second = engine.attach(trajs)
    assert first.old_logits_status == "missing" and first.logp_old is None
    assert second.old_logits_status == "exact"
    assert 4 in source.loads
    assert engine.metrics.value("rollstream_streams_snapshot_unavailable_total") == 1


def test_off_mode_computes_nothing(states, model) -> None:
    engine, _, source = engine_for(states, model, mode="off")
    (got,) = engine.attach([rollout(model, states, [1], [(3, 2)])])
    assert got.old_logits_status == "off" and got.logp_old is None and source.loads == []


def test_batch_limits_do_not_change_values_beyond_tolerance(states, model) -> None:
    trajs = [rollout(model, states, [1] * (i + 1), [(3, 3 + i)], seed=i) for i in range(6)]
    one, _, _ = engine_for(states, model, max_batch_sequences=1)
    many, _, _ = engine_for(states, model, max_batch_sequences=6)
    for a, b in zip(one.attach(trajs), many.attach(trajs), strict=True):
        np.testing.assert_allclose(a.logp_old, b.logp_old, atol=PADDED_BATCH_ATOL)
    assert many.metrics.value("rollstream_streams_oldlogit_tokens_total") == sum(
        len(t.response_ids) for t in trajs
    )


def test_plan_batches_respects_both_limits() -> None:
    class T:
        def __init__(self, p: int) -> None:
            self.num_prompt_tokens = p

    trajs = [T(2), T(2), T(10), T(2)]
    units = [Unit(i, 0, 0, 4) for i in range(4)]
    assert [len(b) for b in plan_batches(units, trajs, 2, 10_000)] == [2, 2]
    # widths 6, 6, 14, 6: rows x widest row must stay within the token limit
    assert [[u.row for u in b] for b in plan_batches(units, trajs, 8, 30)] == [[0, 1], [2, 3]]
    assert [[u.row for u in b] for b in plan_batches(units, trajs, 8, 20)] == [[0, 1], [2], [3]]
    assert [[u.row for u in b] for b in plan_batches(units, trajs, 8, 5)] == [[0], [1], [2], [3]]


def test_segment_units_cover_the_response(states, model) -> None:
    traj = rollout(model, states, [1], [(3, 2), (4, 1), (5, 3)])
    assert segment_units([traj]) == [Unit(0, 3, 0, 2), Unit(0, 4, 2, 3), Unit(0, 5, 3, 6)]


# --- snapshot store ---------------------------------------------------------------------


def nbytes(state) -> int:
    return sum(
        {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in state.values()}.values()
    )


def test_store_hits_misses_and_lru_eviction(states) -> None:
    one = nbytes(states[3])
    source = InMemorySource(states)
    store = SnapshotStore(source, budget_bytes=2 * one + 10)
    assert store.get(3) is not None and store.get(4) is not None
    assert store.get(3) is not None  # hit: 3 becomes most recent
    store.get(5)  # evicts 4, the least recently used
    assert store.versions == [3, 5] and store.bytes <= 2 * one + 10
    store.get(4)  # rebuilt on a miss
    assert source.loads == [3, 4, 5, 4]
    m = store.metrics
    assert m.value("rollstream_streams_snapshot_hits_total") == 1
    assert m.value("rollstream_streams_snapshot_misses_total") == 4
    assert m.value("rollstream_streams_snapshot_rebuilds_total") == 4
    assert m.value("rollstream_streams_snapshot_evictions_total") == 2
    assert m.value("rollstream_streams_snapshot_bytes") == store.bytes


def test_a_version_over_budget_is_still_served(states) -> None:
    store = SnapshotStore(InMemorySource(states), budget_bytes=1)
    assert store.get(3) is not None and store.versions == [3]
    store.get(4)
    assert store.versions == [4]


def test_pushed_versions_hit_and_shared_tensors_count_once(states) -> None:
    store = SnapshotStore(None, budget_bytes=1 << 30)
    base = states[3]
    child = dict(base)
    child["model.norm.weight"] = base["model.norm.weight"] + 1  # a delta touching one tensor
    store.put(3, base)
    store.put(4, child)
    assert store.bytes == nbytes(base) + child["model.norm.weight"].nbytes
    assert store.get(4) is not None and store.get(6) is None  # no source: unavailable
    assert store.retain(4) == [3] and store.versions == [4]


def test_store_converts_dtype_and_keeps_ties(states) -> None:
    store = SnapshotStore(None, budget_bytes=1 << 30, dtype=torch.bfloat16)
    held = store.put(3, states[3])
    assert held["lm_head.weight"] is held["model.embed_tokens.weight"]
    assert held["lm_head.weight"].dtype == torch.bfloat16


def test_seeded_source_is_deterministic() -> None:
    source = SeededSource("tiny:hidden_size=32,seed=2", seed_base=5)  # seed 2 + 5 + v
    a, b = source.load(2), source.load(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(
        a["model.embed_tokens.weight"],
        build_tiny_llama(seed=9, hidden_size=32).state_dict()["model.embed_tokens.weight"],
    )
    with pytest.raises(VersionUnavailable):
        source.load(-1)
    with pytest.raises(ValueError, match="tiny models only"):
        SeededSource("smollm2-135m-instruct")


@pytest.mark.system
def test_follower_source_rebuilds_versions_from_s3(s3_config: S3Config) -> None:
    store = WeightStore.from_config(s3_config, "run-snap")
    writer = DeltaWriter(store, base_every=10)
    published = {}
    model = build_tiny_llama(seed=0)
    for version in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01 * (torch.rand_like(p) < 0.05))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        writer.publish(state, version)
        published[version] = state
    source = FollowerSource(store, max_attempts=1, timeout_s=10)
    snapshots = SnapshotStore(source, budget_bytes=1 << 30)
    for version in (2, 0, 3):  # out of order: each rebuilt from the base + deltas
        got = snapshots.get(version)
        assert got is not None
        assert all(torch.equal(got[k], published[version][k]) for k in published[version])
    with pytest.raises(VersionUnavailable):
        source.load(9)
    assert snapshots.get(9) is None


def multi_turn_rollout(model, states) -> Trajectory:
    """A 5-turn episode of 14 tokens (policy 3 / env 2 / policy 5 / env 2 / policy 2; the
    first 9 at v3, the rest at v4): policy tokens sampled under their versions, the
    environment's written over with tool output the policy never sampled, and 0.0
    log-probs at env positions."""
    traj = rollout(model, states, [1, 5, 6], [(3, 9), (4, 5)], seed=11)
    kinds = [TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY]
    lengths = [3, 2, 5, 2, 2]
    env = np.repeat(np.array(kinds) == TurnKind.ENV, lengths)
    response = traj.response_ids.copy()
    response[env] = [10, 11, 12, 13]  # "tool output"
    logp_infer = traj.logp_infer.copy()
    logp_infer[env] = 0.0
    return dataclasses.replace(
        traj,
        response_ids=response,
        logp_infer=logp_infer,
        turn_lengths=np.array(lengths, np.int32),
        turn_kinds=np.array(kinds, np.uint8),
        tool_calls=2,
        episode_end="done",
    )


def plain_transformers_logprobs(states, version: int, traj: Trajectory) -> np.ndarray:
    """Log-probs of every response token under ``version``: one forward pass of
    prompt + response, log_softmax, gather (no rollstream code on the path)."""
    model = build_tiny_llama(seed=0)
    model.load_state_dict(states[version])
    ids = torch.tensor([[*traj.prompt_ids.tolist(), *traj.response_ids.tolist()]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()[0]
    p = traj.num_prompt_tokens
    logp = torch.log_softmax(logits[p - 1 : -1], dim=-1)
    targets = torch.tensor(traj.response_ids.tolist())
    return logp.gather(1, targets[:, None])[:, 0].numpy()


def test_a_multi_turn_episode_gets_exact_logp_old_at_policy_tokens(states, model) -> None:
    traj = multi_turn_rollout(model, states)
    assert validate(traj, ValidationLimits()) == []
    engine, _, _ = engine_for(states, model)
    (got,) = engine.attach([traj])
    assert got.old_logits_status == "exact"
    assert validate(got, ValidationLimits()) == []
    mask = traj.loss_mask
    # Environment positions: exactly +0.0, bit for bit.
    assert got.logp_old[~mask].view(np.uint32).tolist() == [0] * int((~mask).sum())
    # Policy positions: each token under the version of its segment (the env turn at 3..5
    # belongs to segment 0, v3; segment 1, v4, starts at policy token 9, mid-turn).
    versions = traj.token_versions()
    for version in (3, 4):
        want = plain_transformers_logprobs(states, version, traj)
        at = mask & (versions == version)
        assert at.any()
        np.testing.assert_allclose(got.logp_old[at], want[at], atol=PADDED_BATCH_ATOL)
    # The first policy turn came before any tool output: it matches what was sampled.
    np.testing.assert_allclose(got.logp_old[:3], traj.logp_infer[:3], atol=1e-5)
    # The per-sample diagnostics count policy tokens only.
    x = got.logp_old[mask].astype(np.float64) - traj.logp_infer[mask]
    diag = SampleDiagnostics.of(got, staleness=0)
    np.testing.assert_allclose(diag.k3_kl, np.mean(np.expm1(x) - x), rtol=1e-9)
    assert diag.d_min == np.exp(x).min() and diag.d_max == np.exp(x).max()


def test_diagnostics_ignore_env_tokens(states, model) -> None:
    """A discrepancy planted at policy tokens shows undiluted by the env tokens."""
    traj = multi_turn_rollout(model, states)
    mask = traj.loss_mask
    logp_old = traj.logp_infer.copy()
    logp_old[mask] += np.float32(0.1)
    diag = SampleDiagnostics.of(traj.with_old_logits(logp_old), staleness=0)
    np.testing.assert_allclose([diag.d_min, diag.d_max, diag.d_mean], [np.exp(0.1)] * 3, rtol=1e-5)
    np.testing.assert_allclose(diag.k3_kl, np.expm1(0.1) - 0.1, rtol=1e-4)
