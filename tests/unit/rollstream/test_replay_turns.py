"""Replay, inspect and ``--rerun train`` on multi-turn episodes, without a broker: the
renderer shows turns, the environment's tokens, per-turn versions, tool calls and why the
episode ended; the rerun's loss terms honour the loss mask."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from rich.console import Console
from support.synthetic import episode

from consumers.batching import pack, response_logprobs
from consumers.config import TrainerConfig
from consumers.loss_config import GrpoLossConfig
from consumers.losses import LossInputs, compute_loss
from core.models import build_tiny_llama
from rollstream.debug.render import Renderer, RenderOptions
from rollstream.debug.rerun import Policy, loss_terms
from schemas.group import SampleDiagnostics, ScoredGroup

TURNS = [(0, 3), (1, 2), (0, 2), (1, 1)]  # policy 3 / env 2 / policy 2 / env 1


def record():
    """Four turns over two versions: v3 covers the first policy turn, the env turn after
    it and the first token of the second policy turn; v4 the rest."""
    traj = episode(TURNS, end="tool_timeout", tools=2)
    return dataclasses.replace(
        traj,
        segment_versions=np.array([3, 4], np.int64),
        segment_lengths=np.array([6, 2], np.int32),
    )


def rendered(draw) -> str:
    console = Console(width=160, record=True, force_terminal=False)
    draw(Renderer(RenderOptions(tokenizer="tiny"), console))
    return console.export_text()


def test_a_trajectory_shows_its_turns_and_marks_env_tokens() -> None:
    text = rendered(lambda r: r.trajectory(record()))
    assert "turns 4  policy tokens 5/8  tool calls 2  episode_end tool_timeout" in text
    assert "P0 [0:3) v3  E1 [3:5) env  P2 [5:7) v3→v4  E3 [7:8) env" in text
    assert "turn 1 env" in text and "turn 2 policy" in text
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [row[1] for row in rows] == ["P0", "P0", "P0", "E1", "E1", "P2", "P2", "E3"]
    env_rows = [row for row in rows if row[1].startswith("E")]
    assert all("env" in row and row[-2:] == ["-", "-"] for row in env_rows)  # no log d, d
    policy_versions = [row[4] for row in rows if row[1].startswith("P")]
    assert policy_versions == ["3", "3", "3", "3", "4"]


def test_single_turn_records_render_as_before() -> None:
    single = episode([(0, 5)])
    text = rendered(lambda r: r.trajectory(single))
    assert "turns" not in text and "episode_end" not in text and "response " in text


def test_a_broken_turn_layout_still_renders() -> None:
    """A dead-lettered record may have turns that do not cover the response."""
    broken = dataclasses.replace(record(), turn_lengths=np.array([3, 2, 9, 1], np.int32))
    text = rendered(lambda r: r.trajectory(broken))
    assert "turns ?" in text


def test_a_scored_group_lists_turns_per_sample() -> None:
    samples = (record(), dataclasses.replace(episode([(0, 4)], index=1), advantage=-0.5))
    group = ScoredGroup(
        run_id="run",
        group_id="g",
        group_size=2,
        samples=samples,
        diagnostics=tuple(SampleDiagnostics.of(t, 0) for t in samples),
        reward_mean=1.0,
        reward_std=0.0,
        trainer_version_seen=4,
        complete=True,
        emitted_at_ms=0,
    )
    text = rendered(lambda r: r.group(group))
    assert "4 (2 tools, tool_timeout)" in text


def test_rerun_train_loss_terms_honour_the_loss_mask() -> None:
    """``--rerun train`` computes what the trainer computes: env tokens out of the loss."""
    model = build_tiny_llama(seed=0)
    trainer = TrainerConfig.model_validate({"loss": {"type": "grpo"}})
    records = [record(), dataclasses.replace(episode([(0, 6)], index=1), advantage=-1.0)]
    policy = Policy(model, None, pad_id=0, vocab_size=16, max_length=64, description="tiny")
    metrics = loss_terms(trainer, records, policy)
    assert metrics["tokens/response"] == 5 + 6 and metrics["tokens/env"] == 3

    batch = pack(records)
    with torch.no_grad():
        logp_new = response_logprobs(model, batch, pad_id=0)
    direct = compute_loss(
        GrpoLossConfig(),
        LossInputs(
            logp_new=logp_new,
            logp_infer=batch.logp_infer,
            advantages=batch.advantages,
            mask=batch.loss_mask,
        ),
    )
    assert metrics["loss/total"] == pytest.approx(direct.metrics["loss/total"], rel=1e-6)
    everything = compute_loss(
        GrpoLossConfig(),
        LossInputs(
            logp_new=logp_new,
            logp_infer=batch.logp_infer,
            advantages=batch.advantages,
            mask=batch.response_mask,
        ),
    )
    assert metrics["loss/total"] != pytest.approx(everything.metrics["loss/total"], rel=1e-6)
