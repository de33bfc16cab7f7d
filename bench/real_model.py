"""A real-model ablation: exact, lost and uncorrected old logits, and sync, on SmolLM2-135M.

Run from the repository root: ``python -m bench.real_model [--cells a,b] [--steps 22]``.
Every cell is one ``rollstream up --model smollm2-135m`` run (each role its own process,
embedded Kafka and S3, a DeepSpeed trainer), every role in bf16 (``PRECISION_NOTE``):
the engine's incremental decoding and the stream's and trainer's full forward passes round
differently, so ``d = pi_old / pi_infer`` is not 1. The task is the ``arithmetic`` task's
``two-step`` level (an addition and a subtraction in one word problem) with a format
reward of 0.1, and a fixed held-out split of 64 problems that training never samples,
measured greedily every ``EVAL_EVERY`` versions by the eval role.

Arms (``ARMS``): ``exact`` (the stream's exact old logits, decoupled loss with token MIS:
the shipped default); ``lost`` (no old logits, anchored on the detached log-probs of the
weights being trained, ``[trainer.approx] route = "current"``: what a pipeline that loses
them and recomputes them at training time does); ``uncorrected`` (no old logits, anchored
on the engine's log-probs, ``route = "infer"``: the ratio to the engine only); ``sync``
(window 0: generation waits for each update). Cells are named ``<arm>-w<window>-seed<s>``
(``sync-seed<s>``) and run in ``PRIORITY`` order.

Each finished cell is saved to ``CELLS`` at once; a later invocation skips the cells
already there, so the grid is built up in parts. ``--report-only`` rewrites the table and
plots in ``docs/learning.md`` from the saved cells. ``--measure-task`` prints the untrained
model's held-out accuracy and the share of its reward that the format alone earns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.figures import moving_mean, replace_block, spread, trainer_rows
from bench.smollm2 import run_up
from core.models import bf16_is_native

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "learning.md"
PLOTS = ROOT / "docs" / "learning"
CACHE = Path.home() / ".cache" / "rollstream" / "bench"
#: The finished cells are the measurement itself, kept with the docs they make (a cell is
#: ~12-20 minutes of this machine; a cache under the home directory went with a machine).
CELLS = PLOTS / "real-model-cells.json"
RUNS = CACHE / "real-model-runs"
BEGIN, END = "<!-- bench.real_model: begin -->", "<!-- bench.real_model: end -->"
MODEL = "smollm2-135m"
TASK_OPTIONS: dict[str, Any] = {"level": "two-step", "format_reward": 0.1, "eval_size": 64}
EVAL_EVERY = 5
#: Why the trainer is not in fp32: measured on this 2-core machine, an fp32 trainer step
#: (4 groups x 8 samples) took 122 s against about 10 s in bf16, so a 40-step cell would
#: take well over an hour. In bf16 the engine (incremental decoding with a KV cache) and
#: the trainer and stream (one full forward pass) still round differently, so d != 1.
PRECISION_NOTE = "bf16 engine, stream and trainer (an fp32 trainer step took 122 s here)"
NO_NATIVE_BF16 = (
    "this machine has no native bf16 (core.models.bf16_is_native: no AVX-512 bf16 kernels, "
    "no CUDA): torch computes bf16 on a scalar path here (a 1024x1024 matmul at 0.9 GFLOP/s "
    "against 107 for float32 on a 2-core AVX2 EPYC, 2026-12-07), and a cell's stream attached "
    "old logits to 3 groups in its first 5 minutes (a cell needs about 90). The cells run "
    "in bf16 because its mismatch is what they compare: run them on an AVX-512 machine or a "
    "GPU; --report-only works anywhere."
)
WINDOW = 10  # steps of the final training means
PLOT_WINDOW = 5  # steps of the plotted moving mean (a cell is about 20 steps)
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Arm:
    """One way of anchoring the ratio, as ``--set`` overrides of the shipped profile."""

    name: str
    settings: tuple[str, ...] = ()
    sync: bool = False
    about: str = ""


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("exact", about="exact old logits (stream), decoupled loss, token MIS"),
        Arm(
            "lost",
            ("streams.old_logits.mode=off", "trainer.approx.route=current"),
            about="no old logits; anchor recomputed under the policy being trained",
        ),
        Arm(
            "uncorrected",
            ("streams.old_logits.mode=off", "trainer.approx.route=infer"),
            about="no old logits; ratio to the engine's log-probs only",
        ),
        Arm("sync", sync=True, about="window 0, exact old logits (a sync baseline)"),
    )
}


@dataclass(frozen=True)
class Cell:
    """One run of the grid: an arm, a staleness window and a seed."""

    arm: str
    window: int
    seed: int

    @property
    def name(self) -> str:
        if self.arm == "sync":
            return f"sync-seed{self.seed}"
        return f"{self.arm}-w{self.window}-seed{self.seed}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        """The cell a name stands for; a clear error for anything else."""
        parts = name.strip().split("-")
        try:
            seed = int(parts[-1].removeprefix("seed")) if parts[-1].startswith("seed") else -1
            if parts[0] == "sync" and len(parts) == 2 and seed >= 0:
                return cls("sync", 0, seed)
            if parts[0] in ARMS and parts[0] != "sync" and len(parts) == 3 and seed >= 0:
                window = int(parts[1].removeprefix("w")) if parts[1].startswith("w") else -1
                if window >= 1:
                    return cls(parts[0], window, seed)
        except ValueError:
            pass
        raise ValueError(
            f"unknown cell {name!r}: <arm>-w<window>-seed<n> with arm one of "
            f"{sorted(a for a in ARMS if a != 'sync')} and window >= 1, or sync-seed<n>"
        )

    def settings(self) -> list[str]:
        """The ``--set`` overrides of this cell's run."""
        arm = ARMS[self.arm]
        options = [f"producers.rollout.task_options.{k}={v}" for k, v in TASK_OPTIONS.items()]
        seeds = [f"{section}.seed={self.seed}" for section in
                 ("producers.rollout", "producers.engine", "trainer.engine")]  # fmt: skip
        return [
            # every role in bf16: an fp32 trainer took 122 s a step here (PRECISION_NOTE)
            "profile.precision=bf16",
            f"profile.sync={'true' if arm.sync else 'false'}",
            *([] if arm.sync else [f"profile.staleness_window={self.window}"]),
            *options,
            *seeds,
            f"producers.eval.every_versions={EVAL_EVERY}",
            # a step's 4 groups one micro-batch each: a trainer holding the logits of all 32
            # sequences at once was killed for memory (11 GB in fp32) on the shared machine
            "trainer.batch.max_groups=1",
            "trainer.engine.grad_accum_steps=4",
            *arm.settings,
        ]


