"""A trainer alone (a world of one) meets in an in-process store: no rendezvous port is
bound, so a port taken by someone else (any outgoing connection can take one) or left
behind in the environment by a parent cannot stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from support.paths import REPO

SCRIPT = textwrap.dedent(
    """
    import socket, sys
    import consumers.train_engine as te
    from consumers.config import EngineConfig
    from core.process import free_port

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = [busy.getsockname()[1]]  # the first choice is already taken
    te.free_port = lambda: ports.pop(0) if ports else free_port()
    te.init_distributed(EngineConfig(accelerator="cpu"))
    import torch.distributed as dist
    print("world", dist.get_world_size(), "port", te.os.environ["MASTER_PORT"])
    """
)


@pytest.mark.system
def test_a_taken_rendezvous_port_does_not_matter() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world 1 port" in done.stdout


@pytest.mark.system
def test_variables_a_parent_left_behind_do_not_pin_a_world_of_one() -> None:
    """A process that trained in-process (a test run) leaves RANK=0, WORLD_SIZE=1 and the
    port of its own live rendezvous in its environment; a trainer it starts must not try
    to bind that port."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = str(busy.getsockname()[1])
        env = {
            **os.environ,
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": taken,
        }
        script = (
            "import consumers.train_engine as te\n"
            "from consumers.config import EngineConfig\n"
            "te.init_distributed(EngineConfig(accelerator='cpu'))\n"
            "print('ok', te.os.environ['MASTER_PORT'])\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    port = done.stdout.split("ok ", 1)[1].strip()
    assert port != taken
