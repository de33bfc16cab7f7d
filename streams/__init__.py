"""Stream processors: rollouts.raw → (validate, staleness, exact old logits, groups) →
rollouts.scored, exactly once.

The modules here are the decisions, pure Python (``processor`` is what happens to one
message); ``faust`` is the framework half that applies them to Kafka. ``python -m streams``
runs ``rollstream stream``.
"""
