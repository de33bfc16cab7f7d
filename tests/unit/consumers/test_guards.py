"""The stability guards' pure logic (``consumers.guards``): config, signals, decisions,
rollback targets, the ledger's rollback lines, and the pause on the announcement path."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from support.synthetic import synthetic_groups

from consumers.checkpoint import LedgerStep, Rollback, TrainingLedger
from consumers.config import TrainerConfig
from consumers.guard_config import GuardsConfig
from consumers.guards import Guards, GuardState, Signals, Trip, measure, mismatch
from schemas.control import VersionAnnouncement
from schemas.trajectory import OldLogitsStatus

# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"entropy": {"floor": -0.1}}, "floor"),
        ({"entropy": {"floor": "low"}}, "floor"),
        ({"entropy": {"steps": 0}}, "steps"),
        ({"mismatch": {"bound": 0}}, "bound"),
        ({"mismatch": {"metric": "kl"}}, "metric"),
        ({"flat_rewards": {"steps": -1}}, "steps"),
        ({"flat_rewards": {"action": "explode"}}, "action"),
        ({"non_finite": {"enabled": "maybe"}}, "enabled"),
        ({"rollback": {"max": -1}}, "max"),
        ({"rollback": {"lr_factor": 0}}, "lr_factor"),
        ({"rollback": {"lr_factor": 2.0}}, "lr_factor"),
        ({"rollback": {"reseed": "sometimes"}}, "reseed"),
        ({"entropy": {"flor": 0.1}}, "flor"),
        ({"panic": {}}, "panic"),
    ],
)
def test_garbage_guard_settings_are_refused_naming_the_field(
    table: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        TrainerConfig.model_validate({"guards": table})


def test_by_default_only_the_non_finite_guard_acts_and_it_stops() -> None:
    config = GuardsConfig()
    assert list(config.enabled()) == ["non_finite"]
    assert config.non_finite.action == "stop" and not config.rolls_back()
    set_all = GuardsConfig.model_validate(
        {
            "entropy": {"floor": 0.1},
            "mismatch": {"bound": 0.5},
            "flat_rewards": {"steps": 3, "action": "rollback"},
            "non_finite": {"enabled": False},
        }
    )
    assert list(set_all.enabled()) == ["entropy", "mismatch", "flat_rewards"]
    assert set_all.rolls_back()


# --- signals ------------------------------------------------------------------------------


def test_measure_reads_entropy_mismatch_flat_groups_and_non_finite_norms() -> None:
    groups = synthetic_groups(3, group_size=4, seed=1, version=5)
    # group 0: every reward equal (flat); the others keep a spread
    groups[0] = [dataclasses.replace(t, reward=0.25) for t in groups[0]]
    # exact records with a known discrepancy x = logp_old - logp_infer = 0.1 everywhere
    shifted = [
        t.with_old_logits(t.logp_infer + np.float32(0.1), OldLogitsStatus.EXACT) for t in groups[1]
    ]
    groups[1] = shifted
    trajectories = [t for g in groups for t in g]
    signals = measure(trajectories, {"policy/entropy": 0.7, "grad/norm": 2.0})
    assert signals.entropy == 0.7
    assert signals.flat_frac == pytest.approx(1 / 3)
    assert not signals.non_finite and signals.oldest_version == 5
    n_shifted = sum(t.num_response_tokens for t in shifted)
    n_all = sum(t.num_response_tokens for t in trajectories)
    # groups 0 and 2 have logp_old == logp_infer (x = 0): they dilute the mean
    x = np.float64(np.float32(0.1))
    assert signals.mismatch == pytest.approx((math.expm1(x) - x) * n_shifted / n_all, rel=1e-3)
    assert mismatch(shifted, "abs_log_d") == pytest.approx(0.1, rel=1e-3)
    nan = measure(trajectories, {"grad/norm": 1.0, "grad/norm_max": float("nan")})
    assert nan.non_finite
    inf_reward = [dataclasses.replace(trajectories[0], reward=float("inf")), *trajectories[1:]]
    assert measure(inf_reward, {}).non_finite


def test_mismatch_is_not_measured_without_exact_old_logits() -> None:
    groups = synthetic_groups(2, seed=2, status=OldLogitsStatus.MISSING.value)
    signals = measure([t for g in groups for t in g], {})
    assert signals.mismatch is None and signals.entropy is None


def test_after_a_rollback_only_groups_of_newer_versions_are_judged() -> None:
    old = synthetic_groups(2, seed=3, version=4)
    old = [[dataclasses.replace(t, reward=0.0) for t in g] for g in old]  # flat, discarded
    new = synthetic_groups(2, seed=4, version=9)
    trajectories = [t for g in old + new for t in g]
    assert measure(trajectories, {}).flat_frac == 0.5
    judged = measure(trajectories, {}, since_version=9)
    assert judged.flat_frac == 0.0 and judged.oldest_version == 9
    nothing = measure([t for g in old for t in g], {}, since_version=9)
    assert nothing.flat_frac is None and nothing.oldest_version is None


# --- decisions ----------------------------------------------------------------------------


def flat(version: int = 0) -> Signals:
    return Signals(flat_frac=1.0, oldest_version=version)


def spread(version: int = 0) -> Signals:
    return Signals(flat_frac=0.5, oldest_version=version)


def guards(**tables: object) -> Guards:
    return Guards(GuardsConfig.model_validate(tables))


def test_a_guard_trips_after_its_consecutive_steps_and_unmeasured_steps_do_not_count() -> None:
    g = guards(flat_rewards={"steps": 3, "action": "warn"})
    assert g.observe(1, flat(0)).action is None
    assert g.observe(2, Signals()).action is None  # not measured: the streak holds
    assert g.observe(3, flat(2)).action is None
    decision = g.observe(4, flat(3))
    assert decision.action == "warn" and decision.main is not None
    assert decision.main.streak == 3 and decision.main.onset_version == 0
    assert "flat_rewards" in decision.main.reason() and "3 consecutive" in decision.main.reason()
    assert g.observe(5, spread(4)).action is None  # normal: the streak resets
    assert g.state.streaks["flat_rewards"] == 0
    assert g.observe(6, flat(5)).action is None


def test_each_signal_trips_its_own_guard() -> None:
    g = guards(entropy={"floor": 0.2}, mismatch={"bound": 0.01})
    assert g.observe(1, Signals(entropy=0.3, mismatch=0.005)).action is None
    low = g.observe(2, Signals(entropy=0.1, mismatch=0.005))
    assert [t.guard for t in low.trips] == ["entropy"] and "0.1 < floor 0.2" in low.trips[0].detail
    high = g.observe(3, Signals(entropy=0.3, mismatch=0.02))
    assert [t.guard for t in high.trips] == ["mismatch"]
    nan = g.observe(4, Signals(entropy=float("nan"), mismatch=0.0))  # NaN entropy is low
    assert {t.guard for t in nan.trips} == {"entropy"}
    stopped = g.observe(5, Signals(non_finite=True))
    assert stopped.action == "stop" and stopped.main is not None
    assert stopped.main.guard == "non_finite"


def test_the_strongest_action_wins() -> None:
    g = guards(
        entropy={"floor": 1.0, "action": "pause"},
        flat_rewards={"steps": 1, "action": "rollback"},
        mismatch={"bound": 0.1, "action": "warn"},
    )
    decision = g.observe(1, Signals(entropy=0.0, mismatch=1.0, flat_frac=1.0))
    assert decision.action == "rollback" and decision.paused
    assert decision.main is not None and decision.main.guard == "flat_rewards"
    assert g.observe(2, Signals(entropy=0.0, non_finite=True)).action == "stop"


def test_rollbacks_are_bounded_then_the_run_stops() -> None:
    g = guards(flat_rewards={"steps": 1, "action": "rollback"}, rollback={"max": 1})
    assert g.observe(1, flat()).action == "rollback"
    g.rolled_back(2, {}, 0)
    decision = g.observe(3, flat(2))
    assert decision.action == "stop" and decision.main is not None
    assert "rollback limit reached (1)" in decision.main.reason()
    assert (
        guards(flat_rewards={"steps": 1, "action": "rollback"}, rollback={"max": 0})
        .observe(1, flat())
        .action
        == "stop"
    )


def test_a_pause_holds_until_its_signal_is_measured_normal() -> None:
    g = guards(entropy={"floor": 0.5, "action": "pause"})
    assert g.observe(1, Signals(entropy=0.1)).paused
    reason = g.pause_reason()
    assert reason is not None and "entropy" in reason
    assert g.observe(2, Signals()).paused  # not measured: still paused
    assert not g.observe(3, Signals(entropy=0.9)).paused
    assert g.pause_reason() is None


def test_metrics_name_every_signal_and_the_tripped_guards() -> None:
    g = guards(flat_rewards={"steps": 2})
    signals = Signals(entropy=0.4, mismatch=0.01, flat_frac=1.0)
    first = g.metrics(signals, g.observe(1, signals))
    assert first == {
        "guards/entropy": 0.4,
        "guards/mismatch": 0.01,
        "guards/flat_frac": 1.0,
        "guards/flat_streak": 1.0,
        "guards/non_finite": 0.0,
        "guards/rollbacks": 0.0,
        "guards/paused": 0.0,
        "guards/flat_rewards/tripped": 0.0,
        "guards/non_finite/tripped": 0.0,
    }
    assert g.metrics(signals, g.observe(2, signals))["guards/flat_rewards/tripped"] == 1.0


def test_the_rollback_target_is_the_newest_healthy_checkpoint_before_the_onset() -> None:
    g = guards(flat_rewards={"steps": 2, "action": "rollback"}, rollback={"lr_factor": 0.5})
    steps = {"step000000010": 10, "step000000020": 20, "step000000030": 30}
    g.mark_checkpoint("step000000010", list(steps))
    g.mark_checkpoint("step000000020", list(steps))
    g.observe(29, flat(27))  # the streak starts: a checkpoint now is not healthy
    g.mark_checkpoint("step000000030", list(steps))
    assert g.state.healthy_tags == ["step000000010", "step000000020"]
    decision = g.observe(31, flat(28))
    trip = decision.main
    assert decision.action == "rollback" and trip is not None and trip.onset_version == 27
    assert g.rollback_target(trip, steps) == "step000000020"
    early = Trip("flat_rewards", "rollback", 31, 2, 20, "")  # data of v20 was bad already
    assert g.rollback_target(early, steps) == "step000000010"
    assert g.rollback_target(Trip("x", "rollback", 3, 1, 5, ""), steps) is None
    g.mark_checkpoint("step000000040", ["step000000020", "step000000030", "step000000040"])
    assert "step000000010" not in g.state.healthy_tags  # pruned off the disk: forgotten
    g.rolled_back(31, {**steps, "step000000025": 25}, 20)
    assert g.state.rollbacks == 1 and g.state.since_version == 31 and not g.state.streaks
    assert g.lr_factor() == 0.5 and g.seed_shift() == 1
    g.state.healthy_tags.append("step000000025")  # of the discarded steps (21..31)
    g.rolled_back(40, {**steps, "step000000025": 25}, 20)
    assert g.state.healthy_tags == ["step000000020"]
    assert g.lr_factor() == 0.25


def test_guard_state_survives_a_checkpoint_round_trip() -> None:
    state = GuardState(
        streaks={"flat_rewards": 2},
        onsets={"flat_rewards": 7, "entropy": None},
        rollbacks=1,
        since_version=12,
        healthy_tags=["step000000010"],
        paused={"entropy": "guard 'entropy' ..."},
    )
    assert GuardState.from_state(state.to_state()) == state
    assert GuardState.from_state(None) == GuardState() and GuardState().healthy()
    assert not state.healthy()


# --- the ledger ---------------------------------------------------------------------------


def test_rollback_lines_are_written_once_and_name_the_steps_they_discard(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = TrainingLedger(path, fsync=False)
    ledger.append([LedgerStep(s, [f"t{s}a", f"t{s}b"]) for s in range(1, 6)])
    rollback = Rollback(1, 5, 2, "step000000002", "flat_rewards", "guard 'flat_rewards' ...")
    assert ledger.append_rollbacks([rollback]) == 1
    assert ledger.append_rollbacks([rollback]) == 0  # a restart writes it again: once
    ledger.append([LedgerStep(6, ["t6a"])])
    reopened = TrainingLedger(path, fsync=False)
    assert reopened.last_step == 6 and reopened.append_rollbacks([rollback]) == 0
    assert TrainingLedger.read_rollbacks(path) == [rollback]
    assert [s.step for s in TrainingLedger.read_steps(path)] == [1, 2, 3, 4, 5, 6]
    assert TrainingLedger.rolled_back_steps(path) == {3, 4, 5}
    ids, wrong = TrainingLedger.rolled_back_ids(path)
    assert sorted(ids) == ["t3a", "t3b", "t4a", "t4b", "t5a", "t5b"] and wrong == []
    beyond = Rollback(2, 9, 6, "step000000006", "entropy", "")
    TrainingLedger(path, fsync=False).append_rollbacks([beyond])
    _ids, wrong = TrainingLedger.rolled_back_ids(path)
    assert wrong == ["rollback 2 of steps 7..9: the ledger lacks step 9"]


# --- the pause on the announcement path ---------------------------------------------------


def announcement(version: int = 3, **extra: object) -> VersionAnnouncement:
    return VersionAnnouncement(
        run="r",
        version=version,
        uri=f"s3://b/weights/r/v{version}/",
        parent=None,
        base=version,
        sha256="0" * 64,
        bytes=1,
        published_at_ms=1,
        groups_per_step=4,
        max_staleness=2,
        **extra,  # type: ignore[arg-type]
    )


def test_a_paused_announcement_round_trips_and_garbage_is_refused() -> None:
    paused = announcement(paused="guard 'entropy' tripped")
    assert VersionAnnouncement.from_json(paused.to_json()) == paused
    assert b"paused" not in announcement().to_json()  # older parsers read it unchanged
    assert b"paused" in paused.signed_bytes()  # a forged pause does not verify
    with pytest.raises(ValueError, match="paused"):
        announcement(paused=7)
    with pytest.raises(ValueError, match="paused is longer"):
        announcement(paused="x" * 501)


def test_an_unsigned_pause_is_ignored_where_versions_are_signed() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from weights.trust import Trust

    trust = Trust(Ed25519PrivateKey.generate().public_key())
    assert trust.vouched(announcement(paused="forged")).paused is None


def test_producers_start_no_group_while_the_trainer_announces_a_pause() -> None:
    from support.fake_engine import FakeBackend, fake_worker

    worker = fake_worker(FakeBackend())
    worker.trainer.announcement = lambda: announcement(0, paused="guard 'entropy' tripped")
    why = worker.admission.pause_reason()
    assert why is not None and "the trainer paused generation at v0: guard 'entropy'" in why
    worker.trainer.announcement = lambda: announcement(0)
    assert worker.admission.pause_reason() is None
    ignoring = fake_worker(FakeBackend(), ignore_trainer_pause=True)  # a person resumes
    ignoring.trainer.announcement = lambda: announcement(0, paused="guard 'entropy' tripped")
    assert ignoring.admission.pause_reason() is None
