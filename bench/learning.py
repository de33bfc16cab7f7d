"""Learning under forced staleness: the off-policy ablation grid on the tiny model.

Run from the repository root: ``python -m bench.learning [--quick] [--jobs 2]``.

Every cell trains the tiny Llama on ``reverse-3-digits`` from the same initial weights
with one route of the loss family, with every trained batch exactly ``k`` versions old
(fewer during the first ``k`` steps, when no older version exists). The cell runs the
project's own pieces in one process:

- **generation**: ``producers.engine.engine.Engine`` on a **bf16** copy of the weights
  of version ``n - k`` (the real train-inference mismatch: the trainer is fp32);
- **old logits**: ``streams.oldlogits.OldLogitEngine`` over a ``SnapshotStore`` of recent
  versions, in fp32, exactly as the stream worker computes them;
- **advantages**: ``core.advantages.group_advantages`` (GRPO);
- **training**: ``consumers.step.StepRunner`` on a DeepSpeed engine (world of one, fp32),
  with ``[trainer.ppo]`` minibatches so the clip is a trust region at every staleness.

Routes (``ROUTES``): the total ratio (``grpo``); decoupled with exact old logits, TIS and
MIS (the literature's weighted MIS), the latter also without the dual clip (the PPO
surrogate unbounded for negative advantages); old logits *lost*, anchored on the current
policy (what a pipeline that recomputes them at training time does) or on ``logp_infer``;
PPO-EWMA (old logits lost, EWMA proximal anchor); Mu-GRPO (relaxed clip + NAV on the total
ratio). Per cell: steps and CPU seconds to a reward target, final reward, collapse
(ends below the target with a near-deterministic policy), falls (reached it and ended
below it), clip and mask fractions and the overlap of the two token sets, the largest ratio
the surrogate saw. Seeds change the initial weights, the prompts and the
sampling. CPU seconds (``time.process_time``) rather than wall-clock: the machine is
shared and noisy, CPU time is what a cell costs.

Writes ``docs/learning.md`` (table and short story are written by hand around the
generated block between its markers), ``docs/learning/reward_k<k>.png``, and every cell's
per-step series to ``~/.cache/rollstream/bench/learning-cells.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.figures import moving_mean, replace_block, spread

if TYPE_CHECKING:
    from core.config import LoraConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "learning.md"
PLOTS = ROOT / "docs" / "learning"
RAW = Path.home() / ".cache" / "rollstream" / "bench" / "learning-cells.json"  # 1 MB: not in git
BEGIN, END = "<!-- bench.learning: begin -->", "<!-- bench.learning: end -->"


@dataclass(frozen=True)
class Route:
    """One way of anchoring the ratio, as trainer config plus where logp_old comes from."""

    name: str
    loss: dict[str, Any]
    approx: dict[str, Any] = field(default_factory=dict)
    #: exact: the stream's old logits; current: recomputed under the policy being trained
    #: (old logits lost); off: none attached (the trainer's approximate route)
    old_logits: str = "exact"


ROUTES: tuple[Route, ...] = (
    Route("grpo", {"type": "grpo"}),
    Route("decoupled-tis", {"type": "decoupled", "correction": "tis"}),
    Route("decoupled-mis", {"type": "decoupled", "correction": "mis", "mis_weight": "discrepancy"}),
    Route(
        "decoupled-mis-no-dual",
        {"type": "decoupled", "correction": "mis", "mis_weight": "discrepancy", "dual_clip": None},
    ),
    Route("lost-current", {"type": "decoupled", "correction": "mis"}, old_logits="current"),
    Route("lost-infer", {"type": "decoupled"}, {"route": "infer"}, old_logits="off"),
    Route("ppo-ewma", {"type": "ppo_ewma"}, {"route": "ewma"}, old_logits="off"),
    Route("mu-grpo", {"type": "mu_grpo"}),
)


@dataclass(frozen=True)
class Settings:
    """What every cell shares."""

    steps: int = 300
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 3e-3
    epochs: int = 1
    minibatches: int = 2
    temperature: float = 1.0
    target: float = 0.5  # 10-step mean reward
    task: str = "reverse-3-digits"
    task_options: tuple[tuple[str, Any], ...] = ()
    #: stream data operators applied to each group before training (``streams.operators``);
    #: groups are generated until ``prompts_per_step`` pass (at most 4x), as DAPO does
    operators: tuple[dict[str, Any], ...] = ()
    #: ``[producers.rollout.curriculum]`` keys: prompts are drawn through
    #: ``producers.rollout.curriculum.Curriculum`` fed with every generated group's statistics
    curriculum: tuple[tuple[str, Any], ...] = ()
    #: train a LoRA adapter instead of every weight: the trainer, the generator and the
    #: old-logit model all carry it, so a version's state dict (base + adapter, PEFT names)
    #: loads into each as it is
    lora: LoraConfig | None = None


@dataclass
class CellResult:
    route: str
    staleness: int
    seed: int
    rewards: list[float]
    entropy: list[float]  # -mean logp_infer of sampled tokens: an entropy estimate
    clip_frac: list[float]
    mask_frac: list[float]
    overlap_frac: list[float]
    cpu_s: list[float]  # cumulative CPU seconds at the end of each step
    versions: list[int]  # the version that generated each step's batch
    zero_adv: list[float] = field(default_factory=list)  # share of trained groups, A = 0
    generated: list[int] = field(default_factory=list)  # groups generated for the step
    generated_flat: list[int] = field(default_factory=list)  # of which rewards all equal
    ratio_max: list[float] = field(default_factory=list)  # largest ratio the surrogate saw

    def smoothed(self, window: int = 10) -> list[float]:
        return moving_mean(self.rewards, window)

    def step_to(self, target: float) -> int | None:
        for i, value in enumerate(self.smoothed()):
            if value >= target:
                return i + 1
        return None

    def final(self, window: int = 20) -> float:
        return statistics.fmean(self.rewards[-window:])

    def collapsed(self, target: float) -> bool:
        return self.final() < target and statistics.fmean(self.entropy[-20:]) < 0.1

    def fell(self, target: float) -> bool:
        """Reached the target, then ended below it (a collapse whatever the entropy does)."""
        return self.step_to(target) is not None and self.final() < target


@dataclass
class Rig:
    """The pieces one cell trains with (see the module doc)."""

    trainer: Any  # consumers.train_engine.TrainEngine
    runner: Any  # consumers.step.StepRunner
    generator: Any  # producers.engine.engine.Engine, bf16
    history: Any  # streams.snapshots.InMemorySource: fp32 weights by version
    old_logits: Any  # streams.oldlogits.OldLogitEngine over the history
    current_model: Any  # fp32 module for logp under the current weights
    task: Any
    params: Any
    rng: random.Random

    def generate_at(self, version: int) -> None:
        """Load ``version``'s weights into the generator (cast to bf16)."""
        import torch

        state = self.history.load(version)
        self.generator.model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})

    def record_version(self, version: int, keep_from: int) -> None:
        """Store the trainer's weights as ``version``; forget versions before ``keep_from``."""
        self.history.states[version] = _fp32_copy(self.trainer.state_dict())
        for old in [v for v in self.history.states if v < keep_from]:
            del self.history.states[old]
        self.old_logits.snapshots.retain(keep_from)


