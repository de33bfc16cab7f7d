"""End to end with a real model: SmolLM2-135M under ``rollstream up`` on the session's real
Kafka broker and SeaweedFS store, one step of its agentic calculator task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.up_runs import assert_reconciles, run_command, run_up, scored_samples, write_config

from core.config import KafkaConfig, S3Config

pytestmark = pytest.mark.system

# A step of the language-model profile closes 5 s after its first group (async: never wait
# long for stragglers); on 2 CPU cores a SmolLM2 group takes longer than that to follow,
# so this run waits for whole steps, which is what its assertions count. A turn of 32 new
# tokens holds a calculator call or an answer line; the task's 96 would triple the run.
_SMOLLM2_SHORT_RUN = {
    "trainer": {"batch": {"max_wait_s": 300.0}},
    "producers": {"rollout": {"group_size": 4, "task_options": {"max_new_tokens": 32}}},
}


@pytest.mark.timeout(900)  # up's own 600 s, then its stop, come first
def test_smollm2_calculator_episodes_are_scored_trained_and_reconciled(
    kafka_config: KafkaConfig, s3_config: S3Config, tmp_path: Path
) -> None:
    """A real model under the language-model profile (``--model smollm2-135m``), one
    step of its agentic task: the step trains whole groups of scored episodes with
    exact old logits over policy tokens, its reward flags are those of the scored
    records it trained, and the audit reconciles. No learning is claimed: what the
    untrained model answers is luck (a group of 4 episodes may hold no ``Answer:`` line
    at all, and then no advantage and no weight moves); what SmolLM2 learns over a run is
    ``bench.real_model``'s measure. How scoring reads answers: unit/producers/test_tasks.py."""
    config = write_config(tmp_path, kafka_config, s3_config, "smol", _SMOLLM2_SHORT_RUN)
    args = ("--model", "smollm2-135m", "--task", "arithmetic-calculator",
            "--max-steps", "1", "--groups-per-step", "1")  # fmt: skip
    run = run_up(tmp_path, config, 600, *args)
    assert len(run.rows) == 1
    for row in run.rows:
        assert row["data/trajectories"] == 4 and row["data/exact_old_frac"] == 1.0
        assert "reward/correct_frac" in row and "episode/tool_calls_total" in row
        assert sum(v for k, v in row.items() if k.startswith("episode/end/")) == 4
    from consumers.checkpoint import TrainingLedger

    (step,) = TrainingLedger.read_steps(run.run_dir / "ledger.jsonl")
    trained = [s for s in scored_samples(run.run_dir) if s.trajectory_id in step.trajectory_ids]
    assert len(trained) == 4  # the step's group, as the ledger names it
    for flag in ("format_ok", "correct"):
        flags = [bool(s.reward_details[flag]) for s in trained]
        assert run.rows[0][f"reward/{flag}_frac"] == pytest.approx(sum(flags) / len(flags))
    assert_reconciles(run.run_dir, run.rows)
    # versions ship in bf16 whatever the trainer's precision: after v0, a small delta
    v0, *later = (json.loads(run_command(run.run_dir, "weights", "show", str(v))) for v in range(2))
    for manifest in (v0, *later):
        assert {t["dtype"] for t in manifest["tensors"].values()} == {"bfloat16"}
    base_bytes = sum(f["bytes"] for f in v0["files"])
    for manifest in later:
        assert manifest["kind"] == "delta", manifest["kind"]
        assert sum(f["bytes"] for f in manifest["files"]) < 0.1 * base_bytes
