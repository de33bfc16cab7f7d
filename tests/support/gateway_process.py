"""A gateway producer in its own process, so a test can kill it with SIGKILL and start it
again on the same ledger: ``python -m support.gateway_process '<json>'`` with the
``GatewayProcess`` fields (``spawn`` builds the command)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.paths import REPO, TESTS


@dataclass(frozen=True)
class GatewayProcess:
    """What the producer runs with; the same values make the same producer (its ledger)."""

    bootstrap: str
    topic: str
    run_id: str
    state_dir: str
    model: str
    dataset: str
    port: int
    api_key: str
    system_prompt: str
    group_size: int = 4
    inflight: int = 2

    def spawn(self, log: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}"}
        command = [sys.executable, "-m", "support.gateway_process", json.dumps(self.__dict__)]
        with log.open("ab") as out:
            return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out)


def main(spec: GatewayProcess) -> None:
    import torch

    from core.config import KafkaConfig, default_cache_dir
    from producers.app import run_producer
    from producers.config import EngineConfig, GatewayConfig, ProducersConfig, RolloutConfig
    from rollstream.config.settings import RollstreamConfig

    torch.set_num_threads(1)
    config = RollstreamConfig(
        run_id=spec.run_id,
        state_dir=Path(spec.state_dir),
        cache_dir=default_cache_dir(),
        kafka=KafkaConfig(bootstrap_servers=spec.bootstrap),
    )
    rollout = RolloutConfig(
        topic=spec.topic,
        task="file",
        task_options={
            "path": spec.dataset,
            "system_prompt": spec.system_prompt,
            "max_new_tokens": 2,
        },
        group_size=spec.group_size,
        groups=1000,
        max_inflight_groups=spec.inflight,
        seed=1,
        progress=False,
        producer_id="gateway-a",
        ledger_fsync=True,
        follow_weights=False,
        gateway=GatewayConfig(
            enabled=True,
            port=spec.port,
            api_key=spec.api_key,
            claim_wait_s=5.0,
            idle_timeout_s=120.0,
            served_model_names=["policy"],
        ),
    )
    settings = ProducersConfig(engine=EngineConfig(model=spec.model, seed=7), rollout=rollout)
    asyncio.run(run_producer(config, settings, install_signals=True))


if __name__ == "__main__":
    fields = {f.name for f in dataclasses.fields(GatewayProcess)}
    main(GatewayProcess(**{k: v for k, v in json.loads(sys.argv[1]).items() if k in fields}))
