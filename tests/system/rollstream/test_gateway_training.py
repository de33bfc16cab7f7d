"""An agent written against the OpenAI API (``examples/gateway_agent.py``, unchanged) trains
through ``rollstream up`` with the gateway on: its episodes go through the real broker and
the stream to the trainer, and the reward it reports rises. That rise is the answer's
format (two digits: half the agent's score, which a policy blind to its prompt earns), so
this is a test of the gateway's plumbing, not of learning content: that the policy reads
its prompt is the tiny run's claim (test_e2e_pipeline).

The task is the tiny chat one of test_your_own_run.py in two turns: the user says three
digits, the assistant answers, the agent's tool asks again (the digits again), the assistant
answers again; the agent scores both answers (half for two digits, half for the right ones).
``up`` prints where the gateway listens and where its key is.
"""

from __future__ import annotations

import importlib.util
import json
import random
import threading
from pathlib import Path
from types import ModuleType

import httpx
import openai
import pytest
from support.paths import REPO
from support.up_runs import assert_reconciles, finish, mean, metric_rows, start_up, write_config

from core.config import KafkaConfig, S3Config
from core.process import free_port
from rollstream.cli.starter import save_chat_model

pytestmark = pytest.mark.system

EXAMPLE = REPO / "examples" / "gateway_agent.py"
STEPS = 30
AGENTS = 6
KEY = "agent-key"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gateway_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _agents(agent: ModuleType, gateway: str, stop: threading.Event, rewards: list[float]) -> None:
    """One agent's loop: episodes until the run is over."""
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            try:
                reward = agent.play_episode(http, gateway, KEY, "copy the first digit twice", 5.0)
                rewards.append(reward)
            except (openai.APIError, httpx.HTTPError, TimeoutError, OSError):
                if stop.wait(0.5):  # the run stopping under it, or an episode abandoned
                    return


def test_an_openai_agents_episodes_train_its_answer_format_through_the_gateway(
    kafka_config: KafkaConfig, module_s3_config: S3Config, tmp_path: Path
) -> None:
    model = save_chat_model(tmp_path / "my-model", seed=3)
    rng = random.Random(5)
    rows = []
    for _ in range(300):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        rows.append(json.dumps({"messages": [{"role": "user", "content": digits}]}))
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    port = free_port()
    extra = {
        "profile": {
            "name": "tiny",
            "model": str(model),
            "precision": "fp32",
            "groups_per_step": 4,
        },
        "producers": {
            "engine": {"seed": 7},
            "rollout": {
                "task": "file",
                "seed": 7,
                "task_options": {
                    "path": str(tmp_path / "train.jsonl"),
                    "system_prompt": "copy the first digit twice",
                    "max_new_tokens": 2,
                },
                "group_size": 4,
                "gateway": {"enabled": True, "port": port, "api_key": KEY},
            },
        },
        "trainer": {
            "engine": {"lr_scheduler": "cosine", "warmup_steps": 5, "decay_steps": 2 * STEPS}
        },
    }
    config = write_config(tmp_path, kafka_config, module_s3_config, "agents", extra)
    proc = start_up(config, tmp_path / "run", "--max-steps", str(STEPS))
    agent, stop = _example(), threading.Event()
    rewards: list[float] = []
    gateway = f"http://127.0.0.1:{port}"
    threads = [
        threading.Thread(target=_agents, args=(agent, gateway, stop, rewards), daemon=True)
        for _ in range(AGENTS)
    ]
    for thread in threads:
        thread.start()
    try:
        out = finish(proc, timeout_s=600).decode(errors="replace")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "an agent did not stop"
    assert proc.returncode == 0, out[-4000:]
    assert f"gateway http://127.0.0.1:{port} (key: [producers.rollout.gateway] api_key" in out
    rows_ = metric_rows(tmp_path / "run")
    assert len(rows_) == STEPS
    first, last = mean(rows_[:10], "reward/mean"), mean(rows_[-10:], "reward/mean")
    assert last >= first + 0.15, (first, last)
    assert len(rewards) >= STEPS  # every trained record was an episode an agent closed
    assert_reconciles(tmp_path / "run", rows_)
