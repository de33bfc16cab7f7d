"""End to end with a real model: SmolLM2-135M under ``rollstream up`` on the session's real
Kafka broker and SeaweedFS store, one step of its agentic calculator task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.up_runs import assert_reconciles, run_command, run_up, write_config

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
def test_smollm2_trains_calculator_episodes_and_reconciles(
    kafka_config: KafkaConfig, s3_config: S3Config, tmp_path: Path
) -> None:
    """A real model under the language-model profile (``--model smollm2-135m``), one
    step of its agentic task: the step trains whole groups of scored episodes with
    exact old logits over policy tokens, and the audit reconciles. What the untrained
    model answers is luck (a group of 4 episodes may hold no ``Answer:`` line at all), so
    what is asserted of the scoring is that every episode was scored: its flags reach the
    step's metrics. How scoring reads answers is tested in test_producers_tasks; what the model
    learns over a longer run is measured in the docs."""
    config = write_config(tmp_path, kafka_config, s3_config, "smol", _SMOLLM2_SHORT_RUN)
    args = ("--model", "smollm2-135m", "--task", "arithmetic-calculator",
            "--max-steps", "1", "--groups-per-step", "1")  # fmt: skip
    run = run_up(tmp_path, config, 600, *args)
    assert len(run.rows) == 1
    for row in run.rows:
        assert row["data/trajectories"] == 4 and row["data/exact_old_frac"] == 1.0
        assert "reward/correct_frac" in row and "episode/tool_calls_total" in row
        assert sum(v for k, v in row.items() if k.startswith("episode/end/")) == 4
        assert 0.0 <= row["reward/format_ok_frac"] <= 1.0
    assert_reconciles(run.run_dir, run.rows)
    # versions ship in bf16 whatever the trainer's precision: after v0, a small delta
    v0, *later = (json.loads(run_command(run.run_dir, "weights", "show", str(v))) for v in range(2))
    for manifest in (v0, *later):
        assert {t["dtype"] for t in manifest["tensors"].values()} == {"bfloat16"}
    base_bytes = sum(f["bytes"] for f in v0["files"])
    for manifest in later:
        assert manifest["kind"] == "delta", manifest["kind"]
        assert sum(f["bytes"] for f in manifest["files"]) < 0.1 * base_bytes
