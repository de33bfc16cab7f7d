"""Producers: generate rollouts with a policy version on every token, publish them to Kafka.

Modules, in reading order:

- ``config``: ``ProducersConfig`` (``[engine]``, ``[rollout]`` with its gateway, curriculum
  and episode tables, ``[eval]``), pydantic only.
- ``inference_engine``: the CPU inference engine (torch + transformers): batched, abortable,
  hot-swappable weights, SGLang's log-prob numerics. Its parts: ``engine_requests`` (sampling
  parameters, results, request errors), ``engine_sampling`` (the sampling math),
  ``engine_batch`` and ``engine_kv`` (running a batch, its KV cache), ``engine_weights``
  (weights on disk).
- ``server``: the engine behind the subset of SGLang's native HTTP API that RL needs.
- ``client``: ``EngineClient`` for that API (ours or a real SGLang), responses checked.
- ``tasks``: prompt sources and reward functions (a registry users extend).
- ``backends``: in-process or HTTP engine, one interface for the worker.
- ``ledger``, ``group_publisher``: idempotent Kafka publishing, groups counted only when all G
  records are acknowledged, a crash-safe ledger and its recovery.
- ``worker``: the rollout worker, composed of ``admission`` (when a group may start, the
  trainer's credit), ``versions`` (the weight follower, loading versions between engine
  calls), ``generation`` (samples and episodes) and ``publishing`` (records, publishers,
  ledger marks); ``peers`` holds the other policies an episode calls.
- ``app``: ``run_producer``, which opens, runs and closes everything a worker needs.
- ``metrics``: Prometheus metrics and the terminal progress line.
- ``__main__``: ``python -m producers`` runs ``rollstream produce`` (or ``serve``); the
  commands themselves are ``rollstream.produce_cli``.
"""