def priority(seeds: Sequence[int] = SEEDS) -> list[Cell]:
    """Every cell, most wanted first: window 4 and sync seed by seed, then window 2."""
    order: list[Cell] = []
    for seed in seeds:
        order += [Cell(a, 4, seed) for a in ("exact", "lost", "uncorrected")]
        order.append(Cell("sync", 0, seed))
    for seed in seeds:
        order += [Cell(a, 2, seed) for a in ("exact", "lost")]
    return order


# --- the cell store -----------------------------------------------------------------------


def load_store(path: Path = CELLS) -> dict[str, Any]:
    """The store: ``{"cells": {name: record}, "task": measurement or null}`` (empty when
    the file does not exist yet)."""
    if not path.exists():
        return {"cells": {}, "task": None}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("cells"), dict):
        raise ValueError(f"{path}: not a cell store (a JSON object with a 'cells' object)")
    data.setdefault("task", None)
    return data


def _write_store(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a crash mid-write keeps the previous store


def save_cell(record: dict[str, Any], path: Path = CELLS) -> None:
    """Add one finished cell to the store as soon as it finishes."""
    data = load_store(path)
    data["cells"][record["name"]] = record
    _write_store(data, path)


def save_task(measurement: dict[str, Any], path: Path = CELLS) -> None:
    """Keep the untrained model's task measurement beside the cells."""
    data = load_store(path)
    data["task"] = measurement
    _write_store(data, path)


def pending(wanted: Sequence[Cell], done: dict[str, Any]) -> list[Cell]:
    """The cells of ``wanted`` not saved yet, in order: where a resumed grid starts."""
    return [c for c in wanted if c.name not in done]


# --- one cell's figures ---------------------------------------------------------------------


def _num(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


SERIES = {
    "reward": "reward/mean",
    "correct": "reward/correct_frac",
    "format_ok": "reward/format_ok_frac",
    "clip": "clip/frac",
    "masked": "mis/masked_frac",
    "truncated": "tis/truncated_frac",
    "entropy": "policy/entropy",
    "abs_log_d_mean": "mismatch/abs_log_d/mean",
    "abs_log_d_max": "mismatch/abs_log_d/max",
    "staleness": "staleness/mean",
}


def cell_record(
    cell: Cell, rows: list[dict[str, Any]], evals: list[dict[str, Any]], started: float,
    wall_s: float,
) -> dict[str, Any]:  # fmt: skip
    """What is kept of a run: per-step series, the eval curve and the staleness histogram."""
    elapsed = [_num(r, "time/unix_s") - started for r in rows]
    series: dict[str, list[float]] = {"step": [_num(r, "step") for r in rows], "elapsed_s": elapsed}
    for name, key in SERIES.items():
        series[name] = [round(_num(r, key), 5) for r in rows]
    at_version = {0.0: 0.0, **dict(zip(series["step"], elapsed, strict=True))}  # v0: launch
    held_out = {
        "version": [int(e["version"]) for e in evals],
        "correct": [_num(e, "eval/reward/correct_frac") for e in evals],
        "reward": [_num(e, "eval/reward/mean") for e in evals],
        "elapsed_s": [at_version.get(float(e["version"]), math.nan) for e in evals],
    }
    hist: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("staleness/hist/") and isinstance(value, int | float):
                bucket = key.removeprefix("staleness/hist/")
                hist[bucket] = hist.get(bucket, 0.0) + float(value)
    return {
        "name": cell.name, "arm": cell.arm, "window": cell.window, "seed": cell.seed,
        "steps": len(rows), "wall_s": round(wall_s, 1), "settings": cell.settings(),
        "finished_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "series": series, "eval": held_out, "staleness_hist": hist,
    }  # fmt: skip


def finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if isinstance(v, int | float) and math.isfinite(v)]


def final_mean(values: Sequence[float], window: int = WINDOW) -> float:
    """The mean of the last ``window`` finite values (nan for none)."""
    tail = finite(values)[-window:]
    return statistics.fmean(tail) if tail else math.nan


def first_reaching(values: Sequence[float], target: float) -> int | None:
    """The index of the first value at or above ``target`` (none reaches it: None)."""
    for i, value in enumerate(values):
        if math.isfinite(value) and value >= target:
            return i
    return None


def eval_elapsed(held_out: dict[str, list[float]]) -> list[float]:
    """Seconds from launch at which each evaluated version was published (v0: launch)."""
    versions, seconds = held_out["version"], held_out["elapsed_s"]
    return [0.0 if v == 0 else t for v, t in zip(versions, seconds, strict=True)]


def summary(record: dict[str, Any], target: float) -> dict[str, float]:
    """One cell's figures for the table."""
    s, held_out = record["series"], record["eval"]
    hit = first_reaching(held_out["correct"], target)  # held-out accuracy, not training
    accuracy = finite(held_out["correct"])
    return {
        "eval_first": accuracy[0] if accuracy else math.nan,
        "eval_last": accuracy[-1] if accuracy else math.nan,
        "eval_last_version": held_out["version"][-1] if held_out["version"] else math.nan,
        "correct": final_mean(s["correct"]),
        "reward": final_mean(s["reward"]),
        "steps_to": held_out["version"][hit] if hit is not None else math.nan,
        "seconds_to": eval_elapsed(held_out)[hit] if hit is not None else math.nan,
        "abs_log_d_mean": mean_or_nan(s["abs_log_d_mean"]),
        "abs_log_d_max": max(finite(s["abs_log_d_max"]), default=math.nan),
        **{k: mean_or_nan(s[k]) for k in ("clip", "masked", "truncated", "entropy", "staleness")},
        "wall_s": record["wall_s"],
    }


def mean_or_nan(values: Sequence[float]) -> float:
    clean = finite(values)
    return statistics.fmean(clean) if clean else math.nan


# --- the report -----------------------------------------------------------------------------


def groups(cells: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Saved cells by (arm, window), seeds in order."""
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in sorted(cells.values(), key=lambda r: (r["arm"], r["window"], r["seed"])):
        out.setdefault((record["arm"], record["window"]), []).append(record)
    return out


def table(cells: dict[str, Any], target: float) -> list[str]:
    """The markdown table: one row per (arm, window), mean ± sd over the seeds present."""
    lines = [
        "| arm | window | n | held-out right, first → last eval (version) | train right, "
        f"last {WINDOW} | reward, last {WINDOW} | versions to {target:g} held-out right "
        "(reached) | "
        f"s to {target:g} | \\|log d\\| mean / max | clip | masked | truncated | entropy | "
        "staleness | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: i for i, name in enumerate(ARMS)}
    for (arm, window), records in sorted(
        groups(cells).items(), key=lambda kv: (kv[0][1] == 0, -kv[0][1], order[kv[0][0]])
    ):
        rows = [summary(r, target) for r in records]

        def col(key: str, digits: int = 2, rows: list[dict[str, float]] = rows) -> str:
            return spread(finite([r[key] for r in rows]), digits)

        reached = finite([r["steps_to"] for r in rows])
        seconds = finite([r["seconds_to"] for r in rows])
        steps_to = f"{statistics.median(reached):g}" if reached else "-"
        seconds_to = f"{statistics.median(seconds):.0f}" if seconds else "-"
        versions = sorted({int(v) for r in rows if math.isfinite(v := r["eval_last_version"])})
        lines.append(
            f"| {arm} | {window} | {len(rows)} | {col('eval_first')} → {col('eval_last')} "
            f"({'/'.join(map(str, versions)) or '-'}) | {col('correct')} | {col('reward')} | "
            f"{steps_to} ({len(reached)}/{len(rows)}) | {seconds_to} | "
            f"{col('abs_log_d_mean', 4)} / {col('abs_log_d_max', 2)} | {col('clip', 3)} | "
            f"{col('masked', 4)} | {col('truncated', 3)} | {col('entropy', 2)} | "
            f"{col('staleness', 2)} | {col('wall_s', 0)} |"
        )
    return lines


def staleness_lines(cells: dict[str, Any]) -> list[str]:
    """Each (arm, window)'s share of trained trajectories per staleness bucket."""
    lines = []
    for (arm, window), records in sorted(groups(cells).items()):
        total: dict[str, float] = {}
        for record in records:
            for bucket, count in record["staleness_hist"].items():
                total[bucket] = total.get(bucket, 0.0) + count
        n = sum(total.values()) or 1.0
        shares = ", ".join(f"{b}: {100 * c / n:.0f}%" for b, c in sorted(total.items()) if c)
        lines.append(f"- {arm}, window {window}: {shares or 'none recorded'}")
    return lines


def missing_cells(cells: dict[str, Any]) -> list[str]:
    """The grid's cells not measured yet, in priority order."""
    return [c.name for c in pending(priority(), cells)]


def plot(cells: dict[str, Any], directory: Path = PLOTS) -> list[Path]:
    """Per window: held-out accuracy and training reward against steps and wall-clock,
    one line per arm (the mean over its seeds; sync drawn in every window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    grouped = groups(cells)
    for window in sorted({w for _, w in grouped if w > 0}):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        for (arm, w), records in sorted(grouped.items()):
            if w not in (window, 0):
                continue
            label = f"{arm} (n={len(records)})"
            for record in records:
                s, e = record["series"], record["eval"]
                alpha = 1.0 if record is records[0] else 0.5
                seed_label = label if record is records[0] else None
                color = f"C{list(ARMS).index(arm)}"
                axes[0][0].plot(
                    e["version"], e["correct"], "o-", color=color, alpha=alpha, label=seed_label
                )
                axes[0][1].plot(eval_elapsed(e), e["correct"], "o-", color=color, alpha=alpha)
                values = [v if math.isfinite(v) else 0.0 for v in s["reward"]]
                smooth = moving_mean(values, PLOT_WINDOW)
                axes[1][0].plot(s["step"], smooth, color=color, alpha=alpha)
                axes[1][1].plot(s["elapsed_s"], smooth, color=color, alpha=alpha)
        for ax, (xlabel, ylabel) in zip(
            [a for row in axes for a in row],
            [("version (trainer step)", "held-out answers right (greedy)"),
             ("wall-clock s since launch", "held-out answers right (greedy)"),
             ("trainer step", f"training reward, {PLOT_WINDOW}-step mean"),
             ("wall-clock s since launch", f"training reward, {PLOT_WINDOW}-step mean")],
            strict=True,
        ):  # fmt: skip
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(
            f"SmolLM2-135M, arithmetic two-step, window {window} (+ sync), one line per seed"
        )
        fig.tight_layout()
        path = directory / f"real_model_w{window}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def machine() -> str:
    """``lscpu``'s model name and the core count."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


def untrained_eval(cells: dict[str, Any]) -> tuple[float, float] | None:
    """Held-out accuracy and reward at version 0 (the same checkpoint in every cell)."""
    for record in cells.values():
        held_out = record["eval"]
        if held_out["version"] and held_out["version"][0] == 0:
            return held_out["correct"][0], held_out["reward"][0]
    return None


def report(cells: dict[str, Any], target: float, task: dict[str, Any] | None) -> str:
    """The generated block of ``docs/learning.md``."""
    plots = plot(cells) if cells else []
    steps = sorted({r["steps"] for r in cells.values()})
    dates = sorted(r["finished_utc"] for r in cells.values())
    head = [
        f"Generated by `python -m bench.real_model --report-only` on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC from {len(cells)} saved cell(s) "
        f"(run {dates[0] if dates else '-'} to {dates[-1] if dates else '-'} UTC), "
        f"{machine()}, shared with other jobs; {'/'.join(map(str, steps)) or '-'} trainer steps "
        f"of 4 groups x 8 samples per cell. Task options: `{json.dumps(TASK_OPTIONS)}`; "
        f"held-out split measured greedily every {EVAL_EVERY} versions.",
        "",
    ]
    if task:
        head += [
            f"Untrained model (`--measure-task`, engine bf16): held-out accuracy "
            f"{task['greedy_correct']:.3f} greedy, {task['sampled_correct']:.3f} sampled "
            f"(T = 1, {task['samples']} samples); a correct format alone earns "
            f"{100 * task['format_only_share']:.0f} % of the maximum reward, and "
            f"{100 * task['format_share_untrained']:.0f} % of what the untrained model earns.",
            "",
        ]
    elif untrained := untrained_eval(cells):
        correct, reward = untrained
        fmt = TASK_OPTIONS["format_reward"]
        format_part = (reward - (1 - fmt) * correct) / reward if reward else 1.0
        head += [
            f"Untrained model (version 0 of every cell, greedy, the eval role): held-out "
            f"accuracy {correct:.3f}, reward {reward:.3f}; a correct format alone earns "
            f"{100 * fmt:.0f} % of the maximum reward (and {100 * format_part:.0f} % of "
            "what the untrained model earns: it almost always writes the answer line).",
            "",
        ]
    body = table(cells, target) if cells else ["(no cell measured yet)"]
    missing = missing_cells(cells)
    tail = [
        "",
        "Staleness of the trained trajectories (share per bucket, all seeds):",
        "",
        *staleness_lines(cells),
        "",
        *[f"![{p.stem}](learning/{p.name})" for p in plots],
        "",
        f"Missing cells ({len(missing)}): {', '.join(missing) or 'none'}.",
    ]
    return "\n".join(head + body + tail)


# --- measuring the task and running cells -----------------------------------------------------


def measure_task(samples_per_prompt: int = 4) -> dict[str, Any]:
    """The untrained model on the held-out split, greedy and sampled, in the engine's bf16;
    and how much of the reward the format alone earns."""
    import logging

    import torch

    from core.models import load_model, load_tokenizer
    from producers.engine.engine import Engine
    from producers.engine.requests import SamplingParams
    from producers.tasks.base import TaskContext
    from producers.tasks.catalog import make_task

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    cache = Path.home() / ".cache" / "rollstream"
    tokenizer = load_tokenizer(MODEL, cache_dir=cache)
    task = make_task("arithmetic", TASK_OPTIONS, TaskContext(cache_dir=cache, tokenizer=tokenizer))
    engine = Engine(load_model(MODEL, "bfloat16"), model_path=MODEL, seed=0,
                    eos_token_ids=list(task.stop_token_ids))  # fmt: skip
    prompts = task.eval_prompts()
    out: dict[str, Any] = {}
    for label, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, samples_per_prompt)):
        params = SamplingParams(temperature=temperature, max_new_tokens=task.max_new_tokens,
                                stop_token_ids=tuple(task.stop_token_ids))  # fmt: skip
        asked = [p for p in prompts for _ in range(n)]
        answers = engine.generate([p.ids for p in asked], params)
        scores = [task.reward(p, a.output_ids) for p, a in zip(asked, answers, strict=True)]
        out[f"{label}_correct"] = statistics.fmean(d["correct"] for _, d in scores)
        out[f"{label}_format_ok"] = statistics.fmean(d["format_ok"] for _, d in scores)
        out[f"{label}_reward"] = statistics.fmean(r for r, _ in scores)
    out["samples"] = len(prompts) * samples_per_prompt
    fmt = TASK_OPTIONS["format_reward"]
    out["format_only_share"] = fmt  # the maximum reward is 1.0
    earned = out["sampled_reward"]
    out["format_share_untrained"] = fmt * out["sampled_format_ok"] / earned if earned else 1.0
    return out


