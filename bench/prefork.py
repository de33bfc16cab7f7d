"""What forking roles from the prefork server saves a short ``rollstream up``.

Run from the repository root: ``python -m bench.prefork [--rounds 3] [--steps 3]``.

Each round runs ``rollstream up --max-steps N`` on the embedded default twice, once with
``[up] prefork = true`` and once with ``false``, in alternating order, in a fresh state
directory per arm (each arm's first run pays Kafka's storage formatting: round 0 is
counted like the others, as a new user's first run is). Measured per run: wall seconds
until ``up`` exits, and CPU seconds of ``up`` and the processes under it (roles, the
prefork server, the stream worker), not of the embedded Kafka and SeaweedFS, which run
detached and cost the same in both arms. Figures are medians over the rounds; the ratio
is of medians, measured side by side in one invocation.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(prefork: bool, steps: int, state: Path, run_id: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the run and its reaped descendants)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rollstream",
            "--set",
            f"up.prefork={'true' if prefork else 'false'}",
            "up",
            "--max-steps",
            str(steps),
            "--run-id",
            run_id,
        ],
        env={**os.environ, "XDG_STATE_HOME": str(state)},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args(argv)
    figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-prefork-") as tmp:
        for round_ in range(options.rounds):
            order = (True, False) if round_ % 2 == 0 else (False, True)
            for prefork in order:
                state = Path(tmp) / ("prefork" if prefork else "exec")
                run_id = f"r{round_}-{'prefork' if prefork else 'exec'}"
                wall, cpu = one_run(prefork, options.steps, state, run_id)
                figures[prefork].append((wall, cpu))
                print(f"round {round_} prefork={prefork}: {wall:.1f} s wall, {cpu:.1f} CPU-s")
    medians = {
        arm: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        for arm, runs in figures.items()
    }
    print(f"\n{options.steps}-step `up`, medians of {options.rounds} rounds:")
    print("arm       wall s   CPU-s")
    for arm, label in ((False, "exec"), (True, "prefork")):
        print(f"{label:8s} {medians[arm][0]:7.1f} {medians[arm][1]:7.1f}")
    print(
        f"prefork / exec: wall {medians[True][0] / medians[False][0]:.2f}, "
        f"CPU {medians[True][1] / medians[False][1]:.2f}"
    )


if __name__ == "__main__":
    main()
