"""Stream processors: rollouts.raw → (validate, staleness, exact old logits, groups) →
rollouts.scored, exactly once.

Reading order: ``config`` (the ``[streams]`` section), ``processor`` (what happens to one
message, pure Python), ``groups`` (table layout, ScoredGroup assembly), ``staleness`` and
``versions`` (the trainer's version), ``snapshots`` and ``oldlogits`` (exact logp_old from
recent versions' weights), ``txn`` (why and how a step commits atomically), ``gaps``
(records Faust skipped), ``app`` (``build_app``: the Faust worker wiring it all),
``metrics``. ``python -m streams`` runs ``rollstream stream`` (``rollstream.stream_cli``).
"""
