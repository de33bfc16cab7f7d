"""User stream operators loaded by dotted path in tests."""

from __future__ import annotations

from streams.operators import Drop, Keep


class DropLowMean:
    """Drops groups whose mean reward is below ``threshold``."""

    name = "drop_low_mean"

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = threshold

    def __call__(self, samples):  # type: ignore[no-untyped-def]
        mean = sum(t.reward for t in samples) / len(samples)
        return Drop("low_mean") if mean < self.threshold else Keep(samples)


class Raises:
    name = "raises"

    def __call__(self, samples):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")


class WrongType:
    name = "wrong_type"

    def __call__(self, samples):  # type: ignore[no-untyped-def]
        return list(samples)
