"""What a fork costs and what it shows: one recorded run, forked under each loss route.

Run from the repository root: ``python -m bench.fork [--steps 100] [--seed 0]``.

On a fresh embedded broker and store, ``rollstream up`` runs the tiny pipeline (engine,
producer, stream worker, trainer; the trainer deterministic) for ``--steps`` steps. Then
``rollstream fork`` trains that run again: once with nothing changed (the control arm:
every version must be the run's, bit for bit) and once per loss route of the off-policy
ablation (``bench.learning.ROUTES``): a route whose old logits are the stream's exact ones
trains the run's scored groups; a route without old logits (``old_logits = "off"``) is
forked with ``--restream`` and ``streams.old_logits.mode = "off"``: the raw topic goes
through the stream again without them (its wall time includes the restream). The route
whose old logits are recomputed under the policy being trained is not a stream setting
and is left out.
Printed, side by side: the run's wall time (from ``up`` to its end), each fork's, and
their ratio (the target: a fork costs at most 0.3 of its run: no generation, no stream);
per arm, the last-20-step means of the loss, the PPO-clipped and MIS-masked fractions,
how far its policy ends from the one that generated the data (``offpolicy/k3_kl``), and
the held-out reward of its own versions (``rollstream eval --stored``: the task's fixed
eval set, greedy, at every tenth version the store still holds). Every arm trains the same
recorded generations, so the reward of the data is the run's in every arm: the table
measures what each loss does to the same data, not what an on-policy run with that loss
would do; the eval column is the one that says which arm's policy does the task better.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import orjson

from bench.e2e import RunSpec, run_up
from bench.learning import ROUTES
from rollstream.config.settings import load_config
from rollstream.runs.report import eval_path, load_metrics

SHOWN = ("loss/total", "clip/frac", "mis/masked_frac", "offpolicy/k3_kl")


@dataclass
class Arm:
    name: str
    assignments: list[str]
    seconds: float
    output: str
    rows: list[dict[str, float]]  # one per step, in step order
    evals: list[dict[str, float]]  # one per evaluated version, in version order

    def tail_mean(self, name: str, window: int = 20) -> float | None:
        values = [r[name] for r in self.rows[-window:] if name in r]
        return statistics.fmean(values) if values else None


def route_assignments(loss: dict[str, object], approx: dict[str, object]) -> list[str]:
    """``--set`` values of a route's loss (a loss of another type than the run's starts
    from that type's defaults) and ``approx`` settings."""
    out = [f"trainer.loss.{k}={orjson.dumps(v).decode()}" for k, v in loss.items()]
    out += [f"trainer.approx.{k}={orjson.dumps(v).decode()}" for k, v in approx.items()]
    return out


def fork_arm(
    config: Path, state: Path, run: str, name: str, assignments: list[str], *options: str
) -> Arm:
    argv = [sys.executable, "-m", "rollstream", "--config", str(config), "fork", run, *options]
    argv += ["--as", name] + [x for a in assignments for x in ("--set", a)]
    began = time.time()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    seconds = time.time() - began
    if done.returncode != 0:
        raise SystemExit(f"fork {name} failed:\n{done.stderr[-3000:]}")
    rows = load_metrics(name, [state / "trainer" / name / "metrics.jsonl"]).rows
    print(f"  fork {name}: {seconds:.0f}s; {done.stdout.strip()}", flush=True)
    return Arm(name, assignments, seconds, done.stdout.strip(), rows, evaluate(config, name))


def evaluate(config: Path, run: str) -> list[dict[str, float]]:
    """The held-out rows of ``run``'s stored versions (every tenth)."""
    argv = [sys.executable, "-m", "rollstream", "--config", str(config), "eval", "--stored"]
    done = subprocess.run(
        [*argv, "--run", run, "--every-versions", "10"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"eval of {run} failed:\n{done.stderr[-3000:]}")
    rows_file = eval_path(load_config(config), run)  # where report finds them
    if rows_file is None:
        raise SystemExit(f"eval of {run} wrote no rows:\n{done.stdout[-3000:]}")
    return load_metrics(run, [rows_file]).rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of the recorded run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from infra.services import Services

    started = datetime.now(UTC)
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-fork-") as tmp:
        state = Path(tmp) / "state"
        services = Services(load_config(None, state_dir=state))
        print(f"infra up in {services.up().seconds:.1f}s", flush=True)
        try:
            spec = RunSpec(
                "async",
                args.steps,
                args.seed,
                # every version kept: the restreamed arms and the eval read old ones
                settings={
                    "trainer": {"engine": {"deterministic": True}},
                    "weights": {"keep_versions": args.steps + 1},
                },
            )
            run = run_up(state, Path(tmp), spec)
            config = run.run_dir / "rollstream.toml"
            recorded = evaluate(config, run.run_dir.name)
            arms = [fork_arm(config, state, run.run_dir.name, "control", [])]
            for route in ROUTES:
                assignments = route_assignments(route.loss, route.approx)
                options: list[str] = []
                if route.old_logits == "off":
                    assignments.append('streams.old_logits.mode="off"')
                    options.append("--restream")
                elif route.old_logits != "exact":
                    continue
                arms.append(
                    fork_arm(config, state, run.run_dir.name, route.name, assignments, *options)
                )
        finally:
            services.down()
    print()
    print(
        f"bench.fork, {started:%Y-%m-%d %H:%M} UTC, {platform.machine()} with "
        f"{os.cpu_count()} cores; recorded run: {args.steps} steps of the tiny pipeline "
        f"(`rollstream up --async`, deterministic trainer), {run.seconds:.0f}s wall-clock"
    )
    print()
    print("| arm | wall s | fork / run | " + " | ".join(SHOWN) + " (last 20 steps) | eval |")
    print("|---|---|---|" + "---|" * (len(SHOWN) + 1))
    print(f"| the run | {run.seconds:.0f} | 1 |" + " |" * len(SHOWN) + f" {held_out(recorded)} |")
    for arm in arms:
        means = [arm.tail_mean(name) for name in SHOWN]
        cells = " | ".join("-" if m is None else f"{m:.4g}" for m in means)
        ratio = arm.seconds / run.seconds
        print(f"| {arm.name} | {arm.seconds:.0f} | {ratio:.2f} | {cells} | {held_out(arm.evals)} |")
    print()
    print(f"control: {arms[0].output}")


def held_out(rows: list[dict[str, float]]) -> str:
    """``eval/reward/mean`` per evaluated version, e.g. ``v80 0.41, v90 0.44``."""
    return ", ".join(f"v{r['version']:.0f} {r['eval/reward/mean']:.3f}" for r in rows) or "-"


if __name__ == "__main__":
    main()
