"""Two policies in one run (``propose-solve``) over seeds, beside a single-policy baseline.

Run from the repository root: ``python -m bench.multi_policy [--seeds 3] [--steps 100]
[--out docs/learning/propose_solve.png]``.

Per seed, one after the other, each in a fresh temporary state dir (``rollstream up``
starts and stops its own embedded Kafka and S3):

- **propose-solve**: ``rollstream --config <infra/propose-solve.toml + seeds> up``: per
  policy a stream worker and a trainer, the proposer's engine and producer, the solver's
  engine inside that producer. The run ends when the first trainer reaches the steps.
- **baseline**: ``rollstream up`` on the default tiny task with the same seeds and steps,
  so the cost of the second policy in wall time per step can be read on the same cores.

The seed goes everywhere the config takes one: the tiny model's initialisation
(``profile.model = "tiny:seed=S"``), the engines' sampling, the producer's prompt
sampling and the trainers' torch seed; both policies share them (root settings).
Reported per policy: first- and last-10-step mean reward, steps to a 10-step mean reward
of 0.5 and seconds per trainer step (mean ± sd over seeds), the baseline's seconds per
step and the ratio; error lines in the roles' logs. The seed-mean 10-step reward curve of
each policy, with a band of ± sd, is drawn to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.e2e import steps_per_s
from bench.figures import moving_mean, spread
from core.config import merge_tables, to_toml

CONFIG = Path("infra/propose-solve.toml")
POLICIES = ("proposer", "solver")
BASELINE = "baseline"
WINDOW = 10
TARGET = 0.5
_ERROR = re.compile(r"\bERROR\b|Traceback")


@dataclass(frozen=True)
class Run:
    """One finished ``rollstream up``: its trainers' metric rows by name (a policy, or
    ``baseline``), its wall-clock seconds (start-up included) and error lines in its logs."""

    kind: str
    seed: int
    wall_s: float
    rows: Mapping[str, list[dict[str, float]]]
    errors: Mapping[str, int]


def seeded(seed: int, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (a config's tables) with ``seed`` in every place the config takes one."""
    seeds = {
        "profile": {"model": f"tiny:seed={seed}"},
        "producers": {"engine": {"seed": seed}, "rollout": {"seed": seed}},
        "trainer": {"engine": {"seed": seed}},
    }
    return merge_tables(dict(base or {}), seeds)


def read_rows(path: Path) -> list[dict[str, float]]:
    """A trainer's metrics file, one dict per step (none if it never wrote one)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_errors(logs: Path) -> dict[str, int]:
    """Lines with ``ERROR`` or ``Traceback`` per role log that has any."""
    found: dict[str, int] = {}
    for log in sorted(logs.glob("*.log")):
        text = log.read_text(errors="replace")
        count = sum(1 for line in text.splitlines() if _ERROR.search(line))
        if count:
            found[log.stem] = count
    return found


def run_up(kind: str, seed: int, steps: int, tmp: Path) -> Run:
    """One ``rollstream up`` of ``kind`` (``propose-solve`` or ``baseline``) in a fresh
    state dir under ``tmp``; its output goes to ``<tmp>/<kind>-s<seed>.log``, its run
    dir (metrics, role logs) is ``<tmp>/<kind>-s<seed>/run``."""
    name = f"{kind}-s{seed}"
    base = tomllib.loads(CONFIG.read_text()) if kind != BASELINE else {}
    config = tmp / f"{name}.toml"
    config.write_text(to_toml(seeded(seed, base)))
    run_dir = tmp / name / "run"
    argv = [sys.executable, "-m", "rollstream", "--config", str(config),
            "--state-dir", str(tmp / name / "state"), "up",
            "--max-steps", str(steps), "--run-dir", str(run_dir)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    began = datetime.now(UTC)
    with (tmp / f"{name}.log").open("wb") as out:
        done = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=steps * 30 + 600)  # fmt: skip
    wall = (datetime.now(UTC) - began).total_seconds()
    if done.returncode != 0:
        raise SystemExit(f"{name}: rollstream up exited {done.returncode}; see {tmp / name}.log")
    names = POLICIES if kind != BASELINE else (BASELINE,)
    files = {n: f"trainer.{n}.jsonl" if n != BASELINE else "trainer.jsonl" for n in names}
    rows = {n: read_rows(run_dir / f) for n, f in files.items()}
    return Run(kind, seed, wall, rows, log_errors(run_dir / "logs"))


def steps_to(rewards: Sequence[float], target: float = TARGET, window: int = WINDOW) -> int | None:
    """The first step whose full ``window``-step mean reward reaches ``target``."""
    for i, value in enumerate(moving_mean(rewards, window)):
        if i + 1 >= window and value >= target:
            return i + 1
    return None


def rewards(rows: Sequence[Mapping[str, float]]) -> list[float]:
    return [row["reward/mean"] for row in rows if "reward/mean" in row]


def seconds_per_step(rows: list[dict[str, float]]) -> float:
    """Wall seconds per trainer step, first to last step (start-up left out)."""
    rate = steps_per_s(rows) if len(rows) > 1 else 0.0
    return 1.0 / rate if rate > 0 else float("nan")


def figures(runs: Sequence[Run], name: str) -> dict[str, list[float]]:
    """Per seed, ``name``'s first-10 and last-10 mean reward, steps to the target (reached
    only) and seconds per step."""
    out: dict[str, list[float]] = {"first": [], "last": [], "reached": [], "s_step": []}
    for run in runs:
        got = rewards(run.rows[name])
        if not got:
            continue
        out["first"].append(statistics.fmean(got[:WINDOW]))
        out["last"].append(statistics.fmean(got[-WINDOW:]))
        reached = steps_to(got)
        if reached is not None:
            out["reached"].append(float(reached))
        out["s_step"].append(seconds_per_step(run.rows[name]))
    return out


def table(multi: Sequence[Run], base: Sequence[Run]) -> str:
    """A markdown table: a row per policy and one for the baseline (mean ± sd over seeds),
    and the ratio of each policy's seconds per step to the baseline's."""
    lines = [
        f"| trainer | first {WINDOW} | last {WINDOW} | steps to {TARGET:g} (seeds reached) "
        "| s/step | steps/s | s/step vs baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    base_figs = figures(base, BASELINE)
    base_s = statistics.fmean(base_figs["s_step"]) if base_figs["s_step"] else float("nan")
    for name, runs in [*((p, multi) for p in POLICIES), (BASELINE, base)]:
        figs = figures(runs, name)
        reached = figs["reached"]
        to = (
            f"{spread(reached, 1)} ({len(reached)}/{len(figs['first'])})"
            if reached
            else (f"not reached (0/{len(figs['first'])})")
        )
        rate = [1.0 / s for s in figs["s_step"]]
        ratio = statistics.fmean(figs["s_step"]) / base_s if figs["s_step"] else float("nan")
        lines.append(
            f"| {name} | {spread(figs['first'])} | {spread(figs['last'])} | {to} | "
            f"{spread(figs['s_step'], 3)} | {spread(rate)} | "
            f"{'-' if name == BASELINE else f'{ratio:.2f}x'} |"
        )
    return "\n".join(lines)


def per_seed(multi: Sequence[Run], base: Sequence[Run]) -> str:
    """One line per seed: steps, final reward and s/step of each trainer, and wall times."""
    lines = []
    for run, ref in zip(multi, base, strict=True):
        parts = []
        for name, r in [*((p, run) for p in POLICIES), (BASELINE, ref)]:
            got = rewards(r.rows[name])
            last = f"{statistics.fmean(got[-WINDOW:]):.3f}" if got else "-"
            to = steps_to(got) if got else None
            parts.append(
                f"{name} {len(got)} steps, last {last}, to {TARGET:g}: {to or 'not reached'}, "
                f"{seconds_per_step(r.rows[name]):.3f} s/step"
            )
        lines.append(
            f"  seed {run.seed}: " + "; ".join(parts)
            + f"; wall {run.wall_s:.0f} s vs {ref.wall_s:.0f} s"
        )  # fmt: skip
    return "\n".join(lines)


def band(curves: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Mean and sd over ``curves`` at each step all of them have (sd 0 for one curve)."""
    n = min(len(c) for c in curves)
    mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
    sd = [statistics.stdev(c[i] for c in curves) if len(curves) > 1 else 0.0 for i in range(n)]
    return mean, sd


