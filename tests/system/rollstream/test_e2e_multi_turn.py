"""End to end, multi-turn: ``rollstream up`` runs the echo-digits environment's episodes
through engine, producer, stream worker and trainer on the session's real Kafka broker and
SeaweedFS store, with the policy as a LoRA adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.up_runs import (
    assert_reconciles,
    exported_dataset,
    run_command,
    run_up,
    write_config,
)

from core.config import KafkaConfig, S3Config

pytestmark = pytest.mark.system

# echo-digits: three policy turns, each echoing the digit the environment said last. What
# this run asserts is the multi-turn pipeline: whole episodes, environment tokens never
# trained, exact old logits over policy tokens, the audit. Reading the history takes
# longer than the suite affords (80 steps reached 0.17 of the digits right against 0.10
# for a policy that does not read it, the reward rising mostly from the format), so the
# learning assertion stays with the single-turn run of test_e2e_pipeline. The policy trains a LoRA
# adapter ([lora]): every version after the first is an adapter on it, through the whole
# pipeline (engine, old-logit service, trainer) and out again by ``rollstream export``.
ECHO_STEPS = 8


@pytest.mark.timeout(900)  # up's own 600 s, then its stop, come first
def test_multi_turn_echo_episodes_train_policy_tokens_only_and_reconcile(
    kafka_config: KafkaConfig, s3_config: S3Config, tmp_path: Path
) -> None:
    extra = {
        "producers": {"engine": {"seed": 5}, "rollout": {"seed": 5}},
        "lora": {"rank": 8, "alpha": 16.0},
    }
    config = write_config(tmp_path, kafka_config, s3_config, "echo", extra)
    run = run_up(tmp_path, config, 600, "--task", "echo-digits", "--max-steps", str(ECHO_STEPS))
    rows = run.rows
    assert len(rows) == ECHO_STEPS
    # episodes of three policy turns and two environment turns, every one ended by the
    # environment; exact old logits over policy tokens, engine and trainer agree
    assert all(row["episode/end/done"] == row["data/trajectories"] for row in rows)
    assert all(0.25 < row["episode/env_token_share"] < 0.6 for row in rows)
    assert all(row["data/exact_old_frac"] == 1.0 for row in rows)
    assert max(row["mismatch/k3_kl"] for row in rows) < 1e-6
    assert_reconciles(run.run_dir, rows)
    # the engine got the versions as named adapters (SGLang's dynamic LoRA API), the
    # requests naming them: the kept version directories are adapters
    engine_dirs = list(tmp_path.glob("state/producers/*/*/weights/v*"))
    assert engine_dirs and all(d.name.endswith("-adapter") for d in engine_dirs), engine_dirs
    # exported as chats: prompt, then the policy's and the environment's turns in turn,
    # only the policy's tokens marked as its own
    data = exported_dataset(run.run_dir, tmp_path / "dataset")
    assert len(data) == sum(row["data/trajectories"] for row in rows)
    for row in data:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
        assert 0 < sum(row["completion_mask"]) < len(row["completion_ids"])
    # versions: one base, then adapters on it of a few percent of its bytes
    show = [json.loads(run_command(run.run_dir, "weights", "show", str(v))) for v in (0, 1, 8)]
    assert [m["kind"] for m in show] == ["base", "adapter", "adapter"]
    base_bytes = sum(f["bytes"] for f in show[0]["files"])
    assert all(
        m["base"] == 0 and sum(f["bytes"] for f in m["files"]) < 0.1 * base_bytes for m in show[1:]
    )
    out = tmp_path / "exported"
    assert "adapter/adapter_model.safetensors" in run_command(
        run.run_dir, "export", "--out", str(out)
    )
