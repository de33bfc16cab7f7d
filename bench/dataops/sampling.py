"""Dynamic sampling and the curriculum on the tiny task: how much generation is wasted.

Runs ``bench.learning`` cells (engine bf16, exact old logits, decoupled MIS, staleness
``--staleness``, ``--task``) for ``--steps`` steps under four settings: nothing; the
``zero_variance`` operator (groups generated until a step's 16 pass, at most 4x, as DAPO
fills its batch); the curriculum (``producers.rollout.curriculum.Curriculum`` skips prompts whose
pass rate reached 0.9 after 8 samples, fed with every generated group's statistics as the
stream publishes them); both. Reports, over ``--seeds`` seeds: the share of trained groups
whose rewards are all equal (zero advantage, zero gradient; target 0 with the operator),
the share of *generated* groups with zero advantage (the generation wasted), groups
generated per trained group, final reward and CPU seconds.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from bench.learning import ROUTES, CellResult, Settings, _run

#: name -> (operators, curriculum)
SETTINGS: dict[str, tuple[tuple, tuple]] = {
    "off": ((), ()),
    "zero_variance": (({"name": "zero_variance"},), ()),
    "curriculum": ((), (("max_pass_rate", 0.9), ("min_samples", 8))),
    "curriculum + zero_variance": (
        ({"name": "zero_variance"},),
        (("max_pass_rate", 0.9), ("min_samples", 8)),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--task", default="copy-first-digit-twice")
    parser.add_argument(
        "--digits", type=int, default=None, help="task num_digits (1: ten prompts that recur)"
    )
    args, _ = parser.parse_known_args()
    route = next(r for r in ROUTES if r.name == "decoupled-mis")
    options = (("num_digits", args.digits),) if args.digits is not None else ()
    base = Settings(steps=args.steps, task=args.task, task_options=options)
    jobs = [
        (route, args.staleness, seed, replace(base, operators=ops, curriculum=cur))
        for ops, cur in SETTINGS.values()
        for seed in range(args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        cells: list[CellResult] = list(pool.map(_run, jobs))
    print(f"tiny {args.task} {dict(options)}, staleness {args.staleness}, {args.steps} steps, "
          f"{args.seeds} seeds")  # fmt: skip
    print("| setting | zero-advantage share of trained groups | of generated groups | "
          "generated / trained groups | final reward | CPU s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for i, name in enumerate(SETTINGS):
        mine = cells[i * args.seeds : (i + 1) * args.seeds]
        zero = statistics.fmean(x for c in mine for x in c.zero_adv)
        ratio = sum(sum(c.generated) for c in mine) / (
            len(mine) * args.steps * base.prompts_per_step
        )
        wasted = sum(sum(c.generated_flat) for c in mine) / sum(sum(c.generated) for c in mine)
        final = statistics.fmean(c.final() for c in mine)
        cpu = statistics.fmean(c.cpu_s[-1] for c in mine)
        print(f"| {name} | {zero:.3f} | {wasted:.3f} | {ratio:.2f} | {final:.2f} | {cpu:.0f} |")


if __name__ == "__main__":
    main()
