"""Run the data-operator benchmarks: ``python -m bench.dataops [NAME ...] [--option ...]``
(all when none is named; the options go to each benchmark, which ignores unknown ones)."""

from __future__ import annotations

import sys

from bench.dataops import longtail, sampling, throughput

BENCHMARKS = {"throughput": throughput.main, "sampling": sampling.main, "longtail": longtail.main}


def main() -> None:
    args = sys.argv[1:]
    first_option = next((i for i, a in enumerate(args) if a.startswith("-")), len(args))
    names = args[:first_option] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; known: {sorted(BENCHMARKS)}")
    sys.argv = [sys.argv[0], *args[first_option:]]  # the options, for each benchmark
    for name in names:
        print(f"== {name}", flush=True)
        BENCHMARKS[name]()


if __name__ == "__main__":
    main()
