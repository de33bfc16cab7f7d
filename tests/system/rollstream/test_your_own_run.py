"""A practitioner's run, from one config file: a locally saved Hugging Face model with a
chat tokenizer, a conversational JSONL dataset with an eval split, two TRL-style reward
functions (one async, one that raises on some rows), warmup and cosine decay, TensorBoard
→ ``rollstream up`` on the real broker and store → the reward rises, the eval is reported
→ ``rollstream export`` → transformers loads the export and generates.

The task is the tiny one in chat form: the user says three digits, the assistant answers
the first digit twice (at most two tokens, as TRL's ``max_completion_length``). The model is
the tiny Llama at the chat vocabulary's size. In 40 steps it learns the answer's format
(two digits: the format reward ``two_digits`` goes from about 0.4 to 1.0), which a policy
blind to its prompt learns as well: this is a test of a practitioner's plumbing, not of
learning content. Which digits, the part that reads the prompt, takes longer and is
asserted by the tiny run of test_e2e_pipeline.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.paths import SUPPORT
from support.tracking import tensorboard_scalars
from support.up_runs import (
    UpRun,
    assert_reconciles,
    mean,
    role_env,
    run_up,
    scored_samples,
    write_config,
)

from core.config import KafkaConfig, S3Config
from producers.tasks.rewards import RewardSet
from rollstream.cli.starter import CHAT_VOCAB as VOCAB
from rollstream.cli.starter import save_chat_model
from rollstream.config.settings import load_config

pytestmark = pytest.mark.system

STEPS = 40
EVAL_EVERY = 20
SYSTEM_PROMPT = "copy the first digit twice"


def _rows(rng: random.Random, count: int, with_system: bool) -> list[dict]:
    rows = []
    for i in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        messages = [{"role": "user", "content": digits}]
        if with_system and i % 2:  # half bring their own system message
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        rows.append({"messages": messages, "answer": digits[0] * 2})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def chat_run(
    kafka_config: KafkaConfig, module_s3_config: S3Config, tmp_path_factory: pytest.TempPathFactory
) -> UpRun:
    path = tmp_path_factory.mktemp("chat-run")
    model = save_chat_model(path / "my-model", seed=3)
    rng = random.Random(5)
    extra = {
        "profile": {"name": "tiny", "model": str(model), "precision": "fp32"},
        "producers": {
            "engine": {"seed": 7},
            "rollout": {
                "task": "file",
                "seed": 7,
                "task_options": {
                    "path": _write_jsonl(path / "train.jsonl", _rows(rng, 300, True)),
                    "eval_path": _write_jsonl(path / "test.jsonl", _rows(rng, 12, False)),
                    "system_prompt": SYSTEM_PROMPT,
                    "order": "epochs",
                    "shuffle_seed": 1,
                    "max_new_tokens": 2,
                    "rewards": [
                        {"function": "trl_rewards:answer_digits", "weight": 2.0},
                        {"function": "trl_rewards:two_digits"},
                    ],
                },
            },
            "eval": {"every_versions": EVAL_EVERY},
        },
        "trainer": {
            "engine": {"lr_scheduler": "cosine", "warmup_steps": 5, "decay_steps": 2 * STEPS}
        },
        "tracking": {"backends": ["tensorboard"], "dir": str(path / "tracking")},
    }
    config = write_config(path, kafka_config, module_s3_config, "chat", extra)
    run_dir = path / "state" / "runs" / "chat"  # where `up` puts a run it names itself
    return run_up(path, config, 600, "--max-steps", str(STEPS), pythonpath=SUPPORT, run_dir=run_dir)


def _home(run: UpRun) -> Path:
    """The test's directory, holding the user's files: the run is <home>/state/runs/chat."""
    return run.run_dir.parents[2]


def test_the_answer_format_is_learned_under_warmup_and_cosine_decay(chat_run: UpRun) -> None:
    rows = chat_run.rows
    assert len(rows) == STEPS
    format_reward = "reward/fn/two_digits"
    first, last = mean(rows[:10], format_reward), mean(rows[-10:], format_reward)
    print(f"{format_reward}: first 10 steps {first:.3f}, last 10 {last:.3f}")
    assert last >= first + 0.2, (first, last)
    lrs = [row["optim/lr"] for row in rows]
    assert lrs[0] < lrs[4] and max(lrs) == pytest.approx(3e-3)  # warmup to the peak
    assert all(a >= b for a, b in itertools.pairwise(lrs[5:]))  # then decays
    assert lrs[-1] < 0.8 * max(lrs)
    for name in ("answer_digits", "two_digits"):
        assert all(f"reward/fn/{name}" in row for row in rows)


def _first_digit(sample: Any) -> str:
    """The first digit the user said, read from the sample's prompt tokens."""
    ids = [int(t) for t in sample.prompt_ids]
    return VOCAB[ids[ids.index(VOCAB.index("user")) + 1]]


