"""A collapse, the guard that sees it, and the rolled-back run, on the tiny model.

Run from the repository root: ``python -m bench.guards [--seeds 2] [--steps 300]``.

Each run is ``bench.learning``'s cell (``decoupled-mis``: exact old logits, discrepancy-
weighted MIS; lr 3e-3, forced staleness 4, 16 prompts x 8 samples, reverse-3-digits) with
the trainer's stability guards (``consumers.guards``) judging every step, real DeepSpeed
checkpoints every 10 steps (``consumers.checkpoint.CheckpointManager``) and the trainer's
rollback: rewind to the newest healthy checkpoint older than the first abnormal data, the
learning rate scaled, the seeds moved.

The EOS-only trap (the policy emits only EOS, every group's rewards are equal, so every
advantage is zero and no gradient leads back) is looked for in plain runs (``--search``),
and induced where it does not come by itself (``--collapse-at``): after that step the
trainer's weights are edited so that EOS wins every position (the embedding row of EOS,
tied to the output head, moved along the mean final hidden state), which is the trap's
end state. Arms per seed: ``unguarded`` (the trap, kept) and ``guarded`` (flat-reward guard,
3 consecutive batches, action rollback).

Prints a table (and ``--doc`` appends it to ``docs/learning.md``'s guards block); the
per-step series go to ``~/.cache/rollstream/bench/guards-runs.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.figures import moving_mean, replace_block
from bench.learning import ROUTES, Settings, _generate_groups, build_rig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "learning.md"
RAW = Path.home() / ".cache" / "rollstream" / "bench" / "guards-runs.json"
BEGIN, END = "<!-- bench.guards: begin -->", "<!-- bench.guards: end -->"
ROUTE = next(r for r in ROUTES if r.name == "decoupled-mis")
GUARDS: dict[str, Any] = {
    "flat_rewards": {"steps": 3, "action": "rollback"},
    "rollback": {"max": 2, "lr_factor": 1.0, "reseed": True},
}


@dataclass
class GuardedRun:
    arm: str
    seed: int
    staleness: int
    collapse_at: int | None
    rewards: list[float] = field(default_factory=list)
    flat_frac: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)  # policy/entropy of the trainer
    trips: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    cpu_s: float = 0.0
    eos_margin: float = float("nan")  # EOS logit over the next best after the edit

    def final(self, window: int = 10) -> float:
        return statistics.fmean(self.rewards[-window:])

    def first_flat(self) -> int | None:
        """The first step (1-based) whose batch had every group flat, after a collapse."""
        start = self.collapse_at or 0
        return next((i + 1 for i, f in enumerate(self.flat_frac) if i >= start and f >= 1), None)


def force_eos(engine: Any, prompts: list[list[int]], gap: float = 60.0) -> float:
    """Edit the trainer's weights so that EOS is the first token of every answer: the EOS
    row of the (tied) output head moves along the least-squares direction that lifts its
    logit over every other token by at least ``gap`` at the last position of every prompt
    (``prompts``: all of the task's). Returns the smallest margin reached. The gap is wide
    because the in-flight groups of the versions before the edit (staleness 4) and Adam's
    momentum still push the policy for a few steps: at 20 (at step 12) and at 60 (at step
    205) they pulled it back out (docs/learning.md)."""
    import torch

    from core.models import EOS_ID

    module = engine.module
    head = module.get_output_embeddings().weight
    batch = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(20):
            out = module(input_ids=batch, output_hidden_states=True)
            logits = out.logits[:, -1, :].float()
            others = logits.clone()
            others[:, EOS_ID] = -float("inf")
            margin = logits[:, EOS_ID] - others.max(dim=1).values
            if float(margin.min()) >= gap:
                break
            states = out.hidden_states[-1][:, -1, :].float()
            need = (gap + 5.0 - margin).clamp(min=0.0)[:, None]
            delta = torch.linalg.lstsq(states, need).solution[:, 0]
            head[EOS_ID] += delta.to(head.dtype)
    return float(margin.min())


def all_prompts() -> list[list[int]]:
    """Every prompt of reverse-3-digits: BOS d1 d2 d3 SEP."""
    from core.models import BOS_ID, DIGIT0_ID, SEP_ID

    return [
        [BOS_ID, DIGIT0_ID + a, DIGIT0_ID + b, DIGIT0_ID + c, SEP_ID]
        for a in range(10)
        for b in range(10)
        for c in range(10)
    ]


def run(
    arm: str,
    seed: int,
    settings: Settings,
    staleness: int,
    *,
    guards: dict[str, Any] | None,
    collapse_at: int | None,
    every: int = 10,
    eos_gap: float = 60.0,
) -> GuardedRun:
    """One run; ``guards`` None: measured, never acted on."""
    import torch

    from consumers.checkpoint import CheckpointManager, TrainerState
    from consumers.config import CheckpointConfig
    from consumers.guard_config import GuardsConfig
    from consumers.guards import Guards, measure

    rig = build_rig(ROUTE, seed, settings)
    config = GuardsConfig.model_validate(guards or {"non_finite": {"enabled": False}})
    keeper = Guards(config)
    result = GuardedRun(arm, seed, staleness, collapse_at)
    started = time.process_time()
    with tempfile.TemporaryDirectory(prefix="bench-guards-") as tmp:
        checkpoints = CheckpointManager(
            CheckpointConfig(dir=Path(tmp), every=every, keep=3, fsync=False)
        )
        for step in range(settings.steps):
            version = max(0, step - staleness)
            rig.generate_at(version)
            groups = _generate_groups(rig, settings, version, f"{step}")
            records = [t for g in groups for t in g if t.num_response_tokens > 0]
            records = rig.old_logits.attach(records)
            metrics = rig.runner.train_step([records], step=step).metrics
            signals = measure(records, metrics, since_version=keeper.state.since_version)
            decision = keeper.observe(step + 1, signals)
            result.rewards.append(statistics.fmean(t.reward for g in groups for t in g))
            result.flat_frac.append(measure(records, {}).flat_frac or 0.0)
            result.entropy.append(metrics.get("policy/entropy", float("nan")))
            for trip in decision.trips:
                result.trips.append({"step": step + 1, "guard": trip.guard, "action": trip.action})
            if collapse_at is not None and step + 1 == collapse_at:
                result.eos_margin = force_eos(rig.trainer, all_prompts(), eos_gap)
            if guards is not None and decision.action == "rollback" and decision.main:
                kept = checkpoints.kept()
                target = keeper.rollback_target(decision.main, kept)
                if target is not None:
                    state = checkpoints.load_tag(rig.trainer, target)
                    rig.runner.load_state_dict(state.runner)
                    keeper.rolled_back(step + 1, kept, state.step)
                    rig.trainer.set_peak_lr(settings.lr * keeper.lr_factor())
                    shift = keeper.seed_shift()
                    rig.runner.seed_shift = shift
                    rig.rng = random.Random(seed + 7919 * shift)
                    rig.generator.generator.manual_seed(seed + 7919 * shift)
                    torch.manual_seed(seed + shift)
                    result.rollbacks.append(
                        {"at": step + 1, "to": state.step, "guard": decision.main.guard}
                    )
            elif guards is not None and decision.action == "stop":
                break
            rig.record_version(step + 1, keep_from=step + 1 - staleness)
            if (step + 1) % every == 0:
                tag = checkpoints.save(
                    rig.trainer,
                    TrainerState(step=step + 1, runner=rig.runner.state_dict()),
                )
                keeper.mark_checkpoint(tag, list(checkpoints.kept()))
    result.cpu_s = time.process_time() - started
    return result


def _run(args: tuple[Any, ...]) -> GuardedRun:
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    arm, seed, settings, staleness, guards, collapse_at, gap = args
    return run(arm, seed, settings, staleness, guards=guards, collapse_at=collapse_at, eos_gap=gap)


def table(runs: list[GuardedRun], target: float) -> str:
    lines = [
        "| seed | arm | collapse after step | first all-flat batch | guard tripped "
        "| rollback (at → to) | 10-step mean at the collapse | 30 steps later | final "
        f"(last 10) | ≥ {target:g} | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        trips = ", ".join(f"{t['guard']} {t['action']} @{t['step']}" for t in r.trips[:3])
        backs = ", ".join(f"{b['at']} → {b['to']}" for b in r.rollbacks) or "-"
        smooth = moving_mean(r.rewards, 10)
        at = r.collapse_at or 0
        before = smooth[at - 1] if at else float("nan")
        later = smooth[min(at + 29, len(smooth) - 1)] if at else float("nan")
        lines.append(
            f"| {r.seed} | {r.arm} | {r.collapse_at or '-'} | {r.first_flat() or '-'} | "
            f"{trips or '-'} | {backs} | {before:.2f} | {later:.2f} | {r.final():.2f} | "
            f"{'yes' if r.final() >= target else 'no'} | {r.cpu_s:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="2", help="comma-separated tiny-model seeds")
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--collapse-at", type=int, default=205, help="0: no induced collapse")
    parser.add_argument("--eos-gap", type=float, default=60.0, help="EOS logit lead of the edit")
    parser.add_argument("--search", action="store_true", help="plain guarded runs only")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--doc", action="store_true", help="write the table into the doc")
    args = parser.parse_args()
    settings = Settings(steps=args.steps)
    seeds = [int(s) for s in args.seeds.split(",")]
    collapse = args.collapse_at or None
    if args.search:
        jobs = [("plain", s, settings, args.staleness, GUARDS, None, 0.0) for s in seeds]
    else:
        jobs = [
            (arm, s, settings, args.staleness, guards, collapse, args.eos_gap)
            for s in seeds
            for arm, guards in (("unguarded", None), ("guarded", GUARDS))
        ]
    started = time.perf_counter()
    runs: list[GuardedRun] = []
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(_run, jobs))
    else:
        runs = [_run(job) for job in jobs]
    elapsed = time.perf_counter() - started
    header = (
        f"Generated by `python -m bench.guards --seeds {args.seeds} --steps {args.steps} "
        f"--collapse-at {args.collapse_at} --eos-gap {args.eos_gap:g}"
        f"{' --search' if args.search else ''}` on "
        f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}, {platform.machine()} with "
        f"{os.cpu_count()} cores (shared), {elapsed / 60:.0f} min wall-clock. Route "
        f"`{ROUTE.name}`, forced staleness {args.staleness}, guards {json.dumps(GUARDS)}."
    )
    margins = ", ".join(f"{r.eos_margin:.1f}" for r in runs if r.collapse_at)
    if margins:
        header += f" EOS logit over the next best after the edit (least over prompts): {margins}."
    report = header + "\n\n" + table(runs, settings.target)
    print(report)
    RAW.parent.mkdir(parents=True, exist_ok=True)
    RAW.write_text(json.dumps([asdict(r) for r in runs]))
    if args.doc:
        replace_block(DOC, BEGIN, END, report)


if __name__ == "__main__":
    main()
