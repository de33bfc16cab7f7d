"""A tool-using agent, written against the OpenAI API, trains through ``rollstream up`` with
the gateway on, and its reward rises on content: only an answer that is the tool's result
earns it (``support.tool_agent``). The model (``support.tool_models``) knows how to call the
tool and read its result; the run learns that calling pays. The task, the warm start and
the calibration of the bars: docs/train-your-agent.md, "An agent that learns to use its
tool". ``up`` prints where the gateway listens and where its key is.
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
from support.tool_agent import BLIND_REWARD, CONTENT_BAR, ToolEpisode, play
from support.tool_models import save_tool_agent_model
from support.up_runs import assert_reconciles, finish, mean, metric_rows, start_up, write_config

from core.config import KafkaConfig, S3Config
from core.process import free_port

pytestmark = pytest.mark.system

EXAMPLE = REPO / "examples" / "gateway_agent.py"
STEPS = 40
AGENTS = 6
RISE_BAR = 0.1
"""The least rise of the trainer's reward/mean, first 10 steps to last 10."""
CALLS_RISE_BAR = 0.2
"""The least rise of the share of episodes that call ``lookup``, first third to last."""
KEY = "agent-key"


def _example() -> ModuleType:
    """The documented agent, for its episode opening (waits while generation is held)."""
    spec = importlib.util.spec_from_file_location("gateway_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _agent(gateway: str, seed: int, stop: threading.Event, played: list[ToolEpisode]) -> None:
    """One agent's loop: episodes until the run is over."""
    example, rng = _example(), random.Random(seed)
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            try:
                episode = example.open_episode(http, gateway, KEY, 5.0)
                client = openai.OpenAI(
                    base_url=gateway + episode["base_url_path"],
                    api_key=KEY,
                    max_retries=0,
                    http_client=http,
                )
                question = episode["prompt"]["metadata"]["example"]["messages"][-1]["content"]
                outcome = play(client, client.models.list().data[0].id, question, rng)
                http.post(
                    f"{gateway}/v1/episodes/{episode['episode_id']}/close",
                    json={"reward": outcome.reward},
                    headers=auth,
                ).raise_for_status()
                played.append(outcome)
            except (openai.APIError, httpx.HTTPError, TimeoutError, OSError):
                if stop.wait(0.5):  # the run stopping under it, or an episode abandoned
                    return


def test_a_tool_using_agent_learns_to_use_its_tools_result_through_the_gateway(
    kafka_config: KafkaConfig, module_s3_config: S3Config, tmp_path: Path
) -> None:
    model = save_tool_agent_model(tmp_path / "tool-model", seed=3)
    rng = random.Random(5)
    questions = ("".join(rng.choices("0123456789", k=3)) for _ in range(300))
    rows = [json.dumps({"messages": [{"role": "user", "content": q}]}) for q in questions]
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
                "task_options": {"path": str(tmp_path / "train.jsonl"), "max_new_tokens": 8},
                "group_size": 4,
                "gateway": {
                    "enabled": True,
                    "port": port,
                    "api_key": KEY,
                    "tool_call_parser": "auto",
                },
            },
        },
        "trainer": {"engine": {"lr": 1e-3}},  # gentler than the tiny profile's: keep the reading
    }
    config = write_config(tmp_path, kafka_config, module_s3_config, "tools", extra)
    proc = start_up(config, tmp_path / "run", "--max-steps", str(STEPS))
    gateway, stop = f"http://127.0.0.1:{port}", threading.Event()
    played: list[ToolEpisode] = []
    threads = [
        threading.Thread(target=_agent, args=(gateway, seed, stop, played), daemon=True)
        for seed in range(AGENTS)
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
    steps = metric_rows(tmp_path / "run")
    assert len(steps) == STEPS
    assert len(played) >= STEPS  # every trained record was an episode an agent closed
    first, last = mean(steps[:10], "reward/mean"), mean(steps[-10:], "reward/mean")
    third = len(played) // 3
    early, late = played[:third], played[-third:]
    calls = [sum(e.called for e in part) / len(part) for part in (early, late)]
    print(
        f"reward/mean: first 10 steps {first:.3f}, last 10 {last:.3f} (bar {CONTENT_BAR}, "
        f"blind to the tool {BLIND_REWARD}); lookup called in {calls[0]:.2f} of the first "
        f"{third} episodes, {calls[1]:.2f} of the last"
    )
    assert last >= CONTENT_BAR and last >= first + RISE_BAR, (first, last)
    assert calls[1] >= calls[0] + CALLS_RISE_BAR, calls
    assert_reconciles(tmp_path / "run", steps)