def build_rig(route: Route, seed: int, settings: Settings, **trainer: Any) -> Rig:
    """A fresh cell: the tiny model of ``seed`` on both sides, ``trainer`` sections merged
    into the trainer config."""
    import torch

    from consumers.config import TrainerConfig
    from consumers.step import StepRunner
    from consumers.train_engine import TrainEngine
    from core.models import EOS_ID, PAD_ID, load_model
    from producers.engine.engine import Engine
    from producers.engine.requests import SamplingParams
    from producers.tasks.base import TaskContext
    from producers.tasks.catalog import make_task
    from streams.config import OldLogitsConfig
    from streams.oldlogits import OldLogitEngine
    from streams.snapshots import InMemorySource, SnapshotStore

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    spec = f"tiny:seed={seed}"
    config = TrainerConfig.model_validate(
        {
            "model": spec,
            "engine": {"lr": settings.lr, "zero_stage": 0, "bf16": False, "seed": seed},
            "loss": route.loss,
            "approx": route.approx,
            "ppo": {"epochs": settings.epochs, "minibatches": settings.minibatches},
            **trainer,
        }
    )
    lora = settings.lora
    engine = TrainEngine(
        load_model(spec, "float32", lora=lora),
        config.engine,
        frozen_copies=StepRunner.frozen_copies_needed(config),
    )
    history = InMemorySource({0: _fp32_copy(engine.state_dict())})
    options = dict(settings.task_options)
    task = make_task(settings.task, options, TaskContext(cache_dir=Path.home() / ".cache"))
    return Rig(
        trainer=engine,
        runner=StepRunner(engine, config, pad_id=PAD_ID),
        generator=Engine(
            load_model(spec, "bfloat16", lora=lora),
            model_path=spec,
            seed=seed,
            eos_token_ids=[EOS_ID],
        ),
        history=history,
        old_logits=OldLogitEngine(
            OldLogitsConfig(model=spec, dtype="float32"),
            SnapshotStore(history, budget_bytes=1 << 30, dtype=torch.float32),
            lora=lora,
        ),
        current_model=load_model(spec, "float32", lora=lora),
        task=task,
        params=SamplingParams(
            temperature=settings.temperature,
            max_new_tokens=task.max_new_tokens,
            stop_token_ids=tuple(task.stop_token_ids),
        ),
        rng=random.Random(seed),
    )


