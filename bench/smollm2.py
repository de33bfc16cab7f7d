"""A real LLM learning: SmolLM2-135M-Instruct on the default ``arithmetic`` task.

Run from the repository root: ``python -m bench.smollm2 [--steps 70]`` (about half an
hour on 2 cores). It runs what a new user runs, ``rollstream up --model smollm2-135m``
(the ``language-model`` profile, embedded Kafka and S3), then reads the trainer's metrics
file and prints, per window of 10 steps, the mean reward, the share of answers right
(``reward/correct_frac``), the share that ended with an ``Answer: N`` line
(``reward/format_ok_frac``), the response length and the seconds per step; it draws the
same curves to ``docs/learning/smollm2_arithmetic.png``. ``--run-dir DIR --no-run``
summarises a run that already finished. ``--lora-rank R [--lr LR]`` trains a LoRA
adapter instead of the whole model (the LoRA comparison in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from bench.figures import moving_mean, trainer_rows

WINDOW = 10
CURVES = (
    ("reward/mean", "reward"),
    ("reward/correct_frac", "answer right"),
    ("reward/format_ok_frac", "'Answer: N' line"),
)


def run_up(run_dir: Path, steps: int, settings: Sequence[str] = ()) -> float:
    """``rollstream up --model smollm2-135m --max-steps steps`` with ``--set`` for each
    of ``settings``; its wall-clock seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    sets = [arg for setting in settings for arg in ("--set", setting)]
    command = [sys.executable, "-m", "rollstream", *sets, "up", "--model", "smollm2-135m",
               "--max-steps", str(steps), "--run-dir", str(run_dir)]  # fmt: skip
    started = datetime.now(UTC)
    with (run_dir.parent / f"{run_dir.name}.log").open("wb") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
                       timeout=steps * 120 + 600)  # fmt: skip
    return (datetime.now(UTC) - started).total_seconds()


def windows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Means over consecutive windows of ``WINDOW`` steps."""
    out = []
    for start in range(0, len(rows), WINDOW):
        part = rows[start : start + WINDOW]
        summary = {"first": part[0]["step"], "last": part[-1]["step"]}
        for key in (*(k for k, _ in CURVES), "response/length_mean", "time/step_s"):
            values = [r[key] for r in part if key in r]
            summary[key] = statistics.fmean(values) if values else float("nan")
        out.append(summary)
    return out


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in CURVES:
        ax.plot(steps, moving_mean([r.get(key, float("nan")) for r in rows]), label=label)
    ax.set_xlabel("trainer step (4 groups x 8 samples)")
    ax.set_ylabel(f"{WINDOW}-step moving mean")
    ax.set_ylim(0, 1.05)
    ax.set_title("SmolLM2-135M-Instruct, arithmetic, rollstream up (2 CPU cores)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--run-dir", type=Path, help="default: a new temporary directory")
    parser.add_argument("--no-run", action="store_true", help="summarise --run-dir only")
    parser.add_argument("--plot", type=Path, default=Path("docs/learning/smollm2_arithmetic.png"))
    parser.add_argument(
        "--lora-rank", type=int, help="train a LoRA adapter of this rank (alpha 2x rank)"
    )
    parser.add_argument("--lr", type=float, help="the trainer's learning rate (default: profile)")
    args = parser.parse_args()
    settings = []
    if args.lora_rank:
        settings += [f"lora.rank={args.lora_rank}", f"lora.alpha={2 * args.lora_rank}"]
    if args.lr:
        settings.append(f"trainer.engine.lr={args.lr}")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="smollm2-")) / "run"
    wall = None
    if not args.no_run:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        wall = run_up(run_dir, args.steps, settings)
    rows = trainer_rows(run_dir)
    took = f" in {wall:.0f} s (start-up included)" if wall else ""
    print(f"bench.smollm2, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores; "
          f"{len(rows)} steps{took}; settings: {' '.join(settings) or 'the profile'}")  # fmt: skip
    print("| steps | reward | answer right | 'Answer: N' line | response tokens | s/step |")
    print("|---|---|---|---|---|---|")
    for w in windows(rows):
        print(f"| {w['first']:.0f}-{w['last']:.0f} | {w['reward/mean']:.3f} | "
              f"{w['reward/correct_frac']:.2f} | {w['reward/format_ok_frac']:.2f} | "
              f"{w['response/length_mean']:.1f} | {w['time/step_s']:.1f} |")  # fmt: skip
    plot(rows, args.plot)
    print(f"curves: {args.plot}; run dir: {run_dir}")


if __name__ == "__main__":
    main()
