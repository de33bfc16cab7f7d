"""Every listener binds loopback unless told otherwise: the Prometheus endpoints of the
producer, the stream worker and the trainer, and (under ``rollstream up``) the trainer's
rendezvous; ``up`` gives its engines a per-run API key its producers send, and its gateway
one its agents send."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil
import pytest

from core.process import free_port


def _listening(port: int) -> set[str]:
    """The addresses this process listens on at ``port``."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = {
            c.laddr.ip
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


def _serve_producer(port: int) -> None:
    from producers.config import RolloutConfig
    from producers.rollout.metrics import ProducerMetrics

    ProducerMetrics().serve(port, RolloutConfig().metrics_host)


def _serve_streams(port: int) -> None:
    from streams.config import StreamsConfig
    from streams.metrics import StreamMetrics

    StreamMetrics().serve(port, StreamsConfig().metrics_host)


def _serve_trainer(port: int) -> None:
    from consumers.config import TrainerConfig
    from consumers.metrics import MetricsSink

    MetricsSink(None, progress=False).serve(port, TrainerConfig().prometheus_host)


@pytest.mark.parametrize("serve", [_serve_producer, _serve_streams, _serve_trainer])
def test_metrics_bind_loopback_by_default(serve):
    port = free_port()
    serve(port)
    assert _listening(port) == {"127.0.0.1"}
    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert reply.status_code == 200


def _up_config(tmp_path: Path, trainer_ranks: int):
    from rollstream.config.settings import RollstreamConfig, UpConfig
    from rollstream.up.plan import Ports, build_config

    up = UpConfig(trainer_ranks=trainer_ranks)
    return build_config(RollstreamConfig(), up, "run1", tmp_path / "run", Ports.free())


def test_up_plans_a_loopback_rendezvous_for_several_trainer_ranks(tmp_path):
    from rollstream.up.plan import role_specs

    config = _up_config(tmp_path, trainer_ranks=2)
    (trainer,) = [s for s in role_specs(tmp_path / "run.toml", config) if s.name == "trainer"]
    argv = trainer.argv
    assert "torch.distributed.run" in argv and "--standalone" not in argv
    (endpoint,) = [a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-endpoint=")]
    host, port = endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == 0  # torch picks a free one
    assert "--rdzv-backend=c10d" in argv and "--nnodes=1" in argv
    assert trainer.env["MASTER_ADDR"] == "127.0.0.1"


def test_up_gives_its_engines_a_per_run_key_that_its_producers_send(tmp_path):
    from rollstream.up.plan import write_config

    config = _up_config(tmp_path, trainer_ranks=1)
    key = config.producers.engine.api_key
    assert key is not None and len(key.get_secret_value()) >= 32
    again = _up_config(tmp_path, trainer_ranks=1).producers.engine.api_key
    assert again is not None and again.get_secret_value() != key.get_secret_value()
    path = tmp_path / "run" / "rollstream.toml"
    write_config(config, path)  # producers and engines read the key from this file (0600)
    assert key.get_secret_value() in path.read_text()
    assert path.stat().st_mode & 0o077 == 0


def test_up_gives_its_gateway_a_per_run_key_and_says_where_agents_find_it(tmp_path):
    from rollstream.config.settings import RollstreamConfig, UpConfig
    from rollstream.up.plan import Ports, build_config, gateway_notes, plan_policies

    gateway = {"producers": {"rollout": {"gateway": {"enabled": True, "port": 8123}}}}
    base = RollstreamConfig.model_validate(gateway)
    config = build_config(base, UpConfig(), "run1", tmp_path / "run", Ports.free())
    key, engine_key = config.producers.rollout.gateway.api_key, config.producers.engine.api_key
    assert key is not None and engine_key is not None and len(key.get_secret_value()) >= 32
    assert key.get_secret_value() != engine_key.get_secret_value()
    path = tmp_path / "run" / "rollstream.toml"
    assert gateway_notes(plan_policies(config), path) == [
        f"gateway http://127.0.0.1:8123 (key: [producers.rollout.gateway] api_key in {path})"
    ]
    alone = _up_config(tmp_path, trainer_ranks=1)  # no gateway: no key, nothing to say
    assert alone.producers.rollout.gateway.api_key is None
    assert gateway_notes(plan_policies(alone), path) == []


_ALONE = """
import json, os, psutil
from consumers.config import EngineConfig
from consumers.train_engine import init_distributed
init_distributed(EngineConfig(accelerator="cpu"))
import torch.distributed as dist
print(json.dumps(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet")
                         if c.status == psutil.CONN_LISTEN})))
dist.barrier()
"""


def test_a_trainer_world_of_one_listens_on_no_wildcard_address():
    """Torch's TCPStore binds every interface whatever MASTER_ADDR says: a world of one
    meets in an in-process store instead (gloo's own sockets stay, on the host name's
    address, as torch picks it)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-c", _ALONE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    listening = json.loads(done.stdout.strip().splitlines()[-1])
    assert not {"::", "0.0.0.0"} & set(listening), listening