def run_cell(route: Route, staleness: int, seed: int, settings: Settings) -> CellResult:
    """Train one cell; see the module doc."""
    import numpy as np
    import torch

    from core.logprobs import response_logprobs
    from schemas.trajectory import OldLogitsStatus, Trajectory
    from streams.operators import Keep, apply_chain, build_chain

    rig = build_rig(route, seed, settings)
    trainer, runner = rig.trainer, rig.runner
    old_logits, current_model = rig.old_logits, rig.current_model
    chain = build_chain(list(settings.operators))
    stats = curriculum = None
    if settings.curriculum:
        from producers.config import CurriculumConfig
        from producers.rollout.curriculum import Curriculum

        stats = GeneratedStats()
        config = CurriculumConfig(enabled=True, **dict(settings.curriculum))
        curriculum = Curriculum(config, stats.view)
    result = CellResult(route.name, staleness, seed, [], [], [], [], [], [], [])
    started = time.process_time()
    for step in range(settings.steps):
        version = max(0, step - staleness)
        rig.generate_at(version)
        groups: list[list[Trajectory]] = []
        generated = flat = 0
        train = True
        while len(groups) < settings.prompts_per_step and generated < 4 * settings.prompts_per_step:
            batch = _generate_groups(
                rig,
                settings,
                version,
                f"{step}-{generated}",
                curriculum,
                count=settings.prompts_per_step - len(groups),
            )
            if stats is not None:
                stats.add(batch)
            flat += sum(_flat(g) for g in batch)
            generated += len(batch)
            groups.extend(
                g for g in batch if not chain or isinstance(apply_chain(chain, g).decision, Keep)
            )
        groups = groups[: settings.prompts_per_step]
        result.generated.append(generated)
        result.generated_flat.append(flat)
        if groups:
            result.zero_adv.append(sum(_flat(g) for g in groups) / len(groups))
        else:  # operators filtered every group generated: the stream would emit nothing
            groups, train = batch, False
        rewards = [t.reward for g in groups for t in g]
        records = [t for g in groups for t in g]
        records = [r for r in records if r.num_response_tokens > 0]
        if route.old_logits == "exact":
            records = old_logits.attach(records)
        elif route.old_logits == "current":
            current = trainer.state_dict()
            pairs = [(r.prompt_ids, r.response_ids) for r in records]
            logps = response_logprobs(current_model, pairs, torch.float32, state=current)
            records = [r.with_old_logits(lp) for r, lp in zip(records, logps, strict=True)]
        else:
            off = OldLogitsStatus.OFF.value
            records = [dataclasses.replace(r, old_logits_status=off) for r in records]
        metrics = runner.train_step([records], step=step).metrics if train else {}
        rig.record_version(step + 1, keep_from=step + 1 - staleness)

        tokens = np.concatenate([r.logp_infer for r in records])
        result.rewards.append(float(np.mean(rewards)))
        result.entropy.append(float(-tokens.mean()))
        result.clip_frac.append(metrics.get("clip/frac", 0.0))
        masked = metrics.get("mis/masked_frac", metrics.get("nav/vetoed_frac", 0.0))
        if "train_infer/kept_frac" in metrics:
            masked = 1.0 - metrics["train_infer/kept_frac"]
        result.mask_frac.append(masked)
        result.overlap_frac.append(metrics.get("clip/masked_overlap_frac", 0.0))
        result.ratio_max.append(metrics.get("ratio/max", 1.0))
        result.cpu_s.append(time.process_time() - started)
        result.versions.append(version)
    return result


