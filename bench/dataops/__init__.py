"""Data-operator benchmarks: ``python -m bench.dataops [throughput|sampling ...]``.

- ``throughput``: stream records/s with the operator chain on vs off, two real workers
  on one broker, rounds interleaved (``bench/dataops/throughput.py``);
- ``sampling``: on the tiny task, the share of trained groups with zero advantage and the
  groups generated per trained group, with and without dynamic sampling
  (``bench/dataops/sampling.py``).
"""