def test_a_raising_reward_is_contained_in_the_samples_it_could_not_score(
    chat_run: UpRun,
) -> None:
    samples = scored_samples(chat_run.run_dir)
    leading_zero = [s for s in samples if _first_digit(s) == "0"]
    assert leading_zero and len(leading_zero) < len(samples)
    for sample in samples:
        details = sample.reward_details
        failed = _first_digit(sample) == "0"
        assert details["reward_failed"] is failed
        assert details["rewards"]["answer_digits"] is not None
        assert (details["rewards"]["two_digits"] is None) is failed
        if failed:
            assert "leading zero" in json.dumps(details["reward_errors"])


def test_the_eval_split_is_reported_at_its_versions_and_tracked(chat_run: UpRun) -> None:
    evals = [json.loads(line) for line in (chat_run.run_dir / "eval.jsonl").read_text().split()]
    versions = [row["version"] for row in evals]
    assert versions and all(v % EVAL_EVERY == 0 for v in versions)
    assert STEPS in versions
    assert all("eval/reward/mean" in row and "eval/fn/two_digits" in row for row in evals)
    tracking = _home(chat_run) / "tracking" / "tensorboard"
    (trainer_dir,) = tracking.glob("chat-trainer*")
    (eval_dir,) = tracking.glob("chat-eval*")
    assert [step for step, _ in tensorboard_scalars(trainer_dir, "reward/mean")] == list(
        range(1, STEPS + 1)
    )
    tracked = dict(tensorboard_scalars(eval_dir, "eval/reward/mean"))
    assert tracked == {row["version"]: pytest.approx(row["eval/reward/mean"]) for row in evals}


def test_the_export_loads_in_transformers_and_answers_like_the_last_eval(
    chat_run: UpRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    config = chat_run.run_dir / "rollstream.toml"
    export = subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config), "export", "chat",
         "--version", str(STEPS), "--out", str(out)],
        env=role_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    # greedy over the eval split, scored by the run's own reward list as its evaluation
    # scores each prompt: the same answers give the same reward
    monkeypatch.syspath_prepend(str(SUPPORT))
    rewards = RewardSet.from_configs(load_config(config).producers.rollout.task_options["rewards"])
    eval_rows = [json.loads(line) for line in (_home(chat_run) / "test.jsonl").open()]
    answers, scores = [], []
    for row in eval_rows:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *row["messages"]]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        prompt = torch.tensor([ids["input_ids"]])
        generated = model.generate(prompt, max_new_tokens=2, do_sample=False)[0, prompt.shape[1] :]
        answer = tokenizer.decode(generated, skip_special_tokens=True)
        completion = [{"role": "assistant", "content": answer}]
        (score,) = asyncio.run(
            rewards.score(
                [messages], [completion], [generated.tolist()], {"answer": [row["answer"]]}
            )
        )
        answers.append(answer)
        scores.append(score.reward)
    evals = [json.loads(line) for line in (chat_run.run_dir / "eval.jsonl").read_text().split()]
    (last,) = [row for row in evals if row["version"] == STEPS]
    assert sum(scores) / len(scores) == pytest.approx(last["eval/reward/mean"], abs=0.25), answers
    assert sum(a.isdigit() for a in answers) >= len(answers) // 2, answers  # the task's format
    assert_reconciles(chat_run.run_dir, chat_run.rows)
