"""A trainer rank dies with the torchrun that started it (``core.process.die_with_rank_launcher``).

torchrun puts each rank in a session of its own; killed outright it cannot stop them. Two
ranks of one torchrun: rank 0 calls the function, rank 1 (the control) does not. After a
SIGKILL to torchrun, rank 0 is gone and rank 1 is still waiting, orphaned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.weight_states import wait_for

from core.process import pid_alive

REPO = Path(__file__).resolve().parents[3]

RANK = """
import os, sys, time
from pathlib import Path
from core.process import die_with_rank_launcher
rank = os.environ["LOCAL_RANK"]
if rank == "0":
    die_with_rank_launcher()
Path(sys.argv[1], f"rank{rank}.pid").write_text(str(os.getpid()))
time.sleep(300)
"""


def test_a_rank_dies_with_its_killed_launcher_and_one_without_the_call_is_orphaned(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
         "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1",
         str(script), str(tmp_path)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
    try:
        wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files), 120, "both ranks")
        rank0, rank1 = (int(p.read_text()) for p in pid_files)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        wait_for(lambda: not pid_alive(rank0), 10, "rank 0 to die with its launcher")
        time.sleep(0.5)
        assert pid_alive(rank1)  # the control: torchrun alone leaves it behind
    finally:
        launcher.kill()
        for path in pid_files:
            if path.exists() and path.read_text():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(path.read_text()), signal.SIGKILL)
