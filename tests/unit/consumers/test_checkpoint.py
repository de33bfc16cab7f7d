"""Checkpoints carry the trainer state (offsets, ledger, EWMA) and become LATEST only when
complete; the training ledger repairs torn lines and is reconciled from a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
import torch
from pydantic import ValidationError
from support.synthetic import synthetic_groups

from consumers.checkpoint import (
    LATEST_NAME,
    CheckpointManager,
    LedgerStep,
    TrainerState,
    TrainingLedger,
    tag_for,
    tag_order,
)
from consumers.config import CheckpointConfig, TrainerConfig
from consumers.step import StepRunner
from consumers.train_engine import TrainEngine
from core.models import load_model


def build(config: TrainerConfig) -> tuple[TrainEngine, StepRunner]:
    engine = TrainEngine(
        load_model(config.model.spec),
        config.engine,
        frozen_copies=StepRunner.frozen_copies_needed(config),
    )
    return engine, StepRunner(engine, config, pad_id=0)


def test_save_load_round_trip_restores_weights_optimizer_and_state(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(
        {
            "engine": {"lr": 1e-3},
            "loss": {"type": "decoupled"},
            "checkpoint": {"dir": str(tmp_path / "ck"), "keep": 2},
        }
    )
    engine, runner = build(config)
    manager = CheckpointManager(config.checkpoint)
    assert manager.latest() is None
    records = [t for g in synthetic_groups(2, seed=1, status="missing") for t in g]
    ids = [t.trajectory_id for t in records]
    for step in (1, 2, 3):
        runner.train_step([records])
        state = TrainerState(
            step=step,
            offsets={("scored", 0): 10 * step, ("scored", 3): 5},
            ledger=[LedgerStep(step, ids, [ids[:4], ids[4:]], ids[:1])],
            runner=runner.state_dict(),
            last_published=step,
        )
        manager.save(engine, state)
    assert manager.latest() == (tag_for(3), 3)
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.is_dir())
    assert kept == [tag_for(2), tag_for(3)]  # keep = 2
    weights = {k: v.clone() for k, v in engine.state_dict().items()}
    # a fourth step trained but never checkpointed is forgotten on load
    fourth = runner.train_step([records])
    after_four = {k: v.clone() for k, v in engine.state_dict().items()}

    fresh_engine, fresh_runner = build(config)
    loaded = CheckpointManager(config.checkpoint).load(fresh_engine)
    assert loaded is not None and loaded.step == 3 and fresh_engine.global_steps == 3
    assert loaded.offsets == {("scored", 0): 30, ("scored", 3): 5}
    assert loaded.ledger == [LedgerStep(3, ids, [ids[:4], ids[4:]], ids[:1])]
    assert loaded.last_published == 3
    for name, value in fresh_engine.state_dict().items():
        assert torch.equal(value, weights[name]), name
    fresh_runner.load_state_dict(loaded.runner)
    ewma = fresh_runner.ewma
    assert ewma is not None and ewma.num_updates + ewma.num_resets == 3
    # optimiser moments and fp32 master weights came back: the same fourth step, bit for bit
    again = fresh_runner.train_step([records])
    assert again.metrics["loss/total"] == fourth.metrics["loss/total"]
    for name, value in fresh_engine.state_dict().items():
        assert torch.equal(value, after_four[name]), name


def test_a_torn_checkpoint_is_never_latest_and_gets_removed(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(
        {"engine": {"lr": 1e-3}, "checkpoint": {"dir": str(tmp_path)}}
    )
    engine, _runner = build(config)
    manager = CheckpointManager(config.checkpoint)
    manager.save(engine, TrainerState(step=4))
    torn = tmp_path / tag_for(8)  # what kill -9 during save_checkpoint leaves
    torn.mkdir()
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"half")
    assert manager.latest() == (tag_for(4), 4)
    assert orjson.loads((tmp_path / LATEST_NAME).read_bytes()) == {"tag": tag_for(4), "step": 4}
    state = manager.load(engine)
    assert state is not None and state.step == 4
    assert not torn.exists()


def test_a_second_checkpoint_of_the_same_step_never_overwrites_the_first(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(
        {"engine": {"lr": 1e-3}, "checkpoint": {"dir": str(tmp_path), "keep": 2}}
    )
    engine, _runner = build(config)
    manager = CheckpointManager(config.checkpoint)
    manager.save(engine, TrainerState(step=4, offsets={("scored", 0): 10}))
    # records set aside at a stop: the same step, offsets further on
    tag = manager.save(engine, TrainerState(step=4, offsets={("scored", 0): 13}))
    assert tag == tag_for(4, 1) == "step000000004-1"
    assert (tmp_path / tag_for(4)).exists()  # the durable one stays until the new is LATEST
    assert manager.save(engine, TrainerState(step=4)) == tag_for(4, 2)
    manager.save(engine, TrainerState(step=5, offsets={("scored", 0): 20}))
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert kept == [tag_for(4, 2), tag_for(5)]  # keep = 2, ordered by (step, revision)
    assert tag_order("step000000004-2") == (4, 2) and tag_order("step4") is None


def test_client_state_without_trainer_state_is_refused() -> None:
    with pytest.raises(ValueError, match="no rollstream trainer state"):
        TrainerState.from_client_state({"other": 1})


def test_ledger_appends_once_repairs_torn_lines_and_reconciles(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = TrainingLedger(path)
    assert ledger.last_step == 0
    assert ledger.append([(1, ["a", "b"]), (2, ["c"])]) == 2
    assert ledger.append([(2, ["c"]), (3, ["d"])]) == 1  # step 2 is already there
    with path.open("ab") as fh:
        fh.write(b'{"step": 4, "trajectory_ids": ["e"')  # kill -9 mid-write
    assert [s for s, _ in TrainingLedger.read(path)] == [1, 2, 3]
    reopened = TrainingLedger(path)
    assert reopened.last_step == 3
    # reconcile from a checkpoint that covers steps 4 and 5
    assert reopened.append([(4, ["e"]), (5, ["f"])]) == 2
    assert TrainingLedger.read(path) == [
        (1, ["a", "b"]),
        (2, ["c"]),
        (3, ["d"]),
        (4, ["e"]),
        (5, ["f"]),
    ]


def _cosine_with_warmup(step: int, peak: float, warmup: int, decay: int) -> float:
    """The rate after ``step`` optimiser steps, written out independently of transformers."""
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / (decay - warmup))  # held at the end
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_a_warmup_and_cosine_schedule_steps_per_optimiser_step_and_resumes_from_a_checkpoint(
    tmp_path: Path,
) -> None:
    peak, warmup, decay = 1e-3, 2, 6
    config = TrainerConfig.model_validate(
        {
            "engine": {
                "lr": peak,
                "lr_scheduler": "cosine",
                "warmup_steps": warmup,
                "decay_steps": decay,
            },
            "checkpoint": {"dir": str(tmp_path / "ck")},
        }
    )
    engine, runner = build(config)
    records = [t for g in synthetic_groups(2, seed=2, status="missing") for t in g]
    assert engine.lr() == 0.0  # warmup starts from nothing
    rates = []
    for step in (1, 2, 3):
        result = runner.train_step([records])
        rates.append(result.metrics["optim/lr"])
        state = TrainerState(step=step, offsets={}, ledger=[], runner=runner.state_dict())
        CheckpointManager(config.checkpoint).save(engine, state)
    expected = [_cosine_with_warmup(s, peak, warmup, decay) for s in (1, 2, 3)]
    assert rates == pytest.approx(expected, rel=1e-9)
    assert rates[1] == pytest.approx(peak)  # the peak right after warmup

    fresh, fresh_runner = build(config)  # a restart: the schedule goes on where it was
    CheckpointManager(config.checkpoint).load(fresh)
    assert fresh.lr() == pytest.approx(expected[-1], rel=1e-9)
    for step in (4, 5, 6, 7):
        rate = fresh_runner.train_step([records]).metrics["optim/lr"]
        assert rate == pytest.approx(_cosine_with_warmup(step, peak, warmup, decay), abs=1e-12)
    assert fresh.lr() == pytest.approx(0.0, abs=1e-12)  # decayed at decay_steps; stays


def test_a_step_reports_the_policys_entropy(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate({"checkpoint": {"dir": str(tmp_path / "ck")}})
    engine, runner = build(config)
    records = [t for g in synthetic_groups(2, seed=3, status="missing") for t in g]
    entropies = []
    for traj in records:  # under the weights the step starts from, written independently
        prompt, response = list(traj.prompt_ids), list(traj.response_ids)
        with torch.no_grad():
            logits = engine.module(input_ids=torch.tensor([prompt + response])).logits[0]
        at = logits.float()[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        entropies.append(torch.distributions.Categorical(logits=at).entropy())
    want = float(torch.cat(entropies).mean())
    got = runner.train_step([records]).metrics["policy/entropy"]
    assert got == pytest.approx(want, rel=1e-5)
    assert 0.0 < got <= math.log(16)


@pytest.mark.parametrize(
    ("engine", "error"),
    [
        ({"lr_scheduler": "cosine"}, "decays over decay_steps"),
        ({"lr_scheduler": "linear", "warmup_steps": 5, "decay_steps": 5}, "must exceed"),
        ({"lr_scheduler": "exponential"}, "lr_scheduler"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr_scheduler": "cosine", "decay_steps": "soon"}, "decay_steps"),
        ({"lr_scheduler": None}, "lr_scheduler"),
    ],
)
def test_a_bad_schedule_is_a_config_error_naming_it(engine: dict, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        TrainerConfig.model_validate({"engine": engine})


def test_a_constant_rate_without_warmup_adds_no_scheduler() -> None:
    """The default leaves DeepSpeed's optimiser as it was: checkpoints made before
    schedules existed still load."""
    engine, _ = build(TrainerConfig.model_validate({"engine": {"lr": 2e-4}}))
    assert engine.engine.lr_scheduler is None and engine.lr() == 2e-4


def _checkpoints(directory: Path) -> CheckpointConfig:
    return TrainerConfig.model_validate({"checkpoint": {"dir": str(directory)}}).checkpoint


@pytest.mark.parametrize(
    "marker",
    [
        b'{"tag": "../../elsewhere", "step": 4}',
        b'{"tag": "/etc", "step": 4}',
        b'{"tag": "step000000005", "step": 4}',
        b'{"tag": "step000000004", "step": "4"}',
        b'{"tag": 4, "step": 4}',
        b'{"step": 4}',
        b"[1, 2]",
        b"not json",
    ],
)
def test_a_latest_marker_that_names_no_checkpoint_of_its_step_is_refused(
    tmp_path: Path, marker: bytes
) -> None:
    """The tag becomes a path under the checkpoint directory: only a tag of its own step."""
    manager = CheckpointManager(_checkpoints(tmp_path))
    (tmp_path / LATEST_NAME).write_bytes(marker)
    with pytest.raises(ValueError, match="checkpoint"):
        manager.latest()


def test_a_latest_marker_of_a_revision_is_read(tmp_path: Path) -> None:
    manager = CheckpointManager(_checkpoints(tmp_path))
    (tmp_path / LATEST_NAME).write_bytes(orjson.dumps({"tag": tag_for(4, 1), "step": 4}))
    assert manager.latest() == (tag_for(4, 1), 4)
