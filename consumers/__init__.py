"""Consumers: the trainer role (``python -m consumers`` / ``rollstream train``).

Modules, in reading order:

- ``config``: ``TrainerConfig``, the ``[trainer]`` section (pydantic, no torch).
- ``loss_config``, ``losses``, ``ewma``: the loss family and the PPO-EWMA
  proximal weights.
- ``batching``: micro-batches of whole groups (group count, token budget, max wait) and
  the response log-prob layout shared with the stream (``core.logprobs``).
- ``train_engine``: the DeepSpeed engine around a transformers causal LM (ZeRO, bf16,
  accumulation, clipping, checkpoints).
- ``step``: one optimiser step, with the per-record anchor (exact ``logp_old`` or the
  approximate route for records without it).
- ``metrics``: per-step metrics to JSONL, Prometheus and a progress line.
- ``source``: reading ``rollouts.scored`` (consumer group, seeks, DLQ, commits).
- ``checkpoint``: checkpoints carrying Kafka offsets, and the training ledger.
- ``weight_publisher``: versions through ``weights`` with retries.
- ``trainer``: the driver loop. ``build_lock`` / ``prebuild``: DeepSpeed's C++ ops, built
  once and safe against a kill -9 while loading them.
- ``__main__``: ``python -m consumers`` runs ``rollstream train``
  (``rollstream.cli.train``).
"""