def run_cell(cell: Cell, steps: int) -> dict[str, Any]:
    """One ``rollstream up`` run of ``cell``; its record (the run directory is kept)."""
    home = RUNS / cell.name
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    run_dir = home / "run"
    started = time.time()
    wall = run_up(run_dir, steps, cell.settings())
    rows = trainer_rows(run_dir)
    eval_file = run_dir / "eval.jsonl"
    evals = (
        [json.loads(line) for line in eval_file.read_text().splitlines() if line.strip()]
        if eval_file.exists()
        else []
    )
    return cell_record(cell, rows, evals, started, wall)


def write_report(target: float) -> None:
    """Rewrite the doc block and plots from the store."""
    store = load_store()
    replace_block(DOC, BEGIN, END, report(store["cells"], target, store["task"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cells", help="comma-separated cell names (default: the grid in priority order)"
    )
    parser.add_argument("--steps", type=int, default=22, help="trainer steps per cell")
    parser.add_argument(
        "--target", type=float, default=0.15, help="held-out accuracy target (untrained: 0.08)"
    )
    parser.add_argument("--report-only", action="store_true", help="rewrite the doc block only")
    parser.add_argument("--measure-task", action="store_true", help="measure the untrained model")
    args = parser.parse_args()
    if args.steps < 1 or args.steps > 1000:
        parser.error(f"--steps must be within [1, 1000], got {args.steps}")
    if not 0 < args.target <= 1:
        parser.error(f"--target must be within (0, 1], got {args.target}")
    try:
        wanted = [Cell.parse(n) for n in args.cells.split(",")] if args.cells else priority()
    except ValueError as err:
        parser.error(str(err))
    if args.measure_task:
        task = measure_task()
        print(json.dumps(task, indent=1))
        save_task(task)
    if args.report_only or args.measure_task:
        write_report(args.target)
        return
    todo = pending(wanted, load_store()["cells"])
    if todo and not bf16_is_native():
        sys.exit(NO_NATIVE_BF16)
    for cell in todo:
        print(f"{datetime.now(UTC):%H:%M} running {cell.name} ({args.steps} steps)", flush=True)
        try:
            record = run_cell(cell, args.steps)
        except subprocess.SubprocessError as err:
            print(f"{cell.name} failed: {err}; log: {RUNS / cell.name / 'run.log'}", flush=True)
            continue
        save_cell(record)
        print(f"{cell.name}: {json.dumps(summary(record, args.target))}", flush=True)
        write_report(args.target)


if __name__ == "__main__":
    sys.exit(main())
