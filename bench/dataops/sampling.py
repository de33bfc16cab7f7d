"""Dynamic sampling on the tiny task: zero-advantage groups trained, with and without.

Runs ``bench.learning`` cells (engine bf16, exact old logits, decoupled MIS, staleness
``--staleness``) for ``--steps`` steps with and without the ``zero_variance`` operator
(groups generated until a step's 16 pass, at most 4x, as DAPO fills its batch). Reports,
per setting and over ``--seeds`` seeds: the share of trained groups whose rewards are all
equal (zero advantage, zero gradient; target 0 with the operator), groups generated per
trained group, final reward and CPU seconds.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from bench.learning import ROUTES, CellResult, Settings, _run

SETTINGS = {
    "off": (),
    "zero_variance": ({"name": "zero_variance"},),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2)
    args, _ = parser.parse_known_args()
    route = next(r for r in ROUTES if r.name == "decoupled-mis")
    base = Settings(steps=args.steps)
    jobs = [
        (route, args.staleness, seed, replace(base, operators=ops))
        for ops in SETTINGS.values()
        for seed in range(args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        cells: list[CellResult] = list(pool.map(_run, jobs))
    print(f"tiny reverse-3-digits, staleness {args.staleness}, {args.steps} steps, "
          f"{args.seeds} seeds")  # fmt: skip
    print("| setting | zero-advantage share of trained groups | generated / trained groups "
          "| final reward | CPU s |")  # fmt: skip
    print("|---|---|---|---|---|")
    for i, name in enumerate(SETTINGS):
        mine = cells[i * args.seeds : (i + 1) * args.seeds]
        zero = statistics.fmean(x for c in mine for x in c.zero_adv)
        ratio = sum(sum(c.generated) for c in mine) / (
            len(mine) * args.steps * base.prompts_per_step
        )
        final = statistics.fmean(c.final() for c in mine)
        cpu = statistics.fmean(c.cpu_s[-1] for c in mine)
        print(f"| {name} | {zero:.3f} | {ratio:.2f} | {final:.2f} | {cpu:.0f} |")


if __name__ == "__main__":
    main()
