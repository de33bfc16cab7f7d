"""One cell of the learning grid through the Kafka pipeline, beside the same cell in one
process, so the grid's in-process figures can be checked against the real system.

Run from the repository root: ``python -m bench.learning_pipeline [--steps N] [--seeds N]``.

Per seed, the grid's cell (``bench.learning``: tiny model of that seed, the task, batch,
learning rate, ``[trainer.ppo]`` minibatches and loss of ``bench.learning.Settings`` and
its ``decoupled-mis`` route) trains twice:

- **pipeline**: ``rollstream up --async`` with the staleness window ``k`` (engine,
  producer, stream worker, trainer as processes over an embedded broker and S3, as
  ``bench.e2e`` runs it). The pipeline does not force staleness: each batch is as old as
  the run makes it, at most the window; the trainer's ``staleness/hist/*`` metrics give
  the distribution actually trained.
- **in process**: ``bench.learning.run_cell`` with every batch exactly ``k`` versions old.

Reported: steps to the grid's reward target and final reward of each side (mean ± sd over
seeds), the 10-step mean reward curve of both at a few steps and the mean absolute
difference between them, clip and mask fractions, and the pipeline's trained staleness
distribution. Sampling seeds cannot be matched across the two sides (the pipeline samples
in another process, concurrently), so the curves agree in distribution, not draw by draw.
With ``--plot`` the two mean curves are drawn to ``docs/learning/pipeline_k<k>.png``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.e2e import RunSpec, with_infra
from bench.figures import spread
from bench.learning import PLOTS, ROUTES, CellResult, Route, Settings, run_cell

HIST_PREFIX = "staleness/hist/"


@dataclass(frozen=True)
class Side:
    """One side's cells (one per seed), under a label."""

    name: str
    cells: list[CellResult]


def pipeline_settings(route: Route, settings: Settings, window: int) -> dict[str, Any]:
    """The run's config over the tiny profile: the grid cell's batch, lr, trust region and
    loss, and the staleness window."""
    return {
        "profile": {"staleness_window": window, "groups_per_step": settings.prompts_per_step},
        "producers": {
            "rollout": {
                "group_size": settings.group_size,
                "sampling": {"temperature": settings.temperature},
                "task_options": dict(settings.task_options),
            }
        },
        "trainer": {
            "engine": {"lr": settings.lr},
            "ppo": {"epochs": settings.epochs, "minibatches": settings.minibatches},
            "loss": dict(route.loss),
            **({"approx": dict(route.approx)} if route.approx else {}),
        },
    }


def cell_of_rows(
    route: str, window: int, seed: int, rows: Sequence[Mapping[str, float]]
) -> CellResult:
    """A pipeline run's trainer metrics as a ``CellResult`` (no entropy estimate or CPU
    time: the pipeline's trainer records neither; ``versions`` are the trained versions)."""
    masked = [
        1.0 - row["train_infer/kept_frac"]
        if "train_infer/kept_frac" in row
        else row.get("mis/masked_frac", 0.0)
        for row in rows
    ]
    return CellResult(
        route=route,
        staleness=window,
        seed=seed,
        rewards=[row["reward/mean"] for row in rows],
        entropy=[],
        clip_frac=[row.get("clip/frac", 0.0) for row in rows],
        mask_frac=masked,
        overlap_frac=[row.get("clip/masked_overlap_frac", 0.0) for row in rows],
        cpu_s=[],
        versions=[int(row["version"]) for row in rows],
    )


def staleness_histogram(rows: Sequence[Mapping[str, float]]) -> dict[str, int]:
    """Trained trajectories per staleness bucket over the run (the trainer's
    ``staleness/hist/<bucket>`` metrics, summed over steps)."""
    total: Counter[str] = Counter()
    for row in rows:
        for key, value in row.items():
            if key.startswith(HIST_PREFIX):
                total[key.removeprefix(HIST_PREFIX)] += int(value)
    return dict(total)


def curve_gap(a: Sequence[CellResult], b: Sequence[CellResult]) -> float:
    """Mean absolute difference between the two sides' seed-mean 10-step reward curves,
    over the steps both have."""
    mean_a, mean_b = _mean_curve(a), _mean_curve(b)
    n = min(len(mean_a), len(mean_b))
    return statistics.fmean(abs(x - y) for x, y in zip(mean_a[:n], mean_b[:n], strict=True))


