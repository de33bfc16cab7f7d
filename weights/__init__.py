"""Policy weights across regions: versioned bases and sparse bf16 deltas in S3.

Modules, in reading order: ``manifest`` (what a version is), ``format`` (bit-exact
encoding), ``store`` (the S3 layout), ``writer`` and ``follower`` (the two ends),
``announce`` (Kafka), ``mirror`` and ``retention`` (operating regions), ``config``, ``cli``.
"""