def _generate_groups(
    rig: Rig,
    settings: Settings,
    version: int,
    prefix: str,
    curriculum: Any = None,
    count: int | None = None,
) -> list[list[Any]]:
    """``prompts_per_step`` GRPO groups sampled at ``version`` by ``rig``'s generator from
    its task, with advantages (prompts drawn through ``curriculum``, a
    ``producers.rollout.curriculum.Curriculum``, if given)."""
    from core.advantages import group_advantages
    from schemas.trajectory import Trajectory

    generator, task, rng, params = rig.generator, rig.task, rig.rng, rig.params

    def draw() -> Any:
        return task.sample(rng)

    prompts = [
        curriculum.choose(draw) if curriculum is not None else draw()
        for _ in range(count or settings.prompts_per_step)
    ]
    inputs = [p.ids for p in prompts for _ in range(settings.group_size)]
    outputs = generator.generate(inputs, params, return_logprob=True)
    rewards = [
        task.reward(prompts[i // settings.group_size], out.output_ids)[0]
        for i, out in enumerate(outputs)
    ]
    members = [i // settings.group_size for i in range(len(outputs))]
    advantages = group_advantages(rewards, members).advantages
    groups: list[list[Any]] = [[] for _ in prompts]
    for i, out in enumerate(outputs):
        if not out.output_ids:
            continue
        groups[members[i]].append(
            Trajectory.create(
                run_id="bench",
                trajectory_id=f"{prefix}-{i}",
                group_id=f"{prefix}-{members[i]}",
                group_size=settings.group_size,
                sample_index=i % settings.group_size,
                producer_id="bench",
                region="local",
                task=settings.task,
                prompt_ids=inputs[i],
                response_ids=out.output_ids,
                logp_infer=out.output_logprobs,
                segment_versions=[version],
                segment_lengths=[len(out.output_ids)],
                reward=rewards[i],
                reward_details={},
                finish_reason="stop",
                created_at_ms=0,
                finished_at_ms=0,
            ).with_advantage(float(advantages[i]))
        )
    return [g for g in groups if g]


def _flat(group: list[Any]) -> bool:
    """All rewards equal: zero advantage, zero gradient."""
    return max(t.reward for t in group) == min(t.reward for t in group)


class GeneratedStats:
    """Per-prompt statistics of every generated group, as the stream would publish them
    (one partition), folded into a ``producers.rollout.curriculum.PromptStatsView``."""

    def __init__(self, pass_threshold: float = 1.0) -> None:
        from producers.rollout.curriculum import PromptStatsView

        self.view = PromptStatsView("bench")
        self.pass_threshold = pass_threshold
        self.totals: dict[str, tuple[int, int, float]] = {}

    def add(self, groups: list[list[Any]]) -> None:
        from schemas.control import PromptStats, prompt_key

        for group in groups:
            key = prompt_key(group[0].prompt_ids)
            n, passes, total = self.totals.get(key, (0, 0, 0.0))
            n += len(group)
            passes += sum(t.reward >= self.pass_threshold for t in group)
            total += sum(t.reward for t in group)
            self.totals[key] = (n, passes, total)
            self.view.apply(PromptStats("bench", key, 0, n, passes, total, 0).to_json())


def _fp32_copy(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().float().clone() for k, v in state.items()}


def _run(args: tuple[Route, int, int, Settings]) -> CellResult:
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return run_cell(*args)


# --- the report -----------------------------------------------------------------------


def table(cells: list[CellResult], settings: Settings) -> str:
    """The markdown table: one row per (staleness, route)."""
    lines = [
        f"| k | route | steps to {settings.target:g} (median, reached) | CPU s to target "
        "(median) | final reward (mean ± sd) | collapses | fell after reaching | clip frac | "
        "mask frac | clip∩mask | largest ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(c.staleness, c.route) for c in cells}, key=lambda k: (k[0], _order(k[1])))
    for k, route in keys:
        group = [c for c in cells if c.staleness == k and c.route == route]
        steps = [c.step_to(settings.target) for c in group]
        reached = [s for s in steps if s is not None]
        cpu = [c.cpu_s[s - 1] for c, s in zip(group, steps, strict=True) if s is not None]
        lines.append(
            f"| {k} | {route} | "
            f"{statistics.median(reached) if reached else '-'} ({len(reached)}/{len(group)}) | "
            f"{f'{statistics.median(cpu):.0f}' if cpu else '-'} | "
            f"{spread([c.final() for c in group])} | "
            f"{sum(c.collapsed(settings.target) for c in group)}/{len(group)} | "
            f"{sum(c.fell(settings.target) for c in group)}/{len(group)} | "
            f"{statistics.fmean(x for c in group for x in c.clip_frac):.3f} | "
            f"{statistics.fmean(x for c in group for x in c.mask_frac):.3f} | "
            f"{statistics.fmean(x for c in group for x in c.overlap_frac):.4f} | "
            f"{_median_of_largest(c.ratio_max for c in group)} |"
        )
    return "\n".join(lines)


def _median_of_largest(series: Iterable[list[float]]) -> str:
    """The median over cells of each cell's largest value (the table's spike columns)."""
    largest = [max(values) for values in series if values]
    return f"{statistics.median(largest):.3g}" if largest else "-"


def _order(route: str) -> int:
    names = [r.name for r in ROUTES]
    return names.index(route) if route in names else len(names)


def plot(cells: list[CellResult], directory: Path) -> list[Path]:
    """One PNG per staleness level: 10-step mean reward vs step, mean over seeds per route."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for k in sorted({c.staleness for c in cells}):
        fig, ax = plt.subplots(figsize=(7, 4))
        for route in sorted({c.route for c in cells}, key=_order):
            group = [c.smoothed() for c in cells if c.staleness == k and c.route == route]
            if not group:
                continue
            mean = [statistics.fmean(v) for v in zip(*group, strict=True)]
            ax.plot(range(1, len(mean) + 1), mean, label=route)
        ax.set(title=f"staleness k = {k}", xlabel="trainer step", ylabel="reward (10-step mean)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        path = directory / f"reward_k{k}.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def write_doc(text: str) -> None:
    """Replace the generated block of ``docs/learning.md`` (or append it)."""
    replace_block(DOC, BEGIN, END, text)


def _rounded(cell: dict[str, Any]) -> dict[str, Any]:
    """Per-step series at 4 decimals: the raw data stays small enough to keep in docs/."""
    return {
        k: [round(x, 4) if isinstance(x, float) else x for x in v] if isinstance(v, list) else v
        for k, v in cell.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--staleness", default="0,2,4,8", help="comma-separated k values")
    parser.add_argument("--routes", default=",".join(r.name for r in ROUTES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--minibatches", type=int, default=Settings.minibatches)
    parser.add_argument("--epochs", type=int, default=Settings.epochs)
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--prompts", type=int, default=Settings.prompts_per_step)
    parser.add_argument("--jobs", type=int, default=2, help="cells run in parallel")
    parser.add_argument("--quick", action="store_true", help="k 0,4; 3 routes; 1 seed; 60 steps")
    parser.add_argument("--no-doc", action="store_true", help="print only, write no docs")
    args = parser.parse_args()
    ks = [int(k) for k in args.staleness.split(",")]
    names = args.routes.split(",")
    seeds, steps = args.seeds, args.steps
    if args.quick:
        ks, names, seeds, steps = [0, 4], ["grpo", "decoupled-mis", "lost-current"], 1, 60
    unknown = sorted(set(names) - {r.name for r in ROUTES})
    if unknown:
        parser.error(f"unknown routes {unknown}; known: {[r.name for r in ROUTES]}")
    settings = Settings(
        steps=steps,
        epochs=args.epochs,
        minibatches=args.minibatches,
        lr=args.lr,
        prompts_per_step=args.prompts,
    )
    routes = [r for r in ROUTES if r.name in names]
    jobs = [(r, k, s, settings) for k in ks for r in routes for s in range(seeds)]
    print(f"{len(jobs)} cells x {steps} steps, {args.jobs} in parallel", flush=True)
    started = time.perf_counter()
    cells: list[CellResult] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for cell in pool.map(_run, jobs):
            cells.append(cell)
            print(
                f"k={cell.staleness} {cell.route:14s} seed {cell.seed}: final "
                f"{cell.final():.2f}, to {settings.target:g} at {cell.step_to(settings.target)}, "
                f"{cell.cpu_s[-1]:.0f} CPU s",
                flush=True,
            )
    elapsed = time.perf_counter() - started
    header = (
        f"Generated by `python -m bench.learning` on "
        f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}, {platform.machine()} with "
        f"{os.cpu_count()} cores, {elapsed / 60:.0f} min wall-clock. Settings: "
        f"{json.dumps(asdict(settings))}; seeds 0..{seeds - 1}."
    )
    report = header + "\n\n" + table(cells, settings)
    print(report)
    if not args.no_doc:
        plots = plot(cells, PLOTS)
        images = "\n".join(f"![{p.stem}](learning/{p.name})" for p in plots)
        write_doc(report + "\n\n" + images)
        RAW.parent.mkdir(parents=True, exist_ok=True)
        RAW.write_text(json.dumps([_rounded(asdict(c)) for c in cells], separators=(",", ":")))
        print(f"wrote {DOC.relative_to(ROOT)}, {len(plots)} plots; per-step data in {RAW}")
    if any(math.isnan(c.final()) for c in cells):
        raise SystemExit("a cell produced NaN rewards")


if __name__ == "__main__":
    main()
