"""Stream processors: rollouts.raw → (validate, staleness, exact old logits, groups) →
rollouts.scored, exactly once.

Reading order: ``config`` (the ``[streams]`` section), ``processor`` (what happens to one
message, pure Python), ``groups`` (table layout, ScoredGroup assembly), ``staleness`` and
``versions`` (the trainer's version), ``snapshots`` and ``oldlogits`` (exact logp_old from
recent versions' weights), ``txn`` (why and how a step commits atomically), ``gaps``
(records Faust skipped), ``topics`` (what the worker creates), ``agent`` (its work per
message), ``worker`` (``StreamWorker``: the Faust app wiring it all; ``app.build_app``
builds it), ``metrics``. ``python -m streams`` runs ``rollstream stream``
(``rollstream.stream_cli``).
"""
