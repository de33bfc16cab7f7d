"""Run the data-operator benchmarks (all, or those named on the command line)."""

from __future__ import annotations

import sys

from bench.dataops import sampling, throughput

BENCHMARKS = {"throughput": throughput.main, "sampling": sampling.main}


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("-")] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; known: {sorted(BENCHMARKS)}")
    sys.argv = [sys.argv[0], *[a for a in sys.argv[1:] if a.startswith("-")]]
    for name in names:
        print(f"== {name}", flush=True)
        BENCHMARKS[name]()


if __name__ == "__main__":
    main()