def _mean_curve(cells: Sequence[CellResult]) -> list[float]:
    curves = [c.smoothed() for c in cells]
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


def summary(sides: Sequence[Side], target: float) -> str:
    """A markdown table, one row per side."""
    lines = [
        f"| side | steps to {target:g} (median, reached) | final reward (mean ± sd) | "
        "clip frac | mask frac |",
        "|---|---|---|---|---|",
    ]
    for side in sides:
        steps = [c.step_to(target) for c in side.cells]
        reached = [s for s in steps if s is not None]
        lines.append(
            f"| {side.name} | {statistics.median(reached) if reached else '-'} "
            f"({len(reached)}/{len(steps)}) | {spread([c.final() for c in side.cells])} | "
            f"{statistics.fmean(x for c in side.cells for x in c.clip_frac):.3f} | "
            f"{statistics.fmean(x for c in side.cells for x in c.mask_frac):.3f} |"
        )
    return "\n".join(lines)


def plot(sides: Sequence[Side], window: int, path: Path) -> None:
    """The seed-mean 10-step reward curve of each side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side in sides:
        mean = _mean_curve(side.cells)
        ax.plot(range(1, len(mean) + 1), mean, label=side.name)
    ax.set(
        title=f"one cell, staleness {window}", xlabel="trainer step", ylabel="reward (10-step mean)"
    )
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1")
    parser.add_argument("--staleness", type=int, default=2, help="window k (pipeline), forced k")
    parser.add_argument("--route", default="decoupled-mis", help="a bench.learning route")
    parser.add_argument("--plot", action="store_true", help="write docs/learning/pipeline_k<k>.png")
    args = parser.parse_args()
    route = {r.name: r for r in ROUTES}.get(args.route)
    if route is None or route.old_logits != "exact":
        parser.error("the pipeline attaches exact old logits: pick an exact-anchored route")
    settings = Settings(steps=args.steps)
    k = args.staleness
    piped, local = [], []
    hist: Counter[str] = Counter()
    token_staleness: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-cell-") as tmp:
        for seed in range(args.seeds):
            spec = RunSpec(
                "async", args.steps, seed, task=settings.task,
                settings=pipeline_settings(route, settings, k),
            )  # fmt: skip
            rows = with_infra(Path(tmp), spec).rows
            piped.append(cell_of_rows(route.name, k, seed, rows))
            hist.update(staleness_histogram(rows))
            token_staleness += [row["staleness/mean"] for row in rows if "staleness/mean" in row]
            print(f"  seed {seed} pipeline: final {piped[-1].final():.2f}", flush=True)
            local.append(run_cell(route, k, seed, settings))
            print(f"  seed {seed} in process: final {local[-1].final():.2f}", flush=True)
    sides = [
        Side(f"pipeline, window {k}", piped),
        Side(f"in process, forced k = {k}", local),
    ]
    print(f"\n{route.name}, {args.steps} steps, seeds 0..{args.seeds - 1}\n")
    print(summary(sides, settings.target))
    at = [s for s in (25, 50, 100, 150, 200, 300) if s <= args.steps]
    print("\n10-step mean reward (mean over seeds) at steps " + ", ".join(map(str, at)))
    for side in sides:
        mean = _mean_curve(side.cells)
        print(f"  {side.name:28s} " + "  ".join(f"{mean[s - 1]:.2f}" for s in at))
    print(f"  mean |difference| of the two curves: {curve_gap(piped, local):.3f}")
    trained = sum(hist.values())
    order = sorted(hist, key=lambda b: int(b.split("-")[0].rstrip("+")))
    shares = ", ".join(f"{b}: {hist[b] / trained:.1%}" for b in order if hist[b])
    print(f"\npipeline's trained staleness (trajectories, {trained}): {shares}")
    if token_staleness:
        print(f"  mean token staleness, mean over steps: {statistics.fmean(token_staleness):.2f}")
    if args.plot:
        path = PLOTS / f"pipeline_k{k}.png"
        plot(sides, k, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
