"""The gateway killed with SIGKILL while 8 agents (the real ``openai`` client, no
retries) are mid-episode, then started again on the same ledger: every episode that had a
completed call is in the ledger as abandoned because the gateway restarted, its agent is
answered 409 saying so, what was published before the kill is published once, and the
audit finds nothing lost."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.gateway_process import GatewayProcess
from support.producer_runs import make_topic, read_topic
from support.streams import create_stream_topics

from core.process import free_port
from producers.rollout.ledger import GATEWAY_RESTARTED, ledger_dir, read_ledger
from rollstream.cli.starter import save_chat_model
from rollstream.runs.audit import audit
from rollstream.runs.reads import AuditSources
from schemas.codec import decode

pytestmark = pytest.mark.integration

KEY = "gateway-kill-key"
SYSTEM = "copy the first digit twice"
AGENTS = 8


def _dataset(path: Path) -> Path:
    rng = random.Random(5)
    rows = []
    for _ in range(20):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        row = {"messages": [{"role": "user", "content": digits}], "answer": digits[0] * 2}
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


class Gateway:
    """The producer process and how to talk to it."""

    def __init__(self, spec: GatewayProcess, log: Path) -> None:
        self.spec, self.log = spec, log
        self.url = f"http://127.0.0.1:{spec.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = self.spec.spawn(self.log)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            alive = self.process.poll() is None
            assert alive and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def post(self, path: str, body: Any = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}"}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=30)

    def open(self) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while (answer := self.post("/v1/episodes")).status_code == 429:
            assert time.monotonic() < deadline, "no slot opened"
        assert answer.status_code == 201, answer.text
        return answer.json()

    def client(self, episode_id: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/episodes/{episode_id}/v1", api_key=KEY, max_retries=0, timeout=30
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _messages(opened: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        *opened["prompt"]["metadata"]["example"]["messages"],
    ]


class Agent(threading.Thread):
    """Opens an episode and calls it until the gateway goes away; ``completed``: the calls
    whose answers it received."""

    def __init__(self, gateway: Gateway, opened: dict[str, Any], started: threading.Barrier):
        super().__init__(daemon=True)
        self.gateway, self.opened, self.started = gateway, opened, started
        self.completed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        client = self.gateway.client(self.opened["episode_id"])
        messages = _messages(self.opened)
        try:
            while True:
                answer = client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=2
                )
                self.completed += 1
                if self.completed == 1:
                    self.started.wait(60)
                text = answer.choices[0].message.content or ""
                messages = [*messages, {"role": "assistant", "content": text}]
                messages.append({"role": "user", "content": "again"})
                if len(messages) > 12:  # stay well within the episode's limits
                    messages = _messages(self.opened)
        except (openai.APIConnectionError, openai.APIStatusError) as exc:
            self.error = exc


def test_a_gateway_killed_mid_episode_closes_its_episodes_as_abandoned_on_restart(
    kafka_config, unique_name, tmp_path
):
    model = save_chat_model(tmp_path / "model", seed=3)
    dlq, stale = unique_name("rollouts.dlq"), unique_name("rollouts.stale")
    create_stream_topics(kafka_config.client_config(), {"dlq": dlq, "stale": stale})
    spec = GatewayProcess(
        bootstrap=kafka_config.bootstrap_servers,
        topic=make_topic(kafka_config, unique_name, partitions=1),
        run_id=f"run-{uuid.uuid4().hex[:6]}",
        state_dir=str(tmp_path / "state"),
        model=str(model),
        dataset=str(_dataset(tmp_path / "train.jsonl")),
        port=free_port(),
        api_key=KEY,
        system_prompt=SYSTEM,
    )
    ledger_path = ledger_dir(Path(spec.state_dir), spec.run_id, "gateway-a") / "ledger.jsonl"
    gateway = Gateway(spec, tmp_path / "gateway.log")
    gateway.start()
    try:
        # one group played whole and published before the kill
        first = [gateway.open() for _ in range(spec.group_size)]
        for opened in first:
            gateway.client(opened["episode_id"]).chat.completions.create(
                model="policy", messages=_messages(opened), max_tokens=2
            )
            assert gateway.post(
                f"/v1/episodes/{opened['episode_id']}/close", {"reward": 1}
            ).is_success
        deadline = time.monotonic() + 30
        while first[0]["group_id"] not in read_ledger(ledger_path).delivered:
            assert time.monotonic() < deadline, "the first group was not published"
            time.sleep(0.2)
        # 8 agents mid-episode: each has a completed call and keeps calling; then kill -9
        opened = [gateway.open() for _ in range(AGENTS)]
        started = threading.Barrier(AGENTS + 1)
        agents = [Agent(gateway, o, started) for o in opened]
        for agent in agents:
            agent.start()
        started.wait(60)
        assert gateway.process is not None
        gateway.process.send_signal(signal.SIGKILL)
        gateway.process.wait(10)
        for agent in agents:
            agent.join(30)
            assert not agent.is_alive() and isinstance(agent.error, openai.APIConnectionError)
        gateway.start()  # the same producer, the same ledger
        ledger = read_ledger(ledger_path)
        restarted = {
            eid for reasons in ledger.abandoned.values() for eid, why in reasons.items()
            if why == GATEWAY_RESTARTED
        }  # fmt: skip
        answered = {a.opened["episode_id"] for a in agents if a.completed}
        assert len(answered) == AGENTS and answered <= restarted
        assert restarted <= {o["episode_id"] for o in opened}  # and nothing else
        for agent in agents:  # their agents are told, not 404
            episode_id = agent.opened["episode_id"]
            with pytest.raises(openai.ConflictError, match=GATEWAY_RESTARTED):
                gateway.client(episode_id).chat.completions.create(
                    model="policy", messages=_messages(agent.opened), max_tokens=2
                )
            closed = gateway.post(f"/v1/episodes/{episode_id}/close", {"reward": 1})
            assert closed.status_code == 409 and GATEWAY_RESTARTED in closed.text
            state = httpx.get(
                f"{gateway.url}/v1/episodes/{episode_id}",
                headers={"Authorization": f"Bearer {KEY}"},
            ).json()
            assert (state["state"], state["reason"]) == ("abandoned", GATEWAY_RESTARTED)
    finally:
        gateway.stop()
    records = [decode(m.value()) for m in read_topic(kafka_config, spec.topic)]
    counts = Counter(r.trajectory_id for r in records)
    assert counts and max(counts.values()) == 1  # nothing published twice
    assert {r.group_id for r in records} == {first[0]["group_id"]}
    report = audit(
        AuditSources(
            run_id=spec.run_id,
            client_config=kafka_config.client_config(),
            producers_dir=ledger_path.parent.parent,
            trainer_ledger=tmp_path / "no-trainer.jsonl",
            raw=spec.topic,
            scored=spec.topic,
            stales=(stale,),
            dlqs=(dlq,),
            filtered=None,
            stream_app_id="none",
            trainer_group="none",
        ),
        diagnose=False,
    )
    figures = report.counts()
    assert (figures["lost_groups"], figures["orphaned"], figures["interrupted_episodes"]) == (
        0,
        0,
        0,
    )
    assert figures["delivered"] == len(counts)
    assert report.missing == set(counts)  # delivered, no trainer ran: none lost
    assert figures["abandoned_reasons"][GATEWAY_RESTARTED] == len(restarted)
    assert figures["abandoned_with_calls"] >= len(restarted)
