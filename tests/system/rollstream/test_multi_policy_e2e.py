"""End to end: a two-policy run (``propose-solve``) under ``rollstream up`` on the session's
real broker and S3 store. The proposer learns content (problems of its seed digit, against
a blind policy's one in ten); both rewards rise, the solver's by what its reward pays for
an answer's form (its exact answers are not asserted: see below), so the solver's part is
plumbing, not a learning claim; each trainer trains only its own policy's records, and
each policy's audit reconciles on its own topics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support.streams import read_topic
from support.up_runs import SEED_MIN_GAIN, seed_blind_bar

from core.config import KafkaConfig, S3Config, to_toml
from core.models import DIGIT0_ID
from schemas.group import decode_group

pytestmark = pytest.mark.system

# measured 2026-11-25 (2 shared cores, run alone): mean reward of steps 1-10 and 51-60,
# proposer 0.14 -> 0.43, solver 0.07 -> 0.41 (and 0.67, 0.69 at steps 91-100); in CI on
# 2026-11-27 the proposer went 0.13 -> 0.27: its reward counts the solver's score, which
# learns at its own pace, so its own skill below carries the stronger claim
STEPS = 60
MIN_GAIN = {"proposer": 0.07, "solver": 0.15}
POLICIES = ("proposer", "solver")
# the proposer's own skill, apart from the solver's score in its reward: problems of its
# seed digit (first 10 steps -> last 10), measured 2026-11-25 0.07 -> 0.85 and 0.08 -> 0.64
# in 60 steps (alone), in CI on 2026-11-26 0.06 -> 0.30, and on 2026-12-07 0.063 -> 0.198
# under the system tier's three workers on two cores (still rising: 0.23 in steps 56-60).
# The control: a proposer blind to its seed digit (``seed_blind_bar``).
# The solver's exact answers are not asserted: they went 0.005 -> 0.19 in one run and
# 0.004 -> 0.001 in the next (a solver stuck on a partial answer, as in the benchmark's
# stuck runs).
OWN_SKILL = {"proposer": ("reward/seeded_frac", SEED_MIN_GAIN)}


def _config(path: Path, kafka: KafkaConfig, s3: S3Config, run_id: str) -> Path:
    """A propose-solve run on the fixtures' services; the run id keeps its topics apart
    from other tests' (each policy's names get the policy on top)."""
    suffix = run_id.rsplit("-", 1)[-1]
    names = {
        name: f"rollouts.{name}-{suffix}" for name in ("raw", "scored", "stale", "dlq", "filtered")
    }
    data = {
        "run_id": run_id,
        "state_dir": str(path / "state"),
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "s3": s3.model_dump(mode="python"),
        "weights": {"topic": f"policy.versions-{suffix}"},
        "presence": {"topic": f"rollstream.roles-{suffix}"},
        "producers": {
            "rollout": {
                "topic": names["raw"],
                "curriculum": {"topic": f"prompts.stats-{suffix}"},
            }
        },
        "streams": {
            "topics": {
                **names,
                "prompt_stats": f"prompts.stats-{suffix}",
                "versions": f"policy.versions-{suffix}",
            }
        },
        "trainer": {
            "topics": {
                "scored": names["scored"],
                "dlq": names["dlq"],
                "stale": names["stale"],
                "versions": f"policy.versions-{suffix}",
            }
        },
        "policies": {
            "proposer": {
                "producers": {
                    "rollout": {
                        "task": "propose-solve",
                        "task_options": {"solver": "solver"},
                        "peers": ["solver"],
                    }
                }
            },
            "solver": {},
        },
    }
    config = path / "rollstream.toml"
    config.write_text(to_toml(data))
    return config


def _rollstream(config: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _rows(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(row[key] for row in rows) / len(rows)


def _trained_ids(ledger: Path) -> set[str]:
    """Trajectory ids the trainer's ledger says it trained."""
    ids: set[str] = set()
    for line in ledger.read_text().splitlines():
        entry = json.loads(line)
        ids.update(entry.get("trajectory_ids", ()))
    return ids


def test_the_proposer_learns_its_seed_and_no_trainer_trains_the_others_tokens(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name: Callable[[str], str], tmp_path
) -> None:
    run_id = unique_name("mp")
    config = _config(tmp_path, kafka_config, s3_config, run_id)
    run_dir = tmp_path / "run"
    up = _rollstream(
        config, "up", "--run-dir", str(run_dir), "--max-steps", str(STEPS), timeout_s=540
    )
    assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and set(summary["policies"]) == set(POLICIES)

    scored_samples: dict[str, list] = {}
    for policy in POLICIES:
        rows = _rows(run_dir / f"trainer.{policy}.jsonl")
        assert len(rows) >= STEPS - 5, (policy, len(rows))  # the first to finish ends the run
        first, last = _mean(rows[:10], "reward/mean"), _mean(rows[-10:], "reward/mean")
        assert last >= first + MIN_GAIN[policy], (policy, first, last)
        if policy in OWN_SKILL:  # its own skill, apart from the other policy's
            skill, min_gain = OWN_SKILL[policy]
            first, last = _mean(rows[:10], skill), _mean(rows[-10:], skill)
            bar = seed_blind_bar(sum(row["data/trajectories"] for row in rows[-10:]))
            print(f"{policy} {skill}: first 10 steps {first:.3f}, last 10 {last:.3f}")
            assert last >= first + min_gain, (policy, skill, first, last)
            assert last >= bar, (policy, skill, last, bar)
        assert all(row["data/exact_old_frac"] == 1.0 for row in rows)
        assert rows[-1]["data/dlq_total"] == 0
        # what this policy's trainer could read: only its own policy's records
        scored_topic = f"rollouts.scored-{run_id.rsplit('-', 1)[-1]}.{policy}"
        groups = [
            decode_group(msg.value())
            for msg in read_topic(kafka_config.client_config(), [scored_topic])
        ]
        samples = [s for g in groups for s in g.samples]
        assert samples and {s.policy for s in samples} == {policy}
        scored_samples[policy] = samples
        trained = _trained_ids(run_dir / f"ledger.{policy}.jsonl")
        assert trained and trained <= {s.trajectory_id for s in samples}

    # the solver's records are the solver's answers to the proposer's problems
    solver = scored_samples["solver"]
    assert all(s.group_id.endswith("-solver") for s in solver)
    assert {int(s.prompt_ids[1]) for s in solver} <= set(range(DIGIT0_ID, DIGIT0_ID + 10))
    proposer_ids = {s.trajectory_id for s in scored_samples["proposer"]}
    assert proposer_ids.isdisjoint(s.trajectory_id for s in solver)

    for policy in POLICIES:  # each policy's own audit: nothing lost, nothing twice
        audit = _rollstream(
            run_dir / "rollstream.toml", "--policy", policy, "audit", "--json", timeout_s=300
        )
        assert audit.returncode == 0, (audit.stdout + audit.stderr)[-3000:]
        figures = json.loads(audit.stdout)
        assert figures["problems"] == [] and figures["missing"] == 0
        assert figures["trained_twice"] == 0
