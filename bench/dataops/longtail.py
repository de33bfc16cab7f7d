"""Length bias of the staleness window: who gets discarded, and what the remedies change.

In an asynchronous pipeline a long response takes longer to generate, so it reaches the
trainer more versions behind: the staleness window discards long rollouts first and
training drifts towards short answers. This benchmark models that on the tiny model and
the ``repeat-digit`` task (answers of 2 to 20 tokens) with the project's engine, old-logit
engine and trainer step (``bench.learning.build_rig``):

- every step the engine generates 16 groups at the current version; a group becomes
  ready ``max response tokens // --tokens-per-version`` versions later (generation time
  in trainer steps; 6 tokens a version by default: with the window of 2, answers of 18
  tokens or more, the right answers for 8 and 9 among them, arrive over the window), and
  waits in a queue until then;
- the trainer takes at most 16 ready groups a step, by arrival (first ready first) or by
  deadline (oldest version first, ``[trainer.batch] order = "deadline"``); a group over
  the window (``max_staleness``) is discarded (``over_window = "route"``) or trained with
  the relaxed clip up to twice the window (``"relaxed_clip"``).

Reported per setting: discard rate (groups), mean response length of discarded vs trained
groups, final reward (last 20 steps), mean staleness trained.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench.learning import ROUTES, Settings, _generate_groups, build_rig

SETTINGS = (
    ("arrival", "route"),
    ("deadline", "route"),
    ("arrival", "relaxed_clip"),
    ("deadline", "relaxed_clip"),
)


@dataclass
class LongTailResult:
    order: str
    over_window: str
    seed: int
    discarded_lengths: list[float] = field(default_factory=list)
    trained_lengths: list[float] = field(default_factory=list)
    trained_staleness: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


def run(order: str, over_window: str, seed: int, steps: int, window: int, per_version: int
        ) -> LongTailResult:  # fmt: skip
    """One setting; see the module doc."""
    route = next(r for r in ROUTES if r.name == "decoupled-mis")
    settings = Settings(steps=steps, task="repeat-digit")
    rig = build_rig(
        route,
        seed,
        settings,
        staleness={"max_staleness": window, "over_window": over_window},
    )
    hard = rig.runner.config.staleness.route_limit()
    result = LongTailResult(order, over_window, seed)
    queue: list[tuple[int, int, list[Any]]] = []  # (ready at step, version, group)
    for step in range(steps):
        rig.generate_at(step)
        for group in _generate_groups(rig, settings, step, f"{step}"):
            longest = max(t.num_response_tokens for t in group)
            queue.append((step + longest // per_version, step, group))
        ready = [q for q in queue if q[0] <= step]
        ready.sort(key=(lambda q: (q[1], q[0])) if order == "deadline" else (lambda q: q[0]))
        taken, trained = ready[: settings.prompts_per_step], []
        for entry in taken:
            queue.remove(entry)
            _, version, group = entry
            length = statistics.fmean(t.num_response_tokens for t in group)
            if step - version > hard:
                result.discarded_lengths.append(length)
                continue
            trained.append((step - version > window, group))
            result.trained_lengths.append(length)
            result.trained_staleness.append(step - version)
        if trained:
            relaxed = {t.trajectory_id for over, g in trained if over for t in g}
            records = rig.old_logits.attach([t for _, g in trained for t in g])
            rig.runner.train_step([records], step=step, relaxed=relaxed)
            result.rewards.append(statistics.fmean(t.reward for _, g in trained for t in g))
        rig.record_version(step + 1, keep_from=step + 1 - 4 * window - 8)
    return result


def _run(args: tuple) -> LongTailResult:
    return run(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--tokens-per-version", type=int, default=6)
    parser.add_argument("--jobs", type=int, default=2)
    args, _ = parser.parse_known_args()
    jobs = [
        (order, over, seed, args.steps, args.window, args.tokens_per_version)
        for order, over in SETTINGS
        for seed in range(args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_run, jobs))
    print(f"repeat-digit, window {args.window}, a group is ready max_len // "
          f"{args.tokens_per_version} versions after it starts, {args.steps} steps, "
          f"{args.seeds} seed(s)")  # fmt: skip
    print("| order | over window | discarded groups | mean length discarded | mean length "
          "trained | mean staleness trained | final reward |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for order, over in SETTINGS:
        mine = [r for r in results if r.order == order and r.over_window == over]
        discarded = [x for r in mine for x in r.discarded_lengths]
        trained = [x for r in mine for x in r.trained_lengths]
        share = len(discarded) / max(len(discarded) + len(trained), 1)
        mean_d = f"{statistics.fmean(discarded):.1f}" if discarded else "-"
        lags = [x for r in mine for x in r.trained_staleness]
        stale = statistics.fmean(lags) if lags else float("nan")
        finals = [statistics.fmean(r.rewards[-20:]) for r in mine if r.rewards]
        final = statistics.fmean(finals) if finals else float("nan")
        print(f"| {order} | {over} | {share:.1%} | {mean_d} | "
              f"{statistics.fmean(trained) if trained else float('nan'):.1f} | {stale:.2f} | "
              f"{final:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