def plot(multi: Sequence[Run], path: Path, machine: str) -> None:
    """Each policy's seed-mean 10-step reward curve with a band of ± sd over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in POLICIES:
        curves = [moving_mean(rewards(run.rows[name]), WINDOW) for run in multi]
        mean, sd = band([c for c in curves if c])
        steps = range(1, len(mean) + 1)
        ax.plot(steps, mean, label=name)
        low = [m - s for m, s in zip(mean, sd, strict=True)]
        high = [m + s for m, s in zip(mean, sd, strict=True)]
        ax.fill_between(steps, low, high, alpha=0.2)
    ax.axhline(TARGET, color="grey", lw=0.8, ls=":")
    ax.set(
        title=f"propose-solve, rollstream up, {len(multi)} seeds (mean ± sd), {machine}",
        xlabel="trainer step (16 groups x 8)",
        ylabel=f"reward ({WINDOW}-step mean)",
    )
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def machine() -> str:
    """Cores this process may use, memory and the platform."""
    mem = next(
        (line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
         if line.startswith("MemTotal:")),
        "0",
    )  # fmt: skip
    return f"{len(os.sched_getaffinity(0))} cores, {int(mem) / 2**20:.0f} GiB, {platform.machine()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("docs/learning/propose_solve.png"))
    args = parser.parse_args()
    began = datetime.now(UTC)
    multi: list[Run] = []
    base: list[Run] = []
    tmp = Path(tempfile.mkdtemp(prefix="rollstream-bench-mp-"))
    print(f"runs, logs and metrics under {tmp}", flush=True)
    for seed in range(args.seeds):  # interleaved, so drift on the machine hits both alike
        for kind, out in (("propose-solve", multi), (BASELINE, base)):
            run = run_up(kind, seed, args.steps, tmp)
            shutil.rmtree(tmp / f"{kind}-s{seed}" / "state", ignore_errors=True)
            steps = ", ".join(f"{n} {len(r)}" for n, r in run.rows.items())
            print(f"{kind} seed {seed}: {run.wall_s:.0f} s ({steps} steps)", flush=True)
            for role, count in run.errors.items():
                print(f"  {count} error lines in logs/{role}.log", flush=True)
            out.append(run)
    print(
        f"\nbench.multi_policy, {began:%Y-%m-%d %H:%M} UTC, {machine()}; seeds 0..{args.seeds - 1}"
        f", {args.steps} steps; {(datetime.now(UTC) - began).total_seconds() / 60:.1f} min\n"
    )
    print(table(multi, base))
    print("\nper seed:\n" + per_seed(multi, base))
    plot(multi, args.out, machine())
    print(f"\ncurves: {args.out}")


if __name__ == "__main__":
    main()
